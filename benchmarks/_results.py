"""Shared helpers for benchmark scripts: machine description and RESULTS.md sections.

Each benchmark owns one section of benchmarks/RESULTS.md, delimited by HTML comments, so
benchmarks can be rerun independently without clobbering each other's figures.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
RESULTS_DIR = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    """CPU model, cores, memory, GPU and library versions of the machine running a benchmark."""
    from compress.report import machine as run_machine
    from compress.report import versions

    v = versions()
    return {**run_machine(), "python": v["python"], "torch": v.get("torch"), "onnxruntime": v.get("onnxruntime")}


def machine_line(m: dict[str, Any] | None = None) -> str:
    m = m or machine()
    gpu = f", GPU {m['gpu']}" if m.get("gpu") else ", no GPU"
    return (
        f"{m['cpu']}" + (f" ({m['int8_isa']})" if m.get("int8_isa") else "") + f", {m['cores']} cores, {m['memory_gib']} GiB{gpu}; "
        f"Python {m['python']}, torch {m['torch']}" + (f", onnxruntime {m['onnxruntime']}" if "onnxruntime" in m else "")
    )


def median_interval(xs: list[float], level: float = 0.95) -> tuple[float, float]:
    """A distribution-free interval for the median of ``xs`` at confidence ``level``: the order
    statistics ``x_(j)`` and ``x_(n+1-j)`` where the count of samples below the median is
    Binomial(n, 1/2); too few samples for ``level`` give the whole range (7 give 98.4%)."""
    s = sorted(xs)
    n = len(s)
    if n == 0:
        raise ValueError("median_interval: no samples")
    tail, j = 0.0, 0
    for k in range(n + 1):
        p = math.comb(n, k) / 2**n
        if tail + p > (1 - level) / 2:
            break
        tail, j = tail + p, k + 1
    return (s[0], s[-1]) if j == 0 else (s[j - 1], s[n - j])


def median_time_ms(fn: Callable[[], Any], *, warmup: int = 5, runs: int = 20) -> float:
    """Median wall time of ``fn`` in milliseconds after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def write_section(name: str, markdown: str, data: Any = None, *, measured_on: dict[str, Any] | None = None) -> None:
    """Replace (or append) the section ``name`` of RESULTS.md; also write results/NAME.json.

    ``measured_on``: the machine record of the run that measured the figures, when the section is
    rewritten elsewhere (rows from a lent GPU machine merged here)."""
    header = "# Benchmark results\n\nEach section is written by the script named in it; figures are measured, never edited by hand.\n"
    text = RESULTS.read_text() if RESULTS.exists() else header
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    body = f"<!-- begin:{name} -->\n{markdown.rstrip()}\n\n_Machine: {machine_line(measured_on)}. Run {stamp}._\n<!-- end:{name} -->"
    pattern = re.compile(rf"<!-- begin:{re.escape(name)} -->.*?<!-- end:{re.escape(name)} -->", re.S)
    text = pattern.sub(lambda _: body, text) if pattern.search(text) else text.rstrip() + "\n\n" + body + "\n"
    RESULTS.write_text(text)
    if data is not None:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        (RESULTS_DIR / f"{name}.json").write_text(json.dumps({"machine": measured_on or machine(), **data}, indent=2, default=str))


def calib_section(base: str, calib: int, default: int = 64) -> str:
    """A calibration-dependent benchmark's section (and JSON) name: ``base`` at the default number of
    calibration windows, ``base_calibN`` otherwise, so a run on less data never replaces the main table."""
    return base if calib == default else f"{base}_calib{calib}"


def table(rows: list[dict[str, Any]], columns: list[str] | None = None) -> str:
    """A markdown table of ``rows``."""
    if not rows:
        return "_no rows_\n"
    cols = columns or list(rows[0])
    def fmt(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def gap_closed(value: float, rtn: float | None, base: float) -> str:
    """The share of round-to-nearest's perplexity gap over ``base`` (fp32) that ``value`` closes, as
    ``"45%"``; ``-`` when there is no RTN row or no gap."""
    if rtn is None or rtn <= base:
        return "-"
    return f"{(rtn - value) / (rtn - base):.0%}"


def gpu_bench_device(prog: str, interpret_smoke: bool, *, needs_triton: bool = True) -> Any:
    """The ``torch.device`` a GPU benchmark runs on, or None after one line on stderr (the caller exits 2).

    ``interpret_smoke``: the CPU under ``TRITON_INTERPRET=1`` (tiny shapes check the script), set here
    before the kernels are first imported because ``triton.jit`` reads it then; otherwise CUDA."""
    import os
    import sys

    import torch

    if interpret_smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        print(f"{prog}: needs a CUDA GPU (none found); --interpret-smoke checks the script on CPU", file=sys.stderr)
        return None
    if needs_triton:
        from compress.quantization.lowering.kernels import triton_available

        if not triton_available():
            print(f"{prog}: needs Triton: pip install -e '.[triton]'", file=sys.stderr)
            return None
    gemm = sys.modules.get("compress.quantization.lowering.kernels.gemm")
    if interpret_smoke and gemm is not None and not getattr(gemm, "INTERPRETED", False):
        print(f"{prog}: kernels were loaded before TRITON_INTERPRET was set", file=sys.stderr)
        return None
    return torch.device("cpu" if interpret_smoke else "cuda")
