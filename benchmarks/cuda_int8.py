"""W8A8 Triton kernels against fp16/bf16 cuBLAS and torch._int_mm, on GEMM and conv shapes and end to end.

    python -m benchmarks.cuda_int8                   # on a CUDA GPU: writes results/cuda_int8.json + RESULTS.md
    python -m benchmarks.cuda_int8 --quick           # fewer shapes
    python -m benchmarks.cuda_int8 --interpret-smoke # CPU, TRITON_INTERPRET=1, tiny shapes: checks the script

GEMM rows: ours = int8 GEMM with the fused epilogue (per-token x per-channel scales, bias, fp16 out)
on int8 operands; ``ours_q`` adds the fused per-token activation quantization (fp16 in, fp16 out,
what a W8A8 Linear costs); ``int_mm`` = torch._int_mm then the same epilogue as separate torch ops;
fp16/bf16 = F.linear (cuBLAS). Times are medians of triton's do_bench (CUDA events, L2 flushed),
all variants of a shape measured back to back. SQNR is against a float64 product of the unquantized
operands. Models: fp16 eager baseline vs the converted int8 model (fp16 activations), timed side by
side with CUDA graphs up to batch 32; fidelity is the SQNR of the int8 output against fp32.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks._results import gpu_bench_device

log = logging.getLogger("benchmarks.cuda_int8")

SQUARE = [1024, 2048, 4096, 8192]
LINEARS = {  # (N, K) of each model's Linear layers
    "bert-base": [(768, 768), (3072, 768), (768, 3072)],
    "bert-large": [(1024, 1024), (4096, 1024), (1024, 4096)],
    "llama-7b": [(4096, 4096), (11008, 4096), (4096, 11008)],
}
TOKENS = [1, 16, 128, 2048, 8192]
# ResNet-50 (v1.5) bottleneck convs at 224x224: (C, O, k, stride, H_in)
RESNET50_CONVS = [
    (64, 64, 1, 1, 56), (64, 64, 3, 1, 56), (64, 256, 1, 1, 56), (256, 64, 1, 1, 56),
    (256, 128, 1, 1, 56), (128, 128, 3, 2, 56), (128, 512, 1, 1, 28), (512, 128, 1, 1, 28), (128, 128, 3, 1, 28),
    (512, 256, 1, 1, 28), (256, 256, 3, 2, 28), (256, 1024, 1, 1, 14), (1024, 256, 1, 1, 14), (256, 256, 3, 1, 14),
    (1024, 512, 1, 1, 14), (512, 512, 3, 2, 14), (512, 2048, 1, 1, 7), (2048, 512, 1, 1, 7), (512, 512, 3, 1, 7),
]


def sqnr_db(ref: torch.Tensor, y: torch.Tensor) -> float:
    ref, y = ref.double(), y.double()
    noise = (ref - y).pow(2).mean().clamp(min=1e-300)
    return float(10 * torch.log10(ref.pow(2).mean() / noise))


class Timer:
    """Median milliseconds: triton's do_bench on CUDA; a few wall-clock runs on CPU (smoke only)."""

    def __init__(self, cuda: bool, *, warmup: int, rep: int) -> None:
        self.cuda, self.warmup, self.rep = cuda, warmup, rep

    def __call__(self, fn: Callable[[], Any]) -> float:
        if self.cuda:
            from triton.testing import do_bench

            return float(do_bench(fn, warmup=self.warmup, rep=self.rep, return_mode="median"))
        fn()
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def _int_mm_or_none(a: torch.Tensor, bt: torch.Tensor) -> Callable[[], torch.Tensor] | None:
    """torch._int_mm as a callable, or None for shapes it rejects (M <= 16 on CUDA, K or N not /8)."""
    try:
        torch._int_mm(a, bt)
    except RuntimeError:
        return None
    return lambda: torch._int_mm(a, bt)


