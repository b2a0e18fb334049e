"""End-to-end speed of converted models on CUDA against the same model in fp16: a Llama decoder stack
at LLaMA-7B widths (prefill and decode), a BERT-base encoder and a ResNet-50, each as transformers /
torchvision define them, converted by ``compress.convert`` for every scheme that has CUDA kernels.

    python -m benchmarks.cuda_e2e                    # on a CUDA GPU: results/cuda_e2e.json + RESULTS.md
    python -m benchmarks.cuda_e2e --interpret-smoke  # CPU, TRITON_INTERPRET=1, tiny widths: checks the script

Schemes: ``W8A8`` (int8 weights per channel, int8 activations per token, our Triton GEMM),
``FP8_DYNAMIC`` (e4m3 weights per channel and activations per token, cuBLASLt through
``torch._scaled_mm``), ``W4A16`` (int4 g128 weights, our Triton kernel or PyTorch's tinygemm,
whichever is faster per shape, timed once), ``w8a8`` (static per-tensor int8 activations; ResNet).
Every variant of a model is timed in alternating runs through CUDA graphs (median of the replays,
CUDA events), so launch overhead stays out of all of them alike; the ratio is fp16 time over the
variant's. Fidelity is measured against the fp32 model on the same inputs: cosine similarity and
SQNR of the last hidden state (logits for ResNet). Layers a scheme leaves in float are counted
with their reasons.

Decode: a StaticCache holding ``context`` tokens, one new token per sequence at batch 1..16, the
step replayed as a CUDA graph (what serving stacks do).

``--compile``: the Llama prefill and BERT are also timed with every variant, fp16 included, compiled
by ``torch.compile`` (inductor fuses the float work: norms, rotary, SiLU*mul, residual adds; our
kernels are custom operators it calls as they are); compiled variants are compared with compiled
fp16, in the same alternating run as the eager ones. ``--profile``: one eager forward of each
variant under the profiler, CUDA kernel time summed per kind (GEMM, activation quantization,
attention, other), which says where an end-to-end ratio is lost.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks._results import gpu_bench_device

log = logging.getLogger("benchmarks.cuda_e2e")

FULL: dict[str, Any] = {
    "llama": {"hidden": 4096, "inter": 11008, "heads": 32, "kv_heads": 32, "layers": 4, "vocab": 1024,
              "prefill": [2048], "decode": [1, 4, 16], "context": 2048},
    "bert": {"hidden": 768, "inter": 3072, "heads": 12, "layers": 12, "batch": [32], "seq": 128},
    "resnet": {"batch": [32], "image": 224},
    "schemes": {"llama": ["W8A8", "FP8_DYNAMIC", "W4A16"], "bert": ["W8A8", "FP8_DYNAMIC"], "resnet": ["w8a8"]},
}
SMOKE: dict[str, Any] = {
    "llama": {"hidden": 64, "inter": 128, "heads": 4, "kv_heads": 2, "layers": 1, "vocab": 128,
              "prefill": [8], "decode": [2], "context": 8},
    "bert": {"hidden": 32, "inter": 64, "heads": 2, "layers": 1, "batch": [2], "seq": 8},
    "resnet": {"batch": [1], "image": 32},
    "schemes": {"llama": ["W8A8", "FP8_DYNAMIC", "W4A16"], "bert": ["W8A8"], "resnet": ["w8a8"]},
}


def _fidelity(ref: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    ref, y = ref.double().flatten(1), y.double().flatten(1)
    noise = (ref - y).pow(2).mean().clamp(min=1e-300)
    cos = torch.nn.functional.cosine_similarity(ref, y, dim=1).mean()
    return {"cosine": float(cos), "sqnr_db": float(10 * torch.log10(ref.pow(2).mean() / noise))}


def _convert(fp32: nn.Module, scheme: str, calib: list[Any], dev: torch.device, dtype: torch.dtype,
             *, first_last: str = "quantize") -> tuple[nn.Module, dict[str, Any]]:
    from compress.export.validation.cuda import cast_float_layers
    from compress.quantization.api import QuantizeParams
    from compress.quantization.lowering.convert import convert_with_report

    import compress

    params = QuantizeParams(first_last=first_last, quantize_ops=False)
    fq = compress.quantize(copy.deepcopy(fp32), scheme, calib, params=params).eval()
    model, report = convert_with_report(fq, placed="drop")
    model = cast_float_layers(model.to(dev), dtype).eval()
    kinds: dict[str, int] = {}
    for r in report:
        if r.converted:
            kinds[str(r.int8_type)] = kinds.get(str(r.int8_type), 0) + 1
    reasons: dict[str, int] = {}
    for r in report:
        if not r.converted:
            reasons[r.reason] = reasons.get(r.reason, 0) + 1
    return model, {"converted": kinds, "float": reasons}


def _time(fns: dict[str, Callable[[], Any]], dev: torch.device, *, runs: int) -> dict[str, float]:
    from compress.export.validation.cuda import time_side_by_side

    with torch.no_grad():
        ms, graphs = time_side_by_side(fns, warmup=3, runs=runs, device=dev, graphs=True)
    if dev.type == "cuda" and not graphs:
        log.warning("CUDA graphs could not be captured: eager timings")
    return ms


# Some transformers releases (5.17) write a StaticCache at its own running length, not at the
# cache_position given, so every call of a step (warm-up, capture, each graph replay) takes a new
# slot: the cache gets room for all of them. A static cache's attention spans its whole length
# (masked), so the room costs every variant alike.
_CACHE_ROOM = 256


def _llama(spec: dict[str, Any]) -> nn.Module:
    from transformers import LlamaConfig, LlamaModel

    cfg = LlamaConfig(hidden_size=spec["hidden"], intermediate_size=spec["inter"], num_attention_heads=spec["heads"],
                      num_key_value_heads=spec["kv_heads"], num_hidden_layers=spec["layers"],
                      vocab_size=spec["vocab"], max_position_embeddings=spec["context"] + 2 * _CACHE_ROOM)
    torch.manual_seed(0)
    return LlamaModel(cfg).eval()


def _rows_for(name: str, fns: dict[str, Callable[[], Any]], outs: dict[str, torch.Tensor], dev: torch.device,
              runs: int, extra: dict[str, Any], info: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    ms = _time(fns, dev, runs=runs)
    rows = []
    for variant, t in ms.items():
        scheme, compiled = variant.removesuffix(_COMPILED), variant.endswith(_COMPILED)
        if scheme in ("fp16", "fp32", _FP16N):
            continue
        base = "fp16" + _COMPILED if compiled else "fp16"  # compiled against compiled fp16: the fair pair
        base_n = _FP16N + _COMPILED if compiled else _FP16N
        fid = _fidelity(outs["fp32"], outs[variant])
        strict = {"fp16n_ms": ms[base_n], "speedup_fp16n": ms[base_n] / t} if base_n in ms else {}
        rows.append({"model": name, **extra, "scheme": scheme, "mode": "compile" if compiled else "eager",
                     "fp16_ms": ms[base], "ms": t, "speedup": ms[base] / t, **strict, **fid,
                     "fp16_cosine": _fidelity(outs["fp32"], outs[base])["cosine"],
                     "layers": info[scheme]["converted"], "float_layers": info[scheme]["float"]})
        log.info("%s %s %s: %s %.3f ms, %s %.3f ms, %.2fx, cosine %.5f", name, extra, variant, base, ms[base], variant,
                 t, rows[-1]["speedup"], fid["cosine"])
    return rows


_COMPILED = "+compile"
_FP16N = "fp16+fused-norm"


def _with_compiled(models: dict[str, nn.Module], compile_: bool) -> dict[str, nn.Module]:
    """``models`` plus, when asked, each non-fp32 one compiled by inductor (static shapes; the
    Triton kernels stay custom operators inside the graph)."""
    if not compile_:
        return models
    out = dict(models)
    for k, m in models.items():
        if k != "fp32":
            out[k + _COMPILED] = torch.compile(m, dynamic=False)  # type: ignore[assignment]
    return out


_KINDS = (("attention", ("flash", "fmha", "attention", "sdpa", "efficient")),
          ("quantize", ("per_token_kernel", "static_kernel", "qdq_kernel")),
          ("gemm", ("gemm", "gemv", "cutlass", "xmma", "nvjet", "cublas", "scaled_mm", "wgmma", "_mm_", "mm_kernel",
                    "triton_tem", "w4a16", "splitk", "conv", "implicit", "tinygemm", "int4")))


def _kind(kernel: str) -> str:
    low = kernel.lower()
    if low.startswith(("triton_poi", "triton_red", "triton_per")):
        return "other"  # inductor's fused pointwise/reduction kernels, named after every op they fuse ("mm" too)
    return next((k for k, keys in _KINDS if any(key in low for key in keys)), "other")


def _kernel_times(fn: Callable[[], Any], dev: torch.device, iters: int, *,
                  with_ops: bool = False) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """``fn`` under torch.profiler after a warm-up call: device kernel ms per call by kernel name
    (on CPU: top-level ops), and with ``with_ops`` on CUDA, per kernel the ms of each op that
    launched it (CPU activity recorded too)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = dev.type == "cuda"
    acts = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    if cuda and with_ops:
        acts.append(ProfilerActivity.CPU)
    with torch.no_grad():
        fn()
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=acts) as prof:
            for _ in range(iters):
                fn()
            if cuda:
                torch.cuda.synchronize()
    per: dict[str, float] = {}
    ops: dict[str, dict[str, float]] = {}
    for e in prof.events():
        if (e.device_type == DeviceType.CUDA) if cuda else e.cpu_parent is None:
            per[e.name] = per.get(e.name, 0.0) + e.time_range.elapsed_us() / 1e3 / iters
        if cuda and with_ops and e.device_type == DeviceType.CPU:
            for kern in e.kernels:
                by = ops.setdefault(kern.name, {})
                by[e.name] = by.get(e.name, 0.0) + kern.duration
    return per, ops


