"""Weight-only LLM quantization on the reference model: held-out perplexity of fp32, RTN, GPTQ, AWQ
and AWQ+GPTQ at w4 g128, w4 per-channel and w3 g128, beside ONNX Runtime's own weight-only
quantizer (``onnxruntime.quantization.matmul_nbits_quantizer``: RTN, GPTQ, HQQ) on the same fp32
ONNX. ``python -m benchmarks.llm_quant --model runs/reference_llm`` (train it first with
``python -m benchmarks.train_reference_llm``).

Calibration windows come from the calibration files, perplexity from the held-out eval files
(compress.data.lm: split by file, never seen in training). Every method quantizes the Linears of
the decoder layers; lm_head (tied to the embedding) and the embedding stay float, for ours and ORT's
(ORT's quantizers are told to skip the lm_head MatMul).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks._results import table, write_section

log = logging.getLogger("benchmarks.llm_quant")

SCHEMES: dict[str, Any] = {
    "w4 g128": "w4_weight_only_g128",
    "w4 per-channel": "w4_weight_only",
    "w3 g128": "w3_weight_only_g128",
    "w3 per-channel": {"weights": {"bits": 3, "granularity": "channel"}, "inputs": None},
}


@torch.no_grad()
def window_nll(model: nn.Module, windows: torch.Tensor, *, batch: int = 16) -> torch.Tensor:
    """Summed next-token NLL of each window (float64): every window predicts ``seq_len - 1`` tokens,
    so perplexity is ``exp(sum / (n * (seq_len - 1)))`` and windows can be resampled (bootstrap).
    Scored through the model's own head in bounded chunks (compress.core.lm_loss.model_nll), so no
    batch of full-vocabulary logits is ever held."""
    from compress.core.lm_loss import model_nll

    model.eval()
    sums = [model_nll(model, windows[i : i + batch], windows[i : i + batch], per_row=True)[0]
            for i in range(0, len(windows), batch)]
    return torch.cat(sums)


def _ppl(nll: torch.Tensor, seq_len: int) -> float:
    return math.exp(float(nll.sum()) / (nll.numel() * (seq_len - 1)))


def perplexity(model: nn.Module, windows: torch.Tensor, *, batch: int = 16) -> float:
    """exp(mean next-token NLL) over every window."""
    return _ppl(window_nll(model, windows, batch=batch), windows.shape[1])


def _windows(ds: Any) -> torch.Tensor:
    return ds.windows if hasattr(ds, "windows") else torch.stack([ds[i][0]["input_ids"] for i in range(len(ds))])


def lm_arguments(p: argparse.ArgumentParser, *, calib: int) -> None:
    """The model/data/thread options every reference-LLM benchmark takes."""
    p.add_argument("--model", default="runs/reference_llm")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--calib", type=int, default=calib, help="calibration windows")
    p.add_argument("--eval", type=int, default=128, help="held-out eval windows")
    p.add_argument("--calib-batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--load", default="shared 2-core machine, other engineers' jobs running")


def lm_windows(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """Sets logging and threads from ``args``; the calibration and held-out eval token windows."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("compress.quantization").setLevel(logging.WARNING)
    torch.set_num_threads(args.threads)
    from compress.data.lm import text_lm

    splits = text_lm(seed=0, tokenizer=args.model, seq_len=args.seq_len, samples=max(args.calib, args.eval))
    return _windows(splits.calibration)[: args.calib], _windows(splits.eval)[: args.eval]


def torch_methods(scheme: Any, data: list[torch.Tensor]) -> dict[str, Callable[[nn.Module], nn.Module]]:
    """Each PyTorch method by its table name: quantizes a model in place with ``scheme``,
    calibrating on the batches ``data``."""
    from compress.quantization.algorithms.awq_search import AWQParams
    from compress.quantization.algorithms.gptq import GPTQParams

    import compress

    return {
        "RTN": lambda m: compress.quantize(m, scheme, ignore=["lm_head"]),
        "GPTQ": lambda m: compress.gptq(m, data, scheme=scheme, params=GPTQParams(act_order=True), ignore=["lm_head"]),
        "AWQ": lambda m: compress.awq(m, data, scheme=scheme, ignore=["lm_head"]),
        "AWQ act-only": lambda m: compress.awq(m, data, scheme=scheme, params=AWQParams(duo_scaling=False), ignore=["lm_head"]),
        # AWQ's two parts told apart: its scales alone, without the clip search
        "AWQ scales only": lambda m: compress.awq(m, data, scheme=scheme, params=AWQParams(clip=False), ignore=["lm_head"]),
        "AWQ+GPTQ": lambda m: compress.gptq(compress.awq(m, data, scheme=scheme, ignore=["lm_head"]), data, scheme=scheme,
                                            params=GPTQParams(act_order=True), ignore=["lm_head"]),
    }


