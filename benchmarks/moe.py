"""Mixture-of-experts LLM quantization: a Mixtral-architecture model (transformers' definition,
random weights, no download) with its packed experts unpacked into per-expert Linears
(compress/moe.py), quantized by RTN, GPTQ and AWQ at w4 g128 and by static W8A8.

    python -m benchmarks.moe [--hidden 512 --layers 4 --experts 8]

Per method: SQNR of the logits to the fp32 model on held-out tokens, routing agreement (the share
of (token, layer) pairs whose top-k expert set equals fp32's: the routers stay float, so what moves
the routing is the quantization upstream of them) and the time quantization took. Then the fp32 and
W8A8 ONNX files (both computing every expert densely, see the module docstring of
compress/moe.py) timed side by side in ONNX Runtime, with their sizes. Random weights make
the SQNR figures a measure of quantization noise, not of task quality.
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from benchmarks._results import table, write_section
from benchmarks.hf_suite import _tokens

log = logging.getLogger("benchmarks.moe")


def build(hidden: int, layers: int, experts: int, vocab: int, seed: int = 0) -> nn.Module:
    import transformers

    torch.manual_seed(seed)
    config = transformers.MixtralConfig(
        hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256), num_local_experts=experts, num_experts_per_tok=2, vocab_size=vocab,
        use_cache=False)
    return transformers.MixtralForCausalLM(config).eval()


def _routing(model: nn.Module, x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits and each router's top-k indices (the integer output of every module named ``*.gate``)."""
    picks: list[torch.Tensor] = []

    def hook(_: nn.Module, __: Any, out: Any) -> None:
        outs = out if isinstance(out, tuple) else (out,)
        picks.extend(t for t in outs if isinstance(t, torch.Tensor) and not t.is_floating_point())

    hs = [m.register_forward_hook(hook) for n, m in model.named_modules() if n.endswith("mlp.gate")]
    try:
        with torch.no_grad():
            logits = model(**x).logits
    finally:
        for h in hs:
            h.remove()
    return logits, picks


def _agreement(ref: list[torch.Tensor], got: list[torch.Tensor]) -> float:
    same = [(a.sort(dim=-1).values == b.sort(dim=-1).values).all(dim=-1).float() for a, b in zip(ref, got, strict=True)]
    return float(torch.cat(same).mean())


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - out).pow(2).mean()))


def _time(sessions: dict[str, Any], feeds: dict[str, np.ndarray], runs: int) -> dict[str, float]:
    for s in sessions.values():
        s.run(None, feeds)
    times: dict[str, list[float]] = {k: [] for k in sessions}
    for i in range(runs):
        for k in list(sessions) if i % 2 == 0 else list(reversed(sessions)):
            t0 = time.perf_counter()
            sessions[k].run(None, feeds)
            times[k].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import onnxruntime as ort

    import compress
    from compress.core.moe import unpack_experts

    fp = build(args.hidden, args.layers, args.experts, args.vocab)
    unpack_experts(fp)
    calib = _tokens(args.calib, 4, args.seq, args.vocab, 1)
    held = _tokens(2, 4, args.seq, args.vocab, 2)
    refs = [_routing(fp, x) for x in held]
    methods = {
        "RTN w4 g128": lambda m: compress.quantize(m, "w4_weight_only_g128", ignore=["lm_head"]),
        "GPTQ w4 g128": lambda m: compress.gptq(m, calib, scheme="w4_weight_only_g128", ignore=["lm_head"]),
        "AWQ w4 g128": lambda m: compress.awq(m, calib, scheme="w4_weight_only_g128", ignore=["lm_head"]),
        "W8A8 static (7-bit weights)": lambda m: compress.quantize(
            m, {"preset": "w8a8", "weights": {"reduce_range": True}}, calib, ignore=["lm_head"]),
    }
    rows: list[dict[str, Any]] = []
    w8a8: nn.Module | None = None
    gptq: nn.Module | None = None
    for name, fn in methods.items():
        t0 = time.perf_counter()
        q = fn(copy.deepcopy(fp))
        secs = time.perf_counter() - t0
        got = [_routing(q, x) for x in held]
        rows.append({
            "method": name,
            "logits SQNR dB": round(statistics.mean(_sqnr(r[0], g[0]) for r, g in zip(refs, got, strict=True)), 2),
            "routing agreement": round(statistics.mean(_agreement(r[1], g[1]) for r, g in zip(refs, got, strict=True)), 4),
            "quantize s": round(secs, 1),
        })
        log.info("%s", rows[-1])
        if name.startswith("W8A8"):
            w8a8 = q
        if name.startswith("GPTQ"):
            gptq = q
    assert w8a8 is not None and gptq is not None
    with tempfile.TemporaryDirectory() as tmp:
        example = held[0]["input_ids"][:1]
        f32 = compress.export_onnx(fp, example, Path(tmp) / "fp32.onnx")
        i8 = compress.export_onnx(w8a8, example, Path(tmp) / "int8.onnx")
        so = ort.SessionOptions()
        so.intra_op_num_threads = args.threads
        sessions = {k: ort.InferenceSession(str(p), so, providers=["CPUExecutionProvider"]) for k, p in
                    (("fp32", f32), ("int8", i8))}
        lat = {}
        for b in (1, 8):
            ids = _tokens(1, b, args.seq, args.vocab, 3)[0]["input_ids"].numpy()
            lat[b] = _time(sessions, {sessions["fp32"].get_inputs()[0].name: ids}, args.runs)
        sizes = {k: p.stat().st_size / 1e6 for k, p in (("fp32", f32), ("int8", i8))}
        gen = _generation(fp, gptq, Path(tmp), held[0]["input_ids"][:1].numpy(), args)
    speed = [{"batch": f"{b} x {args.seq} tokens", "fp32 ms": round(v["fp32"], 1), "int8 ms": round(v["int8"], 1),
              "speedup": round(v["fp32"] / v["int8"], 2)} for b, v in lat.items()]
    return {"rows": rows, "speed": speed, "sizes": sizes, "generation": gen}


