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
        return validate_run_cuda(model, batch_sizes=batch_sizes, runs=runs)
    if backend != "cpu":
        raise RecipeError(f"--backend: '{backend}' is not one of cpu, cuda")
    source: Any = data
    if data is not None and data_kwargs:
        from compress.recipe import DataSpec

        source = DataSpec(source=data, kwargs=dict(data_kwargs))
    records = run(model, reference=reference, data=source, runtimes=runtimes, batch_sizes=batch_sizes, runs=runs,
                  threads=threads, task=_task_of(data))
    return [record_row(r) for r in records]


def validate_run_cuda(
    run_dir: Path, *, batch_sizes: Sequence[int] = (1, 32), runs: int = 20, device: str = "cuda",
    dtype: Any = None,
) -> list[dict[str, Any]]:
    """``compress validate RUN_DIR --backend cuda``: the quantized model a ``compress apply`` run
    left in RUN_DIR, converted to the int8 kernels and validated against the run's fp32 baseline on
    the recipe's eval data (accuracy, parity with fake-quant, latency vs fp16, side by side).
    One row per batch size; ``dtype`` is the deployed float type (default float16)."""
    import torch

    from compress.data import build_data
    from compress.models import load_model
    from compress.recipe import load_recipe
    from compress.runner import FINAL_MODEL

    run_dir = Path(run_dir)
    if not run_dir.is_dir() or not (run_dir / "recipe.yaml").is_file():
        raise RecipeError(
            f"MODEL: --backend cuda validates a run folder of `compress apply` (with recipe.yaml), got '{run_dir}'"
        )
    final = run_dir / "checkpoints" / FINAL_MODEL
    if not final.is_file():
        raise RecipeError(f"MODEL: {final} not found; only runs that quantize the model write it")
    recipe = load_recipe(run_dir / "recipe.yaml")
    # the run folder is the user's own output; the module pickle is how quantizer settings travel
    model = torch.load(final, map_location="cpu", weights_only=False)
    baseline = load_model(recipe.model, where=recipe.where)
    ckpt = run_dir / "checkpoints" / "baseline.pt"
    if ckpt.is_file():
        baseline.load_state_dict(torch.load(ckpt, map_location="cpu", weights_only=True)["model"])
    data = build_data(recipe.data, batch_size=recipe.train.batch_size, seed=recipe.data.seed, where=recipe.where)
    if data.eval is None:
        raise RecipeError(f"{recipe.where('data.source')}: the data source has no eval split to validate on")
    from export.cuda import validate_cuda

    res = validate_cuda(model, eval_loader=data.eval, reference=baseline, batch_sizes=batch_sizes, runs=runs,
                        metric=recipe.train.metric, device=device, dtype=dtype or torch.float16)
    acc, par = res.get("accuracy") or {}, res.get("parity") or {}
    return [
        {"runtime": "cuda", "device": res.get("device"), "batch": row["batch"], "float": res.get("float_dtype"),
         "float_ms": row["float_ms"], "int8_ms": row["int8_ms"], "speedup": row["speedup"],
         "metric": recipe.train.metric, "fp32": acc.get("fp32"), "fakequant": acc.get("fakequant"),
         "int8": acc.get("int8"),
         "parity_sqnr_db": par.get("sqnr_db"), "parity_top1": par.get("top1_agreement"),
         "size_ratio": (res.get("size") or {}).get("ratio")}
        for row in res.get("latency", [])
    ]


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
