"""Int8Linear / Int8Conv2d: bit-exact integer codes, the epilogue against the same math in torch,
and parity with the fake-quant layer they replace. CPU runs use the Triton interpreter."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

if not torch.cuda.is_available():  # before the kernels are first imported (jit decides then)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from compress.quantization.lowering.int8 import Int8Conv2d, Int8Linear
from compress.quantization.numerics.calibration import calibrate
from compress.quantization.numerics.modules import QUANT_LAYERS
from compress.quantization.numerics.primitives import quantize_codes
from compress.quantization.numerics.spec import QuantScheme, QuantSpec, resolve_scheme
from compress.quantization.preparation import calibrate_weight

from compress.core.errors import CompressError, UnsupportedModelError

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs the triton extra")


def _quantized(layer: nn.Module, scheme: QuantScheme | str, data: list[torch.Tensor]) -> nn.Module:
    """The layer as a quantized module owning its input (and output) quantizers: the module-level
    form the int8 modules are checked against (prepare places activation quantizers on the graph)."""
    s = resolve_scheme(scheme)
    q = QUANT_LAYERS[type(layer)].from_float(layer, s, name="0", weights=s.weights)
    calibrate_weight(q)
    calibrate(nn.Sequential(q), data)
    return q


def _linear(scheme: QuantScheme | str, *, k: int = 70, n: int = 45, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    data = [torch.randn(8, k) * 2 + 0.3 for _ in range(3)]
    return _quantized(nn.Linear(k, n), scheme, data)


def test_linear_static_uint8_matches_integer_reference(device: str) -> None:
    ql = _linear("w8a8").eval()
    il = Int8Linear.from_quant(ql).to(device)
    iq, wq = ql.input_quantizer, ql.weight_quantizer
    assert iq is not None and wq is not None and iq.spec.dtype == "uint8"
    x = torch.randn(37, 70) * 2
    # the reference: codes from the primitives, exact integer GEMM, the kernel's epilogue order
    xq = quantize_codes(x, iq.scale, iq.zero_point, iq.qmin, iq.qmax).long() - int(iq.zero_point)
    wcodes = wq.int_repr(ql.weight.detach()).long()
    assert torch.equal(il.weight_q.cpu().long(), wcodes)
    acc = (xq @ wcodes.T).float()
    ref = acc * iq.scale.float() * wq.scale.float()[None, :] + ql.bias.detach()
    y = il(x.to(device)).cpu()
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(y, ql(x), atol=1e-4, rtol=1e-4)  # parity with fake-quant


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_linear_dynamic_per_token_parity(dtype: torch.dtype, device: str) -> None:
    ql = _linear("w8a8_dynamic", seed=1).eval()
    il = Int8Linear.from_quant(ql).to(device)
    assert il.input_mode == "token"
    x = torch.randn(3, 11, 70)
    with torch.no_grad():
        ref = ql.to(dtype=torch.float32)(x.to(dtype).float())
    y = il(x.to(dtype).to(device))
    assert y.dtype == dtype and y.shape == (3, 11, 45)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.cpu().float(), ref, atol=tol, rtol=tol)


def test_linear_smoothquant_and_output_quantizer_parity(device: str) -> None:
    scheme = QuantScheme(
        weights=QuantSpec(granularity="channel"),
        inputs=QuantSpec(granularity="tensor"),
        outputs=QuantSpec(dtype="uint8", symmetric=False),
    )
    ql = _linear(scheme, seed=2).eval()
    assert ql.input_quantizer is not None and ql.output_quantizer is not None
    g = torch.Generator().manual_seed(0)
    ql.input_quantizer.pre_quant_scale = torch.rand(70, generator=g) + 0.5
    il = Int8Linear.from_quant(ql).to(device)
    x = torch.randn(16, 70)
    with torch.no_grad():
        ref = ql(x)
    y = il(x.to(device)).cpu()
    # the output quantizer snaps both to its grid: equal codes give equal values
    step = float(ql.output_quantizer.scale)
    assert (y - ref).abs().max() <= step * 1.001
    assert (y == ref).float().mean() > 0.95


def test_int8_layer_owns_its_output_quantizer() -> None:
    # moving or casting the int8 layer must leave the fake-quant model it came from untouched (on a
    # GPU, .to("cuda") used to move the shared quantizer and broke the fake-quant model's forward)
    scheme = QuantScheme(weights=QuantSpec(granularity="channel"), inputs=QuantSpec(granularity="tensor"),
                         outputs=QuantSpec(dtype="uint8", symmetric=False))
    ql = _linear(scheme, seed=2).eval()
    assert ql.output_quantizer is not None
    il = Int8Linear.from_quant(ql).to(torch.float64)
    assert il.output_quantizer is not None and il.output_quantizer is not ql.output_quantizer
    assert ql.output_quantizer.scale.dtype == torch.float32
    torch.testing.assert_close(il.output_quantizer.scale.float(), ql.output_quantizer.scale)


def test_linear_dynamic_smoothquant_parity(device: str) -> None:
    ql = _linear("w8a8_dynamic", seed=4).eval()
    assert ql.input_quantizer is not None
    ql.input_quantizer.pre_quant_scale = torch.rand(70, generator=torch.Generator().manual_seed(1)) + 0.5
    il = Int8Linear.from_quant(ql).to(device)
    x = torch.randn(9, 70)
    with torch.no_grad():
        torch.testing.assert_close(il(x.to(device)).cpu(), ql(x), atol=1e-4, rtol=1e-4)


def test_conv_static_matches_integer_reference_and_fake_quant(device: str) -> None:
    torch.manual_seed(3)
    conv = nn.Conv2d(6, 10, 3, stride=2, padding=1)
    qc = _quantized(conv, "w8a8", [torch.randn(2, 6, 9, 7) for _ in range(3)]).eval()
    ic = Int8Conv2d.from_quant(qc).to(device)
    iq, wq = qc.input_quantizer, qc.weight_quantizer
    assert iq is not None and wq is not None
    x = torch.randn(2, 6, 9, 7)
    xq = quantize_codes(x, iq.scale, iq.zero_point, iq.qmin, iq.qmax).double() - int(iq.zero_point)
    acc = F.conv2d(xq, wq.int_repr(qc.weight.detach()).double(), stride=2, padding=1).float()
    ref = acc * iq.scale.float() * wq.scale.float()[None, :, None, None] + qc.bias.detach()[None, :, None, None]
    y = ic(x.to(device)).cpu()
    assert y.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(y, qc(x), atol=1e-4, rtol=1e-4)


def test_unsupported_layers_say_why() -> None:
    with pytest.raises(UnsupportedModelError, match="weight-only"):
        Int8Linear.from_quant(_linear("w8_weight_only"))
    with pytest.raises(UnsupportedModelError, match="4-bit"):
        Int8Linear.from_quant(_linear(QuantScheme(weights=QuantSpec(bits=4, granularity="channel"))))
    asym_w = QuantScheme(weights=QuantSpec(granularity="channel", symmetric=False))
    with pytest.raises(UnsupportedModelError, match="asymmetric"):
        Int8Linear.from_quant(_linear(asym_w))
    torch.manual_seed(0)
    dw = _quantized(nn.Conv2d(4, 4, 3, groups=4), "w8a8", [torch.randn(1, 4, 6, 6)])
    with pytest.raises(UnsupportedModelError, match="groups=4"):
        Int8Conv2d.from_quant(dw)
    tok = _quantized(nn.Conv2d(4, 4, 3), "w8a8_dynamic", [torch.randn(1, 4, 6, 6)])
    with pytest.raises(UnsupportedModelError, match="per-token"):
        Int8Conv2d.from_quant(tok)


def test_bad_input_dtype_raises(device: str) -> None:
    il = Int8Linear.from_quant(_linear("w8a8")).to(device)
    with pytest.raises(CompressError, match="float16, bfloat16 or float32"):
        il(torch.randn(2, 70, dtype=torch.float64, device=device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_static_qdq_is_the_fake_quantizer_in_one_pass(device: str, dtype: torch.dtype) -> None:
    from compress.quantization.lowering.int8 import StaticQDQ
    from compress.quantization.numerics.fake_quant import FakeQuantizer

    q = FakeQuantizer(QuantSpec(dtype="uint8", symmetric=False, granularity="tensor"))
    q.observing = True
    q.enabled = False
    q(torch.randn(64) * 3 + 1)
    q.finish_calibration()
    x = (torch.randn(2, 8, 5, 6) * 4).to(dtype).contiguous(memory_format=torch.channels_last)
    ref = q(x.float()).to(dtype) if dtype != torch.float32 else q(x)
    y = StaticQDQ.from_quantizer(q).to(device)(x.to(device))
    assert y.is_contiguous(memory_format=torch.channels_last) and y.dtype == dtype
    assert torch.equal(y.cpu(), ref)


def test_converted_resnet_runs_its_kept_quantizers_as_one_kernel_with_parity() -> None:
    from compress.quantization.api import QuantizeParams
    from compress.quantization.lowering.convert import convert_with_report
    from compress.quantization.lowering.int8 import StaticQDQ
    from compress.quantization.numerics.fake_quant import FakeQuantizer

    import compress
    from compress.models.resnet import resnet

    torch.manual_seed(0)
    x = torch.randn(2, 3, 16, 16)
    fq = compress.quantize(resnet(width=8, depth=2, in_channels=3).eval(), "w8a8", [x],
                           params=QuantizeParams(first_last="float")).eval()
    conv, _ = convert_with_report(fq, placed="fuse")
    assert not any(isinstance(m, FakeQuantizer) and m.enabled and m.role != "weight" for m in conv.modules())
    assert sum(isinstance(m, StaticQDQ) for m in conv.modules()) > 0
    with torch.no_grad():
        ref, y = fq(x), conv(x)
    assert (y - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


def test_placed_drop_removes_the_emulated_integer_ops_and_keeps_every_int8_layer() -> None:
    from compress.quantization.api import QuantizeParams
    from compress.quantization.lowering.convert import convert_with_report
    from compress.quantization.lowering.int8 import StaticQDQ
    from compress.quantization.numerics.fake_quant import FakeQuantizer

    import compress
    from compress.core.errors import RecipeError
    from compress.models.resnet import resnet

    torch.manual_seed(0)
    x = torch.randn(2, 3, 16, 16)
    fp = resnet(width=8, depth=2, in_channels=3).eval()
    fq = compress.quantize(fp, "w8a8", [x], params=QuantizeParams(first_last="float")).eval()
    _, rep_f = convert_with_report(fq, placed="fuse")
    dropped, rep_d = convert_with_report(fq)  # the default
    assert [r.converted for r in rep_f] == [r.converted for r in rep_d]
    assert not any(isinstance(m, (StaticQDQ, FakeQuantizer)) for m in dropped.modules())
    with torch.no_grad():
        ref, y = fq(x), dropped(x)
    cos = F.cosine_similarity(ref.flatten(1), y.flatten(1)).min().item()
    assert cos > 0.99 and not torch.equal(ref, y)  # the same int8 layers, minus the add emulation
    with pytest.raises(RecipeError, match="placed='keep' unknown"):
        convert_with_report(fq, placed="keep")


@pytest.mark.parametrize("scheme", ["W8A8", "FP8_DYNAMIC"])
def test_layers_reading_one_tensor_quantize_it_once(scheme: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """q/k/v read one normed tensor and gate/up another: one quantization each, not three and two;
    the codes are the same, so the output is unchanged."""
    pytest.importorskip("transformers")
    import copy

    from compress.quantization.lowering.convert import convert_with_report
    from compress.quantization.lowering.kernels import load
    from transformers import LlamaConfig, LlamaForCausalLM

    import compress

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=96, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 96, (2, 8))
    fq = compress.quantize(copy.deepcopy(model), scheme, [{"input_ids": ids}]).eval()
    conv, _ = convert_with_report(fq, horizontal=False)  # one GEMM per layer: tests/quantization/lowering/test_horizontal.py
    attn, mlp = conv.model.layers[0].self_attn, conv.model.layers[0].mlp
    assert attn.q_proj.shared_codes is attn.k_proj.shared_codes is attn.v_proj.shared_codes is mlp.gate_proj.shared_codes
    quant = load("quant")
    calls = []
    real = quant.quantize_per_token
    monkeypatch.setattr(quant, "quantize_per_token", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        y = conv(input_ids=ids).logits
        assert len(calls) == 2 * 4 + 1  # per layer: qkv, o, gate/up, down; then lm_head (7 per layer unshared)
        for m in conv.modules():
            m.__dict__.pop("shared_codes", None)
        unshared = conv(input_ids=ids).logits
    assert len(calls) == 2 * 4 + 1 + 2 * 7 + 1
    assert torch.equal(y, unshared)


def test_shared_codes_are_reused_only_for_the_same_unchanged_tensor() -> None:
    from compress.quantization.lowering.shared_input import SharedCodes

    cache, calls = SharedCodes(), []

    def quantize(t: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return t * 2

    with torch.no_grad():
        x = torch.ones(4)
        assert torch.equal(cache.get(x, lambda: quantize(x)), torch.full((4,), 2.0)) and len(calls) == 1
        cache.get(x, lambda: quantize(x))
        assert len(calls) == 1  # same object, unchanged: reused
        x.add_(1)  # in place: its version moves
        assert torch.equal(cache.get(x, lambda: quantize(x)), torch.full((4,), 4.0)) and len(calls) == 2
        y = x.clone()  # equal values, another tensor
        cache.get(y, lambda: quantize(y))
        assert len(calls) == 3
    cache.get(y, lambda: quantize(y))  # with autograd on nothing is cached (training reads change)
    assert len(calls) == 4
