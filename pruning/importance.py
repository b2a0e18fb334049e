"""Importance of each atom (channel or head), aggregated over every tensor of its coupled group.

Per coordinate (a weight tensor's axis) an atom's statistic is the norm of the slices it would
remove; each coordinate is divided by its mean over the atoms it touches, so wide and narrow
layers weigh the same, and an atom's score is the mean over its coordinates. Scores are then
divided by their group's mean, so one threshold can compare groups (global mode).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch
from compress.pruning.graph import IN, NORM, OUT, DependencyGraph
from torch import nn

from compress.core.errors import CalibrationError
from compress.core.registry import Registry

Criterion = Callable[[torch.Tensor, int, "torch.Tensor | None"], torch.Tensor]
#: criterion name -> what it measures (the names a recipe and ``prune(importance=)`` accept)
IMPORTANCE: Registry[str] = Registry("importance")
IMPORTANCE.add("l1", "sum of |w| over the group's weight slices")
IMPORTANCE.add("l2", "L2 norm of the group's weight slices")
IMPORTANCE.add("bn_scale", "|gamma| of the group's norm layers (network slimming)")
IMPORTANCE.add("taylor", "|sum w * dL/dw| over the group's weights (first-order Taylor)")
IMPORTANCE.add("random", "uniform random scores (a baseline)")
IMPORTANCE.add("activation", "activation magnitude into the next layers on calibration data (Minitron)")
_STATS: dict[str, Criterion] = {}
NORM_TYPES = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)


def _stat(name: str) -> Callable[[Criterion], Criterion]:
    def deco(fn: Criterion) -> Criterion:
        _STATS[name] = fn
        return fn

    return deco


def _reduce_others(t: torch.Tensor, axis: int) -> torch.Tensor:
    dims = [d for d in range(t.dim()) if d != axis]
    return t.sum(dim=dims) if dims else t


@_stat("l1")
def _l1(w: torch.Tensor, axis: int, grad: torch.Tensor | None) -> torch.Tensor:
    return _reduce_others(w.abs(), axis)


@_stat("l2")
def _l2(w: torch.Tensor, axis: int, grad: torch.Tensor | None) -> torch.Tensor:
    return _reduce_others(w.pow(2), axis)  # square root taken per atom, after summing


@_stat("activation")
def _activation(w: torch.Tensor, axis: int, stat: torch.Tensor | None) -> torch.Tensor:
    if stat is None or stat.dim() != 1 or stat.numel() != w.shape[axis]:
        return torch.full((w.shape[axis],), float("nan"))  # not an input axis with a statistic
    return stat.to(w.device, torch.float32)


@_stat("taylor")
def _taylor(w: torch.Tensor, axis: int, grad: torch.Tensor | None) -> torch.Tensor:
    if grad is None:
        raise CalibrationError("taylor importance needs gradients: pass data (batches with targets) and a loss")
    return _reduce_others(w * grad, axis)  # |sum w*g| per atom: the first-order loss change




def atom_scores(
    graph: DependencyGraph,
    model: nn.Module,
    criterion: str,
    *,
    grads: Mapping[str, torch.Tensor] | None = None,
    seed: int = 0,
) -> np.ndarray:
    """One score per atom (higher = more important), normalized to mean 1 within each group.

    ``grads``: gradients by parameter name for ``taylor``; for ``activation``, the per-input-channel
    statistics of :func:`pruning.activation.activation_stats` by weight name.
    """
    IMPORTANCE.get(criterion)  # validates the name with a did-you-mean message
    n = len(graph.atoms)
    if criterion == "random":
        raw = np.random.default_rng(seed).random(n) + 1e-3
    else:
        tensors = dict(model.named_parameters(remove_duplicate=False))
        modules = dict(model.named_modules())
        weight_score = _accumulate(graph, tensors, modules, "l1" if criterion == "bn_scale" else criterion, grads, False)
        raw = weight_score
        if criterion == "activation":
            # groups no hooked layer consumes (no statistic) fall back to weight magnitude
            fallback = _accumulate(graph, tensors, modules, "l2", None, False)
            for gr in graph.groups:
                idx = np.asarray(gr.atoms)
                if not np.any(np.isfinite(raw[idx])):
                    raw[idx] = fallback[idx]
        if criterion == "bn_scale":
            norm_score = _accumulate(graph, tensors, modules, "l1", None, True)
            # groups without a norm layer fall back to weight magnitude
            for gr in graph.groups:
                idx = np.asarray(gr.atoms)
                if np.all(np.isfinite(norm_score[idx])):
                    raw[idx] = norm_score[idx]
    out = np.zeros(n)
    for gr in graph.groups:
        idx = np.asarray(gr.atoms)
        vals = np.nan_to_num(raw[idx], nan=0.0)
        mean = vals.mean()
        out[idx] = vals / mean if mean > 0 else vals
    return out


def _accumulate(
    graph: DependencyGraph,
    tensors: Mapping[str, torch.Tensor],
    modules: Mapping[str, nn.Module],
    criterion: str,
    grads: Mapping[str, torch.Tensor] | None,
    norms_only: bool,
) -> np.ndarray:
    n = len(graph.atoms)
    total = np.zeros(n)
    count = np.zeros(n)
    fn = _STATS[criterion]
    for c in graph.coords:
        if c.axis is None:
            continue
        t = tensors.get(c.key)
        if t is None or not t.is_floating_point():
            continue
        is_norm_weight = isinstance(modules.get(c.module), NORM_TYPES) and c.key.endswith(".weight")
        if norms_only:
            if not (NORM in c.roles and is_norm_weight):
                continue
        elif not ((OUT in c.roles or IN in c.roles) and t.dim() >= 2):
            continue
        elif criterion == "activation" and IN not in c.roles:
            continue  # activations are read where channels are consumed
        with torch.no_grad():
            stat = fn(t.detach().float(), c.axis, None if grads is None else grads.get(c.key))
        per_index = stat.double().cpu().numpy()
        if np.isnan(per_index).all():
            continue
        atoms = graph.coord_atoms(c)
        per_atom = np.bincount(atoms, weights=per_index, minlength=n)
        if criterion == "l2":
            per_atom = np.sqrt(np.maximum(per_atom, 0))
        elif criterion == "taylor":
            per_atom = np.abs(per_atom)
        present = np.unique(atoms)
        mean = per_atom[present].mean()
        if mean > 0:
            per_atom = per_atom / mean
        total[present] += per_atom[present]
        count[present] += 1
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / np.maximum(count, 1), np.nan)
