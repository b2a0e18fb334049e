"""QDQ int8 export: int8 weight initializers, uint8 activations, integer kernels in ORT's optimized
graph, parity of ORT against the PyTorch fake-quant model, size, and the graph passes."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from compress.export.onnx import export_onnx
from compress.export.qdq.swap import swap_quantizers
from compress.export.validation.parity import Parity
from compress.export.validation.runtimes import integer_kernel_count
from onnx import numpy_helper

from compress.core.errors import ExportError


def _run(path: Path, feeds: dict[str, np.ndarray], *, optimize: bool = True) -> np.ndarray:
    so = ort.SessionOptions()
    if not optimize:  # ORT without graph optimizations runs the QDQ graph in float: the exact reference
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def _eval_parity(model: torch.nn.Module, path: Path, digits: Any) -> dict[str, Any]:
    p = Parity()
    for x, _ in digits.eval:
        p.update(model(x).detach().numpy(), _run(path, {"input": x.numpy()}))
    return p.result()


def test_int8_parity_on_digits(quantized_resnet: torch.nn.Module, int8_path: Path, digits: Any) -> None:
    res = _eval_parity(quantized_resnet, int8_path, digits)
    assert res["top1_agreement"] >= 0.99, res
    assert res["sqnr_db"] >= 15.0, res  # u8s8 kernels without VNNI saturate a little (see reduce_range)


def test_weights_calibrated_at_reduce_range_give_ort_parity(
    trained_resnet: torch.nn.Module, digits: Any, tmp_path: Path
) -> None:
    from compress.quantization.api import quantize

    scheme = {"preset": "w8a8", "weights": {"reduce_range": True}}
    q = quantize(copy.deepcopy(trained_resnet), scheme, digits.calibration).eval()
    assert q.fc.weight_quantizer.qmin == -64 and q.fc.weight_quantizer.qmax == 63
    p = export_onnx(q, next(iter(digits.eval))[0], tmp_path / "rr7.onnx")
    inits = [numpy_helper.to_array(i) for i in onnx.load(str(p)).graph.initializer]
    codes = [v for v in inits if v.dtype == np.int8 and v.ndim >= 2]
    assert codes and all(c.min() >= -64 and c.max() <= 63 for c in codes)
    res = _eval_parity(q, p, digits)
    # no int16 saturation left: ORT's integer kernels match the fake-quant model to rounding
    assert res["top1_agreement"] == 1.0 and res["sqnr_db"] >= 35.0, res


def test_qdq_graph_matches_fake_quant_exactly(quantized_resnet: torch.nn.Module, int8_path: Path) -> None:
    torch.manual_seed(3)
    x = torch.rand(16, 1, 8, 8) * 16  # digits' pixel range
    out = _run(int8_path, {"input": x.numpy()}, optimize=False)
    ref = quantized_resnet(x).detach().numpy()
    p = Parity()
    p.update(ref, out)
    res = p.result()
    # only rounding ties differ (ONNX divides by the scale, the fake-quant multiplies by its inverse);
    # on random inputs a tie can flip a near-equal pair of logits, and only such a pair: a sample
    # whose top-1 differs has its two leading logits closer than twice the largest difference
    assert res["sqnr_db"] >= 40.0, res
    top2 = np.sort(ref, axis=1)[:, -2:]
    flipped = ref.argmax(1) != out.argmax(1)
    margins = (top2[:, 1] - top2[:, 0])[flipped]
    assert (margins < 2 * res["max_abs_diff"]).all(), (margins, res)


def test_integer_kernels_in_ort_graph(resnet_exports: Any, int8_path: Path) -> None:
    count, ops = integer_kernel_count(int8_path)
    assert ops.get("QLinearConv", 0) == 9, ops  # every conv of the ResNet
    assert ops.get("QLinearAdd", 0) == 3 and ops.get("QGemm", 0) == 1, ops
    final = next(r for r in resnet_exports if r.role == "final")
    assert final.integer_nodes == count and final.format == "onnx-int8-qdq"


def test_weights_stored_int8_per_channel_and_uint8_activations(int8_path: Path) -> None:
    m = onnx.load(str(int8_path))
    inits = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    float_weights = [k for k, v in inits.items() if v.dtype == np.float32 and v.ndim >= 2]
    assert float_weights == []
    producers = {o: n for n in m.graph.node for o in n.output}
    conv_dq = 0
    for n in m.graph.node:
        if n.op_type in ("Conv", "Gemm"):
            dq = producers[n.input[1]]
            assert dq.op_type == "DequantizeLinear" and inits[dq.input[0]].dtype == np.int8
            assert inits[dq.input[1]].ndim == 1  # per-channel scales ...
            axis = next(a.i for a in dq.attribute if a.name == "axis")
            assert axis == 0  # ... along the output channels
            conv_dq += 1
        if n.op_type == "QuantizeLinear":
            assert inits[n.input[2]].dtype == np.uint8
    assert conv_dq == 10  # stem, 6 block convs, 2 shortcuts, fc


def test_no_redundant_pairs(int8_path: Path) -> None:
    m = onnx.load(str(int8_path))
    producers = {o: n for n in m.graph.node for o in n.output}
    inits = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    seen: set[tuple[str, bytes, bytes]] = set()
    for n in m.graph.node:
        if n.op_type != "QuantizeLinear":
            continue
        key = (n.input[0], inits[n.input[1]].tobytes(), inits[n.input[2]].tobytes())
        assert key not in seen, f"duplicate Q/DQ pair on {n.input[0]}"
        seen.add(key)
        src = producers.get(n.input[0])
        if src is not None and src.op_type == "DequantizeLinear":
            same = np.array_equal(inits[src.input[1]], inits[n.input[1]]) and np.array_equal(
                inits[src.input[2]], inits[n.input[2]]
            )
            assert not same, f"Q after DQ with the same params at {n.name}"


def test_int8_file_size_ratio(resnet_exports: Any) -> None:
    final = next(r for r in resnet_exports if r.role == "final")
    base = next(r for r in resnet_exports if r.role == "baseline")
    assert final.size_bytes < 0.35 * base.size_bytes, (final.size_bytes, base.size_bytes)


def test_swap_is_equivalent_in_eager(quantized_resnet: torch.nn.Module) -> None:
    swapped, summary = swap_quantizers(quantized_resnet)
    assert summary.weights == 10 and summary.per_channel_weights == 10 and summary.activations > 0
    torch.manual_seed(4)
    x = torch.rand(8, 1, 8, 8) * 16
    np.testing.assert_allclose(swapped(x).detach().numpy(), quantized_resnet(x).detach().numpy(), atol=1e-4, rtol=0)
    # the original model is untouched: still fake-quantizers
    assert type(quantized_resnet.fc.weight_quantizer).__name__ == "FakeQuantizer"


def test_reduce_range_and_int8_activations(quantized_resnet: torch.nn.Module, tmp_path: Path) -> None:
    torch.manual_seed(5)
    x = torch.rand(16, 1, 8, 8) * 16
    p = export_onnx(quantized_resnet, x, tmp_path / "rr.onnx", reduce_range=True, activation_dtype="int8")
    m = onnx.load(str(p))
    inits = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    codes = [v for k, v in inits.items() if v.dtype == np.int8 and v.ndim >= 2]
    assert codes and all(c.min() >= -64 and c.max() <= 63 for c in codes)
    zps = [inits[n.input[2]] for n in m.graph.node if n.op_type == "QuantizeLinear"]
    assert zps and all(z.dtype == np.int8 for z in zps)
    # 7-bit weights cannot saturate u8s8/s8s8 products: integer kernels equal the float QDQ graph
    fused, exact = _run(p, {"input": x.numpy()}), _run(p, {"input": x.numpy()}, optimize=False)
    par = Parity()
    par.update(exact, fused)
    assert par.result()["sqnr_db"] >= 35.0, par.result()  # u8s8 8-bit weights reach only ~22 dB here
    assert (fused.argmax(1) == quantized_resnet(x).detach().numpy().argmax(1)).mean() >= 0.9


def test_bert_w8a8_uses_integer_matmuls(tiny_bert: Any, text_batch: Any, tmp_path: Path) -> None:
    from compress.quantization.api import quantize

    model = quantize(tiny_bert(), "w8a8", [text_batch(8, 12, seed=s) for s in range(3)])
    p = export_onnx(model, text_batch(4, 12, seed=9), tmp_path / "bert.int8.onnx")
    _, ops = integer_kernel_count(p)
    assert ops.get("MatMulIntegerToFloat", 0) + ops.get("QLinearMatMul", 0) + ops.get("QGemm", 0) >= 12, ops
    batch = text_batch(6, 10, seed=11)
    sess = ort.InferenceSession(str(p), providers=["CPUExecutionProvider"])
    feeds = {i.name: batch[i.name].numpy() for i in sess.get_inputs()}
    exact = _run(p, feeds, optimize=False)
    np.testing.assert_allclose(exact, model(**batch).last_hidden_state.detach().numpy(), atol=2e-3, rtol=0)
    par = Parity(classification=False)
    par.update(model(**batch).last_hidden_state.detach().numpy(), sess.run(None, feeds)[0])
    assert par.result()["cosine"] > 0.98


def test_bert_smoothquant_keeps_one_quantize_per_shared_input(tiny_bert: Any, text_batch: Any, tmp_path: Path) -> None:
    from compress.quantization.api import QuantizeParams, quantize

    calib = [text_batch(8, 12, seed=s) for s in range(3)]
    model = quantize(tiny_bert(), "w8a8", calib, params=QuantizeParams(smoothquant="auto"))
    p = export_onnx(model, text_batch(4, 12, seed=9), tmp_path / "bert.auto.onnx")
    _, ops = integer_kernel_count(p)
    assert ops.get("MatMulIntegerToFloat", 0) + ops.get("QLinearMatMul", 0) + ops.get("QGemm", 0) >= 12, ops
    smoothed = [q for q in model.quantizer_graph.placement.activations if q.startswith("m")]
    assert smoothed
    g = onnx.load(str(p)).graph
    cons: dict[str, list[Any]] = {}
    for n in g.node:
        for i in n.input:
            cons.setdefault(i, []).append(n)
    inits = {i.name for i in g.initializer}
    # smoothing Muls: a constant factor on the way into a QuantizeLinear (the int8 embedding rows'
    # per-row scale Muls feed one too, but their factor is gathered, not a constant)
    muls = [n for n in g.node if n.op_type == "Mul" and any(i in inits for i in n.input)
            and any(c.op_type == "QuantizeLinear" for c in cons.get(n.output[0], []))]
    # query/key/value share one smoothing: one Mul and one QuantizeLinear per smoothed group, each
    # on its own input tensor (the LayerNorm output is smoothed once, not once per Linear)
    assert len(muls) == len(smoothed) and len({m.input[0] for m in muls}) == len(muls), [m.name for m in muls]
    assert all(len([c for c in cons[m.output[0]] if c.op_type == "QuantizeLinear"]) == 1 for m in muls)


def test_dynamic_activation_quant_is_a_clear_error(tmp_path: Path) -> None:
    from compress.quantization.api import quantize

    from compress.models import build_zoo_model

    dyn = quantize(build_zoo_model("mlp", {"hidden": 16}).eval(), "w8a8_dynamic")
    with pytest.raises(ExportError, match="dynamic"):
        export_onnx(dyn, torch.randn(2, 1, 8, 8), tmp_path / "dyn.onnx")
    assert not (tmp_path / "dyn.onnx").exists()


def test_int8_embedding_tables(tmp_path: Path) -> None:
    from compress.quantization.api import quantize

    class Tagger(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(4096, 32)
            self.fc = torch.nn.Linear(32, 5)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.fc(self.emb(ids))

    from compress.quantization.api import QuantizeParams

    torch.manual_seed(0)
    calib = [torch.randint(0, 4096, (8, 12)) for _ in range(3)]
    # tables kept float at quantization time (the opt-out): the export pass stores them int8 on request
    model = quantize(Tagger().eval(), "w8a8", calib, params=QuantizeParams(quantize_embeddings=False))
    ids = torch.randint(0, 4096, (6, 12))
    plain = export_onnx(model, ids, tmp_path / "plain.onnx")
    small = export_onnx(model, ids, tmp_path / "small.onnx", quantize_embeddings=True)
    assert small.stat().st_size < 0.35 * plain.stat().st_size
    torch.manual_seed(0)  # by default the placement quantizes the table: as small, and the export pass is a no-op
    default = export_onnx(quantize(Tagger().eval(), "w8a8", calib), ids, tmp_path / "default.onnx")
    assert default.stat().st_size < 0.35 * plain.stat().st_size
    inits = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(small)).graph.initializer}
    assert any(v.dtype == np.int8 and v.shape == (4096, 32) for v in inits.values())
    a = _run(plain, {"input": ids.numpy()}, optimize=False)
    b = _run(small, {"input": ids.numpy()}, optimize=False)
    par = Parity()
    par.update(a, b)
    assert par.result()["sqnr_db"] > 25.0, par.result()


def test_weight_only_export_is_int8_but_float_compute(tmp_path: Path) -> None:
    from compress.export.pipeline import export_model
    from compress.quantization.api import quantize

    from compress.models import build_zoo_model
    from compress.recipe import ExportSpec

    torch.manual_seed(0)
    model = quantize(build_zoo_model("mlp", {"hidden": 256}).eval(), "w8_weight_only")
    x = torch.randn(4, 1, 8, 8)
    recs = export_model(model, x, ExportSpec(baseline=False), tmp_path)  # warns, does not fail
    assert recs[0].format == "onnx-int8-qdq" and recs[0].integer_nodes == 0
    out = _run(recs[0].path, {"input": x.numpy()})
    np.testing.assert_allclose(out, model(x).detach().numpy(), atol=1e-4, rtol=0)


@pytest.mark.parametrize(("bits", "reduce_range"), [(4, False), (4, True), (3, False)])
def test_low_bit_weights_with_signed_scales_run_in_integer_kernels(
    trained_resnet: torch.nn.Module, digits: Any, tmp_path: Path, bits: int, reduce_range: bool
) -> None:
    """w4a8 / w3a8: low-bit per-channel weights put each channel's larger end on qmin, so about half
    the scales are negative. The file stores positive scales (the codes negated) and ORT's
    QLinearConv/QGemm compute what the fake-quant model does; 4-bit codes already fit reduce_range's
    7 bits."""
    from compress.quantization.api import quantize

    scheme = {"weights": {"bits": bits, "granularity": "channel"}, "inputs": {}}
    q = quantize(copy.deepcopy(trained_resnet), scheme, digits.calibration).eval()
    scales = [m.weight_quantizer.scale for m in q.modules() if getattr(m, "weight_quantizer", None) is not None]
    assert any(bool((s < 0).any()) for s in scales) and any(bool((s > 0).any()) for s in scales)
    p = export_onnx(q, next(iter(digits.eval))[0], tmp_path / "w4a8.onnx", reduce_range=reduce_range)
    graph = onnx.load(str(p)).graph
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    weight_dq = [n for n in graph.node if n.op_type == "DequantizeLinear" and inits.get(n.input[0]) is not None
                 and inits[n.input[0]].ndim >= 2]
    assert weight_dq and all(float(inits[n.input[1]].min()) > 0 for n in weight_dq)
    top = 2 ** (bits - 1)  # the negated codes reach +top
    assert all(int(inits[n.input[0]].min()) >= -top and int(inits[n.input[0]].max()) <= top for n in weight_dq)
    assert integer_kernel_count(p)[1].get("QLinearConv", 0) >= 1
    res = _eval_parity(q, p, digits)
    assert res["top1_agreement"] >= 0.99 and res["sqnr_db"] >= 30.0, res


def test_int4_group_weights_run_as_matmulnbits(tmp_path: Path) -> None:
    from compress.quantization.api import quantize

    from compress.models import build_zoo_model

    torch.manual_seed(0)
    fp32 = build_zoo_model("mlp", {"hidden": 256}).eval()
    x = torch.randn(5, 1, 8, 8)
    base = export_onnx(fp32, x, tmp_path / "fp32.onnx")
    model = quantize(copy.deepcopy(fp32), "w4_weight_only_g128")
    path = export_onnx(model, x, tmp_path / "int4.onnx")
    m = onnx.load(str(path))
    assert next(o.version for o in m.opset_import if o.domain in ("", "ai.onnx")) >= 21
    int4 = [i for i in m.graph.initializer if i.data_type == onnx.TensorProto.INT4]
    assert len(int4) == 6  # codes and zero points of the 3 Linear layers
    assert path.stat().st_size < 0.2 * base.stat().st_size
    _, ops = integer_kernel_count(path)
    assert ops == {"MatMulNBits": 3}
    exact = _run(path, {"input": x.numpy()}, optimize=False)
    ref = model(x).detach().numpy()
    np.testing.assert_allclose(exact, ref, atol=1e-5, rtol=0)
    # the fused MatMulNBits reads the signed group scales as the DequantizeLinear does (accuracy level
    # 0: float activations; ORT's default for the fusion, 4, rounds them to int8 and moves ~1%)
    assert any(bool((m.weight_quantizer.scale < 0).any()) for m in model.modules() if hasattr(m, "weight_quantizer"))
    so = ort.SessionOptions()
    so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
    fused = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, {"input": x.numpy()})[0]
    np.testing.assert_allclose(fused, ref, atol=1e-5, rtol=0)
    with pytest.raises(ExportError, match="opset >= 21"):
        export_onnx(model, x, tmp_path / "old.onnx", opset=20)


def test_bias_that_overflows_int32_keeps_its_value(tmp_path: Path) -> None:
    """A channel with zero weights behind a tiny activation scale: ``bias / (s_x * s_w)`` is far past
    int32. The export raises that channel's weight scale; the bias must survive into ORT."""
    from compress.quantization import quantize

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, 3, padding=1)
    with torch.no_grad():
        conv.weight[1].zero_()
        conv.bias.copy_(torch.tensor([0.1, 0.5, -0.2, 0.3]))
    model = torch.nn.Sequential(conv, torch.nn.ReLU(), torch.nn.Conv2d(4, 4, 1)).eval()
    calib = [torch.randn(2, 3, 8, 8) * 1e-9 for _ in range(2)]
    q = quantize(model, {"preset": "w8a8", "weights": {"reduce_range": True}}, calib)
    path = export_onnx(q, calib[0], tmp_path / "m.int8.onnx")
    out = _run(path, {"input": calib[0].numpy()})
    with torch.no_grad():
        ref = q(calib[0]).numpy()
    assert np.allclose(out, ref, atol=0.02 * np.abs(ref).max()), (out.mean((0, 2, 3)), ref.mean((0, 2, 3)))
    assert integer_kernel_count(path)[1].get("QLinearConv") == 1  # the second conv is the model output


