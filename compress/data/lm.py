"""Causal language-model data from a real corpus: the running Python's standard-library source.

Files (not sentences) are split between train, calibration and eval with a fixed seed, so the
eval text is held out at the file level: a model never sees a line of an eval file. Each split's
files are tokenized in order, joined with the tokenizer's end-of-text token and cut into
non-overlapping windows of ``seq_len`` tokens (the standard perplexity protocol, no padding).
When the tokenizer adds a BOS token by default (:func:`adds_bos`: as its model was trained), every
window, calibration and eval alike, is that BOS followed by ``seq_len - 1`` text tokens; the BOS
position is never a scored target (it is position 0, which no earlier position predicts).
A batch is ``({"input_ids": [B, T]}, labels [B, T])`` with labels equal to the inputs: the loss
and the perplexity metric shift them by one token themselves.

:func:`train_tokenizer` trains the byte-level BPE tokenizer the reference LLM uses
(``tokenizers``), on the train split only.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import sysconfig
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from compress.data.bundle import Splits
from compress.data.digits import FRACTIONS
from compress.data.text import _SKIP_DIRS

log = logging.getLogger(__name__)

#: the end-of-text token of tokenizers trained here (also bos and pad)
EOS = "<|endoftext|>"
SPLITS = ("train", "calibration", "eval")


@functools.lru_cache(maxsize=4)
def source_files(root: Path | None = None) -> tuple[Path, ...]:
    """The stdlib ``.py`` files of :func:`compress.data.text.stdlib_files` (same files, same order),
    found by a walk that does not descend into skipped folders, and cached."""
    base = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    out = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("config-")]
        out += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    return tuple(sorted(out, key=lambda p: p.relative_to(base).as_posix()))


def split_files(seed: int = 0, root: Path | None = None) -> dict[str, list[Path]]:
    """The stdlib ``.py`` files split 60/15/25 by a seeded shuffle (the same split for every run
    with this seed, so a model trained on ``train`` is evaluated on files it never saw)."""
    files = list(source_files(root))
    random.Random(seed).shuffle(files)
    n = len(files)
    a = round(FRACTIONS[0] * n)
    b = a + round(FRACTIONS[1] * n)
    return {"train": files[:a], "calibration": files[a:b], "eval": files[b:]}


def read_text(path: Path) -> str | None:
    """A source file's text, or None when it is not UTF-8 (a few stdlib test fixtures)."""
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def iter_texts(files: Iterable[Path]) -> Iterable[str]:
    for f in files:
        t = read_text(f)
        if t:
            yield t


def train_tokenizer(texts: Iterable[str], *, vocab_size: int = 4096, min_frequency: int = 2) -> Any:
    """A byte-level BPE tokenizer trained on ``texts``, as a transformers ``PreTrainedTokenizerFast``
    (``save_pretrained`` writes it next to a model). Deterministic for the same texts in the same order."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS, unk_token=None)


def token_stream(files: Sequence[Path], tokenizer: Any, *, max_tokens: int | None = None) -> torch.Tensor:
    """The files' tokens in order, each file followed by the end-of-text token (stops once
    ``max_tokens`` are collected, so small runs tokenize only a few files)."""
    eos = tokenizer.convert_tokens_to_ids(EOS) if EOS in tokenizer.get_vocab() else tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no end-of-text token")
    out: list[int] = []
    for text in iter_texts(files):
        out += tokenizer(text, add_special_tokens=False)["input_ids"]
        out.append(int(eos))
        if max_tokens is not None and len(out) >= max_tokens:
            break
    return torch.tensor(out[:max_tokens] if max_tokens is not None else out, dtype=torch.long)


def adds_bos(tokenizer: Any) -> int | None:
    """The BOS id when ``tokenizer`` puts it first by default, else None. The general rule: encode a
    short text with default settings and see whether the first id is the tokenizer's ``bos_token_id``
    (Llama-2/3 and Gemma tokenizers add one; GPT-2's, SmolLM2's and the ones trained here do not)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = tokenizer("x")["input_ids"]
    return int(bos) if len(ids) > 1 and int(ids[0]) == int(bos) else None


class TokenWindows(Dataset[tuple[dict[str, torch.Tensor], torch.Tensor]]):
    """Non-overlapping ``seq_len`` windows of a token stream (a trailing partial window is dropped);
    with ``bos``, each window is ``bos`` and the next ``seq_len - 1`` tokens."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, *, bos: int | None = None) -> None:
        body = seq_len - (bos is not None)
        n = len(tokens) // body
        windows = tokens[: n * body].reshape(n, body)
        if bos is not None:
            windows = torch.cat([torch.full((n, 1), bos, dtype=windows.dtype), windows], dim=1)
        self.windows = windows

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        w = self.windows[i]
        return {"input_ids": w}, w


def text_lm(*, seed: int, tokenizer: str, seq_len: int = 128, samples: int = 512) -> Splits:
    """Causal-LM windows of ``seq_len`` tokens from the stdlib source, at most ``samples`` windows
    per split, tokenized by ``tokenizer`` (a local directory or ``package:DIST``, e.g. the
    reference LLM's own directory), each starting with BOS when the tokenizer adds one by default
    (the report's data states ``bos``). Task ``causal_lm``: use the ``perplexity`` metric."""
    from compress.models.hf import load_tokenizer

    if seq_len < 2 or samples < 1:
        raise ValueError(f"need seq_len >= 2 and samples >= 1, got {seq_len} and {samples}")
    tok = load_tokenizer(tokenizer, where="data.kwargs.tokenizer")
    bos = adds_bos(tok)
    body = seq_len - (bos is not None)
    files = split_files(seed)
    parts = {k: TokenWindows(token_stream(files[k], tok, max_tokens=samples * body), seq_len, bos=bos) for k in SPLITS}
    for k, ds in parts.items():
        if len(ds) < samples:
            log.warning("text_lm: the %s split has %d windows of %d tokens, fewer than the %d asked", k, len(ds), seq_len, samples)
    return Splits(
        train=parts["train"], calibration=parts["calibration"], eval=parts["eval"], num_classes=None, task="causal_lm",
        description={"seq_len": seq_len, "bos": bos is not None},
    )
