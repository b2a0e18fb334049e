"""Build the ORT CPU cost table that placement reads by default (quantization/placement/cost_table.py).

For a grid of Linear, Conv2d and depthwise Conv2d shapes: the one-layer float and QDQ graphs that
``speed_check`` builds (quantization/placement/speed_check.py), both between a Q and a DQ standing for
int8 neighbours, run in ORT with per-node profiling (1 thread), medians after warm-up; each row
holds what each choice costs inside an int8 model. The rows are written, under this machine's int8
instruction set (compress.core.machine.int8_isa), into quantization/placement/data/ort_cpu_costs.json
(rows of other ISAs already there are kept) and a summary into benchmarks/RESULTS.md.

Run: ``nice -n 10 python -m benchmarks.cost_table`` (a few minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks._results import write_section
from compress.core.machine import cpu_name, int8_isa
from quantization.placement.cost_table import TABLE_FILE, isa_key, layer_shape
from quantization.placement.speed_check import _graphs, _island_cost, _profile

SECTION = "cost_table"
HEADING = "## ORT CPU cost table: default keep-float decisions"


def grid(quick: bool = False) -> list[tuple[nn.Module, list[int]]]:
    """(layer, input shape) pairs covering toy to serving sizes."""
    out: list[tuple[nn.Module, list[int]]] = []
    rows = (16, 128, 1024) if not quick else (16, 256)
    feats = (16, 64, 256, 768) if not quick else (16, 256)
    for m, k, n in itertools.product(rows, feats, feats):
        out.append((nn.Linear(k, n), [m, k]))
    chans = (3, 16, 64, 256) if not quick else (3, 64)
    for cin, cout, ks, hw in itertools.product(chans, (16, 64, 256) if not quick else (16, 64), (1, 3),
                                               (8, 28) if not quick else (16,)):
        out.append((nn.Conv2d(cin, cout, ks, padding=ks // 2), [8, cin, hw, hw]))
    for c, ks, hw in itertools.product((16, 64, 256) if not quick else (16, 128), (3, 5), (8, 28) if not quick else (16,)):
        out.append((nn.Conv2d(c, c, ks, padding=ks // 2, groups=c), [8, c, hw, hw]))
    return out


def measure(m: nn.Module, shape: list[int], runs: int, tmp: Path) -> dict[str, Any] | None:
    built = _graphs(m, shape)
    key = layer_shape(m, shape)
    if built is None or key is None:
        return None
    f, q, in_shape = built
    costs = [_island_cost(_profile(g, in_shape, threads=1, runs=runs, tmp=tmp, tag=tag), kept_float=tag == "float",
                          model_input=False, model_output=False, tag=tag)
             for g, tag in ((f, "float"), (q, "int8"))]
    return {"kind": key.kind, "features": list(key.features), "float_op": costs[0][0], "float_us": round(costs[0][1], 2),
            "int8_op": costs[1][0], "int8_us": round(costs[1][1], 2)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=12)
    ap.add_argument("--quick", action="store_true", help="a small grid (a smoke run)")
    ap.add_argument("--out", type=Path, default=TABLE_FILE)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    isa = int8_isa()
    key = isa_key(isa)
    if key is None:
        raise SystemExit(f"no cost-table key for this CPU's int8 instructions ({isa})")
    load = os.getloadavg()[0]
    t0 = time.time()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for m, shape in grid(args.quick):
            r = measure(m, shape, args.runs, Path(d))
            if r is not None:
                rows.append(r)
    machine = f"{cpu_name()} ({isa}), {os.cpu_count()} cores, load average {load:.1f} at the start"
    data = json.loads(args.out.read_text()) if args.out.exists() else {}
    data.setdefault("onnxruntime", {})[key] = {"runtime": "onnxruntime", "isa": isa, "machine": machine,
                                               "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                               "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    slower = [r for r in rows if r["int8_us"] >= r["float_us"]]
    by_kind = {k: [r for r in rows if r["kind"] == k] for k in ("linear", "conv", "depthwise")}
    lines = [HEADING, "", f"`nice -n 10 python -m benchmarks.cost_table` on {machine}; ORT 1 thread, {args.runs} profiled runs "
             f"per graph (median after 2 warm-up runs), {len(rows)} layer shapes in {time.time() - t0:.0f} s; written to "
             f"`{args.out.relative_to(Path(__file__).parents[1]) if args.out.is_relative_to(Path(__file__).parents[1]) else args.out}` "
             f"under `{key}`.", "",
             "| kind | shapes | int8 slower than float | their features (in, out, kernel, pixels / rows, in, out) |",
             "|---|---|---|---|"]
    for k, rs in by_kind.items():
        bad = [r for r in rs if r in slower]
        feats = "; ".join("x".join(f"{f:g}" for f in r["features"]) + f" ({r['float_us'] / max(r['int8_us'], 1e-9):.2f}x)"
                          for r in bad[:12])
        lines.append(f"| {k} | {len(rs)} | {len(bad)} | {feats}{' ...' if len(bad) > 12 else ''} |")
    write_section(SECTION, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
