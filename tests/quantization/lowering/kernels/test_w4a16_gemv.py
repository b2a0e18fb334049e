"""W4A16 decode on the CUDA cores, on the codes (kernels/w4a16_gemv.py): codes made floats by their
exponent bits at five nibble positions, the group scale on each group's sum, split K summed in one
kernel, and the refusals."""

from __future__ import annotations

import pytest
import torch
from compress.quantization.lowering.int4 import Int4Weight, dequantize_int4, pack_nibbles
from compress.quantization.lowering.kernels.w4a16 import W4Config

from compress.core.errors import CompressError
from tests.quantization.lowering.kernels.kernel_cases import (
    compile_without_interpreter,
    int4_weight,
    run_w4a16,
)

# (M, N, K, group): K=80 with group 16 is ragged (a shorter last group; K-tiles past the last group);
# K=576 with group 128 is SmolLM2's hidden width (a 64-wide last group)
SHAPES = [(1, 40, 128, 32), (3, 33, 80, 16), (2, 64, 576, 128), (4, 24, 256, 64)]
CONFIGS = {
    # K-tile inside one group, whole K per program
    "in-group": W4Config(1, 32, 16, gemv=True),
    # K-tile of several groups (where the group is smaller), split 3 with prefetch
    "multi-group-split3": W4Config(1, 16, 64, split_k=3, prefetch=True, gemv=True),
}


def _for(m: int, gs: int, base: W4Config) -> W4Config:
    # rows of the tile: M rounded up to a power of two; the K-tile never wider than 4 groups here
    bk = min(base.block_k, 4 * gs) if base.block_k > gs else base.block_k
    return W4Config(1 if m == 1 else 4 if m > 2 else 2, base.block_n, bk, split_k=base.split_k, prefetch=base.prefetch,
                    gemv=True)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("asym", [False, True], ids=["sym", "asym"])
