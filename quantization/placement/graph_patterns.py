"""Patterns the placement reads off the traced graph (quantization/placement/trace.py): weighted
calls and their weights (a model parameter, or a slice cut from a packed one), activation functions
written as elementwise ops (kept float as one piece), and the tensor indexes the passes share (who
reads each tensor, which tensors the model returns)."""

from __future__ import annotations

from compress.quantization.placement.trace import Operand, OpGraph, OpNode

#: weighted kinds: (data operand position, weight operand position, weight per-channel axis)
_WEIGHTED_POS: dict[str, tuple[int, int, int]] = {"linear": (0, 1, 0), "conv": (0, 1, 0), "addmm": (1, 2, 1)}


def weighted_operands(node: OpNode) -> tuple[Operand, Operand, int] | None:
    """``(data, weight, weight axis)`` of a weighted op call whose weight is a model parameter."""
    ops = {o.position: o for o in node.operands}
    if node.kind in _WEIGHTED_POS:
        d, w, axis = _WEIGHTED_POS[node.kind]
        data, weight = ops.get(d), ops.get(w)
        if data is not None and weight is not None and weight.source == "param":
            return data, weight, axis
        return None
    if node.kind == "matmul" and len(node.operands) == 2:
        a, b = node.operands
        if b.source == "param" and a.source != "param" and len(b.shape) >= 2:
            return a, b, len(b.shape) - 1
    return None


#: ops that cut a tensor into pieces of the same rank (a weight sliced from a packed parameter)
_SLICING = frozenset({"split", "chunk", "narrow", "split_with_sizes", "tensor_split"})


def sliced_weight(node: OpNode, producers: dict[str, OpNode]) -> tuple[Operand, OpNode, Operand, int] | None:
    """``(data, slicing op, parameter operand, axis)`` of a weighted op call whose weight is a slice
    of a model parameter, cut by one split/chunk/narrow call that keeps the rank."""
    ops = {o.position: o for o in node.operands}
    if node.kind not in _WEIGHTED_POS:
        return None
    d, w, axis = _WEIGHTED_POS[node.kind]
    data, weight = ops.get(d), ops.get(w)
    if data is None or weight is None or weight.source != "op":
        return None
    cut = producers.get(str(weight.producer))
    if cut is None or cut.kind != "reshape" or cut.func not in _SLICING or not cut.operands:
        return None
    param = cut.operands[0]
    if param.source != "param" or param.position != 0 or any(len(s) != len(param.shape) for s in cut.out_shapes):
        return None
    return data, cut, param, axis


def tensor_consumers(nodes: list[OpNode]) -> dict[str, list[tuple[OpNode, Operand]]]:
    """The ops reading each produced tensor (by tensor id), with the operand they read it as."""
    consumers: dict[str, list[tuple[OpNode, Operand]]] = {}
    for n in nodes:
        for o in n.operands:
            t = o.tensor_id
            if t is not None:
                consumers.setdefault(t, []).append((n, o))
    return consumers


def output_tensors(graph: OpGraph) -> set[str]:
    return {f"{k}/{i}" for k, i in graph.outputs}


#: recorded op kinds that are elementwise, and other elementwise calls (named as the tracer records
#: calls it gives no kind) that may make up an activation function
_ELEMENTWISE_KINDS = frozenset({"add", "sub", "mul", "act", "silu", "sigmoid", "relu", "relu6"})
_ELEMENTWISE_CALLS = frozenset({
    "~pow", "~__pow__", "~__rpow__", "~div", "~__truediv__", "~__rtruediv__", "~true_divide", "~exp", "~neg",
    "~__neg__", "~abs", "~sqrt", "~rsqrt", "~reciprocal", "~log", "~log1p", "~expm1", "~square",
})


def activation_regions(graph: OpGraph) -> dict[str, list[str]]:
    """``{module scope: op keys}`` for every parameterless module that computes an activation
    function from elementwise calls (GPT-2's tanh GELU, CLIP's QuickGELU, Mish): at least two ops,
    one tensor in, one tensor out, every intermediate of the input's shape. Quantizing each step
    costs a Q/DQ or an integer kernel per op and stops the runtime from fusing the function into one
    float kernel; outermost qualifying module wins."""
    by_scope: dict[str, list[OpNode]] = {}
    for n in graph.nodes.values():
        parts = n.scope.split(".") if n.scope else []
        for i in range(1, len(parts) + 1):
            by_scope.setdefault(".".join(parts[:i]), []).append(n)
    outputs = output_tensors(graph)
    readers: dict[str, set[str]] = {}
    for n in graph.nodes.values():
        for o in n.operands:
            t = o.tensor_id
            if t is not None:
                readers.setdefault(t, set()).add(n.key)
    found: dict[str, list[str]] = {}
    for scope in sorted(by_scope, key=lambda s: s.count(".")):
        if any(scope.startswith(f"{f}.") for f in found):
            continue
        ops = by_scope[scope]
        keys = {n.key for n in ops}
        if len(ops) < 2 or any(n.kind not in _ELEMENTWISE_KINDS and n.kind not in _ELEMENTWISE_CALLS for n in ops):
            continue
        if any(o.source == "param" for n in ops for o in n.operands):
            continue
        ins = {t for n in ops for o in n.operands if (t := o.tensor_id) is not None and t.split("/")[0] not in keys}
        outs = {f"{n.key}/{i}" for n in ops for i in range(n.n_outputs)}
        leaving = {t for t in outs if t in outputs or readers.get(t, set()) - keys}
        if len(ins) != 1 or len(leaving) != 1:
            continue
        shape = next(o.shape for n in ops for o in n.operands if o.tensor_id in ins)
        if any(n.out_shapes[:1] != [shape] for n in ops):
            continue
        if _gated(ops, ins):
            continue
        found[scope] = [n.key for n in ops]
    return found


#: gates whose product with their own input a runtime runs in integer (QLinearSigmoid or a float
#: gate between Q/DQ, then QLinearMul): hardswish as ``x * hardsigmoid(x)``, SiLU as ``x * sigmoid(x)``
_GATES = frozenset({"sigmoid", "hardsigmoid"})


def _gated(ops: list[OpNode], ins: set[str]) -> bool:
    """Whether a region is ``x * gate(x)`` (two ops): quantize_static runs its product as
    QLinearMul, so it is left to the integer-chain pass instead of kept float as one piece."""
    if len(ops) != 2:
        return False
    gate, mul = ops
    if mul.kind != "mul" or (gate.func if gate.kind == "act" else gate.kind) not in _GATES:
        return False
    return {o.tensor_id for o in mul.operands} == {*ins, f"{gate.key}/0"}
