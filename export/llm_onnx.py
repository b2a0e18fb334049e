"""ONNX export of decoder-only LLMs (Llama, Qwen2/Qwen3, Mistral, Phi-3, GPT-2, Mixtral, Qwen2/3-MoE) for generation with a
key/value cache.

``export_llm_onnx(model, path, weights="int4")`` writes a graph that ONNX Runtime runs step by step:

- inputs ``input_ids`` int64 ``[B, S]``, ``attention_mask`` int64 ``[B, P+S]`` (0 marks left
  padding) and, per layer ``i``, ``past_key_values.{i}.key`` / ``.value`` float32
  ``[B, kv_heads, P, head_dim]`` (P = 0 on the first step);
- outputs ``logits`` ``[B, S, vocab]`` and ``present.{i}.key`` / ``.value`` ``[B, kv_heads, P+S,
  head_dim]``, which the next step feeds back as its past (the names ORT GenAI uses).

Positions count the unpadded tokens (``cumsum(attention_mask) - 1``, as transformers' generate
does) and attention is causal over past and new tokens, padding masked out, so batched prompts
of different lengths run left-padded. The graph is traced from
:class:`KVDecoder`, a hand-written forward over the model's own modules (embeddings, RMSNorms,
projections, MLPs, rotary frequencies), because transformers' cache objects do not trace into a
graph with explicit past tensors; where each family keeps those parts is data (:data:`LAYOUTS`).
Rotary embeddings use the model's precomputed ``inv_freq`` and ``attention_scaling`` (default,
linear and llama3 RoPE; dynamic RoPE is refused); GPT-2's learned position table is indexed by the
same positions. Attention is written as ORT's RotaryEmbedding + GroupQueryAttention per layer
(``attention="fused"``, export/llm_attention.py: the same computation over the same inputs) where
the installed onnxruntime's GroupQueryAttention has the inputs it needs, else in plain ONNX ops
(``"decomposed"``).

Weights: ``"int4"`` writes every weight-only 4-bit QuantLinear as ``com.microsoft.MatMulNBits``
(bits 4, block size = the group size, float32 scales, packed uint8 zero points when asymmetric;
per-channel scales become one block of the next power of two >= K, and a K not divisible by the
block is padded with zero-point codes, which dequantize to 0; q/k/v and a gated MLP's gate/up packed
into one op each, export/matmul_nbits.py) and other Linears in float;
``"fp32"`` writes every weight in float32 — for a fake-quant model its quantized values, so both
files compute the fake-quant model up to float rounding. ``"w8a8"`` writes Linears with quantized
inputs in integer form (export/llm_w8a8.py: QDQ + MatMul for static per-tensor activations,
per-token quantization + MatMulInteger for dynamic ones), int4 weight-only layers as MatMulNBits
and the rest in float. GPTQ's act_order in this project keeps static groups (no g_idx), so nothing extra is
exported; a g_idx permutation is refused.

:func:`generate_ort` runs greedy generation on such a file; :class:`OrtGenerator` exposes the
prefill and decode steps separately (benchmarks time them).
"""

from __future__ import annotations

import copy
import logging
import math
import tempfile
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from compress.core.errors import ExportError, UnsupportedModelError
from compress.core.machine import has_vnni
from compress.core.moe import unpack_experts
from compress.core.ort import inference_session, session_options
from export.llm_attention import (
    GroupQueryAttentionFn,
    RotaryFn,
    SkipRMSNormFn,
    fused_attention_supported,
    rms_norm_params,
    rotary_caches,
)

# the MatMulNBits names stay importable from here (tests and callers read them from this module)
from export.matmul_nbits import (  # noqa: F401
    MatMulNBitsLinear,
    _MatMulNBitsFn,
    int8_head,
    matmul_nbits_tensors,
    pack_projections,
)
from quantization.lowering.int4 import (
    activation_quantizers,
    dequantize_int4,
    int4_weight,
    is_int4_weight_only,
)
from quantization.view import input_quantizer, remove_placement

log = logging.getLogger(__name__)

