"""Attention of the LLM generation export (export/llm/onnx.py) as ONNX Runtime's fused contrib ops.

What ONNX Runtime GenAI's model builder emits, per layer: ``com.microsoft.RotaryEmbedding`` on q and
k, then one ``com.microsoft.GroupQueryAttention`` that appends the new keys/values to the past,
attends causally (and within a sliding window where the layer has one) and shares each KV head
between its query heads without repeating it. The decomposed form (masks, rotate-half, KV repeat by
expand/reshape, concat, matmul/softmax) costs about 37 shape/index nodes per layer per step, each
paying ORT's per-node overhead.

The file's interface stays what the decomposed graph accepts: a left-padded ``attention_mask``
``[B, P+S]``, prefill, decode and multi-token steps on a past, in batches. The kernel is told that
every row holds the whole ``P+S`` slots (``seqlens_k = P+S-1``, ``query_seqlens = S``, which lifts
its batch-1 rule for multi-token steps on a past); the padded slots are masked by
``attention_bias`` (0 / float32 min, built once per step and shared by the layers), and rotary
runs before the op from explicit positions (``cumsum(mask) - 1``, or the ``position_ids`` input),
since the op's own rotary reads only the first position of a prompt row, which left padding makes
wrong. ``local_window_size`` equals transformers' ``sliding_window`` (keys ``window`` or more slots
back are dropped). These rules were checked against the decomposed attention in ORT 1.32.

Each residual add and the RMSNorm after it become one ``com.microsoft.SkipSimplifiedLayerNormalization``
(ORT's optimizer fuses a lone RMSNorm into SimplifiedLayerNormalization when it loads a file, but
leaves the add).

Each op is a ``torch.autograd.Function`` whose ``forward`` is the exact decomposed computation (what
the traced module and the export's ORT check compare with) and whose ``symbolic`` writes the
contrib op (TorchScript exporter).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

#: the GroupQueryAttention inputs the fused form feeds (ORT >= 1.32 has all of them on CPU)
_GQA_INPUTS = ("query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length",
               "cos_cache", "sin_cache", "position_ids", "attention_bias", "head_sink", "k_scale", "v_scale",
               "q_norm_weight", "k_norm_weight", "query_seqlens")


@functools.cache
def fused_attention_supported() -> bool:
    """Whether the installed onnxruntime's GroupQueryAttention takes ``attention_bias`` and
    ``query_seqlens`` at the input slots the fused form writes (what left padding and batched
    multi-token steps need); the decomposed form is written otherwise."""
    try:
        from onnxruntime.capi import onnxruntime_pybind11_state as c

        for s in c.get_all_operator_schema():
            if s.name == "GroupQueryAttention" and s.domain == "com.microsoft":
                return tuple(i.name for i in s.inputs)[: len(_GQA_INPUTS)] == _GQA_INPUTS
    except (ImportError, AttributeError):
        pass
    return False


def rotary_caches(inv_freq: torch.Tensor, length: int, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``[length, rotary_dim/2]`` of positions ``0..length-1``, times the RoPE's
    attention scaling: the same products and functions as the decomposed form's per-position ones."""
    freqs = torch.arange(length).float()[:, None] * inv_freq
    return freqs.cos() * scaling, freqs.sin() * scaling


def _none(g: Any) -> Any:
    """An omitted optional input (an empty name in the ONNX node)."""
    n = g.op("prim::Constant")
    n.setType(torch._C.OptionalType.ofTensor())
    return n


class RotaryFn(torch.autograd.Function):
    """Rotate-half RoPE on the first ``rotary_dim`` dims of each head of ``x`` ``[B, S, H*D]`` at
    ``positions`` ``[B, S]``; exported as ``com.microsoft.RotaryEmbedding``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                heads: int) -> torch.Tensor:
        b, s, hd = x.shape
        r = 2 * cos_cache.shape[1]
        cos = torch.cat([cos_cache[positions]] * 2, dim=-1)[:, :, None]  # [B, S, 1, r]
        sin = torch.cat([sin_cache[positions]] * 2, dim=-1)[:, :, None]
        xh = x.view(b, s, heads, hd // heads)
        rot, rest = xh[..., :r], xh[..., r:]
        half = rot.shape[-1] // 2
        rotated = rot * cos + torch.cat((-rot[..., half:], rot[..., :half]), dim=-1) * sin
        return torch.cat([rotated, rest], dim=-1).reshape(b, s, hd)

    @staticmethod
    def symbolic(g: Any, x: Any, positions: Any, cos_cache: Any, sin_cache: Any, heads: int) -> Any:
        rotary_dim = 2 * int(cos_cache.type().sizes()[1])
        out = g.op("com.microsoft::RotaryEmbedding", x, positions, cos_cache, sin_cache, interleaved_i=0,
                   num_heads_i=heads, rotary_embedding_dim_i=rotary_dim)
        out.setType(x.type())
        return out


def slot_rotary(x: torch.Tensor, first: int, cos_cache: torch.Tensor, sin_cache: torch.Tensor, heads: int) -> torch.Tensor:
    """:class:`RotaryFn` at positions ``first, first+1, ...`` in every row (the KV slots): what
    GroupQueryAttention's own rotary (``do_rotary``) applies when it is given no ``position_ids``."""
    b, s = x.shape[:2]
    return RotaryFn.forward(None, x, (torch.arange(s) + first).expand(b, s), cos_cache, sin_cache, heads)