def _gemm_row(m: int, n: int, k: int, g: torch.Generator, timer: Timer, dev: torch.device) -> dict[str, Any]:
    from compress.quantization.lowering.kernels import int8_gemm, quantize_per_token

    x = torch.randn(m, k, generator=g).to(dev)
    w = (torch.randn(n, k, generator=g) * 0.02).to(dev)
    bias = (torch.randn(n, generator=g) * 0.1).to(dev)
    ref = x.double() @ w.double().T + bias.double()
    x16, w16, b16 = x.half(), w.half(), bias.half()
    xb, wb, bb = x.bfloat16(), w.bfloat16(), bias.bfloat16()
    sw = (w.abs().amax(1) / 127).clamp(min=1e-8)
    wq = torch.round(w / sw[:, None]).clamp(-128, 127).to(torch.int8)
    xq, sx = quantize_per_token(x16)
    mm = _int_mm_or_none(xq, wq.t())  # [K, N] column-major view: the layout _int_mm wants

    def ours() -> torch.Tensor:
        return int8_gemm(xq, wq, a_scale=sx, b_scale=sw, bias=bias, out_dtype=torch.float16)

    def ours_q() -> torch.Tensor:
        q, s = quantize_per_token(x16)
        return int8_gemm(q, wq, a_scale=s, b_scale=sw, bias=bias, out_dtype=torch.float16)

    def int_mm() -> torch.Tensor:
        assert mm is not None
        return (mm().float() * sx[:, None] * sw[None, :] + bias).half()

    out = ours()
    t_ours, t_ours_q = timer(ours), timer(ours_q)
    t_fp16 = timer(lambda: F.linear(x16, w16, b16))
    t_bf16 = timer(lambda: F.linear(xb, wb, bb))
    t_int = timer(int_mm) if mm is not None else None
    flops = 2.0 * m * n * k
    return {
        "M": m, "N": n, "K": k,
        "ours_tops": flops / t_ours / 1e9, "ours_q_tops": flops / t_ours_q / 1e9,
        "fp16_tflops": flops / t_fp16 / 1e9, "bf16_tflops": flops / t_bf16 / 1e9,
        "int_mm_tops": flops / t_int / 1e9 if t_int else None,
        "speedup_vs_fp16": t_fp16 / t_ours, "speedup_q_vs_fp16": t_fp16 / t_ours_q,
        "speedup_vs_int_mm": t_int / t_ours if t_int else None,
        "sqnr_db": sqnr_db(ref, out), "fp16_sqnr_db": sqnr_db(ref, F.linear(x16, w16, b16)),
    }


def bench_gemm(shapes: list[tuple[int, int, int]], timer: Timer, dev: torch.device) -> list[dict[str, Any]]:
    g = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    for m, n, k in shapes:
        row = _gemm_row(m, n, k, g, timer, dev)
        log.info("gemm %dx%dx%d: ours %.1f TOPS, fp16 %.1f TFLOPS, %.2fx; sqnr %.1f dB", m, n, k,
                 row["ours_tops"], row["fp16_tflops"], row["speedup_vs_fp16"], row["sqnr_db"])
        rows.append(row)
    return rows


def _conv_row(case: tuple[int, ...], g: torch.Generator, timer: Timer, dev: torch.device) -> dict[str, Any]:
    from compress.quantization.lowering.kernels import int8_conv2d

    batch, c, o, k, s, h = case
    pad = k // 2
    x = torch.randn(batch, c, h, h, generator=g).to(dev).contiguous(memory_format=torch.channels_last)
    w = (torch.randn(o, c, k, k, generator=g) * 0.05).to(dev)
    ref = F.conv2d(x.double(), w.double(), stride=s, padding=pad)
    sx = (x.abs().amax() / 127).reshape(1)
    xq = torch.round(x / sx).clamp(-128, 127).to(torch.int8).contiguous(memory_format=torch.channels_last)
    sw = (w.abs().amax((1, 2, 3)) / 127).clamp(min=1e-8)
    wq = torch.round(w / sw[:, None, None, None]).clamp(-128, 127).to(torch.int8).permute(0, 2, 3, 1).contiguous()
    x16 = x.half().contiguous(memory_format=torch.channels_last)
    w16 = w.half().contiguous(memory_format=torch.channels_last)

    def ours() -> torch.Tensor:
        return int8_conv2d(xq, wq, a_scale=sx, w_scale=sw, stride=s, padding=pad, out_dtype=torch.float16)

    out = ours()
    t_ours = timer(ours)
    t_fp16 = timer(lambda: F.conv2d(x16, w16, stride=s, padding=pad))
    flops = 2.0 * batch * out.shape[2] * out.shape[3] * o * c * k * k
    return {
        "batch": batch, "C": c, "O": o, "k": k, "stride": s, "H": h,
        "ours_tops": flops / t_ours / 1e9, "fp16_tflops": flops / t_fp16 / 1e9,
        "speedup_vs_fp16": t_fp16 / t_ours, "sqnr_db": sqnr_db(ref, out),
    }


