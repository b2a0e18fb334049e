"""General rules found on model families from outside the project, each on a minimal module that
reproduces the pattern: width attributes a forward reshapes with, fused qkv split into q/k/v
then heads, indexed per-head bias tables, einsum, channels-last padding, channel shuffle."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from compress.pruning.plan import PruningPlan
from pruning_blocks import prune_with_graph, run, zeroed_copy
from torch import nn


class FusedBlock(nn.Module):
    """timm/torchvision attention: one qkv Linear, reshape(B, N, 3, heads, head_dim), unbind(0)."""

    def __init__(self, d: int, heads: int, index: bool = False) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.index = heads, d // heads, index
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = (qkv[0], qkv[1], qkv[2]) if self.index else qkv.unbind(0)
        a = torch.softmax(q @ k.transpose(-2, -1) * self.head_dim**-0.5, dim=-1) @ v
        x = x + self.proj(a.transpose(1, 2).reshape(b, n, -1))
        return x + self.fc2(F.gelu(self.fc1(x)))


class PatchViT(nn.Module):
    """torchvision's ViT input: ``conv(x).reshape(n, self.hidden_dim, -1)``; no LayerNorm, so the
    pruned model is exactly the original with the removed channels zeroed."""

    def __init__(self, d: int = 48, heads: int = 6, index: bool = False) -> None:
        super().__init__()
        self.hidden_dim = d
        self.conv_proj = nn.Conv2d(3, d, 4, 4)
        self.cls = nn.Parameter(torch.randn(1, 1, d))
        self.blocks = nn.Sequential(FusedBlock(d, heads, index), FusedBlock(d, heads, index))
        self.head = nn.Linear(d, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        x = self.conv_proj(x).reshape(n, self.hidden_dim, -1).permute(0, 2, 1)
        x = torch.cat([self.cls.expand(n, -1, -1), x], 1)
        return self.head(self.blocks(x)[:, 0])


def _check_exact(model: nn.Module, x: torch.Tensor, ratio: float = 0.5) -> tuple[nn.Module, dict]:
    reference = copy.deepcopy(model)
    graph, keep, slices = prune_with_graph(model, x, ratio)
    torch.testing.assert_close(run(model, x), run(zeroed_copy(reference, graph, keep), x), atol=1e-5, rtol=1e-4)
    return reference, slices


def test_width_attribute_and_fused_qkv_heads() -> None:
    for index in (False, True):
        model = PatchViT(index=index).eval()
        x = torch.randn(2, 3, 16, 16)
        fresh, slices = _check_exact(model, x)
        assert model.hidden_dim == 24 and model.conv_proj.out_channels == 24
        for blk in model.blocks:
            # heads are the unit, the same head index in q, k and v: 6 -> 3 heads of 8
            assert blk.num_heads == 3 and blk.head_dim == 8 and blk.qkv.out_features == 72
        # the plan carries the attribute values too: a replay on a fresh model runs
        PruningPlan.from_dict({**PruningPlan(steps=[slices]).to_dict()}).apply(fresh)
        fresh.load_state_dict(model.state_dict(), strict=True)
        torch.testing.assert_close(run(fresh, x), run(model, x), atol=0, rtol=0)


class WindowAttention(nn.Module):
    """Swin-style block on channels-last (B, H, W, C): pad of the last three dims, window partition,
    a per-head relative-position bias table indexed by a buffer, added to the scores."""

    def __init__(self, d: int = 24, heads: int = 4, window: int = 3) -> None:
        super().__init__()
        self.heads, self.window = heads, window
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.table = nn.Parameter(torch.randn((2 * window - 1) ** 2, heads))
        coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + window - 1
        self.register_buffer("index", rel[..., 0] * (2 * window - 1) + rel[..., 1], persistent=False)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, c = x.shape
        ws = self.window
        pad_b, pad_r = (ws - h % ws) % ws, (ws - w % ws) % ws
        y = F.pad(x, (0, 0, 0, pad_r, 0, pad_b))
        hp, wp = y.shape[1], y.shape[2]
        win = y.view(b, hp // ws, ws, wp // ws, ws, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, ws * ws, c)
        n = win.shape[1]
        q, k, v = self.qkv(win).reshape(-1, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        bias = self.table[self.index.view(-1)].view(n, n, -1).permute(2, 0, 1)
        attn = torch.softmax(q @ k.transpose(-2, -1) + bias.unsqueeze(0), dim=-1)
        out = self.proj((attn @ v).transpose(1, 2).reshape(-1, n, c))
        out = out.view(b, hp // ws, wp // ws, ws, ws, c).permute(0, 1, 3, 2, 4, 5).reshape(b, hp, wp, c)
        x = x + out[:, :h, :w, :].contiguous()
        return x + self.fc2(F.gelu(self.fc1(x)))


class WindowNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 24, 2, 2)
        self.blocks = nn.Sequential(WindowAttention(), WindowAttention())
        self.head = nn.Linear(24, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.blocks(self.stem(x).permute(0, 2, 3, 1))
        return self.head(y.mean((1, 2)))


def test_channels_last_window_attention_prunes_stage_width_and_heads() -> None:
    model = WindowNet().eval()
    x = torch.randn(2, 3, 16, 16)  # 8x8 tokens, window 3: padded to 9x9
    _check_exact(model, x)
    assert model.stem.out_channels == 12  # the stage width: padding the spatial dims pins no channel
    for blk in model.blocks:
        # 4 -> 2 heads: the bias table keeps the columns of the kept heads
        assert blk.heads == 2 and blk.qkv.out_features == 3 * 12 and blk.table.shape == (25, 2)


class BiasedSdpa(nn.Module):
    """T5's relative position bias: an embedding of buckets per head, passed to SDPA as attn_mask."""

    def __init__(self, d: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.bias = nn.Embedding(8, heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (f(x).view(b, n, -1, 4).transpose(1, 2) for f in (self.q, self.k, self.v))
        pos = torch.arange(n)
        bucket = (pos[None, :] - pos[:, None]).clamp(-4, 3) + 4
        mask = self.bias(bucket).permute(2, 0, 1).unsqueeze(0)
        return x + self.o(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, n, -1))


def test_sdpa_bias_mask_follows_heads() -> None:
    model = BiasedSdpa().eval()
    _check_exact(model, torch.randn(2, 6, 16))
    assert model.q.out_features == 8 and model.bias.embedding_dim == 2


class EinsumAttention(nn.Module):
    """Attention written with einsum: heads from a view, scores and context by einsum, a summed
    letter (``...c,...c->...``) and an implicit output."""

    def __init__(self, d: int = 24, heads: int = 4) -> None:
        super().__init__()
        self.hd = d // heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.gate = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (f(x).view(b, n, -1, self.hd) for f in (self.q, self.k, self.v))
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * self.hd**-0.5
        ctx = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, -1), v).reshape(b, n, -1)
        g = torch.einsum("...c,...c->...", self.gate(x), x).unsqueeze(-1)  # one scalar per token
        return x + self.o(ctx) * torch.sigmoid(g)


