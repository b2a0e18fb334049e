"""What llama.cpp's GGUF fixes per architecture, and what a transformers decoder shows of itself.

The GGUF format fixes tensor names and metadata keys per llama.cpp architecture: the names come
from the ``gguf`` package (``gguf.get_tensor_name_map``), and this module holds only what that
package does not say — which architecture a transformers class converts to (llama.cpp's
``convert_hf_to_gguf.py`` registers them by class name), the weight transforms that converter
applies, and the conventions llama.cpp's loader hard-codes instead of reading from the file
(Gemma 3's every-sixth-layer global attention, SmolLM3's every-fourth-layer NoPE, Gemma's
attention scale). :func:`features` reads the model's side from its config and module tree only, so
a meta-device model is judged as a loaded one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from compress.core.errors import UnsupportedModelError


@dataclass(frozen=True)
class Arch:
    """A llama.cpp architecture as its converter and loader treat it."""

    name: str  #: ``gguf.MODEL_ARCH`` member name
    permute_qk: bool = False  #: converter's ``undo_permute``: rotate-half rows -> interleaved pairs
    norm_plus_one: bool = False  #: converter stores ``1 + weight`` for every ``*norm.weight``
    norm: str = "rms"  #: the norm llama.cpp builds: "rms" or "layer"
    act: tuple[str, ...] = ("silu",)  #: the MLP activation llama.cpp builds
    swa_pattern: int | None = None  #: windowed layers: i % p < p - 1 (None: the arch has no windows)
    swa_rope_base: float | None = None  #: rope base llama.cpp fixes for windowed layers
    nope_step: int | None = None  #: layers (i + 1) % step == 0 skip rope (None: every layer rotates)
    gemma_scale: bool = False  #: attention scale fixed to 1/sqrt(head_dim) (n_embd/n_head for 27B)
    keys: frozenset[str] = field(default_factory=frozenset)  #: optional features it has keys for


_GEMMA = ("gelu_pytorch_tanh", "gelu_tanh")
#: transformers class -> llama.cpp architecture, as convert_hf_to_gguf.py registers them
ARCHS: dict[str, Arch] = {
    "LlamaForCausalLM": Arch("LLAMA", permute_qk=True),
    "MistralForCausalLM": Arch("LLAMA", permute_qk=True),
    "Qwen2ForCausalLM": Arch("QWEN2"),
    "Qwen3ForCausalLM": Arch("QWEN3"),
    "Phi3ForCausalLM": Arch("PHI3"),
    "GemmaForCausalLM": Arch("GEMMA", norm_plus_one=True, act=_GEMMA, gemma_scale=True),
    "Gemma2ForCausalLM": Arch("GEMMA2", norm_plus_one=True, act=_GEMMA, swa_pattern=2, gemma_scale=True,
                              keys=frozenset({"attn_softcap", "final_softcap"})),
    "Gemma3ForCausalLM": Arch("GEMMA3", norm_plus_one=True, act=_GEMMA, swa_pattern=6, swa_rope_base=10000.0,
                              gemma_scale=True, keys=frozenset({"final_softcap"})),
    "Olmo2ForCausalLM": Arch("OLMO2"),
    "GraniteForCausalLM": Arch("GRANITE", permute_qk=True,
                               keys=frozenset({"embedding_scale", "residual_scale", "attention_scale", "logit_scale"})),
    "StableLmForCausalLM": Arch("STABLELM", norm="layer", keys=frozenset({"parallel_residual"})),
    "CohereForCausalLM": Arch("COMMAND_R", norm="layer", keys=frozenset({"logit_scale"})),
    "SmolLM3ForCausalLM": Arch("SMOLLM3", permute_qk=True, nope_step=4),
}
#: the 27B Gemma layer counts, for which llama.cpp scales attention by n_embd/n_head instead
_GEMMA_27B = {"GEMMA2": 46, "GEMMA3": 62}


def arch_of(model: nn.Module) -> Arch:
    """The llama.cpp architecture ``model``'s class converts to, or UnsupportedModelError."""
    arch = ARCHS.get(type(model).__name__)
    if arch is None:
        raise UnsupportedModelError(
            f"{type(model).__name__}: no llama.cpp GGUF architecture for this class; GGUF export writes "
            f"{', '.join(sorted(ARCHS))}")
    return arch


