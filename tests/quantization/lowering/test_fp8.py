"""float8 e4m3 (FP8, FP8_DYNAMIC): the spec, the fake quantizer against torch's own cast, the
activation kernel's codes, FP8Linear's parity with the fake-quant model on a transformers decoder,
and the one-line refusals of the paths that have no fp8 form. CPU runs use the Triton interpreter."""

from __future__ import annotations

import copy
import importlib.util
import os

import pytest
import torch
from torch import nn

if not torch.cuda.is_available():  # before the kernels are first imported (jit decides then)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from compress.quantization.numerics.primitives import dynamic_qparams, fake_quantize_fp8, quantize_fp8
from compress.quantization.numerics.spec import QuantScheme, QuantSpec

import compress
from compress.core.errors import ExportError, RecipeError

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs the triton extra")


def _hard_values() -> torch.Tensor:
    """Values where e4m3 rounding is easy to get wrong: ties, carries into the next power of two,
    the subnormal range, saturation, zeros of both signs."""
    grid = torch.arange(-448, 449, dtype=torch.float32)
    ties = torch.tensor([124.0, 120.0 + 4.0, 17.0, 9.0, 0.5 + 2**-5, 2**-9 * 1.5, 2**-10, 2**-9 * 0.5])
    carries = torch.tensor([124.2, 247.9, 63.6, 15.9, 7.99, 1.97, 2**-6 * 0.99])
    torch.manual_seed(0)
    rand = torch.randn(4096) * torch.logspace(-4, 2.6, 4096)
    return torch.cat([grid, ties, -ties, carries, -carries, rand, torch.tensor([0.0, -0.0, 448.0, -448.0, 500.0, -1e6])])


def test_fp8_spec_is_symmetric_8bit_and_refuses_what_has_no_meaning() -> None:
    s = QuantSpec(dtype="fp8_e4m3", granularity="channel")
    assert (s.qmin, s.qmax, s.is_float) == (-448, 448, True)
    for bad in ({"symmetric": False}, {"granularity": "group", "group_size": 32}, {"narrow_range": True}, {"bits": 4}):
        with pytest.raises(ValueError, match="fp8_e4m3"):
            QuantSpec(dtype="fp8_e4m3", **bad)


def test_fp8_presets_mean_what_compressed_tensors_means() -> None:
    static, dyn = QuantScheme.preset("FP8"), QuantScheme.preset("FP8_DYNAMIC")
    assert static.weights is not None and static.inputs is not None and dyn.weights is not None and dyn.inputs is not None
    assert (static.weights.granularity, static.inputs.granularity, static.inputs.dynamic) == ("tensor", "tensor", False)
    assert (dyn.weights.granularity, dyn.inputs.granularity, dyn.inputs.dynamic) == ("channel", "token", True)
    assert QuantScheme.preset("fp8_dynamic") == dyn  # any case, as the other ecosystem names
    with pytest.raises(RecipeError, match="unknown quantization scheme 'FP9'"):
        QuantScheme.preset("FP9")


def test_fake_quantize_fp8_equals_torch_cast_and_passes_gradients_inside_the_range() -> None:
    x = _hard_values()
    scale = torch.tensor(1.0)
    ref = torch.clamp(x, -448, 448).to(torch.float8_e4m3fn).float()
    assert torch.equal(fake_quantize_fp8(x, scale), ref)
    assert torch.equal(quantize_fp8(x, scale).float(), ref)
    xg = torch.tensor([1.3, 500.0, -3.7], requires_grad=True)
    fake_quantize_fp8(xg, torch.tensor(1.0)).sum().backward()
    assert xg.grad is not None and xg.grad.tolist() == [1.0, 0.0, 1.0]  # clamped values get no gradient


def test_dynamic_fp8_scale_maps_each_rows_absmax_to_448() -> None:
    x = torch.randn(5, 33) * 7
    scale, _ = dynamic_qparams(x, QuantSpec(dtype="fp8_e4m3", granularity="token", dynamic=True))
    assert torch.allclose(scale.reshape(-1), x.abs().amax(1) / 448)


