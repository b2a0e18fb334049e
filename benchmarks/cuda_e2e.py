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
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

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
    import compress
    from export.cuda import cast_float_layers
    from quantization.api import QuantizeParams
    from quantization.lowering.convert import convert_with_report

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
    from export.cuda import time_side_by_side

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
        if variant in ("fp16", "fp32"):
            continue
        fid = _fidelity(outs["fp32"], outs[variant])
        rows.append({"model": name, **extra, "scheme": variant, "fp16_ms": ms["fp16"], "ms": t,
                     "speedup": ms["fp16"] / t, **fid, "fp16_cosine": _fidelity(outs["fp32"], outs["fp16"])["cosine"],
                     "layers": info[variant]["converted"], "float_layers": info[variant]["float"]})
        log.info("%s %s %s: fp16 %.3f ms, %s %.3f ms, %.2fx, cosine %.5f", name, extra, variant, ms["fp16"], variant, t,
                 rows[-1]["speedup"], fid["cosine"])
    return rows


def bench_llama(spec: dict[str, Any], schemes: list[str], dev: torch.device, runs: int,
                rows: list[dict[str, Any]]) -> None:
    from transformers import StaticCache

    fp32 = _llama(spec).to(dev)
    calib = [{"input_ids": torch.randint(0, spec["vocab"], (1, 64)).to(dev)}]
    models: dict[str, nn.Module] = {"fp32": fp32, "fp16": copy.deepcopy(fp32).half()}
    info: dict[str, dict[str, Any]] = {}
    for s in schemes:  # quantized on the GPU: calibration and weight grids of 7B-wide layers
        models[s], info[s] = _convert(fp32, s, calib, dev, torch.float16)
        log.info("llama %s: %s", s, info[s])
    g = torch.Generator().manual_seed(1)
    for t in spec["prefill"]:
        ids = torch.randint(0, spec["vocab"], (1, t), generator=g).to(dev)
        with torch.no_grad():
            outs = {k: m(input_ids=ids, use_cache=False).last_hidden_state.float() for k, m in models.items()}
        fns = {k: (lambda m=m, ids=ids: m(input_ids=ids, use_cache=False)) for k, m in models.items() if k != "fp32"}
        rows += _rows_for("llama", fns, outs, dev, runs, {"phase": "prefill", "batch": 1, "tokens": t}, info)
    ctx = spec["context"]
    for b in spec["decode"]:
        ids = torch.randint(0, spec["vocab"], (b, ctx), generator=g).to(dev)
        step = torch.randint(0, spec["vocab"], (b, 1), generator=g).to(dev)
        pos = torch.tensor([ctx], device=dev)
        outs, fns = {}, {}
        for k, m in models.items():
            cache = StaticCache(config=m.config, max_cache_len=ctx + _CACHE_ROOM)
            with torch.no_grad():
                m(input_ids=ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(ctx, device=dev))
                outs[k] = m(input_ids=step, past_key_values=cache, use_cache=True, cache_position=pos).last_hidden_state.float()
            if k != "fp32":
                # each replay rewrites the same cache slot: the step the timings measure is identical
                fns[k] = lambda m=m, cache=cache, step=step, pos=pos: m(
                    input_ids=step, past_key_values=cache, use_cache=True, cache_position=pos)
        rows += _rows_for("llama", fns, outs, dev, runs, {"phase": "decode", "batch": b, "tokens": ctx}, info)
        del fns, outs


def bench_bert(spec: dict[str, Any], schemes: list[str], dev: torch.device, runs: int,
               rows: list[dict[str, Any]]) -> None:
    from transformers import BertConfig, BertModel

    cfg = BertConfig(hidden_size=spec["hidden"], num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"],
                     intermediate_size=spec["inter"], vocab_size=30522, max_position_embeddings=512)
    torch.manual_seed(0)
    fp32 = BertModel(cfg, add_pooling_layer=False).eval()
    fp32 = fp32.to(dev)
    calib = [{"input_ids": torch.randint(0, 30522, (4, spec["seq"])).to(dev)}]
    models: dict[str, nn.Module] = {"fp32": fp32, "fp16": copy.deepcopy(fp32).half()}
    info = {}
    for s in schemes:
        models[s], info[s] = _convert(fp32, s, calib, dev, torch.float16)
    for b in spec["batch"]:
        ids = torch.randint(0, 30522, (b, spec["seq"])).to(dev)
        with torch.no_grad():
            outs = {k: m(input_ids=ids).last_hidden_state.float() for k, m in models.items()}
        fns = {k: (lambda m=m, ids=ids: m(input_ids=ids)) for k, m in models.items() if k != "fp32"}
        rows += _rows_for("bert-base", fns, outs, dev, runs, {"phase": "encode", "batch": b, "tokens": spec["seq"]}, info)


def _resnet() -> tuple[str, nn.Module]:
    try:
        from torchvision.models import resnet50

        torch.manual_seed(0)
        return "resnet50 (torchvision)", resnet50(weights=None).eval()
    except ImportError:  # the smoke on a machine without torchvision: the project's ResNet
        from compress.models.resnet import resnet

        return "resnet (compress zoo)", resnet(width=8, depth=2, in_channels=3).eval()


