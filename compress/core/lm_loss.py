"""Causal-LM negative log-likelihood in bounded memory: never a full float32 ``[batch, sequence,
vocabulary]`` tensor and its log-softmax copy.

With a 262k vocabulary one 512-token window's float32 logits are 0.5 GB and ``cross_entropy`` over
them allocates a log-softmax as large again (plus a float32 copy of bf16 logits, plus the copy
``logits[:, :-1].reshape`` makes). Here the loss runs over chunks of positions whose float32
logits take at most ``chunk_bytes`` (:data:`CHUNK_BYTES` by default, :func:`chunk_positions`
positions for a vocabulary): the extra memory beyond the model's own output is at most a few
chunks (the float32 chunk, its log-softmax, and for :func:`model_nll` the chunk's head output and
its soft-capping temporaries), ``4 * chunk_bytes`` all told.

- :func:`logits_nll` scores logits the caller already has (an ONNX Runtime output, a model's).
- :func:`model_nll` scores a model without materializing its logits: the decoder runs once, and the
  model's own output head (with the final soft-capping or scaling its config declares) turns the
  final hidden states into logits chunk by chunk. Each batch checks the head path against the
  model's own logits at its last position (which the model computes anyway, alone, with
  ``logits_to_keep=1``); a model where they differ (a forward that does more after its head than
  this module reproduces) is scored from its full logits instead, chunked by :func:`logits_nll`.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from compress.core.batching import call_model, primary_output

log = logging.getLogger(__name__)

#: float32 bytes of logits one chunk holds (64 MiB: 64 positions of a 262k vocabulary, 335 of 50k)
CHUNK_BYTES = 64 * 2**20
IGNORE_INDEX = -100


def chunk_positions(vocab: int, *, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Positions per chunk: as many as keep a chunk's float32 logits within ``chunk_bytes`` (at least one)."""
    return max(1, int(chunk_bytes) // (4 * max(int(vocab), 1)))


def next_token_targets(labels: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` targets aligned with the positions that predict them: position t scores label
    t+1; the last position (which predicts past the window) is ``-100``, never scored."""
    tgt = torch.full_like(labels, IGNORE_INDEX)
    tgt[:, :-1] = labels[:, 1:]
    return tgt


def _chunks(batch: int, seq: int, step: int) -> list[tuple[int, int, int]]:
    # (row, start, end) over the positions that predict something (the last one never does)
    return [(b, s, min(s + step, seq - 1)) for b in range(batch) for s in range(0, seq - 1, step)]


def logits_nll(
    logits: torch.Tensor, labels: torch.Tensor, *, chunk_bytes: int = CHUNK_BYTES, label_smoothing: float = 0.0,
    per_row: bool = False,
) -> tuple[torch.Tensor, int]:
    """Summed next-token NLL of ``logits [B, S, V]`` (any float dtype) against ``labels [B, S]``
    (position t predicts label t+1; ``-100`` is not counted) and the number of scored tokens.

    The sum is float64 and keeps the autograd graph (a training loss can divide it by the count).
    Beyond ``logits`` itself, memory holds at most two ``chunk_bytes`` float32 chunks at a time
    (the chunk and its log-softmax); under autograd each chunk is recomputed in backward
    (:func:`checkpointed`), so the graph keeps no chunk's softmax either. ``per_row``: the sums per
    row, ``[B]``, instead of their total."""
    if logits.dim() != 3 or labels.dim() != 2 or tuple(labels.shape) != tuple(logits.shape[:2]):
        raise ValueError(f"need logits [B, S, V] and labels [B, S], got {tuple(logits.shape)} and {tuple(labels.shape)}")
    b, s, v = logits.shape
    tgt = next_token_targets(labels.to(logits.device))
    sums = [torch.zeros((), dtype=torch.float64, device=logits.device) for _ in range(b)]
    step = chunk_positions(v, chunk_bytes=chunk_bytes)
    for row, start, end in _chunks(b, s, step):
        sums[row] = sums[row] + checkpointed(_chunk_nll, logits[row, start:end], tgt[row, start:end], label_smoothing)
    return _reduce(sums, per_row, logits.device), int((tgt != IGNORE_INDEX).sum())


def checkpointed(fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """``fn(*args)``; when a tensor argument needs grad, through ``torch.utils.checkpoint``, so that
    backward recomputes the chunk's float32 copy and softmax instead of keeping them from forward."""
    if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        from torch.utils.checkpoint import checkpoint

        out: torch.Tensor = checkpoint(fn, *args, use_reentrant=False)
        return out
    return fn(*args)


def row_chunks(rows: int, width: int, *, chunk_bytes: int | None = None) -> list[slice]:
    """Slices of ``rows`` rows of ``width`` classes whose float32 chunks take at most ``chunk_bytes``
    (None: :data:`CHUNK_BYTES` as it is at the call)."""
    step = chunk_positions(width, chunk_bytes=CHUNK_BYTES if chunk_bytes is None else chunk_bytes)
    return [slice(a, min(a + step, rows)) for a in range(0, rows, step)]


def _chunk_nll(logits: torch.Tensor, tgt: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    return F.cross_entropy(logits.float(), tgt, ignore_index=IGNORE_INDEX, reduction="sum",
                           label_smoothing=label_smoothing).double()


# ---- scoring a model through its own head, chunk by chunk ----------------------------------------

#: models whose head path did not reproduce their logits: scored from full logits from then on
_UNMATCHED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def final_logit_transform(config: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """What a transformers causal LM's forward does to its head's output, read from its config:
    ``final_logit_softcapping`` (Gemma 2/3: ``c * tanh(x / c)``), ``logits_scaling`` (Granite:
    ``x / s``), ``logit_scale`` (Cohere: ``x * s``); identity otherwise. :func:`model_nll` checks
    the result against the model's own logits, so a forward that does anything else is caught."""
    cap = getattr(config, "final_logit_softcapping", None)
    div = getattr(config, "logits_scaling", None)
    mul = getattr(config, "logit_scale", None)

    def transform(x: torch.Tensor) -> torch.Tensor:
        if isinstance(div, (int, float)) and div not in (0, 1):
            x = x / div
        if isinstance(mul, (int, float)) and mul != 1:
            x = x * mul
        if isinstance(cap, (int, float)) and cap:
            x = torch.tanh(x / cap) * cap
        return x

    return transform


def _head_path(model: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """(decoder, output head) of a transformers-style causal LM whose forward takes
    ``logits_to_keep``; None for anything else."""
    get_head, get_decoder = getattr(model, "get_output_embeddings", None), getattr(model, "get_decoder", None)
    if not callable(get_head) or not callable(get_decoder) or model in _UNMATCHED:
        return None
    try:
        params = inspect.signature(model.forward).parameters
        head, decoder = get_head(), get_decoder()
    except (TypeError, ValueError, AttributeError, NotImplementedError):
        return None
    if "logits_to_keep" not in params or not isinstance(head, nn.Module) or not isinstance(decoder, nn.Module):
        return None
    if decoder is model:
        return None
    return decoder, head


def model_nll(
    model: nn.Module, inputs: Any, labels: torch.Tensor, *, chunk_bytes: int = CHUNK_BYTES, per_row: bool = False
) -> tuple[torch.Tensor, int]:
    """Summed next-token NLL (float64) of ``model`` on one batch and the number of scored tokens,
    without its full logits: the decoder runs once, then the model's output head and final logit
    transform (:func:`final_logit_transform`) run over chunks of ``chunk_bytes`` float32 logits.

    ``inputs``: a tensor of ids or a dict of model inputs; ``labels [B, S]`` as :func:`logits_nll`.
    A model that is not a transformers-style causal LM, or whose head path differs from its own
    logits (checked on every batch at the last position), is scored from its full output logits,
    chunked by :func:`logits_nll` (then only the model's own logits are full-sized). Call it under
    ``torch.no_grad()`` for evaluation. ``per_row``: the sums per row, ``[B]``, instead of their total."""
    path = _head_path(model)
    if path is None:
        return logits_nll(primary_output(call_model(model, inputs)), labels, chunk_bytes=chunk_bytes, per_row=per_row)
    decoder, head = path
    captured: dict[str, torch.Tensor] = {}

    def keep_hidden(_m: nn.Module, _args: Any, out: Any) -> None:
        h = out.get("last_hidden_state") if isinstance(out, Mapping) else getattr(out, "last_hidden_state", None)
        captured["h"] = h if isinstance(h, torch.Tensor) else out[0]

    kw = dict(inputs) if isinstance(inputs, Mapping) else {"input_ids": inputs}
    if "use_cache" in inspect.signature(model.forward).parameters:
        kw.setdefault("use_cache", False)  # a scoring pass has no next step: no KV cache to hold
    handle = decoder.register_forward_hook(keep_hidden)
    try:
        own = primary_output(model(**kw, logits_to_keep=1))  # the last position only: [B, 1, V]
    finally:
        handle.remove()
    hidden = captured.get("h")
    transform = final_logit_transform(getattr(model, "config", None))
    if hidden is None or hidden.dim() != 3 or not _same(transform(head(hidden[:, -1:])), own):
        log.info("%s: its head path does not reproduce its logits; scoring its full logits in chunks",
                 type(model).__name__)
        _UNMATCHED.add(model)
        return logits_nll(primary_output(call_model(model, inputs)), labels, chunk_bytes=chunk_bytes, per_row=per_row)
    b, s, _ = hidden.shape
    tgt = next_token_targets(labels.to(hidden.device))
    sums = [torch.zeros((), dtype=torch.float64, device=hidden.device) for _ in range(b)]
    step = chunk_positions(int(own.shape[-1]), chunk_bytes=chunk_bytes)
    for row, start, end in _chunks(b, s, step):
        sums[row] = sums[row] + _chunk_nll(transform(head(hidden[row:row + 1, start:end]))[0], tgt[row, start:end])
    return _reduce(sums, per_row, hidden.device), int((tgt != IGNORE_INDEX).sum())


def _reduce(sums: list[torch.Tensor], per_row: bool, device: torch.device) -> torch.Tensor:
    if per_row:
        return torch.stack(sums) if sums else torch.zeros(0, dtype=torch.float64, device=device)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for x in sums:
        total = total + x
    return total


def _same(mine: torch.Tensor, own: torch.Tensor) -> bool:
    if mine.shape != own.shape:
        return False
    a, b = mine.float(), own.float()
    scale = float(b.abs().max()) if b.numel() else 0.0
    # the same head on the same rows: equal up to the matmul's blocking (bf16 rounding included)
    tol = (1e-2 if own.dtype in (torch.bfloat16, torch.float16) else 1e-5) * max(scale, 1.0)
    return bool(((a - b).abs() <= tol).all())