@needs_triton
def test_activation_kernel_codes_equal_the_fake_quantizer(device: str) -> None:
    from compress.quantization.lowering.kernels import load

    quant = load("quant")
    x = _hard_values()[: 64 * 70].reshape(64, 70).to(device)
    q, s = quant.quantize_per_token(x, fp8=True)
    assert q.dtype == torch.float8_e4m3fn
    ref_s, _ = dynamic_qparams(x.cpu(), QuantSpec(dtype="fp8_e4m3", granularity="token", dynamic=True))
    assert torch.equal(s.cpu(), ref_s.reshape(-1))
    assert torch.equal(q.cpu().float(), quantize_fp8(x.cpu(), ref_s).float())
    qs = quant.quantize_static(x, scale=torch.tensor(0.37), fp8=True)
    assert torch.equal(qs.cpu().float(), quantize_fp8(x.cpu(), torch.tensor(0.37)).float())


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=96, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


@needs_triton
@pytest.mark.parametrize("scheme", ["FP8_DYNAMIC", "FP8"])
def test_fp8_linear_on_a_transformers_decoder_matches_its_fake_quant_model(device: str, scheme: str) -> None:
    pytest.importorskip("transformers")
    from compress.quantization.lowering.convert import convert_with_report
    from compress.quantization.lowering.fp8 import FP8Linear

    model = _llama()
    ids = torch.randint(0, 96, (2, 12))
    fq = compress.quantize(copy.deepcopy(model), scheme, [{"input_ids": ids}]).eval()
    conv, report = convert_with_report(fq, placed="fuse")  # every quantizer the fake-quant model runs
    assert report and all(r.converted and r.int8_type == "FP8Linear" for r in report)
    assert isinstance(conv.model.layers[0].mlp.down_proj, FP8Linear)
    fq, conv, ids = fq.to(device), conv.to(device), ids.to(device)
    with torch.no_grad():
        ref, y, fp = fq(input_ids=ids).logits, conv(input_ids=ids).logits, model.to(device)(input_ids=ids).logits
    if device == "cpu":
        # same codes, same scales, and on CPU the same fp32 arithmetic: the fake-quant model's output
        assert (y - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()
    else:
        # cuBLASLt accumulates fp8 products in its own order, so a last-bit change can move an
        # activation across an e4m3 rounding boundary (a step of 1/8 relative) in the next layer.
        # fp32: much closer to the fake-quant model than the float model is.
        assert (y - ref).norm() < 0.5 * (fp - ref).norm(), f"{(y - ref).norm():.4f} vs {(fp - ref).norm():.4f}"
    # Deployed in fp16, the inputs reach the quantizer rounded to fp16, which flips about one e4m3
    # code in 2**7 and lands as far from the fake-quant model as another rounding would
    # (benchmarks/cuda_fp8_parity.py: 0.03-0.09 relative, the quantization error itself being 0.06-0.11,
    # on CPU too). What must hold: it adds no more than half again the quantization error.
    from compress.export.validation.cuda import cast_float_layers

    half = cast_float_layers(copy.deepcopy(conv), torch.float16)  # keeps the fp8 codes and fp32 scales
    with torch.no_grad():
        y16 = half(input_ids=ids).logits.float()
    assert (y16 - fp).norm() < 1.5 * (ref - fp).norm(), f"{(y16 - fp).norm():.4f} vs {(ref - fp).norm():.4f}"
    assert (y - fp).abs().max().item() > 1e-3  # and it is quantized: not the float model


def test_fp8_has_no_onnx_export_and_says_so_in_one_line() -> None:
    fq = compress.quantize(nn.Sequential(nn.Linear(16, 16)), "FP8", [torch.randn(4, 16)])
    with pytest.raises(ExportError, match="float8") as err:
        from compress.export.qdq.swap import swap_quantizers

        swap_quantizers(fq)
    assert "\n" not in str(err.value)
