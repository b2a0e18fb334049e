"""Validation of exported models in real runtimes: parity with the PyTorch reference, task accuracy,
latency (warm-up, median of repeated runs, stated thread count), side-by-side speedup and size.

``validate_exports`` serves the recipe's ``validate:`` section (the runner passes the export
records); ``validate`` is the one-shot Python API on an ONNX file.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pydantic
import torch
from compress.export.records import ExportRecord, ThresholdRecord, ValidationRecord, slower_note
from compress.export.specs import Thresholds, ValidateSpec
from compress.export.validation.parity import Parity, resize_batch, to_numpy_feeds
from compress.export.validation.references import References, RowGroups, as_reference, rows
from compress.export.validation.runtimes import (
    RUNTIMES,
    RuntimeSession,
    default_threads,
    load_session,
)
from torch import nn

from compress.core.batching import batch_size_of, split_batch
from compress.core.errors import CompressError, ExportError, RecipeError
from compress.core.machine import has_vnni
from compress.core.progress import fig
from compress.core.services import eval_batches

log = logging.getLogger(__name__)

MetricArg = str | Callable[[Any, Any], float] | None
_TASK_METRICS = {"classification": "accuracy", "embedding": "embedding_cosine"}


def _make_metric(metric: MetricArg, task: str) -> tuple[Any, str] | None:
    from compress.core.metrics import FunctionMetric, make_metric

    if callable(metric):
        return FunctionMetric(metric), getattr(metric, "__name__", "metric")
    name = metric or _TASK_METRICS.get(task)
    if name is None:
        raise CompressError(f"validate: unknown task '{task}'; valid: {', '.join(_TASK_METRICS)}")
    return make_metric(name, where="validate.metric"), name


def _take(eval_loader: Iterable[Any], limit: int | None) -> list[tuple[Any, Any]]:
    batches: list[tuple[Any, Any]] = []
    seen = 0
    for batch in eval_loader:
        if limit is not None and seen >= limit:
            break
        inputs, targets = split_batch(batch)
        n = batch_size_of(inputs)
        if limit is not None and seen + n > limit:
            keep = limit - seen
            if isinstance(inputs, dict):
                inputs = {k: v[:keep] for k, v in inputs.items()}
            elif isinstance(inputs, (tuple, list)):
                inputs = type(inputs)(t[:keep] for t in inputs)
            else:
                inputs = inputs[:keep]
            targets = targets[:keep] if targets is not None else None
            n = keep
        batches.append((inputs, targets))
        seen += n
    if not batches:
        raise CompressError("validate: the eval data is empty")
    return batches


def time_side_by_side(
    sessions: dict[str, RuntimeSession], example: dict[str, np.ndarray], batch_sizes: Sequence[int], warmup: int, runs: int
) -> tuple[dict[str, dict[int, float | None]], list[str]]:
    """Median ms per batch size for each session, runs interleaved so that load on the machine
    hits every model alike (the speedup is a ratio measured side by side)."""
    out: dict[str, dict[int, float | None]] = {k: {} for k in sessions}
    notes: list[str] = []
    for b in batch_sizes:
        feeds = resize_batch(example, b)
        usable = {}
        for key, s in sessions.items():
            static = s.input_shapes.get(next(iter(feeds)), [None])[0]
            if isinstance(static, int) and static != b:
                out[key][b] = None
                notes.append(f"{key}: batch {b} skipped (static batch {static})")
            else:
                usable[key] = s
        for s in usable.values():
            for _ in range(warmup):
                s.run(feeds)
        times: dict[str, list[float]] = {k: [] for k in usable}
        for _ in range(runs):
            for key, s in usable.items():
                t0 = time.perf_counter()
                s.run(feeds)
                times[key].append((time.perf_counter() - t0) * 1e3)
        for key, t in times.items():
            out[key][b] = statistics.median(t)
    return out, notes


def validate_exports(
    records: Sequence[ExportRecord],
    spec: ValidateSpec,
    *,
    eval_loader: Iterable[Any],
    reference: nn.Module | None,
    metric: MetricArg = None,
    task: str = "classification",
    baseline_reference: nn.Module | None = None,
) -> list[ValidationRecord]:
    """Validate every exported model in every runtime of ``spec``.

    ``reference`` is the PyTorch model the final export came from (the fake-quant model for a QDQ
    export); ``baseline_reference`` the fp32 model behind a baseline export (parity of the baseline
    record is skipped without it). ``metric``: a registered metric name, ``fn(outputs, targets) ->
    float``, or None for the task's (classification: accuracy; embedding: mean cosine of
    mean-pooled embeddings to the fp32 model). Threads: ``spec.threads`` or all cores.
    """
    if not records:
        raise CompressError("validate: no exported model to validate")
    threads = spec.threads or default_threads()
    batches = _take(eval_loader, spec.eval_samples)
    with as_reference((reference, baseline_reference)):
        refs = References({"final": reference, "baseline": baseline_reference}, batches)
        return _validate_runtimes(records, spec, batches, refs, reference, baseline_reference, metric, task, threads)


def _validate_runtimes(
    records: Sequence[ExportRecord], spec: ValidateSpec, batches: list[tuple[Any, Any]], refs: References,
    reference: nn.Module | None, baseline_reference: nn.Module | None, metric: MetricArg, task: str, threads: int,
) -> list[ValidationRecord]:
    fp32_role = "baseline" if refs.has("baseline") else "final"
    classification = task == "classification"
    ref_metric = _reference_accuracy(metric, task, batches, refs)
    results: list[ValidationRecord] = []
    for runtime in spec.runtimes:
        if runtime == "cuda":  # the PyTorch model on the int8 kernels, not a file runtime
            if reference is None:
                raise CompressError("validate: runtime 'cuda' runs the PyTorch model; pass reference=the quantized model")
            results.extend(_cuda_records(records, spec, batches, reference, baseline_reference, metric, task, threads))
            continue
        if runtime not in RUNTIMES:
            raise CompressError(f"validate: unknown runtime '{runtime}'")
        try:
            sessions: dict[str, RuntimeSession] = {r.role: load_session(runtime, r.path, threads=threads) for r in records}
        except ExportError as exc:
            if runtime == "openvino" and "needs the openvino package" in str(exc):
                log.warning("%s", exc)
                results.extend(_skipped(r, runtime, threads, str(exc)) for r in records)
                continue
            raise
        base_size = next((r.size_bytes for r in records if r.role == "baseline"), None)
        for rec in records:
            session = sessions[rec.role]
            made = _make_metric(metric, task)
            mt, mname = made if made else (None, None)
            parity = Parity(classification=classification)
            groups = RowGroups(session)
            for i, (batch_inputs, batch_targets) in enumerate(batches):
                try:
                    feeds = to_numpy_feeds(batch_inputs, session.input_names)
                except KeyError as exc:
                    raise CompressError(f"validate: {rec.path.name}: {exc.args[0]}") from None
                for start, end, out in groups.run(feeds):  # bounded: an LM's logits a few rows at a time
                    inputs = rows(batch_inputs, start, end)
                    targets = batch_targets[start:end] if batch_targets is not None else None
                    outputs = torch.from_numpy(np.ascontiguousarray(out))
                    if refs.has(rec.role):
                        parity.update(refs.output(rec.role, i, start, end).numpy(), out, mask=_padding_mask(inputs))
                    if mt is not None and (targets is not None or not mt.needs_targets):
                        if mt.needs_reference and not refs.has(fp32_role):
                            continue
                        fp = refs.output(fp32_role, i, start, end) if mt.needs_reference else None
                        mt.update(outputs, targets, inputs=inputs, reference=fp)
            acc = mt.compute() if mt is not None and mt.count else None
            results.append(
                ValidationRecord(
                    runtime=runtime, device=session.device, precision=rec.precision, format=rec.format,
                    model_path=rec.path, role=rec.role, metric=mname, accuracy=acc,
                    reference_accuracy=ref_metric.get(rec.role), samples=sum(batch_size_of(b[0]) for b in batches),
                    parity=parity.result(), size_bytes=rec.size_bytes,
                    size_ratio=rec.size_bytes / base_size if base_size and rec.role == "final" else None,
                    threads=threads, integer_nodes=rec.integer_nodes, warmup=spec.warmup, runs=spec.runs,
                )
            )
        for vr, rec in zip(results[-len(records):], records):
            if rec.model_float is not None:
                vr.notes.append(f"kept float at quantization: {rec.model_float}")
            if (runtime == "onnxruntime" and rec.precision == "int8" and rec.reduce_range is False
                    and vr.device.endswith(":CPU") and has_vnni() is False):
                vr.notes.append("CPU without VNNI: ORT's u8s8 kernels can saturate 8-bit weights; "
                                "export.reduce_range=true trades one weight bit for exact integer sums")
        example = to_numpy_feeds(batches[0][0], sessions[records[0].role].input_names)
        lat, notes = time_side_by_side(sessions, example, spec.batch_sizes, spec.warmup, spec.runs)
        for vr in results[-len(records):]:
            vr.latency_ms = lat[vr.role]
            vr.notes.extend(notes)
            if vr.role == "final" and "baseline" in lat:
                vr.speedup = {
                    b: (lat["baseline"][b] / ms) if ms and lat["baseline"].get(b) else None  # type: ignore[operator]
                    for b, ms in lat["final"].items()
                }
                slow = {f"batch {b}": x for b, x in vr.speedup.items() if x is not None and x < 1.0}
                if slow and vr.precision != "fp32":
                    vr.notes.append(slower_note(vr.precision, slow))
            lat_text = ", ".join(f"b{k} {fig(v)} ms" for k, v in vr.latency_ms.items())
            log.info("%s %s (%s): %s %s; %s; %d threads", runtime, vr.role, vr.precision, vr.metric,
                     fig(vr.accuracy), lat_text or "no latency", threads)
    return results


def _reference_accuracy(metric: MetricArg, task: str, batches: list[tuple[Any, Any]], refs: References) -> dict[str, float]:
    """The task metric of the PyTorch models themselves, on the same samples (a metric that scores a
    model in bounded memory, perplexity, runs the model itself; the others read the kept outputs)."""
    from compress.core.metrics import Metric

    out: dict[str, float] = {}
    fp32_role = "baseline" if refs.has("baseline") else "final"
    for role, source in (("final", "final"), ("baseline", fp32_role)):
        made = _make_metric(metric, task)
        if not refs.has(source) or made is None:
            continue
        mt = made[0]
        scores_model = type(mt).update_model is not Metric.update_model
        for i, (inputs, targets) in enumerate(batches):
            if targets is None and mt.needs_targets:
                break
            fp = refs.output(fp32_role, i) if mt.needs_reference else None
            if scores_model:
                with torch.no_grad():
                    mt.update_model(refs.models[source], inputs, targets, reference=fp)
            else:
                mt.update(refs.output(source, i), targets, inputs=inputs, reference=fp)
        if mt.count:
            out[role] = float(mt.compute())
    return out


def _skipped(rec: ExportRecord, runtime: str, threads: int, why: str) -> ValidationRecord:
    return ValidationRecord(
        runtime=runtime, device="unavailable", precision=rec.precision, format=rec.format, model_path=rec.path,
        role=rec.role, size_bytes=rec.size_bytes, threads=threads, integer_nodes=rec.integer_nodes,
        notes=[f"skipped: {why}"],
    )


def _cuda_records(
    records: Sequence[ExportRecord], spec: ValidateSpec, batches: list[tuple[Any, Any]], reference: nn.Module,
    baseline_reference: nn.Module | None, metric: MetricArg, task: str, threads: int,
) -> list[ValidationRecord]:
    """The cuda runtime runs the PyTorch model on the project's int8 kernels (export/validation/cuda.py)."""
    final = next((r for r in records if r.role == "final"), records[0])
    if not torch.cuda.is_available():
        log.warning("runtime 'cuda' skipped: no CUDA device")
        return [_skipped(final, "cuda", threads, "no CUDA device")]
    from compress.export.validation.cuda import validate_cuda

    name = metric if isinstance(metric, str) else _TASK_METRICS.get(task)
    res = validate_cuda(
        reference, eval_loader=batches, reference=baseline_reference or reference, batch_sizes=spec.batch_sizes,
        warmup=spec.warmup, runs=spec.runs, metric=name, eval_samples=spec.eval_samples,
    )
    acc = res.get("accuracy") or {}
    rows = res.get("latency", [])
    return [
        ValidationRecord(
            runtime="cuda", device=str(res.get("device")), precision="int8", format="triton-int8",
            model_path=final.path, role="final", metric=name, accuracy=acc.get("int8"),
            reference_accuracy=acc.get("fp32"), samples=int(res.get("samples", 0)),
            parity=dict(res.get("parity", {})), latency_ms={r["batch"]: r["int8_ms"] for r in rows},
            speedup={r["batch"]: r["speedup"] for r in rows}, size_bytes=int(res["size"]["int8_bytes"]),
            size_ratio=float(res["size"]["ratio"]), threads=threads, warmup=spec.warmup, runs=spec.runs,
            notes=[f"speedup vs {res.get('float_dtype')} PyTorch on the same GPU"],
        )
    ]


