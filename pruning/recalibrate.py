"""BatchNorm recalibration after pruning.

A removed channel still fed its BN-shifted constant into the next layer; without it, the next
BatchNorm's running mean and variance are stale. Re-estimating them on a few batches (a cumulative
average, everything else in eval mode) recovers much of the accuracy a cut loses before any
fine-tuning (on digits MobileNetV2 at 30% of channels: 0.12 -> 0.62 top-1, see benchmarks).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from compress.core.batching import call_model, split_batch, to_device
from compress.core.progress import bar


def recalibrate_bn(model: nn.Module, data: Iterable[Any], *, batches: int = 8, device: torch.device | str = "cpu") -> int:
    """Re-estimate every BatchNorm's running statistics on up to ``batches`` batches; returns how
    many batches were used (0 when the model has no BatchNorm with running stats)."""
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    if not bns or batches <= 0:
        return 0
    was_training = model.training
    saved = [(m, m.momentum) for m in bns]
    model.eval()
    for m in bns:
        m.reset_running_stats()
        m.momentum = None  # cumulative average over the batches seen
        m.train()
    used = 0
    try:
        with torch.no_grad():
            for batch in bar(data, desc="BatchNorm recalibration", cap=batches, unit="batch"):
                if used >= batches:
                    break
                inputs, _ = split_batch(batch)
                call_model(model, to_device(inputs, device))
                used += 1
    finally:
        for m, momentum in saved:
            m.momentum = momentum
        model.train(was_training)
    return used
