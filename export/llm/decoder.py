"""The decoder :func:`export.llm.onnx.export_llm_onnx` traces: :class:`KVDecoder`, an
``(input_ids, attention_mask, *past) -> (logits, *present)`` module over a transformers causal LM.

Two forms, chosen by what the model is, never by its family name:

- ``"decomposed"`` runs the model's own forward (every family's norms, activations, rotary variants,
  soft-capping, embedding and logit scales, parallel or post-norm blocks come with it) with the mask
  built here (causal, left padding, each layer type's sliding window) and a cache object that
  concatenates the fed past and hands back the presents, so the traced graph has explicit past
  tensors. Each layer's key/value shapes are read from one probe step, not from the config.
- ``"fused"`` is a hand-written pre-norm block over the model's modules with ORT's contrib ops
  (export/llm/attention.py). It is used only where the module tree has the parts it reads
  (:data:`CONVENTIONS`: attribute names, one per naming convention) and its output equals the
  model's own forward on a probe (:func:`fused_mismatch`); anything the block does not express (a
  ``1 + weight`` norm, an embedding scale, extra norms) fails that probe and the model goes
  decomposed.
"""

from __future__ import annotations

import functools
import inspect
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

#: the logits difference (relative to the largest) above which the fused block is not the model's
#: computation: float32 round-off between the two op orders is 1.5e-6 on SmolLM2-135M's 30 layers
#: (float and int4 alike) and near 1e-6 on the tiny family models; what the block cannot express
#: moves them by 4e-4 (SmolLM3's position-free layers, tiny random model) to 7 (Granite's multipliers)
FUSED_PROBE_TOL = 1e-4
#: the layer types the mask is built for (transformers' ``config.layer_types`` values)
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class Layout:
    """Where a pre-norm decoder keeps its parts (attribute names), read by the fused form."""

    base: str = "model"  # the decoder stack under the LM head
    layers: str = "layers"
    embed: str = "embed_tokens"
    positions: str | None = None  # a learned absolute position table (GPT-2's wpe); None: rotary
    attn: str = "self_attn"
    attn_norm: str = "input_layernorm"
    mlp_norm: str = "post_attention_layernorm"
    out_proj: str = "o_proj"
    final_norm: str = "norm"


#: the attribute-naming conventions the fused form reads (transformers' Llama-style names and
#: GPT-2's); a model matches one by its module tree, and the fused block must then also reproduce
#: its forward (:func:`fused_mismatch`)
CONVENTIONS: tuple[Layout, ...] = (
    Layout(),
    Layout(base="transformer", layers="h", embed="wte", positions="wpe", attn="attn", attn_norm="ln_1",
           mlp_norm="ln_2", out_proj="c_proj", final_norm="ln_f"),
)


def fused_layout(model: nn.Module) -> Layout | None:
    """The :data:`CONVENTIONS` entry whose parts ``model`` has (every layer's attention, its output
    projection, the two norms and the MLP), else None."""
    for lay in CONVENTIONS:
        base = getattr(model, lay.base, None)
        layers = getattr(base, lay.layers, None)
        if base is None or not isinstance(layers, nn.ModuleList) or not len(layers):
            continue
        if not all(hasattr(base, a) for a in (lay.embed, lay.final_norm)):
            continue
        if lay.positions is None and getattr(getattr(base, "rotary_emb", None), "inv_freq", None) is None:
            continue
        if lay.positions is not None and not hasattr(base, lay.positions):
            continue
        if all(hasattr(layer, a) for layer in layers for a in (lay.attn, lay.attn_norm, lay.mlp_norm, "mlp")) \
                and all(hasattr(getattr(layer, lay.attn), lay.out_proj) for layer in layers):
            return lay
    return None


