"""Streaming parity of a runtime's outputs against a reference: max/mean abs diff, cosine, SQNR and
top-1 agreement, accumulated batch by batch (sequence lengths may differ between batches)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

#: float64 elements of one block of a ``[B, S, ...]`` batch that parity reads at a time (32 MiB)
BLOCK_ELEMENTS = 2**22


class Parity:
    """Accumulates ``update(reference, output)`` over batches; ``result()`` gives the figures."""

    def __init__(self, *, classification: bool = True) -> None:
        self.classification = classification
        self.max_abs = 0.0
        self.abs_sum = 0.0
        self.numel = 0
        self.signal = 0.0
        self.noise = 0.0
        self.cos_sum = 0.0
        self.rows = 0
        self.agree = 0
        self.agree_rows = 0
        self.nonfinite = 0

    def update(self, reference: np.ndarray, output: np.ndarray, *, mask: np.ndarray | None = None) -> None:
        """Add one batch. ``mask`` ``[B, S]`` (an attention mask: 0 = padding) leaves the padded
        positions of ``[B, S, ...]`` outputs out of every figure: what a model computes for padding
        is discarded downstream (pooling, the next token), and with short sentences it would
        dominate the per-row cosine. A mask whose shape does not lead the output's is ignored.

        ``[B, S, ...]`` outputs are read a sample and :data:`BLOCK_ELEMENTS` elements at a time, so
        the float64 working copies stay bounded whatever the vocabulary of an LM's logits."""
        ref, out = np.asarray(reference), np.asarray(output)
        if ref.shape != out.shape:
            raise ValueError(f"output shape {out.shape} differs from the reference's {ref.shape}")
        keep = None
        if mask is not None and out.ndim >= 2 and tuple(np.shape(mask)) == out.shape[:2]:
            keep = np.asarray(mask) != 0
        if out.ndim < 3:
            self._rows(ref, out, keep)
            return
        per_position = int(np.prod(out.shape[2:]))
        step = max(1, BLOCK_ELEMENTS // max(per_position, 1))
        for i in range(out.shape[0]):
            dot = rr = oo = 0.0
            for j in range(0, out.shape[1], step):
                k = None if keep is None else keep[i:i + 1, j:j + step]
                d, r, o = self._block(ref[i:i + 1, j:j + step], out[i:i + 1, j:j + step], k)
                dot, rr, oo = dot + float(d[0]), rr + float(r[0]), oo + float(o[0])
            denom = math.sqrt(rr) * math.sqrt(oo)
            self.cos_sum += dot / denom if denom > 0 else 1.0
            self.rows += 1

    def _rows(self, ref: np.ndarray, out: np.ndarray, keep: np.ndarray | None) -> None:
        dot, rr, oo = self._block(ref, out, keep)
        denom = np.sqrt(rr) * np.sqrt(oo)
        cos = np.where(denom > 0, dot / np.where(denom > 0, denom, 1.0), 1.0)
        self.cos_sum += float(cos.sum())
        self.rows += int(cos.size)

    def _block(self, reference: np.ndarray, output: np.ndarray,
               keep: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Accumulate one block's figures; returns its per-sample dot product and squared norms."""
        ref = np.asarray(reference, dtype=np.float64)
        out = np.asarray(output, dtype=np.float64)
        if keep is not None:
            k = np.broadcast_to(keep.reshape(keep.shape + (1,) * (out.ndim - 2)), out.shape)
            ref, out = np.where(k, ref, 0.0), np.where(k, out, 0.0)
        finite = np.isfinite(out)
        self.nonfinite += int(out.size - finite.sum())
        out = np.where(finite, out, 0.0)
        diff = out - ref
        if diff.size:
            self.max_abs = max(self.max_abs, float(np.abs(diff).max()))
        self.abs_sum += float(np.abs(diff).sum())
        self.numel += diff.size if keep is None else int(keep.sum()) * int(np.prod(out.shape[2:]))
        self.signal += float((ref**2).sum())
        self.noise += float((diff**2).sum())
        if self.classification and ref.ndim >= 2:
            a, b = ref.argmax(-1), out.argmax(-1)
            self.agree += int((a == b).sum())
            self.agree_rows += int(a.size)
        n = ref.shape[0] if ref.ndim else 1
        r2, o2 = ref.reshape(n, -1), out.reshape(n, -1)
        return (r2 * o2).sum(1), (r2**2).sum(1), (o2**2).sum(1)

    def result(self) -> dict[str, float | None]:
        if self.numel == 0:
            return {}
        if self.noise == 0:
            sqnr = math.inf
        elif self.signal == 0:
            sqnr = -math.inf
        else:
            sqnr = 10 * math.log10(self.signal / self.noise)
        return {
            "max_abs_diff": self.max_abs,
            "mean_abs_diff": self.abs_sum / self.numel,
            "cosine": self.cos_sum / max(self.rows, 1),
            "sqnr_db": sqnr if math.isfinite(sqnr) else (999.0 if sqnr > 0 else -999.0),
            "top1_agreement": (self.agree / self.agree_rows) if self.agree_rows else None,
            "nonfinite": float(self.nonfinite),
        }


def to_numpy_feeds(inputs: Any, names: list[str]) -> dict[str, np.ndarray]:
    """Feeds for a runtime: a tensor, tuple or dict batch mapped onto the model's input names."""

    def arr(t: Any) -> np.ndarray:
        if isinstance(t, torch.Tensor):
            t = t.detach().cpu()
            if t.is_floating_point():
                return t.float().numpy()
            if t.dtype == torch.bool:
                return t.numpy()
            return t.long().numpy()
        return np.asarray(t)

    if isinstance(inputs, Mapping):
        missing = [n for n in names if n not in inputs]
        if missing:
            raise KeyError(f"model input(s) {missing} are not in the data batch (keys: {sorted(inputs)})")
        return {n: arr(inputs[n]) for n in names}
    seq = list(inputs) if isinstance(inputs, (tuple, list)) else [inputs]
    if len(seq) != len(names):
        raise KeyError(f"the model takes {len(names)} input(s) {names} but the batch holds {len(seq)}")
    return {n: arr(t) for n, t in zip(names, seq)}


def resize_batch(feeds: Mapping[str, np.ndarray], n: int) -> dict[str, np.ndarray]:
    """Feeds with batch ``n``: rows repeated (or cut) along dim 0 from a real batch."""
    out = {}
    for k, v in feeds.items():
        reps = -(-n // v.shape[0])
        out[k] = np.ascontiguousarray(np.concatenate([v] * reps, axis=0)[:n]) if reps > 1 else np.ascontiguousarray(v[:n])
    return out