def test_einsum_attention_prunes_heads() -> None:
    model = EinsumAttention().eval()
    _check_exact(model, torch.randn(2, 5, 24))
    assert model.q.out_features == 12 and model.o.in_features == 12


def _shuffle(x: torch.Tensor, groups: int) -> torch.Tensor:
    b, c, h, w = x.shape
    return x.view(b, groups, c // groups, h, w).transpose(1, 2).contiguous().view(b, c, h, w)


class ShuffleUnit(nn.Module):
    """ShuffleNetV2's stride-1 unit: chunk in two, one branch convolved, concat, channel shuffle."""

    def __init__(self, c: int) -> None:
        super().__init__()
        h = c // 2
        self.branch = nn.Sequential(
            nn.Conv2d(h, h, 1), nn.BatchNorm2d(h), nn.ReLU(),
            nn.Conv2d(h, h, 3, padding=1, groups=h), nn.BatchNorm2d(h),
            nn.Conv2d(h, h, 1), nn.BatchNorm2d(h), nn.ReLU(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = x.chunk(2, dim=1)
        return _shuffle(torch.cat([a, self.branch(b)], 1), 2)


class ShuffleNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.units = nn.Sequential(ShuffleUnit(16), ShuffleUnit(16))
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.units(self.stem(x)).mean((2, 3)))


def test_channel_shuffle_ties_local_indices_across_groups() -> None:
    model = ShuffleNet().eval()
    x = torch.randn(2, 3, 8, 8)
    from compress.pruning.api import Pruner

    graph = Pruner().trace(model, x)
    sizes = sorted(len(g.atoms) for g in graph.prunable_groups())
    # the shuffled stream is not one unit per branch: each unit is one local index of both groups
    assert max(sizes) >= 4, sizes
    _check_exact(model, x)
    assert model.stem[0].out_channels < 16 and model.stem[0].out_channels % 2 == 0
    for unit in model.units:
        assert all(m.weight.shape[0] > 0 for m in unit.branch if isinstance(m, nn.Conv2d))


class GroupedBottleneck(nn.Module):
    """RegNet/ResNeXt bottleneck: 1x1, grouped 3x3 (4 groups of 4), 1x1, residual."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.a = nn.Sequential(nn.Conv2d(8, 16, 1), nn.BatchNorm2d(16), nn.ReLU())
        self.b = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1, groups=4), nn.BatchNorm2d(16), nn.ReLU())
        self.c = nn.Conv2d(16, 8, 1)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        return self.head((y + self.c(self.b(self.a(y)))).mean((2, 3)))


def test_grouped_conv_width_mode_keeps_groups() -> None:
    from compress.pruning.api import PruneParams

    x = torch.randn(2, 3, 8, 8)
    whole = GroupedBottleneck().eval()
    prune_with_graph(whole, x, 0.5)
    assert whole.b[0].groups == 2 and whole.b[0].weight.shape == (8, 4, 3, 3)  # default: 2 of 4 groups go
    model = GroupedBottleneck().eval()
    reference = copy.deepcopy(model)
    graph, keep, slices = prune_with_graph(model, x, 0.5, params=PruneParams(grouped_conv="width"))
    conv = model.b[0]
    assert conv.groups == 4 and conv.weight.shape == (8, 2, 3, 3) and conv.in_channels == 8
    torch.testing.assert_close(run(model, x), run(zeroed_copy(reference, graph, keep), x), atol=1e-5, rtol=1e-4)
    fresh = GroupedBottleneck().eval()
    PruningPlan.from_dict(PruningPlan(steps=[slices]).to_dict()).apply(fresh)
    fresh.load_state_dict(model.state_dict(), strict=True)
    torch.testing.assert_close(run(fresh, x), run(model, x), atol=0, rtol=0)
