"""Wanda (Sun et al., 2023): prune the weights of lowest ``|W_ij| * ||X_j||_2`` (``X_j``: the
layer's input feature j over every calibration token), compared within each output row
(unstructured) or within each group of M consecutive inputs of a row (N:M); no weight update.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from compress.pruning.sparse.params import SparsityParams, sparse_targets
from compress.quantization.algorithms.sequential import Call, LayerHook, sequential_quantize
from compress.quantization.preparation import linearize
from torch import nn

from compress.core.batching import CalibrationData, as_batches
from compress.core.errors import CalibrationError
from compress.core.progress import with_progress
from compress.core.sparsity import set_mask

log = logging.getLogger(__name__)


class WandaParams(SparsityParams):
    """Wanda's settings: what ``compress.wanda`` takes and the ``wanda`` recipe modifier is made of:
    ``sparsity``, ``pattern`` and the selection as :class:`~compress.pruning.sparse.params.SparsityParams`."""


def wanda_mask(weight: torch.Tensor, input_norm: torch.Tensor, params: SparsityParams) -> torch.Tensor:
    """The keep mask (True: kept) of ``weight`` ([out, in]) for input feature norms ``input_norm`` ([in])."""
    score = weight.detach().abs().float() * input_norm.float().to(weight.device).unsqueeze(0)
    rows, cols = score.shape
    pruned = torch.zeros(rows, cols, dtype=torch.bool, device=score.device)
    nm = params.nm
    if nm is not None:
        n, m = nm
        if cols % m:
            raise CalibrationError(f"wanda: pattern {params.pattern} needs an input width divisible by {m}, not {cols}")
        groups = score.reshape(rows, cols // m, m)
        idx = torch.topk(groups, m - n, dim=2, largest=False).indices
        pruned = torch.zeros_like(groups, dtype=torch.bool).scatter_(2, idx, True).reshape(rows, cols)
    else:
        k = int(cols * params.sparsity)
        if k:
            pruned.scatter_(1, torch.topk(score, k, dim=1, largest=False).indices, True)
    return ~pruned


class _SquareSums:
    """Running per-feature sum of squares of one Linear's inputs (a forward pre-hook feeds it)."""

    def __init__(self, in_features: int, device: torch.device | str) -> None:
        self.sq = torch.zeros(in_features, dtype=torch.float64, device=device)

    def hook(self, _: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        x = args[0].detach()
        self.sq += x.reshape(-1, x.shape[-1]).to(self.sq.device, torch.float64).pow(2).sum(0)

    def norms(self) -> torch.Tensor:
        """``||X_j||_2`` per feature, summed across DDP ranks (every rank chooses the same mask)."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(self.sq)
        return self.sq.sqrt()


@torch.no_grad()
def input_norms(layer: nn.Module, linears: Mapping[str, nn.Linear], calls: Sequence[Call]) -> dict[str, torch.Tensor]:
    """``||X_j||_2`` of each Linear's input features over ``calls`` of ``layer`` (as it is now)."""
    sums = {n: _SquareSums(m.in_features, m.weight.device) for n, m in linears.items()}
    handles = [m.register_forward_pre_hook(sums[n].hook) for n, m in linears.items()]
    try:
        was = layer.training
        layer.eval()
        for args, kwargs in calls:
            layer(*args, **kwargs)
        layer.train(was)
    finally:
        for h in handles:
            h.remove()
    return {n: s.norms() for n, s in sums.items()}


@torch.no_grad()
def wanda_layer(layer: nn.Module, linears: Mapping[str, nn.Linear], calls: Sequence[Call], params: WandaParams) -> dict[str, Any]:
    """Wanda on one decoder layer's Linears in place, each left with its mask."""
    for n, norm in input_norms(layer, linears, calls).items():
        set_mask(linears[n], wanda_mask(linears[n].weight, norm, params))
    return {}


@with_progress
def wanda(
    model: nn.Module,
    data: CalibrationData,
    *,
    sparsity: float | None = None,
    pattern: str | None = None,
    targets: Sequence[str] | None = None,
    ignore: Sequence[str] | None = None,
    params: WandaParams | None = None,
    load: LayerHook | None = None,
    release: LayerHook | None = None,
    progress: bool = True,
) -> nn.Module:
    """Wanda pruning of a decoder LLM's Linears (in place), one decoder layer at a time (each layer's
    inputs from the layers pruned before it); returns it. Arguments as :func:`compress.sparsegpt`'s
    (``params``: :class:`WandaParams`). Every pruned Linear keeps a mask (compress.core.sparsity)."""
    p = (params or WandaParams()).given("wanda", sparsity=sparsity, pattern=pattern, targets=targets, ignore=ignore)
    linearize(model)
    names = sparse_targets(model, p, where="wanda")
    summary = sequential_quantize(model, as_batches(data, model, max_batches=p.num_batches), None,
                                  lambda i, layer, lin, calls: wanda_layer(layer, lin, calls, p), p,
                                  load=load, release=release, where="wanda", plain_linears=names)
    log.info("wanda: %d Linears pruned to %s in %.1f s", summary["quantized_linears"],
             p.pattern if p.nm else f"{p.sparsity:.0%}", summary["seconds"])
    return model
