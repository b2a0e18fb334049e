"""Quantizer placement on models nobody here wrote: compress vs ONNX Runtime's ``quantize_static``.

For each model of benchmarks/hf_suite.py (transformers architectures from configs, random weights):
quantize with compress (w8a8 static, per-channel weights, minmax) and export QDQ; run ORT's own
``quantize_static`` (QDQ, per-channel, uint8 activations, minmax) on compress's fp32 export with the
same calibration batches; then, side by side in one run:

- coverage: integer kernels / (integer + float Conv/MatMul/Gemm/Add) in ORT's optimized graph;
- SQNR (dB) of each int8 model's ORT output against the fp32 model's ORT output on held-out inputs;
- ORT latency at a serving batch (fp32, compress int8 and ORT int8 timed in interleaved rounds,
  medians after warm-up) and the speedups over fp32, each the median of the rounds' paired ratios
  with its 95% interval: a row is slower than fp32 only where that interval lies below 1;
- file size over the fp32 file.

``python -m benchmarks.real_models [--size small|serving] [--models resnet bert ...] [--rounds N] [--max-rounds M]``
writes benchmarks/results/real_models[_serving].json and its section of benchmarks/RESULTS.md.
``small`` is the test suite's configs (coverage and fidelity); ``serving`` the same architectures at
their published widths (speed: the small ones are all Q/DQ overhead).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from benchmarks._results import median_interval
from benchmarks.hf_suite import SERVING, SUITE, SuiteModel
from benchmarks.pattern_models import PATTERNS

RESULTS = Path(__file__).with_name("RESULTS.md")
JSON_OUT = {"small": Path(__file__).parent / "results" / "real_models.json",
            "serving": Path(__file__).parent / "results" / "real_models_serving.json"}
SECTION = {"small": "## Real models: quantizer placement vs ORT quantize_static",
           "serving": "## Real models at serving width: int8 speed vs ORT quantize_static"}
#: the two patterns of issue 32 (benchmarks/pattern_models.py) run with both suites
SUITES: dict[str, dict[str, Any]] = {"small": {**SUITE, **PATTERNS}, "serving": {**SERVING, **PATTERNS}}


def _feeds(sess: Any, x: Any) -> dict[str, np.ndarray]:
    names = [i.name for i in sess.get_inputs()]
    if isinstance(x, dict):
        return {n: x[n].numpy() for n in names if n in x}
    return {names[0]: x.numpy()}


def _sqnr(ref: np.ndarray, out: np.ndarray) -> float:
    ref, out = ref.astype(np.float64), out.astype(np.float64)
    return float(10 * np.log10((ref**2).mean() / max(((ref - out) ** 2).mean(), 1e-30)))


def _session(path: Path, threads: int) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _ort_static(fp32: Path, out: Path, calib: list[Any]) -> None:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    sess = _session(fp32, 1)

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter([_feeds(sess, x) for x in calib])

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.it, None)

    quantize_static(str(fp32), str(out), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)


def _serving_input(sm: SuiteModel) -> Any:
    g = torch.Generator().manual_seed(99)
    if sm.kind == "text":
        seq = max(64, sm.calibration[0]["input_ids"].shape[1])
        return {"input_ids": torch.randint(0, 200, (8, seq), generator=g)}
    x = sm.calibration[0]
    return torch.randn(32, *x.shape[1:], generator=g)


#: the least time one round spends on each file: at a few milliseconds a run, rounds of three runs
#: measured the same float file 5-15% apart from fp32 (benchmarks/RESULTS.md, ``real_models``)
ROUND_S = 0.25


#: fresh ORT sessions per file that the rounds take turns on: two sessions of one file measured
#: apart by up to 9% in one run (the small ResNet kept whole float, its file the fp32 model itself,
#: at 0.91x with every round below 1), an effect of the session's memory, not of the file, which
#: pairing rounds does not cancel; rotated through replicas it becomes spread the interval shows
REPLICAS = 3


def _time(sessions: dict[str, list[Any]], x: Any, rounds: int, reps: int, *, max_rounds: int | None = None,
          judged: str = "compress") -> tuple[dict[str, float], dict[str, list[float]]]:
    """Median milliseconds per run of each file, in interleaved rounds of at least ``reps`` runs and
    :data:`ROUND_S` seconds each, the order rotated every round (no file always runs first) and each
    round on the next of the file's session replicas; and each round's fp32 / file ratio per file
    (the first is fp32): paired within a round, they hold where this VM's speed shifts between
    rounds (the same fp32 file ran 1.6 and 2.4 ms a run minutes apart), which a ratio of two medians
    does not. Past ``rounds``, rounds are added up to ``max_rounds`` while the 95% interval of
    ``judged``'s median ratio still holds 1: whether a file is slower than fp32 is then decided by
    more rounds, not by one run's draw."""
    feeds = {k: _feeds(reps_[0], x) for k, reps_ in sessions.items()}
    warm: list[float] = []
    for k, replicas in sessions.items():  # warm-up, which also sizes the rounds
        for s in replicas:
            for _ in range(3):
                t0 = time.perf_counter()
                s.run(None, feeds[k])
                warm.append(time.perf_counter() - t0)
    reps = max(reps, math.ceil(ROUND_S / max(statistics.median(warm), 1e-6)))
    times: dict[str, list[float]] = {k: [] for k in sessions}
    order = list(sessions)

    def ratios() -> dict[str, list[float]]:
        return {k: [b / t for b, t in zip(times[order[0]], v, strict=True)] for k, v in times.items()}

    r = 0
    while r < rounds or (r < (max_rounds or rounds) and _verdict(ratios()[judged]) == "level"):
        for k in order[r % len(order):] + order[:r % len(order)]:
            s = sessions[k][r % len(sessions[k])]
            t0 = time.perf_counter()
            for _ in range(reps):
                s.run(None, feeds[k])
            times[k].append((time.perf_counter() - t0) / reps * 1e3)
        r += 1
    return {k: statistics.median(v) for k, v in times.items()}, ratios()


