"""Tracer rules for attention: activation matmuls, scaled_dot_product_attention and
``nn.MultiheadAttention`` (traced as a whole, with heads as units)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pruning.attention import PrunedMultiheadAttention
from pruning.graph import IN, OUT
from pruning.rules import _along, _couple, _norm_items, _pin_if_shaped, _varies

if TYPE_CHECKING:
    from pruning.trace import Tracer

log = logging.getLogger(__name__)


def matmul_labels(tr: Tracer, a: torch.Tensor, b: torch.Tensor, op: str) -> torch.Tensor | None:
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
    g.union_tensors(A, A[..., :1, :].expand_as(A))
    g.union_tensors(B, B[..., :, :1].expand_as(B))
    g.union_tensors(A[..., 0, :], B[..., :, 0])
    varying = any(_varies(tr, A, d) or _varies(tr, B, d) for d in range(len(batch)))
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


def matmul(tr: Tracer, name: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
    a, b = (args[1], args[0]) if name == "__rmatmul__" else (args[0], args[1])
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise tr.unsupported(name, "non-tensor operand")
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


def sdpa(tr: Tracer, name: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
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
            _pin_if_shaped(tr, scores, mask, name)
    res = matmul_labels(tr, scores, vl, name) if scores is not None else None
    if res is not None:
        tr.set_labels(out, res.reshape(out.shape))


def unsupported_matmul(tr: Tracer, name: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
    raise tr.unsupported(name, "write it as matmul/linear to make it prunable")


RULES = {
    "matmul": matmul,
    "mm": matmul,
    "bmm": matmul,
    "__rmatmul__": matmul,
    "scaled_dot_product_attention": sdpa,
    **dict.fromkeys(("einsum", "baddbmm", "addmm", "addbmm", "addmv", "mv", "dot", "bilinear", "tensordot"), unsupported_matmul),
}


# ---- nn.MultiheadAttention -------------------------------------------------------------------


def _mha_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    names = ("query", "key", "value")
    return [args[i] if len(args) > i else kwargs[n] for i, n in enumerate(names)]


def mha_leaf(tr: Tracer, m: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
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
    bias = _norm_items(tr, [m.in_proj_bias], 3 * inner, mod)
    if bias is not None:
        g.union_tensors(rows, bias)
    on = str(tr.param_name(m.out_proj.weight))
    omod = on.rsplit(".", 1)[0]
    ocols = g.item_labels(g.coord(on, 1, inner, IN, omod))
    for k in range(inner // hd):
        s = slice(k * hd, (k + 1) * hd)
        g.union_all(torch.cat([rows[s], rows[inner:][s], rows[2 * inner :][s], ocols[s]]))
    oitems = g.item_labels(g.coord(on, 0, e_out, OUT, omod))
    obias = _norm_items(tr, [m.out_proj.bias], e_out, omod)
    if obias is not None:
        g.union_tensors(oitems, obias)
    for t in inputs:
        _couple(tr, tr.labels(t), -1, cin)
    tr.set_labels(attn_out, _along(oitems, -1, tuple(attn_out.shape)))
    tokens_q, tokens_k = inputs[0].numel() // e_in, inputs[1].numel() // e_in
    g.mac_records.append(("weight", (tokens_q + 2 * tokens_k) * inner * e_in, (wn,)))
    g.mac_records.append(("weight", tokens_q * inner * e_out, (on,)))
    batch = inputs[0].shape[0] if m.batch_first else inputs[0].shape[1]
    attn_macs = 2 * batch * (tokens_q // batch) * (tokens_k // batch) * inner
    g.mac_records.append(("axis", attn_macs, (wn, 0)))


LEAVES: dict[type[nn.Module], Callable[..., None]] = {nn.MultiheadAttention: mha_leaf, PrunedMultiheadAttention: mha_leaf}
