"""The recipe's ``export:`` section: export the final model (QDQ int8 when it is quantized) and the
fp32 baseline beside it, count ORT's integer kernels, and lay out a Triton repository on request."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from compress.export.edge import write_triton_repository
from compress.export.onnx import OnnxOptions, write_onnx
from compress.export.records import ExportRecord, Role
from compress.export.specs import ExportSpec
from compress.export.validation.describe import describe_onnx
from compress.quantization.view import QuantizedView, is_quantized, quantizers
from torch import nn

from compress.core.errors import ExportError

log = logging.getLogger(__name__)


def export_model(
    model: nn.Module,
    example_inputs: Any,
    spec: ExportSpec,
    out_dir: Path,
    *,
    name: str = "model",
    baseline: nn.Module | None = None,
    metadata: Mapping[str, str] | None = None,
) -> list[ExportRecord]:
    """Export ``model`` to ``out_dir/NAME.onnx`` (fp32) or ``NAME.int8.onnx`` (QDQ), and with
    ``spec.baseline`` the fp32 ``baseline`` to ``NAME.fp32.onnx``; returns one record per file.
    With ``spec.generation`` the files are the KV-cache generation ONNX of a decoder LLM instead
    (:mod:`export.llm.generation`).

    A QDQ export that ORT runs without a single integer kernel is an ExportError: it would be an
    int8 file that runs in float.
    """
    if not spec.enabled or not spec.onnx:
        return []
    if spec.generation:
        from compress.export.llm.generation import export_generation

        return export_generation(model, spec, Path(out_dir), name=name, baseline=baseline, metadata=metadata)
    out_dir = Path(out_dir)
    records: list[ExportRecord] = []
    quantized = is_quantized(model)
    suffix = ".int8" if quantized else (".fp16" if spec.fp16 else "")
    # the recipe's export settings as the file writer's, once: each file below differs in fp16 only
    options = OnnxOptions(opset=spec.opset, dynamic_batch=spec.dynamic_batch, activation_dtype=spec.activation_dtype,
                          reduce_range=spec.reduce_range, fp16=spec.fp16, simplify=spec.simplify)
    final, kept = _export_one(model, example_inputs, options, out_dir / f"{name}{suffix}.onnx", role="final",
                              metadata=metadata, quantized=quantized)
    if not quantized and kept.model_float is not None:  # quantization left the whole model float, and said why
        final.model_float, final.kept_float = kept.model_float, {**final.kept_float, **kept.kept_float}
        log.warning("export: %s is the float model: %s", final.path.name, kept.model_float)
    records.append(final)
    if spec.baseline and baseline is not None:
        if is_quantized(baseline):
            raise ExportError("export: the baseline model holds enabled fake-quantizers; pass the fp32 model")
        base_path = out_dir / f"{name}.fp32.onnx"
        if base_path == final.path:
            base_path = out_dir / f"{name}.baseline.onnx"
        records.append(_export_one(baseline, example_inputs, replace(options, fp16=False), base_path, role="baseline",
                                   metadata=metadata, quantized=False)[0])
    if spec.triton_repository:
        repo = out_dir / "triton_repository"
        for rec in records:
            rec.triton_dir = write_triton_repository(rec.path, repo, name=f"{name}_{rec.role}")
    for rec in records:
        log.info("export %s: %s %s, %d bytes%s", rec.role, rec.path.name, rec.format, rec.size_bytes,
                 f", {rec.integer_nodes} integer kernels in ORT" if rec.integer_nodes is not None else "")
    return records


def _export_one(
    model: nn.Module, example_inputs: Any, options: OnnxOptions, path: Path, *, role: Role,
    metadata: Mapping[str, str] | None, quantized: bool,
) -> tuple[ExportRecord, QuantizedView]:
    """The file's record, and the model's read view the export built (after its trace)."""
    props = {"compress.role": role, **(metadata or {})}
    placed = write_onnx(model, example_inputs, path, replace(options, metadata=props)).placed
    rec = describe_onnx(path, role=role)
    if quantized:
        rec.kept_float = {**rec.kept_float, **placed.kept_float}
        if rec.integer_nodes and rec.float_nodes:
            shown = ", ".join(rec.float_nodes[:8]) + (f" (+{len(rec.float_nodes) - 8} more)" if len(rec.float_nodes) > 8 else "")
            log.warning("export: %d Conv/MatMul/Gemm/Add of %s still run in float in ORT: %s", len(rec.float_nodes),
                        path.name, shown)
        named = [(n, q) for n, q in quantizers(model) if q.enabled]
        enabled = [q for _, q in named]
        weights = [q for q in enabled if q.role == "weight"]
        # embedding tables feed Gathers, not the u8s8 kernels the 7-bit codes are for
        tables = placed.tables
        kernel_weights = [q for n, q in named if q.role == "weight" and n.rsplit(".", 1)[-1] not in tables]
        calibrated_7bit = bool(kernel_weights) and all(getattr(q.spec, "reduce_range", False) for q in kernel_weights)
        rec.activation_dtype, rec.reduce_range = options.activation_dtype, options.reduce_range or calibrated_7bit
        static_acts = len(weights) < len(enabled)
        if not rec.integer_nodes and not static_acts:
            log.warning("export: %s is weight-only int8; ORT dequantizes the weights and computes in float", path.name)
        elif not rec.integer_nodes and options.fp16:
            # fp16 scales are for GPU runtimes (TensorRT fuses them); ORT's CPU kernels want fp32 scales
            log.warning("export: %s has fp16 Q/DQ scales, which ORT's CPU integer kernels do not take", path.name)
        elif not rec.integer_nodes:
            raise ExportError(
                f"export: ORT runs {path.name} without integer kernels (the QDQ model would run in float); "
                "quantize activations statically (e.g. scheme w8a8) so Q/DQ pairs surround the layers"
            )
    return rec, placed
