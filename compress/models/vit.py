"""A small Vision Transformer (Dosovitskiy et al. 2021): patch embedding, class token, learned
position embedding, pre-norm encoder blocks and a linear head on the class token."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from compress.core.errors import CompressError


class Attention(nn.Module):
    """Multi-head self-attention with separate ``q``/``k``/``v`` Linears and an output ``proj``.

    Heads are contiguous ``head_dim`` slices of the q/k/v outputs, so structured pruning removes a
    head by slicing those rows (and the matching ``proj`` columns). The head count used at forward
    time is read from the weights (``q.out_features // head_dim``), so a pruned module stays
    consistent; ``num_heads`` is kept in step for readers.
    """

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim ({dim}) must be divisible by heads ({heads})")
        self.num_heads = heads
        self.head_dim = dim // heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.softmax = nn.Softmax(dim=-1)
        self.proj = nn.Linear(dim, dim)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        b, n, _ = t.shape
        return t.reshape(b, n, -1, self.head_dim).transpose(1, 2)  # (b, heads, n, head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q = self._heads(self.q(x)) * self.head_dim**-0.5
        k = self._heads(self.k(x))
        v = self._heads(self.v(x))
        attn = self.softmax(q @ k.transpose(-2, -1))
        out = (attn @ v).transpose(1, 2).reshape(b, n, -1)
        return self.proj(out)


class NativeAttention(nn.Module):
    """torch's ``nn.MultiheadAttention`` as self-attention (for comparing against the fused op)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(dim, heads, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mha(x, x, x, need_weights=False)[0]


class Mlp(nn.Module):
    """Linear - GELU - Linear."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class EncoderBlock(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, dim: int, heads: int, mlp_hidden: int, attn: Literal["native", "mha"]) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn: nn.Module = Attention(dim, heads) if attn == "native" else NativeAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, mlp_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """Vision Transformer classifier for ``image_size`` x ``image_size`` inputs cut into ``patch`` tiles.

    ``attn="native"`` uses this package's attention (q/k/v Linears, ``@``), ``attn="mha"``
    torch's ``nn.MultiheadAttention``. The zoo builds it by name (``vit``).
    """

    def __init__(
        self,
        *,
        dim: int = 64,
        depth: int = 2,
        heads: int = 4,
        patch: int = 4,
        image_size: int = 8,
        mlp_ratio: float = 2.0,
        attn: Literal["native", "mha"] = "native",
        num_classes: int = 10,
        in_channels: int = 1,
    ) -> None:
        super().__init__()
        if min(dim, depth, heads, patch, image_size) < 1 or mlp_ratio <= 0:
            raise ValueError("dim, depth, heads, patch, image_size and mlp_ratio must be positive")
        if image_size % patch:
            raise ValueError(f"image_size ({image_size}) must be divisible by patch ({patch})")
        if attn not in ("native", "mha"):
            raise ValueError(f"attn must be 'native' or 'mha', got {attn!r}")
        self.image_size = image_size
        self.patch = patch
        num_patches = (image_size // patch) ** 2
        self.patch_embed = nn.Conv2d(in_channels, dim, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, dim))
        hidden = max(1, round(dim * mlp_ratio))
        self.blocks = nn.Sequential(*(EncoderBlock(dim, heads, hidden, attn) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape[-2:]) != (self.image_size, self.image_size):
            raise CompressError(
                f"this ViT was built for {self.image_size}x{self.image_size} inputs, got "
                f"{x.shape[-2]}x{x.shape[-1]}; build it with image_size={x.shape[-1]}"
            )
        x = self.patch_embed(x).flatten(2).transpose(1, 2)  # (b, patches, dim)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.blocks(x + self.pos_embed)
        return self.head(self.norm(x)[:, 0])

