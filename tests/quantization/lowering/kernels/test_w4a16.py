"""W4A16 GEMM: the in-register dequantization bit-exact, products bit-exact where float32 sums are
order-independent and within the float32 accumulation bound elsewhere; W4A16Linear against the
fake-quant layer it replaces, through convert(backend="cuda")."""

from __future__ import annotations

import pytest
import torch
from compress.quantization.lowering.convert import convert_with_report
from compress.quantization.lowering.int4 import (
    Int4Weight,
    dequantize_int4,
    int4_weight,
    pack_nibbles,
    unpack_nibbles,
)
from compress.quantization.lowering.kernels import GemmConfig, w4a16_gemm
from compress.quantization.lowering.kernels.w4a16 import W4Config, dequantize_w4
from compress.quantization.lowering.w4a16 import W4A16Linear
from compress.quantization.numerics.spec import QuantScheme, QuantSpec
from torch import nn

import compress
from compress.core.errors import CompressError, UnsupportedModelError

TILE = GemmConfig(16, 32, 32, group_m=2)
# the fused kernel's regimes: tensor cores; CUDA cores for 1..4 rows with K split in three (partials
# summed by the reduce kernel), also accumulating elementwise with the next tile prefetched;
# tensor cores with K split and prefetch
CONFIGS = {
    "dot": TILE,
    "cuda-cores-split3": W4Config(4, 16, 32, split_k=3),
    "cuda-cores-acc3-prefetch": W4Config(2, 16, 32, split_k=2, acc3=True, prefetch=True),
    "dot-split2-prefetch": W4Config(16, 32, 32, split_k=2, prefetch=True),
    # K-tiles spanning several groups (64 features: four groups of 16, two of 32, one of 64 in SHAPES)
    "cuda-cores-multigroup": W4Config(2, 16, 64, split_k=2, acc3=True, prefetch=True),
    "dot-multigroup": W4Config(16, 16, 64, prefetch=True),
}