@functools.cache
def _feed_cache_class() -> type:
    from transformers.cache_utils import Cache

    class FeedCache(Cache):
        """The cache the decomposed form hands the model: ``update`` prepends the fed past of that
        layer (``past`` None: nothing, the probe step) and keeps what it returns as the present."""

        def __init__(self, past: tuple[torch.Tensor, ...] | None) -> None:
            super().__init__(layers=[])
            self.past = past
            self.presents: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any,  # type: ignore[override]
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            if self.past is not None:
                key = torch.cat([self.past[2 * layer_idx], key], dim=2)
                value = torch.cat([self.past[2 * layer_idx + 1], value], dim=2)
            self.presents[layer_idx] = (key, value)
            return key, value

        def get_seq_length(self, layer_idx: int | None = 0) -> int:
            return 0 if self.past is None else int(self.past[0].shape[2])

    return FeedCache


class KVDecoder(nn.Module):
    """``(input_ids, attention_mask, *past) -> (logits, *present)`` over a transformers causal LM,
    in the ``attention`` form the module docstring describes; :func:`check_decoder` says which
    models it takes."""

    lm: Any  # a transformers causal LM (its submodules are reached by attribute)
    inv_freq: torch.Tensor
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor

    def __init__(self, model: nn.Module, *, attention: Attention = "decomposed") -> None:
        super().__init__()
        cfg = check_decoder(model)
        self.lm = model
        if attention not in ("fused", "decomposed"):
            raise ExportError(f"attention must be 'fused' or 'decomposed' (got {attention!r})")
        #: "fused": RotaryEmbedding + GroupQueryAttention per layer (export/llm/attention.py)
        self.attention = attention
        self.n_layers = int(cfg.num_hidden_layers)
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(getattr(cfg, "num_key_value_heads", None) or self.n_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.windows = sliding_windows(cfg)
        self.layer_types: list[str] | None = list(getattr(cfg, "layer_types", None) or []) or None
        #: a ``position_ids`` input after the mask (what Optimum feeds) instead of positions from the mask
        self.explicit_positions = False
        #: logits of the last position only (``[B, 1, V]``): what generation reads, without the lm_head
        #: over every prompt position (llama.cpp's default; a fifth of SmolLM2-135M's prefill work)
        self.last_logits = False
        self._kv_shapes: list[tuple[tuple[int, int], tuple[int, int]]] | None = None
        lay = fused_layout(model) if attention == "fused" else None
        if attention == "fused" and lay is None:
            raise UnsupportedModelError(f"{type(model).__name__}: its module tree has no part names the fused "
                                        "attention form reads; export with attention='decomposed'")
        self.layout = lay or Layout()
        self.rotary = lay is not None and lay.positions is None
        rot: Any = getattr(self.base, "rotary_emb", None) if lay is not None else None
        inv = rot.inv_freq.detach().float().clone() if self.rotary else torch.zeros(0)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.rope_scaling = float(getattr(rot, "attention_scaling", 1.0))
        if self.rotary:  # positions 0..max_position_embeddings-1, as the model declares
            length = int(getattr(cfg, "max_position_embeddings", 0) or 0)
            if length <= 0:
                raise UnsupportedModelError(f"{type(model).__name__}: no max_position_embeddings to size the rotary cache")
            cos, sin = rotary_caches(self.inv_freq, length, self.rope_scaling)
        else:
            cos = sin = torch.zeros(0, 0)
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)
        params = inspect.signature(model.forward).parameters
        # transformers 5 renamed past_key_values to cache (the old name warns until 5.40)
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    @property
    def base(self) -> Any:
        return getattr(self.lm, self.layout.base)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *rest: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``rest``: ``position_ids`` ``[B, S]`` first when :attr:`explicit_positions`, then the past."""
        past = rest[1:] if self.explicit_positions else rest
        if self.explicit_positions:
            pos = rest[0]
        else:  # positions count real tokens only (left padding), as transformers' generate derives them
            pos = positions(attention_mask, input_ids.shape[1])
        if self.attention == "fused":
            return self._forward_fused(input_ids, attention_mask, pos, past)
        return self._forward_model(input_ids, attention_mask, pos, past)

    def _forward_model(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, pos: torch.Tensor,
                       past: tuple[torch.Tensor, ...] | None) -> tuple[torch.Tensor, ...]:
        """The model's own forward on the fed past (None: the probe step, no past)."""
        s = input_ids.shape[1]
        p = 0 if past is None else past[0].shape[2]
        cache = _feed_cache_class()(past)
        out = self.lm(input_ids=input_ids, attention_mask=self._masks(attention_mask, s, p), position_ids=pos,
                      use_cache=True, cache_position=torch.arange(p, p + s, device=input_ids.device),
                      logits_to_keep=1 if self.last_logits else 0, **{self._cache_arg: cache})
        presents = [t for i in range(self.n_layers) for t in cache.presents[i]]
        return (out.logits, *presents)

    def _masks(self, attention_mask: torch.Tensor, s: int, p: int) -> torch.Tensor | dict[str, torch.Tensor]:
        """The additive ``[B, 1, S, P+S]`` mask (future keys, left padding and, on a sliding-window
        layer, keys ``window`` or more slots back: transformers' rule): one tensor when every layer
        has the same window, else one per layer type (what transformers' forwards take as given)."""
        dev = attention_mask.device
        t = p + s
        query = (torch.arange(s, device=dev) + p)[:, None]
        keys = torch.arange(t, device=dev)[None, :]
        masked = (keys > query)[None] | (attention_mask[:, None, :] == 0)  # [B, S, T]
        lowest = torch.finfo(torch.float32).min

        def additive(window: int | None) -> torch.Tensor:
            m = masked if window is None else masked | (query - keys >= window)[None]
            return (m.float() * lowest)[:, None]

        if len(set(self.windows)) == 1:
            return additive(self.windows[0])
        assert self.layer_types is not None  # check_decoder refuses mixed windows without layer types
        return {kind: additive(w) for kind, w in dict(zip(self.layer_types, self.windows)).items()}

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

    def dummy_inputs(self, batch: int, past: int, new: int) -> tuple[torch.Tensor, ...]:
        ids = torch.randint(0, int(self.lm.config.vocab_size), (batch, new))
        return self.feed(ids, torch.ones(batch, past + new, dtype=torch.long), self.empty_past(batch, past))

    def feed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, past: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The forward's arguments for one step: ``position_ids`` from the mask where the graph takes them."""
        pos = (positions(attention_mask, input_ids.shape[1]),) if self.explicit_positions else ()
        return (input_ids, attention_mask, *pos, *past)

    def empty_past(self, batch: int, length: int = 0) -> list[torch.Tensor]:
        """Zero ``[batch, kv_heads, length, head_dim]`` keys and values of every layer, in each
        layer's own shapes (the decomposed form reads them from one probe step of the model)."""
        return [torch.zeros(batch, heads, length, dim) for shapes in self.kv_shapes() for heads, dim in shapes]

    def kv_shapes(self) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        """Per layer ``((key heads, key dim), (value heads, value dim))``."""
        if self._kv_shapes is None:
            if self.attention == "fused":
                self._kv_shapes = [((self.n_kv, self.head_dim),) * 2] * self.n_layers
            else:
                one = torch.zeros(1, 1, dtype=torch.long)
                with torch.no_grad():
                    out = self._forward_model(one, torch.ones_like(one), one, None)[1:]
                self._kv_shapes = [((int(out[2 * i].shape[1]), int(out[2 * i].shape[3])),
                                    (int(out[2 * i + 1].shape[1]), int(out[2 * i + 1].shape[3])))
                                   for i in range(self.n_layers)]
        return self._kv_shapes


