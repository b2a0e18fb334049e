"""Small models with the structures pruning must get right, and helpers to check a pruned model."""

from __future__ import annotations

import copy
import io
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from compress.pruning.api import PruneParams, Pruner
from compress.pruning.graph import ELEMENT, DependencyGraph
from torch import nn


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.b1 = nn.Sequential(nn.Conv2d(16, 24, 3, padding=1), nn.BatchNorm2d(24), nn.ReLU(), nn.Conv2d(24, 16, 3, padding=1), nn.BatchNorm2d(16))
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = F.relu(x + self.b1(x))
        return self.head(x.mean((2, 3)))


class ConcatNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.b = nn.Conv2d(3, 12, 1)
        self.bn = nn.BatchNorm2d(20)
        self.c = nn.Conv2d(20, 16, 3, padding=1)
        self.head = nn.Linear(16 * 4 * 4, 5)  # flatten into Linear: channel x spatial

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(torch.cat([self.a(x), self.b(x)], 1)))
        x = F.max_pool2d(F.relu(self.c(x)), 2)
        return self.head(torch.flatten(x, 1))


class ChunkNet(nn.Module):
    """chunk into a gate (GLU-like) and a torch.split into two branches of equal size."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(10, 32)
        self.b = nn.Linear(16, 24)
        self.c1 = nn.Linear(12, 6)
        self.c2 = nn.Linear(12, 6)
        self.head = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u, g = self.a(x).chunk(2, dim=-1)
        h = F.relu(self.b(u * torch.sigmoid(g)))
        p, q = torch.split(h, 12, dim=-1)
        return self.head(torch.cat([self.c1(p), self.c2(q)], dim=-1))


class GroupedNet(nn.Module):
    """Grouped conv (4 groups), depthwise conv with channel multiplier 2, GroupNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 16, 3, padding=1)
        self.gn = nn.GroupNorm(4, 16)
        self.grouped = nn.Conv2d(16, 32, 3, padding=1, groups=4)
        self.bn = nn.BatchNorm2d(32)
        self.dw = nn.Conv2d(32, 64, 3, padding=1, groups=32)
        self.pw = nn.Conv2d(64, 24, 1)
        self.head = nn.Linear(24, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.gn(self.c1(x)))
        x = F.relu(self.bn(self.grouped(x)))
        x = F.relu(self.pw(F.relu(self.dw(x))))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


class HeadAttention(nn.Module):
    """q/k/v Linears, heads by view(-1, head_dim), ``@`` matmuls; a fixed hidden size."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.num_heads, self.head_dim = heads, dim // heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, n, -1, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        attn = torch.softmax((q @ k.transpose(-2, -1)) * self.head_dim**-0.5, dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, -1))


class AttnNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.attn = HeadAttention()
        self.sdpa_q, self.sdpa_kv = nn.Linear(32, 24), nn.Linear(32, 48)
        self.out = nn.Linear(32 + 24, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        y = self.attn(x) + x  # residual keeps the hidden size coupled to the embedding
        q = self.sdpa_q(y).view(*y.shape[:2], 3, 8).transpose(1, 2)
        k, v = self.sdpa_kv(y).view(*y.shape[:2], 3, 16).transpose(1, 2).chunk(2, dim=-1)
        z = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        return self.out(torch.cat([y, z], dim=-1)).mean(1)


class SharedNet(nn.Module):
    """One conv applied twice (shared weights), then an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Conv2d(3, 12, 3, padding=1)
        self.shared = nn.Conv2d(12, 12, 3, padding=1)
        self.fc = nn.Linear(12, 20)
        self.head = nn.Linear(20, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.inp(x))
        x = F.relu(self.shared(x))
        x = F.relu(self.shared(x))
        return self.head(F.relu(self.fc(x.amax((2, 3)))))


class ChannelsLast(nn.Module):
    """ConvNeXt-style: depthwise conv, permute to channels-last, Linear MLP, permute back, residual."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.dw = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.fc1, self.fc2 = nn.Linear(16, 48), nn.Linear(48, 16)
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        y = self.dw(x).permute(0, 2, 3, 1)
        y = self.fc2(F.gelu(self.fc1(y))).permute(0, 3, 1, 2)
        return self.head((x + y).mean((2, 3)))


class MhaNet(nn.Module):
    """nn.MultiheadAttention (batch first) in a residual, no LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(40, 32)
        self.mha = nn.MultiheadAttention(32, 4, batch_first=True)
        self.head = nn.Linear(32, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        return self.head(x + self.mha(x, x, x)[0]).mean(1)


class Tricky(nn.Module):
    """All blocks together (one ONNX export covers them)."""

    def __init__(self) -> None:
        super().__init__()
        self.res, self.cat, self.grouped, self.shared = Residual(), ConcatNet(), GroupedNet(), SharedNet()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.res(x) + self.cat(x) + self.grouped(x) + self.shared(x)


IMAGE = (2, 3, 8, 8)
BLOCKS: dict[str, tuple[type[nn.Module], Any]] = {
    "residual": (Residual, lambda: torch.randn(IMAGE)),
    "concat_flatten": (ConcatNet, lambda: torch.randn(IMAGE)),
    "chunk_split": (ChunkNet, lambda: torch.randn(3, 10)),
    "grouped_depthwise": (GroupedNet, lambda: torch.randn(IMAGE)),
    "attention": (AttnNet, lambda: torch.randint(0, 50, (2, 6))),
    "shared": (SharedNet, lambda: torch.randn(IMAGE)),
    "channels_last": (ChannelsLast, lambda: torch.randn(IMAGE)),
    "mha": (MhaNet, lambda: torch.randint(0, 40, (2, 7))),
}


def zeroed_copy(model: nn.Module, graph: DependencyGraph, keep: np.ndarray) -> nn.Module:
    """A copy of the unpruned model with every index of every removed atom set to zero."""
    z = copy.deepcopy(model)
    tensors = {**dict(z.named_parameters(remove_duplicate=False)), **dict(z.named_buffers(remove_duplicate=False))}
    with torch.no_grad():
        for c in graph.coords:
            t = tensors.get(c.key)
            drop = ~keep[graph.coord_atoms(c)]
            if t is None or not drop.any() or not t.is_floating_point():
                continue
            if c.axis is not None:
                t.index_fill_(c.axis, torch.as_tensor(np.nonzero(drop)[0]), 0.0)
            elif ELEMENT in c.roles:
                t.view(-1)[torch.as_tensor(np.nonzero(drop)[0])] = 0.0
    return z.eval()


def prune_with_graph(model: nn.Module, x: Any, ratio: float, *, params: PruneParams | None = None,
                     ) -> tuple[DependencyGraph, np.ndarray, Any]:
    """Prune in place through the Pruner steps; returns the graph, the keep flags and the slices."""
    pruner = Pruner(params)
    graph = pruner.trace(model, x)
    keep = pruner.select(model, graph, ratio=ratio, budget=None)
    slices = pruner.cut(model, graph, keep, x)
    return graph, keep, slices


def run(model: nn.Module, x: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(x) if not isinstance(x, dict) else model(**x)


def onnx_outputs(model: nn.Module, x: torch.Tensor) -> np.ndarray:
    """Export with the dynamo exporter and run the file in ONNX Runtime."""
    import onnxruntime as ort

    prog = torch.onnx.export(model.eval(), (x,), dynamo=True, external_data=False, verbose=False)
    assert prog is not None
    buf = io.BytesIO()
    prog.save(buf)
    sess = ort.InferenceSession(buf.getvalue(), providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
