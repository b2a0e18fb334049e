"""Build the ORT CPU cost table that placement reads by default (quantization/placement/cost_table.py).

For a grid of Linear, Conv2d and depthwise Conv2d shapes (and attention's products of two activations,
``matmul`` rows: float MatMul against QLinearMatMul): the one-layer float and QDQ graphs that
``speed_check`` builds (quantization/placement/speed_check.py), both between a Q and a DQ standing for
int8 neighbours, run in ORT with per-node profiling (1 thread), medians after warm-up; each row
holds what each choice costs inside an int8 model. Besides the layers, the model-level costs no
layer row holds, under ``boundary``: entering int8 (the QuantizeLinear of a float tensor, and for a
conv the NCHW -> NHWC transpose of QLinearConv's layout) and leaving it (transpose back,
DequantizeLinear), by element count, from the same int8 profiles; residual adds, ORT's float Add
against its QLinearAdd; and what the profiler itself adds to each node's time. The rows are written, under this machine's int8
instruction set and CPU vendor (``vnni:intel``; compress.core.machine), into
quantization/placement/data/ort_cpu_costs.json (tables of other CPUs already there are kept), and a
summary of every table in the file into benchmarks/RESULTS.md.

Run: ``nice -n 10 python -m benchmarks.cost_table`` (a few minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from compress.quantization.placement.cost_table import TABLE_FILE, layer_shape, table_key
from compress.quantization.placement.speed_check import _graphs, _island_cost, _profile, boundary_costs
from torch import nn

from benchmarks._results import write_section
from compress.core.machine import cpu_name, int8_isa
from compress.core.ort import session_options

SECTION = "cost_table"
HEADING = "## ORT CPU cost table: default keep-float decisions"


def grid(quick: bool = False) -> list[tuple[nn.Module, list[int]]]:
    """(layer, input shape) pairs covering toy to serving sizes, and batch 1 on small images (the
    quickstart's 8x8 digits: 64, 16 and 4 pixels after its strides)."""
    out: list[tuple[nn.Module, list[int]]] = []
    rows = (1, 16, 128, 1024, 8192) if not quick else (1, 256)
    feats = (16, 64, 256, 768) if not quick else (16, 256)
    for m, k, n in itertools.product(rows, feats, feats):
        out.append((nn.Linear(k, n), [m, k]))
    chans = (3, 16, 64, 256) if not quick else (3, 64)
    sizes = ((8, 8), (8, 28), (1, 2), (1, 4), (1, 8)) if not quick else ((8, 16), (1, 4))
    for cin, cout, ks, (b, hw) in itertools.product(chans, (16, 64, 256) if not quick else (16, 64), (1, 3), sizes):
        out.append((nn.Conv2d(cin, cout, ks, padding=ks // 2), [b, cin, hw, hw]))
    dw_sizes = ((8, 8), (8, 28), (1, 4), (1, 8)) if not quick else ((8, 16), (1, 4))
    for c, ks, (b, hw) in itertools.product((16, 64, 256) if not quick else (16, 128), (3, 5), dw_sizes):
        out.append((nn.Conv2d(c, c, ks, padding=ks // 2, groups=c), [b, c, hw, hw]))
    if quick:
        return out
    # serving sizes of small vision nets (batch 32 of 64x64 images): stems of 3 channels (3x3 and
    # 7x7) and the first stage at 32k pixels, wide 1x1 heads (MobileNet's 1280), depthwise at 32k pixels
    for cin, cout, ks in [(3, 16, 3), (3, 64, 3), (3, 16, 7), (3, 64, 7), (16, 16, 3), (16, 64, 1), (64, 16, 1)]:
        out.append((nn.Conv2d(cin, cout, ks, padding=ks // 2), [32, cin, 32, 32]))
    for cin, (b, hw) in itertools.product((64, 256), ((1, 4), (8, 8))):
        out.append((nn.Conv2d(cin, 1024, 1), [b, cin, hw, hw]))
    for c, ks in itertools.product((16, 64), (3, 5)):
        out.append((nn.Conv2d(c, c, ks, padding=ks // 2, groups=c), [32, c, 32, 32]))
    # squeeze-and-excitation 1x1 convs on pooled 1x1 maps (RegNet, MobileNetV3, EfficientNet): 4:1
    # squeezes and 1:4 excites, one pixel per image
    for (cin, cout), b in itertools.product([(16, 4), (32, 8), (64, 16), (256, 64), (4, 16), (8, 32), (16, 64), (64, 256)],
                                            (1, 8, 32)):
        out.append((nn.Conv2d(cin, cout, 1), [b, cin, 1, 1]))
    # vocabulary heads: wide outputs
    for m, k, n in itertools.product((16, 128, 1024), (64, 256, 768), (2048, 8192)):
        out.append((nn.Linear(k, n), [m, k]))
    return out


def add_grid(quick: bool = False) -> list[list[int]]:
    """Shapes of residual adds: feature maps (batch, channels, pixels) and token rows."""
    maps = [[b, c, hw, hw] for b, c, hw in itertools.product((1, 8), (16, 64, 256), (2, 8, 28))]
    tokens = [[r, f] for r, f in itertools.product((1, 16, 128, 1024), (64, 256, 768))]
    return (maps + tokens) if not quick else [[1, 16, 8, 8], [128, 256]]


def measure(m: nn.Module, shape: list[int], runs: int, tmp: Path) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
    """The layer's row, and its two boundary rows (entering int8 at its input, leaving at its output)."""
    built = _graphs(m, shape)
    key = layer_shape(m, shape)
    if built is None or key is None:
        return None
    f, q, in_shape = built
    prof = {tag: _profile(g, in_shape, threads=1, runs=runs, tmp=tmp, tag=tag) for g, tag in ((f, "float"), (q, "int8"))}
    costs = {tag: _island_cost(p, kept_float=tag == "float", model_input=False, model_output=False, tag=tag)
             for tag, p in prof.items()}
    # the float kernel alone (no conversions around it): what the layer costs in the fp32 model
    kernel = _island_cost(prof["float"], kept_float=True, model_input=True, model_output=True, tag="float")[1]
    enter, leave = boundary_costs(prof["int8"], tag="int8")
    layout = "linear" if key.kind == "linear" else "conv"
    with torch.no_grad():  # a strided conv writes fewer pixels than it reads
        out_elems = m(torch.zeros(in_shape)).numel()
    bounds = [{"kind": f"enter:{layout}", "features": [float(math.prod(in_shape))], "us": round(enter, 2)},
              {"kind": f"leave:{layout}", "features": [float(out_elems)], "us": round(leave, 2)}]
    return ({"kind": key.kind, "features": list(key.features), "float_op": costs["float"][0],
             "float_us": round(costs["float"][1], 2), "float_kernel_us": round(kernel, 2), "int8_op": costs["int8"][0], "int8_us": round(costs["int8"][1], 2)},
            bounds)


#: elementwise ops with two activation inputs that ORT runs on int8 codes (QLinearAdd, QLinearMul),
#: measured by element count for the model-level check
ELEMENTWISE = ("add", "mul")


def _qdq_graph(op_type: str, a: list[int], b: list[int], out: list[int], out_scale: float) -> Any:
    """``op_type`` of two activations between int8 neighbours: Q/DQ on both inputs and the output.
    ORT runs the QDQ form as its integer kernel (QLinearAdd, QLinearMul, QLinearMatMul); the float one
    (QDQ fusion off) as the float op between the same conversions."""
    from onnx import TensorProto, helper, numpy_helper

    x = [helper.make_tensor_value_info(n, TensorProto.FLOAT, sh) for n, sh in (("a", a), ("b", b))]
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, out)
    inits = [numpy_helper.from_array(np.array(np.float32(s)), f"s{i}") for i, s in enumerate((4 / 255, 5 / 255, out_scale))]
    inits.append(numpy_helper.from_array(np.array(128, np.uint8), "zp"))
    nodes = []
    for i, n in enumerate(("a", "b")):
        nodes += [helper.make_node("QuantizeLinear", [n, f"s{i}", "zp"], [f"{n}q"]),
                  helper.make_node("DequantizeLinear", [f"{n}q", f"s{i}", "zp"], [f"{n}d"])]
    nodes += [helper.make_node(op_type, ["ad", "bd"], ["out"]),
              helper.make_node("QuantizeLinear", ["out", "s2", "zp"], ["yq"]),
              helper.make_node("DequantizeLinear", ["yq", "s2", "zp"], ["y"])]
    return helper.make_model(helper.make_graph(nodes, op_type.lower(), x, [y], inits),
                             opset_imports=[helper.make_opsetid("", 17)])


def measure_binary(op: str, shape: list[int], runs: int, tmp: Path) -> dict[str, Any]:
    """An elementwise op's row (``op``: add or mul): ORT's float kernel and its integer one, by element count."""
    rng = np.random.default_rng(1)
    feeds = {n: rng.standard_normal(shape).astype(np.float32) for n in ("a", "b")}
    # a residual add, or a product of two activations (gates, hardswish)
    us, ops = _op_times(_qdq_graph(op.capitalize(), shape, shape, shape, 8 / 255), feeds, {"float": op.capitalize(), "int8": f"QLinear{op.capitalize()}"},
                        runs, tmp, op)
    return {"kind": op, "features": [float(math.prod(shape))], "float_op": ops["float"], "float_us": round(us["float"], 2),
            "int8_op": ops["int8"], "int8_us": round(us["int8"], 2)}


def matmul_grid(quick: bool = False) -> list[tuple[int, int, int, int]]:
    """Attention's two products of activations as (batch x heads, M, K, N): scores ``q @ k^T``
    (L, d, L) and the weighted sum ``p @ v`` (L, L, d), from toy to serving sizes."""
    bhs, lens, dims = ((8, 64, 256), (16, 64, 256), (16, 64)) if not quick else ((8,), (16, 64), (16,))
    out = []
    for bh, n, d in itertools.product(bhs, lens, dims):
        out += [(bh, n, d, n), (bh, n, n, d)]
    return out


def measure_matmul(shape: tuple[int, int, int, int], runs: int, tmp: Path) -> dict[str, Any]:
    """A product of two activations' row (kind ``matmul``, features batch x heads, M, K, N): ORT's
    float MatMul against its QLinearMatMul, the kernels alone (the conversions are the model-level
    check's boundary rows)."""
    bh, m, k, n = shape
    feeds = {"a": np.random.default_rng(1).standard_normal((bh, m, k)).astype(np.float32),
             "b": np.random.default_rng(2).standard_normal((bh, k, n)).astype(np.float32)}
    us, ops = _op_times(_qdq_graph("MatMul", [bh, m, k], [bh, k, n], [bh, m, n], 64 / 255), feeds, {"float": "MatMul", "int8": "QLinearMatMul"}, runs, tmp, "matmul")
    return {"kind": "matmul", "features": [float(f) for f in shape], "float_op": ops["float"],
            "float_us": round(us["float"], 2), "float_kernel_us": round(us["float"], 2), "int8_op": ops["int8"],
            "int8_us": round(us["int8"], 2)}


def _op_times(g: Any, feeds: dict[str, Any], names: dict[str, str], runs: int, tmp: Path,
              tag: str) -> tuple[dict[str, float], dict[str, str]]:
    """Median profiled microseconds of the one compute node of ``g`` run float (QDQ fusion off) and
    int8 (on): ``names`` the op each should run, ``float`` standing in where ORT kept the float op."""
    import onnxruntime as ort

    us: dict[str, float] = {}
    ops: dict[str, str] = {}
    for mode in ("float", "int8"):
        so = session_options(threads=1, profile_prefix=tmp / f"{tag}_{mode}", quantize_qdq=mode != "float")
        sess = ort.InferenceSession(g.SerializeToString(), so, providers=["CPUExecutionProvider"])
        for _ in range(runs):
            sess.run(None, feeds)
        events = json.loads(Path(sess.end_profiling()).read_text())
        per: dict[str, list[float]] = {}
        for e in events:
            name = e.get("args", {}).get("op_name", "")
            if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and name in names.values():
                per.setdefault(name, []).append(float(e["dur"]))
        got = names[mode] if names[mode] in per else names["float"]
        if got not in per:
            raise SystemExit(f"ORT's profile of the {mode} {tag} graph has no {names[mode]} node")
        us[mode], ops[mode] = statistics.median(per[got][2:] or per[got]), got
    return us, ops


def _neg_chain(n: int) -> bytes:
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])
    nodes = [helper.make_node("Neg", ["x" if i == 0 else f"t{i}"], ["y" if i == n - 1 else f"t{i + 1}"]) for i in range(n)]
    return helper.make_model(helper.make_graph(nodes, "chain", [x], [y]),
                             opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def profile_overhead(tmp: Path, nodes: int = 41) -> float:
    """What ORT's profiler adds to a node's measured time: on a chain of trivial nodes (Neg on 64
    floats), the profiled per-node median less the unprofiled time each added node costs (1 thread)."""
    import onnxruntime as ort

    x = {"x": np.ones((1, 64), np.float32)}

    def wall(n: int) -> float:
        sess = ort.InferenceSession(_neg_chain(n), session_options(threads=1), providers=["CPUExecutionProvider"])
        for _ in range(200):
            sess.run(None, x)
        rounds = []
        for _ in range(15):
            t0 = time.perf_counter()
            for _ in range(200):
                sess.run(None, x)
            rounds.append((time.perf_counter() - t0) / 200 * 1e6)
        return statistics.median(rounds)

    per_node = (wall(nodes) - wall(1)) / (nodes - 1)
    sess = ort.InferenceSession(_neg_chain(nodes), session_options(threads=1, profile_prefix=tmp / "chain"),
                                providers=["CPUExecutionProvider"])
    for _ in range(100):
        sess.run(None, x)
    events = json.loads(Path(sess.end_profiling()).read_text())
    profiled = statistics.median(float(e["dur"]) for e in events
                                 if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"))
    return max(profiled - per_node, 0.0)


def _merge_bounds(bounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One boundary row per (kind, elements): the median of the shapes measured at that size."""
    by: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for b in bounds:
        by.setdefault((b["kind"], b["features"][0]), []).append(b)
    out = []
    for (k, e), bs in sorted(by.items()):
        row: dict[str, Any] = {"kind": k, "features": [e]}
        for f in ("us", "float_us", "int8_us"):
            if f in bs[0]:
                row[f] = round(statistics.median(b[f] for b in bs), 2)
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=12)
    ap.add_argument("--quick", action="store_true", help="a small grid (a smoke run)")
    ap.add_argument("--out", type=Path, default=TABLE_FILE)
    ap.add_argument("--no-section", dest="section", action="store_false", help="do not rewrite benchmarks/RESULTS.md")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    isa = int8_isa()
    key = table_key(isa, cpu_name())
    if key is None:
        raise SystemExit(f"no cost-table key for this CPU's int8 instructions ({isa})")
    load = os.getloadavg()[0]
    t0 = time.time()
    rows: list[dict[str, Any]] = []
    bounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as d:
        for m, shape in grid(args.quick):
            r = measure(m, shape, args.runs, Path(d))
            if r is not None:
                rows.append(r[0])
                bounds.extend(r[1])
        adds = [measure_binary(op, shape, args.runs, Path(d)) for op in ELEMENTWISE for shape in add_grid(args.quick)]
        rows += [measure_matmul(shape, args.runs, Path(d)) for shape in matmul_grid(args.quick)]
        overhead = profile_overhead(Path(d))
    boundary = _merge_bounds(bounds + adds)
    machine = f"{cpu_name()} ({isa}), {os.cpu_count()} cores, load average {load:.1f} at the start"
    data = json.loads(args.out.read_text()) if args.out.exists() else {}
    data.setdefault("onnxruntime", {})[key] = {"runtime": "onnxruntime", "isa": isa, "machine": machine,
                                               "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                               "runs": args.runs, "seconds": round(time.time() - t0),
                                               "rows": rows, "boundary": boundary,
                                               "profile_overhead_us": round(overhead, 2)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    root = Path(__file__).parents[1]
    where = args.out.relative_to(root) if args.out.is_relative_to(root) else args.out
    text = "\n".join([HEADING, "", f"`nice -n 10 python -m benchmarks.cost_table` writes `{where}`, one table per "
                      "runtime, int8 instruction set and CPU vendor; placement reads the one for the CPU it runs on "
                      "(quantization/placement/cost_table.py `table_for`). Every table in the file:", "",
                      *(line for k, t in sorted(data["onnxruntime"].items()) for line in table_summary(k, t))])
    if args.section:
        write_section(SECTION, text)
    print(text)


def table_summary(key: str, t: dict[str, Any]) -> list[str]:
    """One table's lines in the RESULTS section: its machine, the shapes where int8 lost, the boundary rows."""
    rows, boundary = t["rows"], t.get("boundary", [])
    how = f"{t['runs']} profiled runs per graph (median after 2 warm-up runs), " if "runs" in t else ""
    took = f" in {t['seconds']} s" if "seconds" in t else ""
    lines = [f"### `{key}`: {t['machine']}", "", f"Measured {t.get('measured', '?')}; ORT 1 thread, {how}"
             f"{len(rows)} layer shapes{took}.", "",
             "| kind | shapes | int8 slower than float | their features (conv: in, out, kernel, pixels; linear: rows, in, "
             "out; depthwise: channels, kernel, pixels; matmul of two activations: batch x heads, M, K, N) |",
             "|---|---|---|---|"]
    for k in ("linear", "conv", "depthwise", "matmul"):
        rs = [r for r in rows if r["kind"] == k]
        bad = [r for r in rs if r["int8_us"] >= r["float_us"]]
        feats = "; ".join("x".join(f"{f:g}" for f in r["features"]) + f" ({r['float_us'] / max(r['int8_us'], 1e-9):.2f}x)"
                          for r in bad[:12])
        lines.append(f"| {k} | {len(rs)} | {len(bad)} | {feats}{' ...' if len(bad) > 12 else ''} |")
    lines += ["", f"Boundary rows (`boundary`, read by the model-level check, quantization/placement/model_cost.py): "
              f"{len(boundary)}; the entering / leaving costs at a few sizes (elements: us) and elementwise ops (float "
              f"against integer kernel). The profiler adds {t.get('profile_overhead_us', 0):.2f} us to each node's time "
              "(`profile_overhead_us`: a trivial node's profiled median less its unprofiled cost), which the model-level "
              "sum takes off every node it counts:", ""]
    for kind in ("enter:conv", "leave:conv", "enter:linear", "leave:linear", *ELEMENTWISE):
        rs = [b for b in boundary if b["kind"] == kind]
        if not rs:
            continue
        shown = rs[:: max(1, len(rs) // 6)][:7]
        vals = "; ".join(f"{b['features'][0]:g}: " + (f"{b['us']:g}" if "us" in b else f"{b['float_us']:g} vs {b['int8_us']:g}")
                         for b in shown)
        lines.append(f"- {kind} ({len(rs)} sizes): {vals}")
    return [*lines, ""]


if __name__ == "__main__":
    main()