def run_torch(model_dir: str, calib: torch.Tensor, evalw: torch.Tensor, *, calib_batch: int,
              schemes: list[str]) -> list[dict[str, Any]]:
    from compress.models import load_model

    fp = load_model({"hf_path": model_dir}).eval()
    data = [calib[i : i + calib_batch] for i in range(0, len(calib), calib_batch)]
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    base = perplexity(fp, evalw)
    rows.append({"scheme": "fp32", "method": "fp32", "perplexity": base, "seconds": 0.0})
    log.info("fp32 %.3f", base)
    for label in schemes:
        for method, fn in torch_methods(SCHEMES[label], data).items():
            t = time.perf_counter()
            q = fn(copy.deepcopy(fp))
            secs = time.perf_counter() - t
            ppl = perplexity(q, evalw)
            rows.append({"scheme": label, "method": method, "perplexity": ppl, "seconds": secs})
            log.info("%s %s %.3f (%.1f s; %.0f s total)", label, method, ppl, secs, time.perf_counter() - t0)
    return rows


def outlier_ratios(model_dir: str, calib: torch.Tensor, *, batch: int = 16) -> list[float]:
    """:func:`input_outlier_ratios` of the decoder Linears on ``calib``."""
    from compress.models import load_model

    model = load_model({"hf_path": model_dir}).eval()
    batches = [{"input_ids": calib[i : i + batch]} for i in range(0, len(calib), batch)]
    return input_outlier_ratios(model, batches, lambda n: ".layers." in f".{n}")


@torch.no_grad()
def input_outlier_ratios(model: nn.Module, batches: list[dict[str, torch.Tensor]],
                         keep: Callable[[str], bool]) -> list[float]:
    """For each Linear whose name ``keep`` accepts: its input's largest per-channel mean |x| over the
    median channel's, on ``batches`` (model kwargs). LLMs with massive activations have channels
    tens of times the rest; they are what AWQ's scales protect."""
    sums: dict[str, torch.Tensor] = {}

    def hook(name: str) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], None]:
        def record(m: nn.Module, a: tuple[torch.Tensor, ...]) -> None:
            x = a[0].detach().abs().reshape(-1, a[0].shape[-1]).sum(0)
            sums[name] = sums[name] + x if name in sums else x

        return record

    handles = [mod.register_forward_pre_hook(hook(n)) for n, mod in model.named_modules()
               if isinstance(mod, nn.Linear) and keep(n)]
    try:
        for b in batches:
            model(**b)
    finally:
        for h in handles:
            h.remove()
    return [float(v.max() / v.median().clamp_min(1e-12)) for v in sums.values()]


# ---- calibration draws: how much of a method's figure is the calibration sample's luck ------------


def draw_windows(pool: torch.Tensor, calib: int, draw: int) -> torch.Tensor:
    """Draw 0: the first ``calib`` windows (the main table's calibration set); draw k: ``calib``
    windows sampled without replacement from ``pool`` with seed k."""
    if draw == 0:
        return pool[:calib]
    return pool[torch.randperm(len(pool), generator=torch.Generator().manual_seed(draw))[:calib]]


