"""Data movement between per-tensor Q/DQ pairs runs on the integer codes (export/qdq/moves.py
``moves_on_codes``): torch.roll's Slice + Concat and F.pad's Pad, which ORT would otherwise run in
float between a DequantizeLinear and the next QuantizeLinear (issue 32)."""

from __future__ import annotations

import copy
from pathlib import Path

import compress.export.qdq.moves as qdq_moves
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from compress.export.onnx import export_onnx
from compress.export.qdq.ir import QdqGraph
from compress.export.validation.runtimes import ort_coverage
from compress.quantization import QuantizeParams
from onnx import TensorProto, helper, numpy_helper

import compress
from benchmarks.pattern_models import window_transformer


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return np.asarray(sess.run(None, {"x": x})[0])


def _roll_graph(*, second_scale: float = 0.05, out_scale: float = 0.05, pad_value: float | None = 0.0) -> onnx.ModelProto:
    """x -> Q -> DQ -> (Pad) -> roll by 1 on the last axis (Slice, Slice, Concat) -> Q -> DQ -> y,
    the second half dequantized with ``second_scale``; the output quantized with ``out_scale``."""
    inits = [numpy_helper.from_array(np.array(v, dtype=dt), n) for n, v, dt in [
        ("s", 0.05, np.float32), ("s2", second_scale, np.float32), ("so", out_scale, np.float32),
        ("z", 128, np.uint8), ("pads", [0, 0, 0, 2], np.int64), ("fill", pad_value or 0.0, np.float32),
        ("a0", [0], np.int64), ("a1", [1], np.int64), ("e", [np.iinfo(np.int64).max], np.int64), ("ax", [1], np.int64)]]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
        helper.make_node("DequantizeLinear", ["xq", "s2", "z"], ["xd2"]),
    ]
    src = "xd"
    if pad_value is not None:
        nodes.append(helper.make_node("Pad", ["xd", "pads", "fill"], ["xp"], mode="constant"))
        src = "xp"
    nodes += [
        helper.make_node("Slice", [src, "a1", "e", "ax"], ["tail"]),
        helper.make_node("Slice", ["xd2", "a0", "a1", "ax"], ["head"]),
        helper.make_node("Concat", ["tail", "head"], ["r"], axis=1),
        helper.make_node("QuantizeLinear", ["r", "so", "z"], ["rq"]),
        helper.make_node("DequantizeLinear", ["rq", "so", "z"], ["y"]),
    ]
    g = helper.make_graph(nodes, "roll", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, None])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)])


def _tidied(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    m = copy.deepcopy(model)
    done = qdq_moves.moves_on_codes(QdqGraph(m.graph))
    onnx.checker.check_model(m)
    return m, done


X = np.linspace(-3, 3, 12, dtype=np.float32).reshape(2, 6)


def test_roll_and_zero_pad_run_on_codes_and_compute_the_same() -> None:
    before = _roll_graph(second_scale=0.05)
    after, done = _tidied(before)
    ops = [n.op_type for n in after.graph.node]
    assert done >= 1 and ops.count("QuantizeLinear") == 1 and ops.count("DequantizeLinear") == 1, ops
    # the one DQ is the output's: Pad, Slices and Concat read integer codes
    assert ops[-1] == "DequantizeLinear", ops
    fill = next(n for n in after.graph.node if n.op_type == "Pad").input[2]
    assert numpy_helper.to_array(next(i for i in after.graph.initializer if i.name == fill)) == 128
    np.testing.assert_array_equal(_run(after, X), _run(before, X))


@pytest.mark.parametrize("what", ["other input scale", "other output scale", "padded with 1.0"])
def test_moves_stay_float_where_the_codes_would_change_meaning(what: str) -> None:
    kw = {"other input scale": {"second_scale": 0.1}, "other output scale": {"out_scale": 0.1},
          "padded with 1.0": {"pad_value": 1.0}}[what]
    before = _roll_graph(**kw)  # type: ignore[arg-type]
    after, _ = _tidied(before)
    cat = next(n for n in after.graph.node if n.op_type == "Concat")
    producers = {o: n for n in after.graph.node for o in n.output}
    # the Concat still joins dequantized (float) tensors: requantizing is ORT's QLinearConcat's job
    assert all(producers[i].op_type != "QuantizeLinear" for i in cat.input)
    np.testing.assert_array_equal(_run(after, X), _run(before, X))


@pytest.mark.slow  # 61 s in a full run: a window transformer quantized, exported twice, run in ORT
def test_window_transformer_rolls_and_pads_leave_no_float_moves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pm = window_transformer(0, size=32, batch=2, n=2, dim=16, heads=(2, 2))
    # served at batch 32: its residual stream and patch-merging concat stay on codes (at batch 1 they
    # return to float beside Linears that write float: without a cost table, integer_chains.FLOAT_WRITER_BATCH)
    q = compress.quantize(pm.model, "w8a8", pm.calibration, params=QuantizeParams(batch_sizes=(32,)))
    new, old = tmp_path / "new.onnx", tmp_path / "old.onnx"
    export_onnx(q, pm.example, new)
    monkeypatch.setattr(qdq_moves, "moves_on_codes", lambda g: 0)
    export_onnx(q, pm.example, old)
    cov_new, cov_old = ort_coverage(new), ort_coverage(old)
    assert cov_old.float_left.get("Concat", 0) > 0, cov_old.float_left  # what the pass is for
    assert "Concat" not in cov_new.float_left and cov_new.integer_ops.get("Concat (codes)", 0) > 0, cov_new
    float_pads = [n for n in onnx.load(str(new)).graph.node if n.op_type == "Pad"
                  and n.input[0] in {d.output[0] for d in onnx.load(str(new)).graph.node if d.op_type == "DequantizeLinear"}]
    assert not float_pads
    x = np.random.default_rng(3).standard_normal((2, 3, 32, 32)).astype(np.float32)
    outs = [ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, {"input": x})[0] for p in (old, new)]
    np.testing.assert_array_equal(outs[0], outs[1])  # moving codes is exact
