"""Tracer rules for the ops that own parameters: conv, linear, norms, PReLU, embeddings."""

from __future__ import annotations

from typing import Any

import torch
from compress.pruning.graph import IN, NORM, OUT, VIRTUAL
from compress.pruning.rule_helpers import Rule, RuleTracer, along, arg, couple, dense, linear_t, norm_items

from compress.core.tracing import iter_tensors


def _weight(tr: RuleTracer, w: Any, x: Any, op: str) -> str | None:
    name = tr.param_name(w)
    if name is None and isinstance(x, torch.Tensor) and tr.labels(x, bare=False) is not None:
        raise tr.unsupported(op, "its weight is not a parameter of the model")
    return name


def conv(tr: RuleTracer, name: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
    x, w, b = arg(args, kwargs, 0, "input"), arg(args, kwargs, 1, "weight"), arg(args, kwargs, 2, "bias")
    groups = int(arg(args, kwargs, 6, "groups", 1))
    wn = _weight(tr, w, x, name)
    if wn is None:
        return
    mod = wn.rsplit(".", 1)[0]
    g = tr.graph
    transposed = "transpose" in name
    if transposed:
        if groups != 1:
            raise tr.unsupported(name, "grouped transposed convolutions are not supported")
        cin, cout = w.shape[0], w.shape[1]
        win, wout = g.coord(wn, 0, cin, IN, mod), g.coord(wn, 1, cout, OUT, mod)
        ins = g.item_labels(win)
    else:
        cout, ipg = w.shape[0], w.shape[1]
        cin = ipg * groups
        wout = g.coord(wn, 0, cout, OUT, mod)
        if groups == 1:
            ins = g.item_labels(g.coord(wn, 1, cin, IN, mod))
        elif g.grouped_conv == "width" and ipg > 1:
            # every group loses the same local input and output indices: groups stay, narrower
            ins = g.item_labels(g.coord(wn, 1, ipg, IN, mod)).repeat(groups)
            outs = g.item_labels(wout).view(groups, cout // groups)
            g.union_tensors(outs, outs[:1].expand_as(outs))
            g.group_width_convs[mod] = groups
        else:
            # a conv group is kept or removed whole: its inputs and outputs form one atom
            ins = g.item_labels(g.coord(mod + "#in", None, cin, VIRTUAL, mod))
            outs = g.item_labels(wout)
            opg = cout // groups
            for k in range(groups):
                g.union_all(torch.cat([ins[k * ipg : (k + 1) * ipg], outs[k * opg : (k + 1) * opg]]))
    out_items = g.item_labels(wout)
    bias_items = norm_items(tr, [b], cout, mod)
    if bias_items is not None:
        g.union_tensors(out_items, bias_items)
    cdim = 1 if x.dim() == w.dim() else 0
    couple(tr, tr.labels(x), cdim, ins)
    tr.set_labels(out, along(out_items, cdim, tuple(out.shape)))
    per_out = (w[0].numel() if not transposed else w.shape[1] * w[0, 0].numel()) if w.dim() > 1 else 1
    macs = out.numel() * per_out if not transposed else x.numel() * w[0].numel()
    g.mac_records.append(("weight", int(macs), (wn,)))


def linear(tr: RuleTracer, name: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
    x, w, b = arg(args, kwargs, 0, "input"), arg(args, kwargs, 1, "weight"), arg(args, kwargs, 2, "bias")
    wn = _weight(tr, w, x, name)
    if wn is None:
        return
    dense(tr, wn, tuple(w.shape), x, b, out, out_axis=0)


def addmm(tr: RuleTracer, name: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
    b, x, w = arg(args, kwargs, 0, "input"), arg(args, kwargs, 1, "mat1"), arg(args, kwargs, 2, "mat2")
    if tr.is_param(w) and w.dim() == 2 and not tr.is_param(x) and (not isinstance(b, torch.Tensor) or b.dim() <= 1):
        linear_t(tr, name, x, w, b, out)
        return
    if any(tr.labels(t) is not None for t in iter_tensors(args)):
        raise tr.unsupported(name, "only addmm(bias, x, weight) with a weight parameter is supported")


def _passthrough_norm(tr: RuleTracer, x: torch.Tensor, out: torch.Tensor, dim: int, items: torch.Tensor | None) -> None:
    lab = tr.labels(x)
    if items is None:
        if lab is not None:
            tr.set_labels(out, lab)
        return
    couple(tr, lab, dim, items)
    laid = along(items, dim, tuple(out.shape))
    tr.set_labels(out, laid if lab is None else torch.where(lab >= 0, lab, laid))


def batch_norm(tr: RuleTracer, name: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
    x = arg(args, kwargs, 0, "input")
    params = [arg(args, kwargs, i, n) for i, n in ((1, "running_mean"), (2, "running_var"), (3, "weight"), (4, "bias"))]
    names = [tr.param_name(p) for p in params if isinstance(p, torch.Tensor)]
    mod = next((n.rsplit(".", 1)[0] for n in names if n), tr.module_name())
    dim = 1 if x.dim() > 1 else 0
    _passthrough_norm(tr, x, out, dim, norm_items(tr, params, x.shape[dim], mod))


def layer_norm(tr: RuleTracer, name: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
    x, shape = arg(args, kwargs, 0, "input"), arg(args, kwargs, 1, "normalized_shape")
    w = arg(args, kwargs, 2, "weight")
    b = arg(args, kwargs, 3, "bias") if name == "layer_norm" else None
    lab = tr.labels(x)
    if len(tuple(shape)) != 1 or tr.param_name(w) is None:
        # the normalized shape is fixed in the module: those channels cannot shrink
        if lab is not None:
            tr.graph.pin(lab, f"'{name}' without a per-channel weight {tr.where()}")
            tr.set_labels(out, lab)
        return
    mod = str(tr.param_name(w)).rsplit(".", 1)[0]
    _passthrough_norm(tr, x, out, -1, norm_items(tr, [w, b], x.shape[-1], mod))


def group_norm(tr: RuleTracer, name: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
    x, groups = arg(args, kwargs, 0, "input"), int(arg(args, kwargs, 1, "num_groups"))
    w, b = arg(args, kwargs, 2, "weight"), arg(args, kwargs, 3, "bias")
    lab = tr.labels(x)
    if tr.param_name(w) is None:
        if lab is not None:
            tr.graph.pin(lab, f"'group_norm' without affine weight {tr.where()}")
            tr.set_labels(out, lab)
        return
    mod = str(tr.param_name(w)).rsplit(".", 1)[0]
    c = x.shape[1]
    items = norm_items(tr, [w, b], c, mod)
    assert items is not None
    per = c // groups
    for k in range(groups):  # statistics are per group: a group goes whole
        tr.graph.union_all(items[k * per : (k + 1) * per])
    _passthrough_norm(tr, x, out, 1, items)


def prelu(tr: RuleTracer, name: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
    x, w = arg(args, kwargs, 0, "input"), arg(args, kwargs, 1, "weight")
    wn = tr.param_name(w)
    items = None
    if wn is not None and w.numel() > 1:
        items = tr.graph.item_labels(tr.graph.coord(wn, 0, w.numel(), NORM, wn.rsplit(".", 1)[0]))
    _passthrough_norm(tr, x, out, 1 if x.dim() > 1 else 0, items)


def embedding(tr: RuleTracer, name: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
    w = arg(args, kwargs, 1, "weight")
    wn = tr.param_name(w)
    if wn is None:
        return
    c = tr.graph.coord(wn, 1, w.shape[1], OUT, wn.rsplit(".", 1)[0])
    tr.set_labels(out, along(tr.graph.item_labels(c), -1, tuple(out.shape)))


def mha_functional(tr: RuleTracer, name: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
    if any(tr.labels(t, bare=False) is not None for t in iter_tensors(args[:3])):
        raise tr.unsupported(name, "call it through nn.MultiheadAttention")


MODULE_OPS: dict[str, Rule] = {
    **dict.fromkeys(("conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"), conv),
    "linear": linear,
    "addmm": addmm,
    "batch_norm": batch_norm,
    "instance_norm": batch_norm,
    "layer_norm": layer_norm,
    "rms_norm": layer_norm,
    "group_norm": group_norm,
    "prelu": prelu,
    "embedding": embedding,
    "multi_head_attention_forward": mha_functional,
}
