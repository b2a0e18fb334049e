"""Calibration: run a forward loop with activation observers on, then fix the qparams."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from compress.core.batching import CalibrationData, as_forward_loop
from compress.core.errors import CalibrationError
from quantization.placement.activations import ensure_placed
from quantization.preparation import quantizers, unwrap

log = logging.getLogger(__name__)


@contextmanager
def float_mode(model: nn.Module) -> Iterator[None]:
    """Quantizers off (and not observing) inside the block, restored after; the model in eval."""
    qs = list(quantizers(model))
    saved = [(q.enabled, q.observing) for _, q in qs]
    was_training = model.training
    for _, q in qs:
        q.enabled = q.observing = False
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
        for (_, q), (en, ob) in zip(qs, saved):
            q.enabled, q.observing = en, ob


def calibrate(model: nn.Module, forward_loop: CalibrationData, *, where: str = "calibration") -> None:
    """Observe activations over ``forward_loop`` (float forward, quantizers off), then set qparams.

    Raises CalibrationError when the loop feeds no data, when a quantizer saw none (its module was
    never called) or when activations hold NaN/inf.
    """
    loop = as_forward_loop(forward_loop)
    root = unwrap(model)
    ensure_placed(root, loop)
    acts = [(n, q) for n, q in quantizers(root) if q.role != "weight" and q.observer is not None]
    if not acts:
        return
    with float_mode(root), torch.no_grad():
        for _, q in acts:
            assert q.observer is not None
            q.observer.reset()
            q.observing = True
        loop(model)
    if all(q.observer is not None and q.observer.num_updates == 0 for _, q in acts):
        raise CalibrationError(f"{where}: the forward loop fed no data (empty calibration set?)")
    for _, q in acts:
        q.finish_calibration()
    log.info("%s: calibrated %d activation quantizers", where, len(acts))
