"""QDQ export of fake-quant models: swap quantizers for ONNX Q/DQ ops, then tidy the graph for ORT.

Why a swap rather than exporting ``torch.fake_quantize_*``: torch.export has no fake-tensor kernel
for ``fake_quantize_*_cachemask``, and decomposed float math would hide the quantization from
runtimes. On a deep copy of the model each FakeQuantizer becomes a small module that calls one of
two custom ops, translated to ``QuantizeLinear``/``DequantizeLinear`` by the dynamo exporter:

- a weight quantizer becomes ``DequantizeLinear(int8 initializer)``: the codes are computed once,
  so the file stores int8 weights (about 4x smaller) and never a float copy;
- an activation quantizer becomes a ``QuantizeLinear -> DequantizeLinear`` pair, in uint8 by
  default (u8s8 is what ORT's x86 kernels want without VNNI; the zero-point shift is exact).

The graph passes then transpose weights into the layout their consumer reads, quantize biases to
int32 (ORT fuses a Conv/Gemm into an integer kernel only when every input comes from a
DequantizeLinear), merge duplicate pairs and drop pairs that re-quantize with identical params.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper
from torch import nn

from compress.errors import ExportError

log = logging.getLogger(__name__)

ActDtype = Literal["uint8", "int8"]


# ---- custom ops (traced by torch.export, translated to ONNX Q/DQ) ---------------------------------------
def _bounds(zero_point: torch.Tensor) -> tuple[int, int]:
    return (0, 255) if zero_point.dtype == torch.uint8 else (-128, 127)


def _shape_for(t: torch.Tensor, like: torch.Tensor, axis: int) -> torch.Tensor:
    if t.dim() == 0:
        return t
    shape = [1] * like.dim()
    shape[axis] = -1
    return t.reshape(shape)


@torch.library.custom_op("compress_export::qdq", mutates_args=())
def qdq_op(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int) -> torch.Tensor:
    """QuantizeLinear then DequantizeLinear, with ONNX's semantics (round half to even, saturate)."""
    lo, hi = _bounds(zero_point)
    s = _shape_for(scale, x, axis)
    z = _shape_for(zero_point, x, axis).float()
    return ((torch.clamp(torch.round(x / s) + z, lo, hi) - z) * s).to(x.dtype)