def _get(cfg: Any, *names: str) -> Any:
    for name in names:
        value = getattr(cfg, name, None)
        if value is not None:
            return value
    return None


def _rope(cfg: Any) -> dict[str, dict[str, Any]]:
    """rope parameters per layer type ("full_attention", "sliding_attention"), flat ones under both."""
    params = getattr(cfg, "rope_parameters", None) or {}
    if any(isinstance(v, dict) for v in params.values()):
        return {k: v for k, v in params.items() if isinstance(v, dict)}
    if not params:
        params = {"rope_type": "default", "rope_theta": float(_get(cfg, "rope_theta") or 10000.0)}
    return {"full_attention": params, "sliding_attention": params}


def _windows(cfg: Any) -> list[int | None]:
    """Each layer's attention window (None: global), a window at least the context counting as none."""
    n, window = int(cfg.num_hidden_layers), getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        out = [window if t == "sliding_attention" else None for t in types]
    elif getattr(cfg, "use_sliding_window", True) is False:
        out = [None] * n
    else:
        out = [window] * n
    ctx = int(getattr(cfg, "max_position_embeddings", 0) or 0)
    return [None if w is None or (ctx and int(w) >= ctx) else int(w) for w in out]


def _norms(model: nn.Module) -> list[nn.Module]:
    return [m for n, m in model.named_modules() if n.split(".")[-1].endswith("norm") and hasattr(m, "weight")]


@dataclass(frozen=True)
class Features:
    """What the model computes that llama.cpp must be told: sizes, rope, windows, optional scalings."""

    heads: int
    kv_heads: int
    head_dim: int
    rope_dims: int
    rope_base: float
    windows: list[int | None]
    norm: str
    eps: float
    optional: dict[str, float]  #: optional feature -> value, only those the model has