def _generation(fp: nn.Module, int4: nn.Module, tmp: Path, ids: np.ndarray, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Greedy generation in ORT from the KV-cache files (fp32, GPTQ int4 as MatMulNBits), interleaved."""
    from compress.export.llm.generation import time_generation
    from compress.export.llm.onnx import OrtGenerator, export_llm_onnx

    files = {"fp32": export_llm_onnx(fp, tmp / "gen.fp32.onnx", weights="fp32"),
             "GPTQ int4": export_llm_onnx(int4, tmp / "gen.int4.onnx", weights="int4")}
    gens = {k: OrtGenerator(p, threads=args.threads) for k, p in files.items()}
    for g in gens.values():
        time_generation(g, ids, 4)
    runs: dict[str, list[tuple[float, float]]] = {k: [] for k in gens}
    for _ in range(args.runs):
        for k, g in gens.items():
            runs[k].append(time_generation(g, ids, 16))
    out = []
    for k in gens:
        pre = statistics.median(r[0] for r in runs[k])
        dec = statistics.median(r[1] for r in runs[k])
        out.append({"file": k, "MB": round(files[k].stat().st_size / 1e6, 1), "prefill ms": round(pre, 1),
                    "decode ms/token": round(dec, 2), "tokens/s": round(1e3 / dec, 1)})
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--calib", type=int, default=8, help="calibration batches of 4 sequences")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=10)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    res = run(args)
    md = [
        "## Mixture-of-experts LLM: quantized experts, float routers (`python -m benchmarks.moe`)",
        "",
        f"Mixtral architecture (transformers' definition, random weights): hidden {args.hidden}, {args.layers} layers, "
        f"{args.experts} experts, top-2, vocab {args.vocab}; packed experts unpacked into per-expert Linears "
        "(compress/moe.py), routers kept float. Held-out: 2 batches of 4 x "
        f"{args.seq} random tokens; calibration: {args.calib} such batches. Routing agreement: share of "
        "(token, layer) pairs whose top-2 expert set equals fp32's. Random weights: SQNR is quantization noise, "
        "not task quality.",
        "",
        table(res["rows"]),
        "",
        f"ONNX Runtime, {args.threads} threads, median of {args.runs} interleaved runs after warm-up; both files compute "
        "every expert densely (unrouted ones weighted 0). File sizes: fp32 "
        f"{res['sizes']['fp32']:.1f} MB, int8 {res['sizes']['int8']:.1f} MB.",
        "",
        table(res["speed"]),
        "",
        f"Greedy generation from the KV-cache files (export_llm_onnx; every expert computed for every token): prompt "
        f"1 x {args.seq} tokens, 16 new tokens, median of {args.runs} interleaved runs.",
        "",
        table(res["generation"]),
        "",
        f"Wall time {time.perf_counter() - t0:.0f} s.",
    ]
    write_section("moe", "\n".join(md), data=res)


if __name__ == "__main__":
    main()
