"""Per-op rules of the dependency tracer for ops without parameters: elementwise, layout (reshape,
split, select), reductions, pooling and padding; how each moves and couples channel labels.

Label tensors hold item ids per element (-1: none). Layout ops are replayed on the labels; mixing
ops (conv, linear, norms: ``rules_modules``; matmul, attention: ``rules_attention``) join items; an
op with labeled inputs and no rule raises UnsupportedModelError, never a guess (``pruning.trace``
holds the table of which rule runs for which op).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from compress.pruning.rule_helpers import (
    PendingSplit,
    Rule,
    RuleTracer,
    arg,
    const_along,
    factor,
    pin_if_shaped,
    resolve,
    splits_outer,
    varies,
)

from compress.core.tracing import iter_tensors

log = logging.getLogger(__name__)

UNARY = {
    "relu", "relu6", "gelu", "silu", "sigmoid", "tanh", "hardswish", "hardsigmoid", "hardtanh", "leaky_relu",
    "elu", "selu", "celu", "mish", "softplus", "softsign", "logsigmoid", "tanhshrink", "threshold",
    "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout",
    "softmax", "log_softmax", "softmin", "normalize", "abs", "neg", "exp", "log", "log1p", "expm1", "sqrt",
    "rsqrt", "square", "sin", "cos", "erf", "erfc", "reciprocal", "sign", "floor", "ceil", "round", "trunc",
    "clamp", "clip", "clamp_min", "clamp_max", "nan_to_num", "detach", "to", "type", "type_as", "float",
    "double", "half", "bfloat16", "cpu", "cuda", "requires_grad", "zeros_like", "ones_like", "empty_like",
    "full_like", "rand_like", "randn_like", "logical_not", "bitwise_not", "isnan", "isinf", "isfinite",
    "get:data", "cumsum", "cumprod",
}
ELEMENTWISE = {
    "add", "sub", "mul", "div", "truediv", "true_divide", "floordiv", "floor_divide", "__rsub__",
    "__rtruediv__", "__rdiv__", "pow", "__rpow__", "maximum", "minimum", "fmax", "fmin", "where",
    "masked_fill", "lerp", "addcmul", "addcdiv", "atan2", "hypot", "remainder", "fmod", "copysign",
    "logaddexp", "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "and", "or", "xor",
    "bitwise_and", "bitwise_or", "rsub",
}
RESHAPE = {"view", "reshape", "flatten", "unflatten", "view_as", "reshape_as"}
LAYOUT = {
    "permute", "transpose", "t", "movedim", "moveaxis", "swapaxes", "swapdims", "squeeze", "unsqueeze",
    "expand", "expand_as", "broadcast_to", "contiguous", "clone", "repeat", "tile", "flip", "roll",
    "repeat_interleave", "get:T", "get:mT", "cat", "concat", "concatenate", "stack",
}
SPLIT = {"split", "chunk", "tensor_split", "unbind", "split_with_sizes"}
SELECT = {"narrow", "select", "getitem", "index_select"}
REDUCE = {
    "mean", "sum", "amax", "amin", "max", "min", "logsumexp", "norm", "std", "var", "prod", "nansum",
    "nanmean", "median", "vector_norm", "std_mean", "var_mean", "linalg_vector_norm", "linalg_norm",
}
SPATIAL = {
    "max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d",
    "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "adaptive_max_pool1d",
    "adaptive_max_pool2d", "adaptive_max_pool3d", "lp_pool1d", "lp_pool2d", "interpolate", "upsample",
    "upsample_nearest", "upsample_bilinear", "pad", "max_pool2d_with_indices", "_max_pool2d",
    "_adaptive_max_pool2d", "fractional_max_pool2d",
}
NO_LABELS = {"new_zeros", "new_ones", "new_empty", "new_full", "new_tensor"}
ARG = {"argmax", "argmin", "argsort", "topk", "sort", "nonzero", "multinomial"}


# ---- generic ops ------------------------------------------------------------------------------


def unary(tr: RuleTracer, name: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
    x = next(iter_tensors(args))
    lab = tr.labels(x)
    if lab is None or not isinstance(out, torch.Tensor):
        return
    if tuple(out.shape) != tuple(lab.shape):
        raise tr.unsupported(name, f"shape {tuple(x.shape)} -> {tuple(out.shape)}")
    tr.set_labels(out, lab)


def elementwise(tr: RuleTracer, name: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
    if not isinstance(out, torch.Tensor):
        return
    shape = tuple(out.shape)
    labs: list[torch.Tensor] = []
    consts: list[torch.Tensor] = []
    tensors = list(iter_tensors((args, kwargs)))
    if not any(tr.labels(t) is not None for t in tensors):
        return
    for t in tensors:
        lab = tr.labels(t, buffers=True)
        if lab is None:
            consts.append(t)
        else:
            labs.append(lab.broadcast_to(shape))
    for other in labs[1:]:
        tr.graph.union_tensors(labs[0], other)
    res = labs[0]
    for other in labs[1:]:
        res = torch.where(res >= 0, res, other)
    for c in consts:
        pin_if_shaped(tr, res, c, name)
    tr.set_labels(out, res)


def _replay(tr: RuleTracer, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Call ``func`` with every floating tensor replaced by its labels (index tensors kept)."""

    def sub(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            if o.is_floating_point() or tr.labels(o) is not None:
                return tr.labels_or_blank(o)
            return o.cpu()  # index tensors meet labels, which live on the CPU
        if isinstance(o, (list, tuple)) and not isinstance(o, torch.Size):
            return type(o)(sub(v) for v in o)
        return o

    raw = getattr(func, "__name__", "")
    if raw.endswith("_") and not raw.startswith("_") and hasattr(torch.Tensor, raw[:-1]):
        func = getattr(torch.Tensor, raw[:-1])  # in-place view ops replay out of place
    return func(*[sub(a) for a in args], **{k: sub(v) for k, v in kwargs.items()})


def _blocks(a: tuple[int, ...], b: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Groups of dims of ``a`` and ``b`` (size-1 dims skipped) whose sizes multiply to the same value."""
    ia = [i for i, s in enumerate(a) if s != 1]
    ib = [i for i, s in enumerate(b) if s != 1]
    out: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(ia) and j < len(ib):
        da, db = [ia[i]], [ib[j]]
        pa, pb = a[ia[i]], b[ib[j]]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb and i < len(ia):
                pa *= a[ia[i]]
                da.append(ia[i])
                i += 1
            elif pb < pa and j < len(ib):
                pb *= b[ib[j]]
                db.append(ib[j])
                j += 1
            else:
                return []
        out.append((da, db))
    return out


def _reshape_constraints(
    tr: RuleTracer, name: str, lab_in: torch.Tensor, lab_out: torch.Tensor, pending: PendingSplit | None
) -> PendingSplit | None:
    """Constraints of a reshape; returns the split of a channel dim it starts, if any."""
    started = None
    for din, dout in _blocks(tuple(lab_in.shape), tuple(lab_out.shape)):
        if len(din) > 1 and len(dout) == 1 and pending is not None and not pending.resolved:
            if any(varies(tr, lab_in, d) for d in din):
                resolve(tr, pending, pieces=True)  # a split merged back (channel shuffle)
            continue
        if len(dout) < 2 or not any(varies(tr, lab_in, d) for d in din):
            continue
        if len(din) > 1:
            # a many-to-many reshape of channels has no index mapping that pruning could keep
            tr.graph.pin(lab_in, f"'{name}' regrouping channel dims {tr.where()}")
            continue
        # a channel dim split in (outer, inner...): rows of the outer factor (heads) or pieces of it
        # (q/k/v, shuffle groups) become units, as the ops that follow say
        started = started or factor(tr, lab_out, dout)
    return started


def _shape_arg(args: tuple[Any, ...]) -> list[Any]:
    rest = list(args[1:])
    if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)):
        return list(rest[0])
    return rest


def _width_attributes(tr: RuleTracer, name: str, args: tuple[Any, ...], lab_out: torch.Tensor) -> None:
    """Record module int attributes that a reshape passes as the size of a channel dim.

    ``x.reshape(n, self.hidden_dim, -1)`` or ``view(b, n, self.num_heads, self.head_dim)``: the
    pruned model must reshape with the new width, so surgery updates the attribute (found by value
    on the modules whose forward is running, innermost first). A value no module holds came from a
    shape (dynamic, nothing to do) or a literal (the cut's check then names the failing group).
    """
    shape = _shape_arg(args)
    if len(shape) != lab_out.dim():
        return
    for d, size in enumerate(shape):
        if not isinstance(size, int) or isinstance(size, bool) or size <= 1 or not varies(tr, lab_out, d):
            continue
        if any(type(s) is int and s == size and varies(tr, lab_out, j) for j, s in enumerate(shape) if j != d):
            continue  # two channel dims of that value: which one an attribute sizes is not knowable
        held = _attribute_holding(tr, size)
        if held:
            # which dims are channel units is known once the trace ends (slices_from_keep)
            tr.graph.width_attrs.append((held, lab_out.movedim(d, -1).reshape(-1, lab_out.shape[d])))


def _attribute_holding(tr: RuleTracer, size: int) -> list[tuple[str, str]]:
    """The int attributes of value ``size`` on the innermost running module that has any.

    One module may hold several (GPT-2's ``split_size == embed_dim``, Conv1D's ``nf == nx``):
    which one the code used is not knowable from values, so the first is taken and the cut tries
    the others when the pruned model does not run.
    """
    for mod_name, mod in reversed(tr.stack):
        hits = [k for k, v in vars(mod).items() if type(v) is int and v == size and not k.startswith("_")]
        if hits:
            return [(mod_name, k) for k in hits]
    return []


def layout(tr: RuleTracer, name: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
    replayed = _replay(tr, func, args, kwargs)
    outs, labs = list(iter_tensors(out)), list(iter_tensors(replayed))
    if len(outs) != len(labs):
        raise tr.unsupported(name, "could not replay it on channel labels")
    x = next(iter_tensors(args))
    lab_in = tr.labels_or_blank(x)
    pending = tr.pending.get(id(x))
    if pending is not None and not pending.resolved and name in SPLIT | SELECT:
        # q, k, v = qkv.unbind(0) / qkv[0] take pieces; a split inside the rows (LeViT's
        # split([key_dim, key_dim, d], dim=3), RoPE's x[..., : hd // 2]) says the rows are the units
        resolve(tr, pending, pieces=splits_outer(tr, pending, labs))
    if pending is not None and pending.resolved:
        pending = None
    if name in RESHAPE:
        pending = _reshape_constraints(tr, name, lab_in, labs[0], pending) or pending
        if name in ("view", "reshape"):
            _width_attributes(tr, name, args, labs[0])
    elif name in SPLIT and len(labs) > 1:
        same = all(tuple(lab.shape) == tuple(labs[0].shape) for lab in labs)
        sizes_fixed = name in ("split", "split_with_sizes") or (
            name == "tensor_split" and not isinstance(arg(args, kwargs, 1, "indices_or_sections"), int)
        )
        size = arg(args, kwargs, 1, "split_size_or_sections")
        dims = [d for d in range(lab_in.dim()) if any(lab.dim() == lab_in.dim() and lab.shape[d] != lab_in.shape[d] for lab in labs)]
        held = _attribute_holding(tr, size) if sizes_fixed and same and type(size) is int and len(dims) == 1 else []
        if held:
            # split(self.split_size) (GPT-2's fused qkv): equal pieces whose size follows the cut
            for lab in labs[1:]:
                tr.graph.union_tensors(labs[0], lab)
            tr.graph.width_attrs.append((held, labs[0].movedim(dims[0], -1).reshape(-1, labs[0].shape[dims[0]])))
        elif sizes_fixed:
            # split(x, 12) keeps cutting at 12 after pruning: channels of a split dim stay
            if any(varies(tr, lab_in, d) for d in dims):
                tr.graph.pin(lab_in, f"'{name}' at fixed sizes {tr.where()}")
        elif same:
            # code splits at fixed fractions: each piece must lose the same local indices
            for lab in labs[1:]:
                tr.graph.union_tensors(labs[0], lab)
        else:
            dims = [d for d in range(lab_in.dim()) if all(lab.dim() == lab_in.dim() for lab in labs)
                    and any(lab.shape[d] != lab_in.shape[d] for lab in labs)]
            if any(varies(tr, lab_in, d) for d in dims):
                tr.graph.pin(lab_in, f"'{name}' into unequal channel pieces {tr.where()}")
    elif name in SELECT:
        tensor_index = any(isinstance(t, torch.Tensor) and not t.is_floating_point() for t in iter_tensors(args[1:]))
        idims = _indexed_dims(name, args, kwargs, lab_in.dim()) if tensor_index else []
        if idims and tr.is_param(x):
            # a table indexed by positions (relative-position bias[index]): what the index picks is
            # a position, the other dims (heads) stay units
            for d in idims:
                tr.graph.union_tensors(lab_in, lab_in.narrow(d, 0, 1).expand_as(lab_in))
        r_in = set(torch.unique(tr.graph.roots(lab_in)).tolist()) - {-1}
        r_out = set(torch.unique(tr.graph.roots(labs[0])).tolist()) - {-1}
        indexes_channels = tensor_index and (idims is None or any(varies(tr, lab_in, d) for d in idims)) and len(r_in) > 1
        if r_in - r_out or indexes_channels:
            # a fixed index/slice into channels would select other channels after pruning
            tr.graph.pin(lab_in, f"'{name}' selecting channels {tr.where()}")
    for t, lab in zip(outs, labs):
        if tuple(t.shape) != tuple(lab.shape):
            raise tr.unsupported(name, "could not replay it on channel labels")
        tr.set_labels(t, lab)
        if pending is not None:
            tr.pending[id(t)] = pending


def _indexed_dims(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], ndim: int) -> list[int] | None:
    """Dims an integer tensor indexes (``t[idx]``, ``t[:, idx]``, ``index_select``); None if unclear."""
    if name == "index_select":
        return [int(arg(args, kwargs, 1, "dim")) % ndim]
    if name != "getitem" or len(args) < 2:
        return None
    key = args[1] if isinstance(args[1], tuple) else (args[1],)
    out: list[int] = []
    for pos, k in enumerate(key):
        if k is Ellipsis or k is None or (isinstance(k, torch.Tensor) and k.dtype == torch.bool):
            return None
        if isinstance(k, torch.Tensor):
            out.append(pos)
    return out


def _dims(dims: Any, ndim: int) -> tuple[int, ...] | None:
    if dims is None:
        return None
    if isinstance(dims, int):
        return (dims % ndim,)
    if isinstance(dims, (tuple, list)) and all(isinstance(d, int) for d in dims):
        return tuple(d % ndim for d in dims)
    return None


def reduce(tr: RuleTracer, name: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
    x = args[0]
    lab = tr.labels(x)
    if lab is None:
        return
    if name in ("max", "min") and len(args) > 1 and isinstance(args[1], torch.Tensor):
        elementwise(tr, name, func, args, kwargs, out)
        return
    dpos, kpos = (2, 3) if name in ("norm", "vector_norm", "linalg_vector_norm", "linalg_norm") else (1, 2)
    dim_arg = arg(args, kwargs, dpos, "dim")
    keepdim = bool(arg(args, kwargs, kpos, "keepdim", False)) if name not in ("std", "var", "std_mean", "var_mean") else bool(kwargs.get("keepdim", False))
    outs = [t for t in iter_tensors(out) if t.is_floating_point()]
    if dim_arg is None:
        return  # a full reduction: the scalar has no channel identity
    dims = _dims(dim_arg, x.dim())
    if dims is None:
        raise tr.unsupported(name, f"cannot read its dims {dim_arg!r}")
    res = const_along(lab, dims, keepdim=keepdim)
    for t in outs:
        if tuple(t.shape) != tuple(res.shape):
            raise tr.unsupported(name, "unexpected output shape")
        tr.set_labels(t, res)


def spatial(tr: RuleTracer, name: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
    x = args[0] if args else kwargs["input"]
    lab = tr.labels(x)
    if lab is None:
        return
    y = next(iter_tensors(out))
    lead = 2 if x.dim() >= 3 else 1
    if tuple(y.shape[:lead]) != tuple(x.shape[:lead]):
        raise tr.unsupported(name, f"it changes the channel dim ({tuple(x.shape)} -> {tuple(y.shape)})")
    res = const_along(lab, tuple(range(lead, x.dim())))
    if bool((res < 0).any() & (lab >= 0).any()):
        tr.graph.pin(lab, f"'{name}' over channel-varying dims {tr.where()}")
    tr.set_labels(y, res.expand(y.shape))


def pad(tr: RuleTracer, name: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
    """``F.pad`` pads the last ``len(pad) // 2`` dims, whatever the layout (Swin pads (B, H, W, C) with
    (0, 0, 0, pad_r, 0, pad_b)): only dims it actually pads must not hold channels."""
    x = args[0] if args else kwargs["input"]
    lab = tr.labels(x)
    widths = arg(args, kwargs, 1, "pad")
    if lab is None or not isinstance(out, torch.Tensor):
        return
    padded = [x.dim() - 1 - i // 2 for i, w in enumerate(widths) if w != 0]
    padded = sorted({d for d in padded if d >= 0})
    res = const_along(lab, tuple(padded))
    if bool((res < 0).any() & (lab >= 0).any()):
        tr.graph.pin(lab, f"'{name}' over channel-varying dims {tr.where()}")
    tr.set_labels(out, res.expand(out.shape))


def setitem(tr: RuleTracer, name: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
    target, value = args[0], args[2] if len(args) > 2 else None
    lab = tr.labels(target)
    vlab = tr.labels(value) if isinstance(value, torch.Tensor) else None
    if vlab is not None:
        tr.graph.pin(vlab, f"'__setitem__' {tr.where()}")
        if lab is not None:
            tr.graph.pin(lab, f"'__setitem__' {tr.where()}")


def no_labels(tr: RuleTracer, name: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
    """New tensors built from a shape: no channel identity."""


def arg_op(tr: RuleTracer, name: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
    """Indices into channels change meaning after pruning: pin what they index."""
    lab = tr.labels(args[0])
    if lab is not None:
        tr.graph.pin(lab, f"'{name}' {tr.where()}")
    for t in iter_tensors(out):
        if t.is_floating_point() and lab is not None and tuple(t.shape) == tuple(lab.shape):
            tr.set_labels(t, lab)


#: the rules of ops without parameters, by folded op name (see :func:`pruning.trace.func_name`)
RULES: dict[str, Rule] = {
    **dict.fromkeys(UNARY, unary),
    **dict.fromkeys(ELEMENTWISE, elementwise),
    **dict.fromkeys(RESHAPE | LAYOUT | SPLIT | SELECT, layout),
    **dict.fromkeys(REDUCE, reduce),
    **dict.fromkeys(SPATIAL, spatial),
    "pad": pad,
    **dict.fromkeys(NO_LABELS, no_labels),
    **dict.fromkeys(ARG, arg_op),
    "setitem": setitem,
}
