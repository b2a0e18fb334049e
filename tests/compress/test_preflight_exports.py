"""Refusals up front: a recipe whose LLM export cannot take its model stops at ``--dry-run`` (and at
``compress apply`` before the run folder is touched) with the export's own message, naming the recipe
field that asked for the export; the checks read the model's structure only (meta-device models too)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from compress.export.llm.decoder import check_decoder
from compress.export.llm.onnx import export_llm_onnx
from torch import nn

import compress
from compress.cli import main, shipped_recipes
from compress.core.errors import RecipeError, UnsupportedModelError
from compress.recipe import load_recipe
from compress.runner import plan


def _gemma_config(vocab_size: int) -> Any:
    from transformers import GemmaConfig

    return GemmaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128)


def _dynamic_rope_config(vocab_size: int) -> Any:
    """A Llama whose RoPE frequencies change with the sequence length: no fixed graph computes it."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                       rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})


@pytest.fixture(scope="module")
def rope_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Llama with dynamic RoPE (which the generation export refuses) with a BPE tokenizer."""
    from transformers import LlamaForCausalLM

    from compress.data.lm import iter_texts, split_files, train_tokenizer

    out = tmp_path_factory.mktemp("tiny_dynamic_rope")
    tok = train_tokenizer(iter_texts(split_files(0)["train"][:4]), vocab_size=384)
    torch.manual_seed(0)
    LlamaForCausalLM(_dynamic_rope_config(len(tok))).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def _recipe(tmp_path: Path, model_dir: str) -> Path:
    """The shipped GPTQ recipe (export.generation: true) on ``model_dir``, its data shrunk."""
    raw = yaml.safe_load(shipped_recipes()["llm_gptq_w4"].read_text())
    raw["model"]["hf_path"] = model_dir
    raw["data"]["kwargs"] = {"tokenizer": model_dir, "seq_len": 32, "samples": 8}
    raw["data"].update(calibration_samples=8, eval_samples=4, calibration_batch_size=4, eval_batch_size=4)
    assert raw["export"]["generation"] is True
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def _field_line(path: Path) -> int:
    lines = path.read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.strip().startswith("generation:"))


def _decoder_refusal(model: nn.Module) -> str:
    with pytest.raises(UnsupportedModelError) as exc:
        check_decoder(model)
    return str(exc.value)


def test_dry_run_refuses_a_generation_export_the_model_cannot_take(rope_dir: str, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    recipe = _recipe(tmp_path, rope_dir)
    out = tmp_path / "run"
    rc = main(["apply", str(recipe), "--dry-run", "--out", str(out)])
    # (transformers' own "Loading weights" bar may precede it on stderr)
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("compress: error:")]
    assert rc == 2
    assert len(errors) == 1, errors
    err = errors[0]
    # the field that asked for the export, with its file and line, then the export's own words
    assert (f"r.yaml:{_field_line(recipe)}: export.generation: RoPE type 'dynamic' changes with the sequence "
            "length; not exported") in err
    assert not out.exists()


def test_apply_refuses_before_the_run_folder_is_touched(rope_dir: str, tmp_path: Path) -> None:
    recipe = load_recipe(_recipe(tmp_path, rope_dir))
    out = tmp_path / "run"
    with pytest.raises(RecipeError, match=r"export\.generation: RoPE type 'dynamic'"):
        compress.apply(recipe, out_dir=out, quiet=True)
    assert not out.exists()


def test_the_same_recipe_with_the_export_off_passes_dry_run(rope_dir: str, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    recipe = _recipe(tmp_path, rope_dir)
    for flag in ("export.enabled=false", "export.generation=false"):
        rc = main(["apply", str(recipe), "--dry-run", "--set", flag])
        cap = capsys.readouterr()
        assert rc == 0, (flag, cap.err)
        assert "gptq" in cap.out


def test_a_supported_family_passes_dry_run(tiny_llm_dir: str, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["apply", str(_recipe(tmp_path, tiny_llm_dir)), "--dry-run"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert "LlamaForCausalLM" in cap.out


def test_the_export_refuses_in_the_preflight_words(rope_dir: str, tmp_path: Path) -> None:
    from compress.models import load_model

    model = load_model({"hf_path": rope_dir})
    with pytest.raises(UnsupportedModelError) as exc:
        export_llm_onnx(model, tmp_path / "m.onnx", weights="fp32", attention="decomposed", check=False)
    assert not (tmp_path / "m.onnx").exists()
    with pytest.raises(RecipeError) as pre:
        plan(_recipe(tmp_path, rope_dir))
    assert str(pre.value).endswith(f"export.generation: {exc.value}")
    assert str(exc.value) == _decoder_refusal(model)


def test_the_checks_read_structure_only_meta_models_included() -> None:
    """A meta-device model (what a dry run builds from a GGUF file it has not converted) is judged as
    the loaded one: the same refusal for dynamic RoPE; Llama and Gemma pass the generation check, Llama the
    GGUF and compressed-tensors checks, a windowed Qwen2 is refused by GGUF."""
    from compress.export.llm.compressed_tensors import check_compressed_tensors
    from compress.export.llm.gguf_file import check_gguf
    from transformers import GemmaForCausalLM, LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        rope = LlamaForCausalLM(_dynamic_rope_config(384))
        gemma = GemmaForCausalLM(_gemma_config(384))
        llama = LlamaForCausalLM(LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))
    torch.manual_seed(0)
    assert _decoder_refusal(rope) == _decoder_refusal(LlamaForCausalLM(_dynamic_rope_config(384)))
    assert check_decoder(gemma) is gemma.config
    from compress.models.families import tiny_decoder

    with torch.device("meta"):
        qwen2_windowed = tiny_decoder("qwen2")  # llama.cpp's qwen2 has no sliding windows
    with pytest.raises(UnsupportedModelError, match=r"sliding_window=4: llama\.cpp's qwen2 has no sliding-window"):
        check_gguf(qwen2_windowed)
    for check in (check_decoder, check_gguf, check_compressed_tensors):
        assert check(llama) is llama.config


def test_gguf_and_compressed_tensors_writers_refuse_in_their_checks_words(tmp_path: Path) -> None:
    pytest.importorskip("gguf")
    pytest.importorskip("compressed_tensors")
    from compress.export.llm.compressed_tensors import check_compressed_tensors, save_compressed_tensors
    from compress.export.llm.gguf_file import check_gguf, save_gguf

    from compress.models.families import tiny_decoder

    windowed = tiny_decoder("qwen2")  # a sliding window llama.cpp's qwen2 cannot state
    for check, write, model in ((check_gguf, lambda m: save_gguf(m, tmp_path / "m.gguf", tokenizer=None), windowed),
                                (check_compressed_tensors, lambda m: save_compressed_tensors(m, tmp_path / "ct"),
                                 nn.Linear(4, 4))):
        with pytest.raises(UnsupportedModelError) as want:
            check(model)
        with pytest.raises(UnsupportedModelError) as got:
            write(model)
        assert str(got.value) == str(want.value)
    assert not list(tmp_path.iterdir())


def _nvfp4_recipe(tmp_path: Path, model_dir: str, export: dict[str, Any]) -> Path:
    raw = yaml.safe_load(shipped_recipes()["llm_nvfp4"].read_text())
    raw["model"]["hf_path"] = model_dir
    raw["data"]["kwargs"] = {"tokenizer": model_dir, "seq_len": 32, "samples": 8}
    raw["data"].update(calibration_samples=8, eval_samples=4, calibration_batch_size=4, eval_batch_size=4)
    raw["export"] = export
    path = tmp_path / "fp4.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@pytest.mark.parametrize("export", [{"enabled": True}, {"generation": True}], ids=["single-pass", "generation"])
def test_an_fp4_scheme_with_an_onnx_export_is_refused_at_dry_run(export: dict[str, Any], tiny_llm_dir: str,
                                                                 tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    rc = main(["apply", str(_nvfp4_recipe(tmp_path, tiny_llm_dir, export)), "--dry-run", "--out", str(out)])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("compress: error:")]
    assert rc == 2 and len(errors) == 1, errors
    assert "stages.0.modifiers.0.scheme: fp4 (NVFP4/MXFP4) schemes have no ONNX form" in errors[0]
    assert "export.onnx: false and export.compressed_tensors: true" in errors[0]
    assert not out.exists()


def test_export_sections_that_write_nothing_or_generate_without_onnx_are_refused(tiny_llm_dir: str,
                                                                                 tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="onnx: false with compressed_tensors: false writes nothing"):
        load_recipe(_nvfp4_recipe(tmp_path, tiny_llm_dir, {"onnx": False}))
    with pytest.raises(RecipeError, match="generation: true needs onnx: true"):
        load_recipe(_nvfp4_recipe(tmp_path, tiny_llm_dir, {"onnx": False, "compressed_tensors": True,
                                                          "generation": True}))


def test_the_checkpoint_export_runs_the_writer_check_at_dry_run(tmp_path: Path) -> None:
    """export.compressed_tensors asks the writer's structural check up front: a model without a
    transformers config (a zoo CNN) is refused, naming the field."""
    raw = {"version": 1, "name": "ct", "model": {"name": "resnet", "kwargs": {"width": 8, "depth": 1, "num_classes": 10, "in_channels": 1}}, "data": {"source": "digits"},
           "stages": [{"name": "q", "modifiers": [{"type": "ptq", "scheme": "w8a8"}]}],
           "export": {"compressed_tensors": True}}
    path = tmp_path / "ct.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    with pytest.raises(RecipeError, match=r"export\.compressed_tensors: compressed-tensors export needs a transformers model"):
        plan(path)