def run_draws(model_dir: str, pool: torch.Tensor, evalw: torch.Tensor, *, calib: int, calib_batch: int, draws: int,
              schemes: list[str], methods: list[str]) -> dict[str, Any]:
    """Per-window NLLs of fp32, RTN and each of ``methods`` calibrated on ``draws`` calibration sets."""
    from compress.models import load_model

    fp = load_model({"hf_path": model_dir}).eval()
    out: dict[str, Any] = {"fp32": window_nll(fp, evalw).tolist(), "schemes": {}}
    t0 = time.perf_counter()
    for label in schemes:
        rtn = torch_methods(SCHEMES[label], [])["RTN"](copy.deepcopy(fp))
        out["schemes"][label] = {"RTN": window_nll(rtn, evalw).tolist(), "draws": {m: [] for m in methods}}
    for d in range(draws):
        cal = draw_windows(pool, calib, d)
        data = [cal[i : i + calib_batch] for i in range(0, len(cal), calib_batch)]
        for label in schemes:
            table_ = torch_methods(SCHEMES[label], data)
            for m in methods:
                nll = window_nll(table_[m](copy.deepcopy(fp)), evalw)
                out["schemes"][label]["draws"][m].append(nll.tolist())
                log.info("draw %d %s %s %.3f (%.0f s)", d, label, m, _ppl(nll, evalw.shape[1]),
                         time.perf_counter() - t0)
    return out


def gap_closed(fp: torch.Tensor, rtn: torch.Tensor, method: torch.Tensor) -> torch.Tensor:
    """Share of RTN's perplexity gap to fp32 that ``method`` removes, from per-window NLLs
    (``[..., windows]``; leading dims broadcast, e.g. bootstrap resamples or draws)."""
    ppl = [t.mean(-1).exp() for t in (fp, rtn, method)]  # per-token NLLs: windows predict equal token counts
    return (ppl[1] - ppl[2]) / (ppl[1] - ppl[0])


def summarize_draws(res: dict[str, Any], seq_len: int, *, resamples: int = 2000) -> list[dict[str, Any]]:
    """Per scheme and method: the gap closed on each draw, their mean and range, and a 90% interval
    of the mean from a paired bootstrap over the eval windows (every method on the same resample)."""
    tok = float(seq_len - 1)
    fp = torch.tensor(res["fp32"], dtype=torch.float64) / tok
    n = fp.numel()
    idx = torch.randint(0, n, (resamples, n), generator=torch.Generator().manual_seed(0))
    rows = []
    for label, sc in res["schemes"].items():
        rtn = torch.tensor(sc["RTN"], dtype=torch.float64) / tok
        for m, per_draw in sc["draws"].items():
            nll = torch.tensor(per_draw, dtype=torch.float64) / tok  # [draws, windows]
            each = gap_closed(fp, rtn, nll)
            boot = gap_closed(fp[idx], rtn[idx], nll[:, idx]).mean(0)  # [resamples]
            lo, hi = torch.quantile(boot, torch.tensor([0.05, 0.95], dtype=torch.float64)).tolist()
            rows.append({
                "scheme": label, "method": m, "draws": len(per_draw),
                "gap closed, mean": f"{float(each.mean()):.0%}",
                "90% interval (eval windows)": f"{lo:.0%} to {hi:.0%}",
                "per draw": " ".join(f"{float(v):.0%}" for v in each),
                "min": f"{float(each.min()):.0%}", "max": f"{float(each.max()):.0%}",
            })
    return rows


# ---- ONNX Runtime's weight-only quantizer on the same fp32 model ----------------------------------


