"""MobileNetV2 (Sandler et al. 2018) with inverted residual blocks, adapted to small images
(stride-1 stem, as in the CIFAR variants)."""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import nn

# (expansion t, output channels c, repeats n, first stride s), as in table 2 of the paper
STANDARD: tuple[tuple[int, int, int, int], ...] = (
    (1, 16, 1, 1),
    (6, 24, 2, 1),  # stride 1 here (2 in the paper): small inputs
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)
# a shorter variant for CPU tests: same block types, a quarter of the blocks
COMPACT: tuple[tuple[int, int, int, int], ...] = (
    (1, 16, 1, 1),
    (6, 24, 2, 1),
    (6, 32, 2, 2),
    (6, 64, 2, 2),
    (6, 96, 1, 1),
)
CONFIGS = {"standard": (STANDARD, 1280), "compact": (COMPACT, 256)}


def make_divisible(value: float, divisor: int = 8) -> int:
    """Round channels to a multiple of ``divisor`` without dropping more than 10% (the paper's rule)."""
    out = max(divisor, int(value + divisor / 2) // divisor * divisor)
    if out < 0.9 * value:
        out += divisor
    return out


def conv_bn_relu6(c_in: int, c_out: int, kernel: int, stride: int = 1, groups: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=kernel // 2, groups=groups, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU6(inplace=True),
    )


class InvertedResidual(nn.Module):
    """Expand (1x1) - depthwise (3x3) - linear project (1x1); a residual add when the shape is kept."""

    def __init__(self, c_in: int, c_out: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = c_in * expand
        layers: list[nn.Module] = []
        if expand != 1:
            layers.append(conv_bn_relu6(c_in, hidden, 1))
        layers.append(conv_bn_relu6(hidden, hidden, 3, stride=stride, groups=hidden))
        layers += [nn.Conv2d(hidden, c_out, 1, bias=False), nn.BatchNorm2d(c_out)]
        self.conv = nn.Sequential(*layers)
        self.use_residual = stride == 1 and c_in == c_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv(x)
        return out + x if self.use_residual else out


class MobileNetV2(nn.Module):
    """Stem conv, inverted residual stages, 1x1 head conv, global pooling, dropout and a classifier.

    ``config="standard"`` is the paper's block table, ``"compact"`` a short one for tests. The zoo
    builds it by name (``mobilenetv2``).
    """

    def __init__(
        self,
        *,
        width_mult: float = 1.0,
        depth_mult: float = 1.0,
        config: Literal["compact", "standard"] = "compact",
        num_classes: int = 10,
        in_channels: int = 1,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if config not in CONFIGS:
            raise ValueError(f"config must be one of {sorted(CONFIGS)}, got {config!r}")
        if width_mult <= 0 or depth_mult <= 0:
            raise ValueError("width_mult and depth_mult must be > 0")
        if not 0 <= dropout < 1:
            raise ValueError("dropout must be in [0, 1)")
        table, last = CONFIGS[config]
        c_in = make_divisible(32 * width_mult)
        layers: list[nn.Module] = [conv_bn_relu6(in_channels, c_in, 3)]
        for t, c, n, s in table:
            c_out = make_divisible(c * width_mult)
            for i in range(max(1, math.ceil(n * depth_mult))):
                layers.append(InvertedResidual(c_in, c_out, s if i == 0 else 1, t))
                c_in = c_out
        self.last_channels = make_divisible(last * max(1.0, width_mult))
        layers.append(conv_bn_relu6(c_in, self.last_channels, 1))
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten(1)
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(self.last_channels, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.flatten(self.pool(self.features(x)))
        return self.classifier(self.dropout(x))

