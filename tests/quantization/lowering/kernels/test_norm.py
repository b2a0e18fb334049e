"""rmsnorm_quantize: transformers' LlamaRMSNorm within a unit in the last place, and the codes and
scales of its output bit-identical to quantize_per_token's of that output."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from compress.quantization.lowering.kernels import rmsnorm_quantize  # noqa: E402

from compress.core.errors import CompressError  # noqa: E402
from tests.quantization.lowering.kernels.kernel_cases import assert_codes_match  # noqa: E402


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
    assert_codes_match(y, q, s, rows=12, k=k, qmin=qmin, qmax=qmax, pre_scale=pqs, fp8=fp8)


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


def test_kernel_compiles_for_hopper_without_a_gpu() -> None:
    # Triton compiles to PTX and cubin without a device: the CUDA path (not the interpreter's) builds,
    # for int8 and fp8 codes, SmoothQuant's pre-scale, bf16, a wider output dtype and long rows, RMSNorm
    # and LayerNorm (with and without weight and bias)
    code = """
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from compress.quantization.lowering.kernels import norm as k

        def build(x="fp16", y="fp16", single=True, codes=True, pqs=False, fp8=False, layer=False, w=True, b=False):
            names = list(k._norm_quant_kernel.arg_names)
            const = {"QMIN": -448.0 if fp8 else -128, "QMAX": 448.0 if fp8 else 127.0, "QEPS": 1.1920928955078125e-07,
                     "BLOCK_K": 4096, "SINGLE": single, "CODES": codes, "HAS_PQS": pqs, "FP8": fp8,
                     "X_BF16": x == "bf16", "Y_BF16": y == "bf16", "LAYER": layer, "HAS_W": w, "HAS_B": b}
            ptrs = {"x_ptr": "*" + x, "w_ptr": "*" + y, "b_ptr": "*" + y, "y_ptr": "*" + y, "q_ptr": "*fp8e4nv" if fp8 else "*i8",
                    "scale_ptr": "*fp32", "pqs_ptr": "*fp32"}
            sig = {n: ptrs.get(n, "constexpr" if n in const else "fp32" if n == "eps" else "i32") for n in names}
            src = ASTSource(fn=k._norm_quant_kernel, signature=sig,
                            constexprs={(names.index(c),): v for c, v in const.items()})
            return len(triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["cubin"])

        sizes = [build(), build(x="bf16", y="bf16", pqs=True, fp8=True), build(y="fp32", pqs=True),
                 build(single=False), build(codes=False), build(layer=True, b=True),
                 build(x="bf16", y="bf16", layer=True, w=False, fp8=True, pqs=True), build(layer=True, single=False, b=True)]
        print("OK", all(s > 0 for s in sizes))
    """
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                       timeout=240, cwd=Path(__file__).resolve().parents[4])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "OK True" in r.stdout
