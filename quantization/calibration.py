"""Calibration: run a forward loop with activation observers on, then fix the qparams."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from compress.batching import call_model, split_batch, to_device
from compress.errors import CalibrationError
from quantization.prepare import quantizers, unwrap

log = logging.getLogger(__name__)

ForwardLoop = Callable[[nn.Module], Any]


def as_forward_loop(data: ForwardLoop | Iterable[Any], *, max_batches: int | None = None) -> ForwardLoop:
    """A ``forward_loop(model)`` from a callable or an iterable of batches (``(inputs, targets)``,
    a tensor or a dict of tensors); inputs move to the model's device."""
    if callable(data) and not isinstance(data, Iterable):
        return data

    def loop(model: nn.Module) -> int:
        p = next(model.parameters(), None)
        device = p.device if p is not None else torch.device("cpu")
        n = 0
        with torch.no_grad():
            for i, batch in enumerate(data):
                if max_batches is not None and i >= max_batches:
                    break
                inputs, _ = split_batch(batch)
                call_model(model, to_device(inputs, device))
                n += 1
        return n

    return loop


def calibrate(model: nn.Module, forward_loop: ForwardLoop | Iterable[Any], *, where: str = "calibration") -> None:
    """Observe activations over ``forward_loop`` (float forward, quantizers off), then set qparams.

    Raises CalibrationError when the loop feeds no data, when a quantizer saw none (its module was
    never called) or when activations hold NaN/inf.
    """
    loop = as_forward_loop(forward_loop)
    root = unwrap(model)
    acts = [(n, q) for n, q in quantizers(root) if q.role != "weight" and q.observer is not None]
    if not acts:
        return
    saved = {n: (q.enabled, q.observing) for n, q in quantizers(root)}
    for _, q in quantizers(root):
        q.enabled = False
        if q.observer is not None and q.role != "weight":
            q.observer.reset()
            q.observing = True
    was_training = root.training
    root.eval()
    try:
        with torch.no_grad():
            loop(model)
    finally:
        root.train(was_training)
        for n, q in quantizers(root):
            q.enabled, q.observing = saved[n]
    if all(q.observer is not None and q.observer.num_updates == 0 for _, q in acts):
        raise CalibrationError(f"{where}: the forward loop fed no data (empty calibration set?)")
    for _, q in acts:
        q.finish_calibration()
    log.info("%s: calibrated %d activation quantizers", where, len(acts))
