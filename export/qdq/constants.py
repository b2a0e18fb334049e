"""Constant passes of the QDQ graph (run by :func:`export.qdq.graph.tidy_qdq_graph`): what the
export can compute once instead of on every call. Subgraphs of constants feeding a quantizer are
evaluated, layout ops on dequantized constant codes move onto the codes, a QuantizeLinear of a
constant becomes stored integer codes, a Where on an all-True or all-False constant condition
goes, and initializers nothing reads are removed."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np
import onnx
from compress.export.qdq.ir import QdqGraph, constant_value, quant_axis
from onnx import TensorProto, helper, numpy_helper

log = logging.getLogger(__name__)


#: deterministic ops a constant subgraph may hold (index and mask arithmetic, table gathers, layout)
_PURE = frozenset({
    "Constant", "Identity", "Gather", "Reshape", "Transpose", "Unsqueeze", "Squeeze", "Flatten", "Slice", "Concat",
    "Expand", "Tile", "Cast", "Shape", "Range", "ConstantOfShape", "Equal", "Not", "Where", "Add", "Sub", "Mul", "Div",
    "Neg", "ScatterND", "QuantizeLinear", "DequantizeLinear",
})

#: a constant subgraph is evaluated at export only up to this many input elements
_MAX_CONSTANT_NUMEL = 1 << 22


def _constant_subgraph(g: QdqGraph, name: str) -> list[onnx.NodeProto] | None:
    """The nodes computing ``name`` from initializers alone through :data:`_PURE` ops, in graph
    order (None where a graph input, a non-pure op or too large a constant is upstream)."""
    seen: dict[str, onnx.NodeProto] = {}
    stack, numel = [name], 0
    while stack:
        t = stack.pop()
        if not t or t in g.init:
            numel += int(np.prod(g.init[t].dims)) if t else 0
            continue
        node = g.producer.get(t)
        if node is None or node.op_type not in _PURE:
            return None
        if node.output[0] in seen:
            continue
        seen[node.output[0]] = node
        stack.extend(node.input)
    if not seen or numel > _MAX_CONSTANT_NUMEL:
        return None
    return [n for n in g.g.node if n.output and n.output[0] in seen]


def fold_constant_subgraphs(g: QdqGraph) -> int:
    """A quantizer's input computed from constants only (Swin's relative-position bias gathered from
    its table and permuted, a shift mask built from zeros and filled) -> one initializer, so
    :func:`fold_constant_quantize` stores its codes. The float export gets the same folding from ORT's
    optimizer; the int8 one does not, because ORT does not fold through QuantizeLinear and leaves the
    Gather/Reshape/Transpose/Unsqueeze chain running on every call."""
    from onnx.reference import ReferenceEvaluator

    done = 0
    for q in list(g.g.node):
        if q.op_type != "QuantizeLinear" or constant_value(g, q.input[0]) is not None or q.input[0] in g.outputs:
            continue
        nodes = _constant_subgraph(g, q.input[0])
        if nodes is None:
            continue
        used = {i for n in nodes for i in n.input if i in g.init}
        sub = helper.make_graph(
            nodes, "constant", [], [helper.make_tensor_value_info(q.input[0], TensorProto.UNDEFINED, None)],
            [i for i in g.g.initializer if i.name in used])
        try:
            value = ReferenceEvaluator(helper.make_model(sub, opset_imports=[helper.make_opsetid("", 21)])).run(None, {})[0]  # type: ignore[index]
        except Exception as exc:  # a subgraph the reference cannot run stays as it is
            log.debug("constant subgraph of %s not folded: %s", q.input[0], exc)
            continue
        if not isinstance(value, np.ndarray) or value.dtype != np.float32:
            continue
        g.producer[q.input[0]].output[0] = g.unique(f"{q.input[0]}_unfolded")
        g.set_init(q.input[0], value)
        g.refresh()
        done += 1
    if done:  # the chains nothing reads any more
        changed = True
        while changed:
            changed = False
            for n in list(g.g.node):
                if n.op_type in _PURE and not any(g.consumers.get(o) or o in g.outputs for o in n.output):
                    g.g.node.remove(n)
                    changed = True
            g.refresh()
    return done


_LAYOUT = frozenset({"Reshape", "Transpose", "Unsqueeze", "Squeeze", "Flatten", "Expand"})


def layout_into_constant_codes(g: QdqGraph) -> int:
    """``Unsqueeze(DQ(codes))`` (any :data:`_LAYOUT` op on a per-tensor dequantized initializer) ->
    ``DQ(Unsqueeze(codes))`` with the new codes stored: the last layout step of a constant operand
    (the bias's ``unsqueeze(0)``) then runs at export, and the add still reads a DequantizeLinear."""
    from onnx.reference import ReferenceEvaluator

    done = 0
    for n in list(g.g.node):
        if n.op_type not in _LAYOUT or not n.input:
            continue
        dq = g.producer.get(n.input[0])
        if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in g.init:
            continue
        if any(i not in g.init for i in [*dq.input[1:], *n.input[1:]] if i) or g.array(dq.input[1]).ndim:
            continue
        if len(g.consumers.get(dq.output[0], [])) != 1:
            continue
        used = [i for i in n.input if i]
        sub = helper.make_graph([helper.make_node(n.op_type, list(n.input), ["y"], **{
            a.name: helper.get_attribute_value(a) for a in n.attribute})], "layout", [],
            [helper.make_tensor_value_info("y", TensorProto.UNDEFINED, None)],
            [g.init[i] for i in used[1:]] + [numpy_helper.from_array(g.array(dq.input[0]), n.input[0])])
        try:
            codes = ReferenceEvaluator(helper.make_model(sub, opset_imports=[helper.make_opsetid("", 21)])).run(None, {})[0]  # type: ignore[index]
        except Exception as exc:  # left as it is
            log.debug("layout of %s not folded: %s", n.name, exc)
            continue
        name = g.unique(f"{dq.input[0]}_{n.op_type.lower()}")
        g.set_init(name, np.asarray(codes))
        g.g.node.remove(n)
        dq.input[0] = name
        dq.output[0] = n.output[0]
        g.refresh()
        done += 1
    return done


def fold_constant_quantize(g: QdqGraph) -> int:
    """``QuantizeLinear(constant)`` -> its integer codes as an initializer: a constant operand placed
    with a quantizer of its own (a position embedding, ``eps`` of ``var + eps``, an attention bias) is
    stored as uint8/int8 codes + DequantizeLinear, the form ORT fuses into QLinearAdd, never as a float
    copy. Codes follow ONNX's QuantizeLinear: round half to even, add the zero point, saturate."""
    done = 0
    for q in list(g.g.node):
        if q.op_type != "QuantizeLinear" or len(q.input) < 3 or q.output[0] in g.outputs:
            continue
        x, scale, zp = (constant_value(g, i) for i in q.input[:3])
        if x is None or scale is None or zp is None or x.dtype != np.float32:
            continue
        if scale.ndim:
            shape = [1] * x.ndim
            shape[quant_axis(q) % x.ndim] = -1
            scale, zp = scale.reshape(shape), zp.reshape(shape)
        info = np.iinfo(zp.dtype)
        with np.errstate(over="ignore"):  # a mask fill (float32's lowest) saturates to the grid's lowest code
            codes = np.clip(np.rint(x / scale.astype(np.float32)) + zp.astype(np.float32), info.min, info.max)
        out = q.output[0]
        g.g.node.remove(q)
        g.set_init(out, codes.astype(zp.dtype))
        g.refresh()
        done += 1
    if done:  # Constant nodes nothing reads any more
        for n in [n for n in g.g.node if n.op_type == "Constant" and not g.consumers.get(n.output[0])]:
            if n.output[0] not in g.outputs:
                g.g.node.remove(n)
        g.refresh()
    return done


def remove_unused_initializers(g: QdqGraph) -> int:
    used = {i for n in g.g.node for i in n.input} | g.outputs
    dead = [i for i in g.g.initializer if i.name not in used]
    for i in dead:
        g.g.initializer.remove(i)
    graph_inputs = [i for i in g.g.input if i.name in {d.name for d in dead}]
    for i in graph_inputs:
        g.g.input.remove(i)
    g.refresh()
    return len(dead)


def fold_constant_where(g: QdqGraph, shapes: Mapping[str, tuple[int | None, ...]]) -> int:
    """``Where(c, x, y)`` with a constant ``c`` that is all True (or all False) -> ``x`` (or ``y``),
    where that operand already has the output's shape. The decomposed attention's ``masked_fill`` of
    a boolean mask that masks nothing (no padding, fixed shapes) leaves such Wheres, which the float
    export's SDPA does not have."""
    done = 0
    for n in list(g.g.node):
        if n.op_type != "Where" or n.output[0] in g.outputs:
            continue
        c = constant_value(g, n.input[0])
        if c is None or c.dtype != np.bool_ or not (c.all() or not c.any()):
            continue
        pick = n.input[1] if c.all() else n.input[2]
        want = shapes.get(n.output[0])
        if want is None or shapes.get(pick) != want:
            continue
        g.rewire(n.output[0], pick)
        g.g.node.remove(n)
        g.refresh()
        done += 1
    return done
