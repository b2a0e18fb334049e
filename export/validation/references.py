"""Bounded reading of outputs during validation: the PyTorch references' outputs per eval batch
(kept while small, recomputed per row group when large) and a runtime session run in row groups,
so that an LM's full-vocabulary logits are read a few rows at a time, never an eval set's at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from compress.export.validation.runtimes import RuntimeSession, run_session
from torch import nn

from compress.core.batching import batch_size_of, call_model, primary_output
from compress.core.precision import float32_weights

#: outputs of the PyTorch references kept across runtimes (a classifier's logits); an LM's are recomputed
REFERENCE_CACHE_BYTES = 256 * 2**20
#: bytes of a runtime's first output one run may return: larger batches run in row groups
OUTPUT_BYTES = 256 * 2**20


def rows(inputs: Any, start: int, end: int) -> Any:
    """Rows ``start:end`` of a batch (a tensor, tuple or dict of tensors)."""
    if isinstance(inputs, Mapping):
        return {k: v[start:end] if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(rows(t, start, end) for t in inputs)
    return inputs[start:end] if isinstance(inputs, torch.Tensor) else inputs


class References:
    """The PyTorch references' outputs per eval batch (primary output, float32, CPU), computed when
    asked for. Whole batches are kept while they fit in :data:`REFERENCE_CACHE_BYTES` (every runtime
    and record reads them again); row groups of larger ones (an LM's full-vocabulary logits) are
    computed for the rows asked and dropped, so no eval set's logits are ever held at once."""

    def __init__(self, models: Mapping[str, nn.Module | None], batches: list[tuple[Any, Any]]) -> None:
        self.models = {k: m for k, m in models.items() if m is not None}
        self.batches = batches
        self.cache: dict[tuple[str, int], torch.Tensor] = {}
        self.bytes = 0

    def has(self, role: str) -> bool:
        return role in self.models

    def output(self, role: str, i: int, start: int = 0, end: int | None = None) -> torch.Tensor:
        inputs = self.batches[i][0]
        n = batch_size_of(inputs)
        end = n if end is None else end
        got = self.cache.get((role, i))
        if got is not None:
            return got[start:end]
        whole = start == 0 and end == n
        with torch.no_grad():
            out = primary_output(call_model(self.models[role], inputs if whole else rows(inputs, start, end)))
        out = out.detach().float().cpu()
        if whole and self.bytes + out.numel() * 4 <= REFERENCE_CACHE_BYTES:
            self.cache[(role, i)] = out
            self.bytes += out.numel() * 4
        return out


@contextlib.contextmanager
def as_reference(models: Iterable[nn.Module | None]) -> Iterator[None]:
    """The models in eval mode with float32 weights (the file computes in float32: export.onnx)."""
    with contextlib.ExitStack() as stack:
        for m in {id(m): m for m in models if m is not None}.values():
            was = m.training
            m.eval()
            stack.callback(m.train, was)
            stack.enter_context(float32_weights(m))
        yield


class RowGroups:
    """Runs a session on a batch in row groups whose first output stays within :data:`OUTPUT_BYTES`:
    the first batch's first row alone measures a row's output, then groups of as many rows as fit
    (one group for a classifier's batch; a row at a time for an LM's full-vocabulary logits). A file
    with a static batch dimension runs whole batches."""

    def __init__(self, session: RuntimeSession) -> None:
        self.session = session
        self.per_run: int | None = None

    def run(self, feeds: dict[str, np.ndarray]) -> Iterator[tuple[int, int, np.ndarray]]:
        sizes = {v.shape[0] if v.ndim else None for v in feeds.values()}
        n = next(iter(sizes)) if len(sizes) == 1 else None
        static = any(isinstance((self.session.input_shapes.get(k) or [None])[0], int) for k in feeds)
        if n is None or static or n == 1:
            yield 0, int(n or 1), run_session(self.session, feeds)[0]
            return
        start = 0
        if self.per_run is None:
            first = run_session(self.session, {k: v[:1] for k, v in feeds.items()})[0]
            self.per_run = max(1, OUTPUT_BYTES // max(int(first.nbytes), 1))
            yield 0, 1, first
            start = 1
        for a in range(start, n, self.per_run):
            b = min(a + self.per_run, n)
            part = feeds if (a, b) == (0, n) else {k: np.ascontiguousarray(v[a:b]) for k, v in feeds.items()}
            yield a, b, run_session(self.session, part)[0]
