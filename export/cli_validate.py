"""What ``compress validate MODEL.onnx ...`` runs (the CLI parses arguments and calls :func:`run`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

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
    data: str | None = None,
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
