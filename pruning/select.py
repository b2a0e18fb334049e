"""Which atoms to remove: per-group (local) or one global threshold, per-layer overrides, a cap,
``round_to``, and parameter/MAC targets met by searching the ratio with an exact cost model."""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from compress.pruning.graph import ELEMENT, OUT, DependencyGraph, Group
from torch import nn


def _matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], name) is not None
    return fnmatch.fnmatchcase(name, pattern)


@dataclass(frozen=True)
class SelectionRules:
    """How many atoms each group may lose. ``eligible`` names the modules whose groups are pruned."""

    mode: str = "local"
    max_ratio: float = 0.9
    round_to: int = 1
    overrides: tuple[tuple[str, float], ...] = ()
    eligible: frozenset[str] | None = None


def eligible_groups(graph: DependencyGraph, rules: SelectionRules) -> list[Group]:
    groups = graph.prunable_groups()
    if rules.eligible is None:
        return groups
    return [g for g in groups if any(m in rules.eligible for m in g.modules)]


def _group_ratio(g: Group, ratio: float, rules: SelectionRules) -> float:
    for pattern, r in rules.overrides:
        if any(_matches(pattern, m) for m in g.modules):
            return r
    return ratio


def _round_kept(kept: int, n: int, rules: SelectionRules, width: int) -> int:
    if rules.round_to > 1 and width == 1 and n >= rules.round_to:
        # nearest multiple, halves up (Python's round() would send 1.5 and 2.5 both to 2)
        kept = max(rules.round_to, math.floor(kept / rules.round_to + 0.5) * rules.round_to)
    return min(max(kept, 1), n)


def choose(
    graph: DependencyGraph,
    scores: np.ndarray,
    ratio: float,
    rules: SelectionRules,
    *,
    base_sizes: Mapping[int, int] | None = None,
) -> np.ndarray:
    """Keep flag per atom for removing ``ratio`` of the channels of each eligible group (local) or
    of all eligible groups together (global), lowest scores first.

    ``base_sizes`` (group index -> its size before an iterative schedule began) makes a local
    ratio cumulative: a group keeps ``n0 - floor(ratio * n0)`` of its original ``n0`` atoms, so
    rounding does not compound over steps.
    """
    base_sizes = base_sizes or {}
    keep = np.ones(len(graph.atoms), dtype=bool)
    groups = eligible_groups(graph, rules)
    if rules.mode == "global":
        budget: dict[int, int] = _global_budget(graph, scores, ratio, groups, rules)
    else:
        budget = {}
        for g in groups:
            r = min(_group_ratio(g, ratio, rules), rules.max_ratio)
            n0 = base_sizes.get(g.index, len(g.atoms))
            budget[g.index] = max(0, len(g.atoms) - (n0 - math.floor(r * n0 + 1e-9)))
    for g in groups:
        n = len(g.atoms)
        n0 = base_sizes.get(g.index, n)
        width = g.width(graph)
        n_remove = budget.get(g.index, 0)
        kept = _round_kept(n - n_remove, n, rules, width)
        kept = max(kept, n0 - math.floor(rules.max_ratio * n0 + 1e-9), 1)
        prunable = [a for a in g.atoms if graph.atoms[a].prunable]
        n_remove = min(n - kept, len(prunable))
        if n_remove <= 0:
            continue
        order = sorted(prunable, key=lambda a: (scores[a], a))
        keep[np.asarray(order[:n_remove])] = False
    _keep_every_layer(graph, scores, keep, rules)
    return keep


def _keep_every_layer(graph: DependencyGraph, scores: np.ndarray, keep: np.ndarray, rules: SelectionRules) -> None:
    """No producing tensor may lose all its outputs (a weight of shape [0, ...]): when a unit spans a
    whole layer's output (a shuffled branch, a tiny layer), its best ``round_to`` units stay."""
    for c in graph.coords:
        if OUT not in c.roles or c.axis is None:
            continue
        atoms = np.unique(graph.coord_atoms(c))
        if keep[atoms].any():
            continue
        best = sorted(atoms.tolist(), key=lambda a: (-scores[a], a))[: max(1, rules.round_to)]
        keep[np.asarray(best)] = True


