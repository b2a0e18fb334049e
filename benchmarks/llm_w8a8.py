"""W8A8 on the reference decoder: held-out perplexity of fp32, static per-tensor activations (ORT's
full placement and Linears only), SmoothQuant (alpha 0.5 and auto), per-token dynamic activations,
and an int8 KV cache (per-token and per-head scales). ``python -m benchmarks.llm_w8a8 --model
runs/reference_llm`` (train it first with ``python -m benchmarks.train_reference_llm``).

Same data as benchmarks/llm_quant.py: calibration windows from the calibration files, perplexity on
the held-out eval files. Every Linear of the decoder layers is quantized (int8 per-channel
symmetric weights); lm_head and the embedding stay float.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._results import table, write_section
from benchmarks.llm_quant import lm_arguments, lm_windows, perplexity

log = logging.getLogger("benchmarks.llm_w8a8")

# label -> (scheme, QuantizeParams fields)
CONFIGS: dict[str, tuple[str | dict[str, Any], dict[str, Any]]] = {
    "W8A8 static, ORT placement (Linears, attention matmuls, residual adds, RoPE)": ("w8a8", {}),
    "W8A8 static, ORT placement + SmoothQuant auto": ("w8a8", {"smoothquant": "auto"}),
    "W8A8 static, Linears only": ("w8a8", {"quantize_ops": False}),
    "W8A8 static, Linears only + SmoothQuant 0.5": ("w8a8", {"quantize_ops": False, "smoothquant": 0.5}),
    "W8A8 static, Linears only + SmoothQuant auto": ("w8a8", {"quantize_ops": False, "smoothquant": "auto"}),
    "W8A8 static, Linears only + SmoothQuant auto, 7-bit weight codes (the recipe; exact in ORT)": (
        {"preset": "w8a8", "weights": {"reduce_range": True}}, {"quantize_ops": False, "smoothquant": "auto"}),
    "W8A8 static, Linears only + SmoothQuant auto + int8 KV per-head": (
        "w8a8", {"quantize_ops": False, "smoothquant": "auto", "kv_cache": "per_head"}),
    "W8A8 static, Linears only + SmoothQuant auto + int8 KV per-token": (
        "w8a8", {"quantize_ops": False, "smoothquant": "auto", "kv_cache": "per_token"}),
    "W8A8 dynamic per-token": ("w8a8_dynamic", {}),
    "W8A8 dynamic per-token + SmoothQuant auto": ("w8a8_dynamic", {"smoothquant": "auto"}),
    "W8A8 dynamic per-token + SmoothQuant auto, 7-bit weight codes (llm_generate's dynamic file)": (
        {"preset": "w8a8_dynamic", "weights": {"reduce_range": True}}, {"smoothquant": "auto"}),
    "W8A8 dynamic per-token + int8 KV per-token": ("w8a8_dynamic", {"kv_cache": "per_token"}),
    "W8A8 dynamic per-token + int8 KV per-head": ("w8a8_dynamic", {"kv_cache": "per_head"}),
}


NOTE = ("Perplexity repeats to the last digit between quiet runs on one machine (a run sharing the CPU with a "
        "second copy of this benchmark once read 40.291 for the recipe's row, 40.282 in two quiet runs, every "
        "other row the same; likely SmoothQuant's alpha search flipping on a near tie, since the load can change "
        "the order of float sums); on the 2000-step reference model (weight-only costs in `llm_quant`) differences of a "
        "few hundredths of a percent are real but too small to rank configurations on other models by.")


def run(model_dir: str, calib: torch.Tensor, evalw: torch.Tensor, *, calib_batch: int) -> list[dict[str, Any]]:
    import compress
    from compress.models import load_model

    fp = load_model({"hf_path": model_dir}).eval()
    data = [calib[i : i + calib_batch] for i in range(0, len(calib), calib_batch)]
    base = perplexity(fp, evalw)
    rows: list[dict[str, Any]] = [{"config": "fp32", "perplexity": base, "seconds": 0.0}]
    log.info("fp32 %.3f", base)
    for label, (scheme, fields) in CONFIGS.items():
        t = time.perf_counter()
        q = compress.quantize(copy.deepcopy(fp), scheme, data, ignore=["lm_head"],
                              params=compress.QuantizeParams(**fields))
        secs = time.perf_counter() - t
        ppl = perplexity(q, evalw)
        rows.append({"config": label, "perplexity": ppl, "seconds": secs})
        log.info("%s: %.3f (%.1f s)", label, ppl, secs)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    lm_arguments(p, calib=64)
    args = p.parse_args(argv)
    calib, evalw = lm_windows(args)
    rows = run(args.model, calib, evalw, calib_batch=args.calib_batch)
    base = rows[0]["perplexity"]
    summary = [{"config": r["config"], "perplexity": f"{r['perplexity']:.3f}",
                "vs fp32": f"{(r['perplexity'] / base - 1) * 100:+.2f}%", "quantize s": round(r["seconds"], 1)}
               for r in rows]
    info = json.loads((Path(args.model) / "training.json").read_text())
    md = (
        "## W8A8 decoder: SmoothQuant, per-token activations, int8 KV cache (`python -m benchmarks.llm_w8a8`)\n\n"
        f"The reference LLaMA ({info['params'] / 1e6:.1f}M parameters; see `llm_quant`). Perplexity on {len(evalw)} "
        f"held-out windows of {args.seq_len} tokens, {len(calib)} calibration windows. Every decoder Linear has int8 "
        "per-channel symmetric weights; lm_head and embeddings float. 'static': one uint8 scale per tensor, "
        "calibrated (min/max); 'ORT placement': the onnxruntime target's full placement (Linear inputs, both "
        "attention matmuls' inputs, residual adds, RoPE adds and concats: what ORT fuses into integer kernels); "
        "'Linears only': `quantize_ops: false` (the SmoothQuant paper's setting, and the form "
        "`export_llm_onnx(weights='w8a8')` writes). 'dynamic per-token': a symmetric int8 scale per token row, "
        "computed at run time. '7-bit weight codes': `weights: {reduce_range: true}`, what ORT's u8s8 kernels sum "
        "exactly on CPUs without VNNI (the files `llm_generate` times). SmoothQuant folds 1/s into input_layernorm (q/k/v), post_attention_layernorm "
        "(gate/up) and up_proj's rows (down_proj); o_proj (GQA: no exact fold) keeps a Mul. 'int8 KV': keys (after "
        "RoPE) and values entering attention fake-quantized, a scale per (head, token) row or one static scale "
        "per head.\n\n"
        + table(summary)
        + "\n" + NOTE + "\n"
        + f"\nMachine load: {args.load}.\n"
    )
    write_section("llm_w8a8", md, {"rows": rows, "args": vars(args)})


if __name__ == "__main__":
    main()
