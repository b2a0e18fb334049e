"""W4A16 Triton kernel (int4 g128 weights, fp16 activations) against fp16 cuBLAS at LLaMA-7B linear shapes.

    python -m benchmarks.w4a16                   # on a CUDA GPU: writes results/w4a16.json + RESULTS.md
    python -m benchmarks.w4a16 --interpret-smoke # CPU, TRITON_INTERPRET=1, tiny shapes: checks the script
    python -m benchmarks.w4a16 --compile-check   # no GPU needed: compiles every config to sm80/sm90 cubin

Rows: every (N, K) Linear of LLaMA-7B (q/k/v/o 4096x4096, gate/up 11008x4096, down 4096x11008) at
M = 1 and 16 tokens (decode) and 2048 (prefill). ``fp16`` is F.linear on fp16 weights (cuBLAS),
``w4a16`` the Triton kernel on packed int4 weights with group-128 scales, symmetric and asymmetric
(zero points), both autotuned first. Times are medians of triton's do_bench (CUDA events, L2
flushed), all variants of a shape back to back. ``GB/s`` is the weight bytes read per call over
the time (what bounds decode). SQNR is of the kernel's output against fp64 on the same int4 weight
(checks the kernel on every measured shape, not the quantization error).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger("benchmarks.w4a16")

LLAMA7B = [(4096, 4096), (11008, 4096), (4096, 11008)]  # (N, K) of the attention and MLP linears
TOKENS = [1, 16, 2048]
GROUP = 128
SMOKE = {"shapes": [(48, 256)], "tokens": [1, 5], "group": 64}


def sqnr_db(ref: torch.Tensor, y: torch.Tensor) -> float:
    ref, y = ref.double(), y.double()
    noise = (ref - y).pow(2).mean().clamp(min=1e-300)
    return float(10 * torch.log10(ref.pow(2).mean() / noise))


def _timer(cuda: bool) -> Any:
    if cuda:
        from triton.testing import do_bench

        return lambda fn: float(do_bench(fn, warmup=25, rep=100, return_mode="median"))

    def cpu(fn: Any) -> float:  # smoke only: interpreter timings mean nothing
        fn()
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return cpu


def bench(shapes: list[tuple[int, int]], tokens: list[int], group: int, dev: torch.device, cuda: bool) -> list[dict[str, Any]]:
    from quantization.int4 import Int4Weight, dequantize_int4, pack_nibbles
    from quantization.kernels import w4a16_gemm

    timer = _timer(cuda)
    g = torch.Generator().manual_seed(0)
    rows: list[dict[str, Any]] = []
    for n, k in shapes:
        codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        scale = torch.rand(n, k // group, generator=g) * 0.01 + 1e-3
        zp = torch.randint(4, 12, (n, k // group), generator=g, dtype=torch.uint8)
        w_sym = Int4Weight(codes, scale, torch.full_like(zp, 8), group, True)
        w_asym = Int4Weight(codes, scale, zp, group, False)
        packed = pack_nibbles(codes).to(dev)
        s, z = scale.to(dev), zp.to(dev)
        w16 = dequantize_int4(w_sym).half().to(dev)
        deq_asym = dequantize_int4(w_asym).half().to(dev)
        for m in tokens:
            x = (torch.randn(m, k, generator=g) * 0.5).half().to(dev)
            y_sym = w4a16_gemm(x, packed, scale=s, group_size=group)
            y_asym = w4a16_gemm(x, packed, scale=s, group_size=group, zero_point=z)
            t_fp16 = timer(lambda x=x, w16=w16: F.linear(x, w16))
            t_sym = timer(lambda x=x, p=packed, s=s: w4a16_gemm(x, p, scale=s, group_size=group))
            t_asym = timer(lambda x=x, p=packed, s=s, z=z: w4a16_gemm(x, p, scale=s, group_size=group, zero_point=z))
            wbytes = n * k // 2 + scale.numel() * 4
            row = {
                "N": n, "K": k, "M": m, "fp16_ms": t_fp16, "w4a16_ms": t_sym, "w4a16_zp_ms": t_asym,
                "speedup": t_fp16 / t_sym, "speedup_zp": t_fp16 / t_asym,
                "w4a16_GBps": wbytes / (t_sym * 1e-3) / 1e9, "fp16_GBps": n * k * 2 / (t_fp16 * 1e-3) / 1e9,
                "sqnr_db": min(sqnr_db(x.double() @ w16.double().T, y_sym), sqnr_db(x.double() @ deq_asym.double().T, y_asym)),
            }
            rows.append(row)
            log.info("N=%d K=%d M=%d: fp16 %.4f ms, w4a16 %.4f ms (%.2fx), zp %.4f ms, sqnr %.1f dB",
                     n, k, m, t_fp16, t_sym, row["speedup"], t_asym, row["sqnr_db"])
    return rows


def compile_variant(arch: int, cfg: Any, x: str = "fp16", **flags: Any) -> dict[str, Any]:
    """Compile the kernel for ``sm{arch}`` (PTX and cubin; no GPU needed) with one tile config
    (a ``triton.Config``), activation dtype ``x`` and specialization ``flags``; what it used."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from quantization.kernels import w4a16 as k

    fn = k._w4a16_kernel
    names = list(fn.arg_names)
    const = {"HAS_ZP": True, "HAS_GIDX": False, "HAS_BIAS": True, "ACT": 0, "GROUP_M": cfg.kwargs["GROUP_M"],
             "BLOCK_M": cfg.kwargs["BLOCK_M"], "BLOCK_N": cfg.kwargs["BLOCK_N"], "BLOCK_K": cfg.kwargs["BLOCK_K"],
             "EVEN_K": True, "TILE_IN_GROUP": True, "DOT_F32": False, **flags}
    ptrs = {"x_ptr": f"*{x}", "w_ptr": "*u8", "s_ptr": "*fp32", "z_ptr": "*u8", "g_ptr": "*i32",
            "bias_ptr": "*fp32", "y_ptr": f"*{x}"}
    sig = {n: ptrs.get(n, "constexpr" if n in const else "i32") for n in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(c),): v for c, v in const.items()})
    t0 = time.perf_counter()
    kern = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    row = {"arch": f"sm{arch}", "tile": "x".join(str(cfg.kwargs[b]) for b in ("BLOCK_M", "BLOCK_N", "BLOCK_K")),
           "stages": cfg.num_stages, "warps": cfg.num_warps, "x": x, "flags": dict(flags),
           "shared_bytes": int(kern.metadata.shared), "cubin_bytes": len(kern.asm["cubin"]),
           "seconds": time.perf_counter() - t0}
    log.info("%s %s s%d w%d %s %s: %d B shared", row["arch"], row["tile"], cfg.num_stages, cfg.num_warps, x,
             row["flags"], row["shared_bytes"])
    return row


