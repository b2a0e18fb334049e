"""One Intel AutoRound row for ``benchmarks.autoround_peer``, run by that script with the Python of
auto-round's own virtualenv: it imports torch, transformers and auto_round only, never compress.

``python _autoround_worker.py --model DIR --windows FILE --bits 4 --group-size 64 --iters 50
--nsamples 32 --batch-size 8 --out ROW.json``: loads the float32 model saved by the parent,
quantizes it with ``auto_round.AutoRound(...).quantize()`` (SignRound: signed gradient descent on
each weight's rounding offset and each group's min/max factors, block by block) on the parent's
calibration windows, and writes perplexity of the resulting fake-quantized model (its Linears hold
the de-quantized weights) on the parent's held-out windows (the same sum of next-token NLL as
compress's ``causal_lm_nll``), the wall time of ``quantize()`` and the peak resident memory it added.

auto-round's defaults, kept: the SignRound config (lr = minmax_lr = 1 / iters, decaying linearly to
0; min/max factors initialised at 1 and clamped to [0, 1]; the best-loss step's parameters kept;
quantized inputs for later blocks, float targets), scheme W4A16's int data type with fp16 scales,
lm_head and embeddings float (``quant_lm_head=False``), ``low_cpu_mem_usage``, ``torch.compile`` on
(auto-round turns it off itself below 10 iters), seed 42. Overridden, and why (the parent's section
says so too):

- ``dataset``: the parent's windows, one ``[1, seq_len]`` tensor each (auto-round's
  ``LLMCalibrator.calib`` takes an iterable of ``input_ids`` tensors); its default is
  ``NeelNanda/pile-10k`` from the Hub, unreachable here and not the windows compress calibrates on.
  The Hub is set offline and ``auto_round.calib_dataset.get_dataloader`` refuses, so no other data
  can come in silently; the worker counts the windows auto-round consumed.
- ``amp=False``: auto-round casts the model to bfloat16 for tuning on a CPU with bf16 support
  (``ModelContext._set_amp_dtype``); compress tunes and evaluates in float32.
- ``device_map="cpu"``: its default 0 means the first accelerator.
- ``bits``, ``group_size``, ``sym=True``, ``iters``, ``nsamples``, ``seqlen``, ``batch_size``: the
  row's scheme and budget, the same as compress's row.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import threading
import time
from collections.abc import Iterator
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
    """exp(mean next-token NLL) over every window (``benchmarks._llmc_worker.perplexity``, copied)."""
    total = 0.0
    for i in range(0, len(windows), batch):
        x = windows[i : i + batch]
        logits = model(input_ids=x).logits
        pred = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
        total += float(torch.nn.functional.cross_entropy(pred, x[:, 1:].reshape(-1), reduction="sum").double())
    return math.exp(total / (windows.shape[0] * (windows.shape[1] - 1)))


class Windows:
    """The calibration windows as auto-round iterates a dataset: one ``[1, seq_len]`` tensor per
    sample; ``taken`` counts the ones it consumed."""

    def __init__(self, windows: torch.Tensor) -> None:
        self.windows, self.taken = windows, 0

    def __len__(self) -> int:
        return len(self.windows)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i in range(len(self.windows)):
            self.taken += 1
            yield self.windows[i : i + 1]


def _refuse_other_data() -> None:
    """auto-round fetches a named dataset through ``calib_dataset.get_dataloader``; make that raise,
    so a dataset it substituted for ours fails the row instead of calibrating on other text."""
    import auto_round.calib_dataset as cd

    def refuse(*a: Any, **k: Any) -> Any:
        raise RuntimeError(f"auto-round tried to load a calibration dataset of its own ({a[2:3]}), not the windows given")

    cd.get_dataloader = refuse  # type: ignore[assignment]


def _rounded_check(float_sd: dict[str, torch.Tensor], model: Any, bits: int, group: int) -> dict[str, Any]:
    """Evidence that the evaluated model carries auto-round's rounded weights: over every decoder
    Linear, the most distinct values in one group (at most 2**bits when rounded onto a grid), and
    the share of weights whose value differs from round-to-nearest's on auto-round's own untuned grid
    (``quant_tensor_sym``: full range [-2**(bits-1), 2**(bits-1) - 1], the larger side of the range
    on the end of the grid, fp16 scales); and that lm_head and the embeddings are left as they were."""
    most, changed, total, n_linear = 0, 0, 0, 0
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear) or name.endswith("lm_head"):
            continue
        g = mod.weight.detach().float().reshape(-1, group)
        s = g.sort(dim=1).values
        most = max(most, int((s.diff(dim=1) != 0).sum(dim=1).max()) + 1)
        f = float_sd[name + ".weight"].float().reshape(-1, group)
        lo, hi = f.amin(1).clamp(max=0), f.amax(1).clamp(min=0)
        maxq = 2 ** (bits - 1)
        # the larger side lands on -maxq: a positive scale when the negative side is larger, else negative
        scale = (torch.where(hi < -lo, -lo, -hi) / maxq).half().float().unsqueeze(1)
        rtn = torch.clamp(torch.round(f / scale), -maxq, maxq - 1) * scale
        changed += int(((g - rtn).abs() > 1e-6 * scale.abs()).sum())
        total += g.numel()
        n_linear += 1
    head_same = all(torch.equal(float_sd[k], v) for k, v in model.state_dict().items()
                    if k in float_sd and ("lm_head" in k or "embed_tokens" in k))
    return {"linears": n_linear, "most levels in a group": most, "share changed vs RTN": changed / max(total, 1),
            "lm_head and embeddings float": head_same}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--windows", required=True)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--nsamples", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--fp32", action="store_true", help="no quantization: the float model's row")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    # no download of any kind (read when huggingface_hub is first imported, below): the calibration
    # data is the parent's windows, the model and tokenizer a local folder
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    w = torch.load(args.windows)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    row: dict[str, Any] = {"method": "fp32" if args.fp32 else "AutoRound", "seconds": 0.0, "peak GB": None}
    if not args.fp32:
        import auto_round

        _refuse_other_data()
        calib = w["calib"][: args.nsamples]
        if len(calib) < args.nsamples:
            raise SystemExit(f"--nsamples {args.nsamples}: the windows file holds {len(calib)} calibration windows")
        float_sd = {k: v.clone() for k, v in model.state_dict().items()}
        data = Windows(calib)
        with PeakRSS() as mem:
            t = time.perf_counter()
            ar = auto_round.AutoRound(
                model, tokenizer, bits=args.bits, group_size=args.group_size, sym=True, iters=args.iters,
                nsamples=args.nsamples, seqlen=calib.shape[1], batch_size=args.batch_size, dataset=data,
                device_map="cpu", amp=False)
            model, _ = ar.quantize()
            row["seconds"] = time.perf_counter() - t
        row["peak GB"] = (mem.peak - mem.base) / 1e9
        if data.taken != args.nsamples:
            raise SystemExit(f"auto-round consumed {data.taken} of the {args.nsamples} calibration windows")
        model = model.float().eval()
        row["check"] = {"windows consumed": data.taken,
                        "pad token masked": None if tokenizer.pad_token_id is None else int((calib == tokenizer.pad_token_id).sum()),
                        **_rounded_check(float_sd, model, args.bits, args.group_size)}
        if row["check"]["most levels in a group"] > 2**args.bits:
            raise SystemExit(f"the quantized model's weights are not on a {args.bits}-bit grid: {row['check']}")
        row["settings"] = {k: getattr(ar.quantize_config, k, None) for k in (
            "iters", "lr", "minmax_lr", "enable_minmax_tuning", "enable_quanted_input", "not_use_best_mse",
            "gradient_accumulate_steps", "momentum", "nblocks")}
        row["settings"].update(amp=ar.model_context.amp, amp_dtype=str(ar.model_context.amp_dtype),
                               torch_compile=bool(ar.enable_torch_compile), seed=ar.seed,
                               batch_size=ar.calibration_context.batch_size)
    row["ppl stdlib"] = perplexity(model, w["stdlib"])
    row["ppl prose"] = perplexity(model, w["prose"])
    import importlib.metadata

    row["version"] = importlib.metadata.version("auto-round")
    row["torch"], row["transformers"] = torch.__version__, importlib.metadata.version("transformers")
    with open(args.out, "w") as f:
        json.dump(row, f, default=str)


if __name__ == "__main__":
    main()
