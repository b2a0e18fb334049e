"""What an export produced and what validation measured: plain pydantic records, JSON-ready for
report.json and the runner's threshold checks."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

#: "checkpoint": a Hugging Face folder beside the ONNX files (compressed-tensors), not run by validation
Role = Literal["final", "baseline", "checkpoint"]

#: model metadata key of a QDQ export: {ONNX node: the torch op whose decomposition made it}
#: (export.onnx.decomposed_compute), so a record names why those float nodes are float
DECOMPOSED_KEY = "compress.decomposed_nodes"


class ExportRecord(BaseModel):
    """One exported file. ``integer_nodes`` counts the integer kernels (QLinearConv, QGemm,
    MatMulIntegerToFloat, ...) in ORT's optimized CPU graph; None for float exports."""

    model_config = ConfigDict(extra="forbid")

    path: Path
    format: str  # "onnx-fp32" | "onnx-int8-qdq" | "onnx-fp16" | "onnx-int8-qdq-fp16"
    role: Role = "final"
    precision: str  # "fp32" | "int8" | "fp16"
    size_bytes: int
    integer_nodes: int | None = None
    integer_ops: dict[str, int] = Field(default_factory=dict)
    #: Conv/MatMul/Gemm/Add nodes ORT still runs in float (``OpType:node``), for QDQ exports
    float_nodes: list[str] = Field(default_factory=list)
    #: what stays float and why (``op call: why``): layers and ops the quantizer placement left float,
    #: calls only the export ran (unseen by the placement), nodes the exporter made inside another op
    kept_float: dict[str, str] = Field(default_factory=dict)
    #: why the whole model was left float at quantization (the cost table predicted int8 slower than
    #: fp32 at a batch size the run serves): the file is the float model
    model_float: str | None = None
    opset: int | None = None
    dynamic_batch: bool = True
    inputs: list[str] = Field(default_factory=list)
    outputs: list[str] = Field(default_factory=list)
    activation_dtype: str | None = None
    reduce_range: bool | None = None
    triton_dir: Path | None = None


class ValidationRecord(BaseModel):
    """One exported model measured in one runtime.

    ``accuracy`` is the task metric on the eval data (``metric`` names it: classification accuracy,
    or for embeddings the mean cosine of mean-pooled embeddings to the reference); ``parity``
    compares the runtime's outputs with the PyTorch reference (max_abs_diff, mean_abs_diff,
    cosine, sqnr_db, top1_agreement); ``latency_ms`` is the median per batch size and ``speedup``
    the baseline's latency over this model's, timed side by side in one run.
    """

    model_config = ConfigDict(extra="forbid")

    runtime: str
    device: str
    precision: str
    format: str
    model_path: Path
    role: Role
    metric: str | None = None
    accuracy: float | None = None
    reference_accuracy: float | None = None
    samples: int = 0
    parity: dict[str, float | None] = Field(default_factory=dict)
    latency_ms: dict[int, float | None] = Field(default_factory=dict)
    speedup: dict[int, float | None] | None = None
    size_bytes: int
    size_ratio: float | None = None
    threads: int
    integer_nodes: int | None = None
    warmup: int = 0
    runs: int = 0
    #: generation files (export.llm.generation): prompt_tokens, new_tokens, prefill_ms,
    #: decode_ms_per_token, tokens_per_s and, beside a baseline, prefill_speedup / decode_speedup
    generation: dict[str, float] | None = None
    notes: list[str] = Field(default_factory=list)


class ThresholdRecord(BaseModel):
    """One threshold of the recipe against what the run measured. ``where`` names the record that
    decided it (the worst runtime), or ``pytorch`` when nothing was validated in a runtime."""

    model_config = ConfigDict(extra="forbid")

    name: str
    limit: float
    value: float | None
    passed: bool
    where: str | None = None


def slower_note(precision: str, slow: dict[str, float]) -> str:
    """The note a validation record carries where the compressed file measured slower than fp32
    (``slow``: speedup by what was timed, e.g. ``{"batch 16": 0.8}`` or ``{"prefill": 0.7}``)."""
    at = ", ".join(f"{k}: {x:.2f}x" for k, x in slow.items())
    return (f"{precision} measured slower than fp32 ({at}): at these shapes the quantized kernels and their "
            "quantize/dequantize steps cost more than they save, or layers stayed float (see coverage); "
            "validate.thresholds.min_speedup turns this into a failure")
