"""Distillation under DistributedDataParallel: two gloo processes on CPU."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

WORKER = Path(__file__).with_name("ddp_worker.py")
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_adapters_and_student_stay_identical_across_ranks(tmp_path: Path) -> None:
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {
            **os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(tmp_path)], env=env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out.decode()[-2000:]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2))
    # adapters were broadcast from rank 0, then trained on averaged gradients: the same on both ranks
    for a0, a1 in zip(r0["adapter0"], r1["adapter0"]):
        assert torch.equal(a0, a1)
    for a0, a1, init in zip(r0["adapter"], r1["adapter"], r0["adapter0"]):
        assert torch.allclose(a0, a1, atol=1e-6)
        assert not torch.equal(a0, init)  # and they did train
    for k, v in r0["student"].items():
        assert torch.allclose(v, r1["student"][k], atol=1e-6), k
    # a teacher trained by the recipe on per-rank shards is the same teacher on every rank
    for k, v in r0["trained_teacher"].items():
        assert torch.allclose(v, r1["trained_teacher"][k], atol=1e-6), k
