"""One progress mechanism for every caller (compress.core.progress): a plain Python script with no
logging configured sees a line per decoder layer / epoch on stderr; ``progress=False`` silences it;
logging the caller configured is used alone (no line twice); under torchrun only rank 0 speaks.

Each case runs in a fresh interpreter: logging must start unconfigured, as a user's script does
(inside pytest the root logger always has pytest's handlers)."""

from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import logging, sys, warnings
    import torch
    warnings.simplefilter("ignore")
    mode = sys.argv[1]
    if mode == "basic":
        logging.basicConfig(level=logging.INFO, format="USER %(name)s: %(message)s")
    import compress
    torch.manual_seed(0)
    if mode in ("default", "off", "basic", "rank1", "late"):
        from transformers import LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
        data = [torch.randint(0, 128, (2, 16)) for _ in range(3)]
        compress.gptq(LlamaForCausalLM(cfg).eval(), data, scheme="w4_weight_only", progress=mode != "off", ignore=["lm_head"])
        if mode == "off":  # silent for the call only: a later call speaks again
            from compress.core.progress import enabled
            assert enabled()
        if mode == "late":  # the caller configures logging after a first call: theirs alone from now on
            logging.basicConfig(level=logging.INFO, format="USER %(name)s: %(message)s")
            compress.gptq(LlamaForCausalLM(cfg).eval(), data, scheme="w4_weight_only", ignore=["lm_head"])
    elif mode in ("train", "train_off"):
        from torch import nn
        from torch.utils.data import DataLoader, TensorDataset
        from compress.core.progress import scope
        from compress.recipe import TrainSpec
        x = torch.randn(64, 6)
        loader = DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=16)
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
        with scope(mode == "train"):
            compress.Trainer(TrainSpec(lr=0.1, device="cpu")).fit(model, loader, epochs=3)
        compress.quantize(model, "w8a8", [x[:16], x[16:32]], progress=mode == "train")
    print("done")
    """
)


def _run(mode: str, **env: str) -> str:
    full = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env}
    full.pop("RANK", None)
    full.update(env)
    r = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, cwd=ROOT,
                       env=full, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "done", r.stderr[-3000:]
    return r.stderr


def _layer_lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if re.search(r"gptq: layer \d/2 \(7 Linears\)", ln)]


@pytest.mark.slow  # 21 s in a full run: a GPTQ run in a subprocess
def test_python_caller_sees_a_line_per_decoder_layer_without_logging_configured() -> None:
    err = _run("default")
    lines = _layer_lines(err)
    assert [re.findall(r"layer (\d)/2", ln) for ln in lines] == [["1"], ["2"]], err
    assert all(" INFO compress.quantization.algorithms.sequential: gptq: layer" in ln for ln in lines), lines
    assert "ETA" in lines[0] and "error RTN" in lines[0]
    assert "gptq: 14 Linears in 2 layers" in err  # the toolkit's other INFO lines are shown too
    assert "\r" not in err and "%|" not in err, err  # not a terminal: lines, no bar


def test_progress_false_prints_nothing() -> None:
    assert _run("off") == ""


def test_logging_the_caller_configured_is_used_alone() -> None:
    err = _run("basic")
    lines = _layer_lines(err)
    assert len(lines) == 2, err  # once each: not also through the toolkit's own handler
    assert all(ln.startswith("USER compress.quantization.algorithms.sequential: gptq: layer") for ln in lines), lines
    assert len(err.splitlines()) == len(set(err.splitlines())), err


def test_logging_configured_after_a_first_call_takes_over() -> None:
    lines = _layer_lines(_run("late"))
    assert len(lines) == 4, lines
    assert [ln.startswith("USER ") for ln in lines] == [False, False, True, True], lines


def test_only_rank_0_speaks_under_torchrun() -> None:
    assert _layer_lines(_run("rank1", RANK="1")) == []


@pytest.mark.parametrize("on", [True, False])
def test_training_epochs_and_calibration_report_the_same_way(on: bool) -> None:
    err = _run("train" if on else "train_off")
    epochs = [ln for ln in err.splitlines() if re.search(r"train epoch \d/3: loss", ln)]
    if not on:
        assert err == ""
        return
    assert len(epochs) == 3, err
    assert "ETA" in epochs[0]
    assert re.search(r"quantize: calibrated \d+ activation quantizers", err), err


# ---- in process: bars on a terminal only, lines demoted when silenced ---------------------------------


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_only_on_a_terminal_of_rank_0_with_progress_on(monkeypatch: pytest.MonkeyPatch) -> None:
    from tqdm import tqdm

    from compress.core import progress

    items = [1, 2, 3]
    assert progress.bar(items, desc="x") is items  # pytest's stderr is no terminal
    monkeypatch.setattr(sys, "stderr", _Terminal())
    b = progress.bar(items, desc="x", cap=2)
    assert isinstance(b, tqdm) and b.total == 2 and list(b) == items
    assert progress.bar(b, desc="y") is b  # under a bar already: not a second one
    with progress.scope(False):
        assert progress.bar(items, desc="x") is items
        with progress.scope(True):  # off stays off inside
            assert progress.bar(items, desc="x") is items
    progress.show_bars(False)  # the CLI's --quiet
    try:
        assert progress.bar(items, desc="x") is items
    finally:
        progress.show_bars(True)
    monkeypatch.setenv("RANK", "1")
    assert progress.bar(items, desc="x") is items


def test_report_is_info_and_debug_when_silenced(caplog: pytest.LogCaptureFixture) -> None:
    from compress.core import progress

    log = logging.getLogger("compress.test_progress")
    with caplog.at_level(logging.DEBUG, logger="compress"):
        progress.report(log, "layer %d", 1)
        with progress.scope(False):
            progress.report(log, "layer %d", 2)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.INFO, "layer 1"), (logging.DEBUG, "layer 2")]


def test_track_reports_each_tenth(caplog: pytest.LogCaptureFixture) -> None:
    from compress.core import progress

    log = logging.getLogger("compress.test_progress")
    with caplog.at_level(logging.INFO, logger="compress"):
        seen = list(progress.track(list(range(25)), logger=log, desc="sq", unit="group"))
    assert seen == list(range(25))
    done = [int(r.getMessage().split()[1].split("/")[0]) for r in caplog.records]
    assert len(done) == 10 and done[-1] == 25 and done == sorted(done), done
