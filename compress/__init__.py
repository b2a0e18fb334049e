"""compress: recipe-driven model compression for PyTorch (QAT, PTQ, pruning, distillation, ONNX).

The public names are re-exported lazily so that importing any one package never half-initializes
another (quantization/, pruning/, ... import compress's core modules, never this module's names).
"""

from __future__ import annotations

import importlib
from typing import Any

from compress.version import __version__ as __version__

_EXPORTS: dict[str, str] = {
    # core
    "load_recipe": "compress.recipe",
    "Recipe": "compress.recipe",
    "Session": "compress.session",
    "apply": "compress.runner",
    "Report": "compress.report",
    "load_model": "compress.models",
    "build_data": "compress.data",
    "Trainer": "compress.training",
    "evaluate": "compress.training",
    "select_modules": "compress.targets",
    "CompressError": "compress.errors",
    "RecipeError": "compress.errors",
    "TargetMatchError": "compress.errors",
    "UnsupportedModelError": "compress.errors",
    "CalibrationError": "compress.errors",
    "ExportError": "compress.errors",
    "ValidationFailed": "compress.errors",
    # quantization
    "quantize": "quantization.api",
    "QuantizeParams": "quantization.api",
    "gptq": "quantization.weight_only",
    "awq": "quantization.weight_only",
    "GPTQParams": "quantization.gptq",
    "AWQParams": "quantization.awq",
    "QuantSpec": "quantization.spec",
    "QuantScheme": "quantization.spec",
    # pruning
    "prune": "pruning.api",
    "PruneResult": "pruning.api",
    "PruningPlan": "pruning.plan",
    # distillation
    "Distiller": "distillation.api",
    # export and validation
    "export_onnx": "export.onnx",
    "validate": "compress.validation",
    # LLM exports (issue 13): ONNX with a KV cache (MatMulNBits int4), compressed-tensors checkpoints
    "export_llm_onnx": "export.llm_onnx",
    "generate_ort": "export.llm_onnx",
    "save_compressed_tensors": "export.compressed_tensors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'compress' has no attribute '{name}'")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])