def bench_conv(cases: list[tuple[int, ...]], timer: Timer, dev: torch.device) -> list[dict[str, Any]]:
    g = torch.Generator(device="cpu").manual_seed(1)
    rows = []
    for case in cases:
        rows.append(_conv_row(case, g, timer, dev))
        log.info("conv b%d %d->%d k%d s%d @%d: %.2fx", *case, rows[-1]["speedup_vs_fp16"])
    return rows


def _encoder(hidden: int, layers: int, heads: int, inter: int) -> nn.Module:
    from transformers import BertConfig, BertModel

    cfg = BertConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                     intermediate_size=inter, vocab_size=30522, max_position_embeddings=512)
    return BertModel(cfg, add_pooling_layer=False).eval()


def bench_models(spec: dict[str, Any], dev: torch.device, *, warmup: int, runs: int) -> list[dict[str, Any]]:
    from compress.export.validation.cuda import cast_float_layers, time_side_by_side
    from compress.quantization.api import QuantizeParams
    from compress.quantization.lowering.convert import convert_with_report

    import compress
    from compress.core.batching import call_model, primary_output
    from compress.models.resnet import resnet

    torch.manual_seed(0)
    rows = []
    # the ResNet keeps its 3-channel stem conv and classifier in float (usual practice); the encoder
    # quantizes all its Linear layers. Residual adds stay float (no requantizing epilogue yet).
    cases: list[tuple[str, nn.Module, str, Callable[[int], Any], list[int], Any]] = [
        ("resnet-w{}".format(spec["resnet_width"]), resnet(width=spec["resnet_width"], depth=3, in_channels=3).eval(),
         "w8a8", lambda b: torch.randn(b, 3, spec["image"], spec["image"]), spec["resnet_batches"], "float"),
        ("encoder-h{}-l{}".format(spec["hidden"], spec["layers"]),
         _encoder(spec["hidden"], spec["layers"], spec["heads"], 4 * spec["hidden"]), "w8a8_dynamic",
         lambda b: {"input_ids": torch.randint(0, 30522, (b, spec["seq"]))}, spec["encoder_batches"], "quantize"),
    ]
    for name, fp, scheme, make, batches, first_last in cases:
        calib = [make(4) for _ in range(2)]
        params = QuantizeParams(first_last=first_last, quantize_ops=False)
        fq = compress.quantize(copy.deepcopy(fp), scheme, calib, params=params).eval()
        int8, report = convert_with_report(fq)
        floats = [r.name for r in report if not r.converted]
        log.info("%s: %d int8 layers, float: %s", name, sum(r.converted for r in report), floats or "none")
        fp32 = fp.to(dev)
        fp16 = copy.deepcopy(fp).to(dev).half()
        if name.startswith("resnet"):
            fp16 = fp16.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # cuDNN's fast NHWC path, like the int8 model
        int8 = cast_float_layers(int8.to(dev), torch.float16).eval()
        for b in batches:
            x32 = {k: v.to(dev) for k, v in make(b).items()} if name.startswith("encoder") else make(b).to(dev)
            x16 = x32 if isinstance(x32, dict) else x32.half().contiguous(memory_format=torch.channels_last)
            with torch.no_grad():
                ref = primary_output(call_model(fp32, x32)).float()
                y8 = primary_output(call_model(int8, x16)).float()
                y16 = primary_output(call_model(fp16, x16)).float()
                fns = {"fp16": functools.partial(call_model, fp16, x16), "int8": functools.partial(call_model, int8, x16)}
                ms, graphs = time_side_by_side(fns, warmup=warmup, runs=runs, device=dev, graphs=b <= 32)
            rows.append({
                "name": name, "batch": b, "fp16_ms": ms["fp16"], "int8_ms": ms["int8"],
                "speedup": ms["fp16"] / ms["int8"], "metric": sqnr_db(ref, y8), "metric_name": "sqnr_db_vs_fp32",
                "fp16_sqnr_db": sqnr_db(ref, y16), "cuda_graphs": graphs, "float_layers": floats,
            })
            log.info("%s b=%d: fp16 %.3f ms, int8 %.3f ms, %.2fx, sqnr %.1f dB", name, b, ms["fp16"], ms["int8"],
                     rows[-1]["speedup"], rows[-1]["metric"])
    return rows


