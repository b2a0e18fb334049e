"""Tracer rules for attention: activation matmuls, scaled_dot_product_attention and
``nn.MultiheadAttention`` (traced as a whole, with heads as units)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from compress.pruning.attention import PrunedMultiheadAttention
from compress.pruning.graph import IN, OUT
from compress.pruning.rule_helpers import (
    Rule,
    RuleTracer,
    along,
    const_along,
    couple,
    linear_t,
    norm_items,
    pin_if_shaped,
    varies,
)
from torch import nn

log = logging.getLogger(__name__)


def matmul_labels(tr: RuleTracer, a: torch.Tensor, b: torch.Tensor, op: str) -> torch.Tensor | None:
    """Couple the contracted dim of ``a @ b`` (labels, >= 2-D) and return the output's labels.

    An output element takes ``b``'s column label when that is one id along the contraction (the
    values' channel in ``attn @ v``), else ``a``'s row label, else its batch entry's (the head).
    """
    if a.dim() < 2 or b.dim() < 2:
        tr.graph.pin(torch.cat([a.reshape(-1), b.reshape(-1)]), f"1-D '{op}' {tr.where()}")
        return None
    try:
        batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    except RuntimeError as exc:
        raise tr.unsupported(op, str(exc)) from None
    A = a.broadcast_to((*batch, *a.shape[-2:]))
    B = b.broadcast_to((*batch, *b.shape[-2:]))
    g = tr.graph
    # channels contracted against a tensor without channels (an input, a constant) cannot shrink
    if bool((B < 0).all()) and varies(tr, A, -1):
        g.pin(A, f"'{op}' contracting channels with a fixed tensor {tr.where()}")
    if bool((A < 0).all()) and varies(tr, B, -2):
        g.pin(B, f"'{op}' contracting channels with a fixed tensor {tr.where()}")
    g.union_tensors(A, A[..., :1, :].expand_as(A))
    g.union_tensors(B, B[..., :, :1].expand_as(B))
    g.union_tensors(A[..., 0, :], B[..., :, 0])
    varying = any(varies(tr, A, d) or varies(tr, B, d) for d in range(len(batch)))
    rep: torch.Tensor | None = None
    if varying:
        # a head dim: everything in head h of a goes with head h of b
        A2, B2 = A.reshape(*batch, -1), B.reshape(*batch, -1)
        g.union_tensors(A2, A2.amax(-1, keepdim=True).expand_as(A2))
        g.union_tensors(B2, B2.amax(-1, keepdim=True).expand_as(B2))
        g.union_tensors(A2.amax(-1), B2.amax(-1))
        rep = torch.maximum(A2.amax(-1), B2.amax(-1))
    bmax, bmin = B.amax(-2), B.amin(-2)
    col = torch.where(bmax == bmin, bmax, torch.full_like(bmax, -1))
    amax, amin = A.amax(-1), A.amin(-1)
    row = torch.where(amax == amin, amax, torch.full_like(amax, -1))
    shape = (*batch, A.shape[-2], B.shape[-1])
    out = col.unsqueeze(-2).expand(shape)
    out = torch.where(out >= 0, out, row.unsqueeze(-1).expand(shape))
    if rep is not None:
        out = torch.where(out >= 0, out, rep[..., None, None].expand(shape))
    macs = int(torch.Size(batch).numel() * A.shape[-2] * A.shape[-1] * B.shape[-1])
    g.mac_records.append(("matmul", macs, (A, B)))
    return out


def matmul(tr: RuleTracer, name: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
    a, b = (args[1], args[0]) if name == "__rmatmul__" else (args[0], args[1])
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise tr.unsupported(name, "non-tensor operand")
    if tr.is_param(b) and b.dim() == 2 and not tr.is_param(a) and a.dim() >= 1:
        linear_t(tr, name, a, b, None, out)  # x @ W: a Linear stored transposed
        return
    if tr.is_param(a) or tr.is_param(b):
        # x @ W with a bare weight: its rows and columns would both need slicing; keep the channels
        for t in (a, b):
            lab = tr.labels(t, bare=False)
            if lab is not None:
                tr.graph.pin(lab, f"'{name}' with a bare weight {tr.where()}")
        return
    lab = matmul_labels(tr, tr.labels_or_blank(a), tr.labels_or_blank(b), name)
    if lab is not None and isinstance(out, torch.Tensor):
        tr.set_labels(out, lab.reshape(out.shape))


def sdpa(tr: RuleTracer, name: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
    q, k, v = (args[i] if len(args) > i else kwargs[n] for i, n in enumerate(("query", "key", "value")))
    ql, kl, vl = (tr.labels_or_blank(t) for t in (q, k, v))
    if kwargs.get("enable_gqa") and q.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        # grouped-query attention: query head h reads key/value head h // n_rep, exactly as if the
        # code had repeated k and v itself (transformers' repeat_kv); the labels say so
        n_rep = q.shape[-3] // k.shape[-3]
        kl, vl = (lab.repeat_interleave(n_rep, dim=-3) for lab in (kl, vl))
    scores = matmul_labels(tr, ql, kl.transpose(-2, -1), name)
    mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
    if scores is not None and isinstance(mask, torch.Tensor):
        mlab = tr.labels(mask) if mask.is_floating_point() else None
        if mlab is not None:
            # a learned additive bias per head (T5's relative position bias): its heads are these heads
            tr.graph.union_tensors(scores, mlab.broadcast_to(scores.shape))
        else:
            pin_if_shaped(tr, scores, mask, name)
    res = matmul_labels(tr, scores, vl, name) if scores is not None else None
    if res is not None:
        tr.set_labels(out, res.reshape(out.shape))


def _einsum_spec(eq: str, ndims: list[int]) -> tuple[list[str], str] | None:
    """Operand and output subscripts with ``...`` spelled out; None for diagonals or bad input."""
    eq = eq.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    ins = lhs.split(",")
    if len(ins) != len(ndims):
        return None
    spare = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in eq]
    width = max((n - len(t.replace("...", "")) for t, n in zip(ins, ndims) if "..." in t), default=0)
    ell = "".join(spare[:width])
    out_ins = []
    for t, n in zip(ins, ndims):
        if "..." in t:
            t = t.replace("...", ell[width - (n - len(t.replace("...", ""))) :])
        if len(t) != n or len(set(t)) != len(t):
            return None
        out_ins.append(t)
    if not arrow:
        counts = {c: sum(t.count(c) for t in out_ins) for c in set("".join(out_ins))}
        rhs = ell + "".join(sorted(c for c, k in counts.items() if k == 1 and c not in ell))
    rhs = rhs.replace("...", ell)
    return out_ins, rhs


def einsum(tr: RuleTracer, name: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
    """``einsum`` with one or two operands, as a permute/reduce or a batched matmul of the labels."""
    eq = args[0]
    ops = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
    spec = _einsum_spec(eq, [o.dim() for o in ops]) if isinstance(eq, str) else None
    if spec is None or len(ops) > 2 or not isinstance(out, torch.Tensor):
        raise tr.unsupported(name, f"equation {eq!r} (diagonals, or more than two operands)")
    ins, rhs = spec
    if any(tr.is_param(o) for o in ops):
        for o in ops:  # a bare weight's rows and columns would both need slicing; keep the channels
            lab = tr.labels(o, bare=False)
            if lab is not None:
                tr.graph.pin(lab, f"'{name}' with a bare weight {tr.where()}")
        return
    labs = [tr.labels_or_blank(o) for o in ops]
    sizes = {c: n for t, o in zip(ins, ops) for c, n in zip(t, o.shape)}
    if len(ops) == 1:
        t, lab = ins[0], labs[0]
        gone = tuple(i for i, c in enumerate(t) if c not in rhs)
        red = const_along(lab, gone, keepdim=False)
        kept = [c for c in t if c in rhs]
        tr.set_labels(out, red.permute(*[kept.index(c) for c in rhs]))
        return
    (ta, tb), (la, lb) = ins, labs
    # letters summed inside one operand only reduce it first
    la, ta = _einsum_reduce(la, ta, tb + rhs)
    lb, tb = _einsum_reduce(lb, tb, ta + rhs)
    batch = [c for c in ta if c in tb and c in rhs]
    ka = [c for c in ta if c in tb and c not in rhs]
    ma, nb = [c for c in ta if c not in tb], [c for c in tb if c not in ta]

    def arrange(lab: torch.Tensor, t: str, first: list[str], second: list[str]) -> torch.Tensor:
        def size(c: str) -> int:
            return lab.shape[t.index(c)] if c in t else 1

        moved = lab.permute(*[t.index(c) for c in batch + first + second])
        dims = [size(c) for c in batch] + [math.prod(size(c) for c in first), math.prod(size(c) for c in second)]
        return moved.reshape(dims)

    A = arrange(la, ta, ma, ka)
    B = arrange(lb, tb, ka, nb)
    res = matmul_labels(tr, A, B, name)
    if res is None:
        return
    full = res.reshape(*[res.shape[i] for i in range(len(batch))], *[sizes[c] for c in ma], *[sizes[c] for c in nb])
    order = batch + ma + nb
    tr.set_labels(out, full.permute(*[order.index(c) for c in rhs]).broadcast_to(out.shape))


def _einsum_reduce(lab: torch.Tensor, t: str, others: str) -> tuple[torch.Tensor, str]:
    gone = tuple(i for i, c in enumerate(t) if c not in others)
    if not gone:
        return lab, t
    return const_along(lab, gone, keepdim=False), "".join(c for c in t if c in others)


def baddbmm(tr: RuleTracer, name: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
    """``beta * input + alpha * batch1 @ batch2`` (Bloom's ALiBi scores): the product's labels, and
    the added term's: joined when it has channels, else it pins what its shape spans (per-head
    slopes computed for the unpruned head count would stop fitting)."""
    inp, b1, b2 = (args[i] if len(args) > i else kwargs[n] for i, n in enumerate(("input", "batch1", "batch2")))
    lab = matmul_labels(tr, tr.labels_or_blank(b1), tr.labels_or_blank(b2), name)
    if lab is None or not isinstance(out, torch.Tensor):
        return
    if isinstance(inp, torch.Tensor):
        ilab = tr.labels(inp) if inp.is_floating_point() else None
        if ilab is not None:
            tr.graph.union_tensors(lab, ilab.broadcast_to(lab.shape))
        else:
            pin_if_shaped(tr, lab, inp, name)
    tr.set_labels(out, lab.reshape(out.shape))


def unsupported_matmul(tr: RuleTracer, name: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
    raise tr.unsupported(name, "write it as matmul/linear to make it prunable")


RULES: dict[str, Rule] = {
    "matmul": matmul,
    "mm": matmul,
    "bmm": matmul,
    "__rmatmul__": matmul,
    "scaled_dot_product_attention": sdpa,
    "einsum": einsum,
    "baddbmm": baddbmm,
    **dict.fromkeys(("addbmm", "addmv", "mv", "dot", "bilinear", "tensordot"), unsupported_matmul),
}


# ---- nn.MultiheadAttention -------------------------------------------------------------------


def _mha_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    names = ("query", "key", "value")
    return [args[i] if len(args) > i else kwargs[n] for i, n in enumerate(names)]


def mha_leaf(tr: RuleTracer, m: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
    """q/k/v input channels, per-head rows of in_proj and columns of out_proj, output channels."""
    inputs = _mha_inputs(args, kwargs)
    attn_out = output[0] if isinstance(output, tuple) else output
    w = getattr(m, "in_proj_weight", None)
    wn = tr.param_name(w)
    if not getattr(m, "_qkv_same_embed_dim", True) or getattr(m, "bias_k", None) is not None or getattr(m, "add_zero_attn", False) or w is None or wn is None:
        # separate kdim/vdim projections or learned key/value biases: keep this module whole
        for t in inputs:
            lab = tr.labels(t, bare=False)
            if lab is not None:
                tr.graph.pin(lab, f"nn.MultiheadAttention variant {tr.where()}")
        log.warning("pruning leaves %s whole: kdim/vdim, bias_k or add_zero_attn are not supported", tr.where())
        return
    g = tr.graph
    mod = wn.rsplit(".", 1)[0]
    inner, e_in = w.shape[0] // 3, w.shape[1]
    hd = int(m.head_dim)
    e_out = m.out_proj.weight.shape[0]
    cin = g.item_labels(g.coord(wn, 1, e_in, IN, mod))
    rows = g.item_labels(g.coord(wn, 0, 3 * inner, OUT, mod))
    bias = norm_items(tr, [m.in_proj_bias], 3 * inner, mod)
    if bias is not None:
        g.union_tensors(rows, bias)
    on = str(tr.param_name(m.out_proj.weight))
    omod = on.rsplit(".", 1)[0]
    ocols = g.item_labels(g.coord(on, 1, inner, IN, omod))
    for k in range(inner // hd):
        s = slice(k * hd, (k + 1) * hd)
        g.union_all(torch.cat([rows[s], rows[inner:][s], rows[2 * inner :][s], ocols[s]]))
    oitems = g.item_labels(g.coord(on, 0, e_out, OUT, omod))
    obias = norm_items(tr, [m.out_proj.bias], e_out, omod)
    if obias is not None:
        g.union_tensors(oitems, obias)
    for t in inputs:
        couple(tr, tr.labels(t), -1, cin)
    tr.set_labels(attn_out, along(oitems, -1, tuple(attn_out.shape)))
    tokens_q, tokens_k = inputs[0].numel() // e_in, inputs[1].numel() // e_in
    g.mac_records.append(("weight", (tokens_q + 2 * tokens_k) * inner * e_in, (wn,)))
    g.mac_records.append(("weight", tokens_q * inner * e_out, (on,)))
    batch = inputs[0].shape[0] if m.batch_first else inputs[0].shape[1]
    attn_macs = 2 * batch * (tokens_q // batch) * (tokens_k // batch) * inner
    g.mac_records.append(("axis", attn_macs, (wn, 0)))


LEAVES: dict[type[nn.Module], Callable[..., None]] = {nn.MultiheadAttention: mha_leaf, PrunedMultiheadAttention: mha_leaf}
