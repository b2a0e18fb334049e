"""Statistics are all-reduced across DDP ranks: 2 gloo CPU processes calibrate on different data and
end with the qparams one process gets on all of it; SmoothQuant smooths alike on every rank; QAT
with LSQ trains under DDP."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from compress.quantization import calibrate, input_quantizer, prepare, quantizers
from compress.quantization.algorithms.smoothquant import smooth_quant
from compress.quantization.numerics.spec import QuantScheme, QuantSpec
from torch import nn


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _scheme(observer: str) -> QuantScheme:
    return QuantScheme(inputs=QuantSpec(dtype="uint8", symmetric=False, observer=observer))


def _iq(m: nn.Module) -> Any:
    q = input_quantizer(m, "0")
    assert q is not None
    return q


def _data(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(10 + rank)
    return [torch.randn(8, 16, generator=g) * (1 + 2 * rank) for _ in range(3)]


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        result = {}
        for observer in ("minmax", "percentile"):
            m = _model()
            prepare(m, _scheme(observer))
            calibrate(m, _data(rank))
            result[observer] = {n: q.scale.clone() for n, q in quantizers(m)}
        # SmoothQuant (fixed and auto alpha) on per-rank data: the same smoothing on every rank
        for sq in (0.5, "auto"):
            m = _model()
            prepare(m, QuantScheme(weights=QuantSpec(granularity="channel"), inputs=_scheme("minmax").inputs))
            smooth_quant(m, _data(rank), alpha=sq)
            result[f"sq_{sq}"] = {"w": m[0].weight.detach().clone(), "s": _iq(m).pre_quant_scale.clone()}
        # QAT with LSQ under DDP: scales get averaged gradients and stay identical across ranks
        m = _model()
        prepare(m, _scheme("minmax"))
        calibrate(m, _data(rank))
        for _, q in quantizers(m):
            q.enable_lsq()
        ddp = nn.parallel.DistributedDataParallel(m)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(rank)
        for _ in range(3):
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
        result["lsq"] = {n: q.scale.detach().clone() for n, q in quantizers(m)}
        torch.save(result, Path(out) / f"rank{rank}.pt")
        # both ranks done with every collective before either tears gloo down: a rank that exits
        # while its peer's gloo threads still talk to it aborts the peer (seen once in CI: SIGABRT)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_observers_all_reduce_across_ranks(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{i}.pt", weights_only=True) for i in range(2))
    for observer in ("minmax", "percentile", "lsq", "sq_0.5", "sq_auto"):
        for name in r0[observer]:
            torch.testing.assert_close(r0[observer][name], r1[observer][name], atol=0, rtol=0)
    # minmax over both ranks' data equals one process calibrating on all of it
    m = _model()
    prepare(m, _scheme("minmax"))
    calibrate(m, _data(0) + _data(1))
    for name, q in quantizers(m):
        torch.testing.assert_close(r0["minmax"][name], q.scale, atol=0, rtol=0)
    # and differs from what rank 0 alone would have seen (the reduction did something)
    solo = _model()
    prepare(solo, _scheme("minmax"))
    calibrate(solo, _data(0))
    name0 = next(n for n, q in quantizers(solo) if q is _iq(solo))
    assert not torch.equal(_iq(solo).scale, r0["minmax"][name0])
    assert any(not torch.equal(r0["lsq"][n], r0["minmax"][n]) for n in r0["lsq"])  # LSQ moved the scales
