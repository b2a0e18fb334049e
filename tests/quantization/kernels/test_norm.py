"""rmsnorm_quantize: transformers' LlamaRMSNorm within a unit in the last place, and the codes and
scales of its output bit-identical to quantize_per_token's of that output."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from compress.core.errors import CompressError  # noqa: E402
from quantization.lowering.kernels import quantize_per_token, rmsnorm_quantize  # noqa: E402


def _norm(k: int, dtype: torch.dtype, device: str, seed: int = 0) -> torch.nn.Module:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(seed)
    n = LlamaRMSNorm(k, eps=1e-5)
    torch.nn.init.normal_(n.weight, mean=1.0, std=0.5)
    return n.to(device=device, dtype=dtype)


def _x(shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-2, 2, shape[-2]).reshape(-1, 1)  # row magnitudes differ
    return x.to(device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(2, 9, 70), (5, 576), (3, 17000)], ids=["3d-k70", "2d-k576", "long-rows"])
def test_norm_matches_transformers_llama_rmsnorm(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> None:
    norm = _norm(shape[-1], dtype, device)
    x = _x(shape, dtype, device)
    y, q, s = rmsnorm_quantize(x, norm.weight, norm.variance_epsilon, codes=False)
    with torch.no_grad():
        ref = norm(x)
    assert q is None and s is None and y.shape == ref.shape and y.dtype == ref.dtype
    # The kernel sums x^2 in another order than torch: h may differ by a float32 ulp, which after the
    # cast to 16 bits moves y by at most one unit in its last place (the bound: eps * |y|).
    ulps = 1.0 if dtype != torch.float32 else 8.0
    bound = ulps * torch.finfo(dtype).eps * ref.float().abs() + torch.finfo(dtype).tiny
    assert bool(((y.float() - ref.float()).abs() <= bound).all())
    if dtype != torch.float32:  # and it does so rarely: almost every element is the same bits
        assert (y != ref).float().mean().item() < 0.01


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fp8", [False, True], ids=["int8", "fp8"])
@pytest.mark.parametrize("smooth", [False, True], ids=["plain", "pre_scale"])
@pytest.mark.parametrize("k", [200, 17000], ids=["k200", "long-rows"])
def test_codes_are_quantize_per_token_of_the_output(dtype: torch.dtype, fp8: bool, smooth: bool, k: int,
                                                    device: str) -> None:
    norm = _norm(k, dtype, device, seed=2)
    x = _x((3, 4, k), dtype, device, seed=3)
    pqs = (torch.rand(k, generator=torch.Generator().manual_seed(4)) * 3 + 0.2).to(device) if smooth else None
    qmin, qmax = (-127, 127) if not fp8 else (-128, 127)  # a narrow int8 range is passed through
    y, q, s = rmsnorm_quantize(x, norm.weight, norm.variance_epsilon, qmin=qmin, qmax=qmax, pre_scale=pqs, fp8=fp8)
    q_ref, s_ref = quantize_per_token(y, qmin=qmin, qmax=qmax, pre_scale=pqs, fp8=fp8)
    assert q is not None and s is not None
    assert q.dtype == (torch.float8_e4m3fn if fp8 else torch.int8) and q.shape == (12, k)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.int8), q_ref.reshape(12, k).view(torch.int8))  # the bits, fp8 included
    if not fp8:
        assert int(q.min()) >= -127


def test_weight_dtype_promotes_like_torch(device: str) -> None:
    # an fp32 norm weight read with fp16 activations: torch's weight * h.to(fp16) is float32
    norm = _norm(96, torch.float32, device, seed=5)
    x = _x((4, 96), torch.float16, device, seed=6)
    y, _, _ = rmsnorm_quantize(x, norm.weight, norm.variance_epsilon, codes=False)
    with torch.no_grad():
        ref = norm(x)
    assert y.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(y, ref, rtol=8 * torch.finfo(torch.float32).eps, atol=0)


def test_bad_inputs_raise(device: str) -> None:
    x = torch.randn(2, 16, device=device)
    with pytest.raises(CompressError, match="weight of shape"):
        rmsnorm_quantize(x, torch.ones(15, device=device), 1e-6)
    with pytest.raises(CompressError, match="symmetric int8 range"):
        rmsnorm_quantize(x, torch.ones(16, device=device), 1e-6, qmin=0, qmax=255)
    with pytest.raises(CompressError, match="pre_scale has 3"):
        rmsnorm_quantize(x, torch.ones(16, device=device), 1e-6, pre_scale=torch.ones(3))
