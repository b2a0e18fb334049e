"""W4A16 on tensor cores with the scale on the accumulator (kernels/w4a16_mma.py): the codes made
floats by their exponent bits, split K summed in one kernel in split order, and the refusals."""

from __future__ import annotations

import pytest
import torch
from compress.quantization.lowering.int4 import dequantize_int4
from compress.quantization.lowering.kernels.w4a16 import W4Config

from compress.core.errors import CompressError
from tests.quantization.lowering.kernels.kernel_cases import (
    compile_without_interpreter,
    int4_weight,
    run_w4a16,
)

# (M, N, K, group): decode rows; K=80 with group 32 is ragged (a shorter last group, K-tile masked);
# M=20 takes 32-row tiles
SHAPES = [(1, 40, 128, 32), (5, 33, 80, 32), (16, 64, 128, 64), (20, 48, 256, 128)]
CONFIGS = {
    "whole-k": W4Config(16, 32, 32, num_stages=2, scaled_acc=True),
    "split3-prefetch": W4Config(16, 16, 32, num_stages=2, split_k=3, prefetch=True, scaled_acc=True),
}


def _tile_rows(m: int) -> int:
    return 16 if m <= 16 else 32


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("asym", [False, True], ids=["sym", "asym"])
@pytest.mark.parametrize("mnkg", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_dyadic_product_is_bit_exact(mnkg: tuple[int, int, int, int], asym: bool, dtype: torch.dtype, config: str,
                                     device: str) -> None:
    # integer activations, power-of-two scales: each code minus its zero point must come out exact
    # (the exponent-bits conversion), and the split partials must all be added: then y is exact
    m, n, k, gs = mnkg
    g = torch.Generator().manual_seed(m * 100 + n + k + asym)
    w = int4_weight(n, k, gs, asym=asym, g=g, dyadic=True)
    x = torch.randint(-4, 5, (m, k), generator=g).to(dtype)
    bias = torch.randint(-8, 8, (n,), generator=g).float() / 4
    base = CONFIGS[config]
    cfg = W4Config(_tile_rows(m), base.block_n, base.block_k, num_stages=base.num_stages, split_k=base.split_k,
                   prefetch=base.prefetch, scaled_acc=True)
    y = run_w4a16(x, w, device, cfg, bias=bias)
    ref = (x.double() @ dequantize_int4(w).double().T + bias.double()).to(dtype)
    assert ref.float().abs().max() > 1
    torch.testing.assert_close(y, ref, atol=0, rtol=0)
    # the split's tile counters were re-zeroed by the last split: a second call sums the same way
    torch.testing.assert_close(run_w4a16(x, w, device, cfg, bias=bias), y, atol=0, rtol=0)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_random_product_is_the_exact_int4_weights(config: str, device: str) -> None:
    # unlike the dequantizing kernels, the weight is not rounded to fp16: the error against the
    # float64 product of the float32 int4 weight is float32 summation (per tile, then one scaled add
    # per tile: gamma_(K + tiles)) plus the output's rounding to fp16
    m, n, k, gs = 3, 40, 256, 64
    g = torch.Generator().manual_seed(7)
    w = int4_weight(n, k, gs, asym=True, g=g, dyadic=False)
    x = torch.randn(m, k, generator=g).half()
    y = run_w4a16(x, w, device, CONFIGS[config]).double()
    wd = dequantize_int4(w).double()
    exact = x.double() @ wd.T
    u, steps = 2.0**-24, k + k // 32 + 2
    bound = steps * u / (1 - steps * u) * (x.double().abs() @ wd.abs().T) + exact.abs() * 2.0**-11
    assert bool(((y - exact).abs() <= bound).all())
    # the fp16-rounded weight is further from the exact product on these values than ours
    rounded = x.double() @ dequantize_int4(w).half().double().T
    assert (rounded - exact).abs().max() > 0


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_fused_activation_after_the_split_sum(activation: str, device: str) -> None:
    g = torch.Generator().manual_seed(4)
    w = int4_weight(20, 128, 32, asym=False, g=g, dyadic=False)
    x = torch.randn(3, 128, generator=g).half()
    bias = torch.randn(20, generator=g)
    y = run_w4a16(x, w, device, CONFIGS["split3-prefetch"], bias=bias, activation=activation).float()
    ref = torch.nn.functional.linear(x.float(), dequantize_int4(w), bias)
    ref = torch.relu(ref) if activation == "relu" else torch.nn.functional.gelu(ref)
    torch.testing.assert_close(y, ref, atol=2e-3, rtol=2e-3)


def test_refusals_name_what_does_not_fit(device: str) -> None:
    g = torch.Generator().manual_seed(0)
    w = int4_weight(16, 96, 48, asym=False, g=g, dyadic=False)  # group 48: no K-tile of 32+ inside one group
    x = torch.randn(2, 96, generator=g).half()
    with pytest.raises(CompressError, match=r"scaled_acc tiles need .* group 48"):
        run_w4a16(x, w, device, W4Config(16, 16, 32, scaled_acc=True))
    w = int4_weight(16, 64, 32, asym=False, g=g, dyadic=False)
    with pytest.raises(CompressError, match=r"scaled_acc tiles need .*float32"):
        run_w4a16(torch.randn(2, 64, generator=g), w, device, W4Config(16, 16, 32, scaled_acc=True))
    with pytest.raises(CompressError, match=r"scaled_acc tiles need .*block 4x32"):
        run_w4a16(torch.randn(2, 64, generator=g).half(), w, device, W4Config(4, 16, 32, scaled_acc=True))


def test_tuner_times_the_scaled_tiles_only_where_theyrun_w4a16() -> None:
    from compress.quantization.lowering.kernels import w4a16 as k4

    def scaled(m: int, dtype: torch.dtype, gs: int = 128, tile_in_group: bool = True) -> list[W4Config]:
        return [c for c in k4._scaled_acc_candidates(m, 4096, 4096, gs, tile_in_group, dtype, 132)]

    assert scaled(1, torch.float16) and all(c.block_m == 16 and c.scaled_acc for c in scaled(1, torch.float16))
    assert {c.block_k for c in scaled(1, torch.bfloat16)} == {64, 128}
    assert {c.block_k for c in scaled(4, torch.float16, gs=64)} == {64}
    assert not scaled(1, torch.float32)  # fp32 activations: no fp32 tensor-core path for the codes
    assert not scaled(1, torch.float16, tile_in_group=False)  # act_order's g_idx
    assert not scaled(64, torch.float16)  # prefill dequantizes once for cuBLAS
    assert all(c.block_m == 32 for c in scaled(20, torch.float16))


COMPILE_SCRIPT = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from compress.quantization.lowering.kernels import load
load("w4a16")
from compress.quantization.lowering.kernels import w4a16_mma as k

names = list(k._w4a16_mma_kernel.arg_names)
for x, split, prefetch, zp in (("fp16", False, False, False), ("bf16", True, True, True), ("fp16", True, False, True)):
    const = {"HAS_ZP": zp, "HAS_BIAS": True, "ACT": 2, "X_KIND": {"fp16": 1, "bf16": 2}[x], "INTERP_BF16": False,
             "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT": 4 if split else 1, "EVEN_K": True,
             "PREFETCH": prefetch}
    ptrs = {"x_ptr": f"*{x}", "w_ptr": "*u8", "s_ptr": "*fp32", "z_ptr": "*u8", "bias_ptr": "*fp32", "y_ptr": f"*{x}",
            "ws_ptr": "*fp32", "cnt_ptr": "*i32"}
    sig = {n: ptrs.get(n, "constexpr" if n in const else "i32") for n in names}
    src = ASTSource(fn=k._w4a16_mma_kernel, signature=sig, constexprs={(names.index(c),): v for c, v in const.items()})
    kern = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 2 if prefetch else 4})
    ptx = kern.asm["ptx"]
    # tensor cores on the codes, and no int-to-float conversion per weight: the codes become floats
    # by their exponent bits. What converts is per row (a zero point): each thread holds 64 weights
    # of a 64x128 tile (128 threads), the dequantizing kernel converts each of them
    import re
    assert "mma.sync" in ptx, "no tensor-core MMA"
    int_to_float = re.findall(r"cvt\.rn\.(?:f16|bf16|f32)(?:x2)?\.[su](?:8|16|32|64)", ptx)
    assert len(int_to_float) <= 8, int_to_float
    print("compiled", x, split, prefetch, zp)
'''


def test_compiles_for_sm90_with_mma_and_no_weight_conversions() -> None:
    assert compile_without_interpreter(COMPILE_SCRIPT).count("compiled") == 3