def compile_check() -> list[dict[str, Any]]:
    """Every autotune config (sm90, fp16, zero points), and every specialization (sym, per-feature
    scale gathers, g_idx with ragged K, bf16, fused GELU) on one decode and one prefill config for
    sm80 and sm90."""
    from quantization.kernels import w4a16 as k

    rows = [compile_variant(90, c) for c in k.DECODE_CONFIGS + k.PREFILL_CONFIGS]
    variants: list[dict[str, Any]] = [
        {"HAS_ZP": False}, {"TILE_IN_GROUP": False}, {"TILE_IN_GROUP": False, "HAS_GIDX": True, "EVEN_K": False},
        {"ACT": 2},
    ]
    for cfg in (k.DECODE_CONFIGS[0], k.PREFILL_CONFIGS[0]):
        for arch in (80, 90):
            rows.append(compile_variant(arch, cfg, "bf16"))
            rows += [compile_variant(arch, cfg, "fp16", **v) for v in variants]
    return rows


def _markdown(data: dict[str, Any]) -> str:
    lines = [
        "## W4A16 kernel vs fp16 cuBLAS (LLaMA-7B linears)",
        "",
        f"`python -m benchmarks.w4a16` on {data['gpu']}: int4 g{data['group']} weights dequantized in registers, "
        "fp16 activations; medians of do_bench (L2 flushed). SQNR: kernel output vs fp64 on the same int4 weight.",
        "",
        "| N x K | M | fp16 ms | W4A16 ms | speedup | W4A16+zp ms | speedup | W4A16 GB/s | SQNR dB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in data["rows"]:
        lines.append(
            f"| {r['N']}x{r['K']} | {r['M']} | {r['fp16_ms']:.4f} | {r['w4a16_ms']:.4f} | {r['speedup']:.2f}x | "
            f"{r['w4a16_zp_ms']:.4f} | {r['speedup_zp']:.2f}x | {r['w4a16_GBps']:.0f} | {r['sqnr_db']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.w4a16", description=__doc__.splitlines()[0])
    ap.add_argument("--interpret-smoke", action="store_true",
                    help="run the script on CPU under TRITON_INTERPRET=1 with tiny shapes (checks the script)")
    ap.add_argument("--compile-check", action="store_true",
                    help="compile every config for sm80/sm90 without a GPU (checks the CUDA path builds)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.compile_check:
        os.environ.pop("TRITON_INTERPRET", None)
        rows = compile_check()
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(rows, indent=2))
        log.info("compiled %d kernel variants for sm80/sm90 (no timing: no GPU involved)", len(rows))
        return 0
    if args.interpret_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are first imported: jit decides then
    elif not torch.cuda.is_available():
        print("benchmarks.w4a16: needs a CUDA GPU (none found); --interpret-smoke checks the script on CPU", file=sys.stderr)
        return 2
    from quantization.kernels import triton_available

    if not triton_available():
        print("benchmarks.w4a16: needs Triton: pip install 'compress[triton]'", file=sys.stderr)
        return 2
    cuda = not args.interpret_smoke
    dev = torch.device("cuda" if cuda else "cpu")
    shapes, tokens, group = (LLAMA7B, TOKENS, GROUP) if cuda else (SMOKE["shapes"], SMOKE["tokens"], SMOKE["group"])
    data: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(0) if cuda else "cpu (TRITON_INTERPRET smoke)",
        "group": group,
        "rows": bench(shapes, tokens, group, dev, cuda),  # type: ignore[arg-type]
    }
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=2))
    if cuda:  # smoke figures are interpreter timings: never written over measured results
        from benchmarks._results import write_section

        write_section("w4a16", _markdown(data), data)
    else:
        print(_markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
