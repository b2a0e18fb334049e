"""Converted models under torch.compile: the kernels are torch.ops.compress operators (opaque to the
compiler, shape-only fake implementations), so a whole converted model traces in one graph and
computes what it computes eagerly. CPU runs use the Triton interpreter and the aot_eager backend
(tracing and AOT autograd, no code generation)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():  # before the kernels are first imported (jit decides then)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import compress

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs the triton extra")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _compiled_equals_eager(model: torch.nn.Module, *args: object, fullgraph: bool = True, rtol: float = 0.0,
                           **kwargs: object) -> None:
    torch._dynamo.reset()
    with torch.no_grad():
        ref = model(*args, **kwargs)
        out = torch.compile(model, backend="aot_eager", fullgraph=fullgraph)(*args, **kwargs)
    ref = getattr(ref, "logits", ref)
    out = getattr(out, "logits", out)
    if rtol == 0.0:
        assert torch.equal(out, ref)
    else:
        assert (out - ref).abs().max().item() <= rtol * ref.abs().max().item()


@pytest.mark.parametrize("scheme", ["W8A8", "FP8_DYNAMIC", "W4A16"])
def test_a_converted_transformers_decoder_compiles_in_one_graph(scheme: str) -> None:
    pytest.importorskip("transformers")
    from compress.quantization.lowering.convert import convert
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=96, max_position_embeddings=64)
    ids = torch.randint(0, 96, (2, 8))
    fq = compress.quantize(LlamaForCausalLM(cfg).eval(), scheme, [{"input_ids": ids}]).eval()
    _compiled_equals_eager(convert(fq, fuse_norms=False).to(DEV), input_ids=ids.to(DEV))
    # fused RMSNorms (the default) trace too: compiled, they are torch's float math, which sums in
    # another order than their eager kernel (a unit in the last place; a code may move one step)
    _compiled_equals_eager(convert(fq).to(DEV), input_ids=ids.to(DEV), rtol=0.02)


def test_a_converted_convnet_compiles_in_one_graph() -> None:
    """The default conversion drops the quantizers the ONNX placement put on functional ops (the
    residual adds) and with them the placement's per-op interception, which compiled code would not run."""
    from compress.quantization.api import QuantizeParams
    from compress.quantization.lowering.convert import convert_with_report
    from compress.quantization.lowering.int8 import Int8Conv2d
    from compress.quantization.placement.mode import graph_of

    from compress.models.resnet import resnet

    torch.manual_seed(0)
    x = torch.randn(2, 3, 16, 16)
    fq = compress.quantize(resnet(width=8, depth=1, in_channels=3).eval(), "w8a8", [x],
                           params=QuantizeParams(first_last="float")).eval()
    assert graph_of(fq) is not None
    conv, _ = convert_with_report(fq)
    assert any(isinstance(m, Int8Conv2d) for m in conv.modules()) and graph_of(conv) is None
    _compiled_equals_eager(conv.to(DEV), x.to(DEV))


def test_the_operators_pass_torch_library_opcheck() -> None:
    from compress.quantization.lowering.kernels.ops import ops, register

    register()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 32, generator=g).to(DEV)
    w = torch.randint(-127, 128, (24, 32), generator=g, dtype=torch.int8).to(DEV)
    q, s = ops().quantize_per_token(x, -128, 127, False, None)
    cases = [
        (ops().quantize_per_token, (x, -128, 127, False, None)),
        (ops().quantize_static, (x, torch.tensor([0.05], device=DEV), 3, -128, 127, False, None)),
        (ops().int8_gemm, (q, w, s, torch.rand(24, device=DEV), None, 0, None, 1, torch.float32)),
        (ops().fake_quantize_static, (x, torch.tensor([0.05], device=DEV), 3, -128, 127)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