Weights = Literal["int4", "fp32", "w8a8"]
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
        if attention not in ("fused", "decomposed"):
            raise ExportError(f"attention must be 'fused' or 'decomposed' (got {attention!r})")
        #: "fused": RotaryEmbedding + GroupQueryAttention per layer (export/llm_attention.py)
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
        logits = self.lm.lm_head(getattr(base, lay.final_norm)(h))
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
        # the op rotates q and k itself at the KV slots where positions are the slots up to a per-row shift
        # (derived from the mask, not fed) and the rotary covers whole heads; else RotaryEmbedding per q and k
        in_op = self.rotary and not self.explicit_positions and 2 * self.cos_cache.shape[1] == self.head_dim
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
        return (self.lm.lm_head(x), *presents)

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


def _swap_linears(model: nn.Module, weights: Weights, accuracy_level: int) -> dict[str, int]:
    """Replace quantized layers in place: W8A8 modules (w8a8), MatMulNBitsLinear (int4) or float Linear."""
    counts = {"int4": 0, "float": 0, "w8a8": 0}
    w8a8: dict[str, nn.Module] = {}
    if weights == "w8a8":
        from export.llm_w8a8 import w8a8_linear

        shared: dict[int, Any] = {}
        for name, mod in list(model.named_modules()):
            if getattr(mod, "weight_quantizer", None) is not None:
                new8 = w8a8_linear(model, name, mod, shared)
                if new8 is not None:
                    w8a8[name] = new8
    for name, mod in list(model.named_modules()):
        if getattr(mod, "weight_quantizer", None) is None:
            continue
        if name in w8a8:
            model.set_submodule(name, w8a8[name])
            counts["w8a8"] += 1
            continue
        if getattr(mod, "input_quantizer", None) is not None or getattr(mod, "output_quantizer", None) is not None:
            raise UnsupportedModelError(
                f"{name}: quantized activations (W8A8) are not exported for generation here; weight-only layers are"
            )
        if weights in ("int4", "w8a8") and is_int4_weight_only(mod):
            new: nn.Module = MatMulNBitsLinear(int4_weight(mod, where=name), mod.bias,
                                               accuracy_level=accuracy_level, where=name)
            counts["int4"] += 1
        else:
            with torch.no_grad():
                w = (dequantize_int4(int4_weight(mod, where=name)) if is_int4_weight_only(mod)
                     else mod.quantized_weight().detach())
            lin = nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None)
            lin.weight = nn.Parameter(w.float().clone(), requires_grad=False)
            if mod.bias is not None:
                lin.bias = nn.Parameter(mod.bias.detach().float().clone(), requires_grad=False)
            new = lin
            counts["float"] += 1
        model.set_submodule(name, new)
    return counts


class _ScaledLinear(nn.Module):
    """``Linear(x * pre_scale)``: a quantized layer's float computation (SmoothQuant's ``1/s`` kept)."""

    pre_scale: torch.Tensor | None

    def __init__(self, linear: nn.Linear, pre_scale: torch.Tensor | None) -> None:
        super().__init__()
        self.linear = linear
        self.register_buffer("pre_scale", pre_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x if self.pre_scale is None else x * self.pre_scale)


def _float_linears(model: nn.Module) -> None:
    """Replace every quantized Linear of ``model`` by its float computation, in place: the weight as
    held (already smoothed) and the input quantizer's ``pre_quant_scale``, wherever the placement
    keeps that quantizer (on the Linear, or on a reshape before it, which KVDecoder does not run)."""
    for name, mod in list(model.named_modules()):
        if getattr(mod, "weight_quantizer", None) is None:
            continue
        iq: Any = input_quantizer(model, name)
        pre = None if iq is None or iq.pre_quant_scale is None else iq.pre_quant_scale.detach().float().clone()
        lin = nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None)
        weight: Any = mod.weight
        lin.weight = nn.Parameter(weight.detach().float().clone(), requires_grad=False)
        if mod.bias is not None:
            lin.bias = nn.Parameter(mod.bias.detach().float().clone(), requires_grad=False)
        model.set_submodule(name, _ScaledLinear(lin, pre))


def io_names(n_layers: int, *, position_ids: bool = False) -> tuple[list[str], list[str]]:
    past = [f"past_key_values.{i}.{kv}" for i in range(n_layers) for kv in ("key", "value")]
    present = [f"present.{i}.{kv}" for i in range(n_layers) for kv in ("key", "value")]
    return ["input_ids", "attention_mask", *(["position_ids"] if position_ids else []), *past], ["logits", *present]


