"""Fused RMSNorm + per-token activation quantization on CUDA (issue 30, item 1), side by side.

Two measurements, each variant timed in alternating runs through CUDA graphs (median of the
replays, CUDA events, export.validation.cuda.time_side_by_side):

- one norm at LLaMA-7B width (4096, fp16) at 1, 16 and 2048 rows: transformers' eager LlamaRMSNorm,
  that norm followed by the per-token int8 quantize kernel (what a converted model ran before), our
  kernel as the norm alone, and our kernel writing the norm and the codes;
- the decode step of a Llama decoder stack at LLaMA-7B widths (a StaticCache of ``context`` tokens,
  one new token per sequence), converted W8A8 and FP8_DYNAMIC with ``fuse_norms`` off and on, against
  fp16; cosine of the last hidden state to the fp32 model for each.

    python -m benchmarks.cuda_fused_norm                    # CUDA: results/cuda_fused_norm.json + RESULTS.md
    python -m benchmarks.cuda_fused_norm --interpret-smoke  # CPU, TRITON_INTERPRET=1, tiny widths: checks the script
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys
from typing import Any

import torch
from torch import nn

from benchmarks._results import gpu_bench_device

log = logging.getLogger("benchmarks.cuda_fused_norm")

FULL: dict[str, Any] = {"hidden": 4096, "inter": 11008, "heads": 32, "kv_heads": 32, "layers": 2, "vocab": 1024,
                        "rows": [1, 16, 2048], "decode": [1, 16], "context": 512, "runs": 30}
SMOKE: dict[str, Any] = {"hidden": 64, "inter": 128, "heads": 4, "kv_heads": 2, "layers": 1, "vocab": 128,
                         "rows": [2], "decode": [2], "context": 8, "runs": 2}
_ROOM = 64  # StaticCache slots past the context (some transformers releases advance a slot per call)


def _time(fns: dict[str, Any], dev: torch.device, runs: int) -> dict[str, float]:
    from compress.export.validation.cuda import time_side_by_side

    with torch.no_grad():
        ms, graphs = time_side_by_side(fns, warmup=3, runs=runs, device=dev, graphs=True)
    if dev.type == "cuda" and not graphs:
        log.warning("CUDA graphs could not be captured: eager timings")
    return ms


def bench_norm(spec: dict[str, Any], dev: torch.device) -> list[dict[str, Any]]:
    from compress.quantization.lowering.kernels import load
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    quant, kern = load("quant"), load("norm")
    k = spec["hidden"]
    norm = LlamaRMSNorm(k, eps=1e-5)
    nn.init.normal_(norm.weight, mean=1.0, std=0.2)
    norm = norm.to(dev, torch.float16).eval()
    w, eps = norm.weight, norm.variance_epsilon
    rows = []
    for m in spec["rows"]:
        x = torch.randn(m, k, device=dev, dtype=torch.float16)
        fns = {
            "hf_norm": lambda x=x: norm(x),
            "hf_norm+quantize": lambda x=x: quant.quantize_per_token(norm(x)),
            "kernel_norm": lambda x=x: kern.rmsnorm_quantize(x, w, eps, codes=False),
            "kernel_norm+codes": lambda x=x: kern.rmsnorm_quantize(x, w, eps),
        }
        ms = _time(fns, dev, spec["runs"])
        rows.append({"rows": m, "hidden": k, **{f"{n}_us": t * 1e3 for n, t in ms.items()},
                     "speedup": ms["hf_norm+quantize"] / ms["kernel_norm+codes"]})
        log.info("norm rows %d: %s", m, {n: f"{t * 1e3:.1f} us" for n, t in ms.items()})
    return rows


def _llama(spec: dict[str, Any]) -> nn.Module:
    from transformers import LlamaConfig, LlamaModel

    cfg = LlamaConfig(hidden_size=spec["hidden"], intermediate_size=spec["inter"], num_attention_heads=spec["heads"],
                      num_key_value_heads=spec["kv_heads"], num_hidden_layers=spec["layers"], vocab_size=spec["vocab"],
                      max_position_embeddings=spec["context"] + 2 * _ROOM)
    torch.manual_seed(0)
    model = LlamaModel(cfg).eval()
    for mod in model.modules():  # trained norms are not all ones
        if type(mod).__name__.endswith("RMSNorm"):
            nn.init.normal_(mod.weight, mean=1.0, std=0.2)
    return model


def bench_decode(spec: dict[str, Any], dev: torch.device) -> list[dict[str, Any]]:
    from compress.export.validation.cuda import cast_float_layers
    from compress.quantization.api import QuantizeParams
    from compress.quantization.lowering.convert import convert_with_report
    from transformers import StaticCache

    import compress

    fp32 = _llama(spec).to(dev)
    calib = [{"input_ids": torch.randint(0, spec["vocab"], (1, 32)).to(dev)}]
    models: dict[str, nn.Module] = {"fp32": fp32, "fp16": copy.deepcopy(fp32).half()}
    norms: dict[str, int] = {}
    for scheme in ("W8A8", "FP8_DYNAMIC"):
        fq = compress.quantize(copy.deepcopy(fp32), scheme, calib, params=QuantizeParams(quantize_ops=False)).eval()
        for fuse in (False, True):
            conv, report = convert_with_report(fq, placed="drop", fuse_norms=fuse)
            name = f"{scheme}{'+fused_norms' if fuse else ''}"
            models[name] = cast_float_layers(conv.to(dev), torch.float16).eval()
            norms[name] = sum(r.converted for r in report if r.kind == "norm")
        del fq
    rows = []
    ctx = spec["context"]
    g = torch.Generator().manual_seed(1)
    for b in spec["decode"]:
        ids = torch.randint(0, spec["vocab"], (b, ctx), generator=g).to(dev)
        step = torch.randint(0, spec["vocab"], (b, 1), generator=g).to(dev)
        pos = torch.tensor([ctx], device=dev)
        outs: dict[str, torch.Tensor] = {}
        fns = {}
        for k, m in models.items():
            cache = StaticCache(config=m.config, max_cache_len=ctx + _ROOM)
            with torch.no_grad():  # prefill, then one eager step: the fused norms' readers claim them here
                m(input_ids=ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(ctx, device=dev))
                outs[k] = m(input_ids=step, past_key_values=cache, use_cache=True,
                            cache_position=pos).last_hidden_state.float()
            if k != "fp32":
                fns[k] = lambda m=m, cache=cache, step=step, pos=pos: m(
                    input_ids=step, past_key_values=cache, use_cache=True, cache_position=pos)
        ms = _time(fns, dev, spec["runs"])
        for k, t in ms.items():
            ref, y = outs["fp32"].flatten(1).double(), outs[k].flatten(1).double()
            cos = float(torch.nn.functional.cosine_similarity(ref, y, dim=1).mean())
            rows.append({"batch": b, "context": ctx, "variant": k, "ms": t, "vs_fp16": ms["fp16"] / t,
                         "cosine": cos, "fused_norms": norms.get(k, 0)})
            log.info("decode batch %d %s: %.3f ms (%.2fx fp16), cosine %.5f", b, k, t, ms["fp16"] / t, cos)
        del fns, outs
    return rows


def _markdown(norm_rows: list[dict[str, Any]], dec_rows: list[dict[str, Any]], spec: dict[str, Any]) -> str:
    from benchmarks._results import table

    out = ["## CUDA fused RMSNorm + activation quantization",
           "", "Written by `python -m benchmarks.cuda_fused_norm`. Each table's variants ran alternately in one run, "
           "as CUDA graph replays (median, CUDA events).", "",
           f"One LlamaRMSNorm at width {spec['hidden']}, fp16 (microseconds; speedup: HF norm + quantize kernel "
           "over the fused kernel writing norm and codes):", "", table(norm_rows),
           f"Decode step of a {spec['layers']}-layer Llama stack at LLaMA-7B widths (hidden {spec['hidden']}, "
           f"intermediate {spec['inter']}), StaticCache of {spec['context']} tokens; `+fused_norms` converts with "
           "`fuse_norms=True` (the others with `False`); cosine of the last hidden state to fp32:", "",
           table(dec_rows)]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.cuda_fused_norm", description=__doc__.splitlines()[0])
    ap.add_argument("--interpret-smoke", action="store_true", help="CPU under TRITON_INTERPRET=1, tiny widths")
    ap.add_argument("--only", nargs="*", default=["norm", "decode"], choices=["norm", "decode"])
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dev = gpu_bench_device("benchmarks.cuda_fused_norm", args.interpret_smoke)
    if dev is None:
        return 2
    spec = SMOKE if args.interpret_smoke else FULL
    norm_rows = bench_norm(spec, dev) if "norm" in args.only else []
    dec_rows = bench_decode(spec, dev) if "decode" in args.only else []
    if not args.interpret_smoke:
        from benchmarks._results import write_section

        write_section("cuda_fused_norm", _markdown(norm_rows, dec_rows, spec),
                      {"spec": spec, "norm": norm_rows, "decode": dec_rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
