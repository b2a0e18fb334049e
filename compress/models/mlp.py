"""A multilayer perceptron classifier: Flatten, then Linear-ReLU layers, then a Linear head."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn


class MLP(nn.Module):
    """``Flatten -> [Linear -> ReLU] * len(hidden) -> Linear``."""

    def __init__(
        self, in_features: int, hidden: Sequence[int], num_classes: int, dropout: float = 0.0
    ) -> None:
        super().__init__()
        self.flatten = nn.Flatten(1)
        layers: list[nn.Module] = []
        c_in = in_features
        for h in hidden:
            layers += [nn.Linear(c_in, h), nn.ReLU(inplace=True)]
            if dropout:
                layers.append(nn.Dropout(dropout))
            c_in = h
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(c_in, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.flatten(x)))


def mlp(
    *,
    hidden: int | Sequence[int] = 128,
    depth: int = 2,
    in_features: int | None = None,
    input_shape: Sequence[int] | None = None,
    image_size: int = 8,
    in_channels: int = 1,
    num_classes: int = 10,
    dropout: float = 0.0,
) -> MLP:
    """An MLP. ``hidden`` is a list of layer widths, or one width repeated ``depth`` times. The input
    size is ``in_features``, else the product of ``input_shape`` (per sample), else
    ``in_channels * image_size**2``."""
    widths = [hidden] * depth if isinstance(hidden, int) else list(hidden)
    if any(not isinstance(w, int) or w < 1 for w in widths) or depth < 0:
        raise ValueError(f"hidden must be positive ints and depth >= 0, got hidden={hidden!r}, depth={depth}")
    if not 0 <= dropout < 1:
        raise ValueError("dropout must be in [0, 1)")
    if in_features is None:
        in_features = math.prod(input_shape) if input_shape is not None else in_channels * image_size**2
    if in_features < 1:
        raise ValueError(f"in_features must be positive, got {in_features}")
    return MLP(in_features, widths, num_classes, dropout)
