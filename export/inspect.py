"""``compress inspect``: a readable summary of an ONNX file (what it takes and returns, its precision,
size, ops, ORT's integer kernels and what still runs in float, its metadata) and of a run folder's
exports (from its report.json)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import onnx
from compress.export.records import ExportRecord
from compress.export.validation import describe
from compress.export.validation.runtimes import Coverage
from pydantic import ValidationError

from compress.core.bounded import load_json_file
from compress.core.errors import RecipeError

#: float nodes and kept-float entries listed by name before "(+N more)"
SHOWN = 20


def _shape(v: onnx.ValueInfoProto) -> str:
    t = v.type.tensor_type
    dims = [str(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?") for d in t.shape.dim]
    return f"{v.name}: {onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)}[{', '.join(dims)}]"


def _listed(items: list[str]) -> list[str]:
    more = len(items) - SHOWN
    return [f"    {i}" for i in items[:SHOWN]] + ([f"    (+{more} more)"] if more > 0 else [])


def coverage_lines(rec: ExportRecord) -> list[str]:
    """What ORT runs in integers and what in float (by node), and what the quantizer placement kept
    float on purpose with its reason; nothing for float exports."""
    if rec.integer_nodes is None:
        return []
    cov = Coverage(rec.integer_ops, rec.float_nodes)
    kinds = ", ".join(f"{k} x{v}" for k, v in rec.integer_ops.items()) or "none: ORT runs it in float"
    lines = [
        f"  integer kernels in ORT's optimized graph: {rec.integer_nodes} ({kinds})",
        f"  integer coverage: {cov.share:.2f} of Conv/MatMul/Gemm/Add work ({cov.integer} integer, "
        f"{len(rec.float_nodes)} float)",
    ]
    if rec.float_nodes:
        lines.append(f"  still float in ORT ({len(rec.float_nodes)}, OpType:node):")
        lines += _listed(rec.float_nodes)
    else:
        lines.append("  still float in ORT: none")
    if rec.kept_float:
        lines.append(f"  kept float, each for its reason ({len(rec.kept_float)}, op call: reason):")
        lines += _listed([f"{k}: {v}" for k, v in rec.kept_float.items()])
    return lines


def _run_record(path: Path) -> ExportRecord | None:
    """The export record a run folder's report.json holds for the ONNX file ``path`` (None if the
    file is not in a run folder)."""
    for folder in (path.parent, path.parent.parent):
        report = folder / "report.json"
        if not report.is_file():
            continue
        for rec in _records(report, _read_report(report)):
            if rec.path.name == path.name:
                return rec
    return None


def _read_report(report: Path) -> dict[str, Any]:
    """A run's report.json as a mapping; RecipeError (one line) for anything unreadable."""
    try:
        data = load_json_file(report, what="run report")
    except (OSError, ValueError) as exc:
        raise RecipeError(f"{report}: not a readable run report ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{report}: not a readable run report (not a JSON object)")
    return data


def _records(report: Path, data: dict[str, Any]) -> list[ExportRecord]:
    try:
        return [ExportRecord.model_validate(e) for e in data.get("exports", [])]
    except ValidationError as exc:
        raise RecipeError(f"{report}: not a readable run report ({str(exc).splitlines()[0]})") from None


def inspect_onnx(path: Path) -> str:
    """A multi-line description of the ONNX model at ``path``."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"{path}: file not found")
    rec = describe.describe_onnx(path)
    run = _run_record(path)
    if run is not None:
        rec.kept_float = {**rec.kept_float, **run.kept_float}
    m = onnx.load(str(path), load_external_data=False)
    init = {t.name for t in m.graph.initializer}
    ops = Counter(n.op_type for n in m.graph.node)
    lines = [
        f"{path}: {rec.format}, opset {rec.opset}, {rec.size_bytes / 1e6:.3f} MB, "
        f"{'dynamic' if rec.dynamic_batch else 'static'} batch",
        "  inputs:  " + "; ".join(_shape(i) for i in m.graph.input if i.name not in init),
        "  outputs: " + "; ".join(_shape(o) for o in m.graph.output),
        "  ops: " + ", ".join(f"{k} x{v}" for k, v in ops.most_common()),
        *coverage_lines(rec),
    ]
    if m.metadata_props:
        lines.append("  metadata: " + ", ".join(f"{p.key}={p.value}" for p in m.metadata_props))
    return "\n".join(lines)


def inspect_run(folder: Path) -> str:
    """The exports of a run folder (``compress apply --out``) from its report.json: file, format,
    size, and the integer coverage lines of each."""
    report = Path(folder) / "report.json"
    if not report.is_file():
        raise RecipeError(f"{folder}: not a run folder (no report.json in it)")
    data = _read_report(report)
    name = (data.get("recipe") or {}).get("name", "?")
    recs = _records(report, data)
    lines = [f"{folder}: run of recipe '{name}'" + (f", FAILED: {data['error']}" if data.get("error") else "")]
    if not recs:
        lines.append("  no exports")
    for rec in recs:
        lines.append(f"  {rec.role}: {rec.path.name}: {rec.format}, {rec.size_bytes / 1e6:.3f} MB")
        lines += ["  " + ln for ln in coverage_lines(rec)]
    return "\n".join(lines)
