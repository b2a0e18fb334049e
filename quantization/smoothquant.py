"""SmoothQuant (Xiao et al., 2023): move activation outliers into the weights of Linear layers.

Per input feature j, ``s_j = max|X_j|^alpha / max|W_:,j|^(1-alpha)``; the weight is scaled by
``s`` and the input by ``1/s``, which leaves the float product unchanged but evens out the
per-channel activation ranges that one per-tensor activation scale must cover. The ``1/s`` lives
in the input quantizer as ``pre_quant_scale`` (a Mul before QuantizeLinear when exported), so it
works for post-LN transformers such as BERT, where the LayerNorm output also feeds the residual
and cannot absorb the factor.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from compress.errors import CalibrationError
from quantization.calibration import ForwardLoop, as_forward_loop, float_mode
from quantization.modules import QuantLinear
from quantization.preparation import calibrate_weight, quant_modules, unwrap

log = logging.getLogger(__name__)


def smooth_quant(
    model: nn.Module, forward_loop: ForwardLoop | Any, *, alpha: float = 0.5, min_scale: float = 1e-2
) -> dict[str, torch.Tensor]:
    """Smooth every QuantLinear that quantizes its input; returns the factors ``s`` by layer name.

    Runs ``forward_loop`` once in float to record per-feature activation maxima (O(features)
    memory), then rescales weights in place and recalibrates the weight quantizers. ``s`` is
    clamped to ``[min_scale, 1/min_scale]`` so that dead features do not blow up the weight.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"smoothquant alpha must be in [0, 1] (got {alpha})")
    loop = as_forward_loop(forward_loop)
    root = unwrap(model)
    layers = {n: m for n, m in quant_modules(root) if isinstance(m, QuantLinear) and m.input_quantizer is not None}
    if not layers:
        return {}
    amax: dict[str, torch.Tensor] = {}

    def hook(name: str) -> Any:
        def fn(_: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0].detach()
            a = x.abs().reshape(-1, x.shape[-1]).amax(0).float()
            amax[name] = torch.maximum(amax[name], a) if name in amax else a

        return fn

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in layers.items()]
    try:
        with float_mode(root), torch.no_grad():
            loop(model)
    finally:
        for h in handles:
            h.remove()
    scales: dict[str, torch.Tensor] = {}
    for name, mod in layers.items():
        if name not in amax:
            raise CalibrationError(f"smoothquant: layer '{name}' saw no data during the forward loop")
        iq = mod.input_quantizer
        assert iq is not None
        with torch.no_grad():
            if iq.pre_quant_scale is not None:  # smoothed before: start again from the raw weight
                mod.weight.mul_(iq.pre_quant_scale.to(mod.weight.dtype))
            a = amax[name]  # the hook sees the raw input, before pre_quant_scale
            w = mod.weight.abs().amax(0).float()
            s = (a.clamp(min=1e-8).pow(alpha) / w.clamp(min=1e-8).pow(1 - alpha)).clamp(min_scale, 1 / min_scale)
            s = torch.where((a > 0) & (w > 0), s, torch.ones_like(s))
            mod.weight.mul_(s.to(mod.weight.dtype))
        iq.pre_quant_scale = (1.0 / s).to(mod.weight.device)
        calibrate_weight(mod)
        scales[name] = s
    log.info("smoothquant: alpha=%.2f on %d Linear layers", alpha, len(scales))
    return scales
