"""A transformers fast tokenizer written into a GGUF file in the form llama.cpp reads.

The form is decided from the tokenizer itself (its ``tokenizer.json``), not from the model family:
a byte-level BPE (a ``ByteLevel`` pre-tokenizer or decoder) is llama.cpp's ``gpt2`` model (tokens +
merges); a SentencePiece-style one (a Unigram model, or a BPE with byte fallback or a ``Metaspace``
pre-tokenizer) is its ``llama`` model (tokens + scores + token types, merges too for a BPE).
"""

from __future__ import annotations

import json
import re
from typing import Any

from compress.core.errors import ExportError, UnsupportedModelError

# llama.cpp's token types (gguf.TokenType): NORMAL, UNKNOWN, CONTROL, BYTE
_NORMAL, _UNKNOWN, _CONTROL, _BYTE = 1, 2, 3, 6
_BYTE_TOKEN = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


def _types(node: Any) -> set[str]:
    """Every component ``type`` named anywhere under a tokenizer.json node."""
    if isinstance(node, dict):
        return ({node["type"]} if isinstance(node.get("type"), str) else set()).union(*map(_types, node.values()))
    if isinstance(node, list):
        return set().union(*map(_types, node))
    return set()


def tokenizer_form(tokenizer: Any) -> str:
    """``"gpt2"`` (byte-level BPE) or ``"llama"`` (SentencePiece-style), from tokenizer.json; else
    UnsupportedModelError naming what it found."""
    if tokenizer is None or not hasattr(tokenizer, "backend_tokenizer"):
        raise ExportError("save_gguf: llama.cpp reads the tokenizer from the file; pass a fast transformers tokenizer")
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    model, parts = state["model"], _types([state.get("pre_tokenizer"), state.get("decoder"), state.get("normalizer")])
    kind = model.get("type")
    if kind == "Unigram" or (kind == "BPE" and (model.get("byte_fallback") or "Metaspace" in parts)):
        return "llama"
    if kind == "BPE" and "ByteLevel" in parts:
        return "gpt2"
    raise UnsupportedModelError(f"tokenizer: a {kind} model with {sorted(parts) or 'no'} pre-tokenizer/decoder is "
                                "neither byte-level BPE (GGUF gpt2) nor SentencePiece-style (GGUF llama)")


def write_tokenizer(writer: Any, tokenizer: Any, vocab_size: int, config: Any = None) -> str:
    """Write ``tokenizer`` as llama.cpp's tokenizer keys, padded to ``vocab_size`` rows (the model's
    embedding may have more rows than the tokenizer has tokens); a special id the tokenizer lacks is
    taken from the model's ``config``. Returns the form written."""
    form = tokenizer_form(tokenizer)
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    model = state["model"]
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    if len(by_id) > vocab_size:
        raise UnsupportedModelError(f"tokenizer: {len(by_id)} tokens for a model of {vocab_size} embedding rows")
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    special = set(tokenizer.all_special_ids)
    unk = getattr(tokenizer, "unk_token_id", None)
    writer.add_tokenizer_model(form)
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    if form == "gpt2":
        writer.add_token_types([_CONTROL if i in special else _NORMAL for i in range(vocab_size)])
    else:
        if model["type"] == "Unigram":
            score = {i: float(s) for i, (_, s) in enumerate(model["vocab"])}
        else:  # SentencePiece BPE: earlier ids merge first, as its scores rank them
            score = {i: -float(i) for i in range(vocab_size)}
        writer.add_token_scores([score.get(i, -1e9) for i in range(vocab_size)])
        writer.add_token_types([_UNKNOWN if i == unk else _CONTROL if i in special
                                else _BYTE if _BYTE_TOKEN.match(t) else _NORMAL for i, t in enumerate(tokens)])
        prepend = next((p.get("prepend_scheme", "always") for p in _walk(state.get("pre_tokenizer"))
                        if p.get("type") == "Metaspace"), None)
        writer.add_add_space_prefix(prepend is not None and prepend != "never")
    if model["type"] == "BPE":
        writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
    for name, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                      ("unk_token_id", writer.add_unk_token_id), ("pad_token_id", writer.add_pad_token_id)):
        value = getattr(tokenizer, name, None)
        if value is None and name != "unk_token_id":
            value = getattr(config, name, None)
        if isinstance(value, int) and 0 <= value < vocab_size:
            add(int(value))
    add_bos = getattr(tokenizer, "add_bos_token", None)
    if isinstance(add_bos, bool):
        writer.add_add_bos_token(add_bos)
    return form


def _walk(node: Any) -> list[dict[str, Any]]:
    if isinstance(node, dict):
        return [node] + [d for v in node.values() for d in _walk(v)]
    if isinstance(node, list):
        return [d for v in node for d in _walk(v)]
    return []
