"""``compress validate``: an exported ONNX file in the CPU runtimes, or a run folder on the CUDA int8
kernels; and the data source names ``compress.validate`` (export.validation.measure) resolves here.

Run-folder and data-source knowledge lives here, on compress's side; export/ validates what it is
given (files, modules, iterables of batches) and never reads a recipe.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from compress.core.errors import RecipeError
from compress.core.trust import allow_code
from compress.export.records import ValidationRecord

if TYPE_CHECKING:
    from compress.recipe import Recipe


def eval_batches(data: Any, *, batch_size: int = 32) -> Any:
    """An iterable of ``(inputs, targets)`` eval batches from a source name, a DataSpec or an iterable."""
    from compress.recipe import DataSpec

    if isinstance(data, str):
        data = DataSpec(source=data)
    if isinstance(data, DataSpec):
        from compress.data import build_data

        # a source the caller passed here itself (an argument, not a recipe file) is the caller's own code
        bundle = build_data(data, batch_size=batch_size, seed=data.seed, where=f"validate data '{data.source}'",
                            trust_code=True)
        if bundle.eval is None:
            raise RecipeError(f"validate: data source '{data.source}' has no eval split")
        return bundle.eval
    return data


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
    warmup: int = 5,
    threads: int | None = None,
    eval_samples: int | None = None,
    trust_code: bool = False,
) -> list[dict[str, Any]]:
    """The ``compress validate`` command: one JSON-ready row per (runtime, model). Bad arguments raise
    RecipeError (exit 2) naming the argument. ``trust_code`` lets a run folder's recipe run the code
    it names (``--backend cuda`` rebuilds the run's model)."""
    if backend == "cuda":
        return validate_run_cuda(model, batch_sizes=batch_sizes, runs=runs, trust_code=trust_code)
    if backend != "cpu":
        raise RecipeError(f"--backend: '{backend}' is not one of cpu, cuda")
    model = Path(model)
    _check_onnx(model, "MODEL")
    if reference is not None:
        _check_onnx(Path(reference), "--reference")
    from compress.export.validation.runtimes import RUNTIMES

    for rt in runtimes:
        if rt == "cuda":
            raise RecipeError("--runtime cuda: the CUDA int8 kernels validate a run folder: "
                              "compress validate RUN_DIR --backend cuda")
        if rt not in RUNTIMES:
            RUNTIMES.get(rt)  # raises RecipeError listing the valid runtimes
    if threads is not None and threads < 1:
        raise RecipeError(f"--threads: must be >= 1, got {threads}")
    source: Any = data
    if data is not None and data_kwargs:
        from compress.recipe import DataSpec

        source = DataSpec(source=data, kwargs=dict(data_kwargs))
    from compress.export.validation.measure import validate

    records = validate(model, reference=reference, data=source, runtimes=runtimes, batch_sizes=batch_sizes,
                       warmup=warmup, runs=runs, threads=threads, eval_samples=eval_samples,
                       task="embedding" if data == "text" else "classification")
    return [record_row(r) for r in records]


def _check_onnx(path: Path, flag: str) -> None:
    if not path.is_file():
        raise RecipeError(f"{flag}: file '{path}' not found")
    if path.suffix in (".yaml", ".yml"):
        raise RecipeError(f"{flag}: '{path}' is a recipe, not an ONNX model; run it with 'compress apply'")
    import onnx

    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf's DecodeError and friends: the file is the user's input
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise RecipeError(f"{flag}: '{path}' is not an ONNX model ({first})") from None
    from compress.export.validation.describe import check_io

    check_io(proto, path, where=flag)  # no inputs or no outputs: exit 2 before any data is built


def validate_run_cuda(
    run_dir: Path, *, batch_sizes: Sequence[int] = (1, 32), runs: int = 20, device: str = "cuda",
    dtype: Any = None, trust_code: bool = False,
) -> list[dict[str, Any]]:
    """``compress validate RUN_DIR --backend cuda``: the compressed model a ``compress apply`` run
    saved in RUN_DIR (restored from data, :func:`compress.state.restore_compressed`), converted to
    the int8 kernels and validated against the run's fp32 baseline on the recipe's eval data
    (accuracy, parity with fake-quant, latency vs fp16, side by side). One row per batch size;
    ``dtype`` is the deployed float type (default float16). The run's recipe runs code it names only
    with ``trust_code=True``."""
    from compress.recipe import load_recipe

    run_dir = Path(run_dir)
    if not run_dir.is_dir() or not (run_dir / "recipe.yaml").is_file():
        raise RecipeError(
            f"MODEL: --backend cuda validates a run folder of `compress apply` (with recipe.yaml), got '{run_dir}'"
        )
    from compress.run_folder import RunFolder

    final = RunFolder(run_dir).inside("checkpoints/final.pt")  # never read through a link out of the run
    if not final.is_file():
        raise RecipeError(f"MODEL: {final} not found; the run did not finish")
    recipe = load_recipe(run_dir / "recipe.yaml", trust_code=trust_code)
    recipe.require_trust()
    with allow_code(recipe.trusts_code):
        return _validate_run_cuda(recipe, run_dir, final, batch_sizes=batch_sizes, runs=runs, device=device,
                                  dtype=dtype)


def _validate_run_cuda(recipe: Recipe, run_dir: Path, final: Path, *, batch_sizes: Sequence[int], runs: int,
                       device: str, dtype: Any) -> list[dict[str, Any]]:
    import torch

    from compress.data import build_data
    from compress.models import load_model
    from compress.state import load_state_file, restore_compressed

    model = restore_compressed(lambda: load_model(recipe.model, where=recipe.where), final)
    from compress.quantization import quantizers

    if next(quantizers(model), None) is None:
        raise RecipeError(f"MODEL: {run_dir} holds an unquantized model; --backend cuda validates int8 runs")
    baseline = load_model(recipe.model, where=recipe.where)
    ckpt = run_dir / "checkpoints" / "baseline.pt"
    if ckpt.is_file():
        baseline.load_state_dict(load_state_file(ckpt)["model"])
    data = build_data(recipe.data, batch_size=recipe.train.batch_size, seed=recipe.data.seed, where=recipe.where)
    if data.eval is None:
        raise RecipeError(f"{recipe.where('data.source')}: the data source has no eval split to validate on")
    from compress.export.validation.cuda import validate_cuda

    res = validate_cuda(model, eval_loader=data.eval, reference=baseline, batch_sizes=batch_sizes, runs=runs,
                        metric=recipe.train.metric, device=device, dtype=dtype or torch.float16)
    acc, par = res.get("accuracy") or {}, res.get("parity") or {}
    conv = res.get("conversion") or {}
    kept = [f"{k['name']} ({k['type']}): {k['reason']}" for k in conv.get("float_layers", [])]
    return [
        {"runtime": "cuda", "device": res.get("device"), "batch": row["batch"], "float": res.get("float_dtype"),
         "float_ms": row["float_ms"], "int8_ms": row["int8_ms"], "speedup": row["speedup"],
         "metric": recipe.train.metric, "fp32": acc.get("fp32"), "fakequant": acc.get("fakequant"),
         "int8": acc.get("int8"),
         "parity_sqnr_db": par.get("sqnr_db"), "parity_top1": par.get("top1_agreement"),
         "size_ratio": (res.get("size") or {}).get("ratio"), "int8_layers": conv.get("int8_layers"),
         "kept_float": kept}
        for row in res.get("latency", [])
    ]


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
