"""What ``compress validate MODEL.onnx ...`` runs (the CLI parses arguments and calls :func:`run`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from compress.errors import RecipeError
from export.records import ValidationRecord
from export.runtimes import RUNTIMES


def parse_batch_sizes(text: str) -> list[int]:
    """``"1,32"`` -> ``[1, 32]``; RecipeError on anything else."""
    try:
        sizes = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise RecipeError(f"--batch-sizes: '{text}' is not a comma-separated list of integers") from None
    if not sizes or min(sizes) < 1:
        raise RecipeError(f"--batch-sizes: '{text}' must list positive integers")
    return sizes


def run(
    model: str | Path,
    *,
    reference: str | Path | None = None,
    data: Any = None,
    runtimes: Sequence[str] = ("onnxruntime",),
    batch_sizes: Sequence[int] = (1, 32),
    threads: int | None = None,
    warmup: int = 5,
    runs: int = 20,
    eval_samples: int | None = None,
    task: str = "classification",
) -> list[ValidationRecord]:
    """Validate ``model``; ``reference`` is an ONNX file (parity and the speedup baseline), ``data``
    a data source name (e.g. ``digits``; random inputs when None). Bad arguments raise RecipeError
    (exit 2), naming the argument."""
    model = Path(model)
    if not model.is_file():
        raise RecipeError(f"MODEL: file '{model}' not found")
    if reference is not None and not Path(reference).is_file():
        raise RecipeError(f"--reference: file '{reference}' not found")
    for rt in runtimes:
        if rt not in RUNTIMES:
            RUNTIMES.get(rt)  # raises RecipeError listing the valid runtimes
    if threads is not None and threads < 1:
        raise RecipeError(f"--threads: must be >= 1, got {threads}")
    from export.validate import validate

    return validate(
        model, reference=reference, data=data, runtimes=runtimes, batch_sizes=batch_sizes, warmup=warmup, runs=runs,
        threads=threads, eval_samples=eval_samples, task=task,
    )


def run_validate(
    model: Path,
    *,
    reference: Path | None = None,
    data: str | None = None,
    data_kwargs: Mapping[str, Any] | None = None,
    runtimes: Sequence[str] = ("onnxruntime",),
    backend: str = "cpu",
    batch_sizes: Sequence[int] = (1, 32),
    runs: int = 20,
    threads: int | None = None,
) -> list[dict[str, Any]]:
    """The ``compress validate`` command: :func:`run`, with the data source's kwargs, flattened to one
    JSON-ready row per (runtime, model) for printing as a table or JSON."""
    if backend == "cuda":
        raise RecipeError(
            "--backend cuda: the cuda runtime runs the PyTorch model on the int8 kernels, not an ONNX file; "
            "use `compress apply` with validate.runtimes: [cuda]"
        )
    if backend != "cpu":
        raise RecipeError(f"--backend: '{backend}' is not one of cpu, cuda")
    source: Any = data
    if data is not None and data_kwargs:
        from compress.recipe import DataSpec

        source = DataSpec(source=data, kwargs=dict(data_kwargs))
    records = run(model, reference=reference, data=source, runtimes=runtimes, batch_sizes=batch_sizes, runs=runs,
                  threads=threads, task=_task_of(data))
    return [record_row(r) for r in records]


def _task_of(data: str | None) -> str:
    return "embedding" if data == "text" else "classification"


def record_row(r: ValidationRecord) -> dict[str, Any]:
    """A flat row of a validation record (parity keys and per-batch latency/speedup as columns)."""
    row: dict[str, Any] = {
        "runtime": r.runtime, "device": r.device, "role": r.role, "precision": r.precision,
        "model": r.model_path.name, "metric": r.metric, "accuracy": r.accuracy,
    }
    for k in ("cosine", "sqnr_db", "top1_agreement", "max_abs_diff"):
        row[k] = r.parity.get(k)
    for b, ms in r.latency_ms.items():
        row[f"b{b}_ms"] = ms
        row[f"b{b}_speedup"] = (r.speedup or {}).get(b)
    row.update({"size_bytes": r.size_bytes, "integer_nodes": r.integer_nodes, "threads": r.threads,
                "notes": "; ".join(r.notes)})
    return row


def format_records(records: Sequence[ValidationRecord]) -> str:
    """A plain-text table of validation records for the terminal."""
    lines = []
    for r in records:
        lat = ", ".join(f"b{b}={ms:.3f}ms" if ms is not None else f"b{b}=n/a" for b, ms in r.latency_ms.items())
        spd = ", ".join(f"b{b}={s:.2f}x" for b, s in (r.speedup or {}).items() if s is not None)
        par = r.parity
        lines.append(
            f"{r.runtime:<11} {r.role:<8} {r.precision:<5} {r.model_path.name}: "
            + (f"{r.metric}={r.accuracy:.4f} " if r.accuracy is not None else "")
            + (f"cos={par['cosine']:.5f} sqnr={par['sqnr_db']:.1f}dB " if par.get("cosine") is not None else "")
            + (f"top1_agree={par['top1_agreement']:.4f} " if par.get("top1_agreement") is not None else "")
            + f"latency[{lat}] " + (f"speedup[{spd}] " if spd else "")
            + f"size={r.size_bytes / 1e6:.2f}MB threads={r.threads}"
            + (f" ({'; '.join(r.notes)})" if r.notes else "")
        )
    return "\n".join(lines)