def fused_mismatch(model: nn.Module) -> str | None:
    """None when the fused form computes ``model``'s own logits (a 32-token prompt, then 3 steps on
    its cache, within :data:`FUSED_PROBE_TOL` of the largest logit), else why not, in one line. Read
    before q/k/v are packed: the probe runs the model's own forward. MatMulNBits layers run in float
    for it (accuracy_level 0): their int8 activations would turn round-off into rounding flips."""
    try:
        fused = KVDecoder(model, attention="fused").eval()
    except UnsupportedModelError as err:
        return str(err)
    own = KVDecoder(model).eval()
    vocab = int(own.lm.config.vocab_size)
    ids = torch.randint(0, vocab, (1, 35), generator=torch.Generator().manual_seed(0))
    levels: dict[Any, int] = {m: int(getattr(m, "accuracy_level")) for m in model.modules()  # noqa: B009
                              if isinstance(getattr(m, "accuracy_level", None), int)}
    got: list[torch.Tensor] = []
    ref: list[torch.Tensor] = []
    try:
        for m in levels:
            m.accuracy_level = 0
        for dec, out in ((fused, got), (own, ref)):
            try:
                with torch.no_grad():
                    past = dec.empty_past(1)
                    for a, b in ((0, 32), (32, 33), (33, 34), (34, 35)):
                        logits, *past = dec(*dec.feed(ids[:, a:b], torch.ones(1, b, dtype=torch.long), past))
                        out.append(logits)
            except (RuntimeError, ValueError, TypeError, IndexError) as err:  # shapes the block assumed wrongly
                if dec is own:
                    raise
                return f"the fused block does not run on {type(model).__name__} ({str(err).splitlines()[0][:120]})"
    finally:
        for m, level in levels.items():
            m.accuracy_level = level
    x, y = torch.cat(got, 1), torch.cat(ref, 1)
    rel = float((x - y).abs().max()) / (float(y.abs().max()) or 1.0)
    if rel <= FUSED_PROBE_TOL:
        return None
    return f"the fused block is not {type(model).__name__}'s computation (logits differ by {rel:.1e} of their largest)"