def _by_kind(per: dict[str, float]) -> dict[str, Any]:
    """The common profile row of kernel times ``per`` (name -> ms): total, ms per kind, the five longest."""
    kinds: dict[str, float] = {}
    for name, t in per.items():
        kinds[_kind(name)] = kinds.get(_kind(name), 0.0) + t
    top = sorted(per.items(), key=lambda kv: -kv[1])[:5]
    return {"total_ms": sum(per.values()), **{f"{kind}_ms": kinds.get(kind, 0.0) for kind, _ in _KINDS},
            "other_ms": kinds.get("other", 0.0), "top": [[n[:80], round(t, 4)] for n, t in top]}


def _profile(fns: dict[str, Callable[[], Any]], dev: torch.device, iters: int = 3) -> dict[str, dict[str, Any]]:
    """Per variant: device kernel time per forward (ms) summed per kind, and the five longest kernels."""
    out: dict[str, dict[str, Any]] = {}
    for k, fn in fns.items():
        out[k] = _by_kind(_kernel_times(fn, dev, iters)[0])
        log.info("profile %s: %s", k, {kk: round(v, 3) for kk, v in out[k].items() if kk != "top"})
    return out


def bench_llama(spec: dict[str, Any], schemes: list[str], dev: torch.device, runs: int,
                rows: list[dict[str, Any]], profiles: dict[str, Any]) -> None:
    from transformers import StaticCache

    fp32 = _llama(spec).to(dev)
    calib = [{"input_ids": torch.randint(0, spec["vocab"], (1, 64)).to(dev)}]
    models: dict[str, nn.Module] = {"fp32": fp32, "fp16": copy.deepcopy(fp32).half()}
    # the stricter baseline: fp16 with its RMSNorms run by the same norm kernel the converted models
    # use (without codes), so a ratio against it credits the int8/fp8 work, not the norm's fusion
    from compress.quantization.lowering.fused_norm import fuse_rmsnorms

    models[_FP16N] = copy.deepcopy(models["fp16"])
    fuse_rmsnorms(models[_FP16N], record=lambda *_: None)
    info: dict[str, dict[str, Any]] = {}
    for s in schemes:  # quantized on the GPU: calibration and weight grids of 7B-wide layers
        models[s], info[s] = _convert(fp32, s, calib, dev, torch.float16)
        log.info("llama %s: %s", s, info[s])
    g = torch.Generator().manual_seed(1)
    for t in spec["prefill"]:
        ids = torch.randint(0, spec["vocab"], (1, t), generator=g).to(dev)
        timed = _with_compiled(models, spec.get("compile", False))
        with torch.no_grad():
            outs = {k: m(input_ids=ids, use_cache=False).last_hidden_state.float() for k, m in timed.items()}
        fns = {k: (lambda m=m, ids=ids: m(input_ids=ids, use_cache=False)) for k, m in timed.items() if k != "fp32"}
        if spec.get("profile"):
            profiles[f"llama prefill {t}"] = _profile(fns, dev)
        rows += _rows_for("llama", fns, outs, dev, runs, {"phase": "prefill", "batch": 1, "tokens": t}, info)
        del timed, fns
    ctx = spec["context"]
    for b in spec["decode"] if "decode" in spec.get("phases", ("decode",)) else []:
        ids = torch.randint(0, spec["vocab"], (b, ctx), generator=g).to(dev)
        step = torch.randint(0, spec["vocab"], (b, 1), generator=g).to(dev)
        pos = torch.tensor([ctx], device=dev)
        outs, fns = {}, {}
        # not compiled: compiled decode steps ran 20x slower than eager on CPU (transformers 5.24), as a
        # recompile per step would; a StaticCache that keeps its write position as a Python int (5.17)
        # would change dynamo's guards every step. Not worth device time until that is understood
        timed = models
        for k, m in timed.items():
            cache = StaticCache(config=m.config, max_cache_len=ctx + _CACHE_ROOM)
            with torch.no_grad():
                m(input_ids=ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(ctx, device=dev))
                outs[k] = m(input_ids=step, past_key_values=cache, use_cache=True, cache_position=pos).last_hidden_state.float()
            if k != "fp32":
                # each replay rewrites the same cache slot: the step the timings measure is identical
                fns[k] = lambda m=m, cache=cache, step=step, pos=pos: m(
                    input_ids=step, past_key_values=cache, use_cache=True, cache_position=pos)
        if spec.get("profile"):
            profiles[f"llama decode batch {b}"] = _profile(fns, dev)
        rows += _rows_for("llama", fns, outs, dev, runs, {"phase": "decode", "batch": b, "tokens": ctx}, info)
        del fns, outs, timed


