"""Faults: a run SIGKILLed during training, export or validation, then resumed.

The killed run leaves no report (report.json, written last, marks a complete run); ``--resume``
finishes it; no temp file of an interrupted write survives; the recipe file (the input) is untouched.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import compress
from compress.core.errors import RecipeError

ROOT = Path(__file__).resolve().parents[2]
RECIPE = {
    "version": 1, "name": "fault",
    "model": {"name": "mlp", "kwargs": {"hidden": 32, "depth": 1, "num_classes": 10, "in_features": 64}},
    "data": {"source": "digits", "calibration_samples": 32, "eval_samples": 64},
    "train": {"epochs": 3, "batch_size": 64, "lr": 0.1, "seed": 0, "device": "cpu"},
    "stages": [{"name": "ptq", "modifiers": [{"type": "ptq", "scheme": "w8a8"}]}],
    "export": {"baseline": False},  # one export per run keeps each phase a few seconds
    "validate": {"batch_sizes": [1], "warmup": 0, "runs": 2, "thresholds": {"max_accuracy_drop": 0.1}},
}

# each phase patches one step of the run to SIGKILL the process in the middle of it
_DRIVER = """
import os, signal, sys
from pathlib import Path
phase, recipe, out = sys.argv[1:4]
def die():
    os.kill(os.getpid(), signal.SIGKILL)
import compress.runner as runner
if phase == "train":  # after epoch 1's checkpoint, inside epoch 2
    save = runner.save_checkpoint
    def save_then_die(path, model, opt, epoch):
        save(path, model, opt, epoch)
        if path.name == "baseline_last.pt" and epoch == 1:
            Path(str(path) + ".tmp").write_bytes(b"half a checkpoint")  # an interrupted write
            die()
    runner.save_checkpoint = save_then_die
elif phase == "export":  # the int8 file half-written
    import compress.export.pipeline as pipeline
    def export_then_die(model, example, path, options):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        (Path(path).parent / ("." + Path(path).name + ".x.tmp")).write_bytes(b"half an onnx file")
        die()
    pipeline.write_onnx = export_then_die
elif phase == "validate":  # accuracy measured, latency being timed
    import compress.export.validation.measure as validate
    def time_then_die(*a, **k):
        die()
    validate.time_side_by_side = time_then_die
from compress.cli import main
sys.exit(main(["apply", recipe, "--out", out, "--quiet"]))
"""


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("phase", [pytest.param("train", marks=pytest.mark.slow),  # 23 s in a full run
                                   "export", "validate"])
def test_a_killed_run_resumes_to_a_complete_one(phase: str, tmp_path: Path) -> None:
    recipe = tmp_path / "fault.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE, sort_keys=False))
    before = (_digest(recipe), recipe.stat().st_mtime_ns)
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", _DRIVER, phase, str(recipe), str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert not (out / "report.json").exists()  # a killed run never looks complete
    if phase != "validate":
        assert list(out.rglob("*.tmp")), "the kill was meant to interrupt a write"

    report = compress.apply(recipe, out_dir=out, resume=True, quiet=True)
    assert report.error is None and report.passed
    saved = json.loads((out / "report.json").read_text())
    assert saved["error"] is None and [v["role"] for v in saved["validation"]] == ["final"]
    assert [p.name for p in (out / "export").iterdir()] == ["fault.int8.onnx"]
    assert not list(out.rglob("*.tmp")) and not list(out.rglob(".*.tmp"))
    assert (_digest(recipe), recipe.stat().st_mtime_ns) == before
    if phase == "train":  # resumed from epoch 1's checkpoint, not from scratch
        assert "resumed baseline training at epoch 1" in (out / "run.log").read_text()


def test_resume_refuses_a_different_recipe(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "recipe.yaml").write_text(compress.load_recipe(RECIPE).to_yaml())
    other = {**RECIPE, "train": {**RECIPE["train"], "epochs": 5}}
    with pytest.raises(RecipeError, match=r"--resume: the recipe differs .* in train"):
        compress.apply(other, out_dir=out, resume=True, quiet=True)