def test_7bit_record_ignores_the_int8_embedding_tables(tmp_path: Path) -> None:
    """Weights calibrated to 7-bit codes make the record's reduce_range true (no u8s8 saturation
    note) even though the embedding tables, which feed Gathers, keep full 8-bit rows."""
    from compress.export.pipeline import export_model
    from compress.quantization.api import quantize
    from transformers import BertConfig, BertModel

    from compress.recipe import ExportSpec

    torch.manual_seed(0)
    m = BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                             vocab_size=100)).eval()
    data = [{"input_ids": torch.randint(0, 100, (2, 8)), "attention_mask": torch.ones(2, 8, dtype=torch.long)}
            for _ in range(2)]
    q = quantize(m, {"preset": "w8a8", "weights": {"reduce_range": True}}, data)
    tables = [u for u in q.quantizer_graph.placement.weights.values() if u.table]
    assert tables  # word, position and token-type tables are int8
    (rec,) = export_model(q, data[0], ExportSpec(baseline=False), tmp_path)
    assert rec.reduce_range is True


def test_a_bf16_causal_lm_exports_as_float32_and_keeps_its_dtype(tmp_path: Path) -> None:
    """LLMs are loaded in bf16 with a KV cache on: the single-pass export widens the weights to
    float32 (ORT's CPU kernels and Q/DQ scales are float32), asks for no cache, and gives the model
    back unchanged (bf16, use_cache on)."""
    from compress.export.onnx import export_onnx
    from compress.quantization.api import quantize
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=128)).eval().to(torch.bfloat16)
    data = [{"input_ids": torch.randint(0, 128, (2, 16))} for _ in range(2)]
    q = quantize(m, {"preset": "w8a8", "weights": {"reduce_range": True}}, data, ignore=["lm_head"])
    before = {n: (p.dtype, p.detach().clone()) for n, p in q.state_dict().items() if isinstance(p, torch.Tensor)}
    path = export_onnx(q, data[0], tmp_path / "m.int8.onnx")
    after = q.state_dict()
    assert all(after[n].dtype == dt and torch.equal(after[n], t) for n, (dt, t) in before.items())
    assert q.config.use_cache and q.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    out = _run(path, {"input_ids": data[0]["input_ids"].numpy()})
    with torch.no_grad():
        ref = q(**data[0]).logits.float().numpy()
    # the export checked ORT against the widened model itself (it raises otherwise); against the bf16
    # model, bf16 rounding flips some codes
    sqnr = 10 * np.log10((ref**2).sum() / ((out - ref) ** 2).sum())
    assert sqnr > 20, sqnr
