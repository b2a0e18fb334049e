"""compress: recipe-driven model compression for PyTorch (QAT, PTQ, pruning, distillation, ONNX).

The public names are re-exported lazily so that importing any one package never half-initializes
another (quantization/, pruning/, ... import compress's core modules, never this module's names).
"""

from __future__ import annotations

import importlib
from typing import Any

from compress.core import services as _services
from compress.core.version import __version__ as __version__


def _load_model(spec: Any, *, where: Any = "model") -> Any:
    from compress.models import load_model

    return load_model(spec, where=where)


def _train_for(model: Any, data: Any, *, epochs: float, lr: float | None, device: Any, desc: str) -> float | None:
    from compress.training import train_for

    return train_for(model, data, epochs=epochs, lr=lr, device=device, desc=desc)


def _save_quantized(model: Any, out_dir: Any, **kwargs: Any) -> Any:
    from compress.export.llm.compressed_tensors import save_compressed_tensors

    return save_compressed_tensors(model, out_dir, **kwargs)


def _eval_data(data: Any) -> Any:
    from compress.validation import eval_batches

    return eval_batches(data)


# the core's model-loading, training, saving and eval-data slots, filled here because every module of
# the core lives inside this package: whoever imports any of it has run this file first
_services.provide(loader=_load_model, trainer=_train_for, saver=_save_quantized, eval_data=_eval_data)

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
    "select_modules": "compress.core.targets",
    "CompressError": "compress.core.errors",
    "RecipeError": "compress.core.errors",
    "TargetMatchError": "compress.core.errors",
    "UnsupportedModelError": "compress.core.errors",
    "CalibrationError": "compress.core.errors",
    "ExportError": "compress.core.errors",
    "ValidationFailed": "compress.core.errors",
    # quantization
    "quantize": "compress.quantization.api",
    "QuantizeParams": "compress.quantization.api",
    "PrepareParams": "compress.quantization.preparation",
    "gptq": "compress.quantization.algorithms.gptq",
    "awq": "compress.quantization.algorithms.awq",
    "GPTQParams": "compress.quantization.algorithms.gptq",
    "autoround": "compress.quantization.algorithms.autoround",
    "AutoRoundParams": "compress.quantization.algorithms.autoround",
    "AWQParams": "compress.quantization.algorithms.awq_search",
    "rotate": "compress.quantization.algorithms.rotation",
    "RotationParams": "compress.quantization.algorithms.rotation",
    "QuantSpec": "compress.quantization.numerics.spec",
    "QuantScheme": "compress.quantization.numerics.spec",
    # pruning
    "prune": "compress.pruning.api",
    "PruneResult": "compress.pruning.api",
    "PruneParams": "compress.pruning.api",
    "PruningPlan": "compress.pruning.plan",
    # weight sparsity inside the Linears (issue 53): SparseGPT, Wanda, and the masks later stages keep
    "sparsegpt": "compress.pruning.sparse.sparsegpt",
    "SparseGPTParams": "compress.pruning.sparse.sparsegpt",
    "wanda": "compress.pruning.sparse.wanda",
    "WandaParams": "compress.pruning.sparse.wanda",
    "apply_masks": "compress.core.sparsity",
    # distillation
    "Distiller": "compress.distillation.api",
    "DistillParams": "compress.distillation.api",
    # export and validation
    "export_onnx": "compress.export.onnx",
    "validate": "compress.export.validation.measure",
    # LLM exports (issue 13): ONNX with a KV cache (MatMulNBits int4), compressed-tensors checkpoints
    "export_llm_onnx": "compress.export.llm.onnx",
    "generate_ort": "compress.export.llm.onnx",
    "save_compressed_tensors": "compress.export.llm.compressed_tensors",
    # the LLM runtimes' files (issue 31): llama.cpp GGUF, ORT GenAI / Optimum folders
    "save_gguf": "compress.export.llm.gguf_file",
    "write_runtime_files": "compress.export.llm.genai",
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