def _versus(ours: list[float], theirs: list[float]) -> dict[str, Any]:
    """The median of each round's ``ours / theirs`` speedup (their file's time over ours), its 95%
    interval and where it lies against 1."""
    xs = [a / b for a, b in zip(ours, theirs, strict=True)]
    return {"ratio": round(statistics.median(xs), 3), "interval": [round(v, 3) for v in median_interval(xs)],
            "verdict": _verdict(xs)}


def _verdict(xs: list[float]) -> str:
    """``slower``, ``faster`` or ``level`` than fp32: where the 95% interval of the median paired
    ratio lies (benchmarks/_results.py, :func:`median_interval`)."""
    lo, hi = median_interval(xs)
    return "slower" if hi < 1.0 else "faster" if lo > 1.0 else "level"


def _predicted(model: nn.Module, calib: Any, batch: int) -> tuple[float | None, str]:
    """The cost table's model-level prediction for ``model``'s default placement at ``batch`` (the default
    deployment CPU's table, quantization/placement/cost_table.py PORTABLE_CPU): the int8 model's predicted
    speedup over fp32, or None and why the check does not judge it."""
    from compress.quantization.placement.cost_table import deployment_table
    from compress.quantization.placement.model_cost import predict, unpriced_ops
    from compress.quantization.placement.trace import trace_ops

    table = deployment_table()
    if table is None:
        return None, "no cost table (COMPRESS_COST_TABLE off)"
    args, kwargs = ((), dict(calib)) if isinstance(calib, dict) else ((calib,), {})
    graph = trace_ops(model, args, kwargs)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))}
    unpriced = unpriced_ops(graph, table)
    if unpriced:
        return None, "unpriced: " + ", ".join(sorted(unpriced))
    example = next(iter(kwargs.values())) if kwargs else calib
    costs = predict(graph, layers, table, batches=[batch], example_batch=int(example.shape[0])).costs
    return (round(costs[batch].speedup, 3), table.source) if batch in costs else (None, "no row near a layer")


