"""Decode-sized W8A8 GEMMs (M = 1..16 tokens) on LLaMA-7B linears: our int8 GEMM with and without
split K, FP8 through cuBLASLt, against fp16 cuBLAS.

    python -m benchmarks.cuda_decode                   # on a CUDA GPU: results/cuda_decode.json + RESULTS.md
    python -m benchmarks.cuda_decode --interpret-smoke # CPU, TRITON_INTERPRET=1, tiny shapes: checks the script

At decode a Linear reads its whole weight for a handful of rows: the time is the weight's bytes over
the bandwidth the kernel reaches. Columns: ``int8`` = the autotuned int8 GEMM over every candidate
(split-K ones included) on pre-quantized activations; ``int8 no split`` = the same autotuner over the
candidates without split K (what ran before it existed); ``int8+q`` adds the per-token activation
quantization kernel (what a W8A8 Linear launches, unless a fused norm already wrote the codes);
``fp8`` = ``torch._scaled_mm`` on e4m3 operands with per-token and per-channel scales. GB/s: the
int8 weight's bytes over the int8 time.
Times: medians of CUDA-graph replays (host launch overhead excluded, as in a served model), each call
on one of several weight copies that together exceed L2 (every weight comes from HBM), the variants
of a shape in alternating runs.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks._results import gpu_bench_device

log = logging.getLogger("benchmarks.cuda_decode")

FULL = {"tokens": [1, 4, 16], "shapes": [(4096, 4096), (11008, 4096), (4096, 11008)]}
SMOKE = {"tokens": [1, 3], "shapes": [(40, 96), (24, 160)]}


@contextlib.contextmanager
def _launcher(gemm: Any, split: bool) -> Iterator[None]:
    """The int8 GEMM's autotuner over all candidates, or over those without split K."""
    saved = gemm._gemm_tuned
    if not split and saved is not None:
        configs = [c for c in gemm.HOPPER_CONFIGS + gemm.AMPERE_CONFIGS if c.kwargs.get("SPLIT_K", 1) == 1]
        gemm._gemm_tuned = gemm.tuned_gemm(configs)
    try:
        yield
    finally:
        gemm._gemm_tuned = saved


def _tuned_config(gemm: Any, m: int, n: int, k: int) -> Any:
    """The autotuner's choice for this shape as a GemmConfig (a fixed launch of the same kernel)."""
    tuned = gemm._gemm_tuned
    for key, cfg in getattr(tuned, "cache", {}).items():
        if tuple(key[:3]) == (gemm.m_bucket(m), n, k):
            kw = cfg.kwargs
            return gemm.GemmConfig(kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], group_m=kw["GROUP_M"],
                                   num_warps=cfg.num_warps, num_stages=cfg.num_stages, split_k=kw.get("SPLIT_K", 1))
    return None


def _describe(cfg: Any) -> str:
    if cfg is None:
        return "?"
    return f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} s{cfg.num_stages} w{cfg.num_warps} split{cfg.split_k}"


