"""W4A16 Triton kernel (int4 g128 weights, fp16 activations) against fp16 cuBLAS at LLaMA-7B linear shapes.

    python -m benchmarks.w4a16                   # on a CUDA GPU: writes results/w4a16.json + RESULTS.md
    python -m benchmarks.w4a16 --interpret-smoke # CPU, TRITON_INTERPRET=1, tiny shapes: checks the script
    python -m benchmarks.w4a16 --compile-check   # no GPU needed: compiles every config to sm80/sm90 cubin

Rows: every (N, K) Linear of LLaMA-7B (q/k/v/o 4096x4096, gate/up 11008x4096, down 4096x11008) at
M = 1..16 tokens (decode), 64, 256 and 2048 (prefill). ``fp16`` is F.linear on fp16 weights
(cuBLAS); ``fused`` the Triton kernel on packed int4 weights with group-128 scales, symmetric and
asymmetric (zero points), tuned first; ``dequant`` dequantizes once and calls cuBLAS; ``auto`` is
what ``w4a16_gemm`` picks. Times: medians of CUDA-graph replays (see ``graph_time_ms``), the
variants of a shape in alternating runs. ``GB/s`` is the weight bytes read per fused call over its time
(what bounds decode). SQNR is of the kernel's output against fp64 on the same int4 weight (checks
the kernel on every measured shape, not the quantization error).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks._results import gpu_bench_device

log = logging.getLogger("benchmarks.w4a16")

LLAMA7B = [(4096, 4096), (11008, 4096), (4096, 11008)]  # (N, K) of the attention and MLP linears
TOKENS = [1, 4, 16, 64, 256, 2048]
GROUP = 128
SMOKE = {"shapes": [(48, 256)], "tokens": [1, 5], "group": 64}


def sqnr_db(ref: torch.Tensor, y: torch.Tensor) -> float:
    ref, y = ref.double(), y.double()
    noise = (ref - y).pow(2).mean().clamp(min=1e-300)
    return float(10 * torch.log10(ref.pow(2).mean() / noise))


def graph_time_ms(variants: dict[str, list[Any]], dev: torch.device) -> dict[str, float]:
    """Median milliseconds per call of each variant, a variant being the same call on rotating
    copies of its operands, all variants timed in alternating runs (export.validation.cuda.time_side_by_side).

    On CUDA each variant's calls are replayed as one CUDA graph: decode launches are microseconds,
    serving stacks replay graphs, so host launch overhead stays out of every variant alike; and the
    copies together exceed L2, so each call reads its weight from device memory as a model's layers
    do. On CPU (smoke only) a single eager run."""
    from compress.export.validation.cuda import time_side_by_side

    cuda = dev.type == "cuda"
    fns = {name: (lambda calls=calls: [c() for c in calls]) for name, calls in variants.items()}
    ms, _ = time_side_by_side(fns, warmup=3 if cuda else 0, runs=25 if cuda else 1, device=dev, graphs=True)
    return {name: ms[name] / len(calls) for name, calls in variants.items()}


def _copies(nbytes: int, cuda: bool) -> int:
    """How many copies of an operand of ``nbytes`` together exceed twice the L2 cache."""
    if not cuda:
        return 1
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return max(1, min(32, -(-2 * l2 // nbytes)))


def _tinygemm_calls(q4: list[Any], x: torch.Tensor, group: int, k: int) -> list[Any] | None:
    """PyTorch's int4 kernel on the same weights (bf16 activations: the dtype it takes), or None
    where this build has no CUDA kernel for it."""
    from compress.quantization.lowering.w4a16 import tinygemm_pack

    try:
        ops = [tinygemm_pack(p, s, None, k)[:2] for p, s, _ in q4]
        xb = x.to(torch.bfloat16)
        torch.ops.aten._weight_int4pack_mm(xb, ops[0][0], group, ops[0][1])
    except RuntimeError as exc:
        log.warning("tinygemm unavailable: %s", exc)
        return None
    return [lambda t=t, sz=sz, xb=xb: torch.ops.aten._weight_int4pack_mm(xb, t, group, sz) for t, sz in ops]


def bench(shapes: list[tuple[int, int]], tokens: list[int], group: int, dev: torch.device, cuda: bool,
          on_row: Any = None) -> list[dict[str, Any]]:
    """One row per (shape, M); ``on_row(rows)`` after each, so a run cut short keeps what it measured."""
    from compress.quantization.lowering.int4 import Int4Weight, dequantize_int4, pack_nibbles
    from compress.quantization.lowering.kernels import w4a16 as k4

    g = torch.Generator().manual_seed(0)
    rows: list[dict[str, Any]] = []
    for n, k in shapes:
        codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        scale = torch.rand(n, k // group, generator=g) * 0.01 + 1e-3
        zp = torch.randint(4, 12, (n, k // group), generator=g, dtype=torch.uint8)
        w_sym = Int4Weight(codes, scale, torch.full_like(zp, 8), group, True)
        w_asym = Int4Weight(codes, scale, zp, group, False)
        wbytes = n * k // 2 + scale.numel() * 4
        # scales and zero points column-major, as W4A16Linear stores them (a tile's columns adjacent)
        q4 = [(pack_nibbles(codes).to(dev), scale.t().contiguous().t().to(dev), zp.t().contiguous().t().to(dev))
              for _ in range(_copies(wbytes, cuda))]
        w16 = dequantize_int4(w_sym).half().to(dev)
        w16s = [w16] + [w16.clone() for _ in range(_copies(n * k * 2, cuda) - 1)]
        # the references: the exact int4 weights (float32 scales), in float64
        exact_sym = dequantize_int4(w_sym).double().to(dev)
        exact_asym = dequantize_int4(w_asym).double().to(dev)
        for m in tokens:
            x = (torch.randn(m, k, generator=g) * 0.5).half().to(dev)

            def calls(path: str, asym: bool = False, x: torch.Tensor = x, q4: list[Any] = q4) -> list[Any]:
                return [lambda p=p, s=s, z=z: k4.w4a16_gemm(x, p, scale=s, group_size=group,
                                                           zero_point=z if asym else None, path=path)
                        for p, s, z in q4]

            # first calls tune the fused kernel for this shape, outside the timed graphs
            y_sym, y_asym, y_deq = calls("fused")[0](), calls("fused", True)[0](), calls("dequant")[0]()
            auto = "dequant" if m >= k4.DEQUANT_MIN_M else "fused"
            variants = {"fp16": [lambda x=x, w=w: F.linear(x, w) for w in w16s], "fused": calls("fused"),
                        "fused_zp": calls("fused", True), "dequant": calls("dequant")}
            tg = _tinygemm_calls(q4, x, group, k) if cuda else None
            if tg is not None:
                variants["tinygemm"] = tg
            t = graph_time_ms(variants, dev)
            t_fp16, t_fused, t_fused_zp, t_deq = t["fp16"], t["fused"], t["fused_zp"], t["dequant"]
            t_auto = t_fused if auto == "fused" else t_deq
            cfg = k4._TUNED.get(k4.tune_key(m, n, k, group, x.dtype)) if cuda else None
            row = {
                "N": n, "K": k, "M": m, "fp16_ms": t_fp16, "fused_ms": t_fused, "fused_zp_ms": t_fused_zp,
                "dequant_ms": t_deq, "auto": auto, "auto_ms": t_auto, "speedup": t_fp16 / t_auto,
                "speedup_zp": t_fp16 / (t_fused_zp if auto == "fused" else t_deq),
                "fused_GBps": wbytes / (t_fused * 1e-3) / 1e9, "fp16_GBps": n * k * 2 / (t_fp16 * 1e-3) / 1e9,
                "config": None if cfg is None else (f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} split{cfg.split_k}"
                                                   + " acc3" * cfg.acc3 + " prefetch" * cfg.prefetch
                                                   + f" s{cfg.num_stages} scaled-acc" * cfg.scaled_acc + " gemv" * cfg.gemv),
                "copies": len(q4),
                "tinygemm_ms": t.get("tinygemm"), "speedup_tinygemm": t_fp16 / t["tinygemm"] if "tinygemm" in t else None,
                "best": min(("auto", t_auto), ("tinygemm", t.get("tinygemm") or float("inf")), key=lambda kv: kv[1])[0],
                "sqnr_db": min(sqnr_db(x.double() @ exact_sym.T, y_sym),
                               sqnr_db(x.double() @ exact_asym.T, y_asym),
                               sqnr_db(x.double() @ exact_sym.T, y_deq)),
            }
            row["date"] = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
            rows.append(row)
            if on_row is not None:
                on_row(rows)
            log.info("N=%d K=%d M=%d: fp16 %.4f ms, fused %.4f ms (%s, %.0f GB/s), zp %.4f, dequant %.4f, tinygemm %s; "
                     "auto %s %.2fx; sqnr %.1f dB", n, k, m, t_fp16, t_fused, row["config"], row["fused_GBps"], t_fused_zp,
                     t_deq, t.get("tinygemm"), auto, row["speedup"], row["sqnr_db"])
    return rows


def compile_variant(arch: int, cfg: Any, x: str = "fp16", **flags: Any) -> dict[str, Any]:
    """Compile the fused kernel for ``sm{arch}`` (PTX and cubin; no GPU needed) with one launch config
    (a ``W4Config``), activation dtype ``x`` and specialization ``flags``; what it used."""
    import triton
    from compress.quantization.lowering.kernels import w4a16 as k
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = k._w4a16_kernel
    names = list(fn.arg_names)
    const = {"HAS_ZP": True, "HAS_GIDX": False, "HAS_BIAS": True, "ACT": 0, "X_KIND": {"fp16": 1, "bf16": 2}[x],
             "INTERP_BF16": False, "DOT": cfg.block_m >= 16, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
             "BLOCK_K": cfg.block_k, "SPLIT": cfg.split_k > 1, "EVEN_K": True, "TILE_IN_GROUP": True,
             "ACC3": cfg.acc3 and cfg.block_m < 16, "PREFETCH": cfg.prefetch, "TILE_GROUPS": 1, **flags}
    ptrs = {"x_ptr": f"*{x}", "w_ptr": "*u8", "s_ptr": "*fp32", "z_ptr": "*u8", "g_ptr": "*i32",
            "bias_ptr": "*fp32", "y_ptr": f"*{x}", "ws_ptr": "*fp32"}
    sig = {n: ptrs.get(n, "constexpr" if n in const else "i32") for n in names}
    # what a launch specializes on contiguous, 16-byte aligned tensors: unit inner strides, and
    # pointers and row strides divisible by 16 (without it the compiler cannot vectorize loads)
    for unit in ("stride_xk", "stride_wk", "stride_sg", "stride_zg", "stride_yn"):
        const[unit], sig[unit] = 1, "constexpr"
    div16 = [n for n in names if n in ptrs or n in ("K", "stride_xm", "stride_wn", "stride_ym")]
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(c),): v for c, v in const.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in div16})
    t0 = time.perf_counter()
    kern = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    row = {"arch": f"sm{arch}", "tile": f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}", "split_k": cfg.split_k,
           "stages": cfg.num_stages, "warps": cfg.num_warps, "x": x, "flags": dict(flags),
           "shared_bytes": int(kern.metadata.shared), "cubin_bytes": len(kern.asm["cubin"]),
           "vector_loads": kern.asm["ptx"].count("ld.global.v4") + kern.asm["ptx"].count("cp.async.cg"),
           "seconds": time.perf_counter() - t0}
    log.info("%s %s split%d s%d w%d %s %s: %d B shared", row["arch"], row["tile"], cfg.split_k, cfg.num_stages,
             cfg.num_warps, x, row["flags"], row["shared_bytes"])
    return row


# what the tuner picks among at LLaMA-7B shapes: CUDA-core decode tiles (M 1..4), tensor-core tiles
COMPILE_CONFIGS = [(1, 32, 128, 8, True, True), (1, 64, 128, 4, False, True), (4, 32, 128, 4, True, False),
                   (16, 64, 128, 4, False, True), (64, 128, 64, 1, False, False)]


def compile_check() -> list[dict[str, Any]]:
    """Each representative config (sm90, fp16, zero points), and every specialization (sym, per-feature
    scale gathers, g_idx with ragged K, bf16, fused GELU) on a decode and a tensor-core config for
    sm80 and sm90."""
    from compress.quantization.lowering.kernels.w4a16 import W4Config

    cfgs = [W4Config(bm, bn, bk, num_stages=3, split_k=split, acc3=acc3, prefetch=pf)
            for bm, bn, bk, split, acc3, pf in COMPILE_CONFIGS]
    rows = [compile_variant(90, c) for c in cfgs]
    variants: list[dict[str, Any]] = [
        {"HAS_ZP": False}, {"TILE_IN_GROUP": False}, {"TILE_IN_GROUP": False, "HAS_GIDX": True, "EVEN_K": False},
        {"ACT": 2}, {"TILE_IN_GROUP": False, "TILE_GROUPS": 2},
    ]
    for cfg in (cfgs[0], cfgs[3]):
        for arch in (80, 90):
            rows.append(compile_variant(arch, cfg, "bf16"))
            rows += [compile_variant(arch, cfg, "fp16", **v) for v in variants]
    return rows


def _markdown(data: dict[str, Any]) -> str:
    lines = [
        "## W4A16 kernel vs fp16 cuBLAS (LLaMA-7B linears)",
        "",
        f"`python -m benchmarks.w4a16` on {data['gpu']}: int4 g{data['group']} weights, fp16 activations. "
        "Medians of CUDA-graph replays timed with events, each call on one of several weight copies that "
        "together exceed L2 (weights come from HBM, as in a model), the variants of a shape in alternating runs. "
        "`fused`: one kernel, weight dequantized in registers (tuned tile and split-K in the config column); "
        "`dequant`: dequantize once, then cuBLAS; `auto`: what `w4a16_gemm` runs (dequant from "
        f"M = {data.get('dequant_min_m', '?')}). GB/s: int4 weight and scale bytes per fused call over its time. "
        "SQNR: kernel output vs fp64 on the same int4 weight with its float32 scales (the kernel's rounding, not quantization error; the dequantizing kernels round the weight to fp16 first, the `scaled-acc` one does not). "
        "`tinygemm`: PyTorch's int4 kernel (`aten._weight_int4pack_mm`) on the same weights with bf16 "
        "activations and bf16 scales, the library baseline; `tg x`: fp16 ms over its ms.",
        "",
        "| N x K | M | fp16 ms | fused ms | fused+zp ms | dequant ms | auto | speedup | +zp | tinygemm ms | tg x "
        "| fused GB/s | fused config | SQNR dB | measured (UTC) |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for r in data["rows"]:
        tg = r.get("tinygemm_ms")
        tg_cells = f"{tg:.4f} | {r['speedup_tinygemm']:.2f}x" if tg else "- | -"
        lines.append(
            f"| {r['N']}x{r['K']} | {r['M']} | {r['fp16_ms']:.4f} | {r['fused_ms']:.4f} | {r['fused_zp_ms']:.4f} | "
            f"{r['dequant_ms']:.4f} | {r['auto']} | {r['speedup']:.2f}x | {r['speedup_zp']:.2f}x | {tg_cells} | "
            f"{r['fused_GBps']:.0f} | {r['config']} | {r['sqnr_db']:.1f} | {r.get('date', '2026-11-26 (earlier stop)')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.w4a16", description=__doc__.splitlines()[0])
    ap.add_argument("--interpret-smoke", action="store_true",
                    help="run the script on CPU under TRITON_INTERPRET=1 with tiny shapes (checks the script)")
    ap.add_argument("--compile-check", action="store_true",
                    help="compile every config for sm80/sm90 without a GPU (checks the CUDA path builds)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--tokens", type=int, nargs="*", default=None, help=f"rows M to measure (default {TOKENS})")
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
    dev = gpu_bench_device("benchmarks.w4a16", args.interpret_smoke)
    if dev is None:
        return 2
    from compress.quantization.lowering.kernels.w4a16 import DEQUANT_MIN_M

    cuda = not args.interpret_smoke
    shapes, tokens, group = (LLAMA7B, TOKENS, GROUP) if cuda else (SMOKE["shapes"], SMOKE["tokens"], SMOKE["group"])
    tokens = args.tokens or tokens
    gpu = torch.cuda.get_device_name(0) if cuda else "cpu (TRITON_INTERPRET smoke)"
    # rows of an earlier run on the same GPU that this run does not re-measure stay, with their dates
    old = json.loads(args.json.read_text()) if args.json is not None and args.json.exists() else {}
    old_rows = old.get("rows", []) if old.get("gpu") == gpu and old.get("group") == group else []

    def write(rows: list[dict[str, Any]]) -> dict[str, Any]:
        fresh = {(r["N"], r["K"], r["M"]) for r in rows}
        kept = [r for r in old_rows if (r["N"], r["K"], r["M"]) not in fresh]
        merged = sorted(kept + rows, key=lambda r: (r["N"], r["K"], r["M"]))
        data = {"gpu": gpu, "group": group, "dequant_min_m": DEQUANT_MIN_M, "rows": merged}
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(data, indent=2))
        if cuda:  # smoke figures are interpreter timings: never written over measured results
            from benchmarks._results import write_section

            write_section("w4a16", _markdown(data), data)
        return data

    data = write(bench(shapes, tokens, group, dev, cuda, on_row=write))  # type: ignore[arg-type]
    if not cuda:
        print(_markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
