"""ONNX Runtime sessions, built in one place: export's runtimes and validation, the LLM generator
and quantization's speed check all open their sessions here (onnxruntime imported on first use).

Each caller states what differs for it (threads, spinning, profiling, an optimized-graph dump);
everything else is the same for all: full graph optimizations, errors only in the log unless told
otherwise, the CPU provider unless told otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from compress.core.errors import ExportError


def session_options(*, threads: int | None = None, inter_op_threads: int | None = None, spinning: bool | None = None,
                    profile_prefix: Path | None = None, optimized_path: Path | None = None,
                    quantize_qdq: bool = True, log_severity: int = 3) -> Any:
    """``onnxruntime.SessionOptions``: all graph optimizations, errors only in the log (``log_severity``
    3; ORT's own default is 2, warnings too); ``threads`` /
    ``inter_op_threads`` (None: ORT's default); ``spinning=False`` stops idle pool threads spinning
    (they steal the cores of the next session when sessions are timed side by side); profiling to
    ``profile_prefix``; the optimized graph written to ``optimized_path``; ``quantize_qdq=False``
    keeps ORT from quantizing float weights itself and fusing DQ -> op -> Q."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = log_severity
    if threads is not None:
        so.intra_op_num_threads = threads
    if inter_op_threads is not None:
        so.inter_op_num_threads = inter_op_threads
    if spinning is not None:
        so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    if profile_prefix is not None:
        so.enable_profiling = True
        so.profile_file_prefix = str(profile_prefix)
    if optimized_path is not None:
        so.optimized_model_filepath = str(optimized_path)
    if not quantize_qdq:
        so.add_session_config_entry("session.disable_quant_qdq", "1")
    return so


def inference_session(model: str | Path | bytes, options: Any = None, *, providers: Sequence[str] | None = None,
                      disabled_optimizers: Sequence[str] = (), wrap_errors: bool = True) -> Any:
    """An ``onnxruntime.InferenceSession`` on a file or serialized model (CPU unless ``providers``
    says otherwise); a file ORT cannot load is an ExportError naming it (``wrap_errors=False``: ORT's
    own error, for models the caller built itself, where a failure is a bug and not the user's input)."""
    import onnxruntime as ort

    source = model if isinstance(model, bytes) else str(model)
    if not wrap_errors:
        return ort.InferenceSession(source, options or session_options(), providers=list(providers or ["CPUExecutionProvider"]),
                                    disabled_optimizers=list(disabled_optimizers))
    try:
        return ort.InferenceSession(source, options or session_options(), providers=list(providers or ["CPUExecutionProvider"]),
                                    disabled_optimizers=list(disabled_optimizers))
    except Exception as exc:  # ORT's own message, first line: what it could not read
        where = "the model" if isinstance(model, bytes) else f"'{model}'"
        raise ExportError(f"onnxruntime cannot load {where}: {str(exc).splitlines()[0]}") from exc