@qdq_op.register_fake
def _qdq_fake(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("compress_export::dq", mutates_args=())
def dq_op(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int) -> torch.Tensor:
    """DequantizeLinear of stored integer codes."""
    s = _shape_for(scale, q, axis)
    z = _shape_for(zero_point, q, axis).float()
    return ((q.float() - z) * s.float()).to(scale.dtype)


@dq_op.register_fake
def _dq_fake(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int) -> torch.Tensor:
    return torch.empty(q.shape, dtype=scale.dtype, device=q.device)


def translation_table() -> dict[Any, Any]:
    """The dynamo exporter's ``custom_translation_table`` for the two ops."""
    from onnxscript import opset18 as op

    def qdq_onnx(x: Any, scale: Any, zero_point: Any, axis: int) -> Any:
        return op.DequantizeLinear(op.QuantizeLinear(x, scale, zero_point, axis=axis), scale, zero_point, axis=axis)

    def dq_onnx(q: Any, scale: Any, zero_point: Any, axis: int) -> Any:
        return op.DequantizeLinear(q, scale, zero_point, axis=axis)

    return {torch.ops.compress_export.qdq.default: qdq_onnx, torch.ops.compress_export.dq.default: dq_onnx}


# ---- the swap -----------------------------------------------------------------------------------------
class WeightDQ(nn.Module):
    """Stands in for a weight quantizer: returns the dequantized stored codes (its input is the weight
    it was computed from, unused in the graph so the float weight never reaches the file)."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int) -> None:
        super().__init__()
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)
        self.register_buffer("zero_point", zero_point)
        self.axis = axis

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.compress_export.dq(self.codes, self.scale, self.zero_point, self.axis).to(weight.dtype)


class ActivationQDQ(nn.Module):
    """Stands in for an activation quantizer: an optional SmoothQuant Mul, then a Q/DQ pair."""

    pre_scale: torch.Tensor | None

    def __init__(self, scale: torch.Tensor, zero_point: torch.Tensor, axis: int, pre_scale: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("scale", scale)
        self.register_buffer("zero_point", zero_point)
        self.register_buffer("pre_scale", pre_scale)
        self.axis = axis

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_scale is not None:
            x = x * self.pre_scale.to(x.dtype)
        return torch.ops.compress_export.qdq(x, self.scale, self.zero_point, self.axis)


@dataclass
class QDQSummary:
    """What the swap did, for logs and the export record."""

    weights: int = 0
    activations: int = 0
    per_channel_weights: int = 0
    disabled: int = 0
    weight_bits: set[int] = field(default_factory=set)
    activation_dtype: str = "uint8"
    reduce_range: bool = False


def _fake_quantizer_cls() -> type | None:
    try:
        from quantization.fake_quant import FakeQuantizer
    except ImportError:  # the quantization package is optional for fp32 export
        return None
    return FakeQuantizer


def iter_quantizers(model: nn.Module) -> Iterator[tuple[str, Any]]:
    """``(qualified name, FakeQuantizer)`` for every fake-quantizer in ``model``."""
    cls = _fake_quantizer_cls()
    if cls is None:
        return
    for name, m in model.named_modules():
        if isinstance(m, cls):
            yield name, m


def is_quantized(model: nn.Module) -> bool:
    """Whether ``model`` holds at least one enabled fake-quantizer (and so exports as QDQ)."""
    return any(getattr(q, "enabled", False) for _, q in iter_quantizers(model))


def _shift_dtype(scale: torch.Tensor, zp: torch.Tensor, qmin: int, target: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-express integer codes in ``target`` (int8 or uint8): an exact shift of the zero point by 128."""
    signed = qmin < 0
    z = zp.to(torch.int32)
    if target == "uint8" and signed:
        z = z + 128
    elif target == "int8" and not signed:
        z = z - 128
    dtype = torch.uint8 if target == "uint8" else torch.int8
    return scale.detach().float().clone(), z.to(dtype)


def _reduce_range(codes: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor, axis: int, qmin: int, qmax: int) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor
]:
    """Re-quantize int8 weight codes to 7 bits ([-64, 63]) over the same real range (ORT's
    reduce_range: keeps u8s8 products from saturating int16 on CPUs without VNNI)."""
    s = _shape_for(scale, codes, axis) if scale.dim() else scale
    z = (_shape_for(zp, codes, axis) if zp.dim() else zp).float()
    real = (codes.float() - z) * s
    s2 = scale * (qmax - qmin) / 127.0
    z2 = torch.clamp(torch.round(-64 - (qmin - zp.float()) * scale / s2), -64, 63)
    s2b = _shape_for(s2, codes, axis) if s2.dim() else s2
    z2b = _shape_for(z2, codes, axis) if z2.dim() else z2
    q2 = torch.clamp(torch.round(real / s2b) + z2b, -64, 63)
    return q2.to(torch.int8), s2.float(), z2.to(torch.int8)


def _weight_of(parent: nn.Module, qname: str) -> torch.Tensor:
    for attr in ("weight", qname.removesuffix("_quantizer")):
        w = getattr(parent, attr, None)
        if isinstance(w, torch.Tensor):
            return w.detach()
    raise ExportError(f"weight quantizer '{qname}' sits in {type(parent).__name__}, which has no weight to quantize")


def _check_static(q: Any, where: str) -> None:
    spec = q.spec
    if spec.dynamic:
        raise ExportError(
            f"{where}: dynamic ({spec.granularity}) activation quantization has no static QDQ form; "
            "use a static activation scheme (e.g. w8a8) or weight-only for ONNX export"
        )
    if spec.granularity == "group":
        raise ExportError(f"{where}: per-group weight quantization is not exportable as QDQ yet; use per-channel")
    if not q.calibrated:
        raise ExportError(f"{where}: quantizer is not calibrated; run calibration before export")


