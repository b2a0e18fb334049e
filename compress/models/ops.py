"""Tiny modules for the tensor ops that sit between layers (residual adds, concats, attention matmuls).

As modules rather than ``+`` / ``torch.cat`` / ``@`` they are visible to module-swap quantization
(a quantized Add owns its input and output quantizers) and to pruning's graph tracing.
"""

from __future__ import annotations

import torch
from torch import nn


class Add(nn.Module):
    """``a + b`` (a residual connection)."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b


class Concat(nn.Module):
    """``torch.cat(tensors, dim)``."""

    def __init__(self, dim: int = 1) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        return torch.cat(tensors, dim=self.dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class MatMul(nn.Module):
    """``a @ b`` (attention scores and attention-weighted values)."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.matmul(a, b)
