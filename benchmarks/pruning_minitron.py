"""LLM width pruning the way NVIDIA's Minitron does it, on a small Llama trained here on stdlib text.

    python -m benchmarks.pruning_minitron [--quick]

1. A byte-level BPE tokenizer (``tokenizers``) and a small LlamaForCausalLM (GQA: 8 query heads on
   4 key/value heads, SwiGLU, RoPE) trained from a fixed seed for a fixed number of steps on the
   source of the Python standard library; files split train / held-out by a hash of their path.
   (The project's reference LLM, branch issue-13a, was not on main when this ran.)
2. One-shot width pruning of 25% / 50% of the MLP channels, or of the GQA groups (a kv head and
   its query heads), with importance from activations on 8 calibration batches (Minitron) against
   weight magnitude (L2) and random; and one run of everything at once (heads, MLP, embedding
   channels) to a parameter target.
3. Recovery by logit distillation from the unpruned model (``distillation.Distiller``, KD at
   temperature 1, no task loss), the same steps for every row.
4. Held-out perplexity before/after, and ONNX Runtime latency of the pruned model over the
   unpruned one (same process, alternating, median of repeated runs after warm-up).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import logging
import os
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from benchmarks.llm_quant import perplexity

log = logging.getLogger("benchmarks.pruning_minitron")
SEQ = 32
HEADS = ["re:.*self_attn\\.(q|k|v)_proj"]
MLP = ["re:.*mlp\\.(gate|up)_proj"]


def corpus(max_chars: int) -> tuple[str, str]:
    """Train and held-out text: stdlib .py files, split by a hash of their relative path (1 in 10 held out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py"))
    train: list[str] = []
    held: list[str] = []
    for p in files:
        text = p.read_text(errors="ignore")
        bucket = int(hashlib.sha1(p.name.encode()).hexdigest(), 16) % 10
        (held if bucket == 0 else train).append(text)
    return "\n".join(train)[:max_chars], "\n".join(held)[: max_chars // 8]


def tokenize(train: str, held: str, vocab: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([train], trainers.BpeTrainer(vocab_size=vocab, show_progress=False,
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))

    def windows(text: str) -> torch.Tensor:
        ids = torch.tensor(tok.encode(text).ids, dtype=torch.long)
        n = ids.numel() // SEQ
        return ids[: n * SEQ].view(n, SEQ)

    return windows(train), windows(held), tok.get_vocab_size()


def build_llm(vocab: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=SEQ, tie_word_embeddings=True, use_cache=False,
    )
    return LlamaForCausalLM(cfg)


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def train(model: nn.Module, data: torch.Tensor, steps: int, *, lr: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    model.train()
    for _ in range(steps):
        x = data[torch.randint(0, len(data), (8,), generator=g)]
        loss = lm_loss(model(input_ids=x).logits, x)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    model.eval()


def distill(student: nn.Module, teacher: nn.Module, data: torch.Tensor, steps: int, *, seed: int) -> None:
    """Logit KD from the unpruned model (Minitron's recovery): KL at temperature 1, no task loss."""
    from compress.distillation.api import Distiller

    kd = Distiller(copy.deepcopy(teacher), student, losses=[{"type": "kd", "temperature": 1.0}])  # it freezes its teacher
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-3, weight_decay=0.0)
    student.train()
    for _ in range(steps):
        x = {"input_ids": data[torch.randint(0, len(data), (8,), generator=g)]}
        loss = kd(x, student(**x))
        opt.zero_grad()
        loss.backward()
        opt.step()
    student.eval()
    kd.remove()


def ort_latency(models: dict[str, nn.Module], x: torch.Tensor, tmp: Path, runs: int) -> dict[str, float]:
    """Median ms per call of each model in ONNX Runtime (1 thread), timed alternately."""
    import onnxruntime as ort
    from compress.export.onnx import export_onnx

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = {}
    for k, m in models.items():
        path = export_onnx(m, {"input_ids": x}, tmp / f"{k}.onnx", dynamic_batch=False)
        sess[k] = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    feed = {"input_ids": x.numpy()}
    times: dict[str, list[float]] = {k: [] for k in sess}
    for k in sess:
        for _ in range(5):
            sess[k].run(None, {sess[k].get_inputs()[0].name: feed["input_ids"]})
    for _ in range(runs):
        for k, s in sess.items():
            t0 = time.perf_counter()
            s.run(None, {s.get_inputs()[0].name: feed["input_ids"]})
            times[k].append((time.perf_counter() - t0) * 1e3)
    return {k: float(np.median(v)) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--train-steps", type=int, default=250)
    ap.add_argument("--kd-steps", type=int, default=25)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    log.setLevel(logging.INFO)
    torch.set_num_threads(1)
    from compress.pruning.api import PruneParams, prune
    from compress.pruning.counting import count_params

    from benchmarks._results import table, write_section

    if args.quick:
        args.train_steps, args.kd_steps = 20, 4
    t0 = time.perf_counter()
    torch.manual_seed(0)
    train_text, held_text = corpus(1_000_000 if not args.quick else 200_000)
    train_ids, held_ids, vocab = tokenize(train_text, held_text, 512)
    held_ids = held_ids[:128]
    base = build_llm(vocab)
    train(base, train_ids, args.train_steps, lr=3e-3, seed=0)
    ppl0 = perplexity(base, held_ids)
    t_train = time.perf_counter() - t0
    log.info("reference: %d params, %d train windows, held-out ppl %.2f (%.0f s)", count_params(base), len(train_ids), ppl0, t_train)
    calib = [{"input_ids": train_ids[i : i + 8]} for i in range(0, 64, 8)]
    example = {"input_ids": held_ids[:2]}

    settings: list[tuple[str, float, dict[str, Any]]] = [
        ("MLP channels", 0.25, {"options": PruneParams(targets=MLP)}),
        ("MLP channels", 0.5, {"options": PruneParams(targets=MLP)}),
        ("GQA groups", 0.25, {"options": PruneParams(targets=HEADS)}),
        ("GQA groups", 0.5, {"options": PruneParams(targets=HEADS)}),
        ("heads+MLP+embedding to params 0.6", 0.0, {"target": {"params": 0.6}}),
    ]
    rows: list[dict[str, Any]] = []
    pruned_models: dict[str, nn.Module] = {}
    for what, frac, kw in settings:
        for importance in ("activation", "l2", "random"):
            if "target" in kw and importance != "activation":
                continue
            m = copy.deepcopy(base)
            ratio = None if "target" in kw else frac
            res = prune(m, example, ratio=ratio, importance=importance, data=calib, **kw)
            p_cut = perplexity(m, held_ids)
            distill(m, base, train_ids, args.kd_steps, seed=1)
            p_kd = perplexity(m, held_ids)
            rows.append({
                "pruned": what, "fraction": frac if ratio is not None else "", "importance": importance,
                "params": round(res.params_ratio, 3), "ppl_pruned": round(p_cut, 2), "ppl_after_kd": round(p_kd, 2),
            })
            log.info("%s", rows[-1])
            if importance == "activation" and frac in (0.5, 0.0):
                pruned_models[f"{what} {frac or ''}".strip()] = m
    # what KD alone does to the unpruned model (the same steps): the recovery's reference point
    ref = copy.deepcopy(base)
    distill(ref, base, train_ids, args.kd_steps, seed=1)
    with tempfile.TemporaryDirectory() as d:
        lat = ort_latency({"unpruned": base, **pruned_models}, held_ids[:1], Path(d), runs=30 if not args.quick else 5)
    lat_rows = [{"model": k, "params": count_params(m), "ort_ms": round(v, 3), "vs_unpruned": round(v / lat["unpruned"], 3)}
                for (k, v), m in zip(lat.items(), [base, *pruned_models.values()])]
    md = (
        "## LLM width pruning, Minitron-style (`python -m benchmarks.pruning_minitron`)\n\n"
        f"A LlamaForCausalLM (hidden 64, 2 layers, 8 query heads on 4 kv heads, MLP 192, vocab {vocab}, "
        f"{count_params(base)} params) trained here for {args.train_steps} steps (batch 8 x {SEQ} tokens, seed 0, "
        f"{t_train:.0f} s) on stdlib source (the reference LLM of issue 13a was not on main yet); held-out "
        f"perplexity {ppl0:.2f} on {len(held_ids)} windows of files never trained on. Each row prunes a copy "
        "one-shot (ratio per group, or a params target found by the cost model), then recovers by logit KD from "
        f"the unpruned model ({args.kd_steps} steps, batch 8, AdamW 1e-3, T=1, no task loss); the same KD on the "
        f"unpruned model gives {perplexity(ref, held_ids):.2f}. Importance: activation = Minitron's (8 calibration "
        "batches of train text), l2 = weight magnitude, random.\n\n" + table(rows)
        + "\nONNX Runtime fp32, batch 1 x 32 tokens, 1 thread, median of repeated alternating runs:\n\n"
        + table(lat_rows)
    )
    write_section("pruning_minitron", md, {"rows": rows, "latency": lat_rows, "ppl_unpruned": ppl0})


if __name__ == "__main__":
    main()