def bench_bert(spec: dict[str, Any], schemes: list[str], dev: torch.device, runs: int,
               rows: list[dict[str, Any]], profiles: dict[str, Any]) -> None:
    from compress.quantization.lowering.fused_norm import FusedLayerNorm, fuse_norms
    from transformers import BertConfig, BertModel

    cfg = BertConfig(hidden_size=spec["hidden"], num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"],
                     intermediate_size=spec["inter"], vocab_size=30522, max_position_embeddings=512)
    torch.manual_seed(0)
    fp32 = BertModel(cfg, add_pooling_layer=False).eval()
    fp32 = fp32.to(dev)
    calib = [{"input_ids": torch.randint(0, 30522, (4, spec["seq"])).to(dev)}]
    models: dict[str, nn.Module] = {"fp32": fp32, "fp16": copy.deepcopy(fp32).half()}
    # the stricter baseline, as for Llama: fp16 whose LayerNorms run the converted models' norm kernel
    # (without codes). The converted models fuse theirs (convert's default for placed="drop"): each
    # post-LN LayerNorm also writes the per-token codes of q/k/v (next layer) or of the MLP's first Linear
    models[_FP16N] = copy.deepcopy(models["fp16"])
    fuse_norms(models[_FP16N], record=lambda *_: None, forms=(FusedLayerNorm,))
    info = {}
    for s in schemes:
        models[s], info[s] = _convert(fp32, s, calib, dev, torch.float16)
        log.info("bert %s: %s", s, info[s])
    for b in spec["batch"]:
        ids = torch.randint(0, 30522, (b, spec["seq"])).to(dev)
        timed = _with_compiled(models, spec.get("compile", False))
        with torch.no_grad():  # also the eager warm-up in which each fused norm finds its readers
            outs = {k: m(input_ids=ids).last_hidden_state.float() for k, m in timed.items()}
        fns = {k: (lambda m=m, ids=ids: m(input_ids=ids)) for k, m in timed.items() if k != "fp32"}
        # always (cheap): the per-category breakdown is what says where BERT's time goes
        profiles[f"bert batch {b}"] = _bert_profile(fns, dev)
        rows += _rows_for("bert-base", fns, outs, dev, runs, {"phase": "encode", "batch": b, "tokens": spec["seq"]}, info)


