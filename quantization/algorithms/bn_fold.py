"""BatchNorm folding: find each conv (or Linear) whose only consumer is a BatchNorm, and merge the two."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable

import torch
from torch import nn

log = logging.getLogger(__name__)

_CONVS = (nn.Conv1d, nn.Conv2d)
_BNS = (nn.BatchNorm1d, nn.BatchNorm2d)


def find_conv_bn_pairs(model: nn.Module) -> dict[str, str]:
    """``{conv_name: bn_name}`` for every conv whose output feeds only a BatchNorm.

    Uses torch.fx when the model traces; otherwise adjacent children of ``nn.Sequential``
    containers (the only pairing that is certain without a graph).
    """
    try:
        return _pairs_fx(model)
    except Exception as exc:  # fx fails on data-dependent control flow; fall back, don't fail
        log.debug("fx tracing failed (%s); pairing conv/bn by Sequential adjacency", exc)
        return sequential_pairs(model, _conv_compatible)


def _pairs_fx(model: nn.Module) -> dict[str, str]:
    from torch import fx

    gm = fx.symbolic_trace(model)
    mods = dict(model.named_modules())
    pairs: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op != "call_module" or not isinstance(mods.get(node.target), _BNS):
            continue
        src = node.args[0] if node.args else None
        if not isinstance(src, fx.Node) or src.op != "call_module" or len(src.users) != 1:
            continue
        conv, bn = mods.get(src.target), mods[node.target]
        if isinstance(conv, _CONVS) and _compatible(conv, bn):
            pairs[str(src.target)] = str(node.target)
    return pairs


def sequential_pairs(model: nn.Module, match: Callable[[nn.Module, nn.Module], bool]) -> dict[str, str]:
    """``{first_name: second_name}`` for adjacent children of every ``nn.Sequential`` in ``model``
    for which ``match(first, second)`` holds (full module names)."""
    pairs: dict[str, str] = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Sequential):
            continue
        prefix = f"{name}." if name else ""
        for (first_name, first), (second_name, second) in itertools.pairwise(mod.named_children()):
            if match(first, second):
                pairs[prefix + first_name] = prefix + second_name
    return pairs


def _compatible(conv: nn.Module, bn: nn.Module) -> bool:
    """``bn`` normalizes ``conv``'s output channels (or a Linear's output features) with running stats."""
    width = conv.out_channels if isinstance(conv, _CONVS) else conv.out_features if isinstance(conv, nn.Linear) else None
    return (
        width is not None
        and isinstance(bn, _BNS)
        and bn.num_features == width
        and bn.track_running_stats
        and bn.running_mean is not None
    )


def _conv_compatible(conv: nn.Module, bn: nn.Module) -> bool:
    # without a graph a Linear's input rank is unknown: BatchNorm1d on (N, L, C) normalizes L, not C
    return isinstance(conv, _CONVS) and _compatible(conv, bn)


def fold_bn_into_conv(conv: nn.Conv1d | nn.Conv2d | nn.Linear, bn: nn.BatchNorm1d | nn.BatchNorm2d) -> None:
    """Merge ``bn`` (its running statistics) into ``conv``'s (or a Linear's) weight and bias, in place."""
    assert bn.running_mean is not None and bn.running_var is not None
    with torch.no_grad():
        std = torch.sqrt(bn.running_var + bn.eps)
        gamma = bn.weight if bn.weight is not None else torch.ones_like(std)
        beta = bn.bias if bn.bias is not None else torch.zeros_like(std)
        factor = gamma / std
        conv.weight.mul_(factor.reshape([-1] + [1] * (conv.weight.dim() - 1)))
        b = conv.bias if conv.bias is not None else torch.zeros_like(std)
        new_bias = beta + (b - bn.running_mean) * factor
    if conv.bias is None:
        conv.bias = nn.Parameter(new_bias)
    else:
        with torch.no_grad():
            conv.bias.copy_(new_bias)
