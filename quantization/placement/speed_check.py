"""Measured placement: keep a layer float where ONNX Runtime's integer kernel is slower than its float one.

Whether int8 pays off is a property of the runtime's kernels at a shape, not of the layer type:
on ORT's CPU provider a 3-channel stem conv or an 8-channel conv runs slower as QLinearConv than
as fp32's blocked (NCHWc) Conv, while 32+ channel convs win 1.1-2.4x (benchmarks/RESULTS.md). No
static channel rule is right at both toy and serving widths, so each candidate layer is timed.

For every Linear/Conv1d/Conv2d the placement would quantize, two one-layer ONNX graphs are built at
the layer's traced input shape (the batch scaled to ``batch``), both between a Q and a DQ that
stand for int8 neighbours: the float layer (its own DQ, layout reorders and Q around it) and its
QDQ form as compress exports it (int8 per-channel weights), which ORT fuses to QLinearConv / QGemm.
Both run in ORT with per-node profiling, and the per-node medians are summed into what each choice
costs inside the model (:func:`_island_cost`: the int8 side pays the input's Q only at a model
input and the output's DQ only at a model output). A layer whose int8 side is not ``min_speedup``
times faster stays float, its times given as the reason in ``placement.floats``, unless a max-pool
follows it: ORT's QDQ propagation would move the pool's quantizer above the pool and run it on uint8
in NCHW layout, many times slower than what the float layer saves.
"""

from __future__ import annotations

import collections
import json
import logging
import statistics
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from compress.quantization.placement.trace import OpGraph, OpNode
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from compress.core.errors import CompressError
from compress.core.ort import inference_session, session_options

log = logging.getLogger(__name__)

#: nodes around the kernel that a one-layer graph needs but a model shares or fuses away
_BOUNDARY = frozenset({"QuantizeLinear", "DequantizeLinear", "ReorderInput", "ReorderOutput", "Transpose",
                       "Reshape", "Identity"})


class SpeedCheck(BaseModel):
    """Time each layer's ORT integer kernel against its float kernel and keep the losers float.

    ``batch``: the serving batch the decision is for (default: the calibration batch traced);
    ``threads``: ORT intra-op threads, as the model will be served; ``min_speedup``: the int8 kernel
    must be at least this many times faster than the float one; ``runs``: profiled runs per graph
    (the first two are dropped as warm-up).
    """

    model_config = ConfigDict(extra="forbid")

    batch: int | None = Field(None, ge=1)
    threads: int = Field(1, ge=1)
    min_speedup: float = Field(1.0, gt=0)
    runs: int = Field(12, ge=4)


@dataclass
class LayerTiming:
    """One layer's kernels in ORT: float and int8 medians in microseconds, at ``shape``."""

    layer: str
    shape: list[int]
    float_op: str
    float_us: float
    int8_op: str
    int8_us: float
    pooled: bool = False

    @property
    def speedup(self) -> float:
        return self.float_us / max(self.int8_us, 1e-9)

    def reason(self) -> str:
        return (f"kept float by measured placement: ORT {self.int8_op} {self.int8_us:.0f} us vs float "
                f"{self.float_op} {self.float_us:.0f} us ({self.speedup:.2f}x) at input {self.shape}")



@dataclass(frozen=True)
class LayerCall:
    """A layer's first traced call: its data input shape, whether it reads a model input or writes a
    model output, and whether a max-pool follows it (through one-input ops: BatchNorm, activation)."""

    shape: tuple[int, ...]
    model_input: bool = False
    model_output: bool = False
    pooled: bool = False


def layer_calls(graph: OpGraph, layers: Mapping[str, nn.Module]) -> dict[str, LayerCall]:
    """The :class:`LayerCall` of each layer of ``layers`` called in ``graph``."""
    outputs = {f"{k}/{i}" for k, i in graph.outputs}
    readers: dict[str, list[OpNode]] = collections.defaultdict(list)
    for n in graph.nodes.values():
        for o in n.operands:
            if o.source == "op" and o.producer is not None:
                readers[f"{o.producer}/{o.index}"].append(n)

    def pooled(t: str) -> bool:
        while len(readers.get(t, [])) == 1:
            nxt = readers[t][0]
            if nxt.kind == "max_pool":
                return True
            if sum(o.source in ("op", "input") and o.floating for o in nxt.operands) != 1:
                return False
            t = f"{nxt.key}/0"
        return False

    calls: dict[str, LayerCall] = {}
    for n in graph.nodes.values():
        if n.scope in layers and n.scope not in calls and n.kind in ("linear", "conv"):
            data = next((o for o in n.operands if o.position == 0), None)
            if data is not None and data.shape:
                out = f"{n.key}/0"
                calls[n.scope] = LayerCall(tuple(data.shape), data.source == "input", out in outputs, pooled(out))
    return calls


