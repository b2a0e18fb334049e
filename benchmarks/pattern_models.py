"""Two vision models written the way torchvision writes them, without torchvision (no CPU wheel here).

- :class:`WindowTransformer`: Swin-style windowed attention: ``F.pad`` to window multiples,
  ``torch.roll`` for shifted windows, window partition by ``view``/``permute``, a relative-position
  bias gathered from a table and added to the scores, a shift mask added on shifted blocks,
  residual adds around each window block, patch merging by strided slicing and ``torch.cat``.
- :class:`HardswishNet`: MobileNetV3-style inverted residuals with squeeze-excitation, Hardswish
  written as ``x * F.hardsigmoid(x)`` in some blocks and ``F.hardswish`` in others.

Both are written here only as users write them (torchvision's swin_transformer.py and
mobilenetv3.py); nothing in them is shaped to suit compress. Random weights, BatchNorm statistics
set by a few forward passes in train mode.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def _window_partition(x: torch.Tensor, ws: int) -> torch.Tensor:
    b, h, w, c = x.shape
    x = x.view(b, h // ws, ws, w // ws, ws, c)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, ws * ws, c)


def _window_reverse(x: torch.Tensor, ws: int, b: int, h: int, w: int) -> torch.Tensor:
    c = x.shape[-1]
    x = x.view(b, h // ws, w // ws, ws, ws, c)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, c)


class ShiftedWindowAttention(nn.Module):
    """torchvision's shifted_window_attention, as a module."""

    def __init__(self, dim: int, heads: int, window: int, shift: int) -> None:
        super().__init__()
        self.dim, self.heads, self.window, self.shift = dim, heads, window, shift
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.relative_position_bias_table = nn.Parameter(torch.randn((2 * window - 1) ** 2, heads) * 0.02)
        coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0).contiguous()
        rel[:, :, 0] += window - 1
        rel[:, :, 1] += window - 1
        rel[:, :, 0] *= 2 * window - 1
        self.register_buffer("relative_position_index", rel.sum(-1).flatten(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, c = x.shape
        ws = self.window
        pad_r, pad_b = (ws - w % ws) % ws, (ws - h % ws) % ws
        x = F.pad(x, (0, 0, 0, pad_r, 0, pad_b))
        _, ph, pw, _ = x.shape
        shift = 0 if ws >= ph and ws >= pw else self.shift
        if shift > 0:
            x = torch.roll(x, shifts=(-shift, -shift), dims=(1, 2))
        windows = _window_partition(x, ws)  # (B * nW, ws*ws, C)
        n = windows.shape[1]
        qkv = self.qkv(windows).reshape(windows.shape[0], n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        q = q * (c // self.heads) ** -0.5
        attn = q.matmul(k.transpose(-2, -1))
        index: torch.Tensor = self.relative_position_index  # type: ignore[assignment]
        bias = self.relative_position_bias_table[index]
        bias = bias.view(n, n, -1).permute(2, 0, 1).contiguous().unsqueeze(0)
        attn = attn + bias
        if shift > 0:
            mask = x.new_zeros((ph, pw))
            slices = ((0, -ws), (-ws, -shift), (-shift, None))
            count = 0
            for hs in slices:
                for wsl in slices:
                    mask[hs[0]:hs[1], wsl[0]:wsl[1]] = count
                    count += 1
            mask = mask.view(ph // ws, ws, pw // ws, ws).permute(0, 2, 1, 3).reshape(-1, n)
            mask = mask.unsqueeze(1) - mask.unsqueeze(2)
            mask = mask.masked_fill(mask != 0, -100.0).masked_fill(mask == 0, 0.0)
            attn = attn.view(windows.shape[0] // mask.shape[0], mask.shape[0], self.heads, n, n)
            attn = attn + mask.unsqueeze(1).unsqueeze(0)
            attn = attn.view(-1, self.heads, n, n)
        attn = F.softmax(attn, dim=-1)
        out = attn.matmul(v).transpose(1, 2).reshape(windows.shape[0], n, c)
        out = self.proj(out)
        out = _window_reverse(out, ws, b, ph, pw)
        if shift > 0:
            out = torch.roll(out, shifts=(shift, shift), dims=(1, 2))
        return out[:, :h, :w, :].contiguous()


class SwinBlock(nn.Module):
    def __init__(self, dim: int, heads: int, window: int, shift: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = ShiftedWindowAttention(dim, heads, window, shift)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, dim * 4), nn.GELU(), nn.Linear(dim * 4, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PatchMerging(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4 * dim)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[1], x.shape[2]
        x = F.pad(x, (0, 0, 0, w % 2, 0, h % 2))
        x0, x1 = x[..., 0::2, 0::2, :], x[..., 1::2, 0::2, :]
        x2, x3 = x[..., 0::2, 1::2, :], x[..., 1::2, 1::2, :]
        return self.reduction(self.norm(torch.cat([x0, x1, x2, x3], -1)))


class WindowTransformer(nn.Module):
    """A small Swin: patch embedding, stages of (regular, shifted) window blocks, patch merging."""

    def __init__(self, dim: int = 32, depths: tuple[int, ...] = (2, 2), heads: tuple[int, ...] = (2, 4),
                 window: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 4, 4)
        self.patch_norm = nn.LayerNorm(dim)
        stages: list[nn.Module] = []
        for i, (d, h) in enumerate(zip(depths, heads, strict=True)):
            blocks: list[nn.Module] = [SwinBlock(dim, h, window, 0 if j % 2 == 0 else window // 2) for j in range(d)]
            if i < len(depths) - 1:
                blocks.append(PatchMerging(dim))
                dim *= 2
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_norm(self.patch(x).permute(0, 2, 3, 1))
        x = self.norm(self.stages(x))
        return self.head(x.permute(0, 3, 1, 2).mean((2, 3)))


class HardSwishMul(nn.Module):
    """Hardswish as ``x * hardsigmoid(x)`` (how many hand-written MobileNetV3s spell it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * F.hardsigmoid(x)


class FHardswish(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.hardswish(x)


class SqueezeExcite(nn.Module):
    def __init__(self, ch: int, squeeze: int) -> None:
        super().__init__()
        self.fc1 = nn.Conv2d(ch, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, ch, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = F.adaptive_avg_pool2d(x, 1)
        s = F.hardsigmoid(self.fc2(F.relu(self.fc1(s))))
        return x * s


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, exp: int, cout: int, k: int, stride: int, se: bool, act: Callable[[], nn.Module]) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        if exp != cin:
            layers += [nn.Conv2d(cin, exp, 1, bias=False), nn.BatchNorm2d(exp), act()]
        layers += [nn.Conv2d(exp, exp, k, stride, k // 2, groups=exp, bias=False), nn.BatchNorm2d(exp), act()]
        if se:
            layers.append(SqueezeExcite(exp, max(8, exp // 4)))
        layers += [nn.Conv2d(exp, cout, 1, bias=False), nn.BatchNorm2d(cout)]
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        return x + y if self.residual else y


class HardswishNet(nn.Module):
    """A MobileNetV3-small-like net; Hardswish as ``x * hardsigmoid(x)`` or ``F.hardswish``."""

    #: (expansion, out channels, kernel, stride, squeeze-excite, hardswish)
    CONFIG = ((16, 16, 3, 2, True, False), (72, 24, 3, 2, False, False), (88, 24, 3, 1, False, False),
              (96, 40, 5, 2, True, True), (240, 40, 5, 1, True, True), (120, 48, 5, 1, True, True),
              (288, 96, 5, 2, True, True), (576, 96, 5, 1, True, True))

    def __init__(self, classes: int = 10, width: float = 1.0) -> None:
        super().__init__()

        def c(n: int) -> int:
            return max(8, int(n * width + 4) // 8 * 8)

        blocks: list[nn.Module] = [nn.Conv2d(3, c(16), 3, 2, 1, bias=False), nn.BatchNorm2d(c(16)), HardSwishMul()]
        cin = c(16)
        for i, (exp, out, k, s, se, hs) in enumerate(self.CONFIG):
            # both spellings appear, alternating between blocks
            act: Callable[[], nn.Module] = (HardSwishMul if i % 2 else FHardswish) if hs else nn.ReLU
            blocks.append(InvertedResidual(cin, c(exp), c(out), k, s, se, act))
            cin = c(out)
        blocks += [nn.Conv2d(cin, c(576), 1, bias=False), nn.BatchNorm2d(c(576)), HardSwishMul()]
        self.features = nn.Sequential(*blocks)
        self.classifier = nn.Sequential(nn.Linear(c(576), 256), HardSwishMul(), nn.Linear(256, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.adaptive_avg_pool2d(self.features(x), 1).flatten(1)
        return self.classifier(x)


@dataclass
class PatternModel:
    name: str
    model: nn.Module
    example: torch.Tensor
    calibration: list[torch.Tensor]
    kind: str = "vision"


def _bn_warm(model: nn.Module, batches: list[torch.Tensor]) -> None:
    model.train()
    with torch.no_grad():
        for x in batches:
            model(x)
    model.eval()


def _build(name: str, factory: Callable[[], nn.Module], size: int, seed: int, batch: int, n: int) -> PatternModel:
    torch.manual_seed(0)  # the same weights for every seed: ``seed`` draws other inputs
    model = factory()
    g = torch.Generator().manual_seed(seed)
    data = [torch.randn(batch, 3, size, size, generator=g) for _ in range(n)]
    _bn_warm(model, data)
    return PatternModel(name, model, data[0][:2], data)


def window_transformer(seed: int = 0, *, size: int = 56, batch: int = 4, n: int = 4, **kw: Any) -> PatternModel:
    """The Swin-style model on ``size`` x ``size`` images (56: 14x14 tokens, padded to window multiples)."""
    return _build("window_transformer", lambda: WindowTransformer(**kw), size, seed, batch, n)


def hardswish_net(seed: int = 0, *, size: int = 64, batch: int = 4, n: int = 4, **kw: Any) -> PatternModel:
    """The MobileNetV3-style model on ``size`` x ``size`` images."""
    return _build("hardswish_net", lambda: HardswishNet(**kw), size, seed, batch, n)


PATTERNS: dict[str, Callable[..., PatternModel]] = {"window_transformer": window_transformer,
                                                     "hardswish_net": hardswish_net}
