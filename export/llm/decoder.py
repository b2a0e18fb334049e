"""The decoder :func:`export.llm.onnx.export_llm_onnx` traces: :class:`KVDecoder`, a hand-written
``(input_ids, attention_mask, *past) -> (logits, *present)`` forward over a transformers causal LM's
own modules, with the attention decomposed into plain ops or written as ORT's fused contrib ops
(export/llm/attention.py); where each family keeps its parts is data (:data:`LAYOUTS`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from compress.export.llm.attention import (
    GroupQueryAttentionFn,
    RotaryFn,
    SkipRMSNormFn,
    rms_norm_params,
    rotary_caches,
)
from torch import nn

from compress.core.errors import ExportError, UnsupportedModelError

Attention = Literal["fused", "decomposed"]

# ---- the traced decoder -------------------------------------------------------------------------------


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


@dataclass(frozen=True)
class Layout:
    """Where a decoder family keeps its parts (attribute names), read by :class:`KVDecoder`."""

    base: str = "model"  # the decoder stack under the LM head
    layers: str = "layers"
    embed: str = "embed_tokens"
    positions: str | None = None  # a learned absolute position table (GPT-2's wpe); None: rotary
    attn: str = "self_attn"
    attn_norm: str = "input_layernorm"
    mlp_norm: str = "post_attention_layernorm"
    out_proj: str = "o_proj"
    final_norm: str = "norm"


#: the families :func:`export_llm_onnx` writes; Qwen3's q/k norms and fused qkv projections
#: (Phi-3's ``qkv_proj``, GPT-2's ``c_attn``) are found on the attention module itself
LAYOUTS: dict[str, Layout] = {
    # the MoE families run their own sparse block as the layer's MLP, its experts unpacked (compress/moe.py)
    **dict.fromkeys(("llama", "qwen2", "qwen3", "mistral", "phi3", "mixtral", "qwen2_moe", "qwen3_moe"), Layout()),
    "gpt2": Layout(base="transformer", layers="h", embed="wte", positions="wpe", attn="attn", attn_norm="ln_1",
                   mlp_norm="ln_2", out_proj="c_proj", final_norm="ln_f"),
}
SUPPORTED = tuple(LAYOUTS)


class KVDecoder(nn.Module):
    """``(input_ids, attention_mask, *past) -> (logits, *present)`` over a transformers causal LM of a
    :data:`LAYOUTS` family: pre-norm blocks, rotary or learned absolute positions, GQA, fused or
    separate q/k/v projections."""

    lm: Any  # a transformers causal LM (its submodules are reached by attribute)
    inv_freq: torch.Tensor
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor

    def __init__(self, model: nn.Module, *, attention: Attention = "decomposed") -> None:
        super().__init__()
        cfg = check_decoder(model)
        self.lm = model
        self.layout = LAYOUTS[cfg.model_type]
        self.n_layers = cfg.num_hidden_layers
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.rotary = self.layout.positions is None
        rot: Any = getattr(self.base, "rotary_emb", None)
        inv = rot.inv_freq.detach().float().clone() if self.rotary else torch.zeros(0)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.rope_scaling = float(getattr(rot, "attention_scaling", 1.0))
        self.windows = sliding_windows(cfg)
        #: a ``position_ids`` input after the mask (what Optimum feeds) instead of positions from the mask
        self.explicit_positions = False
        #: logits of the last position only (``[B, 1, V]``): what generation reads, without the lm_head
        #: over every prompt position (llama.cpp's default; a fifth of SmolLM2-135M's prefill work)
        self.last_logits = False
        if attention not in ("fused", "decomposed"):
            raise ExportError(f"attention must be 'fused' or 'decomposed' (got {attention!r})")
        #: "fused": RotaryEmbedding + GroupQueryAttention per layer (export/llm/attention.py)
        self.attention = attention
        if self.rotary and attention == "fused":  # positions 0..max_position_embeddings-1, as the model declares
            length = int(getattr(cfg, "max_position_embeddings", 0) or 0)
            if length <= 0:
                raise UnsupportedModelError(f"{type(model).__name__}: no max_position_embeddings to size the rotary cache")
            cos, sin = rotary_caches(self.inv_freq, length, self.rope_scaling)
        else:
            cos = sin = torch.zeros(0, 0)
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    @property
    def base(self) -> Any:
        return getattr(self.lm, self.layout.base)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *rest: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``rest``: ``position_ids`` ``[B, S]`` first when :attr:`explicit_positions`, then the past."""
        base, lay = self.base, self.layout
        b, s = input_ids.shape
        past = rest[1:] if self.explicit_positions else rest
        p = past[0].shape[2]
        if self.explicit_positions:
            pos = rest[0]
        else:  # positions count real tokens only (left padding), as transformers' generate derives them
            pos = positions(attention_mask, s)
        if self.attention == "fused":
            return self._forward_fused(input_ids, attention_mask, pos, past)
        t = p + s
        causal = torch.arange(t, device=input_ids.device)[None, :] > (torch.arange(s, device=input_ids.device) + p)[:, None]
        masked = causal[None] | (attention_mask[:, None, :] == 0)  # [B, S, T]: future keys and padding
        lowest = torch.finfo(torch.float32).min
        mask = (masked.float() * lowest)[:, None]  # [B, 1, S, T]
        # sliding-window layers also drop keys `window` or more slots back (transformers' rule)
        behind = (torch.arange(s, device=input_ids.device) + p)[:, None] - torch.arange(t, device=input_ids.device)[None, :]
        window_mask = {w: ((masked | (behind >= w)[None]).float() * lowest)[:, None]
                       for w in set(self.windows) if w is not None}
        h = getattr(base, lay.embed)(input_ids)
        if self.rotary:
            freqs = pos[..., None].float() * self.inv_freq
            emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, S, D]
            cos, sin = emb.cos() * self.rope_scaling, emb.sin() * self.rope_scaling
        else:
            h = h + getattr(base, lay.positions)(pos)  # type: ignore[arg-type]
        presents: list[torch.Tensor] = []
        for i, layer in enumerate(getattr(base, lay.layers)):
            attn = getattr(layer, lay.attn)
            x = getattr(layer, lay.attn_norm)(h)
            q, k, v = self._qkv(attn, x)
            if self.rotary:
                q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            k = torch.cat([past[2 * i], k], dim=2)
            v = torch.cat([past[2 * i + 1], v], dim=2)
            presents += [k, v]
            rep = self.n_heads // self.n_kv
            if rep > 1:
                k = k[:, :, None].expand(b, self.n_kv, rep, t, self.head_dim).reshape(b, self.n_heads, t, self.head_dim)
                v = v[:, :, None].expand(b, self.n_kv, rep, t, self.head_dim).reshape(b, self.n_heads, t, self.head_dim)
            w = self.windows[i]
            scores = torch.matmul(q, k.transpose(2, 3)) * attn.scaling + (mask if w is None else window_mask[w])
            probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
            o = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim)
            h = h + getattr(attn, lay.out_proj)(o)
            h = h + layer.mlp(getattr(layer, lay.mlp_norm)(h))
        logits = self.lm.lm_head(self._positions_read(getattr(base, lay.final_norm)(h)))
        return (logits, *presents)

    def _forward_fused(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, pos: torch.Tensor,
                       past: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """:meth:`forward` with each layer's attention as RotaryEmbedding + GroupQueryAttention."""
        base, lay = self.base, self.layout
        b, s = input_ids.shape
        t = attention_mask.shape[1]
        # every row holds all t slots (its left padding masked by the bias); computed once per step
        seqlens = torch.ones_like(attention_mask).sum(-1, dtype=torch.int32) - 1
        total = torch.ones_like(attention_mask[0]).sum(dtype=torch.int32)
        query_lens = torch.ones_like(input_ids).sum(-1, dtype=torch.int32)
        pad = (attention_mask == 0).float() * torch.finfo(torch.float32).min
        bias = pad[:, None, None, :].expand(b, 1, s, t)
        h = getattr(base, lay.embed)(input_ids)
        if not self.rotary:
            h = h + getattr(base, lay.positions)(pos)  # type: ignore[arg-type]
        in_op = self._rotary_in_op()
        presents: list[torch.Tensor] = []
        pending: torch.Tensor | None = None  # the sublayer output not yet added to the residual stream h
        for i, layer in enumerate(getattr(base, lay.layers)):
            attn = getattr(layer, lay.attn)
            x, h = self._add_norm(getattr(layer, lay.attn_norm), h, pending)
            packed = self._packed_qkv(attn, x) if in_op or not self.rotary else None
            if packed is not None:  # [q | k | v] straight from one projection into the op, no Split
                q = k = v = packed
            else:
                q, k, v = self._flat_qkv(attn, x)
                if self.rotary and not in_op:
                    q = RotaryFn.apply(q, pos, self.cos_cache, self.sin_cache, self.n_heads)
                    k = RotaryFn.apply(k, pos, self.cos_cache, self.sin_cache, self.n_kv)
            w = self.windows[i]
            o, pk, pv = GroupQueryAttentionFn.apply(q, k, v, past[2 * i], past[2 * i + 1], seqlens, total, bias,
                                                    query_lens, self.cos_cache, self.sin_cache, self.n_heads,
                                                    self.n_kv, float(attn.scaling), -1 if w is None else w,
                                                    int(packed is not None), int(in_op))
            presents += [pk, pv]
            x, h = self._add_norm(getattr(layer, lay.mlp_norm), h, getattr(attn, lay.out_proj)(o))
            pending = layer.mlp(x)
        x, _ = self._add_norm(getattr(base, lay.final_norm), h, pending)
        return (self.lm.lm_head(self._positions_read(x)), *presents)

    def _positions_read(self, x: torch.Tensor) -> torch.Tensor:
        """The final hidden states the lm_head runs on: every position, or the last (:attr:`last_logits`)."""
        return x[:, -1:] if self.last_logits else x

    @staticmethod
    def _add_norm(norm: Any, h: torch.Tensor, pending: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(h + pending), h + pending)``: one SkipSimplifiedLayerNormalization for an RMSNorm."""
        rms = rms_norm_params(norm)
        if pending is None:
            return norm(h), h
        if rms is None:  # GPT-2's LayerNorm: the add and the norm as they are
            h = h + pending
            return norm(h), h
        return SkipRMSNormFn.apply(h, pending, rms[0], rms[1])

    def _rotary_in_op(self) -> bool:
        """Whether GroupQueryAttention rotates q and k itself (at the KV slots): where positions are the
        slots up to a per-row shift (derived from the mask, not fed) and the rotary covers whole heads;
        else RotaryEmbedding runs on q and k before it."""
        return self.rotary and not self.explicit_positions and 2 * self.cos_cache.shape[1] == self.head_dim

    def _packed_qkv(self, attn: Any, x: torch.Tensor) -> torch.Tensor | None:
        """``[q | k | v]`` ``[B, S, (H+2*KV)*D]`` where one projection computes them (a packed
        MatMulNBits, Phi-3's ``qkv_proj``, GPT-2's ``c_attn``) and nothing runs between it and the
        attention (Qwen3's q/k norms do); else None."""
        fused = getattr(attn, "qkv_proj", None) or getattr(attn, "c_attn", None)
        if fused is None or hasattr(attn, "q_norm"):
            return None
        out: torch.Tensor = fused(x)
        return out

    def _flat_qkv(self, attn: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as ``[B, S, heads*D]`` (what GroupQueryAttention reads), Qwen3's q/k norms applied."""
        b, s = x.shape[:2]
        fused = getattr(attn, "qkv_proj", None) or getattr(attn, "c_attn", None)
        if fused is not None:
            nq, nk = self.n_heads * self.head_dim, self.n_kv * self.head_dim
            q, k, v = fused(x).split([nq, nk, nk], dim=-1)
        else:
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        if hasattr(attn, "q_norm"):
            q = attn.q_norm(q.view(b, s, self.n_heads, self.head_dim)).reshape(b, s, -1)
            k = attn.k_norm(k.view(b, s, self.n_kv, self.head_dim)).reshape(b, s, -1)
        return q, k, v

    def _qkv(self, attn: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Heads ``[B, H, S, D]`` of q, k, v: separate projections, or a fused one (Phi-3's ``qkv_proj``,
        GPT-2's ``c_attn``: ``[q | k | v]``);
        Qwen3's per-head RMSNorms on q and k (before RoPE) where the attention has them."""
        b, s = x.shape[:2]
        q, k, v = self._flat_qkv(attn, x)
        return (q.view(b, s, self.n_heads, self.head_dim).transpose(1, 2),
                k.view(b, s, self.n_kv, self.head_dim).transpose(1, 2),
                v.view(b, s, self.n_kv, self.head_dim).transpose(1, 2))

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary embedding on the first ``cos.shape[-1]`` dims (all of them unless the config sets a
        partial_rotary_factor, as Phi models may); the rest pass through."""
        r = cos.shape[-1]
        if r == x.shape[-1]:
            return x * cos + _rotate_half(x) * sin
        rot, rest = x[..., :r], x[..., r:]
        return torch.cat([rot * cos + _rotate_half(rot) * sin, rest], dim=-1)

    def dummy_inputs(self, batch: int, past: int, new: int) -> tuple[torch.Tensor, ...]:
        ids = torch.randint(0, int(self.lm.config.vocab_size), (batch, new))
        return self.feed(ids, torch.ones(batch, past + new, dtype=torch.long), self.empty_past(batch, past))

    def feed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, past: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The forward's arguments for one step: ``position_ids`` from the mask where the graph takes them."""
        pos = (positions(attention_mask, input_ids.shape[1]),) if self.explicit_positions else ()
        return (input_ids, attention_mask, *pos, *past)

    def empty_past(self, batch: int, length: int = 0) -> list[torch.Tensor]:
        return [torch.zeros(batch, self.n_kv, length, self.head_dim) for _ in range(2 * self.n_layers)]


def positions(attention_mask: torch.Tensor, new: int) -> torch.Tensor:
    """``[B, new]`` positions of the last ``new`` tokens: real tokens counted, left padding at 0."""
    return (torch.cumsum(attention_mask, dim=-1) - 1)[:, attention_mask.shape[1] - new :].clamp(min=0)


def check_decoder(model: nn.Module) -> Any:
    """The model's config if it is a supported decoder, else UnsupportedModelError saying why."""
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    if cfg is None or kind not in LAYOUTS:
        raise UnsupportedModelError(
            f"LLM ONNX export supports transformers {', '.join(SUPPORTED)} causal LMs (got {kind or type(model).__name__})"
        )
    lay = LAYOUTS[kind]
    base = getattr(model, lay.base, None)
    if not hasattr(model, "lm_head") or base is None or (lay.positions is None and not hasattr(base, "rotary_emb")):
        need = f".{lay.base}" + (" (with rotary_emb)" if lay.positions is None else "")
        raise UnsupportedModelError(f"{type(model).__name__}: expected {need} and .lm_head")
    if getattr(cfg, "add_cross_attention", False):
        raise UnsupportedModelError(f"{type(model).__name__}: has cross-attention; only decoder-only LMs are exported")
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if isinstance(rope, dict) and rope.get("rope_type", "default") in ("dynamic", "longrope"):
        raise UnsupportedModelError(f"RoPE type '{rope['rope_type']}' changes with the sequence length; not exported")
    return cfg


def sliding_windows(cfg: Any) -> list[int | None]:
    """Each layer's attention window (None: full causal), from ``layer_types`` where the config has
    them (Qwen2's ``use_sliding_window``/``max_window_layers``), else ``sliding_window`` on every
    layer (Mistral)."""
    w = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types:
        return [int(w) if t == "sliding_attention" and w else None for t in types]
    return [int(w) if w else None] * int(cfg.num_hidden_layers)