def bench_resnet(spec: dict[str, Any], schemes: list[str], dev: torch.device, runs: int,
                 rows: list[dict[str, Any]]) -> None:
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
        rows += _rows_for(name, fns, outs, dev, runs, {"phase": "classify", "batch": b, "tokens": size}, info)


def _convert_checked(fp32: nn.Module, scheme: str, calib: list[Any], dev: torch.device,
                     example: torch.Tensor, placed: str) -> tuple[nn.Module, dict[str, Any]]:
    import compress
    from export.cuda import cast_float_layers
    from quantization.api import QuantizeParams
    from quantization.lowering.convert import convert_with_report

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


def _markdown(data: dict[str, Any]) -> str:
    from benchmarks._results import table

    rows = [{**r, "layers": ", ".join(f"{v} {k}" for k, v in r["layers"].items()),
             "kept_float": sum(r["float_layers"].values())} for r in data["rows"]]
    parts = [
        "## CUDA end to end: converted models vs fp16\n",
        f"GPU: {data['gpu']}. Script: `python -m benchmarks.cuda_e2e`. Models as transformers and torchvision "
        "define them, random weights: a Llama decoder stack at LLaMA-7B widths "
        f"({data['plan']['llama']['layers']} layers, hidden 4096, MLP 11008, 32 heads), BERT-base, ResNet-50. "
        "Each variant timed in alternating runs as CUDA-graph replays (median); speedup = fp16 ms / variant ms. "
        "Cosine and SQNR: last hidden state (ResNet: logits) against the fp32 model on the same input. "
        "Decode: one token per sequence against a StaticCache of 2048 tokens.\n",
        table(rows, ["model", "phase", "batch", "tokens", "scheme", "fp16_ms", "ms", "speedup", "cosine", "sqnr_db",
                     "fp16_cosine", "layers", "kept_float"]),
    ]
    kept = {(r["model"], r["scheme"]): r["float_layers"] for r in data["rows"] if r["float_layers"]}
    if kept:
        parts.append("\nLayers kept in float, with the converter's reasons:\n")
        for (model, scheme), reasons in kept.items():
            parts.append(f"- {model} {scheme}: " + "; ".join(f"{n} x {why}" for why, n in reasons.items()))
    if data.get("errors"):
        parts.append("\nParts that failed on this machine:\n")
        parts += [f"- {e}" for e in data["errors"]]
    return "\n".join(parts) + "\n"


def _write(data: dict[str, Any], path: Path) -> None:
    """Write the JSON and the RESULTS.md section, keeping the rows of models this run did not
    measure when an earlier run on the same GPU did (each model may run in its own process: a
    device-side assert in one poisons the CUDA context for the rest)."""
    from benchmarks._results import write_section

    if path.exists():
        old = json.loads(path.read_text())
        if old.get("gpu") == data["gpu"]:
            mine = {r["part"] for r in data["rows"]} | set(data.get("parts", []))
            kept = [r for r in old.get("rows", []) if r.get("part") not in mine]
            data = {**data, "rows": kept + data["rows"],
                    "errors": [e for e in old.get("errors", []) if e.split(":")[0] not in mine] + data["errors"]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str))
    write_section("cuda_e2e", _markdown(data), data)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.cuda_e2e", description=__doc__.splitlines()[0])
    ap.add_argument("--interpret-smoke", action="store_true", help="CPU under TRITON_INTERPRET=1, tiny widths")
    ap.add_argument("--only", nargs="*", default=["llama", "bert", "resnet"], choices=["llama", "bert", "resnet"])
    ap.add_argument("--layers", type=int, default=None, help="decoder layers of the Llama stack")
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--resnet-parity", action="store_true",
                    help="also time the ResNet with its placed quantizers kept (exact fake-quant arithmetic)")
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/cuda_e2e.json"))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.interpret_smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        print("benchmarks.cuda_e2e: needs a CUDA GPU (none found); --interpret-smoke checks the script on CPU",
              file=sys.stderr)
        return 2
    cuda = not args.interpret_smoke
    dev = torch.device("cuda" if cuda else "cpu")
    plan = copy.deepcopy(SMOKE if args.interpret_smoke else FULL)
    if args.layers:
        plan["llama"]["layers"] = args.layers
    plan["resnet"]["parity"] = args.resnet_parity
    runs = args.runs if cuda else 1
    data: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0) if cuda else "cpu (TRITON_INTERPRET smoke)",
                            "plan": plan, "rows": [], "errors": []}
    benches: dict[str, Callable[..., None]] = {"llama": bench_llama, "bert": bench_bert, "resnet": bench_resnet}
    t0 = time.time()
    data["parts"] = list(args.only)
    for part in args.only:
        rows: list[dict[str, Any]] = []  # filled as measured: a failure keeps the rows before it
        try:
            benches[part](plan[part], plan["schemes"][part], dev, runs, rows)
        except Exception as exc:  # one model failing must not lose the others' figures
            log.error("%s failed: %s", part, traceback.format_exc())
            data["errors"].append(f"{part}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        data["rows"] += [{**r, "part": part} for r in rows]
        if cuda:
            torch.cuda.empty_cache()
            _write(data, args.json)  # after each model: a run stopped by its time limit keeps what it measured
    log.info("done in %.0f s", time.time() - t0)
    if not cuda:
        print(_markdown(data))
    return 1 if data["errors"] and not data["rows"] else 0


if __name__ == "__main__":
    sys.exit(main())