@pytest.mark.parametrize("mnkg", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_dyadic_product_is_bit_exact(mnkg: tuple[int, int, int, int], asym: bool, dtype: torch.dtype, config: str,
                                     device: str) -> None:
    # integer activations, power-of-two scales: every code at every nibble position minus its zero
    # point must come out exact, x's power-of-two prescale too, and every split's partial must be
    # added: then y is exact
    m, n, k, gs = mnkg
    g = torch.Generator().manual_seed(m * 100 + n + k + asym)
    w = int4_weight(n, k, gs, asym=asym, g=g, dyadic=True)
    x = torch.randint(-4, 5, (m, k), generator=g).to(dtype)
    bias = torch.randint(-8, 8, (n,), generator=g).float() / 4
    cfg = _for(m, gs, CONFIGS[config])
    y = run_w4a16(x, w, device, cfg, bias=bias)
    ref = (x.double() @ dequantize_int4(w).double().T + bias.double()).to(dtype)
    assert ref.float().abs().max() > 1
    torch.testing.assert_close(y, ref, atol=0, rtol=0)
    # the split's tile counters were re-zeroed by the last split: a second call sums the same way
    torch.testing.assert_close(run_w4a16(x, w, device, cfg, bias=bias), y, atol=0, rtol=0)


def test_every_nibble_position_is_its_own_feature(device: str) -> None:
    # one code set at a time: a swapped position (code j read from another nibble) or a wrong
    # power-of-two prescale shows up as the wrong column of the product
    k, gs = 64, 32
    codes = torch.full((8, k), 8, dtype=torch.uint8)
    for r in range(8):
        codes[r, r * 8 + r] = 15  # row r: feature 8r + r, which is code r of word r
    w = Int4Weight(codes, torch.ones(8, k // gs), torch.full((8, k // gs), 8, dtype=torch.uint8), gs, True)
    x = torch.arange(1, k + 1, dtype=torch.float16)[None, :]
    y = run_w4a16(x, w, device, W4Config(1, 8, 32, gemv=True))
    expected = torch.tensor([[7.0 * (r * 9 + 1) for r in range(8)]], dtype=torch.float16)
    torch.testing.assert_close(y, expected, atol=0, rtol=0)


def test_random_product_is_the_exact_int4_weights(device: str) -> None:
    # the weight is not rounded to fp16: the error against the float64 product of the float32 int4
    # weight is float32 summation (per group, then one scaled add per group) plus the output's rounding
    m, n, k, gs = 1, 40, 256, 64
    g = torch.Generator().manual_seed(7)
    w = int4_weight(n, k, gs, asym=True, g=g, dyadic=False)
    x = torch.randn(m, k, generator=g).half()
    y = run_w4a16(x, w, device, W4Config(1, 16, 128, split_k=2, gemv=True)).double()
    wd = dequantize_int4(w).double()
    exact = x.double() @ wd.T
    u, steps = 2.0**-24, k + k // gs + 2
    bound = steps * u / (1 - steps * u) * (x.double().abs() @ wd.abs().T) + exact.abs() * 2.0**-11
    assert bool(((y - exact).abs() <= bound).all())


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_fused_activation_after_the_split_sum(activation: str, device: str) -> None:
    g = torch.Generator().manual_seed(4)
    w = int4_weight(20, 128, 32, asym=False, g=g, dyadic=False)
    x = torch.randn(3, 128, generator=g).half()
    bias = torch.randn(20, generator=g)
    y = run_w4a16(x, w, device, W4Config(4, 16, 32, split_k=2, prefetch=True, gemv=True), bias=bias,
             activation=activation).float()
    ref = torch.nn.functional.linear(x.float(), dequantize_int4(w), bias)
    ref = torch.relu(ref) if activation == "relu" else torch.nn.functional.gelu(ref)
    torch.testing.assert_close(y, ref, atol=2e-3, rtol=2e-3)


def test_refusals_name_what_does_not_fit(device: str) -> None:
    g = torch.Generator().manual_seed(0)
    w = int4_weight(16, 96, 48, asym=False, g=g, dyadic=False)  # group 48: no power-of-two tile fits it
    x = torch.randn(1, 96, generator=g).half()
    with pytest.raises(CompressError, match=r"gemv tiles need .*group 48"):
        run_w4a16(x, w, device, W4Config(1, 16, 32, gemv=True))
    w = int4_weight(16, 64, 32, asym=False, g=g, dyadic=False)
    with pytest.raises(CompressError, match=r"gemv tiles need .*block 8x32"):
        run_w4a16(torch.randn(2, 64, generator=g).half(), w, device, W4Config(8, 16, 32, gemv=True))
    w = int4_weight(16, 36, 12, asym=False, g=g, dyadic=False)  # K not a multiple of 8: words straddle the end
    with pytest.raises(CompressError, match=r"gemv tiles need .*K=36"):
        run_w4a16(torch.randn(1, 36, generator=g).half(), w, device, W4Config(1, 16, 16, gemv=True))


def test_tuner_times_gemv_tiles_for_decode_only() -> None:
    from compress.quantization.lowering.kernels import w4a16 as k4

    def cands(m: int, k: int = 4096, gs: int = 128, tile_in_group: bool = True) -> list[W4Config]:
        return k4._gemv_candidates(m, 4096, k, gs, tile_in_group, 132)

    assert cands(1) and all(c.gemv and c.block_m == 1 for c in cands(1))
    assert {c.block_m for c in cands(3)} == {4}
    assert not cands(5)  # more rows: tensor cores
    assert not cands(1, tile_in_group=False)  # act_order's g_idx
    assert not cands(1, k=4100)  # K not a multiple of 8
    # no tile holds more than 16 words per thread (the registers of the sm90 compile)
    assert all(c.block_n * c.block_k // 8 <= 16 * 32 * c.num_warps for c in cands(1))


def test_tuners_time_weights_from_device_memory(device: str) -> None:
    # an H200's L2 is 50 MB: a LLaMA-7B 4096x4096 int4 layer (8.4 MB) is timed over 12 copies, a
    # layer larger than twice L2 once; never more than 32 copies
    from compress.quantization.lowering.kernels import w4a16 as k4

    assert k4.copies_beyond_l2(8_912_896, 50 * 2**20) == 12
    assert k4.copies_beyond_l2(200 * 2**20, 50 * 2**20) == 1
    assert k4.copies_beyond_l2(1000, 50 * 2**20) == 32
    w = int4_weight(64, 256, 64, asym=True, g=torch.Generator().manual_seed(1), dyadic=False)
    wt = k4._weight(pack_nibbles(w.codes).to(device), w.scale.t().contiguous().t(), w.zero_point, None, 64,
                    torch.device(device))
    copies = k4.hbm_copies(wt)
    assert copies[0] is wt and (len(copies) == 1) == (device == "cpu")
    for c in copies[1:]:  # separate memory, same values and layout (column-major scales)
        assert c.packed.data_ptr() != wt.packed.data_ptr() and torch.equal(c.packed, wt.packed)
        assert c.scale.stride() == wt.scale.stride() and torch.equal(c.scale, wt.scale)


COMPILE_SCRIPT = r'''
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from compress.quantization.lowering.kernels import load
load("w4a16")
from compress.quantization.lowering.kernels import w4a16_gemv as k

names = list(k._w4a16_gemv_kernel.arg_names)
for x, bm, bn, bk, zp, prefetch in (("fp16", 1, 128, 128, False, False), ("bf16", 1, 128, 256, True, True),
                                    ("fp16", 4, 64, 128, True, False)):
    const = {"HAS_ZP": zp, "HAS_BIAS": True, "ACT": 0, "INTERP_BF16": False, "GROUP": 128, "BLOCK_M": bm,
             "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT": 8, "EVEN_K": True, "PREFETCH": prefetch,
             # what a launch on contiguous tensors specializes (strides of 1)
             "stride_wk": 1, "stride_xk": 1, "stride_sn": 1, "stride_zn": 1, "stride_yn": 1}
    ptrs = {"x_ptr": f"*{x}", "w_ptr": "*i32", "s_ptr": "*fp32", "z_ptr": "*u8", "bias_ptr": "*fp32", "y_ptr": f"*{x}",
            "ws_ptr": "*fp32", "cnt_ptr": "*i32"}
    sig = {n: ptrs.get(n, "constexpr" if n in const else "i32") for n in names}
    div = [n for n in names if n.endswith("_ptr")] + ["stride_wn", "stride_xm", "stride_sg", "stride_zg", "stride_ym"]
    src = ASTSource(fn=k._w4a16_gemv_kernel, signature=sig, constexprs={(names.index(c),): v for c, v in const.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in div})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 1}).asm["ptx"]
    # the weight arrives in 128-bit loads, and no code is converted int-to-float: the exponent bits do it
    assert re.search(r"ld\.global(?:\.\w+)*\.v4\.b32", ptx), "the packed words are not loaded 16 bytes at a time"
    assert "mma" not in ptx
    int_to_float = re.findall(r"cvt\.rn\.f32\.[su](?:8|16|32)", ptx)
    assert len(int_to_float) <= 8, int_to_float  # per row's zero points, not per code
    print("compiled", x, bm, bn, bk, zp, prefetch)
'''


def test_compiles_for_sm90_with_vector_loads_and_no_code_conversions() -> None:
    assert compile_without_interpreter(COMPILE_SCRIPT).count("compiled") == 3
