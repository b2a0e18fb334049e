"""The run report: typed, written as report.json and rendered as report.md with a PNG plot."""

from __future__ import annotations

import contextlib
import json
import logging
import platform
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from compress.core.io import atomic_write_text
from compress.core.machine import cpu_name, int8_isa
from compress.export.records import ExportRecord, ThresholdRecord, ValidationRecord

log = logging.getLogger(__name__)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelFigures(_Model):
    """Accuracy and size of the model at one point of the pipeline. ``size_bytes`` is the deployed
    size of its weights (quantized weights at their bit width: compress.core.size.deployed_size_bytes);
    the exported files' sizes are in ``Report.exports``."""

    accuracy: float | None = None
    params: int | None = None
    macs: int | None = None
    size_bytes: int | None = None


class StageReport(_Model):
    """One stage: its name, its modifiers' metrics, the model's figures after it, its tables."""

    name: str
    metrics: dict[str, Any] = Field(default_factory=dict)
    model: ModelFigures = Field(default_factory=ModelFigures)
    tables: dict[str, list[dict[str, Any]]] = Field(default_factory=dict)
    artifacts: list[str] = Field(default_factory=list)
    seconds: float | None = None


class Report(_Model):
    """Everything a run measured. ``report.json`` is this model dumped as JSON."""

    recipe: dict[str, Any]
    versions: dict[str, str] = Field(default_factory=dict)
    machine: dict[str, Any] = Field(default_factory=dict)
    metric: str = "accuracy"
    #: the data as built: source, task, split sizes and what the source states (text_lm: ``bos``)
    data: dict[str, Any] = Field(default_factory=dict)
    baseline: ModelFigures = Field(default_factory=ModelFigures)
    stages: list[StageReport] = Field(default_factory=list)
    final: ModelFigures = Field(default_factory=ModelFigures)
    exports: list[ExportRecord] = Field(default_factory=list)
    validation: list[ValidationRecord] = Field(default_factory=list)
    thresholds: list[ThresholdRecord] = Field(default_factory=list)
    seconds: float | None = None
    #: the run's peak resident memory in MB (the process's ``ru_maxrss`` when the report was written,
    #: so in a process that ran more before, its peak)
    peak_rss_mb: float | None = None
    #: set when the run failed: what raised (the report then holds what was measured before)
    error: str | None = None

    @property
    def passed(self) -> bool:
        """True when the run finished and every threshold held."""
        return self.error is None and all(t.passed for t in self.thresholds)

    def write(self, out_dir: Path) -> None:
        """Write report.json, report.md and the accuracy-vs-size plot into ``out_dir``."""
        atomic_write_text(out_dir / "report.json", json.dumps(self.model_dump(mode="json"), indent=2) + "\n")
        plot = _plot(self, out_dir / "accuracy_vs_size.png")
        atomic_write_text(out_dir / "report.md", render_markdown(self, plot_name=plot.name if plot else None))


def versions() -> dict[str, str]:
    """Versions of the libraries that decide results."""
    import importlib.metadata as md

    from compress.core.version import __version__

    out = {"python": platform.python_version(), "compress": __version__}
    for dist in ("torch", "onnx", "onnxruntime", "onnxscript", "transformers", "openvino", "triton"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            continue
    return out


def machine() -> dict[str, Any]:
    """CPU, cores, memory and GPU of this machine."""
    import os

    import torch

    info: dict[str, Any] = {"cpu": cpu_name(), "cores": os.cpu_count(), "platform": platform.platform()}
    isa = int8_isa()
    if isa is not None:
        info["int8_isa"] = isa
    with contextlib.suppress(ValueError, OSError):
        info["memory_gib"] = round(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30, 1)
    info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return info


# ---- rendering ------------------------------------------------------------------------------


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, int) and abs(v) >= 10000:
        return f"{v:,}"
    if isinstance(v, dict):
        return ", ".join(f"{k}: {_fmt(x)}" for k, x in v.items())
    if isinstance(v, list):
        return "; ".join(_fmt(x) for x in v)
    return str(v)