def check_thresholds(
    thresholds: Thresholds,
    records: Sequence[ValidationRecord],
    *,
    exports: Sequence[ExportRecord] = (),
    baseline_accuracy: float | None = None,
    final_accuracy: float | None = None,
    higher_is_better: bool = True,
) -> list[ThresholdRecord]:
    """The one threshold check: every limit set in ``thresholds`` against the measured records.

    Every runtime's final record must hold each limit; the reported value is the worst one and
    ``where`` names its runtime. Accuracy drop is the fp32 baseline's accuracy (``baseline_accuracy``,
    else the runtime's baseline record, else the record's PyTorch reference) minus the runtime's; with
    no runtime record it falls back to the PyTorch ``final_accuracy``. Speedup is a runtime's best
    over the timed batch sizes. A limit that nothing measured is missed, not passed. A drop is a
    worsening: with ``higher_is_better=False`` (perplexity) it is the rise of the metric.
    """
    sign = 1.0 if higher_is_better else -1.0
    finals = [r for r in records if r.role == "final" and not any(n.startswith("skipped") for n in r.notes)]
    base = {r.runtime: r for r in records if r.role == "baseline"}
    out: list[ThresholdRecord] = []

    def worst(name: str, limit: float, values: list[tuple[str, float | None]], *, upper: bool) -> None:
        known = [(w, v) for w, v in values if v is not None]
        if not known:
            out.append(ThresholdRecord(name=name, limit=limit, value=None, passed=False))
            return
        w, v = max(known, key=lambda x: x[1]) if upper else min(known, key=lambda x: x[1])
        ok = v <= limit + 1e-12 if upper else v >= limit - 1e-12
        out.append(ThresholdRecord(name=name, limit=limit, value=v, passed=ok, where=w))

    th = thresholds
    if th.max_accuracy_drop is not None:
        drops: list[tuple[str, float | None]] = []
        for r in finals:
            ref = baseline_accuracy
            if ref is None:
                ref = base[r.runtime].accuracy if r.runtime in base else r.reference_accuracy
            drops.append((r.runtime, None if ref is None or r.accuracy is None else sign * (ref - r.accuracy)))
        if not any(d is not None for _, d in drops) and baseline_accuracy is not None and final_accuracy is not None:
            drops = [("pytorch", sign * (baseline_accuracy - final_accuracy))]
        worst("max_accuracy_drop", th.max_accuracy_drop, drops, upper=True)
    if th.min_speedup is not None:
        best = [(r.runtime, max((s for s in (r.speedup or {}).values() if s is not None), default=None)) for r in finals]
        worst("min_speedup", th.min_speedup, best, upper=False)
    if th.min_top1_agreement is not None:
        worst("min_top1_agreement", th.min_top1_agreement,
              [(r.runtime, r.parity.get("top1_agreement")) for r in finals], upper=False)
    if th.min_cosine is not None:
        worst("min_cosine", th.min_cosine, [(r.runtime, r.parity.get("cosine")) for r in finals], upper=False)
    if th.max_size_ratio is not None:
        sizes = {e.role: e.size_bytes for e in exports}
        ratios: list[tuple[str, float | None]] = (
            [("export", sizes["final"] / sizes["baseline"])] if sizes.get("final") and sizes.get("baseline")
            else [(r.runtime, r.size_ratio) for r in finals]
        )
        worst("max_size_ratio", th.max_size_ratio, ratios, upper=True)
    return out