def run_one(name: str, *, rounds: int, threads: int, size: str = "small", max_rounds: int | None = None) -> dict[str, Any]:
    from compress.export.onnx import export_onnx
    from compress.export.validation.runtimes import ort_coverage
    from compress.quantization import QuantizeParams
    from compress.quantization.placement.speed_check import SpeedCheck

    import compress

    suite = SUITES[size]
    sm = suite[name](0)
    fp = copy.deepcopy(sm.model)
    fm = copy.deepcopy(sm.model)
    pm = copy.deepcopy(sm.model)
    am = copy.deepcopy(sm.model)
    serving = _serving_input(sm)
    # the speed check scales the traced batch; for text, tokens per Linear call are what count
    calib = sm.calibration[0]["input_ids"] if sm.kind == "text" else sm.calibration[0]
    check_batch = serving["input_ids"].numel() // calib.shape[1] if sm.kind == "text" else serving.shape[0]
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        f32, ours, theirs = d / "fp32.onnx", d / "ours.int8.onnx", d / "ort.int8.onnx"
        measured, every = d / "ours.measured.int8.onnx", d / "ours.all.int8.onnx"
        export_onnx(fp, sm.example, f32)
        # every layer int8 (the cost table off): what the default's keep-float decisions change
        qa = compress.quantize(am, "w8a8", sm.calibration, params=QuantizeParams(cost_table=False))
        export_onnx(qa, sm.example, every)
        t0 = time.perf_counter()
        # the default, told the batch it is served (and timed) at: the cost table's model-level check
        # decides int8 vs float for that batch (batch 1 when not told)
        q = compress.quantize(sm.model, "w8a8", sm.calibration, params=QuantizeParams(batch_sizes=(int(check_batch),)))
        t_quant = time.perf_counter() - t0
        export_onnx(q, sm.example, ours)
        t0 = time.perf_counter()
        qm = compress.quantize(fm, "w8a8", sm.calibration, params=QuantizeParams(
            speed_check=SpeedCheck(batch=int(check_batch), threads=threads)))
        t_measured = time.perf_counter() - t0
        export_onnx(qm, sm.example, measured)
        ours_rr = d / "ours.int8.rr.onnx"  # 7-bit weight codes: no u8s8 int16 saturation without VNNI
        export_onnx(q, sm.example, ours_rr, reduce_range=True)
        t0 = time.perf_counter()
        _ort_static(f32, theirs, sm.calibration)
        t_ort = time.perf_counter() - t0
        held = suite[name](7).calibration[:2]  # other inputs, same shapes
        files = {"fp32": f32, "compress": ours, "all_int8": every, "measured": measured, "ort": theirs}
        sessions = {k: [_session(p, threads) for _ in range(REPLICAS)] for k, p in files.items()}
        rr = _session(ours_rr, threads)
        sq: dict[str, list[float]] = {"compress": [], "all_int8": [], "measured": [], "ort": [], "compress_7bit": []}
        for x in held:
            ref = sessions["fp32"][0].run(None, _feeds(sessions["fp32"][0], x))[0]
            for k in sq:
                s = rr if k == "compress_7bit" else sessions[k][0]
                sq[k].append(_sqnr(ref, s.run(None, _feeds(s, x))[0]))
        cov = {k: ort_coverage(files[k]) for k in ("compress", "all_int8", "measured", "ort")}
        lat, paired = _time(sessions, serving, rounds, reps=3 if size == "small" else 1, max_rounds=max_rounds)
        nbytes = {k: p.stat().st_size for k, p in files.items()}
    placement = q.quantizer_graph.placement
    predicted, why = _predicted(pm, sm.calibration[0], int(check_batch))
    return {
        "model": name,
        "kind": sm.kind,
        "coverage": {k: round(c.share, 3) for k, c in cov.items()},
        "integer_kernels": {k: c.integer for k, c in cov.items()},
        "integer_ops": {k: dict(c.integer_ops) for k, c in cov.items()},
        "float_nodes": {k: c.float_nodes for k, c in cov.items()},
        "float_left": {k: dict(c.float_left) for k, c in cov.items()},
        "kept_float": placement.floats,
        "sqnr_db": {k: round(statistics.mean(v), 2) for k, v in sq.items()},
        "latency_ms": {k: round(v, 3) for k, v in lat.items()},
        "speedup": {k: round(statistics.median(paired[k]), 3) for k in ("compress", "all_int8", "measured", "ort")},
        # the 95% interval of each median paired ratio, and where it lies against fp32
        "speedup_interval": {k: [round(v, 3) for v in median_interval(paired[k])]
                             for k in ("compress", "all_int8", "measured", "ort")},
        "verdict": {k: _verdict(paired[k]) for k in ("compress", "all_int8", "measured", "ort")},
        "rounds": len(paired["fp32"]),
        # compress against quantize_static, paired the same way (each round's ORT file time over compress's)
        "vs_ort": _versus(paired["compress"], paired["ort"]),
        # the whole model kept float: compress's file is the fp32 model, and its speedup the timing's noise
        "whole_float": placement.model_float is not None,
        "size_ratio": {k: round(nbytes[k] / nbytes["fp32"], 3) for k in ("compress", "measured", "ort")},
        "predicted": predicted,  # the model-level check's int8/fp32 prediction at the serving batch
        "predicted_by": why,
        "quantize_s": {"compress": round(t_quant, 2), "measured": round(t_measured, 2), "ort": round(t_ort, 2)},
        "measured_float": {k: v for k, v in qm.quantizer_graph.placement.floats.items()
                           if v.startswith("kept float by measured placement")},
        "table_float": {k: v for k, v in placement.floats.items() if v.startswith("kept float by the cost table")},
    }


