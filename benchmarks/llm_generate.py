"""ONNX Runtime CPU generation of a small Llama: prefill latency and decode tokens/s, fp32 vs int4 MatMulNBits.

    python -m benchmarks.llm_generate                 # writes results/llm_generate.json + RESULTS.md
    python -m benchmarks.llm_generate --size medium   # a wider Llama (hidden 1024) where weights dominate

The model is the team's reference Llama (trained on stdlib text) when ``--model DIR`` (or
/work/notes/reference_llm) holds a transformers checkpoint, else a random-init Llama with the same
shapes (vocab 4096, hidden 256, 4 layers, 768 MLP, 4 heads / 2 kv heads); the report says which.
Prompts are windows of this repository's README (held-out text for a model trained on the stdlib),
capped so that prompt + generated tokens stay inside the model's trained context; ORT's greedy
continuations of them are compared with the PyTorch model's greedy tokens on the same weights
(export.llm.generation.torch_greedy: KV cache, argmax per step; not ``generate``, whose generation
config suppresses EOS before a minimum length).
int4 = round-to-nearest ``w4_weight_only_g128`` on every Linear but lm_head, exported with
:func:`export.llm.onnx.export_llm_onnx` as MatMulNBits, at accuracy_level 0 (float32 compute) and 4
(ORT quantizes activations to int8 inside the op). Variants run interleaved in each repeat (same
machine state), one ORT intra-op thread each; prefill = one call on the prompt with an empty cache,
decode = per-token time of the following greedy steps. Medians over repeats.
W8A8 (``weights="w8a8"``, export/llm/w8a8.py), every Linear but lm_head, SmoothQuant alpha auto
calibrated on stdlib windows (random ids for a random-init model): *static* = the
llm_smoothquant_w8a8 recipe's scheme (per-tensor uint8 inputs, 7-bit int8 weight codes; QDQ that
ORT fuses into MatMulIntegerToFloat), *dynamic* = ``w8a8_dynamic`` with 7-bit weight codes too
(per-token int8 inputs computed in the graph, entering MatMulInteger as uint8: the u8s8 kernel).
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger("benchmarks.llm_generate")

REFERENCE_DIR = Path("runs/reference_llm")  # benchmarks.train_reference_llm's default output
SIZES: dict[str, dict[str, Any]] = {
    "reference": {"vocab_size": 4096, "hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 768,
                  "num_attention_heads": 4, "num_key_value_heads": 2},
    "medium": {"vocab_size": 4096, "hidden_size": 1024, "num_hidden_layers": 4, "intermediate_size": 2816,
               "num_attention_heads": 16, "num_key_value_heads": 4},
}


def load_model(size: str, model_dir: Path | None) -> tuple[Any, str, Any]:
    """``(model, description, tokenizer or None)``."""
    import transformers

    if size == "reference" and model_dir is not None and (model_dir / "config.json").exists():
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
        tok = None
        try:
            tok = transformers.AutoTokenizer.from_pretrained(model_dir)
        except Exception as exc:  # a checkpoint without a tokenizer still benchmarks on token ids
            log.info("no tokenizer in %s (%s); random prompt ids", model_dir, exc)
        return model, f"reference Llama from {model_dir} (trained on stdlib text)", tok
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**SIZES[size], max_position_embeddings=1024)
    model = transformers.LlamaForCausalLM(cfg).eval()
    shape = ", ".join(f"{k}={v}" for k, v in SIZES[size].items())
    why = "the reference model was not available" if size == "reference" else "no trained model of this size"
    return model, f"random-init Llama ({shape}): {why}", None


def prompt_ids(tok: Any, vocab: int, length: int, count: int) -> np.ndarray:
    """``[count, length]`` prompts: windows spread over this repository's README, text the reference
    model never saw (it was trained on Python stdlib text); random ids without a tokenizer."""
    if tok is not None:
        ids = tok((Path(__file__).resolve().parents[1] / "README.md").read_text())["input_ids"]
        step = max(length, len(ids) // count)
        rows = [ids[i * step: i * step + length] for i in range(count)]
        if all(len(r) == length for r in rows):
            return np.asarray(rows, dtype=np.int64)
    return np.random.default_rng(0).integers(0, vocab, (count, length), dtype=np.int64)


def calibration_windows(tok: Any, model_dir: Path, vocab: int, count: int = 32) -> list[torch.Tensor]:
    """Calibration batches for the W8A8 variants: stdlib windows from the LM data's calibration files
    when the reference tokenizer is there, random ids otherwise."""
    if tok is not None:
        from compress.data.lm import text_lm

        ds: Any = text_lm(seed=0, tokenizer=str(model_dir), seq_len=128, samples=count).calibration
        w = ds.windows[:count]
    else:
        w = torch.randint(0, vocab, (count, 128), generator=torch.Generator().manual_seed(0))
    return [w[i : i + 8] for i in range(0, len(w), 8)]


def agreement(got: torch.Tensor, ref: torch.Tensor, start: int) -> dict[str, int]:
    """How many prompts continue identically, and how many generated tokens agree position by position."""
    g, r = got[:, start:], ref[:, start:]
    return {"prompts_identical": int((g == r).all(1).sum()), "prompts": int(g.shape[0]),
            "tokens_equal": int((g == r).sum()), "tokens": int(g.numel())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.llm_generate", description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=list(SIZES), default="reference")
    ap.add_argument("--model", type=Path, default=REFERENCE_DIR, help="a transformers checkpoint of the reference Llama")
    ap.add_argument("--prompt", type=int, default=96, help="prompt tokens (capped so prompt + new fit the context)")
    ap.add_argument("--prompts", type=int, default=4, help="held-out prompts for the token agreement")
    ap.add_argument("--new", type=int, default=32, help="generated tokens")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from compress.export.llm.generation import time_generation, torch_greedy
    from compress.export.llm.onnx import OrtGenerator, export_llm_onnx, generate_ort

    import compress

    model, what, tok = load_model(args.size, args.model)
    max_pos = int(getattr(model.config, "max_position_embeddings", 4096))
    length = min(args.prompt, max_pos - args.new)  # stay inside the context the model was trained for
    prompts = prompt_ids(tok, int(model.config.vocab_size), length, args.prompts)
    ids = prompts[:1]  # timed prompt
    fq = compress.quantize(copy.deepcopy(model), "w4_weight_only_g128", ignore=["lm_head"])
    calib = calibration_windows(tok, args.model, int(model.config.vocab_size))
    w8_static = compress.quantize(copy.deepcopy(model), {"preset": "w8a8", "weights": {"reduce_range": True}}, calib,
                                  ignore=["lm_head"], params=compress.QuantizeParams(quantize_ops=False,
                                                                                     smoothquant="auto"))
    w8_dynamic = compress.quantize(copy.deepcopy(model), {"preset": "w8a8_dynamic", "weights": {"reduce_range": True}},
                                   calib, ignore=["lm_head"],
                                   params=compress.QuantizeParams(smoothquant="auto"))

    def hf_greedy(m: Any) -> torch.Tensor:
        # prompt + the PyTorch model's greedy tokens (KV cache, argmax per step, as generate_ort)
        return torch.cat([torch.from_numpy(prompts), torch_greedy(m, prompts, args.new)], dim=1)

    hf = {"float": hf_greedy(model), "int4": hf_greedy(fq), "w8a8 static": hf_greedy(w8_static),
          "w8a8 dynamic": hf_greedy(w8_dynamic)}
    reference_of = {"fp32": "float", "int4 (acc 0)": "int4", "int4 (acc 4)": "int4", "W8A8 static (QDQ)": "w8a8 static",
                    "W8A8 dynamic per-token": "w8a8 dynamic"}
    # sessions hold the models in memory once built, so the files can go before timing
    with tempfile.TemporaryDirectory(prefix="llm_generate_") as d:
        tmp = Path(d)
        files = {
            "fp32": export_llm_onnx(model, tmp / "fp32.onnx", weights="fp32"),
            "int4 (acc 0)": export_llm_onnx(fq, tmp / "int4_acc0.onnx", weights="int4", accuracy_level=0),
            "int4 (acc 4)": export_llm_onnx(fq, tmp / "int4_acc4.onnx", weights="int4", accuracy_level=4),
            "W8A8 static (QDQ)": export_llm_onnx(w8_static, tmp / "w8a8_static.onnx", weights="w8a8"),
            "W8A8 dynamic per-token": export_llm_onnx(w8_dynamic, tmp / "w8a8_dynamic.onnx", weights="w8a8"),
        }
        file_mb = {name: path.stat().st_size / 2**20 for name, path in files.items()}
        gens = {name: OrtGenerator(path, threads=args.threads) for name, path in files.items()}
    for gen in gens.values():  # warm-up: first runs allocate and pick kernels
        time_generation(gen, ids, 4)
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in gens}
    agree = {
        name: agreement(generate_ort(gen, prompts, max_new_tokens=args.new), hf[reference_of[name]], prompts.shape[1])
        for name, gen in gens.items()
    }
    load_before = os.getloadavg()[0]
    for _ in range(args.repeats):
        for name, gen in gens.items():  # interleaved: every repeat times each variant back to back
            pre, dec = time_generation(gen, ids, args.new)
            runs[name].append((pre, dec))
    load_after = os.getloadavg()[0]
    rows = []
    base = None
    for name in gens:
        pre = statistics.median(r[0] for r in runs[name])
        dec = statistics.median(r[1] for r in runs[name])
        base = base or (pre, dec)
        row = {
            "variant": name, "file_mb": file_mb[name], "prefill_ms": pre, "decode_ms": dec,
            "decode_ms_range": [min(r[1] for r in runs[name]), max(r[1] for r in runs[name])],
            "prefill_ms_range": [min(r[0] for r in runs[name]), max(r[0] for r in runs[name])],
            "tokens_per_s": 1e3 / dec, "prefill_speedup": base[0] / pre, "decode_speedup": base[1] / dec,
            "agreement_with_pytorch": agree[name],
        }
        rows.append(row)
        log.info("%s: %.2f MB, prefill %.1f ms, decode %.2f ms/token (%.1f tok/s)", name, row["file_mb"], pre, dec,
                 row["tokens_per_s"])
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    float_params = emb.numel() + (0 if head.data_ptr() == emb.data_ptr() else head.numel())  # tied: stored once
    vs_float = {k: agreement(v, hf["float"], prompts.shape[1]) for k, v in hf.items() if k != "float"}
    data = {"size": args.size, "fake_quant_vs_float": vs_float, "float_mb": float_params * 4 / 2**20, "model": what, "prompt": int(ids.shape[1]), "prompts": int(prompts.shape[0]), "new": args.new, "repeats": args.repeats,
            "threads": args.threads, "load": [load_before, load_after], "rows": rows}
    from benchmarks._results import RESULTS_DIR, write_section

    RESULTS_DIR.mkdir(exist_ok=True)
    write_section(f"llm_generate_{args.size}", _markdown(data), data)
    return 0


def _markdown(d: dict[str, Any]) -> str:
    lines = [
        f"## LLM generation in ONNX Runtime (CPU), {d['size']} size: {d['model'].split(' (')[0]}",
        "",
        f"`python -m benchmarks.llm_generate`: {d['model']}. Prompt {d['prompt']} tokens, {d['new']} greedy tokens, "
        f"{d['threads']} ORT thread(s), {d['repeats']} interleaved repeats (medians). int4 = RTN w4 g128 "
        "(lm_head float) as MatMulNBits; W8A8 static = the llm_smoothquant_w8a8 recipe's scheme (SmoothQuant auto, "
        "per-tensor uint8 inputs, 7-bit int8 weights) as QDQ, which ORT fuses into MatMulIntegerToFloat; W8A8 "
        "dynamic = per-token inputs quantized in the graph + MatMulInteger u8s8 (SmoothQuant auto, 7-bit weights); the embeddings "
        "and lm_head, float32 in every file, are "
        f"{d['float_mb']:.2f} MB of it. "
        "Load average {:.1f} -> {:.1f} (2 cores shared with other work: absolute times and ratios move "
        "between runs).".format(*d["load"]),
        "",
        "Each time: median over repeats [fastest, slowest repeat].",
        "",
        "| variant | file MB | prefill ms | decode ms/token | tokens/s | prefill x | decode x | greedy = PyTorch: prompts | tokens |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in d["rows"]:
        a = r["agreement_with_pytorch"]
        lines.append(
            f"| {r['variant']} | {r['file_mb']:.2f} | {r['prefill_ms']:.1f} [{r['prefill_ms_range'][0]:.1f}, "
            f"{r['prefill_ms_range'][1]:.1f}] | {r['decode_ms']:.2f} [{r['decode_ms_range'][0]:.2f}, "
            f"{r['decode_ms_range'][1]:.2f}] | {r['tokens_per_s']:.1f} | "
            f"{r['prefill_speedup']:.2f}x | {r['decode_speedup']:.2f}x | {a['prompts_identical']}/{a['prompts']} | "
            f"{a['tokens_equal']}/{a['tokens']} |"
        )
    fq = d["fake_quant_vs_float"]
    scale = "; ".join(f"{k} {v['prompts_identical']}/{v['prompts']} and {v['tokens_equal']}/{v['tokens']}"
                      for k, v in fq.items())
    lines += [
        "",
        f"Greedy = PyTorch: ORT's greedy continuation of {d['prompts']} prompts ({d['prompt']} tokens each; windows of "
        "the README when the reference tokenizer is there, which the model never saw) against the PyTorch "
        "model's greedy tokens (KV cache, argmax per step) on the same weights: the float model for fp32, each fake-quant model for its file (identical "
        "continuations, and tokens equal position by position). For scale, the fake-quant models themselves keep "
        f"these continuations and tokens of the float model's: {scale}.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