def _scaled(shape: tuple[int, ...], example_batch: int | None, batch: int | None) -> list[int]:
    out = list(shape)
    if batch is not None and example_batch and out and out[0] % example_batch == 0:
        out[0] = out[0] // example_batch * batch
    return out


def _conv_attrs(m: nn.Conv1d | nn.Conv2d) -> dict[str, Any]:
    k, d = list(m.kernel_size), list(m.dilation)
    if m.padding == "valid":
        begin, end = [0] * len(k), [0] * len(k)
    elif m.padding == "same":  # torch pads the extra element at the end, as ONNX's SAME_UPPER
        total = [di * (ki - 1) for di, ki in zip(d, k, strict=True)]
        begin = [t // 2 for t in total]
        end = [t - b for t, b in zip(total, begin, strict=True)]
    else:
        begin = end = list(m.padding)  # type: ignore[arg-type]
    return {"strides": list(m.stride), "pads": begin + end, "dilations": d, "group": m.groups}


def _pad_sums(pads: list[int]) -> list[int]:
    half = len(pads) // 2
    return [a + b for a, b in zip(pads[:half], pads[half:], strict=True)]


def _graphs(m: nn.Module, shape: list[int]) -> tuple[Any, Any, list[int]] | None:
    """(float model, QDQ model, input shape) for one layer, or None for a layer this does not time."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    if isinstance(m, nn.Linear):
        in_shape = [int(np.prod(shape[:-1])), m.in_features]
        w = rng.standard_normal((m.in_features, m.out_features)).astype(np.float32) * 0.05
        b = rng.standard_normal(m.out_features).astype(np.float32)
        out_shape = [in_shape[0], m.out_features]

        def body(win: str) -> list[Any]:
            return [helper.make_node("MatMul", ["x_in", win], ["mm"]), helper.make_node("Add", ["mm", "b"], ["y_out"])]
        axis = 1
    elif isinstance(m, (nn.Conv1d, nn.Conv2d)) and m.padding_mode == "zeros":
        in_shape = list(shape)
        w = rng.standard_normal(tuple(m.weight.shape)).astype(np.float32) * 0.05
        b = rng.standard_normal(m.out_channels).astype(np.float32)
        attrs = _conv_attrs(m)
        out_shape = [in_shape[0], m.out_channels] + [
            (s + p - d * (k - 1) - 1) // st + 1
            for s, p, d, k, st in zip(in_shape[2:], _pad_sums(attrs["pads"]), attrs["dilations"], m.kernel_size,
                                      attrs["strides"], strict=False)
        ]

        def body(win: str) -> list[Any]:
            return [helper.make_node("Conv", ["x_in", win, "b"], ["y_out"], **attrs)]
        axis = 0
    else:
        return None
    if m.bias is None:
        b = np.zeros_like(b)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, in_shape)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)
    xs, ys = np.float32(4.0 / 255), np.float32(8.0 / 255)
    act = [numpy_helper.from_array(np.array(xs), "x_s"), numpy_helper.from_array(np.array(128, np.uint8), "x_zp"),
           numpy_helper.from_array(np.array(ys), "y_s"), numpy_helper.from_array(np.array(128, np.uint8), "y_zp")]
    # both graphs sit between int8 neighbours: Q(x) stands for the producer's quantized output and
    # DQ(y) for the consumer's input; a float layer there pays DQ, layout reorders and Q of its own
    q_in = [helper.make_node("QuantizeLinear", ["x", "x_s", "x_zp"], ["xq"]),
            helper.make_node("DequantizeLinear", ["xq", "x_s", "x_zp"], ["x_in"])]
    q_out = [helper.make_node("QuantizeLinear", ["y_out", "y_s", "y_zp"], ["yq"]),
             helper.make_node("DequantizeLinear", ["yq", "y_s", "y_zp"], ["y"])]
    float_graph = helper.make_graph(
        [*q_in, *body("w"), *q_out], "float_layer", [x], [y],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b"), *act],
    )
    # the QDQ form compress exports: per-tensor uint8 activations, per-channel int8 weights, int32 bias
    wscale = (np.abs(w).max(axis=1 - axis if w.ndim == 2 else tuple(range(1, w.ndim))) / 127).astype(np.float32)
    codes = np.clip(np.round(w / np.expand_dims(wscale, tuple(i for i in range(w.ndim) if i != axis))), -127, 127)
    bias_q = np.round(b / (xs * wscale)).astype(np.int32) if axis == 0 else None
    inits = [
        numpy_helper.from_array(codes.astype(np.int8), "w_q"), numpy_helper.from_array(wscale, "w_s"),
        numpy_helper.from_array(np.zeros_like(wscale, dtype=np.int8), "w_zp"), *act,
    ]
    nodes = [*q_in, helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_zp"], ["w_dq"], axis=axis)]
    if bias_q is not None:  # a conv's bias is int32 at scale x_s * w_s, as ORT's QLinearConv takes it
        inits += [numpy_helper.from_array(bias_q, "b_q"), numpy_helper.from_array((xs * wscale).astype(np.float32), "b_s"),
                  numpy_helper.from_array(np.zeros(len(wscale), np.int32), "b_zp")]
        nodes.append(helper.make_node("DequantizeLinear", ["b_q", "b_s", "b_zp"], ["b"], axis=0))
    else:
        inits.append(numpy_helper.from_array(b, "b"))
    nodes += [*body("w_dq"), *q_out]
    qdq_graph = helper.make_graph(nodes, "int8_layer", [x], [y], inits)
    opset = [helper.make_opsetid("", 17)]
    return (helper.make_model(float_graph, opset_imports=opset), helper.make_model(qdq_graph, opset_imports=opset),
            in_shape)


def _profile(model: Any, shape: list[int], *, threads: int, runs: int, tmp: Path, tag: str) -> list[tuple[str, float]]:
    """``(op, median microseconds)`` of each node ORT ran for ``model``, in execution order."""
    # the float model with quantize_qdq off: else ORT quantizes the float weight itself and fuses
    # DQ -> Conv -> Q into QLinearConv
    so = session_options(threads=threads, profile_prefix=tmp / tag, quantize_qdq=tag != "float")
    sess = inference_session(model.SerializeToString(), so, wrap_errors=False)
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    for _ in range(runs):
        sess.run(None, {"x": x})
    events = json.loads(Path(sess.end_profiling()).read_text())
    per: dict[str, list[float]] = collections.defaultdict(list)
    first: dict[str, tuple[float, str]] = {}
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            per[e["name"]].append(float(e["dur"]))
            first.setdefault(e["name"], (float(e["ts"]), e.get("args", {}).get("op_name", "")))
    order = sorted(per, key=lambda n: first[n][0])
    return [(first[n][1], statistics.median(per[n][2:] or per[n])) for n in order]


def _island_cost(nodes: list[tuple[str, float]], *, kept_float: bool, model_input: bool, model_output: bool,
                 tag: str) -> tuple[str, float]:
    """What the layer costs inside a model whose other layers are int8: ``nodes`` is a one-layer
    profile ``Q(x) ... kernel ... DQ(y)``, where Q(x) and DQ(y) stand for the int8 neighbours.

    A float layer pays its own conversions and layout reorders (DQ, reorder before; reorder, Q after);
    an int8 layer pays none between int8 neighbours (ORT keeps a chain in NHWC), but at a model
    input it quantizes (and transposes) the input and at a model output it dequantizes its result.
    """
    kernel, enter, leave, before, after = _split(nodes, tag)
    cost = sum(us for _, us in kernel)
    if kept_float:
        cost += (0.0 if model_input else before) + (0.0 if model_output else after)
    else:
        cost += (enter if model_input else 0.0) + (leave if model_output else 0.0)
    return "+".join(dict.fromkeys(op for op, _ in kernel)), cost


def boundary_costs(nodes: list[tuple[str, float]], *, tag: str) -> tuple[float, float]:
    """``(enter, leave)`` microseconds of an int8 layer's profile ``Q(x) ... kernel ... DQ(y)``: what
    entering int8 costs before its kernel (the input's QuantizeLinear and the layout transpose ORT
    adds for an NHWC QLinearConv) and what leaving it costs after (transpose back, DequantizeLinear);
    between int8 neighbours neither is paid (:func:`_island_cost`)."""
    _, enter, leave, _, _ = _split(nodes, tag)
    return enter, leave


def _split(nodes: list[tuple[str, float]], tag: str) -> tuple[list[tuple[str, float]], float, float, float, float]:
    """A one-layer profile cut into (kernel nodes, Q(x) + nodes before the kernel, nodes after the
    kernel + DQ(y), nodes before the kernel, nodes after it)."""
    ops = [op for op, _ in nodes]
    if "QuantizeLinear" not in ops or "DequantizeLinear" not in ops:
        raise CompressError(f"measured placement: ORT's profile of the {tag} layer lost its boundary nodes: {ops}")
    i0, i1 = ops.index("QuantizeLinear"), len(ops) - 1 - ops[::-1].index("DequantizeLinear")
    inner = nodes[i0 + 1:i1]
    kernels = [i for i, (op, _) in enumerate(inner) if op not in _BOUNDARY]
    if not kernels:
        raise CompressError(f"measured placement: ORT's profile of the {tag} layer has no kernel: {ops}")
    k0, k1 = kernels[0], kernels[-1]
    before = sum(us for _, us in inner[:k0])
    after = sum(us for _, us in inner[k1 + 1:])
    return inner[k0:k1 + 1], nodes[i0][1] + before, after + nodes[i1][1], before, after


def time_layers(
    layers: Mapping[str, nn.Module], calls: Mapping[str, LayerCall], check: SpeedCheck, *,
    example_batch: int | None,
) -> list[LayerTiming]:
    """Time each layer of ``layers`` (name -> float Linear/Conv) that has a call in ``calls``
    (:func:`layer_calls`; whether it reads a model input or writes a model output decides which
    conversions each side pays, :func:`_island_cost`)."""
    out: list[LayerTiming] = []
    with tempfile.TemporaryDirectory(prefix="compress_measured_") as d:
        for name, mod in layers.items():
            if name not in calls:
                continue
            call = calls[name]
            built = _graphs(mod, _scaled(call.shape, example_batch, check.batch))
            if built is None:
                continue
            float_model, qdq_model, in_shape = built
            costs = [
                _island_cost(_profile(g, in_shape, threads=check.threads, runs=check.runs, tmp=Path(d), tag=tag),
                             kept_float=tag == "float", model_input=call.model_input,
                             model_output=call.model_output, tag=tag)
                for g, tag in ((float_model, "float"), (qdq_model, "int8"))
            ]
            out.append(LayerTiming(name, in_shape, costs[0][0], costs[0][1], costs[1][0], costs[1][1], call.pooled))
    return out


def slower_in_int8(timings: list[LayerTiming], check: SpeedCheck) -> dict[str, str]:
    """``{layer: reason}`` for the layers whose int8 kernel is not ``check.min_speedup`` times faster."""
    slower = [t for t in timings if t.speedup < check.min_speedup]
    # a float layer's max-pool would run on uint8 in NCHW: ORT moves the Q after the pool above it
    # (QDQ propagation), and its uint8 NCHW MaxPool measured 8.9 ms where the int8 chain's NHWC one
    # took 0.3 ms (HF ResNet stem, batch 32), far more than the conv itself saves
    pooled = [t.layer for t in slower if t.pooled]
    if pooled:
        log.info("measured placement: %s stay int8 though slower alone: a max-pool follows them", ", ".join(pooled))
    slow = {t.layer: t.reason() for t in slower if not t.pooled}
    log.info("measured placement: %d of %d layers keep float (int8 kernel not %.2fx faster in ORT)", len(slow),
             len(timings), check.min_speedup)
    return slow
