"""Quantization: specs, observers, fake-quant modules, preparation, PTQ/QAT modifiers, SmoothQuant,
sensitivity, and conversion to real int8 modules (``convert``, in quantization/convert.py).

Names are re-exported lazily so that importing this package stays cheap and acyclic.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "QuantSpec": "quantization.spec",
    "QuantScheme": "quantization.spec",
    "PRESETS": "quantization.spec",
    "resolve_scheme": "quantization.spec",
    "FakeQuantizer": "quantization.fake_quant",
    "QuantLinear": "quantization.modules",
    "QuantConv1d": "quantization.modules",
    "QuantConv2d": "quantization.modules",
    "OBSERVERS": "quantization.observers",
    "Observer": "quantization.observers",
    "prepare": "quantization.preparation",
    "strip": "quantization.preparation",
    "quantizers": "quantization.preparation",
    "quant_modules": "quantization.preparation",
    "set_quantizers": "quantization.preparation",
    "calibrate": "quantization.calibration",
    "input_quantizer": "quantization.hooks",
    "Placement": "quantization.placement",
    "PROFILES": "quantization.profiles",
    "RuntimeProfile": "quantization.profiles",
    "trace_graph": "quantization.graph",
    "quantize": "quantization.api",
    "QuantizeParams": "quantization.api",
    "smooth_quant": "quantization.smoothquant",
    "bias_correction": "quantization.correction",
    "layer_sensitivity": "quantization.sensitivity",
    "convert": "quantization.convert",
    "gptq": "quantization.weight_only",
    "awq": "quantization.weight_only",
    "GPTQParams": "quantization.gptq",
    "AWQParams": "quantization.awq",
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