class _Logits(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits  # type: ignore[no-any-return]


def export_fp32(model_dir: str, path: Path, example: torch.Tensor) -> None:
    from compress.models import load_model

    fp = load_model({"hf_path": model_dir}).eval()
    torch.onnx.export(_Logits(fp).eval(), (example,), str(path), input_names=["input_ids"], output_names=["logits"],
                      dynamo=True, external_data=False)


def ort_perplexity(path: Path, evalw: torch.Tensor, batch: int) -> float:
    import onnxruntime as ort

    from compress.core.metrics import causal_lm_nll

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    total, count = 0.0, 0
    for i in range(0, len(evalw) - batch + 1, batch):
        x = evalw[i : i + batch]
        logits = torch.from_numpy(sess.run(None, {"input_ids": x.numpy()})[0])
        nll, n = causal_lm_nll(logits, x)
        total += float(nll)
        count += n
    return math.exp(total / count)


def run_ort(model_dir: str, calib: torch.Tensor, evalw: torch.Tensor, batch: int) -> list[dict[str, Any]]:
    import onnx
    from onnxruntime.quantization import CalibrationDataReader
    from onnxruntime.quantization import matmul_nbits_quantizer as mnq

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        fp32 = Path(tmp) / "fp32.onnx"
        export_fp32(model_dir, fp32, evalw[:batch])
        rows.append({"scheme": "fp32", "method": "ORT fp32", "perplexity": ort_perplexity(fp32, evalw, batch),
                     "seconds": 0.0})
        head = [n.name for n in onnx.load(str(fp32)).graph.node if n.op_type == "MatMul"][-1:]  # lm_head: last MatMul

        class Reader(CalibrationDataReader):
            def __init__(self) -> None:
                self.it = iter([{"input_ids": calib[i : i + batch].numpy()} for i in range(0, len(calib) - batch + 1, batch)])

            def get_next(self) -> dict[str, Any] | None:
                return next(self.it, None)

        configs: dict[tuple[str, str], Any] = {
            ("w4 g128", "ORT RTN"): lambda: mnq.DefaultWeightOnlyQuantConfig(block_size=128, is_symmetric=True),
            ("w4 g128", "ORT HQQ"): lambda: mnq.HQQWeightOnlyQuantConfig(block_size=128, bits=4),
            ("w4 g128", "ORT GPTQ"): lambda: mnq.GPTQWeightOnlyQuantConfig(Reader(), actorder=True),
            ("w4 per-channel", "ORT RTN"): lambda: mnq.DefaultWeightOnlyQuantConfig(
                block_size=128, is_symmetric=True, channel_wised_quantize=True),
        }
        for (label, method), make in configs.items():
            out = Path(tmp) / f"{method}_{label}.onnx".replace(" ", "_")
            t = time.perf_counter()
            try:
                quant = mnq.MatMulNBitsQuantizer(onnx.load(str(fp32)), block_size=128, is_symmetric=True,
                                                 nodes_to_exclude=head, algo_config=make())
                quant.process()
                quant.model.save_model_to_file(str(out), use_external_data_format=False)
                ppl = ort_perplexity(out, evalw, batch)
            except Exception as exc:  # a quantizer that does not run is reported, not fatal
                log.warning("%s %s failed: %s", label, method, exc)
                rows.append({"scheme": label, "method": method, "perplexity": float("nan"), "seconds": 0.0,
                             "note": f"failed: {type(exc).__name__}: {str(exc)[:120]}"})
                continue
            rows.append({"scheme": label, "method": method, "perplexity": ppl, "seconds": time.perf_counter() - t})
            log.info("%s %s %.3f", label, method, ppl)
    return rows


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    base = next(r["perplexity"] for r in rows if r["method"] == "fp32")
    rtn = {r["scheme"]: r["perplexity"] for r in rows if r["method"] == "RTN"}
    out = []
    for r in rows:
        gap = rtn.get(r["scheme"])
        closed = None
        if gap is not None and r["method"] not in ("RTN", "fp32") and gap > base and math.isfinite(r["perplexity"]):
            closed = (gap - r["perplexity"]) / (gap - base)
        out.append({
            "scheme": r["scheme"], "method": r["method"], "perplexity": f"{r['perplexity']:.3f}",
            "vs fp32": f"{(r['perplexity'] / base - 1) * 100:+.2f}%" if math.isfinite(r["perplexity"]) else "-",
            "RTN gap closed": f"{closed:.0%}" if closed is not None else "-",
            "quantize s": round(r["seconds"], 1), "note": r.get("note", ""),
        })
    return out


def _w3_rtn_cost(rows: list[dict[str, Any]]) -> float:
    base = next(r["perplexity"] for r in rows if r["method"] == "fp32")
    w3 = [r["perplexity"] for r in rows if r["method"] == "RTN" and r["scheme"] == "w3 g128"]
    return (w3[0] / base - 1) * 100 if w3 else float("nan")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    lm_arguments(p, calib=128)
    p.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES))
    p.add_argument("--add", action="store_true", help="run --schemes and merge them into the last run's rows")
    p.add_argument("--no-ort", action="store_true")
    p.add_argument("--ort-only", action="store_true", help="rerun ORT's rows, keep the last run's PyTorch rows")
    p.add_argument("--report-only", action="store_true", help="rewrite the RESULTS.md section from the last run's rows")
    p.add_argument("--draws", type=int, default=0,
                   help="instead of the main table: run --draw-methods on this many calibration sets (draw 0: the "
                        "main table's) and write the llm_quant_draws section")
    p.add_argument("--draw-methods", nargs="+", default=["GPTQ", "AWQ", "AWQ act-only"],
                   choices=[m for m in torch_methods({}, []) if m != "RTN"])
    p.add_argument("--pool", type=int, default=512, help="calibration windows the draws sample from")
    args = p.parse_args(argv)
    calib, evalw = lm_windows(args)
    if args.draws:
        _main_draws(args, len(calib), evalw)
        return
    ratios = sorted(outlier_ratios(args.model, calib))  # once: the section is written up to twice
    if args.ort_only or args.report_only:  # reuse the last run's rows (same args): rerun ORT's part / nothing
        from benchmarks._results import RESULTS_DIR

        rows = [r for r in json.loads((RESULTS_DIR / "llm_quant.json").read_text())["rows"]
                if args.report_only or not r["method"].startswith("ORT")]
        if args.report_only:
            _write(args, rows, len(calib), len(evalw), ratios)
            return
    elif args.add:  # more schemes, merged into the last run's rows (same model, data and args)
        from benchmarks._results import RESULTS_DIR

        old = json.loads((RESULTS_DIR / "llm_quant.json").read_text())["rows"]
        new = [r for r in run_torch(args.model, calib, evalw, calib_batch=args.calib_batch, schemes=args.schemes)
               if r["method"] != "fp32"]
        torch_rows = [r for r in old if not r["method"].startswith("ORT") and r["scheme"] not in args.schemes]
        rows = torch_rows + new + [r for r in old if r["method"].startswith("ORT")]
        _write(args, rows, len(calib), len(evalw), ratios)
        return
    else:
        rows = run_torch(args.model, calib, evalw, calib_batch=args.calib_batch, schemes=args.schemes)
    _write(args, rows, len(calib), len(evalw), ratios)  # the PyTorch figures stand even if ORT's part fails
    if not args.no_ort:
        rows += run_ort(args.model, calib, evalw, batch=16)
        _write(args, rows, len(calib), len(evalw), ratios)