def export_llm_onnx(
    model: nn.Module,
    path: str | Path,
    *,
    weights: Weights = "int4",
    accuracy_level: int = 4,
    opset: int = 17,
    check: bool = True,
    metadata: Mapping[str, str] | None = None,
    position_ids: bool = False,
    attention: Literal["auto", "fused", "decomposed"] = "auto",
    lm_head: Literal["auto", "int8", "float"] = "auto",
) -> Path:
    """Write ``model`` (a transformers causal LM of a :data:`LAYOUTS` family, float or fake-quant)
    as a single ONNX file with past/present key-value tensors. Returns the path.

    ``weights="int4"`` writes weight-only 4-bit layers as MatMulNBits (``accuracy_level`` is its
    attribute: 4, the default, lets ORT's CPU kernel quantize activations to int8 per block, as
    llama.cpp's Q4_0 dot products do and about 1.4x faster decode; 0 computes in float32, the
    fake-quant model's numbers); ``lm_head="int8"`` writes a float lm_head of such a file as an
    8-bit MatMulNBits (round to nearest, blocks of 32: llama.cpp's default Q8_0 for SmolLM2's tied
    embedding), which decodes about 3x faster than its float32 MatMul at a negligible perplexity cost
    (benchmarks/RESULTS.md ``ort_decode_sweep``), ``"float"`` keeps it float, ``"auto"`` (default) is
    int8 at accuracy_level 4 and float at 0 (whose file computes the model's own numbers); an lm_head
    the model quantized to 4 bits is written as it is;
    ``"fp32"`` writes all weights in float32; ``"w8a8"`` writes Linears with quantized inputs as
    integer ops (module docstring). The model itself is not modified. ``check`` runs the file once
    in ONNX Runtime against the traced PyTorch module (ExportError when they disagree). The file's
    ``metadata_props`` carry ``compress.precision`` (int4/int8/fp32), ``compress.kind`` (generation),
    the toolkit version and ``metadata``; it is written whole or not at all. ``position_ids`` adds
    that input after ``attention_mask`` (``[B, S]`` int64, what Optimum's ORTModelForCausalLM feeds;
    without it the graph derives positions from the mask). ``attention``: ``"fused"`` writes each
    layer's attention as ``com.microsoft`` RotaryEmbedding + GroupQueryAttention (export/llm_attention.py),
    ``"decomposed"`` as plain ONNX ops (masks, matmuls, softmax: any ONNX runtime, ORT before 1.32);
    ``"auto"`` (default) is fused where the installed onnxruntime's GroupQueryAttention has the inputs
    the fused form feeds, else decomposed.
    """
    if weights not in ("int4", "fp32", "w8a8"):
        raise ExportError(f"export_llm_onnx: weights must be 'int4', 'fp32' or 'w8a8' (got {weights!r})")
    if attention not in ("auto", "fused", "decomposed"):
        raise ExportError(f"export_llm_onnx: attention must be 'auto', 'fused' or 'decomposed' (got {attention!r})")
    if attention != "decomposed" and not fused_attention_supported():
        if attention == "fused":
            import onnxruntime

            raise ExportError(f"export_llm_onnx(attention='fused'): onnxruntime {onnxruntime.__version__}'s "
                              "GroupQueryAttention lacks attention_bias/query_seqlens (needs 1.32); use 'decomposed'")
        log.info("onnxruntime's GroupQueryAttention lacks attention_bias/query_seqlens: attention written decomposed")
    form: Attention = "decomposed" if attention == "decomposed" or not fused_attention_supported() else "fused"
    check_decoder(model)
    if weights == "w8a8":
        from export.llm_w8a8 import check_w8a8_exportable

        check_w8a8_exportable(model)
    else:
        acts = activation_quantizers(model)
        if acts:
            raise UnsupportedModelError(
                f"{acts[0]}: quantized activations (W8A8) are exported with weights='w8a8', not '{weights}'"
            )
    m: Any = copy.deepcopy(model).float().eval()
    float_reference = None
    if check and weights == "w8a8":  # the W8A8 check's yardstick: the same model with its quantizers off
        flt: Any = copy.deepcopy(model).float().eval()
        unpack_experts(flt)
        _float_linears(flt)
        remove_placement(flt)
        float_reference = KVDecoder(flt).eval()
    unpack_experts(m)  # packed MoE experts (grouped_mm) as per-expert Linears: MatMulNBits / integer ops each
    counts = _swap_linears(m, weights, accuracy_level)
    if counts["int4"]:  # q/k/v and gate/up as one MatMulNBits each, as ORT GenAI's builder writes them
        lay = LAYOUTS[m.config.model_type]
        pack_projections(getattr(getattr(m, lay.base), lay.layers), attn=lay.attn)
    if weights == "int4" and counts["int4"] == 0:
        raise UnsupportedModelError("export_llm_onnx(weights='int4'): the model has no weight-only 4-bit layers")
    if lm_head not in ("auto", "int8", "float"):
        raise ExportError(f"export_llm_onnx: lm_head must be 'auto', 'int8' or 'float' (got {lm_head!r})")
    head = getattr(m, "lm_head", None)
    head_int8 = lm_head == "int8" or (lm_head == "auto" and accuracy_level == 4)
    if weights == "int4" and head_int8 and type(head) is nn.Linear:
        # always accuracy_level 4: ORT's 8-bit kernel at level 0 took 277 ms for this head where level 4 took 3
        m.lm_head = int8_head(head, accuracy_level=4)
    if weights == "w8a8" and counts["w8a8"] == 0:
        raise UnsupportedModelError("export_llm_onnx(weights='w8a8'): the model has no Linears with quantized inputs")
    remove_placement(m)  # its quantizers now live in the swapped layers
    dec = KVDecoder(m, attention=form).eval()
    dec.explicit_positions = position_ids
    if float_reference is not None:
        float_reference.explicit_positions = position_ids
    inputs, outputs = io_names(dec.n_layers, position_ids=position_ids)
    dyn: dict[str, dict[int, str]] = {"input_ids": {0: "batch", 1: "sequence"}, "logits": {0: "batch", 1: "sequence"},
                                      "attention_mask": {0: "batch", 1: "total_sequence"}}
    if position_ids:
        dyn["position_ids"] = {0: "batch", 1: "sequence"}
    for name in inputs[3 if position_ids else 2 :]:
        dyn[name] = {0: "batch", 2: "past_sequence"}
    for name in outputs[1:]:
        dyn[name] = {0: "batch", 2: "total_sequence"}
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad(), warnings.catch_warnings(), tempfile.TemporaryDirectory(dir=out.parent, prefix=".llm_onnx.") as tmp:
        # the TorchScript exporter: custom ops export through autograd.Function.symbolic (the dynamo
        # exporter needs an onnxscript translation per op); the traced forward is our own code
        warnings.simplefilter("ignore")
        traced = Path(tmp) / out.name
        torch.onnx.export(
            dec, dec.dummy_inputs(1, 2, 3), str(traced), input_names=inputs, output_names=outputs,
            dynamic_axes=dyn, opset_version=opset, dynamo=False, custom_opsets={"com.microsoft": 1} if counts["int4"] or form == "fused" else None,
            # no folding: a tied lm_head stays one initializer shared with the embedding (folding writes a
            # transposed copy); ORT folds the weight transposes in memory when it loads the file
            do_constant_folding=False,
        )
        import onnx

        from export.edge import set_metadata
        from export.onnx import atomic_save

        proto = onnx.load(str(traced))
        precision = {"int4": "int4" if counts["int4"] else "fp32", "w8a8": "int8", "fp32": "fp32"}[weights]
        set_metadata(proto, {"compress.precision": precision, "compress.kind": "generation",
                             "compress.model_type": str(m.config.model_type), "compress.attention": form,
                             **(metadata or {})})
        atomic_save(proto, out)
    log.info("LLM ONNX (%s weights: %d W8A8, %d MatMulNBits, %d float Linears; %s attention) written to %s", weights,
             counts["w8a8"], counts["int4"], counts["float"], form, out)
    if check:
        _check_in_ort(out, dec, float_check=weights != "w8a8", float_dec=float_reference)
    return out