# BERT's kernel-time categories, in the order of the RESULTS table. gemm_q: the int8 Triton GEMM and
# FP8's cuBLASLt GEMMs (launched by aten::_scaled_mm); gemm_fp16: every other GEMM.
_BERT_CATS = ("gemm_q", "gemm_fp16", "quantize", "norm", "attention", "elementwise", "other")
_GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear", "aten::matmul")
_BERT_KEYS = (("quantize", ("_per_token_kernel", "_static_kernel", "_qdq_kernel")),
              ("norm", ("_norm_quant_kernel", "layer_norm", "layernorm", "rms_norm", "rmsnorm")),
              ("attention", ("flash", "fmha", "attention", "sdpa", "efficient", "softmax")),
              ("gemm_fp16", ("gemm", "gemv", "cutlass", "xmma", "nvjet", "cublas", "wgmma", "_mm_", "mm_kernel",
                             "splitk", "sm90_", "sm80_", "ampere_", "triton_tem")),
              ("elementwise", ("elementwise", "vectorized", "unrolled", "gelu", "add", "mul", "copy", "fill", "cat",
                               "index", "embedding", "gather", "where", "memcpy", "memset", "triton_poi")))


def _bert_category(kernel: str, op: str) -> str:
    """The category of one kernel, from its name and the aten op that launched it ("" if none)."""
    low = kernel.lower()
    if low.startswith("_gemm_kernel") or "scaled_mm" in op or "e4m3" in low:  # _scaled_mm(_v2)
        return "gemm_q"
    if op in _GEMM_OPS and not low.startswith(("triton_poi", "triton_red", "triton_per")):
        return "gemm_fp16"
    return next((cat for cat, keys in _BERT_KEYS if any(key in low for key in keys)), "other")