class GroupQueryAttentionFn(torch.autograd.Function):
    """Causal attention of ``q`` ``[B, S, H*D]`` over ``past_k/v`` ``[B, KV, P, D]`` and the new
    ``k/v`` ``[B, S, KV*D]``, each KV head shared by ``H/KV`` consecutive query heads, plus
    ``bias`` ``[B, 1, S, P+S]`` (0 or float32 min: left padding); a layer with a ``window`` drops
    keys ``window`` or more slots behind the query. Returns ``(out [B, S, H*D], present_k,
    present_v [B, KV, P+S, D])``; exported as ``com.microsoft.GroupQueryAttention``.

    ``packed`` (0/1; ints, which the exporter passes to ``symbolic`` as they are): ``q`` is ``[q | k | v]`` ``[B, S, (H+2*KV)*D]`` (one projection's output, the op's
    packed-QKV input; ``k`` and ``v`` are ignored), which spares the Split a file would otherwise
    run per layer. ``rotary`` (0/1): the op applies rotate-half RoPE from ``cos_cache``/``sin_cache`` to q and
    k itself (``do_rotary``), at the KV slot of each token (``P + i``): in a left-padded row that
    is the token's position plus the row's padding, a shift common to all its queries and keys,
    which RoPE's scores do not see (they depend on position differences only), so the two
    RotaryEmbedding nodes per layer go away."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past_k: torch.Tensor,
                past_v: torch.Tensor, seqlens_k: torch.Tensor, total: torch.Tensor, bias: torch.Tensor,
                query_lens: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor, heads: int,
                kv_heads: int, scale: float, window: int, packed: int,
                rotary: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, s = q.shape[:2]
        d = past_k.shape[3]
        p = past_k.shape[2]
        t = p + s
        if packed:
            q, k, v = q.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
        if rotary:
            q = slot_rotary(q, p, cos_cache, sin_cache, heads)
            k = slot_rotary(k, p, cos_cache, sin_cache, kv_heads)
        present_k = torch.cat([past_k, k.reshape(b, s, kv_heads, d).transpose(1, 2)], dim=2)
        present_v = torch.cat([past_v, v.reshape(b, s, kv_heads, d).transpose(1, 2)], dim=2)
        rep = heads // kv_heads
        kk = present_k[:, :, None].expand(b, kv_heads, rep, t, d).reshape(b, heads, t, d)
        vv = present_v[:, :, None].expand(b, kv_heads, rep, t, d).reshape(b, heads, t, d)
        slot = torch.arange(s) + p
        masked = torch.arange(t)[None, :] > slot[:, None]
        if window >= 0:
            masked = masked | ((slot[:, None] - torch.arange(t)[None, :]) >= window)
        # the decomposed form's additive mask: float32 min once wherever a key is masked for any reason
        add = torch.where(masked[None, None], torch.finfo(torch.float32).min, bias)
        qh = q.reshape(b, s, heads, d).transpose(1, 2)
        probs = torch.softmax((qh @ kk.transpose(2, 3) * scale + add).float(), dim=-1).to(q.dtype)
        out = (probs @ vv).transpose(1, 2).reshape(b, s, heads * d)
        return out, present_k, present_v

    @staticmethod
    def symbolic(g: Any, q: Any, k: Any, v: Any, past_k: Any, past_v: Any, seqlens_k: Any, total: Any, bias: Any,
                 query_lens: Any, cos_cache: Any, sin_cache: Any, heads: int, kv_heads: int, scale: float, window: int,
                 packed: int, rotary: int) -> Any:
        none = _none(g)
        kv = [none, none] if packed else [k, v]
        caches = [cos_cache, sin_cache] if rotary else [none, none]
        inputs = [q, *kv, past_k, past_v, seqlens_k, total, *caches, none, bias, none, none, none, none, none,
                  query_lens]
        out, pk, pv = g.op("com.microsoft::GroupQueryAttention", *inputs, outputs=3, num_heads_i=heads,
                           kv_num_heads_i=kv_heads, scale_f=scale, local_window_size_i=window,
                           do_rotary_i=int(rotary), rotary_interleaved_i=0)
        sizes = q.type().varyingSizes()
        if packed and sizes is not None and sizes[-1] is not None:  # H*D wide, not the packed (H+2*KV)*D
            out.setType(q.type().with_sizes([*sizes[:-1], sizes[-1] // (heads + 2 * kv_heads) * heads]))
        else:
            out.setType(q.type())
        pk.setType(past_k.type())
        pv.setType(past_v.type())
        return out, pk, pv


class SkipRMSNormFn(torch.autograd.Function):
    """``(RMSNorm(x + residual) * weight, x + residual)``, transformers' RMSNorm arithmetic (float32);
    exported as ``com.microsoft.SkipSimplifiedLayerNormalization`` (ORT fuses a lone RMSNorm into
    SimplifiedLayerNormalization when it loads the file, but not the residual add before it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        total = x + residual
        normed = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + eps)
        return weight * normed, total

    @staticmethod
    def symbolic(g: Any, x: Any, residual: Any, weight: Any, eps: float) -> Any:
        out, _, _, total = g.op("com.microsoft::SkipSimplifiedLayerNormalization", x, residual, weight, outputs=4,
                                epsilon_f=eps)
        out.setType(x.type())
        total.setType(x.type())
        return out, total


def rms_norm_params(module: Any) -> tuple[torch.Tensor, float] | None:
    """``(weight, eps)`` of a transformers RMSNorm (``weight * x / rms(x)``, as Llama's), else None."""
    weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
    if type(module).__name__.endswith("RMSNorm") and isinstance(weight, torch.Tensor) and isinstance(eps, float):
        return weight, eps
    return None
