"""A channel dim reshaped into factors, and what the code does next decides the unit.

``view(b, n, heads, head_dim)`` then attention: a head (a row of the first factor) is the unit.
``reshape(b, n, 3, heads, head_dim)`` then ``unbind(0)``/``qkv[0]``: q, k and v are pieces of the
first factor, and a head (row of the second) is the unit, the same head index in every piece.
``view(b, groups, c // groups, h, w).transpose(1, 2).reshape(b, c, h, w)`` (channel shuffle):
every group loses the same local indices, so that the shuffled order stays a valid interleave.

The choice is deferred: a split is *pending* while only layout ops touch it. Splitting away or
indexing its first factor, or merging it back regrouped, makes it "pieces" (tie across the first
factor); any other op, or the end of the trace, makes it "rows" (each row of the first factor
whole), which is always a valid unit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pruning.trace import Tracer


@dataclass
class PendingSplit:
    """Labels of a factored channel dim, moved to ``(rest..., outer, mid, inner)``."""

    labels: torch.Tensor
    resolved: bool = False


def factor(tr: Tracer, lab_out: torch.Tensor, dout: list[int]) -> PendingSplit | None:
    """Register a split of one channel dim into the output dims ``dout`` (2 or more, size > 1)."""
    rest = [d for d in range(lab_out.dim()) if d not in dout]
    moved = lab_out.permute(*rest, *dout)
    lead = moved.shape[: len(rest)]
    outer, mid = lab_out.shape[dout[0]], lab_out.shape[dout[1]]
    inner = math.prod(lab_out.shape[d] for d in dout[2:])
    grid = moved.reshape(*lead, outer, mid, inner)
    # the innermost factors stay whole whatever the unit is (the code's fixed head_dim)
    tr.graph.union_tensors(grid, grid[..., :1].expand_as(grid))
    return PendingSplit(grid[..., 0])


def resolve(tr: Tracer, p: PendingSplit, *, pieces: bool) -> None:
    if p.resolved:
        return
    p.resolved = True
    g = p.labels
    if pieces:
        tr.graph.union_tensors(g, g[..., :1, :].expand_as(g))  # same mid index in every piece
    else:
        tr.graph.union_tensors(g, g[..., :, :1].expand_as(g))  # each outer row whole


def outer_index(tr: Tracer, p: PendingSplit) -> dict[int, int]:
    """Root item -> its index along the outer factor (only roots that occur in one outer row)."""
    roots = tr.graph.roots(p.labels)
    moved = roots.movedim(-2, 0).reshape(roots.shape[-2], -1)
    seen: dict[int, int] = {}
    for i in range(moved.shape[0]):
        for r in torch.unique(moved[i]).tolist():
            if r >= 0:
                seen[r] = -1 if seen.get(r, i) != i else i
    return {r: i for r, i in seen.items() if i >= 0}


def splits_outer(tr: Tracer, p: PendingSplit, pieces: list[torch.Tensor]) -> bool:
    """Whether ``pieces`` (labels of a split/select's outputs) are whole rows of the outer factor."""
    index = outer_index(tr, p)
    got: list[int] = []
    for lab in pieces:
        r = torch.unique(tr.graph.roots(lab))
        idx = {index.get(int(x), -2) for x in r.tolist() if x >= 0}
        if len(idx) != 1 or -2 in idx:
            return False
        got.append(idx.pop())
    return len(set(got)) == len(got)
