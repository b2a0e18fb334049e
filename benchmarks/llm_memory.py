"""Sequential GPTQ of a ~1B-parameter Llama config in bounded memory: peak RSS against the model's
fp32 size. ``python -m benchmarks.llm_memory`` (writes its RESULTS.md section).

The model is built on the meta device, so its weights never exist together: the embedding is
materialized (random init) to feed the first layer, each decoder layer is materialized (random
init, seeded per layer) just before GPTQ calibrates it, and saved to disk as safetensors and
dropped to meta right after (quantization.algorithms.sequential.DiskOffload). lm_head and the final norm are
never materialized (calibration stops at the layers). Peak RSS is measured in a fresh subprocess
(``resource.getrusage`` ``ru_maxrss``), so nothing of the parent counts.
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
from torch import nn

from benchmarks._results import table, write_section

# TinyLlama-1.1B's shape: hidden 2048, SwiGLU 5632, 22 layers, 32 heads with 4 KV heads, vocab 32000
CONFIG_1B: dict[str, Any] = {
    "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
    "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 2048, "tie_word_embeddings": False,
}


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _init_(module: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        with torch.no_grad():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=g)
            else:
                p.fill_(1.0) if name.endswith("weight") else p.zero_()


def worker(args: argparse.Namespace) -> dict[str, Any]:
    from compress.quantization.algorithms.gptq import GPTQParams, gptq_layer
    from compress.quantization.algorithms.sequential import DiskOffload, sequential_quantize
    from compress.quantization.numerics.spec import resolve_scheme
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    torch.set_num_threads(args.threads)
    cfg = LlamaConfig(**{**CONFIG_1B, "num_hidden_layers": args.layers})
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    params = sum(p.numel() for p in model.parameters())
    model.model.embed_tokens.to_empty(device="cpu")
    _init_(model.model.embed_tokens, 0)
    model.model.rotary_emb = LlamaRotaryEmbedding(config=cfg)  # its buffer is not a weight: computed on CPU
    rss_start = _rss_mib()
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len), generator=g) for _ in range(args.batches)]
    peak_layer: list[float] = []

    def load(i: int, layer: nn.Module) -> None:
        layer.to_empty(device="cpu")
        _init_(layer, 100 + i)

    with tempfile.TemporaryDirectory() as tmp:
        offload = DiskOffload(tmp)

        def release(i: int, layer: nn.Module) -> None:
            offload.release(i, layer)
            peak_layer.append(_rss_mib())

        gptq_seconds: list[float] = []

        def process(i: int, layer: nn.Module, linears: Any, calls: Any) -> None:
            # GPTQ on the first layers; the rest get round-to-nearest (the GPTQ working set is the
            # same for every layer of this config, and 22 GPTQ layers do not fit this machine's time)
            if i < args.gptq_layers:
                t = time.perf_counter()
                gptq_layer(layer, linears, calls, GPTQParams())
                gptq_seconds.append(time.perf_counter() - t)

        t0 = time.perf_counter()
        sequential_quantize(model, data, resolve_scheme("w4_weight_only_g128"), process, load=load, release=release)
        seconds = time.perf_counter() - t0
        disk = sum(p.stat().st_size for p in offload.dir.iterdir())
    return {
        "params": params, "fp32_mib": params * 4 / 2**20, "layers": args.layers,
        "layer_fp32_mib": sum(p.numel() for p in model.model.layers[0].parameters()) * 4 / 2**20,
        "rss_after_setup_mib": rss_start, "peak_rss_mib": _rss_mib(), "peak_rss_after_layer_mib": peak_layer,
        "seconds": seconds, "calibration_tokens": args.batches * args.batch * args.seq_len,
        "offloaded_mib": disk / 2**20, "threads": args.threads, "gptq_layers": args.gptq_layers,
        "gptq_seconds_per_layer": gptq_seconds,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.llm_memory", "--worker", "--layers", str(args.layers),
           "--gptq-layers", str(args.gptq_layers),
           "--batches", str(args.batches), "--batch", str(args.batch), "--seq-len", str(args.seq_len),
           "--threads", str(args.threads)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def report(r: dict[str, Any], load: str) -> str:
    ratio = r["peak_rss_mib"] / r["fp32_mib"]
    rows = [{
        "model": f"Llama {r['params'] / 1e9:.2f}B (TinyLlama-1.1B shape, random init), {r['layers']} layers",
        "fp32 size MiB": round(r["fp32_mib"]),
        "one layer MiB": round(r["layer_fp32_mib"]),
        "peak RSS MiB": round(r["peak_rss_mib"]),
        "peak / fp32 size": round(ratio, 3),
        "RSS after setup MiB": round(r["rss_after_setup_mib"]),
        "GPTQ layers": f"{r['gptq_layers']} of {r['layers']}",
        "GPTQ s per layer": round(sum(r["gptq_seconds_per_layer"]) / max(len(r["gptq_seconds_per_layer"]), 1)),
        "total s": round(r["seconds"]),
    }]
    return (
        "## Sequential GPTQ in bounded memory (`python -m benchmarks.llm_memory`)\n\n"
        "Sequential w4 g128 quantization of a ~1B-parameter Llama config, one decoder layer at a time (GPTQ,\n"
        "act_order off, on the first layers; round-to-nearest on the others, see the table): the model is\n"
        "built on the meta device, each layer is materialized (random init) just before it is calibrated and\n"
        "offloaded to disk as safetensors right after, so the weights never sit in memory together. Peak RSS of a\n"
        f"fresh process (ru_maxrss), {r['calibration_tokens']} calibration tokens, {r['threads']} torch threads.\n\n"
        + table(rows)
        + f"\n\nPeak RSS is {ratio:.1%} of the fp32 model size (the issue's bound: below 50%). What it holds: Python,\n"
        "torch and transformers (the RSS after setup, embedding included), one fp32 layer, that layer's Hessians\n"
        "(the largest, down_proj's 5632^2, is 121 MiB) and GPTQ's working copies. Machine load: " + load + "\n"
        + _creep(r)
    )


def _creep(r: dict[str, Any]) -> str:
    """How the peak RSS moved from the first layer to the last: growth per layer adds up on deeper models."""
    per = r.get("peak_rss_after_layer_mib") or []
    if len(per) < 2:
        return ""
    grow = per[-1] - per[0]
    return (f"\nPeak RSS after the first layer {per[0]:.0f} MiB, after the last {per[-1]:.0f} MiB: it grows by "
            f"{grow:.0f} MiB over {len(per) - 1} more layers ({grow / (len(per) - 1):.0f} MiB a layer), which a deeper "
            "model would add to.\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, default=CONFIG_1B["num_hidden_layers"])
    p.add_argument("--gptq-layers", type=int, default=CONFIG_1B["num_hidden_layers"],
                   help="layers calibrated by GPTQ (the others get round-to-nearest)")
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--load", default="shared 2-core machine, other engineers' jobs running")
    args = p.parse_args(argv)
    if args.worker:
        logging.basicConfig(level=logging.WARNING)
        print(json.dumps(worker(args)))
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    r = run(args)
    logging.info("%s", r)
    write_section("llm_memory", report(r, args.load), r)


if __name__ == "__main__":
    main()