def _awq_samples() -> str:
    """AWQ's default sample sizes, as the sections state them."""
    from compress.quantization.algorithms.awq_search import AWQParams

    p = AWQParams()
    return f"scales searched on up to {p.sample_tokens} calibration tokens and clips on {p.clip_tokens}"


def _main_draws(args: argparse.Namespace, n_calib: int, evalw: torch.Tensor) -> None:
    from benchmarks._results import RESULTS_DIR
    from compress.data.lm import text_lm

    path = RESULTS_DIR / "llm_quant_draws.json"
    if args.report_only:
        res = json.loads(path.read_text())["result"]
    else:
        splits = text_lm(seed=0, tokenizer=args.model, seq_len=args.seq_len, samples=max(args.pool, n_calib))
        pool = _windows(splits.calibration)
        res = run_draws(args.model, pool, evalw, calib=n_calib, calib_batch=args.calib_batch, draws=args.draws,
                        schemes=args.schemes, methods=args.draw_methods)
        res["pool"] = len(pool)
        if args.add:  # more methods (or schemes) merged into the last draws run (same model, data and args)
            old = json.loads(path.read_text())["result"]
            for label, sc in res["schemes"].items():
                old["schemes"].setdefault(label, sc)["draws"].update(sc["draws"])
            res = old
    rows = summarize_draws(res, args.seq_len)
    n_draws = max(r["draws"] for r in rows)
    md = (
        "## Weight-only LLM quantization: the calibration sample's share (`python -m benchmarks.llm_quant --draws N`)\n\n"
        f"The reference LLaMA of `llm_quant`; each method calibrated on {n_draws} calibration sets of {n_calib} "
        f"windows (draw 0: the main table's, the first {n_calib}; draw k: {n_calib} of the first {res['pool']} "
        f"calibration windows, sampled with seed k) and evaluated on the same {len(res['fp32'])} held-out windows. "
        f"AWQ's searches as in `llm_quant` ({_awq_samples()}); 'AWQ scales only': AWQ without its clip search "
        "(`clip: false`), what its scales alone buy. RTN needs no calibration: its gap to fp32 is the same on every draw. 'per draw': the share of RTN's "
        "perplexity gap each calibrated model closes; '90% interval': of the mean over draws, from 2000 paired "
        "bootstrap resamples of the eval windows (what another held-out sample of this size could show).\n\n"
        + table(rows) + f"\nMachine load: {args.load}.\n"
    )
    write_section("llm_quant_draws", md, {"result": res, "args": vars(args)})


