"""The README quickstart as printed: does its int8 file run faster than fp32, and what does it print?

    python -m benchmarks.quickstart [--runs 5]   # writes the `quickstart` section of RESULTS.md

Runs ``compress apply recipes/quickstart.yaml --out runs/quickstart --overwrite`` ``--runs`` times,
each in a fresh folder with the installed command and default settings (ORT's default threads, the
recipe's 5 warm-up and 20 timed runs), and records its wall time, accuracies, the int8-over-fp32
speedups its report holds at batch 1 and 32, and every warning line it printed. Then the last run's
two ONNX files are timed side by side in this process (rounds of interleaved runs after warm-up,
the speedup a ratio per round, its median over rounds) at ORT's default threads and at 1 thread,
and the shipped cost tables' model-level predictions for the recipe's model are listed, one per
table, with the table a CPU without VNNI reads.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
COMMAND = ["apply", "recipes/quickstart.yaml", "--out", "runs/quickstart", "--overwrite"]
#: side-by-side timing of the last run's files: rounds x interleaved runs per batch, after warm-up
ROUNDS, RUNS, WARMUP = 7, 200, 50


def _compress() -> list[str]:
    exe = shutil.which("compress", path=str(Path(sys.executable).parent))
    return [exe] if exe else [sys.executable, "-m", "compress.cli"]


def run_once(d: Path) -> dict[str, Any]:
    """One quickstart run as the README prints it, in folder ``d``: wall time, figures, warnings."""
    t0 = time.perf_counter()
    proc = subprocess.run([*_compress(), *COMMAND], cwd=d, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"quickstart failed (exit {proc.returncode}): {proc.stderr[-800:]}")
    rep = json.loads((d / "runs" / "quickstart" / "report.json").read_text())
    final = next(v for v in rep["validation"] if v["role"] == "final")
    # console warnings: the summary's `warning:` lines (stdout) and WARNING log records (stderr)
    warnings = [ln.strip() for ln in proc.stdout.splitlines() if ln.strip().startswith("warning:")]
    warnings += [ln.strip() for ln in proc.stderr.splitlines() if re.match(r"^(\S+ )?WARNING ", ln)]
    train = re.search(r"baseline trained: .*?, ([^,]+)$", (d / "runs" / "quickstart" / "run.log").read_text(), re.M)
    return {
        "wall_s": wall, "train": train.group(1) if train else None,
        "fp32_accuracy": rep["baseline"]["accuracy"], "int8_accuracy": final["accuracy"],
        "precision": final["precision"], "threads": final["threads"],
        "b1_speedup": final["speedup"]["1"], "b32_speedup": final["speedup"]["32"],
        "warnings": warnings,
    }


def side_by_side(fp32: Path, int8: Path, threads: int | None) -> dict[int, dict[str, float]]:
    """Per batch: median fp32 and int8 ms over all rounds, and the median and interval of the per-round
    speedups (each round a side-by-side median of ``RUNS`` interleaved runs)."""
    import numpy as np
    from compress.export.validation.measure import time_side_by_side
    from compress.export.validation.runtimes import load_session

    from benchmarks._results import median_interval

    sessions = {"fp32": load_session("onnxruntime", fp32, threads=threads),
                "int8": load_session("onnxruntime", int8, threads=threads)}
    x = np.random.default_rng(0).standard_normal((32, 1, 8, 8)).astype(np.float32)
    feeds = {sessions["fp32"].input_names[0]: x}
    time_side_by_side(sessions, feeds, [1, 32], WARMUP, 1)  # warm-up
    per: dict[int, dict[str, list[float]]] = {b: {"fp32": [], "int8": [], "ratio": []} for b in (1, 32)}
    for _ in range(ROUNDS):
        lat, _ = time_side_by_side(sessions, feeds, [1, 32], 5, RUNS)
        for b in (1, 32):
            f, i = lat["fp32"][b], lat["int8"][b]
            assert f is not None and i is not None
            per[b]["fp32"].append(f)
            per[b]["int8"].append(i)
            per[b]["ratio"].append(f / i)
    out = {}
    for b, v in per.items():
        lo, hi = median_interval(v["ratio"])
        out[b] = {"fp32_ms": statistics.median(v["fp32"]), "int8_ms": statistics.median(v["int8"]),
                  "speedup": statistics.median(v["ratio"]), "low": lo, "high": hi}
    return out


def predictions() -> list[dict[str, Any]]:
    """The model-level prediction (quantization/placement/model_cost.py) for the recipe's model at batch
    1 and 32 with each shipped table, and which table placement reads on a CPU without VNNI."""
    import torch
    from compress.quantization.placement.cost_table import shipped_tables, table_for
    from compress.quantization.placement.model_cost import predict
    from compress.quantization.placement.trace import trace_ops
    from torch import nn

    import compress

    recipe = compress.load_recipe("quickstart")
    model = compress.load_model(recipe.model).eval()
    x = torch.randn(8, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    graph = trace_ops(model, (x,), {})
    layers = {n: m for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))}
    avx2 = {v: table_for("AVX2 without VNNI", v) for v in ("AMD EPYC", "Intel Xeon")}
    rows = []
    for key, table in sorted(shipped_tables().items()):
        costs = predict(graph, layers, table, batches=[1, 32], example_batch=8).costs
        read_by = [f"AVX2 {v.split()[0]}" for v, t in avx2.items() if t is table]
        rows.append({"table": key, "machine": table.machine.split(",")[0],
                     "predicted_b1": costs[1].speedup if 1 in costs else None,
                     "predicted_b32": costs[32].speedup if 32 in costs else "not predicted",
                     "also read by": ", ".join(read_by) or "-"})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="quickstart runs (each a fresh folder)")
    args = ap.parse_args(argv)
    from benchmarks._results import table, write_section

    load0 = os.getloadavg()[0]
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.runs):
            d = Path(tmp) / f"r{k}"
            d.mkdir()
            runs.append(run_once(d))
            print(json.dumps(runs[-1]), flush=True)
        out = d / "runs" / "quickstart" / "export"
        fp32, int8 = out / "quickstart.fp32.onnx", out / "quickstart.int8.onnx"
        timed = {"default threads": side_by_side(fp32, int8, None), "1 thread": side_by_side(fp32, int8, 1)}
    load1 = os.getloadavg()[0]
    pred = predictions()

    def med(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    warnings = sorted({w for r in runs for w in r["warnings"]})
    rows = [{"run": i + 1, "wall_s": r["wall_s"], "baseline training": r["train"], "fp32 acc": r["fp32_accuracy"],
             "int8 acc": r["int8_accuracy"], "file": r["precision"], "b1_speedup": r["b1_speedup"],
             "b32_speedup": r["b32_speedup"], "warnings": len(r["warnings"])} for i, r in enumerate(runs)]
    rows.append({"run": "median", "wall_s": med("wall_s"), "b1_speedup": med("b1_speedup"),
                 "b32_speedup": med("b32_speedup")})
    sbs = [{"threads": th, "batch": b, "fp32_ms": v["fp32_ms"], "int8_ms": v["int8_ms"], "speedup": v["speedup"],
            "95% interval": f"{v['low']:.2f}-{v['high']:.2f}"} for th, by_b in timed.items() for b, v in by_b.items()]
    md = [
        "## The README quickstart as printed (`python -m benchmarks.quickstart`)", "",
        f"`compress {' '.join(COMMAND)}` run {args.runs} times, each in a fresh folder (the installed command, "
        "default settings: ORT's default threads, the recipe's 5 warm-up and 20 timed runs per batch). "
        "`b1_speedup`, `b32_speedup`: the int8 file's speedup over the fp32 file that the run reports (its "
        "console line), measured side by side by its validation; `wall_s`: the whole command.", "",
        table(rows, ["run", "wall_s", "baseline training", "fp32 acc", "int8 acc", "file", "b1_speedup",
                     "b32_speedup", "warnings"]), "",
        f"The last run's two files timed side by side here: {ROUNDS} rounds of {RUNS} interleaved runs per batch "
        f"after {WARMUP} warm-up; times are medians over all rounds, `speedup` the median of the per-round ratios "
        "(fp32 / int8), with a distribution-free 95% interval for it:", "",
        table(sbs, ["threads", "batch", "fp32_ms", "int8_ms", "speedup", "95% interval"]), "",
        "The cost tables' model-level prediction for the recipe's model (quantization/placement/model_cost.py; "
        "int8 over fp32, every shipped table; `not predicted`: a layer is more than 8x the work from every "
        "measured shape). No table was measured without VNNI (ORT picks its kernels from CPUID, which this VM "
        "cannot mask); such a CPU reads the VNNI table of its vendor, as the last column says:", "",
        table(pred, ["table", "machine", "predicted_b1", "predicted_b32", "also read by"]), "",
        "Console warnings printed: " + ("; ".join(f"`{w}`" for w in warnings) if warnings else "none") + ".", "",
        f"Load average {load0:.1f} at the start, {load1:.1f} at the end (2 cores shared with other jobs).",
    ]
    write_section("quickstart", "\n".join(md), {"runs": runs, "side_by_side": timed, "predicted": pred,
                                               "load": [load0, load1]})
    print("\n".join(md))


if __name__ == "__main__":
    main()