def positions(attention_mask: torch.Tensor, new: int) -> torch.Tensor:
    """``[B, new]`` positions of the last ``new`` tokens: real tokens counted, left padding at 0."""
    return (torch.cumsum(attention_mask, dim=-1) - 1)[:, attention_mask.shape[1] - new :].clamp(min=0)


def _rope_types(cfg: Any) -> set[str]:
    """The RoPE types a config names (``rope_parameters`` may hold one dict per layer type)."""
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    dicts = [rope] if isinstance(rope, dict) and "rope_type" in rope else [
        v for v in (rope.values() if isinstance(rope, dict) else []) if isinstance(v, dict)]
    return {str(d.get("rope_type", "default")) for d in dicts}


def check_decoder(model: nn.Module) -> Any:
    """The model's config if :class:`KVDecoder` takes it, else UnsupportedModelError saying why in
    one line. Structural only (config and module tree, no weights read): it runs on meta-device
    models at ``--dry-run``. Taken: a transformers causal LM with an output head, attention layers
    of full or sliding-window type, and RoPE that does not change with the sequence length."""
    name = type(model).__name__
    cfg = getattr(model, "config", None)
    if cfg is None or not all(hasattr(cfg, a) for a in ("num_hidden_layers", "num_attention_heads", "vocab_size")):
        raise UnsupportedModelError(f"{name}: the LLM ONNX export takes transformers causal LMs (a config with "
                                    "num_hidden_layers, num_attention_heads and vocab_size)")
    get_head = getattr(model, "get_output_embeddings", None)
    if get_head is None or get_head() is None:
        raise UnsupportedModelError(f"{name}: has no output (LM) head; load it as a causal LM")
    if getattr(cfg, "is_encoder_decoder", False) or getattr(cfg, "add_cross_attention", False):
        raise UnsupportedModelError(f"{name}: has cross-attention; only decoder-only LMs are exported")
    params = inspect.signature(model.forward).parameters
    missing = [a for a in ("attention_mask", "position_ids", "logits_to_keep") if a not in params]
    if missing or ("cache" not in params and "past_key_values" not in params):
        raise UnsupportedModelError(f"{name}: its forward takes no {', '.join(missing) or 'cache'}; the generation "
                                    "export feeds the mask, positions and key/value cache")
    types = list(getattr(cfg, "layer_types", None) or [])
    other = sorted(set(types) - set(LAYER_TYPES))
    if other:
        raise UnsupportedModelError(f"{name}: layer type {other[0]!r} is not exported (only {', '.join(LAYER_TYPES)})")
    windows = sliding_windows(cfg)
    if len(set(windows)) > 1 and len(set(zip(types, windows))) != len(set(types)):
        raise UnsupportedModelError(f"{name}: layers of one type have different attention windows")
    dynamic = sorted(_rope_types(cfg) & {"dynamic", "longrope"})
    if dynamic:
        raise UnsupportedModelError(f"RoPE type '{dynamic[0]}' changes with the sequence length; not exported")
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