def swap_quantizers(model: nn.Module, *, activation_dtype: ActDtype = "uint8", reduce_range: bool = False) -> tuple[
    nn.Module, QDQSummary
]:
    """A deep copy of ``model`` whose fake-quantizers are replaced by QDQ export modules."""
    cls = _fake_quantizer_cls()
    out = copy.deepcopy(model).eval()
    summary = QDQSummary(activation_dtype=activation_dtype, reduce_range=reduce_range)
    if cls is None:
        return out, summary
    for pname, parent in list(out.named_modules()):
        for cname, child in list(parent.named_children()):
            if not isinstance(child, cls):
                continue
            where = f"{pname}.{cname}" if pname else cname
            q: Any = child
            if not q.enabled:
                setattr(parent, cname, nn.Identity())
                summary.disabled += 1
                continue
            _check_static(q, where)
            axis = int(q.axis) if q.axis is not None else 0
            if q.role == "weight":
                if getattr(parent, "bn", None) is not None and hasattr(parent, "fold_bn"):
                    parent.fold_bn()  # QAT conv+BN: the exported conv uses the folded weight
                weight = _weight_of(parent, cname)
                codes = q.int_repr(weight).to(torch.int32)
                scale, zp = q.scale.detach().float(), q.zero_point.to(torch.int32)
                qmin, qmax = int(q.qmin), int(q.qmax)
                if qmin >= 0:  # uint8 weights -> int8 (s8 weights are what ORT's kernels take)
                    codes, zp, qmin, qmax = codes - 128, zp - 128, qmin - 128, qmax - 128
                if axis < 0:
                    axis += weight.dim()
                if reduce_range:
                    c8, s8, z8 = _reduce_range(codes, scale, zp, axis, qmin, qmax)
                else:
                    c8, s8, z8 = codes.to(torch.int8), scale.clone(), zp.to(torch.int8)
                setattr(parent, cname, WeightDQ(c8, s8, z8, axis))
                summary.weights += 1
                summary.weight_bits.add(int(q.spec.bits))
                summary.per_channel_weights += int(scale.dim() > 0)
            else:
                scale, zp = _shift_dtype(q.scale, q.zero_point, int(q.qmin), activation_dtype)
                pre = q.pre_quant_scale.detach().float().clone() if q.pre_quant_scale is not None else None
                setattr(parent, cname, ActivationQDQ(scale, zp, axis, pre))
                summary.activations += 1
    return out, summary


