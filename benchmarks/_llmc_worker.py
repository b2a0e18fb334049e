"""One llm-compressor row for ``benchmarks.llm_compressor_peer``, run by that script with the Python
of llm-compressor's own virtualenv: it imports torch, transformers and llmcompressor only, never
compress (the two tools pin different transformers releases).

``python _llmc_worker.py --model DIR --windows FILE --method GPTQ --weights JSON --out ROW.json``:
loads the float32 model saved by the parent, quantizes it with llm-compressor's ``oneshot`` on the
parent's calibration windows, and writes perplexity on the parent's held-out windows (the same sum
of next-token NLL as compress's ``causal_lm_nll``), wall time and peak added resident memory.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import threading
import time
from typing import Any

import torch


class PeakRSS:
    """Peak resident memory of this process above its level at ``__enter__``, sampled every 50 ms
    (the parent's ``benchmarks.llm_quant_real.PeakRSS``, copied: this file cannot import compress)."""

    def __enter__(self) -> PeakRSS:
        import psutil

        self.proc = psutil.Process(os.getpid())
        self.base = self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()


@torch.no_grad()
def perplexity(model: Any, windows: torch.Tensor, batch: int = 4) -> float:
    total = 0.0
    for i in range(0, len(windows), batch):
        x = windows[i : i + batch]
        logits = model(input_ids=x).logits
        pred = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
        total += float(torch.nn.functional.cross_entropy(pred, x[:, 1:].reshape(-1), reduction="sum").double())
    return math.exp(total / (windows.shape[0] * (windows.shape[1] - 1)))


@torch.no_grad()
def last_hidden(model: Any, windows: torch.Tensor, batch: int = 4) -> torch.Tensor:
    """The decoder's output (after the final norm, before the head) on ``windows``."""
    return torch.cat([model.model(input_ids=windows[i : i + batch]).last_hidden_state.float()
                      for i in range(0, len(windows), batch)])


def recipe(method: str, weights: dict[str, Any] | None, preset: str | None = None) -> list[Any]:
    """llm-compressor's modifiers for ``method``, at their defaults except the scheme: GPTQ block
    128, dampening 0.01, static activation order; AWQ duo scaling, grid 20; SmoothQuant 0.5 then
    GPTQ for its ``W8A8`` preset (int8 per-channel weights, dynamic per-token int8 activations).
    ``preset``: one of its scheme names (``NVFP4A16``, ``NVFP4``, ``MXFP4A16``, ...) instead of ``weights``."""
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier

    ignore = ["lm_head"]
    groups = {"group_0": {"targets": ["Linear"], "weights": (weights or {}).get("weights", weights),
                          "input_activations": (weights or {}).get("input_activations")}}
    if preset is not None and method in ("RTN", "GPTQ"):
        cls = QuantizationModifier if method == "RTN" else GPTQModifier
        return [cls(scheme=preset, targets=["Linear"], ignore=ignore)]
    if method == "SpinQuant+GPTQ":  # its R1 and R2 (fused, no online Hadamards), then GPTQ
        from llmcompressor.modifiers.transform import SpinQuantModifier

        quant = (GPTQModifier(scheme=preset, targets=["Linear"], ignore=ignore) if preset is not None
                 else GPTQModifier(config_groups=groups, ignore=ignore))
        return [SpinQuantModifier(rotations=["R1", "R2"], transform_type="random-hadamard"), quant]
    if method == "RTN":
        return [QuantizationModifier(config_groups=groups, ignore=ignore)]
    if method == "GPTQ":
        return [GPTQModifier(config_groups=groups, ignore=ignore)]
    if method in ("AWQ", "AWQ+GPTQ"):
        from llmcompressor.modifiers.transform.awq import AWQModifier

        last = GPTQModifier if method == "AWQ+GPTQ" else QuantizationModifier
        return [AWQModifier(), last(config_groups=groups, ignore=ignore)]
    if method == "SmoothQuant+GPTQ":
        from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

        return [SmoothQuantModifier(), GPTQModifier(scheme="W8A8", targets=["Linear"], ignore=ignore)]
    raise SystemExit(f"unknown method {method!r}")


def _cpu_only_fixes() -> None:
    """llm-compressor 0.14's AWQ pins its cached activations (``IntermediatesCache.pin_memory``)
    unconditionally, which raises "Cannot access accelerator device when none is available" on a
    machine without one; pinning only speeds host-to-device copies, so without a device it is skipped."""
    if torch.accelerator.is_available():
        return
    from llmcompressor.pipelines.cache import IntermediatesCache

    IntermediatesCache.pin_memory = lambda self, *a, **k: None  # type: ignore[method-assign]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--windows", required=True)
    p.add_argument("--method", required=True)
    p.add_argument("--weights", default="null", help="compressed-tensors weight QuantizationArgs as JSON")
    p.add_argument("--scheme", default=None, help="a compressed-tensors preset name instead of --weights (NVFP4A16, ...)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True)
    p.add_argument("--hidden", action="store_true",
                   help="report the decoder output's relative squared error against float on the held-out windows "
                        "instead of perplexity (for a model cut to its first layers)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    w = torch.load(args.windows)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    row: dict[str, Any] = {"method": args.method, "seconds": 0.0, "peak GB": None}
    ref = {k: last_hidden(model, w[k]) for k in ("stdlib", "prose")} if args.hidden else {}
    if args.method != "fp32":
        from datasets import Dataset
        from llmcompressor import oneshot

        _cpu_only_fixes()

        calib = Dataset.from_dict({"input_ids": w["calib"].tolist(),
                                   "attention_mask": torch.ones_like(w["calib"]).tolist()})
        with PeakRSS() as mem:
            t = time.perf_counter()
            oneshot(model=model, dataset=calib, recipe=recipe(args.method, json.loads(args.weights), args.scheme),
                    num_calibration_samples=len(w["calib"]), max_seq_length=w["calib"].shape[1],
                    shuffle_calibration_samples=False)
            row["seconds"] = time.perf_counter() - t
        row["peak GB"] = (mem.peak - mem.base) / 1e9
    if args.hidden:
        for k, h in ref.items():
            row[f"error {k}"] = float(((last_hidden(model, w[k]) - h) ** 2).sum() / (h**2).sum())
    else:
        row["ppl stdlib"] = perplexity(model, w["stdlib"])
        row["ppl prose"] = perplexity(model, w["prose"])
    import llmcompressor

    row["version"] = llmcompressor.__version__
    with open(args.out, "w") as f:
        json.dump(row, f)


if __name__ == "__main__":
    main()