def _bert_profile(fns: dict[str, Callable[[], Any]], dev: torch.device, iters: int = 3) -> dict[str, dict[str, Any]]:
    """Per variant: device kernel ms per forward in each of _BERT_CATS (and their shares), the kinds
    of the common profile table, the five longest kernels; per scheme, the Amdahl ceiling its GEMMs
    allow (the GEMM share of fp16's kernel time, the scheme's GEMMs' speed over fp16's)."""
    cuda = dev.type == "cuda"
    out: dict[str, dict[str, Any]] = {}
    for k, fn in fns.items():
        per, ops = _kernel_times(fn, dev, iters, with_ops=True)  # ops: kernel name -> launching op -> ms
        cats = dict.fromkeys(_BERT_CATS, 0.0)
        for name, t in per.items():
            op = max(ops[name], key=ops[name].__getitem__) if name in ops else (name if not cuda else "")
            cats[_bert_category(name, op)] += t
        row = _by_kind(per)
        total = row["total_ms"]
        out[k] = {**row, "breakdown_ms": cats,
                  "breakdown_share": {c: (t / total if total else 0.0) for c, t in cats.items()}}
        log.info("bert breakdown %s: %s", k, {c: round(t, 3) for c, t in cats.items() if t})
    for k, p in out.items():
        base = out.get("fp16" + _COMPILED if k.endswith(_COMPILED) else "fp16")
        if k.removesuffix(_COMPILED) in ("fp16", _FP16N) or base is None:
            continue
        gemm16 = base["breakdown_ms"]["gemm_fp16"] + base["breakdown_ms"]["gemm_q"]
        gemm = p["breakdown_ms"]["gemm_fp16"] + p["breakdown_ms"]["gemm_q"]
        x = gemm16 / base["total_ms"] if base["total_ms"] else 0.0
        y = gemm16 / gemm if gemm else float("nan")
        p["amdahl"] = {"gemm_share_fp16": x, "gemm_speedup": y, "ceiling": 1 / (1 - x + x / y) if gemm else float("nan"),
                       "ceiling_at_2x": 1 / (1 - x + x / 2), "kernel_time_ratio": base["total_ms"] / p["total_ms"]}
        log.info("bert amdahl %s: %s", k, {a: round(v, 3) for a, v in p["amdahl"].items()})
    return out


def _resnet() -> tuple[str, nn.Module]:
    try:
        from torchvision.models import resnet50

        torch.manual_seed(0)
        return "resnet50 (torchvision)", resnet50(weights=None).eval()
    except ImportError:  # the smoke on a machine without torchvision: the project's ResNet
        from compress.models.resnet import resnet

        return "resnet (compress zoo)", resnet(width=8, depth=2, in_channels=3).eval()


def bench_resnet(spec: dict[str, Any], schemes: list[str], dev: torch.device, runs: int,
                 rows: list[dict[str, Any]], profiles: dict[str, Any]) -> None:
    name, fp32 = _resnet()
    fp32 = fp32.to(dev)
    size = spec["image"]
    calib = [torch.randn(4, 3, size, size).to(dev) for _ in range(2)]
    cl = torch.channels_last
    models: dict[str, nn.Module] = {"fp32": copy.deepcopy(fp32).to(dev),
                                    "fp16": copy.deepcopy(fp32).to(dev).half().to(memory_format=cl)}  # type: ignore[call-overload]
    info = {}
    for b in spec["batch"]:
        x32 = torch.randn(b, 3, size, size).to(dev)
        x16 = x32.half().contiguous(memory_format=cl)
        for s in schemes:
            # the stem (3 channels) and classifier stay float, as usual for CNNs; speed_check keeps
            # every conv whose int8 kernel is slower than cuDNN fp16 at its shape in fp16. Two
            # deployments: placed quantizers dropped (what validate --backend cuda reports), and
            # kept as one-kernel passes (exactly the fake-quant model's arithmetic)
            for placed in ("drop", "fuse") if spec.get("parity") else ("drop",):
                key = s if placed == "drop" else f"{s} (parity)"
                models[key], info[key] = _convert_checked(fp32, s, calib, dev, x16, placed)
        with torch.no_grad():
            outs = {k: m(x32 if k == "fp32" else x16).float() for k, m in models.items()}
        fns = {k: (lambda m=m, x16=x16: m(x16)) for k, m in models.items() if k != "fp32"}
        if spec.get("profile"):
            profiles[f"resnet batch {b}"] = _profile(fns, dev)
        rows += _rows_for(name, fns, outs, dev, runs, {"phase": "classify", "batch": b, "tokens": size}, info)