#: Float-compute files (fp32 weights, MatMulNBits, whose traced forward quantizes the activations as
#: ORT's kernel does at accuracy_level 4) differ from the traced module only by float rounding, which
#: grows with depth: SmolLM2-135M (30 layers) GPTQ w4 g64 measured 78.8 dB logits SQNR, a 2-layer model 120+ dB. A wrong graph (a dropped zero point, a transposed
#: or mis-scaled weight) lands below 20 dB, so 40 dB (1% noise amplitude) separates the two with
#: room on either side, where a relative max difference (the former 1e-4) failed deep models.
FLOAT_MIN_SQNR_DB = 40.0
#: greedy agreement floor for float compute: at 40+ dB a top-1 flips only on a near tie of the
#: two best logits; more than one position in ten flipping means the logits are wrong
MIN_TOP1 = 0.9


@dataclass(frozen=True)
class OrtCheck:
    """What :func:`export_llm_onnx`'s check measured: ORT's file against the traced module over a
    prefill and decode steps (``sqnr_db``, ``top1``), and for W8A8 the fake-quant model against its
    float self (``quant_sqnr_db``, ``quant_top1``), the yardstick the file's deviation is held to."""

    sqnr_db: float
    top1: float
    max_rel: float
    quant_sqnr_db: float | None = None
    quant_top1: float | None = None


