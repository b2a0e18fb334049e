"""scikit-learn's handwritten digits (1797 8x8 images, 10 classes) as a stratified train /
calibration / eval split, normalized with the train set's statistics."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from compress.data.bundle import Splits, stratified_indices

#: train / calibration / eval fractions of the 1797 images
FRACTIONS = (0.60, 0.15, 0.25)


def load_digits_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """All 1797 images as float (N, 1, 8, 8) in [0, 16] and their int64 labels."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(d.target, dtype=torch.long)
    return x, y


def digits(*, seed: int, image_size: int = 8, channels: int = 1) -> Splits:
    """The digits splits; ``image_size`` resizes (bilinear), ``channels`` repeats the gray channel."""
    if not isinstance(image_size, int) or image_size < 1:
        raise ValueError(f"image_size must be a positive int, got {image_size!r}")
    if not isinstance(channels, int) or channels < 1:
        raise ValueError(f"channels must be a positive int, got {channels!r}")
    x, y = load_digits_tensors()
    if image_size != x.shape[-1]:
        x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False)
    train_idx, calib_idx, eval_idx = stratified_indices(y, FRACTIONS, seed)
    train_x = x[train_idx]
    mean, std = train_x.mean(), train_x.std()
    x = ((x - mean) / std).repeat(1, channels, 1, 1).contiguous()
    return Splits(
        train=TensorDataset(x[train_idx], y[train_idx]),
        calibration=TensorDataset(x[calib_idx], y[calib_idx]),
        eval=TensorDataset(x[eval_idx], y[eval_idx]),
        num_classes=10,
    )
