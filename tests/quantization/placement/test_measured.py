"""Measured placement: one-layer ORT graphs, the island cost accounting, and its use in quantize."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from compress.export.onnx import export_onnx
from compress.export.validation.runtimes import ort_coverage
from compress.quantization import QuantizeParams, quantize
from compress.quantization.placement.speed_check import (
    LayerCall,
    SpeedCheck,
    _graphs,
    _island_cost,
    _profile,
    layer_calls,
    time_layers,
)
from compress.quantization.placement.trace import trace_ops
from torch import nn

from compress.core.errors import CompressError


def _run(model: onnx.ModelProto, x: np.ndarray, *, disable_qdq: bool = False) -> np.ndarray:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if disable_qdq:
        so.add_session_config_entry("session.disable_quant_qdq", "1")
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return np.asarray(sess.run(None, {"x": x})[0])


@pytest.mark.parametrize(
    ("layer", "shape"),
    [(nn.Conv2d(8, 16, 3, 2, 1), [4, 8, 12, 12]), (nn.Conv2d(16, 16, 3, 1, 1, groups=16), [2, 16, 8, 8]),
     (nn.Conv1d(8, 12, 3, padding=1, bias=False), [2, 8, 20]), (nn.Linear(32, 48), [2, 5, 32]),
     (nn.Conv2d(8, 8, (3, 4), padding="same"), [2, 8, 9, 10])],
)
def test_timed_graphs_compute_the_layer_and_fuse_to_integer_kernels(layer: nn.Module, shape: list[int],
                                                                     tmp_path: Path) -> None:
    built = _graphs(layer, shape)
    assert built is not None
    float_model, qdq_model, in_shape = built
    onnx.checker.check_model(float_model, full_check=True)
    onnx.checker.check_model(qdq_model, full_check=True)
    x = np.random.default_rng(0).uniform(-0.5, 0.5, in_shape).astype(np.float32)
    ref, q = _run(float_model, x, disable_qdq=True), _run(qdq_model, x)
    sqnr = 10 * np.log10((ref**2).mean() / ((ref - q) ** 2).mean())
    assert sqnr > 20, sqnr  # the int8 graph is the same layer, quantized
    float_ops = [op for op, _ in _profile(float_model, in_shape, threads=1, runs=4, tmp=tmp_path, tag="float")]
    int8_ops = [op for op, _ in _profile(qdq_model, in_shape, threads=1, runs=4, tmp=tmp_path, tag="int8")]
    assert not any(op.startswith(("QLinear", "QGemm")) for op in float_ops), float_ops
    assert any(op in ("QLinearConv", "QGemm") for op in int8_ops), int8_ops


def test_island_cost_counts_each_sides_conversions() -> None:
    float_nodes = [("QuantizeLinear", 10.0), ("DequantizeLinear", 3.0), ("ReorderInput", 2.0), ("Conv", 100.0),
                   ("ReorderOutput", 5.0), ("QuantizeLinear", 7.0), ("DequantizeLinear", 11.0)]
    int8_nodes = [("QuantizeLinear", 10.0), ("Transpose", 4.0), ("QLinearConv", 60.0), ("Transpose", 6.0),
                  ("DequantizeLinear", 11.0)]

    def cost(nodes: list[tuple[str, float]], kept_float: bool, i: bool, o: bool) -> float:
        return _island_cost(nodes, kept_float=kept_float, model_input=i, model_output=o, tag="t")[1]

    # between int8 neighbours: a float layer pays DQ + reorders + Q, an int8 one only its kernel
    assert cost(float_nodes, True, False, False) == 3 + 2 + 100 + 5 + 7
    assert cost(int8_nodes, False, False, False) == 60
    # at a model input the int8 layer quantizes (and transposes) it; the float one reads it as it is
    assert cost(float_nodes, True, True, False) == 100 + 5 + 7
    assert cost(int8_nodes, False, True, False) == 10 + 4 + 60
    assert cost(int8_nodes, False, True, True) == 10 + 4 + 60 + 6 + 11
    assert _island_cost(int8_nodes, kept_float=False, model_input=False, model_output=False, tag="t")[0] == "QLinearConv"
    with pytest.raises(CompressError, match="no kernel"):
        _island_cost([("QuantizeLinear", 1.0), ("DequantizeLinear", 1.0)], kept_float=True, model_input=False,
                     model_output=False, tag="t")


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    ).eval()


def _data(n: int = 3, batch: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(batch, 3, 16, 16, generator=g) for _ in range(n)]


def test_layer_calls_scale_the_batch_and_mark_model_edges() -> None:
    m = _net()
    layers = {n: mod for n, mod in m.named_modules() if isinstance(mod, (nn.Conv2d, nn.Linear))}
    calls = layer_calls(trace_ops(m, (_data(1)[0],), {}), layers)
    assert calls["0"] == LayerCall((4, 3, 16, 16), model_input=True, pooled=True)  # conv -> relu -> max-pool
    assert calls["3"] == LayerCall((4, 16, 8, 8))
    assert calls["9"] == LayerCall((4, 32), model_output=True)
    timings = time_layers({"3": layers["3"]}, calls, SpeedCheck(batch=8, runs=4), example_batch=4)
    assert [t.shape for t in timings] == [[8, 16, 8, 8]]
    assert timings[0].float_us > 0 and timings[0].int8_us > 0 and timings[0].int8_op == "QLinearConv"


def test_speed_check_keeps_layers_float_with_the_times_as_reason(tmp_path: Path) -> None:
    # min_speedup far above any real kernel's: every layer must stay float, whatever the machine,
    # except conv 0, whose max-pool ORT would then run on uint8 in NCHW (QDQ propagation)
    q = quantize(_net(), "w8a8", _data(), params=QuantizeParams(speed_check=SpeedCheck(min_speedup=1e6, runs=4)))
    floats = q.quantizer_graph.placement.floats
    measured = {k: v for k, v in floats.items() if v.startswith("kept float by measured placement")}
    assert set(measured) == {"3:conv#0", "5:conv#0", "9:linear#0"}, floats
    assert all(" us vs float " in v and "at input [4, " in v for v in measured.values())
    assert all(type(q.get_submodule(n)) in (nn.Conv2d, nn.Linear) for n in ("3", "5", "9"))
    assert type(q.get_submodule("0")) is not nn.Conv2d
    # and a bar every int8 kernel clears keeps everything int8
    q2 = quantize(_net(), "w8a8", _data(), params=QuantizeParams(speed_check=SpeedCheck(min_speedup=1e-6, runs=4)))
    assert not any(v.startswith("kept float by measured") for v in q2.quantizer_graph.placement.floats.values())
    cov = ort_coverage(export_onnx(q2, _data(1)[0], tmp_path / "m.int8.onnx"))
    assert cov.integer_ops.get("QLinearConv") == 3, cov.integer_ops


@pytest.mark.parametrize(
    ("scheme", "params", "match"),
    [("w8a8", QuantizeParams(runtime="tensorrt", speed_check=SpeedCheck()), "runtime is tensorrt"),
     ("w8a8_dynamic", QuantizeParams(speed_check=SpeedCheck()), "static activations")],
)
def test_speed_check_refuses_what_it_cannot_time(scheme: str, params: QuantizeParams, match: str) -> None:
    with pytest.raises(CompressError, match=match):
        quantize(_net(), scheme, _data(), params=params)