def _convert_checked(fp32: nn.Module, scheme: str, calib: list[Any], dev: torch.device,
                     example: torch.Tensor, placed: str) -> tuple[nn.Module, dict[str, Any]]:
    from compress.export.validation.cuda import cast_float_layers
    from compress.quantization.api import QuantizeParams
    from compress.quantization.lowering.convert import convert_with_report

    import compress

    fq = compress.quantize(copy.deepcopy(fp32), scheme, calib, params=QuantizeParams(first_last="float")).eval()
    model, report = convert_with_report(fq, speed_check=example, speed_dtype=torch.float16, placed=placed)
    model = cast_float_layers(model.to(dev), torch.float16).eval().to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    kinds: dict[str, int] = {}
    reasons: dict[str, int] = {}
    for r in report:
        if r.converted:
            kinds[str(r.int8_type)] = kinds.get(str(r.int8_type), 0) + 1
        else:
            key = "speed check: int8 kernel slower than fp16 at its shape" if r.reason.startswith("speed check") else r.reason
            reasons[key] = reasons.get(key, 0) + 1
    return model, {"converted": kinds, "float": reasons}


def _tuned_tiles() -> dict[str, str]:
    """The int8 GEMM tile the autotuner chose per (M bucket, N, K) so far: which decode shapes split K."""
    gemm = sys.modules.get("compress.quantization.lowering.kernels.gemm")
    tuned = getattr(gemm, "_gemm_tuned", None)
    out = {}
    for key, cfg in getattr(tuned, "cache", {}).items():
        kw = cfg.kwargs
        out[f"M<={key[0]} N={key[1]} K={key[2]}"] = (f"{kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']} s{cfg.num_stages} "
                                                 f"w{cfg.num_warps} split{kw.get('SPLIT_K', 1)}")
    return out


def _markdown(data: dict[str, Any]) -> str:
    from benchmarks._results import table

    rows = [{"mode": "eager", **r, "layers": ", ".join(f"{v} {k}" for k, v in r["layers"].items()),
             "kept_float": sum(r["float_layers"].values())} for r in data["rows"]]
    parts = [
        "## CUDA end to end: converted models vs fp16\n",
        f"GPU: {data['gpu']}. Script: `python -m benchmarks.cuda_e2e`. Models as transformers and torchvision "
        "define them, random weights: a Llama decoder stack at LLaMA-7B widths "
        f"({data['plan']['llama']['layers']} layers, hidden 4096, MLP 11008, 32 heads), BERT-base, ResNet-50. "
        "Each variant timed in alternating runs as CUDA-graph replays (median); speedup = fp16 ms / variant ms. "
        "Cosine and SQNR: last hidden state (ResNet: logits) against the fp32 model on the same input. "
        "Decode: one token per sequence against a StaticCache of 2048 tokens.\n",
        f"Rows measured on {', '.join(sorted({str(r.get('date', '2026-11-26'))[:10] for r in rows}))} (same GPU model; "
        "each row's two timings come from one run).\n",
        table(rows, ["model", "phase", "batch", "tokens", "scheme", "mode", "fp16_ms", "ms", "speedup", "fp16n_ms",
                     "speedup_fp16n", "cosine", "sqnr_db", "fp16_cosine", "layers", "kept_float"]),
    ]
    parts.append("\n`fp16n_ms` / `speedup_fp16n` (Llama, BERT): against fp16 whose RMSNorms (LayerNorms) run the same norm kernel as the "
                 "converted models (without codes): the stricter baseline, which does not credit the norm's fusion. "
                 "It still credits the horizontal fusion (the int8 Linears reading one tensor, q/k/v and gate/up, "
                 "run as one GEMM), which an fp16 model could also use (vLLM's fused QKV): the baseline keeps "
                 "transformers' separate fp16 projections.\n")
    parts.append("\nThe random-weight Llama stack amplifies any perturbation (fp16 itself: column `fp16_cosine`), so "
                 "its cosines say as much about that as about a scheme; BERT-base's are the fidelity figures to read. "
                 "`compile` rows compare with fp16 compiled the same way, in the same run.\n")
    kept = {(r["model"], r["scheme"]): r["float_layers"] for r in data["rows"] if r["float_layers"]}
    if kept:
        parts.append("\nLayers kept in float, with the converter's reasons:\n")
        for (model, scheme), reasons in kept.items():
            parts.append(f"- {model} {scheme}: " + "; ".join(f"{n} x {why}" for why, n in reasons.items()))
    if data.get("profiles"):
        parts.append("\nWhere the time goes: CUDA kernel milliseconds per forward (profiler, eager unless "
                     "`+compile`), summed per kind; `quantize` is our activation quantization kernels.\n")
        prof = [{"run": run, "variant": v, **{k: x for k, x in p.items() if k != "top"}}
                for run, per in data["profiles"].items() for v, p in per.items()]
        parts.append(table(prof, ["run", "variant", "total_ms", "gemm_ms", "quantize_ms", "attention_ms", "other_ms"]))
    parts += _bert_breakdown_md(data.get("profiles", {}))
    if data.get("errors"):
        parts.append("\nParts that failed on this machine:\n")
        parts += [f"- {e}" for e in data["errors"]]
    return "\n".join(parts) + "\n"