def _write(args: argparse.Namespace, rows: list[dict[str, Any]], n_calib: int, n_eval: int,
           ratios: list[float]) -> None:
    """The llm_quant section; ``ratios``: :func:`outlier_ratios`, sorted."""
    info = json.loads((Path(args.model) / "training.json").read_text())
    summary = summarize(rows)
    md = (
        "## Weight-only LLM quantization: GPTQ, AWQ, RTN vs ORT (`python -m benchmarks.llm_quant`)\n\n"
        f"The reference LLaMA (benchmarks/train_reference_llm.py: {info['params'] / 1e6:.1f}M parameters, hidden "
        f"{info['config']['hidden_size']}, {info['config']['num_hidden_layers']} layers, GQA "
        f"{info['config']['num_attention_heads']}/{info['config']['num_key_value_heads']} heads, SwiGLU "
        f"{info['config']['intermediate_size']}, vocab {info['config']['vocab_size']}; "
        f"{info['train_tokens_seen'] / 1e3:.0f}k training tokens, {info['train_seconds'] / 60:.0f} min on this CPU under load; "
        f"held-out perplexity {info['eval_perplexity']:.1f} on {info['eval_tokens']} tokens). Here: perplexity on "
        f"{n_eval} held-out windows of {args.seq_len} tokens, {n_calib} calibration windows. Decoder-layer "
        "Linears quantized (lm_head and embeddings float, for every method); symmetric grids with each group's "
        "larger end on the extra level (-8 at 4 bits, a signed scale), as ORT's blockwise quantizer. GPTQ with act_order (static groups); "
        "AWQ with duo scaling (activation and weight terms, compress's default as AutoAWQ's; 'AWQ act-only': the paper's form, activations alone; 'AWQ scales only': without the clip search, what the scales alone buy), grid 20, "
        f"{_awq_samples()}, each candidate judged with its weights clip-searched as the clip phase will clip them; GQA's o_proj scaled through v_proj with scales tied per key/value head; clip "
        "search on every Linear, q/k included, each clip kept only where it lowers its group's module-output "
        "error. 'RTN gap closed': how much of RTN's perplexity increase over "
        "fp32 the method removes. ORT rows: the same fp32 model exported to ONNX and quantized by "
        "onnxruntime.quantization.matmul_nbits_quantizer (MatMulNBits, symmetric), evaluated in ORT.\n\n"
        + table(summary)
        + "\nRTN's cost over fp32 on this model: "
        + ", ".join(f"{r['scheme']} {r['vs fp32']}" for r in summary if r["method"] == "RTN")
        + ". Where it is a few hundredths of a percent the model cannot tell methods apart (differences of that"
        " size are noise)."
        + (" The issue asked for a reference model on which RTN w3 g128 costs several percent; this one does not"
           " get there." if _w3_rtn_cost(rows) < 2.0 else "") + "\n"
        + f"\nActivation outliers, what AWQ's scales protect: at the {len(ratios)} decoder Linears' inputs, the "
        f"largest channel's mean |x| is {ratios[0]:.1f}-{ratios[-1]:.1f} times the median channel's (median "
        f"{statistics.median(ratios):.1f}) on the calibration windows.\n"
        + f"\nMachine load: {args.load}.\n"
    )
    write_section("llm_quant", md, {"rows": rows, "args": vars(args)})


if __name__ == "__main__":
    main()
