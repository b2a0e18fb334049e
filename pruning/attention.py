"""Attention modules after head pruning.

``nn.MultiheadAttention`` ties its inner width to ``embed_dim`` (the query's width), so a layer
that lost heads or input/output channels cannot stay one. :class:`PrunedMultiheadAttention` is a
drop-in replacement with the same call signature, outputs and state_dict keys (``in_proj_weight``,
``in_proj_bias``, ``out_proj.*``) whose inner width is ``num_heads * head_dim``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from compress.core.errors import UnsupportedModelError


class PrunedMultiheadAttention(nn.Module):
    """Multi-head attention with independent input, inner (heads x head_dim) and output widths."""

    def __init__(
        self,
        in_dim: int,
        num_heads: int,
        head_dim: int,
        out_dim: int,
        *,
        bias: bool = True,
        dropout: float = 0.0,
        batch_first: bool = False,
    ) -> None:
        super().__init__()
        inner = num_heads * head_dim
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.dropout = dropout
        self.batch_first = batch_first
        self.in_proj_weight = nn.Parameter(torch.empty(3 * inner, in_dim))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * inner)) if bias else None
        self.out_proj = nn.Linear(inner, out_dim, bias=bias)
        nn.init.xavier_uniform_(self.in_proj_weight)

    @classmethod
    def from_module(cls, m: Any) -> PrunedMultiheadAttention:
        """Take over the (already sliced) parameters of an ``nn.MultiheadAttention``."""
        w = m.in_proj_weight
        if w is None or getattr(m, "bias_k", None) is not None or getattr(m, "add_zero_attn", False):
            raise UnsupportedModelError(f"cannot prune {type(m).__name__}: only packed q/k/v without bias_k is supported")
        head_dim = int(m.head_dim)
        inner = w.shape[0] // 3
        new = cls(
            w.shape[1],
            inner // head_dim,
            head_dim,
            m.out_proj.weight.shape[0],
            bias=m.in_proj_bias is not None,
            dropout=float(m.dropout),
            batch_first=bool(m.batch_first),
        )
        new.in_proj_weight = w
        new.in_proj_bias = m.in_proj_bias
        new.out_proj = m.out_proj
        return new

    def sync(self) -> None:
        """Read the head count back from the weights after slicing."""
        self.num_heads = self.in_proj_weight.shape[0] // 3 // self.head_dim

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        b, lq, _ = query.shape
        lk = key.shape[1]
        wq, wk, wv = self.in_proj_weight.chunk(3)
        bq, bk, bv = self.in_proj_bias.chunk(3) if self.in_proj_bias is not None else (None, None, None)
        q = F.linear(query, wq, bq).view(b, lq, -1, self.head_dim).transpose(1, 2)
        k = F.linear(key, wk, bk).view(b, lk, -1, self.head_dim).transpose(1, 2)
        v = F.linear(value, wv, bv).view(b, lk, -1, self.head_dim).transpose(1, 2)
        mask = _merge_masks(attn_mask, key_padding_mask, q, b, lq, lk)
        if is_causal and mask is None:
            mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril().logical_not()
            mask = torch.zeros(lq, lk, dtype=q.dtype, device=q.device).masked_fill(mask, float("-inf"))
        p = self.dropout if self.training else 0.0
        weights = None
        if need_weights:
            scores = torch.matmul(q, k.transpose(-2, -1)) * self.head_dim**-0.5
            if mask is not None:
                scores = scores + mask
            attn = F.dropout(torch.softmax(scores, dim=-1), p=p, training=self.training)
            out = torch.matmul(attn, v)
            weights = attn.mean(dim=1) if average_attn_weights else attn
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        out = self.out_proj(out.transpose(1, 2).reshape(b, lq, -1))
        if not self.batch_first:
            out = out.transpose(0, 1)
        return out, weights


def _merge_masks(
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    q: torch.Tensor,
    b: int,
    lq: int,
    lk: int,
) -> torch.Tensor | None:
    """One additive float mask of shape broadcastable to (b, heads, lq, lk), as nn.MultiheadAttention reads them."""
    mask: torch.Tensor | None = None
    if attn_mask is not None:
        m = attn_mask
        if m.dtype == torch.bool:
            m = torch.zeros_like(m, dtype=q.dtype).masked_fill(m, float("-inf"))
        mask = m.view(b, -1, lq, lk) if m.dim() == 3 else m
    if key_padding_mask is not None:
        kp = key_padding_mask
        if kp.dtype == torch.bool:
            kp = torch.zeros_like(kp, dtype=q.dtype).masked_fill(kp, float("-inf"))
        kp = kp.view(b, 1, 1, lk)
        mask = kp if mask is None else mask + kp
    return mask


def sync_attention_attrs(m: nn.Module) -> None:
    """Keep head counts of attention modules in step with their (sliced) q projection."""
    if isinstance(m, PrunedMultiheadAttention):
        m.sync()
        return
    q = next((getattr(m, n) for n in ("q", "query", "q_proj") if isinstance(getattr(m, n, None), nn.Linear)), None)
    if q is None:
        return
    if isinstance(getattr(m, "attention_head_size", None), int) and hasattr(m, "num_attention_heads"):
        m.num_attention_heads = q.out_features // m.attention_head_size
        if hasattr(m, "all_head_size"):
            m.all_head_size = q.out_features
    elif isinstance(getattr(m, "head_dim", None), int) and isinstance(getattr(m, "num_heads", None), int):
        m.num_heads = q.out_features // m.head_dim
