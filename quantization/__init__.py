"""Quantization, in rooms named for what they hold:

- ``numerics/``: specs, the arithmetic, observers, the FakeQuantizer, quantized layers, calibration;
- ``placement/``: the graph trace, the runtimes' rule tables, placement, the runtime mode,
  attention written out, the speed check;
- ``algorithms/``: SmoothQuant, bias correction, BN folding, GPTQ, AWQ, the KV cache, sensitivity
  and accuracy control, layer-by-layer calibration;
- ``lowering/``: conversion to int8 / int4 modules and the Triton kernels;
- ``preparation.py`` (module swap, strip, save and restore), ``api.py`` (``compress.quantize``), the
  recipe modifiers, and ``view.py``: what export reads of a quantized model.

Names are re-exported lazily so that importing this package stays cheap and acyclic.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "QuantSpec": "compress.quantization.numerics.spec",
    "QuantScheme": "compress.quantization.numerics.spec",
    "PRESETS": "compress.quantization.numerics.spec",
    "resolve_scheme": "compress.quantization.numerics.spec",
    "FakeQuantizer": "compress.quantization.numerics.fake_quant",
    "QuantLinear": "compress.quantization.numerics.modules",
    "QuantConv1d": "compress.quantization.numerics.modules",
    "QuantConv2d": "compress.quantization.numerics.modules",
    "OBSERVERS": "compress.quantization.numerics.observers",
    "Observer": "compress.quantization.numerics.observers",
    "prepare": "compress.quantization.preparation",
    "PrepareParams": "compress.quantization.preparation",
    "strip": "compress.quantization.preparation",
    "quantizers": "compress.quantization.preparation",
    "quant_modules": "compress.quantization.preparation",
    "set_quantizers": "compress.quantization.preparation",
    "calibrate": "compress.quantization.numerics.calibration",
    "input_quantizer": "compress.quantization.placement.mode",
    "Placement": "compress.quantization.placement.records",
    "PROFILES": "compress.quantization.placement.runtimes",
    "RuntimeProfile": "compress.quantization.placement.runtimes",
    "trace_ops": "compress.quantization.placement.trace",
    "quantize": "compress.quantization.api",
    "QuantizeParams": "compress.quantization.api",
    "smooth_quant": "compress.quantization.algorithms.smoothquant",
    "bias_correction": "compress.quantization.algorithms.bias_correction",
    "layer_sensitivity": "compress.quantization.algorithms.sensitivity",
    "convert": "compress.quantization.lowering.convert",
    "gptq": "compress.quantization.algorithms.gptq",
    "awq": "compress.quantization.algorithms.awq",
    "GPTQParams": "compress.quantization.algorithms.gptq",
    "autoround": "compress.quantization.algorithms.autoround",
    "AutoRoundParams": "compress.quantization.algorithms.autoround",
    "AWQParams": "compress.quantization.algorithms.awq_search",
    "rotate": "compress.quantization.algorithms.rotation",
    "RotationParams": "compress.quantization.algorithms.rotation",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'compress.quantization' has no attribute '{name}'")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
