"""The sparsegpt and wanda recipe modifiers: refusals naming the recipe line, the order rules
(sparsity before quantization, no structured prune after it), a dry run and a tiny run whose 2:4
zeros survive GPTQ in the next stage."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import compress
from compress.cli import main
from compress.core.errors import RecipeError
from compress.core.sparsity import nm_groups_ok
from compress.recipe import load_recipe


def _write(tmp_path: Path, llm_dir: str, *stages: dict[str, Any]) -> Path:
    raw = {
        "version": 1, "name": "sparse_test", "description": "test",
        "model": {"hf_path": llm_dir},
        "data": {"source": "text_lm", "kwargs": {"tokenizer": llm_dir, "seq_len": 32, "samples": 8},
                 "calibration_samples": 8, "eval_samples": 4, "calibration_batch_size": 4, "eval_batch_size": 4},
        "train": {"epochs": 0, "metric": "perplexity"},
        "stages": list(stages),
        "export": {"enabled": False},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def _line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


@pytest.mark.parametrize(("settings", "message"), [
    ({"sparsity": 1.0}, "sparsity: Input should be less than 1"),
    ({"pattern": "4:2"}, "pattern: N:M keeps N of every M weights: it needs 0 < N < M (got 4:2)"),
    ({"pattern": "2:4", "block_size": 6}, "block_size 6 must be a multiple of the pattern's M (4)"),
])
def test_bad_settings_are_refused_at_their_line(tmp_path: Path, settings: dict[str, Any], message: str) -> None:
    path = _write(tmp_path, "unused", {"name": "s", "modifiers": [{"type": "sparsegpt", **settings}]})
    with pytest.raises(RecipeError) as exc:
        load_recipe(path)
    text = str(exc.value)
    assert message in text and "\n" not in text
    assert f"{path}:" in text and "stages.0.modifiers.0" in text


def test_sparsity_after_quantization_is_refused_naming_the_stage(tmp_path: Path) -> None:
    later = _write(tmp_path, "unused", {"name": "q", "modifiers": [{"type": "gptq", "ignore": ["lm_head"]}]},
                   {"name": "s", "modifiers": [{"type": "wanda", "pattern": "2:4"}]})
    with pytest.raises(RecipeError, match=r"stages\.1\.modifiers\.0.*'sparsify' after 'quantize' .*stages\.0\.modifiers\.0"
                                          r".*sparsity comes before quantization"):
        load_recipe(later)
    same = _write(tmp_path, "unused", {"name": "qs", "modifiers": [{"type": "gptq"}, {"type": "sparsegpt"}]})
    with pytest.raises(RecipeError, match=r"stages\.0\.modifiers\.1.*'sparsify' after 'quantize'"):
        load_recipe(same)
    prune_after = _write(tmp_path, "unused", {"name": "s", "modifiers": [{"type": "sparsegpt"}]},
                         {"name": "p", "modifiers": [{"type": "prune", "ratio": 0.5}]})
    with pytest.raises(RecipeError, match=r"'prune' after 'sparsify'.*structured pruning after weight sparsity"):
        load_recipe(prune_after)
    # the right order loads
    load_recipe(_write(tmp_path, "unused", {"name": "s", "modifiers": [{"type": "sparsegpt", "pattern": "2:4"},
                                                                      {"type": "gptq", "ignore": ["lm_head"]}]}))


def test_a_pattern_the_model_cannot_take_is_refused_by_the_dry_run(
        tiny_llm_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, tiny_llm_dir, {"name": "s", "modifiers": [{"type": "wanda", "pattern": "3:7"}]})
    assert main(["apply", str(path), "--dry-run"]) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "Loading weights" not in line]
    assert len(err) == 1 and "pattern: 3:7 needs each Linear's input width divisible by 7" in err[0], err
    assert f"{path}:{_line_of(path, 'type: wanda')}" in err[0] and "stages.0.modifiers.0" in err[0], err


def test_dry_run_then_a_tiny_run_sparsegpt_then_gptq(tiny_llm_dir: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, tiny_llm_dir,
                  {"name": "sparse", "modifiers": [{"type": "sparsegpt", "pattern": "2:4"}]},
                  {"name": "w4", "modifiers": [{"type": "gptq", "scheme": "w4_weight_only_g128", "ignore": ["lm_head"]}]})
    assert main(["apply", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "sparsegpt: model.layers.0.self_attn.q_proj" in out and "lm_head" not in out.split("sparsegpt:")[1].split("\n")[0]
    report = compress.apply(load_recipe(path), out_dir=tmp_path / "run", quiet=True)
    sparse = report.stages[0].metrics
    assert sparse["sparse_linears"] == 14 and sparse["sparsity"] == pytest.approx(0.5, abs=1e-3)
    assert report.final.accuracy is not None and report.baseline.accuracy is not None  # perplexity, here
    state = torch.load(tmp_path / "run" / "checkpoints" / "final.pt", weights_only=True)["model"]
    weights = {k: v for k, v in state.items() if k.endswith("proj.weight") and ".layers." in k}
    assert len(weights) == 14
    for k, w in weights.items():  # GPTQ's rounding kept every zero: at most 2 of every 4 are non-zero
        assert nm_groups_ok(w, 2, 4), k
    # the saved run restores (the masks come back from the zeros)
    from compress.state import restore_compressed

    model = restore_compressed(lambda: compress.load_model({"hf_path": tiny_llm_dir}), tmp_path / "run" / "checkpoints" / "final.pt")
    q = model.get_submodule("model.layers.0.self_attn.q_proj")
    assert torch.equal(q._buffers["weight_mask"], q.weight != 0)
