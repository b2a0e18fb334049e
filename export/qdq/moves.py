"""Data movement on integer codes: a QDQ pass of :func:`export.qdq.graph.tidy_qdq_graph`.

Ops that only select or move elements commute with a per-tensor DequantizeLinear, so between a DQ
and a QuantizeLinear of the same scale and zero point they can run on the 8-bit codes and the pair
can go: what ORT's own QDQ fusion does for one move, here for chains, zero pads and concats."""

from __future__ import annotations

import onnx
from compress.export.qdq.ir import QdqGraph, constant_value, node_attr
from onnx import helper

#: ops that only select or move the elements of their first input: they commute with a per-tensor
#: DequantizeLinear, so they may run on the integer codes instead (Pad too, when it fills with 0.0)
_MOVES = frozenset({"Slice", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Expand", "Identity", "Pad"})


def _per_tensor(g: QdqGraph, node: onnx.NodeProto) -> tuple[float, int, str] | None:
    """``(scale, zero point, code dtype)`` of a Q/DQ with one constant scale and zero point, else None."""
    if node.op_type not in ("QuantizeLinear", "DequantizeLinear") or len(node.input) < 3:
        return None
    scale, zp = constant_value(g, node.input[1]), constant_value(g, node.input[2])
    if scale is None or zp is None or scale.size != 1 or zp.size != 1:
        return None
    return float(scale.reshape(())), int(zp.reshape(())), zp.dtype.str


def _zero_fill(g: QdqGraph, pad: onnx.NodeProto) -> bool:
    """A constant-mode Pad that fills with 0.0 (on codes it fills with the zero point)."""
    mode = node_attr(pad, "mode", b"constant")
    if (mode.decode() if isinstance(mode, bytes) else mode) != "constant":
        return False
    if len(pad.input) < 3 or not pad.input[2]:
        return True
    value = constant_value(g, pad.input[2])
    return value is not None and value.size == 1 and float(value.reshape(())) == 0.0


def _codes_source(g: QdqGraph, name: str) -> tuple[onnx.NodeProto, list[onnx.NodeProto]] | None:
    """The per-tensor DequantizeLinear that ``name`` comes from through :data:`_MOVES` ops (on their
    first input), and those ops in graph order; None when anything else lies on the way."""
    chain: list[onnx.NodeProto] = []
    node = g.producer.get(name)
    while node is not None and node.op_type in _MOVES and node.input and (node.op_type != "Pad" or _zero_fill(g, node)):
        chain.append(node)
        node = g.producer.get(node.input[0])
    if node is None or node.op_type != "DequantizeLinear" or _per_tensor(g, node) is None:
        return None
    return node, chain[::-1]


def _moves_on_codes(g: QdqGraph, dq: onnx.NodeProto, chain: list[onnx.NodeProto], out: list[onnx.NodeProto]) -> str:
    """Clones of ``chain`` reading ``dq``'s codes (appended to ``out``); returns the last one's output."""
    cur = dq.input[0]
    for m in chain:
        clone = onnx.NodeProto()
        clone.CopyFrom(m)
        clone.name = g.unique(f"{m.name or m.output[0]}_codes")
        clone.input[0] = cur
        clone.output[0] = g.unique(f"{m.output[0]}_codes")
        g.producer[clone.output[0]] = clone  # claims the name for the next unique()
        if m.op_type == "Pad":  # 0.0 on the grid is the zero point
            fill = g.unique(f"{clone.output[0]}_fill")
            zp = constant_value(g, dq.input[2])
            assert zp is not None  # _per_tensor checked it
            g.set_init(fill, zp.reshape(()).copy())
            while len(clone.input) < 3:
                clone.input.append("")
            clone.input[2] = fill
        out.append(clone)
        cur = clone.output[0]
    return cur


def _remove_dead(g: QdqGraph, candidates: list[onnx.NodeProto]) -> None:
    """Remove the candidates nothing reads any more (then the ones that fed only them)."""
    live = True
    while live:
        live = False
        for node in list(candidates):
            if node in g.g.node and not any(g.consumers.get(o) or o in g.outputs for o in node.output):
                g.g.node.remove(node)
                candidates.remove(node)
                g.refresh()
                live = True


def moves_on_codes(g: QdqGraph) -> int:
    """Data movement between a per-tensor DequantizeLinear and a QuantizeLinear with the same params
    runs on the integer codes, and the pair goes; a ``Concat`` of inputs dequantized with one (scale,
    zero point), each through such moves, becomes the moves and the Concat on the codes, then one
    DequantizeLinear (a Q with those params after it then goes too).

    ``torch.roll`` exports as Slice + Concat, ``F.pad`` as Pad, window partitions as
    Reshape/Transpose: ORT fuses a single DQ -> move -> Q but not a chain, a Pad filling 0.0 or a
    Concat whose output no Q reads, so these ran in float (the int8 export of a shifted-window model
    kept 8 float Concats and 5 float Pads). A Concat whose output feeds a Q with other params is left
    alone: ORT fuses that form into QLinearConcat, which requantizes in one kernel."""
    done = 0
    for n in list(g.g.node):
        if n not in g.g.node or n.output[0] in g.outputs:
            continue
        if n.op_type == "Concat":
            found = [_codes_source(g, i) for i in n.input]
        elif n.op_type == "QuantizeLinear" and _per_tensor(g, n) is not None:
            found = [_codes_source(g, n.input[0])]
        else:
            continue
        sources = [f for f in found if f is not None]
        if not sources or len(sources) != len(found) or len({_per_tensor(g, dq) for dq, _ in sources}) != 1:
            continue
        want = _per_tensor(g, sources[0][0])
        new: list[onnx.NodeProto] = []
        if n.op_type == "QuantizeLinear":
            if _per_tensor(g, n) != want or not sources[0][1]:  # no moves: merge_duplicate_pairs' case
                continue
            codes = _moves_on_codes(g, *sources[0], new)
            at = list(g.g.node).index(n)
            for k, node in enumerate(new):
                g.g.node.insert(at + k, node)
            g.refresh()
            g.rewire(n.output[0], codes)
            g.g.node.remove(n)
        else:
            if any(c.op_type == "QuantizeLinear" and _per_tensor(g, c) != want for c in g.consumers.get(n.output[0], [])):
                continue
            cat = onnx.NodeProto()
            cat.CopyFrom(n)
            del cat.input[:]
            cat.input.extend(_moves_on_codes(g, dq, chain, new) for dq, chain in sources)
            cat.output[0] = g.unique(f"{n.output[0]}_codes")
            g.producer[cat.output[0]] = cat
            first = sources[0][0]
            back = helper.make_node("DequantizeLinear", [cat.output[0], first.input[1], first.input[2]], [n.output[0]],
                                    name=g.unique(f"{n.name or n.output[0]}_dq"))
            at = list(g.g.node).index(n)
            g.g.node.remove(n)
            for k, node in enumerate([*new, cat, back]):
                g.g.node.insert(at + k, node)
        g.refresh()
        _remove_dead(g, [node for dq, chain in sources for node in [*chain, dq]])
        done += 1
    for q in list(g.g.node):  # Q(DQ(codes)) with the DQ's own params: the codes themselves
        dq = g.producer.get(q.input[0]) if q.op_type == "QuantizeLinear" and q.input else None
        if dq is None or dq.op_type != "DequantizeLinear" or q.output[0] in g.outputs:
            continue
        if _per_tensor(g, q) is None or _per_tensor(g, q) != _per_tensor(g, dq):
            continue
        g.rewire(q.output[0], dq.input[0])
        g.g.node.remove(q)
        g.refresh()
        _remove_dead(g, [dq])
        done += 1
    return done
