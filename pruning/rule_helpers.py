"""What every rule of pruning's channel tracer shares: the face of the tracer a rule sees
(:class:`RuleTracer`), the rule signature, the label helpers that lay items along a dim, couple
and compare them, and the pending split of a factored channel dim.

Label tensors hold item ids per element (-1: none). Rule modules (``rules`` for ops without
parameters, ``rules_modules`` for conv/linear/norms, ``rules_attention`` for matmuls and
attention) import this module and never one another; the tracer (``trace``) imports them all
and owns the table of which rule runs for which op.

The pending split: a channel dim reshaped into factors, where what the code does next decides the unit.

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from compress.pruning.graph import IN, NORM, OUT, DependencyGraph
from torch import nn

from compress.core.errors import UnsupportedModelError


class RuleTracer(Protocol):
    """What a rule may read and call on the tracer running it (:class:`pruning.trace.Tracer`)."""

    graph: DependencyGraph
    #: tensor id -> the channel split it carries, while the unit is undecided
    pending: dict[int, PendingSplit]
    #: the modules whose forward is running, outermost first: (qualified name, module)
    stack: list[tuple[str, nn.Module]]

    def labels(self, t: torch.Tensor, *, bare: bool = True, buffers: bool = False) -> torch.Tensor | None: ...

    def set_labels(self, t: torch.Tensor, labels: torch.Tensor) -> None: ...

    def labels_or_blank(self, t: torch.Tensor) -> torch.Tensor: ...

    def is_param(self, t: Any) -> bool: ...

    def param_name(self, t: torch.Tensor | None) -> str | None: ...

    def where(self) -> str: ...

    def module_name(self) -> str: ...

    def unsupported(self, op: str, why: str = "") -> UnsupportedModelError: ...


#: a rule: (tracer, op name, the function, its args, its kwargs, its result); it labels the result
Rule = Callable[[RuleTracer, str, Callable[..., Any], tuple[Any, ...], dict[str, Any], Any], None]


# ---- labels along dims ---------------------------------------------------------------------


def arg(args: tuple[Any, ...], kwargs: dict[str, Any], i: int, name: str, default: Any = None) -> Any:
    """Argument ``i`` of a call, passed by position or as ``name``."""
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


def along(items: torch.Tensor, dim: int, shape: tuple[int, ...]) -> torch.Tensor:
    """1-D ``items`` laid along ``dim`` and broadcast to ``shape``."""
    dim = dim % len(shape)
    view = [1] * len(shape)
    view[dim] = items.numel()
    return items.view(view).expand(shape)


def couple(tr: RuleTracer, labels: torch.Tensor | None, dim: int, items: torch.Tensor) -> None:
    """Join item ``items[c]`` with every label at index ``c`` of ``dim``."""
    if labels is None:
        return
    if labels.shape[dim] != items.numel():
        raise tr.unsupported("couple", f"expected {items.numel()} channels on dim {dim}, got {labels.shape[dim]}")
    tr.graph.union_tensors(labels, along(items, dim, tuple(labels.shape)))


def varies(tr: RuleTracer, labels: torch.Tensor, dim: int) -> bool:
    """Whether labels (as sets) differ along ``dim``."""
    if labels.shape[dim] <= 1:
        return False
    r = tr.graph.roots(labels)
    return bool((r.amax(dim) != r.amin(dim)).any())


def const_along(labels: torch.Tensor, dims: tuple[int, ...], keepdim: bool = True) -> torch.Tensor:
    """Label per reduced slice when all ids along ``dims`` agree, else -1."""
    if not dims:
        return labels
    mx = labels.amax(dim=dims, keepdim=keepdim)
    mn = labels.amin(dim=dims, keepdim=keepdim)
    return torch.where(mx == mn, mx, torch.full_like(mx, -1))


def pin_if_shaped(tr: RuleTracer, res: torch.Tensor, const: torch.Tensor, op: str) -> None:
    """A constant operand whose shape spans varying channels would stop fitting after pruning."""
    if const.numel() <= 1:
        return
    pad = res.dim() - const.dim()
    for d in range(const.dim()):
        if const.shape[d] > 1 and varies(tr, res, d + pad):
            tr.graph.pin(res, f"'{op}' with a fixed-shape tensor {tr.where()}")
            return


def norm_items(tr: RuleTracer, tensors: list[Any], size: int, mod: str) -> torch.Tensor | None:
    """Join per-channel params/buffers (bias, BN statistics) into one item per channel."""
    first: torch.Tensor | None = None
    for t in tensors:
        name = tr.param_name(t) if isinstance(t, torch.Tensor) else None
        if name is None or t.dim() != 1 or t.numel() != size:
            continue
        items = tr.graph.item_labels(tr.graph.coord(name, 0, size, NORM, mod))
        if first is None:
            first = items
        else:
            tr.graph.union_tensors(first, items)
    return first


def linear_t(tr: RuleTracer, name: str, x: Any, w: torch.Tensor, b: Any, out: Any) -> None:
    """``x @ W`` / ``addmm(b, x, W)`` with a bare (in, out) weight: a Linear stored transposed
    (transformers' Conv1D in GPT-2)."""
    dense(tr, str(tr.param_name(w)), tuple(w.shape), x, b, out, out_axis=1)


def dense(tr: RuleTracer, wn: str, shape: tuple[int, ...], x: Any, b: Any, out: Any, *, out_axis: int) -> None:
    """A dense layer's channels: weight ``wn`` of 2-D ``shape`` has its outputs on ``out_axis`` (0 for
    ``nn.Linear``'s ``[out, in]``, 1 for a weight stored ``[in, out]``); the bias follows the outputs,
    the input's last dim couples to the weight's inputs."""
    mod = wn.rsplit(".", 1)[0]
    g = tr.graph
    nout, nin = shape[out_axis], shape[1 - out_axis]
    out_items = g.item_labels(g.coord(wn, out_axis, nout, OUT, mod))
    bias_items = norm_items(tr, [b], nout, mod)
    if bias_items is not None:
        g.union_tensors(out_items, bias_items)
    couple(tr, tr.labels(x), -1, g.item_labels(g.coord(wn, 1 - out_axis, nin, IN, mod)))
    tr.set_labels(out, along(out_items, -1, tuple(out.shape)))
    g.mac_records.append(("weight", int(out.numel() * nin), (wn,)))


# ---- a factored channel dim ----------------------------------------------------------------


@dataclass
class PendingSplit:
    """Labels of a factored channel dim, moved to ``(rest..., outer, mid, inner)``."""

    labels: torch.Tensor
    resolved: bool = False


def factor(tr: RuleTracer, lab_out: torch.Tensor, dout: list[int]) -> PendingSplit | None:
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


def resolve(tr: RuleTracer, p: PendingSplit, *, pieces: bool) -> None:
    if p.resolved:
        return
    p.resolved = True
    g = p.labels
    if pieces:
        tr.graph.union_tensors(g, g[..., :1, :].expand_as(g))  # same mid index in every piece
    else:
        tr.graph.union_tensors(g, g[..., :, :1].expand_as(g))  # each outer row whole


def outer_index(tr: RuleTracer, p: PendingSplit) -> dict[int, int]:
    """Root item -> its index along the outer factor (only roots that occur in one outer row)."""
    roots = tr.graph.roots(p.labels)
    moved = roots.movedim(-2, 0).reshape(roots.shape[-2], -1)
    seen: dict[int, int] = {}
    for i in range(moved.shape[0]):
        for r in torch.unique(moved[i]).tolist():
            if r >= 0:
                seen[r] = -1 if seen.get(r, i) != i else i
    return {r: i for r, i in seen.items() if i >= 0}


def splits_outer(tr: RuleTracer, p: PendingSplit, pieces: list[torch.Tensor]) -> bool:
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
