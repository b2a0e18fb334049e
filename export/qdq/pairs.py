"""Q/DQ pair passes of the QDQ graph (run by :func:`export.qdq.graph.tidy_qdq_graph`): pairs that
quantize a tensor twice with equal parameters (twins, or a pair re-quantizing an identical one's
output) merge into one, and a zero Pad between pairs in front of a Conv moves into the Conv's own
padding, so ORT fuses the Conv."""

from __future__ import annotations

import numpy as np
import onnx
from compress.export.qdq.ir import QdqGraph, quant_axis
from onnx import helper


def _same_params(g: QdqGraph, a: onnx.NodeProto, b: onnx.NodeProto) -> bool:
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
        and (sa.ndim == 0 or quant_axis(a) == quant_axis(b))
    )


def merge_duplicate_pairs(g: QdqGraph) -> int:
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


def _zero_pad_spatial(g: QdqGraph, pad: onnx.NodeProto) -> list[int] | None:
    """Spatial begin/end pads of a constant-zero Pad that leaves batch and channel alone, else None."""
    if pad.op_type != "Pad" or len(pad.input) > 3 or any(
        a.name == "mode" and helper.get_attribute_value(a) not in (b"constant", "constant") for a in pad.attribute
    ):
        return None
    if len(pad.input) < 2 or pad.input[1] not in g.init:
        return None
    value = pad.input[2] if len(pad.input) == 3 else ""
    if value and (value not in g.init or np.any(g.array(value) != 0)):
        return None
    pads = [int(v) for v in g.array(pad.input[1]).reshape(-1)]
    rank = len(pads) // 2
    begin, end = pads[:rank], pads[rank:]
    if rank < 3 or begin[:2] != [0, 0] or end[:2] != [0, 0] or min(pads) < 0:
        return None
    return begin[2:] + end[2:]


def pads_into_convs(g: QdqGraph) -> int:
    """``DQ(q) -> Pad(0) -> Q -> DQ -> Conv`` (explicit "same" padding, as TF-ported models write it)
    -> ``DQ(q) -> Conv(pads += p)``. ORT runs a Pad between Q/DQ pairs in float and cannot fuse the
    conv; a quantized zero is the zero point, so padding inside QLinearConv gives the same values."""
    done = 0
    touched: list[onnx.NodeProto] = []
    for pad in list(g.g.node):
        extra = _zero_pad_spatial(g, pad)
        dq_a = g.producer.get(pad.input[0]) if extra is not None else None
        if extra is None or dq_a is None or dq_a.op_type != "DequantizeLinear":
            continue
        for q in list(g.consumers.get(pad.output[0], [])):
            if q.op_type != "QuantizeLinear" or not _same_params(g, q, dq_a):
                continue
            for dq_b in list(g.consumers.get(q.output[0], [])):
                if dq_b.op_type != "DequantizeLinear" or not _same_params(g, dq_b, dq_a):
                    continue
                for conv in list(g.consumers.get(dq_b.output[0], [])):
                    attrs = {a.name: helper.get_attribute_value(a) for a in conv.attribute}
                    if conv.op_type != "Conv" or conv.input[0] != dq_b.output[0] or attrs.get("auto_pad", b"NOTSET") not in (
                        b"NOTSET", "NOTSET"
                    ):
                        continue
                    old = list(attrs.get("pads", [0] * len(extra)))
                    if len(old) != len(extra):
                        continue
                    for a in list(conv.attribute):
                        if a.name == "pads":
                            conv.attribute.remove(a)
                    conv.attribute.append(helper.make_attribute("pads", [a + b for a, b in zip(old, extra, strict=True)]))
                    conv.input[0] = dq_a.output[0]
                    touched += [pad, q, dq_b]
                    done += 1
        g.refresh()
    for n in reversed(touched):  # readers before producers: a DQ, then its Q, then the Pad
        if n in g.g.node and not any(g.consumers.get(o) or o in g.outputs for o in n.output):
            g.g.node.remove(n)
            g.refresh()
    return done
