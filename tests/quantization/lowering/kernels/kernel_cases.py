"""What several kernel test modules share: random or dyadic int4 weights, a W4A16 product on a
device, the check that a fused kernel's codes are quantize_per_token's, a counter of per-token
quantize launches, and a script run for the sm90 compiler in a process without the interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from compress.quantization.lowering.int4 import Int4Weight, pack_nibbles
from compress.quantization.lowering.kernels import load

if TYPE_CHECKING:
    from compress.quantization.lowering.kernels.w4a16 import W4Config

ROOT = Path(__file__).resolve().parents[4]


def int4_weight(n: int, k: int, gs: int, *, asym: bool, g: torch.Generator, dyadic: bool) -> Int4Weight:
    """An int4 ``[n, k]`` weight in groups of ``gs`` (a shorter last one); ``dyadic``: power-of-two
    scales, so with integer x every product and sum is exact in float32."""
    groups = -(-k // gs)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    if dyadic:
        scale = 2.0 ** -torch.randint(2, 7, (n, groups), generator=g).float()
    else:
        scale = torch.rand(n, groups, generator=g) * 0.02 + 1e-3
    zp = torch.randint(0, 16, (n, groups), generator=g, dtype=torch.uint8) if asym else torch.full((n, groups), 8, dtype=torch.uint8)
    return Int4Weight(codes, scale, zp, gs, not asym)


def run_w4a16(x: torch.Tensor, w: Int4Weight, device: str, config: W4Config, **kw: object) -> torch.Tensor:
    """``w4a16_gemm`` of ``x`` and ``w`` on ``device`` with launch ``config``, back on the CPU."""
    from compress.quantization.lowering.kernels import w4a16_gemm  # Triton's modules load with the kernels

    return w4a16_gemm(x.to(device), pack_nibbles(w.codes).to(device), scale=w.scale.to(device), group_size=w.group_size,
                      zero_point=None if w.symmetric else w.zero_point.to(device), config=config, **kw).cpu()  # type: ignore[arg-type]


def compile_without_interpreter(script: str) -> str:
    """Run ``script`` (it compiles kernels for a GPU target and asserts on the code) in a process
    without TRITON_INTERPRET, from the repository root; its stdout. Fails the test on a nonzero exit."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    res = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def assert_codes_match(y: torch.Tensor, q: torch.Tensor | None, s: torch.Tensor | None, *, rows: int, k: int, qmin: int,
                       qmax: int, pre_scale: torch.Tensor | None, fp8: bool) -> None:
    """A fused kernel's codes ``q`` and scales ``s`` of its output ``y`` are ``quantize_per_token(y)``'s,
    bit for bit (fp8 included), in the dtype and ``[rows, k]`` shape asked for."""
    from compress.quantization.lowering.kernels import quantize_per_token

    q_ref, s_ref = quantize_per_token(y, qmin=qmin, qmax=qmax, pre_scale=pre_scale, fp8=fp8)
    assert q is not None and s is not None
    assert q.dtype == (torch.float8_e4m3fn if fp8 else torch.int8) and q.shape == (rows, k)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.int8), q_ref.reshape(rows, k).view(torch.int8))
    if not fp8:
        assert int(q.min()) >= qmin


class QuantizeSpy:
    """Counts the per-token quantize kernel launches (every caller reaches it through load("quant"))."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        quant = load("quant")
        real = quant.quantize_per_token
        self.calls = 0

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(quant, "quantize_per_token", counted)
