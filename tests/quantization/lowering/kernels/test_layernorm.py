"""layernorm_quantize: torch's LayerNorm within one unit in the last place of the output plus float32
rounding of the statistics, and the codes and scales of its output bit-identical to
quantize_per_token's of that output."""

from __future__ import annotations

import pytest
import torch
from compress.quantization.lowering.fused_norm import layernorm_tolerance
from compress.quantization.lowering.kernels import layernorm_quantize
from torch import nn

from compress.core.errors import CompressError
from tests.quantization.lowering.kernels.kernel_cases import assert_codes_match


def _norm(k: int, dtype: torch.dtype, device: str, *, bias: bool = True, affine: bool = True,
          seed: int = 0) -> nn.LayerNorm:
    torch.manual_seed(seed)
    n = nn.LayerNorm(k, eps=1e-5, bias=bias, elementwise_affine=affine)
    if affine:  # ones and zeros would hide a wrong formula
        nn.init.normal_(n.weight, mean=1.0, std=0.5)
        if bias:
            nn.init.normal_(n.bias, mean=0.0, std=0.5)
    return n.to(device=device, dtype=dtype)


def _x(shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # row magnitudes differ, and rows sit off zero (a mean to subtract): 0.01..100 times N(3, 1)
    x = (torch.randn(shape, generator=g) + 3.0) * torch.logspace(-2, 2, shape[-2]).reshape(-1, 1)
    return x.to(device=device, dtype=dtype)


def bound(x: torch.Tensor, norm: nn.LayerNorm, ref: torch.Tensor) -> torch.Tensor:
    """The bound fused_norm.layernorm_tolerance states (and the conversion's proof uses): one unit in
    the last place of the output plus 16 float32 ulps of the terms (the mean's error times |w| r,
    the bias)."""
    return layernorm_tolerance(x, norm.weight, norm.bias, norm.eps, ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(2, 9, 70), (5, 768), (3, 17000)], ids=["3d-k70", "2d-k768", "long-rows"])
@pytest.mark.parametrize("form", ["affine", "no-bias", "no-affine"])
def test_norm_matches_torch_layernorm(shape: tuple[int, ...], dtype: torch.dtype, form: str, device: str) -> None:
    norm = _norm(shape[-1], dtype, device, bias=form == "affine", affine=form != "no-affine")
    x = _x(shape, dtype, device)
    y, q, s = layernorm_quantize(x, norm.weight, norm.bias, norm.eps, codes=False)
    with torch.no_grad():
        ref = norm(x)
    assert q is None and s is None and y.shape == ref.shape and y.dtype == ref.dtype == dtype
    assert bool(((y.double() - ref.double()).abs() <= bound(x, norm, ref)).all())
    if dtype != torch.float32:  # and the rounding flips rarely: almost every element is the same bits
        assert (y != ref).float().mean().item() < 0.01


def test_a_wrong_formula_breaks_the_bound(device: str) -> None:
    # the bound is tight enough to tell an unbiased variance (N-1) from torch's biased one at K=768
    norm = _norm(768, torch.float16, device)
    x = _x((4, 768), torch.float16, device)
    y, _, _ = layernorm_quantize(x, norm.weight, norm.bias, norm.eps, codes=False)
    with torch.no_grad():
        xf = x.double()
        unbiased = ((xf - xf.mean(-1, keepdim=True)) / (xf.var(-1, keepdim=True) + norm.eps).sqrt()
                    * norm.weight.double() + norm.bias.double())
    assert not bool(((y.double() - unbiased).abs() <= bound(x, norm, y)).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fp8", [False, True], ids=["int8", "fp8"])
@pytest.mark.parametrize("smooth", [False, True], ids=["plain", "pre_scale"])
@pytest.mark.parametrize("k", [200, 17000], ids=["k200", "long-rows"])
def test_codes_are_quantize_per_token_of_the_output(dtype: torch.dtype, fp8: bool, smooth: bool, k: int,
                                                    device: str) -> None:
    norm = _norm(k, dtype, device, bias=not smooth, seed=2)
    x = _x((3, 4, k), dtype, device, seed=3)
    pqs = (torch.rand(k, generator=torch.Generator().manual_seed(4)) * 3 + 0.2).to(device) if smooth else None
    qmin, qmax = (-127, 127) if not fp8 else (-128, 127)  # a narrow int8 range is passed through
    y, q, s = layernorm_quantize(x, norm.weight, norm.bias, norm.eps, qmin=qmin, qmax=qmax, pre_scale=pqs, fp8=fp8)
    assert_codes_match(y, q, s, rows=12, k=k, qmin=qmin, qmax=qmax, pre_scale=pqs, fp8=fp8)


def test_output_dtype_is_the_input_dtype_like_torch(device: str) -> None:
    # a float32 weight and bias read with fp16 activations: torch's layer_norm returns fp16 (on the
    # CPU; CUDA's refuses the mixed dtypes, so the reference is computed there)
    norm = _norm(96, torch.float32, device, seed=5)
    x = _x((4, 96), torch.float16, device, seed=6)
    y, _, _ = layernorm_quantize(x, norm.weight, norm.bias, norm.eps, codes=False)
    ref = torch.nn.functional.layer_norm(x.cpu(), (96,), norm.weight.detach().cpu(), norm.bias.detach().cpu(),
                                         norm.eps).to(device)
    assert y.dtype == ref.dtype == torch.float16
    assert bool(((y.double() - ref.double()).abs() <= bound(x, norm, ref)).all())


def test_bad_inputs_raise(device: str) -> None:
    x = torch.randn(2, 16, device=device)
    with pytest.raises(CompressError, match="weight of shape"):
        layernorm_quantize(x, torch.ones(15, device=device), None, 1e-5)
    with pytest.raises(CompressError, match="bias of shape"):
        layernorm_quantize(x, None, torch.ones(2, 8, device=device), 1e-5)
    with pytest.raises(CompressError, match="float bias"):
        layernorm_quantize(x, None, torch.ones(16, dtype=torch.int32, device=device), 1e-5)
    with pytest.raises(CompressError, match="symmetric int8 range"):
        layernorm_quantize(x, None, None, 1e-5, qmin=0, qmax=255)
    with pytest.raises(CompressError, match="float input"):
        layernorm_quantize(x.to(torch.int32), None, None, 1e-5)