def _int4(n: int, k: int, gs: int, *, asym: bool, act_order: bool, g: torch.Generator, dyadic: bool = False) -> Int4Weight:
    groups = -(-k // gs)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    if dyadic:  # powers of two: every product and partial sum below is exact in float32
        scale = 2.0 ** -torch.randint(2, 7, (n, groups), generator=g).float()
    else:
        scale = torch.rand(n, groups, generator=g) * 0.02 + 1e-3
    zp = torch.randint(0, 16, (n, groups), generator=g, dtype=torch.uint8) if asym else torch.full((n, groups), 8, dtype=torch.uint8)
    if not asym:  # symmetric int4 scales carry a sign (the larger end of each group's range sits on -8)
        scale = scale * (torch.randint(0, 2, (n, groups), generator=g) * 2 - 1)
    g_idx = torch.randperm(k, generator=g).int() // gs if act_order else None
    return Int4Weight(codes, scale, zp, gs, not asym, g_idx)


def _run(x: torch.Tensor, w: Int4Weight, device: str, **kw: object) -> torch.Tensor:
    return w4a16_gemm(
        x.to(device), pack_nibbles(w.codes).to(device), scale=w.scale, group_size=w.group_size,
        zero_point=None if w.symmetric else w.zero_point, g_idx=w.g_idx, config=kw.pop("config", TILE), **kw,  # type: ignore[arg-type]
    ).cpu()


def test_pack_roundtrip() -> None:
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (5, 9), generator=g, dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.shape == (5, 5)
    assert int(packed[0, 0]) == int(codes[0, 0]) | (int(codes[0, 1]) << 4)
    assert torch.equal(unpack_nibbles(packed, 9), codes)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize(("asym", "act_order"), [(False, False), (True, False), (True, True)], ids=["sym", "asym", "act_order"])
@pytest.mark.parametrize("path", ["fused", "dequant"])
def test_dequantized_weight_is_bit_exact(dtype: torch.dtype, asym: bool, act_order: bool, path: str, device: str) -> None:
    # an identity activation makes each output one product 1 * w plus exact zeros: Y = W^T, whatever the order
    k, n, gs = 64, 24, 16
    w = _int4(n, k, gs, asym=asym, act_order=act_order, g=torch.Generator().manual_seed(k + asym + 2 * act_order))
    y = _run(torch.eye(k, dtype=dtype), w, device, path=path, config=TILE if path == "fused" else None)
    ref = dequantize_int4(w).to(dtype)
    assert y.dtype == dtype
    assert ref.abs().max() > 0.01
    torch.testing.assert_close(y.T, ref, atol=0, rtol=0)
    # the dequant path's weight itself, ragged K included
    wd = dequantize_w4(pack_nibbles(w.codes).to(device), scale=w.scale, group_size=gs, k=k, dtype=dtype,
                       zero_point=None if w.symmetric else w.zero_point, g_idx=w.g_idx)
    torch.testing.assert_close(wd.cpu(), ref, atol=0, rtol=0)


# (M, N, K, group): decode rows 1..16, a prefill-like ragged M; K ragged against the 32-wide K-tile,
# and K=80 with group 32: a shorter last group (the quantizer's layout for such widths)
SHAPES = [(1, 40, 128, 32), (5, 33, 80, 32), (16, 64, 64, 64), (37, 19, 80, 16)]


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize(("asym", "act_order"), [(False, False), (True, True)], ids=["sym", "asym-act_order"])
@pytest.mark.parametrize("mnkg", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_dyadic_product_is_bit_exact(
    mnkg: tuple[int, int, int, int], asym: bool, act_order: bool, config: str, device: str
) -> None:
    # integer activations and power-of-two scales: all sums are exact in float32, so any order agrees
    m, n, k, gs = mnkg
    g = torch.Generator().manual_seed(m * 100 + n + k)
    w = _int4(n, k, gs, asym=asym, act_order=act_order, g=g, dyadic=True)
    x = torch.randint(-4, 5, (m, k), generator=g).half()
    bias = torch.randint(-8, 8, (n,), generator=g).float() / 4
    y = _run(x, w, device, bias=bias, config=CONFIGS[config])
    ref = (x.double() @ dequantize_int4(w).double().T + bias.double()).half()
    assert ref.float().abs().max() > 1
    torch.testing.assert_close(y, ref, atol=0, rtol=0)


@pytest.mark.parametrize("config", [GemmConfig(16, 16, 32), W4Config(2, 16, 32, split_k=2)], ids=["dot", "cuda-cores-split2"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_random_product_within_accumulation_bound(dtype: torch.dtype, config: W4Config | GemmConfig, device: str) -> None:
    # float32 sums in another order than torch's differ by at most gamma_K * sum|x w| (Higham, 3.5)
    # per output, plus one rounding of the result to the output dtype in each of them
    m, n, k, gs = 21, 35, 96, 32
    g = torch.Generator().manual_seed(9)
    w = _int4(n, k, gs, asym=True, act_order=False, g=g)
    x = torch.randn(m, k, generator=g).to(dtype)
    wd = dequantize_int4(w).to(dtype).double()
    y = _run(x, w, device, config=config).double()
    exact = x.double() @ wd.T
    u = 2.0**-24
    bound = (k * u / (1 - k * u)) * (x.double().abs() @ wd.abs().T)
    eps_out = torch.finfo(dtype).eps
    err = (y - exact).abs()
    assert bool((err <= bound + exact.abs() * eps_out + 1e-30).all()), float((err - bound).max())
    assert err.max() > 0 or dtype == torch.float32  # fp16 outputs round: the check compares real values


@pytest.mark.parametrize("config", ["dot", "cuda-cores-split3", "cuda-cores-acc3-prefetch"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_fused_activation(activation: str, config: str, device: str) -> None:
    # with a split, bias and activation run in the reduce kernel after the partial sums
    g = torch.Generator().manual_seed(4)
    w = _int4(20, 64, 32, asym=False, act_order=False, g=g)
    x = torch.randn(3, 64, generator=g)
    bias = torch.randn(20, generator=g)
    y = _run(x, w, device, bias=bias, activation=activation, config=CONFIGS[config])
    ref = nn.functional.linear(x, dequantize_int4(w), bias)
    ref = torch.relu(ref) if activation == "relu" else nn.functional.gelu(ref)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)


def _w4_model(scheme: QuantScheme | str, *, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 32))
    return compress.quantize(model, scheme)


@pytest.mark.parametrize(
    "scheme",
    [
        QuantScheme(weights=QuantSpec(bits=4, granularity="group", group_size=16), inputs=None),
        QuantScheme(weights=QuantSpec(bits=4, symmetric=False, granularity="group", group_size=16), inputs=None),
        QuantScheme(weights=QuantSpec(bits=4, dtype="uint8", symmetric=False, granularity="channel"), inputs=None),
    ],
    ids=["sym-g16", "asym-g16", "uint4-per-channel"],
)
def test_convert_runs_w4_layers_on_the_kernel(scheme: QuantScheme, device: str) -> None:
    fq = _w4_model(scheme)
    for mod in (fq[0], fq[2]):  # the integer form dequantizes to exactly the fake-quant weight
        torch.testing.assert_close(dequantize_int4(int4_weight(mod)), mod.quantized_weight().detach(), atol=0, rtol=0)
    conv, report = convert_with_report(fq, backend="cuda")
    assert [r.int8_type for r in report] == ["W4A16Linear", "W4A16Linear"]
    assert isinstance(conv[0], W4A16Linear) and conv[0].activation == "relu"  # ReLU fused in the epilogue
    assert isinstance(conv[1], nn.Identity) and isinstance(conv[2], W4A16Linear)
    x = torch.randn(2, 5, 64)
    ref = fq(x)
    y = conv.to(device)(x.to(device)).cpu()
    torch.testing.assert_close(y, ref, atol=2e-5, rtol=1e-5)


def test_unsupported_layers_and_bad_inputs_say_why(device: str) -> None:
    w8 = _w4_model("w8_weight_only")
    with pytest.raises(UnsupportedModelError, match="not a weight-only 4-bit"):
        W4A16Linear.from_quant(w8[0])
    a = torch.zeros(4, 8, device=device)
    wp = torch.zeros(3, 4, dtype=torch.uint8, device=device)
    with pytest.raises(CompressError, match="uint8"):
        w4a16_gemm(a, wp.float(), scale=torch.ones(3, 1), group_size=8)
    with pytest.raises(CompressError, match="block_k >= 32"):
        w4a16_gemm(a, wp, scale=torch.ones(3, 1), group_size=8, config=W4Config(16, 32, 16))
    with pytest.raises(CompressError, match="shapes"):
        w4a16_gemm(a[:, :6], wp, scale=torch.ones(3, 1), group_size=8)
    with pytest.raises(CompressError, match="scale has shape"):
        w4a16_gemm(a, wp, scale=torch.ones(3, 2), group_size=8)
    with pytest.raises(CompressError, match="float16"):
        w4a16_gemm(a.double(), wp, scale=torch.ones(3, 1), group_size=8)


def test_convert_runs_a_transformers_llama_on_the_kernel(device: str) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128)
    fq = compress.quantize(transformers.LlamaForCausalLM(cfg).eval(), "w4_weight_only_g128", ignore=["lm_head"])
    conv, report = convert_with_report(fq, backend="cuda")
    assert [r.int8_type for r in report if r.kind == "layer"] == ["W4A16Linear"] * 7  # every projection (q, k, v, o, gate, up, down)
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = fq(ids).logits
        y = conv.to(device)(ids.to(device)).logits.cpu()
    torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("asym", [False, True], ids=["sym", "asym"])
def test_tinygemm_scales_and_zeros_reproduce_our_dequantized_weight(asym: bool) -> None:
    """tinygemm dequantizes (u - 8) * s + z: our zero convention, checked through PyTorch's CPU
    int4 kernel (same formula, CPU packing) against our exact weight, to bf16 rounding."""
    from compress.quantization.lowering.w4a16 import tinygemm_scales_and_zeros

    g = torch.Generator().manual_seed(3)
    w = _int4(64, 256, 64, asym=asym, act_order=False, g=g)
    sz = tinygemm_scales_and_zeros(w.scale, None if not asym else w.zero_point)
    assert sz.shape == (4, 64, 2) and sz.dtype == torch.bfloat16
    tiled = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.codes.to(torch.int32), 2)
    x = torch.randn(3, 256, generator=g).to(torch.bfloat16)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, tiled, 64, sz).float()
    ref = x.float() @ dequantize_int4(w).t()
    assert (y - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()  # bf16 scales, bf16 output


def test_tinygemm_refusals_name_the_constraint() -> None:
    from compress.quantization.lowering.w4a16 import tinygemm_refusal

    assert tinygemm_refusal(4096, 4096, 128, False) is None
    assert "g_idx" in str(tinygemm_refusal(4096, 4096, 128, True))
    assert "groups of" in str(tinygemm_refusal(576, 576, 128, False))  # SmolLM2's 576: ragged last group
    layer = W4A16Linear.from_int4(_int4(16, 96, 48, asym=False, act_order=False, g=torch.Generator().manual_seed(0)), None)
    with pytest.raises(UnsupportedModelError, match="tinygemm takes groups"):
        layer.set_backend("tinygemm")
    with pytest.raises(CompressError, match="backend 'marlin' unknown"):
        layer.set_backend("marlin")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("asym", [False, True], ids=["sym", "asym"])
@pytest.mark.parametrize("m", [1, 16, 64])
def test_tinygemm_backend_matches_the_triton_kernel_on_cuda(asym: bool, m: int) -> None:
    g = torch.Generator().manual_seed(4)
    w = _int4(256, 512, 128, asym=asym, act_order=False, g=g)
    layer = W4A16Linear.from_int4(w, torch.randn(256, generator=g)).cuda()
    x = torch.randn(m, 512, generator=g).cuda().to(torch.bfloat16)
    ref = layer.set_backend("triton")(x).float()
    y = layer.set_backend("tinygemm")(x).float()
    assert (y - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()
    auto = layer.set_backend("auto")(x).float()  # whichever is faster: one of the two
    assert (auto - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()
