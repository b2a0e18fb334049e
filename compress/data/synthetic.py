"""Generated, learnable classification data: each class is a smooth random prototype (low spatial
frequency, so convolutions can learn it) plus gaussian noise; deterministic by seed."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from compress.data.bundle import Splits, stratified_indices
from compress.data.digits import FRACTIONS


def synthetic(
    *,
    seed: int,
    shape: Sequence[int] = (1, 8, 8),
    num_classes: int = 10,
    samples: int = 2000,
    noise: float = 1.0,
) -> Splits:
    """``samples`` inputs of per-sample ``shape`` (C, H, W), (C, L) or (F,), balanced over
    ``num_classes``, split 60/15/25 into train / calibration / eval. ``noise`` is the noise std
    relative to the prototypes' (1.0 keeps the task learnable but not trivial)."""
    shape = tuple(int(s) for s in shape)
    if not shape or min(shape) < 1 or len(shape) > 3:
        raise ValueError(f"shape must be 1 to 3 positive sizes per sample, got {list(shape)}")
    if num_classes < 2 or samples < 2 * num_classes or noise < 0:
        raise ValueError("need num_classes >= 2, samples >= 2 * num_classes and noise >= 0")
    g = torch.Generator().manual_seed(seed)
    protos = _prototypes(shape, num_classes, g)
    y = torch.arange(samples) % num_classes
    y = y[torch.randperm(samples, generator=g)]
    x = protos[y] + noise * torch.randn((samples, *shape), generator=g)
    train_idx, calib_idx, eval_idx = stratified_indices(y, FRACTIONS, seed)
    return Splits(
        train=TensorDataset(x[train_idx], y[train_idx]),
        calibration=TensorDataset(x[calib_idx], y[calib_idx]),
        eval=TensorDataset(x[eval_idx], y[eval_idx]),
        num_classes=num_classes,
    )


def _prototypes(shape: tuple[int, ...], k: int, g: torch.Generator) -> torch.Tensor:
    """``k`` unit-variance class prototypes; spatial ones are upsampled from a coarse grid."""
    if len(shape) == 1:
        return torch.randn((k, *shape), generator=g)
    coarse = [max(1, math.ceil(s / 4)) for s in shape[1:]]
    base = torch.randn((k, shape[0], *coarse), generator=g)
    mode = "linear" if len(shape) == 2 else "bilinear"
    up = F.interpolate(base, size=shape[1:], mode=mode, align_corners=False)
    return (up - up.mean()) / up.std()