def _machine() -> str:
    import os

    from compress.report import machine

    m = machine()
    isa = f" ({m['int8_isa']})" if m.get("int8_isa") else ""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{m['cpu']}{isa}, {m['cores']} cores, torch {torch.__version__}, load average {load:.1f} at the start"


def _by_reason(floats: dict[str, str]) -> str:
    """Layers kept float grouped by their reason (a whole model kept float gives every layer the same
    one): up to three names each, then how many more."""
    groups: dict[str, list[str]] = {}
    for k, v in floats.items():
        groups.setdefault(v, []).append(k)
    return "; ".join(", ".join(f"`{k}`" for k in ks[:3]) + (f" and {len(ks) - 3} more" if len(ks) > 3 else "") + f": {v}"
                     for v, ks in groups.items())


def _pred_cell(r: dict[str, Any]) -> str:
    if "predicted" not in r:
        return "-"
    return f"{r['predicted']:.2f}x" if r["predicted"] is not None else f"not judged ({r['predicted_by']})"


def _interval_cell(r: dict[str, Any]) -> str:
    iv = r.get("speedup_interval", {}).get("compress")
    return f" ({iv[0]:.2f}-{iv[1]:.2f}, {r['rounds']} rounds)" if iv else ""


def _slower(r: dict[str, Any], k: str) -> bool:
    """Slower than fp32: by the interval where the row has one, else (rows of older runs) by the median."""
    verdict = r.get("verdict", {}).get(k)
    return verdict == "slower" if verdict is not None else bool(r["speedup"][k] < 1.0)