FULL: dict[str, Any] = {
    "gemm": [(s, s, s) for s in SQUARE] + sorted({(m, n, k) for v in LINEARS.values() for n, k in v for m in TOKENS}),
    "conv": [(b, *c) for b in (1, 32) for c in RESNET50_CONVS],
    "models": {"resnet_width": 128, "image": 32, "resnet_batches": [1, 32, 256], "hidden": 768, "layers": 12,
               "heads": 12, "seq": 128, "encoder_batches": [1, 32]},
}
QUICK: dict[str, Any] = {
    "gemm": [(4096, 4096, 4096), (8192, 8192, 8192), (1, 4096, 4096), (16, 11008, 4096), (2048, 3072, 768),
             (8192, 4096, 11008)],
    "conv": [(32, *c) for c in RESNET50_CONVS[:4]],
    "models": {**FULL["models"], "resnet_batches": [32], "encoder_batches": [32]},
}
SMOKE: dict[str, Any] = {  # ragged, tiny: the interpreter runs every kernel path of the script on CPU
    "gemm": [(5, 24, 40), (33, 40, 72)],
    "conv": [(2, 8, 16, 3, 1, 6), (1, 16, 8, 1, 1, 5)],
    "models": {"resnet_width": 4, "image": 8, "resnet_batches": [2], "hidden": 32, "layers": 1, "heads": 2,
               "seq": 8, "encoder_batches": [2]},
}


def _markdown(data: dict[str, Any]) -> str:
    from benchmarks._results import table

    parts = [
        "## CUDA int8 (Triton W8A8) vs fp16 cuBLAS/cuDNN and torch._int_mm\n",
        f"GPU: {data['gpu']}. Script: `python -m benchmarks.cuda_int8{' --quick' if data.get('quick') else ''}`"
        f"{' (six GEMM shapes, four convolutions, two models)' if data.get('quick') else ''}. "
        "TOPS = 2MNK/time; speedups are time ratios "
        "measured back to back; SQNR against float64 on the unquantized operands.\n",
        "### GEMM\n",
        table(data["gemm"], ["M", "N", "K", "ours_tops", "ours_q_tops", "fp16_tflops", "int_mm_tops",
                             "speedup_vs_fp16", "speedup_q_vs_fp16", "speedup_vs_int_mm", "sqnr_db", "fp16_sqnr_db"]),
        "### ResNet-50 convolutions (int8 NHWC vs fp16 channels-last cuDNN)\n",
        table(data["conv"], ["batch", "C", "O", "k", "stride", "H", "ours_tops", "fp16_tflops", "speedup_vs_fp16",
                             "sqnr_db"]),
        "### End to end (fp16 vs converted int8, fp16 activations)\n",
        table(data["models"], ["name", "batch", "fp16_ms", "int8_ms", "speedup", "metric", "fp16_sqnr_db",
                               "cuda_graphs"]),
    ]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.cuda_int8", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few representative shapes only")
    ap.add_argument("--interpret-smoke", action="store_true",
                    help="run the whole script on CPU under TRITON_INTERPRET=1 with tiny shapes (checks the script)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["gemm", "conv", "models"], help="parts to skip")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dev = gpu_bench_device("benchmarks.cuda_int8", args.interpret_smoke)
    if dev is None:
        return 2
    cuda = not args.interpret_smoke
    plan = SMOKE if args.interpret_smoke else QUICK if args.quick else FULL
    timer = Timer(cuda, warmup=25, rep=100)
    gpu = torch.cuda.get_device_name(0) if cuda else "cpu (TRITON_INTERPRET smoke)"
    data: dict[str, Any] = {"gpu": gpu, "quick": bool(args.quick), "gemm": [], "conv": [], "models": []}
    t0 = time.time()
    if "gemm" not in args.skip:
        data["gemm"] = bench_gemm(plan["gemm"], timer, dev)
    if "conv" not in args.skip:
        data["conv"] = bench_conv(plan["conv"], timer, dev)
    if "models" not in args.skip:
        data["models"] = bench_models(plan["models"], dev, warmup=10 if cuda else 0, runs=50 if cuda else 1)
    log.info("done in %.0f s", time.time() - t0)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=2))
    if cuda:  # smoke figures are interpreter timings: never written over measured results
        from benchmarks._results import write_section

        write_section("cuda_int8", _markdown(data), data)
    else:
        print(_markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