def _row(m: int, n: int, k: int, dev: torch.device, g: torch.Generator) -> dict[str, Any]:
    from compress.quantization.lowering.fp8 import fp8_gemm
    from compress.quantization.lowering.kernels import load

    from benchmarks.w4a16 import _copies, graph_time_ms

    gemm, quant = load("gemm"), load("quant")
    cuda = dev.type == "cuda"
    x = torch.randn(m, k, generator=g).to(dev).half()
    w = (torch.randn(n, k, generator=g) * 0.02).to(dev)
    sw = (w.abs().amax(1) / 127).clamp(min=1e-8)
    wq = torch.round(w / sw[:, None]).clamp(-128, 127).to(torch.int8)
    # rotating copies that together exceed L2: each call reads its weight from HBM, as a model's layers do
    wqs = [wq] + [wq.clone() for _ in range(_copies(n * k, cuda) - 1)]
    w16s = [w.half()] + [w.half() for _ in range(_copies(n * k * 2, cuda) - 1)]
    xq, sx = quant.quantize_per_token(x)
    if cuda:  # tune both launchers once, outside the timed graphs; the no-split choice then runs fixed
        split_cfg = None
        with _launcher(gemm, split=False):
            gemm.int8_gemm(xq, wq, a_scale=sx, b_scale=sw, out_dtype=torch.float16)
            plain_cfg = _tuned_config(gemm, m, n, k)
        gemm.int8_gemm(xq, wq, a_scale=sx, b_scale=sw, out_dtype=torch.float16)
        chosen = _tuned_config(gemm, m, n, k)
    else:  # the interpreter has no autotuner: fixed tiles, split and not, still check the script's paths
        split_cfg = chosen = gemm.GemmConfig(16, 16, 32, split_k=2)
        plain_cfg = gemm.GemmConfig(16, 16, 32)

    def int8(b: torch.Tensor, cfg: Any = split_cfg, q: bool = False) -> torch.Tensor:
        a, s = quant.quantize_per_token(x) if q else (xq, sx)
        return gemm.int8_gemm(a, b, a_scale=s, b_scale=sw, out_dtype=torch.float16, config=cfg)

    variants: dict[str, list[Callable[[], Any]]] = {
        "fp16": [lambda w16=w16: F.linear(x, w16) for w16 in w16s],
        "int8": [lambda b=b: int8(b) for b in wqs],
        "int8_nosplit": [lambda b=b: int8(b, plain_cfg) for b in wqs],
        "int8_q": [lambda b=b: int8(b, q=True) for b in wqs],
    }
    if cuda:
        wf8 = [(w / sw[:, None]).to(torch.float8_e4m3fn) for _ in wqs]
        xf8, sxf = quant.quantize_per_token(x, fp8=True)
        variants["fp8"] = [lambda b=b: fp8_gemm(xf8, b, a_scale=sxf, b_scale=sw, out_dtype=torch.float16) for b in wf8]
    # integer sums are exact, so any split gives the unsplit kernel's output bit for bit (a forced
    # split: the tuner's choice may be unsplit)
    forced = gemm.GemmConfig(16, 64, 256 if k % 256 == 0 else 32, num_stages=3, split_k=4)
    exact = bool(torch.equal(int8(wq, forced), int8(wq, plain_cfg)))
    t = graph_time_ms(variants, dev)
    row: dict[str, Any] = {"M": m, "N": n, "K": k, "fp16_ms": t["fp16"], "int8_ms": t["int8"],
                           "int8_nosplit_ms": t["int8_nosplit"], "int8_q_ms": t["int8_q"], "fp8_ms": t.get("fp8"),
                           "config": _describe(chosen), "nosplit_config": _describe(plain_cfg), "split_bit_exact": exact,
                           "copies": len(wqs)}
    row["int8_GBps"] = n * k / row["int8_ms"] / 1e6
    row["speedup"] = row["fp16_ms"] / row["int8_ms"]
    row["speedup_q"] = row["fp16_ms"] / row["int8_q_ms"]
    row["split_gain"] = row["int8_nosplit_ms"] / row["int8_ms"]
    log.info("M=%d %dx%d: fp16 %.4f ms, int8 %.4f ms (%s, %.0f GB/s), no split %.4f ms (%s), +q %.4f ms, fp8 %s", m,
             n, k, row["fp16_ms"], row["int8_ms"], row["config"], row["int8_GBps"], row["int8_nosplit_ms"],
             row["nosplit_config"], row["int8_q_ms"], row["fp8_ms"])
    return row


def _markdown(data: dict[str, Any]) -> str:
    from benchmarks._results import table

    return "\n".join([
        "## Decode-sized W8A8 GEMMs: split K, fp8, fp16 (`python -m benchmarks.cuda_decode`)\n",
        f"GPU: {data['gpu']}. LLaMA-7B linears at M = 1, 4, 16 tokens; int8 weights per channel, activations "
        "per token. `int8`: our autotuned GEMM (split-K candidates included), `int8_nosplit`: the same "
        "autotuner without them, `int8_q`: plus the per-token quantization kernel, `fp8`: torch._scaled_mm. "
        "Medians of CUDA-graph replays over weight copies exceeding L2 (weights from HBM); speedup = fp16 ms / int8 ms; GB/s = int8 "
        "weight bytes / int8 time; `split_bit_exact`: a 4-way split's output equals the unsplit kernel's.\n",
        table(data["rows"], ["M", "N", "K", "fp16_ms", "int8_ms", "int8_nosplit_ms", "int8_q_ms", "fp8_ms", "speedup",
                             "speedup_q", "split_gain", "int8_GBps", "config", "nosplit_config", "split_bit_exact"]),
    ])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.cuda_decode", description=__doc__.splitlines()[0])
    ap.add_argument("--interpret-smoke", action="store_true", help="CPU under TRITON_INTERPRET=1, tiny shapes")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dev = gpu_bench_device("benchmarks.cuda_decode", args.interpret_smoke)
    if dev is None:
        return 2
    cuda = not args.interpret_smoke
    plan = SMOKE if args.interpret_smoke else FULL

    g = torch.Generator().manual_seed(0)
    rows = [_row(m, n, k, dev, g) for n, k in plan["shapes"] for m in plan["tokens"]]
    data = {"gpu": torch.cuda.get_device_name(0) if cuda else "cpu (TRITON_INTERPRET smoke)", "rows": rows}
    if args.json is not None:
        import json

        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=2))
    if cuda:  # smoke timings are the interpreter's: never written over measured results
        from benchmarks._results import write_section

        write_section("cuda_decode", _markdown(data), data)
    else:
        print(_markdown(data))
    return 0 if all(r["split_bit_exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
