"""Attention written out in tensor ops, so that quantizers reach its projections and matmuls.

``F.scaled_dot_product_attention`` is one call: :func:`decomposed_attention` writes it as
``q @ k^T * scale``, mask, softmax, ``@ v`` with a ``quant(role, tensor)`` hook on the inputs of the
two matmuls (the graph the ONNX exporter writes for it anyway).

``F.multi_head_attention_forward`` (what ``nn.MultiheadAttention`` and so ``nn.Transformer*``
layers run) is one opaque call too: its packed ``in_proj_weight`` is a bare Parameter and
``out_proj`` is never called as a module, so module swap sees neither. :func:`decomposed_mha`
computes the same thing (to float rounding) from ordinary calls: ``F.linear`` in-projections
(packed, split for cross-attention, or separate ``q/k/v_proj_weight`` with ``kdim``/``vdim``),
head reshapes, ``F.scaled_dot_product_attention`` (or :func:`attention_with_weights` when the
caller wants the attention weights) and the ``F.linear`` out-projection. The graph tracer and the
quantizing mode run it with themselves active (:func:`redirect`), so placement sees those calls like
any others: functional weights, attention matmuls, shared activation quantizers.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import handle_torch_function, has_torch_function


def decomposed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    quant: Callable[[str, torch.Tensor], torch.Tensor],
    return_probs: bool = False,
) -> Any:
    """``F.scaled_dot_product_attention`` written out, with ``quant(role, tensor)`` on q, k^T, the
    softmax output and v (the inputs of the two matmuls), on ``q @ k^T`` and the scale it is
    multiplied by (roles ``qk``, ``scale``), on the scaled scores (``scores``) and, for a float mask,
    on the mask and its sum with the scores (``mask``, ``biased``); ``quant`` passes through a role
    it was not given a quantizer for. ``return_probs``: also return the
    probabilities (after dropout), as ``(output, probs)``."""
    n_q, n_kv = query.size(-3) if query.dim() >= 3 else 1, key.size(-3) if key.dim() >= 3 else 1
    if enable_gqa and n_q != n_kv:
        key = key.repeat_interleave(n_q // n_kv, dim=-3)
        value = value.repeat_interleave(n_q // n_kv, dim=-3)
    s = scale if scale is not None else 1.0 / math.sqrt(query.size(-1))
    qk = torch.matmul(quant("q", query), quant("k", key.transpose(-2, -1)))
    # integer scores where quantized: QLinearMatMul, then QLinearMul by the scale as a quantized constant
    scores = quant("qk", qk) * quant("scale", torch.tensor(s, dtype=qk.dtype, device=qk.device))
    L, S = query.size(-2), key.size(-2)
    # a bool mask fills with the lowest finite value, not -inf: a query row that sees no key then
    # gets finite (uniform) probabilities, which observers can calibrate on, and is zeroed on the
    # output, [.., L, Ev] (cheaper than zeroing the [.., L, S] probabilities)
    low = torch.finfo(scores.dtype).min
    if is_causal or (attn_mask is not None and attn_mask.dtype == torch.bool):
        # where the scores are quantized, the fill is too, on their grid (role ``filled``: the scores'
        # quantizer, whose range the mode extends MASK_GAP below the lowest score during calibration),
        # so the fill lands on the grid's lowest code and the softmax reads 8-bit codes (QLinearWhere,
        # QLinearSoftmax)
        scores = quant("scores", scores)
        fill = quant("filled", torch.tensor(low, dtype=scores.dtype, device=scores.device))
    if is_causal:
        keep = torch.ones(L, S, dtype=torch.bool, device=query.device).tril()
        scores = quant("filled", scores.masked_fill(~keep, fill))
    dead: torch.Tensor | None = None  # query rows that may see no key at all (padding)
    dead_probs: torch.Tensor | None = None  # the same, where the probabilities themselves are NaN
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = quant("filled", scores.masked_fill(~attn_mask, fill))
            dead = ~attn_mask.any(dim=-1, keepdim=True)
        else:  # the scores plus a bias or mask: quantized as one add where the runtime fuses it
            mask = quant("mask", attn_mask)
            biased = quant("scores", scores) + mask
            scores = quant("biased", biased)
            # float -inf reaches the softmax: a row of it alone (max -inf) would be NaN. Where the
            # mask or the sum is quantized, -inf lands on the grid's lowest code like any value
            # below the calibrated range, and such a row weighs its keys evenly (as a row of
            # finfo.min does in float): no guard then, nothing between the softmax and its codes
            if scores is biased and mask is attn_mask and attn_mask.size(-1):
                # one reduction, where isneginf().all() took three passes
                dead_probs = attn_mask.amax(dim=-1, keepdim=True) == float("-inf")
    elif not is_causal:
        scores = quant("scores", scores)  # the softmax's input: QLinearSoftmax where it is quantized
    probs = torch.softmax(scores, dim=-1)
    if dead_probs is not None:  # softmax of an all -inf row is NaN; SDPA gives such a row zeros
        probs = probs.masked_fill(dead_probs, 0.0)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p, training=True)
    out = torch.matmul(quant("p", probs), quant("v", value))
    if dead is not None:
        out = out.masked_fill(dead, 0.0)
        if return_probs:
            probs = probs.masked_fill(dead, 0.0)
    return (out, probs) if return_probs else out


#: how far below the lowest calibrated score the grid of masked scores reaches: a masked key then
#: weighs at most exp(-MASK_GAP) (6e-6) of any unmasked one after the softmax
MASK_GAP = 12.0


def _no_quant(role: str, t: torch.Tensor) -> torch.Tensor:
    return t


def attention_with_weights(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(softmax(q k^T / sqrt(d) + mask) @ v, probabilities)``: attention that also returns its
    weights (``nn.MultiheadAttention(need_weights=True)``). A torch function (modes see it, as they
    see ``F.scaled_dot_product_attention``) so that placement quantizes it like SDPA."""
    if has_torch_function((query, key, value)):
        return handle_torch_function(
            attention_with_weights, (query, key, value), query, key, value, attn_mask=attn_mask, dropout_p=dropout_p
        )
    return decomposed_attention(
        query, key, value, attn_mask, dropout_p, quant=_no_quant, return_probs=True
    )


