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
    "QuantSpec": "quantization.numerics.spec",
    "QuantScheme": "quantization.numerics.spec",
    "PRESETS": "quantization.numerics.spec",
    "resolve_scheme": "quantization.numerics.spec",
    "FakeQuantizer": "quantization.numerics.fake_quant",
    "QuantLinear": "quantization.numerics.modules",
    "QuantConv1d": "quantization.numerics.modules",
    "QuantConv2d": "quantization.numerics.modules",
    "OBSERVERS": "quantization.numerics.observers",
    "Observer": "quantization.numerics.observers",
    "prepare": "quantization.preparation",
    "strip": "quantization.preparation",
    "quantizers": "quantization.preparation",
    "quant_modules": "quantization.preparation",
    "set_quantizers": "quantization.preparation",
    "calibrate": "quantization.numerics.calibration",
    "input_quantizer": "quantization.placement.mode",
    "Placement": "quantization.placement.records",
    "PROFILES": "quantization.placement.runtimes",
    "RuntimeProfile": "quantization.placement.runtimes",
    "trace_graph": "quantization.placement.trace",
    "quantize": "quantization.api",
    "QuantizeParams": "quantization.api",
    "smooth_quant": "quantization.algorithms.smoothquant",
    "bias_correction": "quantization.algorithms.bias_correction",
    "layer_sensitivity": "quantization.algorithms.sensitivity",
    "convert": "quantization.lowering.convert",
    "gptq": "quantization.algorithms.gptq",
    "awq": "quantization.algorithms.awq",
    "GPTQParams": "quantization.algorithms.gptq",
    "AWQParams": "quantization.algorithms.awq_search",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'quantization' has no attribute '{name}'")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
