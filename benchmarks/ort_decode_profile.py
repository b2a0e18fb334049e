"""Where ONNX Runtime's int4 decode time goes on real SmolLM2-135M: ORT's own per-node profile of
decode steps of our ``export_llm_onnx(weights="int4")`` file, summed per op type, with the attention
written decomposed and fused (RotaryEmbedding + GroupQueryAttention) side by side in one run.

    python -m benchmarks.ort_decode_profile [--threads 1] [--steps 32]

RTN int4 (group 32, lm_head float, as the llama.cpp comparison in ``benchmarks.llm_llamacpp``),
MatMulNBits with ``accuracy_level`` 4, a 128-token prompt, then ``--steps`` greedy steps profiled
(the prefill's events are left out). ``model_run`` is ORT's whole ``run`` call per step; the node
time is the sum of the kernels' own times; the difference is the executor's per-node overhead and
the inputs' and outputs' handling. Profiling adds its own overhead: read shares, not tokens/s.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("benchmarks.ort_decode_profile")


def profile_decode(path: Path, *, threads: int, steps: int, prompt: int = 128) -> dict[str, Any]:
    """Run a prompt and ``steps`` decode steps with ORT profiling on; per op type: ms per step,
    nodes per step, share of the node time."""
    import compress.export.llm.ort as lo
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    real = lo.session_options
    prefix = str(Path(tempfile.mkdtemp(prefix="ort_profile.")) / "decode")

    def profiled(*a: Any, **k: Any) -> Any:
        so = real(*a, **k)
        so.enable_profiling, so.profile_file_prefix = True, prefix
        return so

    lo.session_options = profiled
    try:
        gen = lo.OrtGenerator(path, threads=threads)
    finally:
        lo.session_options = real
    logits = gen.prefill(np.asarray([list(range(100, 100 + prompt))], dtype=np.int64), None)
    t0 = time.perf_counter()
    for _ in range(steps):
        logits = gen.step(logits.argmax(-1).astype(np.int64))
    wall = time.perf_counter() - t0
    events = json.loads(Path(gen.session.end_profiling()).read_text())
    runs = [e for e in events if e.get("name") == "model_run"]
    after_prefill = runs[0]["ts"] + runs[0]["dur"]
    per: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    lm_head = 0.0
    for e in events:
        if e.get("cat") == "Node" and e["ts"] > after_prefill and e["name"].endswith("_kernel_time"):
            op = e["args"].get("op_name", "?")
            per[op] += e["dur"]
            count[op] += 1
            if "lm_head" in e["name"]:
                lm_head += e["dur"]
    n = len(runs) - 1
    node_us = sum(per.values())
    rows = [{"op": op, "ms_per_step": t / n / 1e3, "nodes_per_step": count[op] / n, "share": t / node_us}
            for op, t in per.most_common()]
    return {"graph_nodes": len(graph.node), "steps": n, "threads": threads, "wall_tok_s": steps / wall,
            "model_run_ms": sum(r["dur"] for r in runs[1:]) / n / 1e3, "node_ms": node_us / n / 1e3,
            "nodes_per_step": sum(count.values()) / n, "lm_head_ms": lm_head / n / 1e3, "rows": rows}


def _markdown(data: dict[str, Any]) -> str:
    from benchmarks._results import table

    forms = data["forms"]
    summary = [{"attention": f, "file_nodes": d["graph_nodes"], "nodes_per_step": d["nodes_per_step"],
                "run_ms": d["model_run_ms"], "kernel_ms": d["node_ms"], "overhead_ms": d["model_run_ms"] - d["node_ms"],
                "lm_head_ms": d["lm_head_ms"], "tok_s_profiled": d["wall_tok_s"], "tok_s": d["tok_s"]}
               for f, d in forms.items()]
    parts = [
        "## Where ONNX Runtime's int4 decode time goes, real SmolLM2-135M (`python -m benchmarks.ort_decode_profile`)\n",
        "Our `export_llm_onnx(weights=\"int4\")` file (RTN int4 g32, MatMulNBits accuracy_level 4, lm_head float, "
        "as in the llama.cpp comparison), written twice in one run: attention `decomposed` (masks, rotate-half RoPE, "
        "KV repeat, matmul/softmax in plain ONNX ops) and `fused` (per layer one GroupQueryAttention reading the packed "
        "q/k/v MatMulNBits output as its query and applying RoPE itself, each residual add with the RMSNorm after "
        "it as one SkipSimplifiedLayerNormalization); both with q/k/v and gate/up packed into one MatMulNBits each."
        f" {data['threads']} thread, a 128-token prompt then {data['steps']} decode steps under "
        "ORT's profiler (prefill events left out; `run_ms`, `kernel_ms`, `lm_head_ms` and `tok_s_profiled` are "
        "per step under the profiler, which adds overhead); `tok_s`: decode tokens/s of the same file without the "
        f"profiler (64 greedy tokens after the prompt, median of 5 after a warm-up, the two files taking turns). `overhead_ms`: `run` minus the "
        "kernels' own time (per-node executor overhead, inputs and outputs). `nodes_per_step`: nodes ORT runs per "
        "step after its optimizer (`file_nodes`: in the file). Machine load (1/5/15 min) at start: "
        f"{tuple(data.get('load', ()))}.\n",
        table(summary, ["attention", "file_nodes", "nodes_per_step", "run_ms", "kernel_ms", "overhead_ms", "lm_head_ms",
                        "tok_s_profiled", "tok_s"]),
    ]
    for f, d in forms.items():
        top = [r for r in d["rows"] if r["share"] >= 0.01]
        parts += [f"\nPer op type, `{f}` attention (ops with 1% or more of the kernel time):\n", table(top, [
            "op", "ms_per_step", "nodes_per_step", "share"])]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ort_decode_profile", description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import torch
    from compress.export.llm.onnx import export_llm_onnx

    import compress
    from benchmarks._results import write_section
    from benchmarks.llm_llamacpp import interleaved, ort_timer
    from benchmarks.llm_runtimes import load_smollm2

    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="ort_decode_profile."))
    fp, _ = load_smollm2(work / "smollm2")
    scheme = compress.QuantScheme(weights=compress.QuantSpec(bits=4, granularity="group", group_size=32), inputs=None)
    q = compress.quantize(fp, scheme, ignore=["lm_head"])
    load = os.getloadavg()
    forms: dict[str, Any] = {}
    prompt = list(range(100, 228))
    paths = {}
    for form in ("decomposed", "fused"):
        paths[form] = export_llm_onnx(q, work / form / "model.onnx", weights="int4", accuracy_level=4, attention=form,
                                      lm_head="float")
        forms[form] = profile_decode(paths[form], threads=args.threads, steps=args.steps)
    timed = interleaved({form: ort_timer(path, prompt, 64, args.threads) for form, path in paths.items()})
    for form in forms:
        forms[form]["tok_s"] = timed[form][1]
        log.info("%s: %s", form, {k: v for k, v in forms[form].items() if k != "rows"})
    data = {"forms": forms, "threads": args.threads, "steps": args.steps, "load": [round(v, 1) for v in load]}
    write_section("ort_decode_profile", _markdown(data), data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