def _global_budget(
    graph: DependencyGraph, scores: np.ndarray, ratio: float, groups: list[Group], rules: SelectionRules
) -> dict[int, int]:
    widths = {g.index: g.width(graph) for g in groups}
    total = sum(len(g.atoms) * widths[g.index] for g in groups)
    target = ratio * total
    cap = {g.index: math.floor(rules.max_ratio * len(g.atoms) + 1e-9) for g in groups}
    cand = sorted(
        ((scores[a], a, g.index) for g in groups for a in g.atoms if graph.atoms[a].prunable),
        key=lambda t: (t[0], t[1]),
    )
    removed = 0.0
    budget = dict.fromkeys(cap, 0)
    for _, _, gi in cand:
        if removed >= target - 1e-9:
            break
        if budget[gi] >= cap[gi]:
            continue
        budget[gi] += 1
        removed += widths[gi]
    return budget


class CostModel:
    """Exact parameter and MAC counts of the model that a keep-vector would produce."""

    def __init__(self, graph: DependencyGraph, model: nn.Module) -> None:
        self.graph = graph
        self.base_params = 0
        self._params: list[tuple[tuple[int, ...], list[tuple[int, np.ndarray]], np.ndarray | None]] = []
        by_key: dict[str, list[tuple[int, np.ndarray]]] = {}
        elems: dict[str, np.ndarray] = {}
        for c in graph.coords:
            if c.axis is not None:
                by_key.setdefault(c.key, []).append((c.axis, graph.coord_atoms(c)))
            elif ELEMENT in c.roles:
                elems[c.key] = graph.coord_atoms(c)
        self._axes: dict[str, list[tuple[int, np.ndarray]]] = by_key
        seen: set[int] = set()
        for name, p in model.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            if name in by_key or name in elems:
                self._params.append((tuple(p.shape), by_key.get(name, []), elems.get(name)))
            else:
                self.base_params += p.numel()
        self._macs: list[tuple[int, list[tuple[int, np.ndarray]] | None, tuple[torch.Tensor, torch.Tensor] | None]] = []
        for kind, macs, payload in graph.mac_records:
            if kind == "weight":
                self._macs.append((macs, [(a, at) for a, at in by_key.get(str(payload[0]), [])], None))
            elif kind == "axis":
                key, axis = str(payload[0]), int(payload[1])  # type: ignore[call-overload]
                self._macs.append((macs, [(a, at) for a, at in by_key.get(key, []) if a == axis], None))
            else:
                a_lab, b_lab = payload
                assert isinstance(a_lab, torch.Tensor) and isinstance(b_lab, torch.Tensor)
                self._macs.append((macs, None, (graph.label_atoms(a_lab), graph.label_atoms(b_lab))))

    def params(self, keep: np.ndarray) -> int:
        total = self.base_params
        for shape, axes, elem in self._params:
            if elem is not None:
                total += int(keep[elem].sum())
                continue
            sizes = list(shape)
            for axis, atoms in axes:
                sizes[axis] = int(keep[atoms].sum())
            total += math.prod(sizes)
        return total

    def macs(self, keep: np.ndarray) -> int:
        total = 0.0
        keep_t = torch.from_numpy(np.append(keep, True).astype(np.float64))  # index -1 -> kept
        for macs, axes, mats in self._macs:
            if mats is None:
                frac = 1.0
                for _, atoms in axes or []:
                    frac *= float(keep[atoms].mean()) if len(atoms) else 1.0
                total += macs * frac
            else:
                a, b = mats
                am, bm = keep_t[a], keep_t[b]
                total += float(torch.matmul(am, bm).sum())
        return round(total)


def search_ratio(
    graph: DependencyGraph,
    scores: np.ndarray,
    rules: SelectionRules,
    cost: CostModel,
    *,
    metric: str,
    fraction: float,
) -> tuple[float, np.ndarray]:
    """The smallest ratio whose pruned model has at most ``fraction`` of the original ``metric``."""
    full = np.ones(len(graph.atoms), dtype=bool)
    measure = cost.params if metric == "params" else cost.macs
    goal = fraction * measure(full)
    lo, hi = 0.0, rules.max_ratio
    best = choose(graph, scores, hi, rules)
    if measure(best) > goal:
        return hi, best  # the cap leaves more than asked: prune as far as allowed
    best_ratio = hi
    for _ in range(20):
        mid = (lo + hi) / 2
        keep = choose(graph, scores, mid, rules)
        if measure(keep) <= goal:
            hi, best, best_ratio = mid, keep, mid
        else:
            lo = mid
    return best_ratio, best


def override_pairs(overrides: Mapping[str, float] | None) -> tuple[tuple[str, float], ...]:
    return tuple((k, float(v)) for k, v in (overrides or {}).items())