def _bert_breakdown_md(profiles: dict[str, Any]) -> list[str]:
    """BERT's kernel time per category (ms per forward and share) and the Amdahl ceilings."""
    from benchmarks._results import table

    runs = {run: per for run, per in profiles.items() if run.startswith("bert")
            and any("breakdown_ms" in p for p in per.values())}
    if not runs:
        return []
    rows, amdahl = [], []
    for run, per in runs.items():
        for v, p in per.items():
            bd, sh = p.get("breakdown_ms", {}), p.get("breakdown_share", {})
            rows.append({"run": run, "variant": v, "total_ms": p["total_ms"],
                         **{c: f"{bd.get(c, 0.0):.3f} ({100 * sh.get(c, 0.0):.0f}%)" for c in _BERT_CATS}})
            if "amdahl" in p:
                amdahl.append({"run": run, "variant": v, **p["amdahl"]})
    parts = ["\nBERT-base, where the kernel time goes (profiler, one eager forward, or `+compile`; ms per forward "
             "and share of the variant's kernel time): `gemm_q` the int8 Triton GEMM and FP8's cuBLASLt GEMMs, "
             "`gemm_fp16` every other GEMM, `quantize` our per-token activation quantization kernels, `norm` "
             "LayerNorm (ours with the codes, or torch's), `attention` SDPA's kernels, `elementwise` GELU, residual "
             "adds, embeddings, copies.\n", table(rows, ["run", "variant", "total_ms", *_BERT_CATS])]
    if amdahl:
        parts += ["\nAmdahl: with GEMMs a share X of fp16's kernel time and the scheme's GEMMs (all of them, "
                  "quantized and fp16) Y times faster than fp16's, no saving elsewhere gives more than "
                  "1/(1-X+X/Y) (`ceiling`; `ceiling_at_2x`: Y = 2, the H100/H200 int8/fp8 tensor-core peak over "
                  "fp16). `kernel_time_ratio`: fp16 kernel ms over the variant's.\n",
                  table(amdahl, ["run", "variant", "gemm_share_fp16", "gemm_speedup", "ceiling", "ceiling_at_2x",
                                 "kernel_time_ratio"])]
    return parts


def _row_key(r: dict[str, Any]) -> tuple[Any, ...]:
    return (r.get("part"), r.get("phase"), r.get("batch"), r.get("tokens"), r.get("scheme"), r.get("mode", "eager"))


def _write(data: dict[str, Any], path: Path) -> None:
    """Write the JSON and the RESULTS.md section, keeping the rows of models this run did not
    measure when an earlier run on the same GPU did (each model may run in its own process: a
    device-side assert in one poisons the CUDA context for the rest)."""
    from benchmarks._results import write_section

    if path.exists():
        old = json.loads(path.read_text())
        if old.get("gpu") == data["gpu"]:
            mine = {r["part"] for r in data["rows"]} | set(data.get("parts", []))
            fresh = {_row_key(r) for r in data["rows"]}
            # a row this run did not re-measure (another phase, another mode) stays, with its date
            kept = [r for r in old.get("rows", []) if _row_key(r) not in fresh]
            profiles = {k: v for k, v in old.get("profiles", {}).items() if k.split()[0] not in mine}
            data = {**data, "rows": kept + data["rows"], "profiles": {**profiles, **data.get("profiles", {})},
                    "errors": [e for e in old.get("errors", []) if e.split(":")[0] not in mine] + data["errors"]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str))
    write_section("cuda_e2e", _markdown(data), data)


