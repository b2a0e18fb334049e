"""W8A8 LLM generation export: ORT's greedy tokens equal the PyTorch fake-quant model's (transformers'
generate) for static per-tensor (QDQ -> MatMulIntegerToFloat) and per-token dynamic (MatMulInteger,
s8s8 or u8s8) activations; what the hand-written generation graph cannot carry is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import onnx
import pytest
import torch

transformers = pytest.importorskip("transformers")

from compress.export.llm import w8a8 as llm_w8a8  # noqa: E402
from compress.export.llm.onnx import export_llm_onnx, generate_ort  # noqa: E402

import compress  # noqa: E402
from compress.core.errors import ExportError, UnsupportedModelError  # noqa: E402

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 256}
#: 7-bit weight codes: ORT's u8s8 kernels then sum exactly on CPUs without VNNI (README)
STATIC = {"preset": "w8a8", "weights": {"reduce_range": True}}


def _model(kind: str, scheme: Any, **params: Any) -> Any:
    torch.manual_seed(0)
    cls, cfg = ((transformers.LlamaForCausalLM, transformers.LlamaConfig) if kind == "llama"
                else (transformers.Qwen2ForCausalLM, transformers.Qwen2Config))
    model = cls(cfg(**SMALL)).eval()
    g = torch.Generator().manual_seed(3)
    data = [torch.randint(0, 256, (2, 16), generator=g) for _ in range(2)]
    return compress.quantize(model, scheme, data, ignore=["lm_head"], params=compress.QuantizeParams(**params))


def _ops(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in onnx.load(str(path)).graph.node:
        out[n.op_type] = out.get(n.op_type, 0) + 1
    return out


@pytest.mark.parametrize(
    ("kind", "scheme", "params", "integer_op"),
    [
        ("llama", STATIC, {"quantize_ops": False, "smoothquant": "auto"}, "QuantizeLinear"),
        ("qwen2", "w8a8_dynamic", {"smoothquant": 0.5}, "MatMulInteger"),
        ("llama", {"preset": "w8a8_dynamic", "weights": {"reduce_range": True}}, {}, "MatMulInteger"),
    ],
    ids=["llama-static-smoothquant", "qwen2-dynamic-per-token-s8s8", "llama-dynamic-per-token-u8s8"],
)
def test_ort_greedy_tokens_match_the_fake_quant_model(kind: str, scheme: Any, params: dict[str, Any],
                                                        integer_op: str, tmp_path: Path) -> None:
    fq = _model(kind, scheme, **params)
    path = export_llm_onnx(fq, tmp_path / "m.onnx", weights="w8a8")
    ops = _ops(path)
    # static: one Q/DQ pair per quantized tensor (q/k/v share one, gate/up one): 4 per layer;
    # dynamic: one MatMulInteger per Linear; both store the 14 weights as int8
    assert ops.get(integer_op) == (8 if integer_op == "QuantizeLinear" else 14)
    if integer_op == "MatMulInteger":  # uint8 codes with zero point 128 (fast u8s8) only for 7-bit weights
        zp_inputs = {len(n.input) for n in onnx.load(str(path)).graph.node if n.op_type == "MatMulInteger"}
        assert zp_inputs == ({3} if isinstance(scheme, dict) else {2})
    int8 = [i for i in onnx.load(str(path)).graph.initializer if i.data_type == onnx.TensorProto.INT8 and i.dims
            and len(i.dims) == 2]
    assert len(int8) == 14
    ids = torch.randint(1, 256, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    with torch.no_grad():
        ref = fq.generate(ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                          pad_token_id=0)
    got = generate_ort(path, ids, attention_mask=mask, max_new_tokens=12)
    assert torch.equal(got, ref), (got.tolist(), ref.tolist())


def test_refuses_what_the_generation_graph_cannot_carry(tmp_path: Path) -> None:
    full = _model("llama", "w8a8")  # the ORT placement also quantizes residual adds, RoPE and attention
    with pytest.raises(UnsupportedModelError, match="Linear inputs only"):
        export_llm_onnx(full, tmp_path / "a.onnx", weights="w8a8")
    kv = _model("llama", "w8a8_dynamic", kv_cache="per_token")
    with pytest.raises(UnsupportedModelError, match="KV cache is simulated"):
        export_llm_onnx(kv, tmp_path / "b.onnx", weights="w8a8")
    with pytest.raises(UnsupportedModelError, match="no Linears with quantized inputs"):
        export_llm_onnx(_model("llama", "w8_weight_only"), tmp_path / "c.onnx", weights="w8a8")


def test_export_check_catches_a_wrong_graph(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the activations' zero point dropped from the graph: ORT computes something else, the export refuses
    def no_zero_point(g: Any, x: Any, scale: Any, zero_point: Any) -> Any:
        return g.op("DequantizeLinear", g.op("QuantizeLinear", x, scale), scale)

    monkeypatch.setattr(llm_w8a8._QDQFn, "symbolic", staticmethod(no_zero_point))
    with pytest.raises(ExportError, match="does not compute the model"):
        export_llm_onnx(_model("llama", STATIC, quantize_ops=False), tmp_path / "bad.onnx", weights="w8a8")


@pytest.mark.slow  # about a minute on an idle 2-core CPU (the 135M model is copied and traced)
def test_real_smollm2_smoothquant_w8a8_export_passes_its_check(smollm2: Any, tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    # SmolLM2-135M (30 layers, massive activations) after SmoothQuant: rounding ties flipped by ORT's
    # exact int32 sums cascade through the static quantizers, which an elementwise tolerance refused
    # (0.39 of the largest logit); judged against the quantization's own error, the file passes
    import logging
    import os

    model_dir, tok = smollm2
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tok(Path(os.__file__).read_text()[:20000], return_tensors="pt").input_ids[0]
    data = [ids[i * 64 : (i + 1) * 64][None] for i in range(4)]
    q = compress.quantize(model, STATIC, data, ignore=["lm_head"],
                          params=compress.QuantizeParams(quantize_ops=False, smoothquant=0.5))
    with caplog.at_level(logging.INFO, logger="compress.export.llm.ort"):  # the export check logs there
        export_llm_onnx(q, tmp_path / "smollm2.w8a8.onnx", weights="w8a8")
    line = next(r.getMessage() for r in caplog.records if "logits SQNR" in r.getMessage())
    assert "quantization vs float" in line, line