def md_table(rows: list[dict[str, Any]], columns: list[str] | None = None) -> str:
    """A markdown table (columns default to the union of the rows' keys, in order)."""
    if not rows:
        return ""
    cols = columns or list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r.get(c)).replace("|", "/") for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def render_markdown(report: Report, *, plot_name: str | None = None) -> str:
    """report.md: the same content as report.json, as tables."""
    r = report
    name = r.recipe.get("name", "recipe")
    out = [f"# compress run: {name}\n"]
    if r.recipe.get("description"):
        out.append(f"{r.recipe['description']}\n")
    if r.error:
        out.append(f"**The run FAILED**: {r.error} (the traceback is in run.log).\n")
    if r.error:  # a failed run checked nothing: no verdict
        verdict = "not checked (the run failed)"
    elif not r.thresholds:
        verdict = "none set"
    else:
        verdict = "all passed" if all(t.passed for t in r.thresholds) else "THRESHOLDS MISSED"
    out.append(f"Metric: `{r.metric}`. Thresholds: {verdict}."
               + (f" Run time {r.seconds:.1f} s." if r.seconds else "")
               + (f" Peak RSS {r.peak_rss_mb:,.0f} MB." if r.peak_rss_mb else "") + "\n")
    if r.data:
        out.append("Data: " + _fmt(r.data) + ".\n")
    out.append("## Model\n")
    files = {e.role: e.size_bytes for e in r.exports}
    rows = [{"model": "baseline", **r.baseline.model_dump(), "onnx_bytes": files.get("baseline")}]
    rows += [{"model": f"after {s.name}", **s.model.model_dump()} for s in r.stages]
    rows.append({"model": "final", **r.final.model_dump(), "onnx_bytes": files.get("final")})
    out.append(md_table(rows, ["model", "accuracy", "params", "macs", "size_bytes", "onnx_bytes"]))
    out.append("`size_bytes`: the weights as deployed (quantized weights at their bit width); "
               "`onnx_bytes`: the exported file.\n")
    if plot_name:
        out.append(f"\n![accuracy vs size]({plot_name})\n")
    for s in r.stages:
        out.append(f"\n## Stage `{s.name}`\n")
        if s.metrics:
            out.append(md_table([{"metric": k, "value": v} for k, v in s.metrics.items()]))
        for tname, trows in s.tables.items():
            out.append(f"\n**{tname}**\n\n" + md_table(trows))
        for a in s.artifacts:
            out.append(f"\n![{Path(a).stem}]({a})\n")
    if r.exports:
        out.append("\n## Exports\n")
        out.append(md_table([e.model_dump(mode="json") for e in r.exports],
                            ["role", "path", "format", "size_bytes", "integer_nodes"]))
    if r.validation:
        out.append("\n## Validation\n")
        gen = any(v.generation is not None for v in r.validation)
        out.append(md_table([v.model_dump(mode="json") for v in r.validation],
                            ["runtime", "role", "precision", "parity", "generation", "size_ratio"] if gen else
                            ["runtime", "role", "precision", "accuracy", "parity", "latency_ms", "speedup", "notes"]))
    if r.thresholds:
        out.append("\n## Thresholds\n")
        out.append(md_table([t.model_dump() for t in r.thresholds], ["name", "limit", "value", "passed", "where"]))
    out.append("\n## Environment\n")
    out.append(md_table([{"what": k, "value": v} for k, v in {**r.versions, **r.machine}.items()]))
    return "\n".join(out)


def _fit(values: list[float], *, floor: float | None = None) -> tuple[float, float]:
    """Axis limits around ``values`` with a margin (matplotlib pads to round ticks, past 1.0 for
    accuracy, and a flat series gets a visible span)."""
    lo, hi = min(values), max(values)
    pad = (hi - lo) * 0.1 or max(abs(hi) * 0.05, 1e-3)
    low = lo - pad if floor is None else max(floor, lo - pad)
    return low, hi + pad


def _plot(report: Report, path: Path) -> Path | None:
    points = [("baseline", report.baseline)] + [(s.name, s.model) for s in report.stages]
    pts = [(n, f.size_bytes, f.accuracy) for n, f in points if f.size_bytes and f.accuracy is not None]
    if len(pts) < 1:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plotting is a nicety; the tables carry the numbers
        log.warning("matplotlib missing: report.md has no plot")
        return None
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    xs = [p[1] / 1024 for p in pts]
    ys = [p[2] for p in pts]
    ax.plot(xs, ys, "-o")
    for (n, _, _), x, y in zip(pts, xs, ys):
        ax.annotate(n, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlim(*_fit(xs, floor=0.0))
    ax.set_ylim(*_fit(ys))
    ax.set_xlabel("model size (KiB, weights as deployed)")
    ax.set_ylabel(report.metric)
    ax.set_title(f"{report.recipe.get('name', 'run')}: {report.metric} vs size across stages")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    try:
        fig.savefig(tmp)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        plt.close(fig)
    return path