def _sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    noise = float(((got - ref) ** 2).mean())
    return 999.0 if noise == 0 else 10 * math.log10(max(float((ref**2).mean()), 1e-30) / noise)


def _generation_logits(run: Any, dec: KVDecoder, ids: torch.Tensor, mask: torch.Tensor,
                       steps: list[torch.Tensor]) -> torch.Tensor:
    """Logits ``[N, V]`` of the unpadded prefill positions and of each decode step, as generation
    meets them: ``run(input_ids, attention_mask, past) -> (logits, present)`` with its own cache."""
    logits, past = run(ids, mask, dec.empty_past(ids.shape[0]))
    rows = [logits[mask.bool()]]
    for tok in steps:
        mask = torch.cat([mask, torch.ones_like(tok)], dim=1)
        logits, past = run(tok, mask, past)
        rows.append(logits[:, -1])
    return torch.cat(rows)


def decoder_steps(dec: KVDecoder) -> Callable[[torch.Tensor, torch.Tensor, list[torch.Tensor]],
                                               tuple[torch.Tensor, list[torch.Tensor]]]:
    """``(ids, mask, past) -> (logits, present)``: one generation step of ``dec`` in PyTorch, no grad."""
    def run(i: torch.Tensor, m: torch.Tensor, past: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        with torch.no_grad():
            logits, *present = dec(*dec.feed(i, m, past))
        return logits, present
    return run


def _check_in_ort(path: Path, dec: KVDecoder, *, float_check: bool, float_dec: KVDecoder | None = None) -> OrtCheck:
    """Run the file in ORT as deployed (full graph optimizations, integer kernels fused) the way
    generation does — a left-padded batch of two prompts prefilled, then three greedy decode steps
    on each side's own cache — against the traced module, and judge what a deep model's user sees:
    the logits' SQNR and top-1 (greedy token) agreement.

    - fp32 and int4 files (``float_check``; MatMulNBits at accuracy_level 4 is traced with the int8
      activations its kernel computes with): SQNR >= :data:`FLOAT_MIN_SQNR_DB` and top-1 >= :data:`MIN_TOP1`.
    - W8A8 (``float_dec`` is the model with its quantizers off): the file may not differ from the
      fake-quant model more than quantization moved that model from float (SQNR at least the
      quantization's own, top-1 at least its own). A difference is expected at all because a
      value on a rounding tie takes the neighbouring code when ORT sums int8 products exactly and
      PyTorch in float; in a deep static-W8A8 model such flips cascade (SmolLM2-135M with
      SmoothQuant: 24.5 dB on held-out text, against 17.9 dB of quantization error, and ORT's own
      unfused float graph differs from its fused integer one by as much), so an elementwise
      tolerance cannot tell a right file from a wrong one; a wrong zero point or int16 saturation
      lands far below the quantization's own error.
    """
    torch.manual_seed(0)
    vocab = int(dec.lm.config.vocab_size)
    n_past = 2 * dec.n_layers
    # prompts the model itself writes (greedy from one random token): random ids are far outside the
    # ranges static activation scales were calibrated on, where W8A8 clips and the yardstick means little
    ids = torch.randint(0, vocab, (2, 1))
    with torch.no_grad():
        logits, *past = dec(*dec.feed(ids, torch.ones_like(ids), dec.empty_past(2)))
        for _ in range(7):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
            logits, *past = dec(*dec.feed(nxt, torch.ones_like(ids), past))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # the second prompt left-padded

    sess = inference_session(path, session_options(log_severity=3))
    names = [i.name for i in sess.get_inputs()]

    def ort_run(i: torch.Tensor, m: torch.Tensor, past: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        out = sess.run(None, dict(zip(names, [t.numpy() for t in dec.feed(i, m, past)])))
        return torch.from_numpy(out[0]), [torch.from_numpy(o) for o in out[1 : 1 + n_past]]

    # the decode tokens are the reference's greedy ones, fed to every run alike so positions align
    with torch.no_grad():
        first, _ = decoder_steps(dec)(ids, mask, dec.empty_past(2))
    steps, nxt = [], first[:, -1].argmax(-1, keepdim=True)
    for _ in range(3):
        steps.append(nxt)
        nxt = (nxt * 7 + 13) % vocab  # later steps: fixed tokens, the check needs positions, not sense
    ref = _generation_logits(decoder_steps(dec), dec, ids, mask, steps)
    got = _generation_logits(ort_run, dec, ids, mask, steps)
    result = OrtCheck(sqnr_db=_sqnr_db(ref, got), top1=float((ref.argmax(-1) == got.argmax(-1)).float().mean()),
                      max_rel=float((got - ref).abs().max()) / (float(ref.abs().max()) or 1.0))
    if float_dec is not None:
        flt = _generation_logits(decoder_steps(float_dec), float_dec, ids, mask, steps)
        result = OrtCheck(result.sqnr_db, result.top1, result.max_rel, quant_sqnr_db=_sqnr_db(flt, ref),
                          quant_top1=float((flt.argmax(-1) == ref.argmax(-1)).float().mean()))
    log.info("%s in ONNX Runtime vs PyTorch: logits SQNR %.1f dB, greedy top-1 %.3f, max error %.2e of the "
             "largest logit%s", path.name, result.sqnr_db, result.top1, result.max_rel,
             "" if result.quant_sqnr_db is None else
             f" (quantization vs float: {result.quant_sqnr_db:.1f} dB, top-1 {result.quant_top1:.3f})")
    if float_check:
        sqnr_floor, top1_floor = FLOAT_MIN_SQNR_DB, MIN_TOP1
    elif result.quant_sqnr_db is not None and result.quant_top1 is not None:
        sqnr_floor, top1_floor = result.quant_sqnr_db, result.quant_top1
    else:
        return result
    if result.sqnr_db < sqnr_floor or result.top1 < top1_floor:
        hint = ""
        if float_dec is not None and has_vnni() is False and _full_8bit_codes(dec):
            hint = ("; with 8-bit weights ORT's u8s8 integer kernels overflow int16 on CPUs without VNNI (this one): "
                    "quantize with weights: {reduce_range: true} (7-bit codes)")
        raise ExportError(
            f"{path}: ONNX Runtime's outputs differ from the PyTorch model's (logits SQNR {result.sqnr_db:.1f} dB, "
            f"greedy top-1 {result.top1:.3f}; the floor is {sqnr_floor:.1f} dB and {top1_floor:.3f}): the exported "
            f"graph does not compute the model{hint}"
        )
    return result


def _full_8bit_codes(dec: KVDecoder) -> bool:
    """Whether any W8A8 layer's weight codes leave the 7-bit range ORT's u8s8 kernels sum exactly."""
    for mod in dec.modules():
        codes = getattr(mod, "codes", None)
        if isinstance(codes, torch.Tensor) and codes.dtype == torch.int8 and (
                int(codes.min()) < -64 or int(codes.max()) > 63):
            return True
    return False


# ---- generation in ONNX Runtime -------------------------------------------------------------------


class OrtGenerator:
    """Greedy generation on an :func:`export_llm_onnx` file: ``prefill`` then ``step`` per token."""

    def __init__(self, path: str | Path, *, threads: int | None = None) -> None:
        so = session_options(threads=threads, inter_op_threads=1 if threads is not None else None, log_severity=2)
        self.session = inference_session(path, so)
        names = [i.name for i in self.session.get_inputs()]
        past = [i for i in self.session.get_inputs() if i.name.startswith("past_key_values.")]
        if names[:2] != ["input_ids", "attention_mask"] or not past:
            raise ExportError(f"{path}: not an export_llm_onnx file (inputs {names[:3]}...)")
        self.past_names = [i.name for i in past]
        self.position_ids = "position_ids" in names
        self.n_kv, self.head_dim = int(past[0].shape[1]), int(past[0].shape[3])
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.past: list[np.ndarray] = []
        self.mask = np.ones((0, 0), dtype=np.int64)

    def prefill(self, input_ids: np.ndarray, attention_mask: np.ndarray | None = None) -> np.ndarray:
        """Run the prompts ``[B, S]`` with an empty cache; returns the last position's logits ``[B, V]``.

        ``attention_mask`` ``[B, S]`` (1 = token, 0 = padding) allows left-padded prompts of
        different lengths; None means no padding."""
        b = input_ids.shape[0]
        self.mask = np.ones(input_ids.shape, dtype=np.int64) if attention_mask is None else attention_mask.astype(np.int64)
        if self.mask.shape != input_ids.shape:
            raise ExportError(f"attention_mask has shape {self.mask.shape}, input_ids {input_ids.shape}")
        empty = np.zeros((b, self.n_kv, 0, self.head_dim), dtype=np.float32)
        return self._run(input_ids, [empty] * len(self.past_names))

    def step(self, tokens: np.ndarray) -> np.ndarray:
        """Feed one token per sequence ``[B]``; returns the next logits ``[B, V]``."""
        self.mask = np.concatenate([self.mask, np.ones((self.mask.shape[0], 1), dtype=np.int64)], axis=1)
        return self._run(tokens.reshape(-1, 1), self.past)

    def _run(self, ids: np.ndarray, past: list[np.ndarray]) -> np.ndarray:
        feed = {"input_ids": ids.astype(np.int64), "attention_mask": self.mask, **dict(zip(self.past_names, past))}
        if self.position_ids:
            feed["position_ids"] = positions(torch.from_numpy(self.mask), ids.shape[1]).numpy()
        logits, *present = self.session.run(self.output_names, feed)
        self.past = present
        return logits[:, -1]


def generate_ort(
    path: str | Path | OrtGenerator,
    input_ids: torch.Tensor | np.ndarray,
    *,
    max_new_tokens: int,
    attention_mask: torch.Tensor | np.ndarray | None = None,
    eos_token_id: int | None = None,
) -> torch.Tensor:
    """Greedy continuation ``[B, S + new]`` of ``input_ids`` computed by ONNX Runtime.

    ``attention_mask`` marks left padding (0) of prompts of different lengths; generation stops
    early when every sequence produced ``eos_token_id``."""
    gen = path if isinstance(path, OrtGenerator) else OrtGenerator(path)
    ids = np.asarray(input_ids.cpu().numpy() if isinstance(input_ids, torch.Tensor) else input_ids, dtype=np.int64)
    if ids.ndim != 2:
        raise ExportError(f"generate_ort: input_ids must be [batch, sequence] (got shape {ids.shape})")
    out = [ids]
    mask = None if attention_mask is None else np.asarray(
        attention_mask.cpu().numpy() if isinstance(attention_mask, torch.Tensor) else attention_mask)
    logits = gen.prefill(ids, mask)
    done = np.zeros(ids.shape[0], dtype=bool)
    for i in range(max_new_tokens):
        nxt = logits.argmax(-1).astype(np.int64)
        out.append(nxt[:, None])
        if eos_token_id is not None:
            done |= nxt == eos_token_id
            if done.all():
                break
        if i + 1 < max_new_tokens:
            logits = gen.step(nxt)
    return torch.from_numpy(np.concatenate(out, axis=1))
