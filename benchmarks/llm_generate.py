"""ONNX Runtime CPU generation of a small Llama: prefill latency and decode tokens/s, fp32 vs int4 MatMulNBits.

    python -m benchmarks.llm_generate                 # writes results/llm_generate.json + RESULTS.md
    python -m benchmarks.llm_generate --size medium   # a wider Llama (hidden 1024) where weights dominate

The model is the team's reference Llama (trained on stdlib text) when ``--model DIR`` (or
/work/notes/reference_llm) holds a transformers checkpoint, else a random-init Llama with the same
shapes (vocab 4096, hidden 256, 4 layers, 768 MLP, 4 heads / 2 kv heads); the report says which.
int4 = round-to-nearest ``w4_weight_only_g128`` on every Linear but lm_head, exported with
:func:`export.llm_onnx.export_llm_onnx` as MatMulNBits, at accuracy_level 0 (float32 compute) and 4
(ORT quantizes activations to int8 inside the op). Variants run interleaved in each repeat (same
machine state), one ORT intra-op thread each; prefill = one call on the prompt with an empty cache,
decode = per-token time of the following greedy steps. Medians over repeats. W8A8 (QDQ) is not in
this run: the activation-quantizer placement it needs for LLMs is not on main yet.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger("benchmarks.llm_generate")

REFERENCE_DIR = Path("/work/notes/reference_llm")
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
    return model, f"random-init Llama ({shape}): the reference model was not available", None


def prompt_ids(tok: Any, vocab: int, length: int) -> np.ndarray:
    if tok is not None:  # held-out text: a stdlib module the reference model was not trained on is unknown here
        import textwrap

        text = textwrap.dedent(json.__doc__ or "") * 8
        ids = tok(text)["input_ids"][:length]
        if len(ids) == length:
            return np.asarray([ids], dtype=np.int64)
    return np.random.default_rng(0).integers(0, vocab, (1, length), dtype=np.int64)


def time_variant(gen: Any, ids: np.ndarray, new: int) -> tuple[float, float, list[int]]:
    """(prefill ms, median decode ms per token, generated tokens) of one greedy run."""
    t0 = time.perf_counter()
    logits = gen.prefill(ids)
    prefill = (time.perf_counter() - t0) * 1e3
    toks: list[int] = []
    steps = []
    for _ in range(new):
        nxt = logits.argmax(-1).astype(np.int64)
        toks.append(int(nxt[0]))
        t0 = time.perf_counter()
        logits = gen.step(nxt)
        steps.append((time.perf_counter() - t0) * 1e3)
    return prefill, statistics.median(steps), toks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.llm_generate", description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=list(SIZES), default="reference")
    ap.add_argument("--model", type=Path, default=REFERENCE_DIR, help="a transformers checkpoint of the reference Llama")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    ap.add_argument("--new", type=int, default=32, help="generated tokens")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import compress
    from export.llm_onnx import OrtGenerator, export_llm_onnx

    model, what, tok = load_model(args.size, args.model)
    ids = prompt_ids(tok, int(model.config.vocab_size), args.prompt)
    fq = compress.quantize(__import__("copy").deepcopy(model), "w4_weight_only_g128", ignore=["lm_head"])
    with torch.no_grad():
        ref = fq.generate(torch.from_numpy(ids), attention_mask=torch.ones(ids.shape, dtype=torch.long),
                          max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, pad_token_id=0)
    ref_new = ref[0, ids.shape[1]:].tolist()
    tmp = Path(tempfile.mkdtemp(prefix="llm_generate_"))
    files = {
        "fp32": export_llm_onnx(model, tmp / "fp32.onnx", weights="fp32"),
        "int4 (acc 0)": export_llm_onnx(fq, tmp / "int4_acc0.onnx", weights="int4", accuracy_level=0),
        "int4 (acc 4)": export_llm_onnx(fq, tmp / "int4_acc4.onnx", weights="int4", accuracy_level=4),
    }
    gens = {name: OrtGenerator(path, threads=args.threads) for name, path in files.items()}
    for gen in gens.values():  # warm-up: first runs allocate and pick kernels
        time_variant(gen, ids, 4)
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in gens}
    tokens: dict[str, list[int]] = {}
    load_before = os.getloadavg()[0]
    for _ in range(args.repeats):
        for name, gen in gens.items():  # interleaved: every repeat times each variant back to back
            pre, dec, toks = time_variant(gen, ids, args.new)
            runs[name].append((pre, dec))
            tokens[name] = toks
    load_after = os.getloadavg()[0]
    rows = []
    base = None
    for name in gens:
        pre = statistics.median(r[0] for r in runs[name])
        dec = statistics.median(r[1] for r in runs[name])
        base = base or (pre, dec)
        row = {
            "variant": name, "file_mb": files[name].stat().st_size / 2**20, "prefill_ms": pre, "decode_ms": dec,
            "decode_ms_range": [min(r[1] for r in runs[name]), max(r[1] for r in runs[name])],
            "prefill_ms_range": [min(r[0] for r in runs[name]), max(r[0] for r in runs[name])],
            "tokens_per_s": 1e3 / dec, "prefill_speedup": base[0] / pre, "decode_speedup": base[1] / dec,
            "same_tokens_as_pytorch_fake_quant": tokens[name] == ref_new if name != "fp32" else None,
            "same_tokens_as_fp32": tokens[name] == tokens["fp32"],
        }
        rows.append(row)
        log.info("%s: %.2f MB, prefill %.1f ms, decode %.2f ms/token (%.1f tok/s)", name, row["file_mb"], pre, dec,
                 row["tokens_per_s"])
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    float_params = emb.numel() + (0 if head.data_ptr() == emb.data_ptr() else head.numel())  # tied: stored once
    data = {"size": args.size, "float_mb": float_params * 4 / 2**20, "model": what, "prompt": int(ids.shape[1]), "new": args.new, "repeats": args.repeats,
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
        "(lm_head float) as MatMulNBits; the embeddings and lm_head, float32 in every file, are "
        f"{d['float_mb']:.2f} MB of it. "
        "Load average {:.1f} -> {:.1f} (2 cores shared with other work: absolute times and ratios move "
        "between runs).".format(*d["load"]),
        "",
        "Each time: median over repeats [fastest, slowest repeat].",
        "",
        "| variant | file MB | prefill ms | decode ms/token | tokens/s | prefill x | decode x | tokens = PyTorch fake-quant | = fp32 |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in d["rows"]:
        same = r["same_tokens_as_pytorch_fake_quant"]
        lines.append(
            f"| {r['variant']} | {r['file_mb']:.2f} | {r['prefill_ms']:.1f} [{r['prefill_ms_range'][0]:.1f}, "
            f"{r['prefill_ms_range'][1]:.1f}] | {r['decode_ms']:.2f} [{r['decode_ms_range'][0]:.2f}, "
            f"{r['decode_ms_range'][1]:.2f}] | {r['tokens_per_s']:.1f} | "
            f"{r['prefill_speedup']:.2f}x | {r['decode_speedup']:.2f}x | {'-' if same is None else same} | "
            f"{r['same_tokens_as_fp32']} |"
        )
    lines += ["", "W8A8 (QDQ) generation is not measured: the activation-quantizer placement it needs for LLMs is not on "
              "main yet (issue 13, left)."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
