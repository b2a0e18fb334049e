"""Model zoo and data sources: size, compute and eager CPU latency of the zoo models, time to build
each data source, and how fast a plain loop trains the quickstart ResNet on digits to 95%.

    python -m benchmarks.zoo [--quick]
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch

from benchmarks._results import median_time_ms, table, write_section
from compress.core.size import count_macs, count_params
from compress.data import build_data
from compress.data.text import corpus, file_sentences
from compress.models import build_zoo_model

MODELS: list[tuple[str, dict[str, Any]]] = [
    ("resnet", {"width": 16}),
    ("resnet", {"width": 64}),
    ("mobilenetv2", {}),
    ("vit", {}),
    ("vit", {"attn": "mha"}),
    ("mlp", {}),
]


def zoo_rows(runs: int) -> list[dict[str, Any]]:
    rows = []
    for name, kw in MODELS:
        torch.manual_seed(0)
        model = build_zoo_model(name, kw).eval()
        row: dict[str, Any] = {
            "model": name + "".join(f" {k}={v}" for k, v in kw.items()),
            "params": count_params(model),
            "MACs/sample": count_macs(model, torch.randn(2, 1, 8, 8)),
        }
        for bs in (1, 32):
            x = torch.randn(bs, 1, 8, 8)
            with torch.inference_mode():
                row[f"ms b={bs}"] = median_time_ms(lambda m=model, x=x: m(x), warmup=3, runs=runs)
        rows.append(row)
    return rows


def data_rows() -> list[dict[str, Any]]:
    rows = []
    for source, kw in (("digits", {}), ("synthetic", {}), ("text", {"samples": 2000})):
        file_sentences.cache_clear()
        t0 = time.perf_counter()
        b = build_data({"source": source, "kwargs": kw}, batch_size=64, seed=0)
        rows.append(
            {
                "source": source,
                "build s": time.perf_counter() - t0,
                **b.sizes,
                "input_shape": list(b.input_shape),
            }
        )
    file_sentences.cache_clear()
    t0 = time.perf_counter()
    n = len(corpus(10**6, seed=0))
    rows.append({"source": "text corpus (all stdlib)", "build s": time.perf_counter() - t0, "train": n})
    return rows


def digits_training(max_epochs: int) -> dict[str, Any]:
    """Plain SGD loop (the quickstart's settings: width 16, batch 32, lr 0.05, cosine)."""
    torch.manual_seed(0)
    b = build_data({"source": "digits"}, batch_size=32, seed=0)
    assert b.train is not None and b.eval is not None
    model = build_zoo_model("resnet", width=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, max_epochs * len(b.train))
    xe, ye = (torch.cat(t) for t in zip(*b.eval))
    t0, reached, acc = time.perf_counter(), None, 0.0
    for epoch in range(1, max_epochs + 1):
        model.train()
        for x, y in b.train:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            sched.step()
        model.eval()
        with torch.inference_mode():
            acc = (model(xe).argmax(1) == ye).float().mean().item()
        if reached is None and acc >= 0.95:
            reached = {"epoch": epoch, "seconds": time.perf_counter() - t0}
    return {
        "epochs": max_epochs,
        "final_accuracy": acc,
        "total_s": time.perf_counter() - t0,
        "reached_0.95": reached,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer timing runs and epochs")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: stable figures on a shared box)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    runs = 10 if args.quick else 30
    zoo = zoo_rows(runs)
    data = data_rows()
    train = digits_training(5 if args.quick else 10)
    load_after = os.getloadavg()[0]
    r = train["reached_0.95"]
    reached = f"epoch {r['epoch']} after {r['seconds']:.1f} s" if r else "not reached"
    md = (
        "## Model zoo and data sources (`python -m benchmarks.zoo`)\n\n"
        f"Eager fp32 PyTorch on CPU, 1x8x8 inputs, median of {runs} runs after 3 warm-up calls "
        f"(torch threads: {torch.get_num_threads()}; 1-minute load average {load_before:.1f} before, "
        f"{load_after:.1f} after: other jobs shared the machine).\n\n"
        + table(zoo)
        + "\nTime to build each data source (first call in the process; text includes tokenizer loading):\n\n"
        + table(data, ["source", "build s", "train", "calibration", "eval", "input_shape"])
        + f"\nPlain training loop, ResNet width 16 on digits (batch 32, SGD lr 0.05, cosine over {train['epochs']} epochs): "
        f"eval accuracy >= 0.95 at {reached}; final {train['final_accuracy']:.4f} after {train['total_s']:.1f} s.\n"
    )
    extra = {"quick": args.quick, "threads": args.threads, "loadavg": [load_before, load_after]}
    write_section("zoo", md, {"zoo": zoo, "data": data, "digits_training": train, **extra})
    print(md)


if __name__ == "__main__":
    main()
