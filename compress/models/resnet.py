"""CIFAR-style ResNet (He et al. 2016, section 4.2) with basic blocks, sized for small images."""

from __future__ import annotations

import torch
from torch import nn


class BasicBlock(nn.Module):
    """conv3x3-bn-relu-conv3x3-bn, plus a shortcut (1x1 conv + bn when the shape changes), then relu."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )
        else:
            self.shortcut = nn.Identity()
        self.relu2 = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu2(out + self.shortcut(x))


class ResNet(nn.Module):
    """Stem conv, three stages of ``depth`` basic blocks (``width``, 2x, 4x channels; stride 2 in
    stages 2 and 3), global average pooling and a linear classifier. Works on any input >= 4x4."""

    def __init__(
        self, *, width: int = 16, depth: int = 1, num_classes: int = 10, in_channels: int = 1
    ) -> None:
        super().__init__()
        if min(width, depth, num_classes, in_channels) < 1:
            raise ValueError("width, depth, num_classes and in_channels must be positive")
        widths = (width, 2 * width, 4 * width)
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
        )
        stages: list[nn.Module] = []
        c_in = width
        for i, c_out in enumerate(widths):
            blocks: list[nn.Module] = []
            for j in range(depth):
                stride = 2 if i > 0 and j == 0 else 1
                blocks.append(BasicBlock(c_in, c_out, stride))
                c_in = c_out
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3 = stages
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten(1)
        self.fc = nn.Linear(c_in, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(self.flatten(self.pool(x)))


def resnet(*, width: int = 16, depth: int = 1, num_classes: int = 10, in_channels: int = 1) -> ResNet:
    """CIFAR-style ResNet; ``width=16, depth=3`` is ResNet-20, ``width=64`` gives 64/128/256 channels."""
    return ResNet(width=width, depth=depth, num_classes=num_classes, in_channels=in_channels)