def _padding_mask(inputs: Any) -> np.ndarray | None:
    """A text batch's ``attention_mask`` (parity leaves padded positions out), else None."""
    mask = inputs.get("attention_mask") if isinstance(inputs, Mapping) else None
    return mask.detach().cpu().numpy() if isinstance(mask, torch.Tensor) else None


def validate(
    onnx_path: str | os.PathLike[str],
    *,
    reference: nn.Module | str | os.PathLike[str] | None = None,
    data: Any = None,
    baseline: str | os.PathLike[str] | None = None,
    runtimes: Sequence[str] = ("onnxruntime",),
    batch_sizes: Sequence[int] = (1, 32),
    warmup: int = 5,
    runs: int = 20,
    threads: int | None = None,
    eval_samples: int | None = None,
    task: str = "classification",
    metric: MetricArg = None,
) -> list[ValidationRecord]:
    """``compress.validate``: one ONNX file's parity with ``reference``, accuracy on ``data``, latency, size.

    ``reference``: the PyTorch model it came from, or a reference ONNX file (run in onnxruntime;
    it is then also the ``baseline`` the speedup is measured against). ``data``: an iterable of
    ``(inputs, targets)`` batches, a data source name ("digits") or a DataSpec (its eval split), or
    None for random inputs shaped like the model's (parity and latency only).
    """
    # a source name is resolved by compress's top (export/ never reads the data registry), first, as
    # a bad name is the caller's error whatever the file
    data = eval_batches(data)
    from compress.export.validation.describe import (
        check_eval_batches,
        describe_onnx,
        onnx_reference,
        random_batches,
    )

    path = Path(onnx_path)
    if not path.is_file():
        raise RecipeError(f"validate: model file '{path}' not found")
    ref_module: nn.Module | None
    if reference is None or isinstance(reference, nn.Module):
        ref_module = reference
    else:
        ref_path = Path(reference)
        ref_module = onnx_reference(ref_path, model=path)
        baseline = baseline or ref_path
    records = [describe_onnx(path, role="final")]
    if baseline is not None:
        records.append(describe_onnx(Path(baseline), role="baseline"))
    loader = check_eval_batches(data, path, eval_samples=eval_samples) if data is not None else random_batches(path)
    try:
        spec = ValidateSpec.model_validate({
            "runtimes": list(runtimes), "batch_sizes": list(batch_sizes), "warmup": warmup, "runs": runs,
            "threads": threads, "eval_samples": eval_samples,
        })
    except pydantic.ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise RecipeError(f"validate: {where}: {err['msg']}") from None
    return validate_exports(
        records, spec, eval_loader=loader, reference=ref_module, metric=metric, task=task,
        baseline_reference=ref_module if baseline is not None else None,
    )
