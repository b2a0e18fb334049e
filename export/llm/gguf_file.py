"""A GGUF file for llama.cpp from a transformers decoder, float or quantized: the quantized Linears
as Q4_0/Q4_1/Q8_0 blocks with our codes (:mod:`export.llm.gguf_weights`), everything else F32 (or
F16 matrices), the architecture's metadata and the tokenizer inside.

The llama.cpp architecture is chosen from the model's class (:mod:`export.llm.gguf_arch`); every
tensor of the state dict is named through the ``gguf`` package's own map for that architecture
(``gguf.get_tensor_name_map``), and one it has no name for is refused, never dropped. The weight
transforms are those of llama.cpp's converter (``convert_hf_to_gguf.py``): q/k rows permuted from
rotate-half to interleaved pairs where it does so (whole rows move, so blocks are unchanged), and
Gemma's norms stored as ``1 + weight``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
from compress.export.llm.gguf_arch import Arch, Features, arch_of, features, write_metadata
from compress.export.llm.gguf_tokenizer import tokenizer_form, write_tokenizer
from compress.export.llm.gguf_weights import _require_gguf, check_grid, gguf_blocks
from torch import nn

from compress.core.errors import UnsupportedModelError

log = logging.getLogger(__name__)

FLOAT_TYPES = ("f32", "f16")


def _permute(x: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: per head, rows (i, i + d/2) become neighbours."""
    return x.reshape(heads, 2, x.shape[0] // heads // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _is_quantizer_state(key: str) -> bool:
    return any(part.endswith("_quantizer") for part in key.split(".")[:-1])


def _tied(model: nn.Module) -> bool:
    get_head: Any = getattr(model, "get_output_embeddings", None)
    get_embed: Any = getattr(model, "get_input_embeddings", None)
    head, embed = (get_head() if callable(get_head) else None), (get_embed() if callable(get_embed) else None)
    return head is not None and embed is not None and head.weight is embed.weight


def _plan(model: nn.Module, arch: Arch) -> dict[str, str]:
    """state-dict key -> GGUF tensor name, for every tensor written; UnsupportedModelError naming the
    first tensor llama.cpp's architecture has no name for."""
    gguf = _require_gguf()
    cfg: Any = getattr(model, "config", None)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.name], int(cfg.num_hidden_layers))
    tied, plan = _tied(model), {}
    for key in model.state_dict(keep_vars=True):
        if _is_quantizer_state(key):
            continue
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if name is None and tied and key == "lm_head.weight":
            continue  # llama.cpp ties the head to token_embd when the file has no output tensor
        if name is None:
            raise UnsupportedModelError(f"{key}: no GGUF tensor name for it in llama.cpp's {arch.name.lower()} "
                                        "(gguf.get_tensor_name_map); refusing rather than dropping it")
        if tied and name == "output.weight":
            continue
        plan[key] = name
    return plan


def check_gguf(model: nn.Module) -> Any:
    """The model's config if :func:`save_gguf` writes it, else UnsupportedModelError in one line
    saying why: from the structure alone (config, class, module and state-dict names), so it runs on
    a meta-device model before anything trains (compress.preflight) and is the first thing save_gguf
    checks."""
    cfg: Any = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "num_hidden_layers"):
        raise UnsupportedModelError(f"{type(model).__name__}: GGUF export writes transformers causal LMs "
                                    "(no decoder config)")
    arch = arch_of(model)
    features(model, arch)
    _plan(model, arch)
    for name, mod in model.named_modules():
        wq = getattr(mod, "weight_quantizer", None)
        if wq is not None and getattr(wq, "enabled", True):
            check_grid(mod, where=name)
    return cfg


def _file_type(gguf: Any, qtypes: set[Any], float_type: str) -> Any:
    t, f = gguf.GGMLQuantizationType, gguf.LlamaFileType
    for qtype, ftype in ((t.Q4_0, f.MOSTLY_Q4_0), (t.Q4_1, f.MOSTLY_Q4_1), (t.Q8_0, f.MOSTLY_Q8_0)):
        if qtype in qtypes:
            return ftype
    return f.MOSTLY_F16 if float_type == "f16" else f.ALL_F32


def save_gguf(model: nn.Module, path: str | Path, *, tokenizer: Any, float_type: str = "f32") -> Path:
    """Write ``model`` (a transformers causal LM of an architecture llama.cpp has; its quantized
    Linears in groups of 32) as a GGUF file llama.cpp loads, with ``tokenizer`` (a fast transformers
    tokenizer, byte-level BPE or SentencePiece-style) inside. ``float_type`` "f16" stores the float
    matrices as F16 (vectors stay F32). Returns the path; UnsupportedModelError for what
    :func:`check_gguf` refuses or a grid without a block format."""
    gguf = _require_gguf()
    if float_type not in FLOAT_TYPES:
        raise UnsupportedModelError(f"float_type={float_type!r}: GGUF export writes {', '.join(FLOAT_TYPES)}")
    cfg = check_gguf(model)
    tokenizer_form(tokenizer)
    arch = arch_of(model)
    feats: Features = features(model, arch)
    plan = _plan(model, arch)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH[arch.name]])
    writer.add_name(str(getattr(cfg, "_name_or_path", "") or cfg.model_type))
    write_metadata(writer, cfg, feats)
    state = model.state_dict()
    modules = dict(model.named_modules())
    tensors: list[tuple[str, np.ndarray, Any]] = []
    qtypes: set[Any] = set()
    for key, name in plan.items():
        owner, _, leaf = key.rpartition(".")
        mod: Any = modules.get(owner)
        rows = {"attn_q": feats.heads, "attn_k": feats.kv_heads}.get(name.split(".")[-2]) if arch.permute_qk else None
        if leaf == "weight" and getattr(getattr(mod, "weight_quantizer", None), "enabled", False):
            data, qtype = gguf_blocks(mod, where=owner)
            qtypes.add(qtype)
        else:
            data, qtype = state[key].detach().float().numpy(), None
            if arch.norm_plus_one and key.endswith("norm.weight"):
                data = data + 1.0
            if float_type == "f16" and data.ndim == 2:
                data = data.astype(np.float16)
        if rows is not None:
            data = _permute(data, rows)
        tensors.append((name, np.ascontiguousarray(data), qtype))
    writer.add_file_type(_file_type(gguf, qtypes, float_type))
    form = write_tokenizer(writer, tokenizer, int(cfg.vocab_size), cfg)
    for name, data, qtype in tensors:
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    log.info("GGUF (%s, %s tokenizer): %d tensors, %d block-quantized, written to %s", arch.name.lower(), form,
             len(tensors), sum(q is not None for _, _, q in tensors), out)
    return out