def merge(files: list[Path], path: Path) -> None:
    """Merge the result files of several runs on one GPU (each device call starts from a bare copy of
    the repository): per row, the latest measurement wins; profiles likewise; written as one section
    stamped with the GPU machine's record."""
    runs = [json.loads(f.read_text()) for f in files]
    if len({r["gpu"] for r in runs}) != 1:
        raise SystemExit(f"benchmarks.cuda_e2e --merge: the files come from different GPUs ({[r['gpu'] for r in runs]})")
    best: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in (row for run in runs for row in run["rows"]):
        old = best.get(_row_key(r))
        if old is None or str(r.get("date", "")) >= str(old.get("date", "")):
            best[_row_key(r)] = r
    profiles: dict[str, Any] = {}
    for run in sorted(runs, key=lambda run: max(str(r.get("date", "")) for r in run["rows"])):
        profiles.update(run.get("profiles", {}))
    data = {**runs[-1], "rows": list(best.values()), "profiles": profiles, "errors": [], "parts": ["llama", "bert", "resnet"]}
    data.pop("machine", None)
    path.write_text(json.dumps({"machine": runs[-1].get("machine"), **data}, indent=2, default=str))
    from benchmarks._results import write_section

    write_section("cuda_e2e", _markdown(data), data, measured_on=runs[-1].get("machine"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.cuda_e2e", description=__doc__.splitlines()[0])
    ap.add_argument("--interpret-smoke", action="store_true", help="CPU under TRITON_INTERPRET=1, tiny widths")
    ap.add_argument("--only", nargs="*", default=["llama", "bert", "resnet"], choices=["llama", "bert", "resnet"])
    ap.add_argument("--layers", type=int, default=None, help="decoder layers of the Llama stack")
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--resnet-parity", action="store_true",
                    help="also time the ResNet with its placed quantizers kept (exact fake-quant arithmetic)")
    ap.add_argument("--compile", action="store_true",
                    help="also time the Llama prefill and BERT with every variant compiled by torch.compile")
    ap.add_argument("--phases", nargs="*", default=["prefill", "decode"], choices=["prefill", "decode"],
                    help="Llama phases to time")
    ap.add_argument("--decode-batches", nargs="*", type=int, default=None, help="Llama decode batch sizes")
    ap.add_argument("--profile", action="store_true", help="CUDA kernel time per kind for each variant")
    ap.add_argument("--schemes", nargs="*", default=None, metavar="SCHEME",
                    help="only these schemes (e.g. W4A16 w8a8); fp16 always runs as the baseline")
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/cuda_e2e.json"))
    ap.add_argument("--merge", nargs="+", type=Path, default=None, metavar="JSON",
                    help="merge result files of runs on one GPU into --json and RESULTS.md (no GPU needed)")
    args = ap.parse_args(argv)
    if args.merge:
        merge(args.merge, args.json)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # Triton is optional here: the e2e variants without our kernels (fp16, FP8, tinygemm) still run
    dev = gpu_bench_device("benchmarks.cuda_e2e", args.interpret_smoke, needs_triton=False)
    if dev is None:
        return 2
    cuda = not args.interpret_smoke
    plan = copy.deepcopy(SMOKE if args.interpret_smoke else FULL)
    if args.layers:
        plan["llama"]["layers"] = args.layers
    plan["resnet"]["parity"] = args.resnet_parity
    for part in ("llama", "bert"):
        plan[part]["compile"] = args.compile
    plan["llama"]["phases"] = args.phases
    if args.decode_batches:
        plan["llama"]["decode"] = args.decode_batches
    if "prefill" not in args.phases:
        plan["llama"]["prefill"] = []
    for part in ("llama", "bert", "resnet"):
        plan[part]["profile"] = args.profile
        if args.schemes is not None:
            plan["schemes"][part] = [s for s in plan["schemes"][part] if s in args.schemes]
    runs = args.runs if cuda else 1
    data: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0) if cuda else "cpu (TRITON_INTERPRET smoke)",
                            "plan": plan, "rows": [], "errors": [], "profiles": {}}
    benches: dict[str, Callable[..., None]] = {"llama": bench_llama, "bert": bench_bert, "resnet": bench_resnet}
    t0 = time.time()
    data["parts"] = list(args.only)
    for part in args.only:
        rows: list[dict[str, Any]] = []  # filled as measured: a failure keeps the rows before it
        try:
            benches[part](plan[part], plan["schemes"][part], dev, runs, rows, data["profiles"])
        except Exception as exc:  # one model failing must not lose the others' figures
            log.error("%s failed: %s", part, traceback.format_exc())
            data["errors"].append(f"{part}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        data["rows"] += [{**r, "part": part, "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime())} for r in rows]
        data.setdefault("int8_tiles", {}).update(_tuned_tiles())
        if cuda:
            torch.cuda.empty_cache()
            _write(data, args.json)  # after each model: a run stopped by its time limit keeps what it measured
    log.info("done in %.0f s", time.time() - t0)
    if not cuda:
        print(_markdown(data))
    return 1 if data["errors"] and not data["rows"] else 0


if __name__ == "__main__":
    sys.exit(main())