def mha_unsupported(query: Any, key: Any, value: Any) -> str | None:
    """Why a ``multi_head_attention_forward`` call is left as the one opaque (float) op, or None
    when :func:`decomposed_mha` computes it."""
    tensors = (query, key, value)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return "nn.MultiheadAttention called with non-tensor query/key/value"
    if any(t.is_nested for t in tensors):
        return "nn.MultiheadAttention on nested tensors is not decomposed (its weights stay float)"
    if not all(t.is_floating_point() for t in tensors):
        return "nn.MultiheadAttention inputs are not floating point"
    if torch.jit.is_scripting() or torch.jit.is_tracing():
        return "nn.MultiheadAttention under TorchScript is not decomposed"
    return None


_MHA_SIGNATURE = inspect.signature(F.multi_head_attention_forward)


def bind_mha(args: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments of a ``multi_head_attention_forward`` call by name, defaults filled in."""
    bound = _MHA_SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def redirect(func: Any, args: Any, kwargs: dict[str, Any]) -> Callable[[], Any] | None:
    """The decomposition a mode runs (with itself active) in place of ``func``, or None.

    The tracer and the quantizing mode both call this first, so the op calls (and their keys) they
    see are the same ones."""
    if func is not F.multi_head_attention_forward:
        return None
    a = bind_mha(args, kwargs)
    if mha_unsupported(a["query"], a["key"], a["value"]) is not None:
        return None
    return lambda: decomposed_mha(**a)


def _in_projection(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v projections from the packed ``in_proj_weight`` (rows: q, then k, then v)."""
    e = query.size(-1)
    if key is value and query is key:  # self-attention: one projection, split after
        q, k, v = F.linear(query, w, b).chunk(3, dim=-1)
        return q, k, v
    if key is value:  # encoder-decoder attention: k and v share one projection
        w_q, w_kv = w.split([e, 2 * e])
        b_q, b_kv = b.split([e, 2 * e]) if b is not None else (None, None)
        k, v = F.linear(key, w_kv, b_kv).chunk(2, dim=-1)
        return F.linear(query, w_q, b_q), k, v
    w_q, w_k, w_v = w.chunk(3)
    bq, bk, bv = b.chunk(3) if b is not None else (None, None, None)
    return F.linear(query, w_q, bq), F.linear(key, w_k, bk), F.linear(value, w_v, bv)


def decomposed_mha(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    embed_dim_to_check: int,
    num_heads: int,
    in_proj_weight: torch.Tensor | None,
    in_proj_bias: torch.Tensor | None,
    bias_k: torch.Tensor | None,
    bias_v: torch.Tensor | None,
    add_zero_attn: bool,
    dropout_p: float,
    out_proj_weight: torch.Tensor,
    out_proj_bias: torch.Tensor | None,
    training: bool = True,
    key_padding_mask: torch.Tensor | None = None,
    need_weights: bool = True,
    attn_mask: torch.Tensor | None = None,
    use_separate_proj_weight: bool = False,
    q_proj_weight: torch.Tensor | None = None,
    k_proj_weight: torch.Tensor | None = None,
    v_proj_weight: torch.Tensor | None = None,
    static_k: torch.Tensor | None = None,
    static_v: torch.Tensor | None = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``F.multi_head_attention_forward`` (same arguments, same results to float rounding) from
    ``F.linear``, reshapes, ``F.scaled_dot_product_attention`` / :func:`attention_with_weights`.

    Shape checks and mask canonicalization are torch's own helpers, so bad inputs fail as they do
    in torch."""
    shape_check: Any = getattr(F, "_mha_shape_check")  # noqa: B009 (private to torch, not in its stubs)
    is_batched = shape_check(query, key, value, key_padding_mask, attn_mask, num_heads)
    if not is_batched:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    tgt_len, bsz, embed_dim = query.shape
    src_len = key.shape[0]
    key_padding_mask = F._canonical_mask(
        mask=key_padding_mask, mask_name="key_padding_mask", other_type=F._none_or_dtype(attn_mask),
        other_name="attn_mask", target_type=query.dtype,
    )
    if is_causal and attn_mask is None:
        raise RuntimeError("Need attn_mask if specifying the is_causal hint (nn.MultiheadAttention)")
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None  # SDPA's own causal mask
    else:
        attn_mask = F._canonical_mask(
            mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="", target_type=query.dtype,
            check_other=False,
        )
        if key_padding_mask is not None:
            is_causal = False  # merged with the padding mask below: no longer causal alone
    if embed_dim != embed_dim_to_check:
        raise AssertionError(f"was expecting embedding dimension of {embed_dim_to_check}, but got {embed_dim}")
    head_dim = embed_dim // num_heads
    if head_dim * num_heads != embed_dim:
        raise AssertionError(f"embed_dim {embed_dim} not divisible by num_heads {num_heads}")

    if not use_separate_proj_weight:
        if in_proj_weight is None:
            raise AssertionError("use_separate_proj_weight is False but in_proj_weight is None")
        if key.shape != value.shape:
            raise AssertionError(f"key shape {key.shape} does not match value shape {value.shape}")
        q, k, v = _in_projection(query, key, value, in_proj_weight, in_proj_bias)
    else:
        if q_proj_weight is None or k_proj_weight is None or v_proj_weight is None:
            raise AssertionError("use_separate_proj_weight is True but q/k/v_proj_weight is None")
        bq, bk, bv = in_proj_bias.chunk(3) if in_proj_bias is not None else (None, None, None)
        q, k, v = F.linear(query, q_proj_weight, bq), F.linear(key, k_proj_weight, bk), F.linear(value, v_proj_weight, bv)

    if attn_mask is not None:
        if attn_mask.dim() == 2:
            if tuple(attn_mask.shape) != (tgt_len, src_len):
                raise RuntimeError(f"The shape of the 2D attn_mask is {attn_mask.shape}, but should be {(tgt_len, src_len)}.")
            attn_mask = attn_mask.unsqueeze(0)
        elif attn_mask.dim() != 3 or tuple(attn_mask.shape) != (bsz * num_heads, tgt_len, src_len):
            raise RuntimeError(f"attn_mask of shape {tuple(attn_mask.shape)} is not supported "
                               f"(expected {(tgt_len, src_len)} or {(bsz * num_heads, tgt_len, src_len)})")
    if bias_k is not None and bias_v is not None:
        if static_k is not None or static_v is not None:
            raise AssertionError("bias cannot be added to static key/value.")
        k = torch.cat([k, bias_k.repeat(1, bsz, 1)])
        v = torch.cat([v, bias_v.repeat(1, bsz, 1)])
        attn_mask = F.pad(attn_mask, (0, 1)) if attn_mask is not None else None
        key_padding_mask = F.pad(key_padding_mask, (0, 1)) if key_padding_mask is not None else None
    elif bias_k is not None or bias_v is not None:
        raise AssertionError("bias_k and bias_v must be given together")

    # heads: (len, bsz, E) -> (bsz * heads, len, head_dim)
    q = q.reshape(tgt_len, bsz * num_heads, head_dim).transpose(0, 1)
    k = k.reshape(k.shape[0], bsz * num_heads, head_dim).transpose(0, 1) if static_k is None else static_k
    v = v.reshape(v.shape[0], bsz * num_heads, head_dim).transpose(0, 1) if static_v is None else static_v
    if add_zero_attn:
        zeros = torch.zeros((bsz * num_heads, 1, head_dim), dtype=k.dtype, device=k.device)
        k, v = torch.cat([k, zeros], dim=1), torch.cat([v, zeros.to(v.dtype)], dim=1)
        attn_mask = F.pad(attn_mask, (0, 1)) if attn_mask is not None else None
        key_padding_mask = F.pad(key_padding_mask, (0, 1)) if key_padding_mask is not None else None
    src_len = k.size(1)
    if key_padding_mask is not None:
        if tuple(key_padding_mask.shape) != (bsz, src_len):
            raise AssertionError(f"Expected key_padding_mask of shape {(bsz, src_len)}, got {tuple(key_padding_mask.shape)}")
        kpm = key_padding_mask.reshape(bsz, 1, 1, src_len).expand(-1, num_heads, -1, -1).reshape(bsz * num_heads, 1, src_len)
        attn_mask = kpm if attn_mask is None else attn_mask + kpm
    if not training:
        dropout_p = 0.0

    if need_weights:
        if is_causal and attn_mask is None:
            raise AssertionError("is_causal needs attn_mask when need_weights=True")
        out, weights = attention_with_weights(q, k, v, attn_mask, dropout_p)
    else:
        if attn_mask is not None:
            attn_mask = attn_mask.unsqueeze(0) if attn_mask.size(0) == 1 else attn_mask.reshape(bsz, num_heads, -1, src_len)
        q = q.reshape(bsz, num_heads, tgt_len, head_dim)
        k = k.reshape(bsz, num_heads, src_len, head_dim)
        v = v.reshape(bsz, num_heads, src_len, head_dim)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal)
        weights = None
    # (bsz * heads, tgt, head_dim) or (bsz, heads, tgt, head_dim) -> (tgt, bsz, E)
    out = out.reshape(bsz, num_heads, tgt_len, head_dim).permute(2, 0, 1, 3).reshape(tgt_len * bsz, embed_dim)
    out = F.linear(out, out_proj_weight, out_proj_bias).reshape(tgt_len, bsz, -1)
    if weights is not None:
        weights = weights.reshape(bsz, num_heads, tgt_len, src_len)
        if average_attn_weights:
            weights = weights.mean(dim=1)
    if not is_batched:
        out = out.squeeze(1)
        weights = weights.squeeze(0) if weights is not None else None
    return out, weights