def write_results(rows: list[dict[str, Any]], machine: str, threads: int, size: str = "small") -> None:
    what = ("the small configs (benchmarks/hf_suite.py SUITE; the tests run them at one layer)" if size == "small" else
            "published base widths with fewer blocks (benchmarks/hf_suite.py SERVING)")
    loaded = "load average" in machine and any(
        float(w) > 1.5 for w in machine.replace(",", " ").split() if w.replace(".", "", 1).isdigit() and "." in w)
    lines = [SECTION[size], "",
             *(["Timings taken under load (a shared machine, other jobs running): the same placement measured "
                "up to about 20% apart between columns in one run (compare `compress` and `all int8` where no layer "
                "was kept float), so read speedups as +-0.2x.", ""] if loaded else []),
             f"`python -m benchmarks.real_models --size {size}` on {machine}; {what}; ORT {threads} thread(s); "
             "serving batch: 32 images or 8 sequences of max(64, calibration length) tokens; latency = "
             f"interleaved rounds after warm-up, each on the next of {REPLICAS} fresh ORT sessions per file, speedup = the "
             "median of each round's fp32 / file ratio (for compress, its 95% interval and the rounds run in brackets). Coverage = integer kernels / (integer + "
             "float Conv/MatMul/Gemm/Add) in ORT's optimized graph. SQNR of each int8 model's ORT output to the "
             "fp32 model's ORT output on held-out inputs. Random-weight models from transformers configs "
             "(benchmarks/hf_suite.py).", "",
             "SQNR 7-bit: compress's export with `reduce_range=True` (7-bit weight codes), which a CPU with AVX2 "
             "and no VNNI needs to avoid ORT's u8s8 int16 saturation (README); the machine line names this one's "
             "int8 instructions.", "",
             "compress: the default (w8a8; the shipped cost table of the default deployment CPU, `deploy_cpu: vnni:intel`, keeps float the layers it says run slower "
             "in int8, quantization/placement/cost_table.py; its whole-model prediction at the serving batch, passed as "
             "`QuantizeParams(batch_sizes=...)`, quantization/placement/model_cost.py, keeps the whole model float where "
             "int8 is predicted slower, the default `model_check: auto` at a batch of 16 or more; column `model check: "
             "predicted`, for the compress column's placement, or why the check does not judge the model); all int8: "
             "the cost table off; measured: "
             "`speed_check` (each layer's ORT integer kernel timed against its float kernel at the serving batch, "
             "the slower ones kept float). Integer kernels: every QLinear*/QGemm/MatMulIntegerToFloat node of ORT's "
             "optimized graph (ORT fuses DQ -> op -> Q into them); the QLinear* breakdown is in the JSON.", "",
             "Float ops left: the float nodes of ORT's optimized graph that ORT also has an integer kernel for "
             "(Conv, MatMul, Gemm, Add, Mul, Softmax, Where, Sigmoid, Concat, pools, LeakyRelu, fused forms "
             "included; shape arithmetic on integers not counted): quantize_static writes a Linear as QLinearMatMul "
             "plus a QLinearAdd for its bias where we write one QGemm, so integer-kernel counts alone favour it; "
             "the work left in float does not.", "",
             "| model | coverage compress / measured / ORT | integer kernels compress / ORT | float ops left compress / "
             "ORT | QLinearMul / QLinearAdd compress vs ORT | SQNR dB compress / measured / ORT (compress 7-bit) | speedup compress / all int8 / measured / ORT | "
             "size compress / measured / ORT | kept float by table / by measurement | model check: predicted |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    nan = float("nan")
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | failed: {r['error']} | | | | | | | | |")
            continue
        c, s, v, z = r["coverage"], r["sqnr_db"], r["speedup"], r["size_ratio"]
        ops = r.get("integer_ops", {})
        n_int = {k: sum(ops.get(k, {}).values()) for k in ("compress", "ort")}
        mul = {k: ops.get(k, {}).get("QLinearMul", 0) for k in ("compress", "ort")}
        add = {k: ops.get(k, {}).get("QLinearAdd", 0) for k in ("compress", "ort")}
        fl = r.get("float_left", {})
        left = {k: str(sum(fl[k].values())) if k in fl else "-" for k in ("compress", "ort")}
        lines.append(f"| {r['model']} | {c['compress']:.2f} / {c.get('measured', nan):.2f} / {c['ort']:.2f} | "
                     f"{n_int['compress']} / {n_int['ort']} | {left['compress']} / {left['ort']} | {mul['compress']} / {add['compress']} vs "
                     f"{mul['ort']} / {add['ort']} | "
                     f"{s['compress']:.1f} / {s.get('measured', nan):.1f} / {s['ort']:.1f} "
                     f"({s.get('compress_7bit', nan):.1f}) | "
                     f"{v['compress']:.2f}x{_interval_cell(r)} / {v.get('all_int8', nan):.2f}x / {v.get('measured', nan):.2f}x / "
                     f"{v['ort']:.2f}x | "
                     f"{z['compress']:.2f} / {z.get('measured', nan):.2f} / {z['ort']:.2f} | "
                     f"{len(r.get('table_float', {}))} / {len(r.get('measured_float', {}))} | {_pred_cell(r)} |")
    ok = [r for r in rows if "error" not in r]
    if ok:
        keys = [k for k in ("compress", "all_int8", "measured", "ort") if all(k in r["speedup"] for r in ok)]
        med = {k: statistics.median(r["speedup"][k] for r in ok) for k in keys}
        cov = {k: statistics.median(r["coverage"][k] for r in ok) for k in keys if k in ok[0]["coverage"]}
        slower = {k: [r["model"] for r in ok if _slower(r, k) and not (k == "compress" and r.get("whole_float"))]
                  for k in keys}
        level = [f"{r['model']} {r['speedup']['compress']:.2f}x" for r in ok if r.get("verdict", {}).get("compress") == "level"
                 and r["speedup"]["compress"] < 1.0 and not r.get("whole_float")]
        same = [f"{r['model']} {r['speedup']['compress']:.2f}x" for r in ok if r.get("whole_float")]
        versus = [r for r in ok if "vs_ort" in r]
        behind = [f"{r['model']} {r['vs_ort']['ratio']:.2f}x ({r['vs_ort']['interval'][0]:.2f}-{r['vs_ort']['interval'][1]:.2f})"
                  for r in versus if r["vs_ort"]["verdict"] == "slower"]
        level_ort = [r["model"] for r in versus if r["vs_ort"]["verdict"] == "level"]
        lines += ["", f"Medians over {len(ok)} models: coverage " + ", ".join(f"{cov[k]:.2f} ({k})" for k in cov)
                  + "; speedup " + ", ".join(f"{med[k]:.2f}x ({k})" for k in keys) + ". Slower than fp32: "
                  + "; ".join(f"{k} {', '.join(slower[k]) or 'none'}" for k in keys) + "."
                  + (" A row is slower only where the 95% interval of its median paired ratio lies below 1 (the rounds "
                     "of each row, at least --rounds and more while compress's interval holds 1); compress rows below "
                     f"1x whose interval holds 1, level with fp32 within this run's spread: {', '.join(level)}."
                     if level else "")
                  + (f" Kept whole float by compress, so its file is the fp32 model and its figure the timing's spread: "
                     f"{', '.join(same)}." if same else "")
                  + (f" compress against quantize_static (each round's ORT file time over compress's, the median and "
                     f"its 95% interval; rows timed since it was kept, {len(versus)} of {len(ok)}): behind on "
                     f"{', '.join(behind) or 'none'}; level on {', '.join(level_ort) or 'none'}; ahead on "
                     f"{len(versus) - len(behind) - len(level_ort)}." if versus else "")]
    stamps = {r.get("measured_at", "the first run (no time kept)") for r in rows}
    if len(stamps) > 1:
        lines += ["", "Rows measured at different times (load differs between them): " + "; ".join(
            f"{t}: {', '.join(r['model'] for r in rows if r.get('measured_at', 'the first run (no time kept)') == t)}"
            for t in sorted(stamps))]
    floats = [f"- {r['model']}: " + _by_reason({k: v for k, v in r["kept_float"].items() if k not in r.get("table_float", {})})
              for r in ok if set(r["kept_float"]) - set(r.get("table_float", {}))]
    if floats:
        lines += ["", "Left float by compress's placement, with its reason:", *floats]
    tabled = [f"- {r['model']}: " + "; ".join(f"`{k}`: {v.removeprefix('kept float by the cost table ')}"
                                              for k, v in r["table_float"].items())
              for r in ok if r.get("table_float")]
    if tabled:
        lines += ["", "Kept float by the cost table (the default), with the table row it read:", *tabled]
    timed = [f"- {r['model']}: " + "; ".join(f"`{k}`: {v.removeprefix('kept float by measured placement: ')}"
                                             for k, v in r["measured_float"].items())
             for r in ok if r.get("measured_float")]
    if timed:
        lines += ["", "Kept float by the speed check (the `measured` column), with the times:", *timed]
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    if SECTION[size] in text:
        head, _, rest = text.partition(SECTION[size])
        # the section ends at the next heading or at the next marked section's begin comment
        nxt = min((i for i in (rest.find("\n## "), rest.find("\n<!-- begin:")) if i >= 0), default=-1)
        text = head + "\n".join(lines) + ("\n" + rest[nxt + 1:] if nxt >= 0 else "\n")
    else:
        text = text.rstrip("\n") + "\n\n" + "\n".join(lines) + "\n"
    RESULTS.write_text(text)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SUITES), default="small")
    ap.add_argument("--models", nargs="*", default=None)
    ap.add_argument("--rounds", type=int, default=9, help=f"rounds per row (each on the next of {REPLICAS} session replicas)")
    ap.add_argument("--max-rounds", type=int, default=27,
                    help="rounds a row may take while compress's speedup interval still holds 1")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--merge", action="store_true",
                    help="replace --models' rows in the last run's results and keep the others (each row keeps its time)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    start = _machine()
    out = JSON_OUT[args.size]
    old = json.loads(out.read_text()) if args.merge and out.exists() else None
    rows: list[dict[str, Any]] = []
    names = args.models or list(SUITES[args.size])
    for i, name in enumerate(names):
        try:
            row = run_one(name, rounds=args.rounds, threads=args.threads, size=args.size, max_rounds=args.max_rounds)
        except Exception as exc:  # one model's failure is a result, not the end of the run
            row = {"model": name, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
        row["measured_at"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        print(json.dumps({k: v for k, v in row.items() if k not in ("float_nodes",)}), flush=True)
        rows.append(row)
        # written after every row, so that a run cut short keeps what it measured
        _save(rows, old, start, args, done=i + 1 == len(names))


def _save(rows: list[dict[str, Any]], old: dict[str, Any] | None, start: str, args: argparse.Namespace,
          done: bool) -> None:
    import os

    # the machine is shared: say how loaded it was when the timings ended, too
    machine = start + (f", {os.getloadavg()[0]:.1f} at the {'end' if done else 'last row'}"
                       if hasattr(os, "getloadavg") else "")
    if old is not None:
        new = {r["model"]: r for r in rows}
        rows = [new.pop(r["model"], r) for r in old["rows"]] + list(new.values())
        # one rerun note, the latest: each row carries its own time (a second --merge repeated the note)
        base = old["machine"].split(" (rows rerun: ")[0]
        machine = base if machine == base else f"{base} (rows rerun: {machine})"
    out = JSON_OUT[args.size]
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))
    write_results(rows, machine, args.threads, args.size)


if __name__ == "__main__":
    main()
