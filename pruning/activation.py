"""Activation importance (NVIDIA Minitron's width-pruning criterion) from calibration batches.

A channel matters as much as the activation that flows through it into the next layer: for an MLP
intermediate channel that is the input of the down projection, for an attention head the input of
the output projection (the head's context), for an embedding channel the normalized input of every
q/k/v and MLP projection. So the statistic is taken at the input of every conv/linear layer and
scored on the coordinates that consume channels (``IN``): per sample the mean of |x| over positions,
then the L2 over samples (Minitron's best aggregation: batch L2, sequence mean).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from compress.core.batching import call_model, split_batch, to_device
from compress.core.errors import CalibrationError
from compress.core.progress import bar


def _channel_dim(mod: nn.Module, x: torch.Tensor) -> int | None:
    if isinstance(mod, nn.modules.conv._ConvNd):
        return 1 if x.dim() == mod.weight.dim() else 0
    w = getattr(mod, "weight", None)
    if isinstance(w, torch.Tensor) and w.dim() == 2 and x.dim() >= 1 and x.shape[-1] in w.shape:
        return x.dim() - 1  # Linear (out, in) or a transposed one (GPT-2's Conv1D: (in, out))
    return None


def activation_stats(
    model: nn.Module, data: Iterable[Any], *, batches: int = 8, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """Per input channel of every weight layer: the L2 over samples of the mean |input| over
    positions, keyed by the layer's weight name (read by ``importance="activation"``)."""
    sums: dict[str, torch.Tensor] = {}
    handles = []
    for name, mod in model.named_modules():
        if not (isinstance(mod, (nn.Linear, nn.modules.conv._ConvNd)) or type(mod).__name__ == "Conv1D"):
            continue

        def hook(m: nn.Module, args: tuple[Any, ...], *, _key: str = f"{name}.weight" if name else "weight") -> None:
            x = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if x is None or not x.is_floating_point():
                return
            dim = _channel_dim(m, x)
            if dim is None:
                return
            xs = x.detach().float().abs().movedim(dim, -1)
            per_sample = xs.reshape(xs.shape[0], -1, xs.shape[-1]).mean(1) if xs.dim() > 1 else xs[None]
            sq = per_sample.pow(2).sum(0)
            sums[_key] = sums[_key] + sq if _key in sums and sums[_key].shape == sq.shape else sq

        handles.append(mod.register_forward_pre_hook(hook))
    was_training = model.training
    model.eval()
    seen = 0
    try:
        with torch.no_grad():
            for batch in bar(data, desc="activation importance", cap=batches, unit="batch"):
                if seen >= batches:
                    break
                inputs, _ = split_batch(batch)
                call_model(model, to_device(inputs, device))
                seen += 1
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    if not seen:
        raise CalibrationError("activation importance got no calibration batches")
    return {k: v.sqrt().cpu() for k, v in sums.items()}
