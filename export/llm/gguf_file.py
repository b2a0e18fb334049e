"""A GGUF file for llama.cpp from a quantized transformers Llama or Qwen2 model: the quantized Linears
as Q4_0/Q4_1/Q8_0 blocks with our codes (:mod:`export.llm.gguf_weights`), everything else float32,
the architecture's metadata and the tokenizer (byte-level BPE, llama.cpp's ``gpt2`` model) inside.

Tensor names and the Q/K row order follow llama.cpp's own converter (``convert_hf_to_gguf.py``):
Llama's q/k rows are permuted from transformers' rotate-half layout to interleaved pairs (whole
rows move, so the blocks are unchanged); Qwen2's are not, and its q/k/v biases are written.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from compress.export.llm.gguf_weights import _require_gguf, gguf_blocks
from torch import nn

from compress.core.errors import ExportError, UnsupportedModelError

log = logging.getLogger(__name__)

#: transformers module path (under ``model.layers.{i}.``) -> llama.cpp tensor name (under ``blk.{i}.``)
_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
ARCHS = ("llama", "qwen2")


def _permute(x: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: per head, rows (i, i + d/2) become neighbours."""
    return x.reshape(heads, 2, x.shape[0] // heads // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _tokenizer(writer: Any, tokenizer: Any, vocab_size: int) -> None:
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    model = state["model"]
    if model.get("type") != "BPE":
        raise UnsupportedModelError(f"GGUF export writes byte-level BPE tokenizers (got {model.get('type')})")
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    special = set(tokenizer.all_special_ids)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 1 for i in range(vocab_size)])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
    for name, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                      ("pad_token_id", writer.add_pad_token_id)):
        value = getattr(tokenizer, name, None)
        if value is not None:
            add(int(value))


def check_gguf(model: nn.Module) -> Any:
    """The model's config if :func:`save_gguf` writes its architecture, else UnsupportedModelError
    saying why: from the structure alone (config and module names), so it runs on a meta-device
    model before anything trains (compress.preflight) and is the first thing save_gguf checks."""
    cfg: Any = getattr(model, "config", None)
    arch = getattr(cfg, "model_type", None)
    if arch not in ARCHS:
        raise UnsupportedModelError(f"GGUF export writes transformers {', '.join(ARCHS)} causal LMs (got {arch})")
    base: Any = getattr(model, "model", None)
    if base is None or not hasattr(model, "lm_head") or not all(hasattr(base, a) for a in ("embed_tokens", "norm", "layers")):
        raise UnsupportedModelError(f"{type(model).__name__}: GGUF export expects .model.embed_tokens, .model.norm, "
                                    ".model.layers and .lm_head")
    for i, layer in enumerate(base.layers):
        for sub in _LAYER:
            try:
                layer.get_submodule(sub)
            except AttributeError:
                raise UnsupportedModelError(f"model.layers.{i}.{sub}: missing; GGUF export writes {arch}'s "
                                            "attention and gated MLP modules") from None
    return cfg


def save_gguf(model: nn.Module, path: str | Path, *, tokenizer: Any) -> Path:
    """Write ``model`` (a transformers Llama or Qwen2 causal LM whose quantized Linears use groups of 32)
    as a GGUF file llama.cpp loads, with ``tokenizer`` (a transformers fast BPE tokenizer) inside.
    Returns the path. UnsupportedModelError for another architecture or a grid without a block format."""
    gguf = _require_gguf()
    cfg = check_gguf(model)
    arch = cfg.model_type
    if tokenizer is None or not hasattr(tokenizer, "backend_tokenizer"):
        raise ExportError("save_gguf: llama.cpp reads the tokenizer from the file; pass a fast transformers tokenizer")
    heads, kv = int(cfg.num_attention_heads), int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(str(getattr(cfg, "_name_or_path", "") or arch))
    writer.add_context_length(int(cfg.max_position_embeddings))
    writer.add_embedding_length(int(cfg.hidden_size))
    writer.add_block_count(int(cfg.num_hidden_layers))
    writer.add_feed_forward_length(int(cfg.intermediate_size))
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_rope_dimension_count(head_dim)
    rope = getattr(cfg, "rope_parameters", None) or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    writer.add_vocab_size(int(cfg.vocab_size))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _tokenizer(writer, tokenizer, int(cfg.vocab_size))

    def tensor(name: str, x: np.ndarray, qtype: Any = None, rows_heads: int | None = None) -> None:
        if rows_heads is not None and arch == "llama":
            x = _permute(x, rows_heads)
        writer.add_tensor(name, np.ascontiguousarray(x), raw_dtype=qtype)

    base: Any = model.model
    tensor("token_embd.weight", base.embed_tokens.weight.detach().float().numpy())
    tensor("output_norm.weight", base.norm.weight.detach().float().numpy())
    head: Any = model.lm_head
    tied = head.weight.data_ptr() == base.embed_tokens.weight.data_ptr()
    counts = {"quantized": 0, "float": 0}
    for i, layer in enumerate(base.layers):
        for sub, short in _LAYER.items():
            mod: Any = layer.get_submodule(sub)
            where = f"model.layers.{i}.{sub}"
            heads_of = {"attn_q": heads, "attn_k": kv}.get(short)
            if getattr(mod, "weight_quantizer", None) is not None:
                data, qtype = gguf_blocks(mod, where=where)
                tensor(f"blk.{i}.{short}.weight", data, qtype, heads_of)
                counts["quantized"] += 1
            else:
                tensor(f"blk.{i}.{short}.weight", mod.weight.detach().float().numpy(), None, heads_of)
                counts["float"] += "norm" not in short
            bias = getattr(mod, "bias", None)
            if isinstance(bias, torch.Tensor):
                tensor(f"blk.{i}.{short}.bias", bias.detach().float().numpy(), None, heads_of)
    if not tied:
        if getattr(head, "weight_quantizer", None) is not None:
            data, qtype = gguf_blocks(head, where="lm_head")
            tensor("output.weight", data, qtype)
        else:
            tensor("output.weight", head.weight.detach().float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    log.info("GGUF (%s): %d block-quantized Linears, %d float, written to %s", arch, counts["quantized"],
             counts["float"], out)
    return out