# ---- graph passes ----------------------------------------------------------------------------------------
class _Graph:
    """Producer/consumer/initializer maps over an onnx GraphProto, rebuilt after each edit."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.g = graph
        self.refresh()

    def refresh(self) -> None:
        self.init = {i.name: i for i in self.g.initializer}
        self.producer: dict[str, onnx.NodeProto] = {o: n for n in self.g.node for o in n.output}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for n in self.g.node:
            for i in n.input:
                self.consumers.setdefault(i, []).append(n)
        self.outputs = {o.name for o in self.g.output}

    def array(self, name: str) -> np.ndarray:
        return numpy_helper.to_array(self.init[name])

    def set_init(self, name: str, arr: np.ndarray) -> None:
        if name in self.init:
            self.g.initializer.remove(self.init[name])
        self.g.initializer.append(numpy_helper.from_array(arr, name))
        self.init[name] = self.g.initializer[-1]

    def rewire(self, old: str, new: str) -> None:
        for n in self.consumers.get(old, []):
            for k, i in enumerate(n.input):
                if i == old:
                    n.input[k] = new
        for o in self.g.output:
            if o.name == old:  # keep graph output names: rename the producer instead
                raise ValueError("rewire of a graph output")

    def unique(self, base: str) -> str:
        names = set(self.init) | set(self.producer) | {i.name for i in self.g.input}
        k, name = 0, base
        while name in names:
            k += 1
            name = f"{base}_{k}"
        return name


def _axis(node: onnx.NodeProto) -> int:
    for a in node.attribute:
        if a.name == "axis":
            return int(helper.get_attribute_value(a))
    return 1


def _set_axis(node: onnx.NodeProto, axis: int) -> None:
    for a in list(node.attribute):
        if a.name == "axis":
            node.attribute.remove(a)
    node.attribute.append(helper.make_attribute("axis", axis))


def fold_weight_transposes(g: _Graph) -> int:
    """``DQ(W) -> Transpose -> op`` becomes ``DQ(W^T) -> op`` so ORT sees DQ feeding the op directly."""
    done = 0
    for t in list(g.g.node):
        if t.op_type != "Transpose":
            continue
        dq = g.producer.get(t.input[0])
        if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in g.init:
            continue
        if len(g.consumers.get(dq.output[0], [])) != 1 or t.output[0] in g.outputs:
            continue
        perm = next((list(helper.get_attribute_value(a)) for a in t.attribute if a.name == "perm"), None)
        codes = g.array(dq.input[0])
        perm = perm if perm is not None else list(reversed(range(codes.ndim)))
        if len(g.consumers.get(dq.input[0], [])) != 1:
            continue
        g.set_init(dq.input[0], np.ascontiguousarray(np.transpose(codes, perm)))
        if g.array(dq.input[1]).ndim == 1:
            ax = _axis(dq) % codes.ndim
            _set_axis(dq, perm.index(ax))
        out = t.output[0]
        g.g.node.remove(t)
        dq.output[0], old = out, dq.output[0]
        del old
        g.refresh()
        done += 1
    return done


def _same_params(g: _Graph, a: onnx.NodeProto, b: onnx.NodeProto) -> bool:
    try:
        sa, sb = g.array(a.input[1]), g.array(b.input[1])
        za, zb = g.array(a.input[2]), g.array(b.input[2])
    except KeyError:
        return False
    return (
        sa.shape == sb.shape
        and za.dtype == zb.dtype
        and bool(np.array_equal(sa, sb))
        and bool(np.array_equal(za, zb))
        and (sa.ndim == 0 or _axis(a) == _axis(b))
    )


def merge_duplicate_pairs(g: _Graph) -> int:
    """Drop redundant Q/DQ pairs: twins quantizing one tensor with equal params, and a pair that
    re-quantizes the output of an identical pair (``Q->DQ->Q'->DQ'`` with Q' == Q)."""
    removed = 0
    changed = True
    while changed:
        changed = False
        for q in list(g.g.node):
            if q.op_type != "QuantizeLinear":
                continue
            src = g.producer.get(q.input[0])
            # (a) Q'->DQ' right after a DQ with the same params: values already lie on the grid
            prev_q = g.producer.get(src.input[0]) if src is not None and src.op_type == "DequantizeLinear" else None
            twins = [
                o for o in g.consumers.get(q.input[0], [])
                if o is not q and o.op_type == "QuantizeLinear" and _same_params(g, o, q)
            ]
            victim_dq = [d for d in g.consumers.get(q.output[0], []) if d.op_type == "DequantizeLinear"]
            if len(victim_dq) != len(g.consumers.get(q.output[0], [])) or not victim_dq:
                continue
            if any(d.output[0] in g.outputs for d in victim_dq):
                continue
            keep: str | None = None
            if prev_q is not None and prev_q.op_type == "QuantizeLinear" and _same_params(g, prev_q, q) and all(
                _same_params(g, d, q) for d in victim_dq
            ):
                keep = q.input[0]
            elif twins:
                twin = twins[0]
                tw_dq = [d for d in g.consumers.get(twin.output[0], []) if d.op_type == "DequantizeLinear"]
                if tw_dq and all(_same_params(g, d, q) for d in victim_dq + tw_dq):
                    keep = tw_dq[0].output[0]
            if keep is None:
                continue
            for d in victim_dq:
                g.rewire(d.output[0], keep)
                g.g.node.remove(d)
            g.g.node.remove(q)
            g.refresh()
            removed += 1
            changed = True
            break
    return removed


def quantize_biases(g: _Graph) -> int:
    """Float bias of a Conv/Gemm whose input and weight come from DequantizeLinear -> int32 codes with
    scale ``s_x * s_w`` and a DequantizeLinear (what ORT's QDQ selectors need to fuse the op)."""
    done = 0
    for n in list(g.g.node):
        if n.op_type not in ("Conv", "Gemm") or len(n.input) < 3 or n.input[2] not in g.init:
            continue
        dqx, dqw = g.producer.get(n.input[0]), g.producer.get(n.input[1])
        if dqx is None or dqw is None or dqx.op_type != "DequantizeLinear" or dqw.op_type != "DequantizeLinear":
            continue
        if dqx.input[1] not in g.init or dqw.input[1] not in g.init:
            continue
        bias = g.array(n.input[2])
        if bias.dtype != np.float32 or len(g.consumers.get(n.input[2], [])) != 1:
            continue
        sx, sw = g.array(dqx.input[1]), g.array(dqw.input[1])
        if sx.ndim != 0:
            continue
        scale = (sx.astype(np.float64) * sw.astype(np.float64)).astype(np.float32)
        scale = np.broadcast_to(scale, bias.shape).copy() if scale.ndim else scale
        safe = np.where(scale == 0, 1.0, scale)
        codes = np.clip(np.rint(bias / safe), -(2**31), 2**31 - 1).astype(np.int32)
        qn, sn, zn, on = (g.unique(f"{n.input[2]}_{s}") for s in ("quantized", "scale", "zero_point", "dq"))
        g.set_init(qn, codes)
        g.set_init(sn, scale)
        g.set_init(zn, np.zeros(scale.shape, dtype=np.int32))
        dq = helper.make_node("DequantizeLinear", [qn, sn, zn], [on], name=g.unique(f"{n.name}_bias_dq"), axis=0)
        idx = list(g.g.node).index(n)
        g.g.node.insert(idx, dq)
        old = n.input[2]
        n.input[2] = on
        g.g.initializer.remove(g.init[old])
        g.refresh()
        done += 1
    return done


def quantize_embedding_tables(g: _Graph, *, min_numel: int = 1 << 16) -> int:
    """Large float tables read by Gather (token embeddings) -> int8 rows with one fp32 scale per row:
    ``Gather(codes) -> Cast -> Mul(Gather(scales))``. The table is most of a small transformer's file;
    per-row symmetric int8 keeps each looked-up vector within half a step of its row's scale."""
    done = 0
    for n in list(g.g.node):
        if n.op_type != "Gather" or n.input[0] not in g.init or n.input[1] in g.init:
            continue
        if any(a.name == "axis" and helper.get_attribute_value(a) != 0 for a in n.attribute):
            continue
        table = g.array(n.input[0])
        if table.dtype != np.float32 or table.ndim != 2 or table.size < min_numel:
            continue
        if len(g.consumers.get(n.input[0], [])) != 1:
            continue
        amax = np.abs(table).max(axis=1)
        scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
        codes = np.clip(np.rint(table / scale[:, None]), -127, 127).astype(np.int8)
        cn, sn = g.unique(f"{n.input[0]}_int8"), g.unique(f"{n.input[0]}_row_scale")
        g.set_init(cn, codes)
        g.set_init(sn, scale[:, None].copy())
        out = n.output[0]
        gq, gc, gs = (g.unique(f"{out}_{s}") for s in ("codes", "float", "scale"))
        idx = list(g.g.node).index(n)
        new = [
            helper.make_node("Gather", [cn, n.input[1]], [gq], name=g.unique(f"{n.name}_int8"), axis=0),
            helper.make_node("Cast", [gq], [gc], name=g.unique(f"{n.name}_cast"), to=onnx.TensorProto.FLOAT),
            helper.make_node("Gather", [sn, n.input[1]], [gs], name=g.unique(f"{n.name}_scale"), axis=0),
            helper.make_node("Mul", [gc, gs], [out], name=g.unique(f"{n.name}_dequant")),
        ]
        g.g.node.remove(n)
        for k, node in enumerate(new):
            g.g.node.insert(idx + k, node)
        g.g.initializer.remove(g.init[n.input[0]])
        g.refresh()
        done += 1
    return done


def remove_unused_initializers(g: _Graph) -> int:
    used = {i for n in g.g.node for i in n.input} | g.outputs
    dead = [i for i in g.g.initializer if i.name not in used]
    for i in dead:
        g.g.initializer.remove(i)
    graph_inputs = [i for i in g.g.input if i.name in {d.name for d in dead}]
    for i in graph_inputs:
        g.g.input.remove(i)
    g.refresh()
    return len(dead)


def tidy_qdq_graph(model: onnx.ModelProto, *, quantize_embeddings: bool = False) -> dict[str, int]:
    """Run the QDQ passes in place; returns how many edits each made."""
    g = _Graph(model.graph)
    stats = {
        "int8_embedding_tables": quantize_embedding_tables(g) if quantize_embeddings else 0,
        "unused_initializers": remove_unused_initializers(g),
        "weight_transposes": fold_weight_transposes(g),
        "redundant_pairs": merge_duplicate_pairs(g),
        "int32_biases": quantize_biases(g),
    }
    stats["unused_initializers"] += remove_unused_initializers(g)
    if any(stats.values()):  # shapes of edited tensors changed: let shape inference redo them
        del model.graph.value_info[:]
    log.debug("QDQ graph passes: %s", stats)
    return stats
