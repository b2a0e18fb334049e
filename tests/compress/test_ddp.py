"""DistributedDataParallel: 2 CPU processes under torchrun match a single-process run, export and
validation included: rank 0 alone exports, validates and checks thresholds; one summary, one report."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

RECIPE = {
    "version": 1,
    "name": "ddp",
    # no BatchNorm: per-rank batch statistics would differ from the single-process ones by design
    "model": {"name": "mlp", "kwargs": {"hidden": 32, "depth": 1, "num_classes": 10, "in_features": 64}},
    "data": {"source": "digits", "calibration_samples": 32},
    "train": {"epochs": 3, "batch_size": 32, "lr": 0.2, "momentum": 0.0, "weight_decay": 0.0, "seed": 3,
              "device": "cpu"},
    "stages": [{"name": "ptq", "modifiers": [{"type": "ptq", "scheme": "w8a8"}]}],
    "validate": {"batch_sizes": [1], "warmup": 1, "runs": 3,
                 "thresholds": {"min_top1_agreement": 0.9, "max_accuracy_drop": 0.05}},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(tmp: Path, nproc: int) -> tuple[dict, dict, str]:
    recipe = tmp / "r.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE))
    out = tmp / f"out{nproc}"
    if nproc == 1:
        # the single-process reference runs in this process (one torch thread, as the conftest sets):
        # what `compress apply` does without torchrun, less a fresh interpreter's imports and first
        # export; the CLI's exit code 0 is "no threshold missed", checked here on the report
        import compress

        rep = compress.apply(compress.load_recipe(recipe), out_dir=out, quiet=True)
        assert all(t.passed for t in rep.thresholds), rep.thresholds
        stdout = ""
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               "--master_addr=127.0.0.1", f"--master_port={_free_port()}",
               "-m", "compress.cli", "apply", str(recipe), "--out", str(out)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        stdout = proc.stdout
        # the console speaks for rank 0 alone; every rank keeps its own log in the run folder
        assert proc.stderr.count("baseline epoch 1/3") == 1, proc.stderr[-3000:]
        assert "baseline epoch 1/3" in (out / "run.log").read_text()
        assert "baseline epoch 1/3" in (out / "run.rank1.log").read_text()
    report = json.loads((out / "report.json").read_text())
    state = torch.load(out / "checkpoints" / "baseline.pt", weights_only=True)["model"]
    assert sorted(p.name for p in (out / "export").iterdir()) == ["ddp.fp32.onnx", "ddp.int8.onnx"]
    return report, state, stdout


@pytest.mark.slow  # 38 s in a full run: a 2-process run and a 1-process run end to end
def test_two_process_ddp_matches_single_process(tmp_path: Path) -> None:
    single, w1, _ = _run(tmp_path, 1)
    ddp, w2, stdout = _run(tmp_path, 2)
    # one summary (rank 0's), one verdict from rank 0's records
    assert stdout.count("ddp: baseline") == 1, stdout
    assert [(v["runtime"], v["role"]) for v in ddp["validation"]] == [("onnxruntime", "final"),
                                                                      ("onnxruntime", "baseline")]
    assert {t["name"]: t["passed"] for t in ddp["thresholds"]} == {"max_accuracy_drop": True,
                                                                   "min_top1_agreement": True}
    assert abs(ddp["final"]["accuracy"] - single["final"]["accuracy"]) <= 0.03
    # both trained (so the weight comparison is not between two untouched initializations)
    assert single["baseline"]["accuracy"] > 0.85, single["baseline"]
    assert ddp["baseline"]["accuracy"] > 0.85, ddp["baseline"]
    assert abs(ddp["baseline"]["accuracy"] - single["baseline"]["accuracy"]) <= 0.02
    # same samples per step, gradients averaged over ranks: weights agree up to the padded last batch
    for k in w1:
        rel = (w1[k] - w2[k]).norm() / w1[k].norm()
        assert rel < 0.02, (k, float(rel))
