"""GGUF block formats: gguf's own dequantize reads back exactly our codes (with the f16 scales GGUF
stores), within the f16 rounding of the scale of our fake-quant weights, on Llama and Qwen2 layers;
grids without a llama.cpp block format are refused."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from compress.export.llm.gguf_weights import gguf_blocks, gguf_reference  # noqa: E402
from compress.quantization.numerics.spec import QuantScheme, QuantSpec  # noqa: E402

import compress  # noqa: E402
from compress.core.errors import UnsupportedModelError  # noqa: E402

SMALL = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 256}


def _model(kind: str, spec: QuantSpec) -> Any:
    torch.manual_seed(0)
    cls, cfg = ((transformers.LlamaForCausalLM, transformers.LlamaConfig) if kind == "llama"
                else (transformers.Qwen2ForCausalLM, transformers.Qwen2Config))
    return compress.quantize(cls(cfg(**SMALL)).eval(), QuantScheme(weights=spec, inputs=None), ignore=["lm_head"])


@pytest.mark.parametrize(("kind", "spec", "qtype"), [
    ("llama", QuantSpec(bits=4, granularity="group", group_size=32), "Q4_0"),
    ("qwen2", QuantSpec(bits=4, symmetric=False, dtype="uint8", granularity="group", group_size=32), "Q4_1"),
    ("qwen2", QuantSpec(bits=8, granularity="group", group_size=32), "Q8_0"),
    ("llama", QuantScheme.preset("MXFP4A16").weights, "MXFP4"),
])
def test_gguf_dequantize_reads_our_codes(kind: str, spec: QuantSpec | None, qtype: str) -> None:
    assert spec is not None
    model = _model(kind, spec)
    layers = {n: m for n, m in model.named_modules() if getattr(m, "weight_quantizer", None) is not None}
    assert len(layers) == 14
    for name, mod in layers.items():
        data, t = gguf_blocks(mod, where=name)
        assert t == getattr(gguf.GGMLQuantizationType, qtype)
        assert data.shape == (mod.out_features, mod.in_features // 32 * gguf.GGML_QUANT_SIZES[t][1])
        back = torch.from_numpy(gguf.quants.dequantize(data, t).astype(np.float32))
        # llama.cpp's weights: our codes, bit for bit, with the f16 scales GGUF stores
        torch.testing.assert_close(back, gguf_reference(mod, where=name), atol=0, rtol=0)
        # and our fake-quant weights up to the f16 rounding of the scale (2^-11 relative) times a code
        # of at most 2^(bits-1), twice for Q4_1 whose offset m is rounded too
        ours = mod.quantized_weight().detach()
        step = float(mod.weight_quantizer.scale.detach().abs().amax())
        assert float((back - ours).abs().max()) <= step * 2**spec.bits * 2**-11, name
        if qtype == "MXFP4":  # e2m1 codes times the power-of-two scale: nothing rounded
            assert torch.equal(back, ours), name


@pytest.mark.parametrize(("spec", "match"), [
    (QuantSpec(bits=4, granularity="group", group_size=64), "groups of 64 has no llama.cpp block format"),
    (QuantSpec(bits=4, granularity="channel"), "per channel has no llama.cpp block format"),
    (QuantSpec(bits=3, granularity="group", group_size=32), "3-bit sym weights"),
    (QuantScheme.preset("NVFP4A16").weights, "groups of 16 has no llama.cpp block format"),
])
def test_grids_without_a_block_format_are_refused(spec: QuantSpec | None, match: str) -> None:
    assert spec is not None
    model = _model("llama", spec)
    with pytest.raises(UnsupportedModelError, match=match):
        gguf_blocks(model.model.layers[0].self_attn.q_proj, where="model.layers.0.self_attn.q_proj")
