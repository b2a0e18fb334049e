"""Activation quantization kernels: codes and scales bit-identical to quantization.numerics.primitives."""

from __future__ import annotations

import pytest
import torch
from compress.quantization.lowering.kernels import quantize_per_token, quantize_static
from compress.quantization.numerics.primitives import SCALE_EPS, dynamic_qparams, quantize_codes
from compress.quantization.numerics.spec import QuantSpec

from compress.core.errors import CompressError


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 7, 33), (3, 200), (2, 17000)], ids=["3d", "2d", "long-rows"])
def test_per_token_matches_primitives(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    x.view(-1, shape[-1])[0] = 0  # an all-zero row gets the safe minimum scale
    x.view(-1, shape[-1])[-1, :5] = torch.tensor([0.5, 1.5, -2.5, 2.5, 100.0]).to(dtype)  # exact halves
    spec = QuantSpec(granularity="token", dynamic=True)
    scale, zp = dynamic_qparams(x, spec)
    q, s = quantize_per_token(x.to(device))
    torch.testing.assert_close(s.cpu(), scale.reshape(-1), atol=0, rtol=0)
    torch.testing.assert_close(q.cpu(), quantize_codes(x, scale, zp, spec.qmin, spec.qmax), atol=0, rtol=0)
    assert s[0].item() == pytest.approx(SCALE_EPS)


def test_per_token_narrow_range_and_strided_rows(device: str) -> None:
    g = torch.Generator().manual_seed(1)
    base = torch.randn(9, 80, generator=g)
    x = base[::2, 3:50]  # strided in both dims
    spec = QuantSpec(granularity="token", dynamic=True, narrow_range=True)
    scale, zp = dynamic_qparams(x, spec)
    q, _ = quantize_per_token(x.to(device), qmin=spec.qmin, qmax=spec.qmax)
    torch.testing.assert_close(q.cpu(), quantize_codes(x, scale, zp, spec.qmin, spec.qmax), atol=0, rtol=0)
    assert int(q.min()) >= -127


@pytest.mark.parametrize("channels_last", [False, True])
def test_static_uint8_codes_shifted_into_int8(channels_last: bool, device: str) -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 5, 7, 3, generator=g) * 2
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    scale, zp = torch.tensor(0.017), 131
    ref = quantize_codes(x, scale, torch.tensor(zp), 0, 255).int() - 128
    q = quantize_static(x.to(device), scale=scale, zero_point=zp - 128, qmin=-128, qmax=127)
    assert ref.min() == -128 and ref.max() == 127  # both clamps hit
    torch.testing.assert_close(q.cpu().int(), ref, atol=0, rtol=0)
    assert q.is_contiguous(memory_format=torch.channels_last) == channels_last


def test_static_symmetric_fp16(device: str) -> None:
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(3, 1000, generator=g)).half()
    scale = torch.tensor(0.01)
    q = quantize_static(x.to(device), scale=scale)
    torch.testing.assert_close(q.cpu(), quantize_codes(x, scale, torch.tensor(0), -128, 127), atol=0, rtol=0)


def test_bad_inputs_raise(device: str) -> None:
    with pytest.raises(CompressError, match="float"):
        quantize_per_token(torch.zeros(2, 3, dtype=torch.int8, device=device))
    with pytest.raises(CompressError, match="qmin"):
        quantize_static(torch.zeros(2, 3, device=device), scale=0.1, zero_point=200)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_pre_scale_is_fused_exactly(dtype: torch.dtype, device: str) -> None:
    # SmoothQuant's per-column factor: the kernels must equal quantizing ``x * pqs.to(x.dtype)``
    g = torch.Generator().manual_seed(8)
    x = (torch.randn(6, 37, generator=g) * 2).to(dtype)
    pqs = torch.rand(37, generator=g) * 3 + 0.1
    xs = x * pqs.to(dtype)
    spec = QuantSpec(granularity="token", dynamic=True)
    scale, zp = dynamic_qparams(xs, spec)
    q, s = quantize_per_token(x.to(device), pre_scale=pqs)
    torch.testing.assert_close(s.cpu(), scale.reshape(-1), atol=0, rtol=0)
    torch.testing.assert_close(q.cpu(), quantize_codes(xs, scale, zp, -128, 127), atol=0, rtol=0)
    qs = quantize_static(x.to(device), scale=torch.tensor(0.05), zero_point=-7, pre_scale=pqs)
    ref = quantize_codes(xs, torch.tensor(0.05), torch.tensor(121), 0, 255).int() - 128
    torch.testing.assert_close(qs.cpu().int(), ref, atol=0, rtol=0)
    with pytest.raises(CompressError, match="pre_scale has 5 elements"):
        quantize_per_token(x.to(device), pre_scale=torch.ones(5))
