"""Bias correction (Nagel et al., 2019): remove the mean output shift that weight rounding causes.

For a layer ``y = W x + b`` with fake-quantized weight ``Wq``, ``E[y_float - y_quant] =
(W - Wq) E[x]``; adding it to the bias centres the quantized output on the float one. ``E[x]`` is
the per-channel mean of the layer's (quantized) input over the forward loop, O(channels) memory.
For convs the kernel is summed over its spatial taps (padding is ignored, as in the paper).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from compress.quantization.numerics.modules import QuantConv1d, QuantConv2d, QuantLinear
from compress.quantization.preparation import quant_modules, unwrap
from torch import nn

from compress.core.batching import ForwardLoop, as_forward_loop
from compress.core.errors import CalibrationError

log = logging.getLogger(__name__)


def bias_correction(model: nn.Module, forward_loop: ForwardLoop | Any) -> dict[str, torch.Tensor]:
    """Correct the bias of every layer with a weight quantizer; returns the corrections by name.

    The model must be calibrated; the loop runs it in quantized mode. A layer without a bias
    gets one.
    """
    loop = as_forward_loop(forward_loop)
    root = unwrap(model)
    layers = {
        n: m
        for n, m in quant_modules(root)
        if isinstance(m, (QuantLinear, QuantConv1d, QuantConv2d)) and m.weight_quantizer is not None
    }
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def hook(name: str, channel_dim: int) -> Any:
        def fn(mod: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0].detach()
            iq = getattr(mod, "input_quantizer", None)
            if iq is not None:
                x = iq(x)
            xc = x.movedim(channel_dim, -1).reshape(-1, x.shape[channel_dim]).double()
            sums[name] = sums[name] + xc.sum(0) if name in sums else xc.sum(0)
            counts[name] = counts.get(name, 0) + xc.shape[0]

        return fn

    handles = [m.register_forward_pre_hook(hook(n, -1 if isinstance(m, QuantLinear) else 1)) for n, m in layers.items()]
    was_training = root.training
    root.eval()
    try:
        with torch.no_grad():
            loop(model)
    finally:
        root.train(was_training)
        for h in handles:
            h.remove()
    out: dict[str, torch.Tensor] = {}
    for name, mod in layers.items():
        if name not in sums:
            raise CalibrationError(f"bias_correction: layer '{name}' saw no data during the forward loop")
        mean = (sums[name] / counts[name]).float()
        with torch.no_grad():
            dw = (mod.weight - mod.quantized_weight()).float()
            delta = _expected_shift(mod, dw, mean)
            if mod.bias is None:
                mod.bias = nn.Parameter(delta.to(mod.weight.dtype))
            else:
                mod.bias.add_(delta.to(mod.bias.dtype))
        out[name] = delta
    log.info("bias correction on %d layers", len(out))
    return out


def _expected_shift(mod: nn.Module, dw: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    if isinstance(mod, QuantLinear):
        return dw @ mean
    assert isinstance(mod, (QuantConv1d, QuantConv2d))
    k = dw.reshape(dw.shape[0], dw.shape[1], -1).sum(-1)  # [O, C/g]
    g = mod.groups
    m = mean.reshape(g, -1)  # [g, C/g]
    per_group_out = dw.shape[0] // g
    return (k.reshape(g, per_group_out, -1) * m[:, None, :]).sum(-1).reshape(-1)