def features(model: nn.Module, arch: Arch) -> Features:
    """The model's side, from config and module tree; UnsupportedModelError, in one line naming the
    setting, for what ``arch``'s GGUF cannot state (llama.cpp would run a different model)."""
    cfg: Any = getattr(model, "config", None)
    name = arch.name.lower()
    heads = int(cfg.num_attention_heads)
    kv = int(_get(cfg, "num_key_value_heads") or heads)
    head_dim = int(_get(cfg, "head_dim") or cfg.hidden_size // heads)
    rope = _rope(cfg)
    for kind, params in rope.items():
        if params.get("rope_type", "default") != "default":
            raise UnsupportedModelError(f"rope_parameters[{kind!r}]: rope_type {params['rope_type']!r} is not "
                                        "written to GGUF (plain rope only)")
    partial = float(_get(cfg, "partial_rotary_factor") or rope["full_attention"].get("partial_rotary_factor") or 1.0)
    windows = _windows(cfg)
    sizes = {w for w in windows if w is not None}
    if sizes and arch.swa_pattern is None:
        raise UnsupportedModelError(f"sliding_window={sorted(sizes)[0]}: llama.cpp's {name} has no sliding-window "
                                    "attention")
    if len(sizes) > 1:
        raise UnsupportedModelError(f"sliding_window: windows of {sorted(sizes)} in one model; GGUF states one")
    if sizes and arch.swa_pattern is not None:
        p = arch.swa_pattern
        if [w is not None for w in windows] != [i % p < p - 1 for i in range(len(windows))]:
            raise UnsupportedModelError(f"layer_types: llama.cpp's {name} windows layers i % {p} < {p - 1} "
                                        f"(every {p}th global); this model's pattern differs")
        base = float(rope.get("sliding_attention", rope["full_attention"]).get("rope_theta", 10000.0))
        fixed = arch.swa_rope_base
        if fixed is not None and base != fixed:
            raise UnsupportedModelError(f"rope base {base:g} on windowed layers: llama.cpp's {name} fixes {fixed:g}")
    nope = getattr(cfg, "no_rope_layers", None)
    if nope is not None:
        step = arch.nope_step
        want_rope = [int(step is None or (i + 1) % step != 0) for i in range(len(nope))]
        if [int(x) for x in nope] != want_rope:
            what = f"every {step}th layer without rope" if step else "rope on every layer"
            raise UnsupportedModelError(f"no_rope_layers={list(nope)}: llama.cpp's {name} fixes {what}")
    act = _get(cfg, "hidden_activation", "hidden_act")
    if act is not None and act not in arch.act:
        raise UnsupportedModelError(f"hidden_act={act!r}: llama.cpp's {name} computes {arch.act[0]}")
    if arch.gemma_scale:
        scalar = _get(cfg, "query_pre_attn_scalar")
        want = float(cfg.hidden_size / heads if _GEMMA_27B.get(arch.name) == cfg.num_hidden_layers else head_dim)
        if scalar is not None and float(scalar) != want:
            raise UnsupportedModelError(f"query_pre_attn_scalar={scalar}: llama.cpp's {name} scales attention by "
                                        f"1/sqrt({want:g})")
    norms = _norms(model)
    if not norms:
        raise UnsupportedModelError(f"{type(model).__name__}: no norm modules found; GGUF export writes pre/post-norm decoders")
    first = norms[0]
    kind = "layer" if isinstance(first, nn.LayerNorm) or "LayerNorm" in type(first).__name__ else "rms"
    if kind != arch.norm:
        raise UnsupportedModelError(f"{type(norms[0]).__name__}: llama.cpp's {name} normalizes with "
                                    f"{'LayerNorm' if arch.norm == 'layer' else 'RMSNorm'}")
    eps = _get(first, "eps", "variance_epsilon", "variance_eps")
    eps = float(eps if eps is not None else _get(cfg, "rms_norm_eps", "layer_norm_eps", "norm_eps"))
    optional = {k: float(v) for k, v in {
        "attn_softcap": _get(cfg, "attn_logit_softcapping"),
        "final_softcap": _get(cfg, "final_logit_softcapping"),
        "embedding_scale": _get(cfg, "embedding_multiplier"),
        "residual_scale": _get(cfg, "residual_multiplier"),
        "attention_scale": _get(cfg, "attention_multiplier"),
        "logit_scale": _get(cfg, "logits_scaling", "logit_scale"),
    }.items() if v is not None}
    if getattr(cfg, "use_parallel_residual", False):
        optional["parallel_residual"] = 1.0
    for key in optional:
        if key not in arch.keys:
            raise UnsupportedModelError(f"{key.replace('_', ' ')} {optional[key]:g}: llama.cpp's {name} has no key "
                                        "for it")
    return Features(heads=heads, kv_heads=kv, head_dim=head_dim, rope_dims=int(head_dim * partial),
                    rope_base=float(rope["full_attention"].get("rope_theta", 10000.0)), windows=windows,
                    norm=kind, eps=eps, optional=optional)


def write_metadata(writer: Any, cfg: Any, feats: Features) -> None:
    """llama.cpp's hyperparameter keys (``gguf.Keys``) for the architecture ``writer`` was opened with."""
    writer.add_context_length(int(cfg.max_position_embeddings))
    writer.add_embedding_length(int(cfg.hidden_size))
    writer.add_block_count(int(cfg.num_hidden_layers))
    writer.add_feed_forward_length(int(cfg.intermediate_size))
    writer.add_head_count(feats.heads)
    writer.add_head_count_kv(feats.kv_heads)
    writer.add_key_length(feats.head_dim)
    writer.add_value_length(feats.head_dim)
    writer.add_rope_dimension_count(feats.rope_dims)
    writer.add_rope_freq_base(feats.rope_base)
    if feats.norm == "rms":
        writer.add_layer_norm_rms_eps(feats.eps)
    else:
        writer.add_layer_norm_eps(feats.eps)
    window = next((w for w in feats.windows if w is not None), None)
    if window is not None:
        writer.add_sliding_window(window)
    writer.add_vocab_size(int(cfg.vocab_size))
    adders = {"attn_softcap": writer.add_attn_logit_softcapping, "final_softcap": writer.add_final_logit_softcapping,
              "embedding_scale": writer.add_embedding_scale, "residual_scale": writer.add_residual_scale,
              "attention_scale": writer.add_attention_scale, "logit_scale": writer.add_logit_scale}
    for key, value in feats.optional.items():
        if key == "parallel_residual":
            writer.add_parallel_residual(True)
        else:
            adders[key](value)
