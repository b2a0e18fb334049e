"""What limits ONNX Runtime's int4 decode on the real SmolLM2-135M: one run over the export's choices.

    python -m benchmarks.ort_decode_sweep [--rounds 5]

Every file is our ``export_llm_onnx(weights="int4")`` of SmolLM2-135M-Instruct quantized round to
nearest (lm_head ignored by the quantization, as llm-compressor's default): MatMulNBits block size
32 / 64 / 128 (the quantization's group size), symmetric (no zero points, like llama.cpp's Q4_0)
or asymmetric, ``accuracy_level`` 0 (float32 activations) or 4 (int8 activations per block), the
lm_head float32, 8-bit (``lm_head="int8"``, the export's default at level 4) or 4-bit (quantized
with the layers), the attention as written now (q/k/v packed into GroupQueryAttention's query,
RoPE in the op) or as before (a Split and two RotaryEmbedding nodes per layer), 1 or 2 threads.
Decode: ``--rounds`` rounds after a warm-up round, each a 128-token prompt per file then 64
greedy steps, the files taking turns step by step (``benchmarks.llm_llamacpp.interleaved_steps``). Perplexity: ONNX Runtime's own
logits of each file over the held-out windows of ``benchmarks.llm_llamacpp`` (8 x 256 tokens of
stdlib code), so the int8 activations and the head's bits count. The default file is also
profiled (ORT's per-node profiler): per-node overhead against kernel time.
"""

from __future__ import annotations

import argparse
import copy
import logging
import math
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("benchmarks.ort_decode_sweep")


def ort_ppl(path: Path, windows: list[list[int]]) -> float:
    """Perplexity from ONNX Runtime's logits of ``path`` (teacher-forced, one prefill per window)."""
    from compress.core.ort import inference_session, session_options

    sess = inference_session(path, session_options(threads=1, log_severity=3))
    past = [i for i in sess.get_inputs() if i.name.startswith("past_key_values.")]
    empty = np.zeros((1, int(past[0].shape[1]), 0, int(past[0].shape[3])), dtype=np.float32)
    nll, count = 0.0, 0
    for w in windows:
        ids = np.asarray([w], dtype=np.int64)
        feed = {"input_ids": ids, "attention_mask": np.ones_like(ids), **{p.name: empty for p in past}}
        logits = sess.run(["logits"], feed)[0][0, :-1].astype(np.float64)
        logits -= logits.max(-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        nll -= float(logp[np.arange(len(w) - 1), w[1:]].sum())
        count += len(w) - 1
    return math.exp(nll / count)


def previous_form() -> Callable[[], None]:
    """Make the export write the attention as before this sweep's change (q/k/v split, RotaryEmbedding
    on q and k); returns the undo."""
    from compress.export.llm.onnx import KVDecoder

    saved = KVDecoder._rotary_in_op, KVDecoder._packed_qkv
    KVDecoder._rotary_in_op = lambda self: False  # type: ignore[method-assign]
    KVDecoder._packed_qkv = lambda self, attn, x: None  # type: ignore[method-assign]

    def undo() -> None:
        KVDecoder._rotary_in_op, KVDecoder._packed_qkv = saved  # type: ignore[method-assign]
    return undo


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ort_decode_sweep", description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import torch
    from compress.export.llm.onnx import export_llm_onnx

    import compress
    from benchmarks._results import table, write_section
    from benchmarks.llm_llamacpp import _windows, interleaved_steps, ort_stepper
    from benchmarks.llm_runtimes import load_smollm2
    from benchmarks.ort_decode_profile import profile_decode

    torch.set_num_threads(1)
    load = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="ort_decode_sweep."))
    fp, tok = load_smollm2(work / "smollm2")
    windows = _windows(tok, 8, 256)
    prompt, new = windows[0][:128], 64

    def scheme(group: int, symmetric: bool) -> Any:
        return compress.QuantScheme(weights=compress.QuantSpec(
            bits=4, granularity="group", group_size=group, symmetric=symmetric,
            dtype="int8" if symmetric else "uint8"), inputs=None)

    models: dict[tuple[int, bool], Any] = {}

    def model(group: int, symmetric: bool) -> Any:
        if (group, symmetric) not in models:
            models[(group, symmetric)] = compress.quantize(copy.deepcopy(fp), scheme(group, symmetric), ignore=["lm_head"])
        return models[(group, symmetric)]

    # (label, group, symmetric, accuracy_level, lm_head, attention form); lm_head "int4": quantized with the layers
    configs = [
        ("default: g32 sym, level 4, lm_head int8", 32, True, 4, "int8", "now"),
        ("g32 sym, level 4, lm_head float", 32, True, 4, "float", "now"),
        ("g32 sym, level 4, lm_head int4 g32", 32, True, 4, "int4", "now"),
        ("g32 sym, level 0, lm_head float (former default)", 32, True, 0, "float", "now"),
        ("g32 sym, level 4, lm_head int8, attention as before", 32, True, 4, "int8", "before"),
        ("g32 asym, level 4, lm_head int8", 32, False, 4, "int8", "now"),
        ("g64 sym, level 4, lm_head int8", 64, True, 4, "int8", "now"),
        ("g64 asym, level 4, lm_head int8", 64, False, 4, "int8", "now"),
        ("g128 sym, level 4, lm_head int8", 128, True, 4, "int8", "now"),
        ("g128 asym, level 4, lm_head int8", 128, False, 4, "int8", "now"),
    ]
    files: dict[str, Path] = {}
    for i, (label, group, sym, level, head, form) in enumerate(configs):
        q = model(group, sym)
        if head == "int4":
            q = compress.quantize(copy.deepcopy(fp), scheme(group, sym))
        undo = previous_form() if form == "before" else None
        try:
            files[label] = export_llm_onnx(q, work / f"f{i}" / "model.onnx", weights="int4", accuracy_level=level,
                                           lm_head="float" if head == "int4" else head, check=i == 0)
        finally:
            if undo is not None:
                undo()
    import onnx

    rows: list[dict[str, Any]] = []
    for label, path in files.items():
        nodes = len(onnx.load(str(path), load_external_data=False).graph.node)
        rows.append({"file": label, "MiB": path.stat().st_size / 2**20, "file_nodes": nodes,
                     "ppl_ort": ort_ppl(path, windows)})
        log.info("%s", rows[-1])
    # timed in small groups, each beside the default file: with a dozen sessions alive at once on this
    # shared machine some rows ran 40% slower than alone (g128 below g32), the same files in threes did not
    labels = [c[0] for c in configs]
    default = labels[0]
    groups = [[(label, 1) for label in labels[1:4]], [(label, 1) for label in labels[4:6]],
              [(label, 1) for label in labels[6:8]], [(label, 1) for label in labels[8:10]],
              [(default, 2), (labels[3], 2)]]
    speed = []
    for group in groups:
        steppers = {f"{label} @{t}": ort_stepper(files[label], prompt, t) for label, t in [(default, 1), *group]}
        timed = interleaved_steps(steppers, new, rounds=args.rounds)
        base = timed[f"{default} @1"][1]
        speed += [{"file": k.rsplit(" @", 1)[0], "threads": int(k.rsplit(" @", 1)[1]), "prefill_ms": v[0],
                   "decode_tok_s": v[1], "vs_default": v[1] / base} for k, v in timed.items()]
        del steppers
    for row in speed:
        log.info("%s", row)
    prof = profile_decode(files[configs[0][0]], threads=1, steps=32)
    top = [r for r in prof["rows"] if r["share"] >= 0.01]
    float_ppl = ort_ppl(export_llm_onnx(fp, work / "fp32" / "model.onnx", weights="fp32", check=False), windows)
    md = ("## What limits ONNX Runtime's int4 decode, real SmolLM2-135M (`python -m benchmarks.ort_decode_sweep`)\n\n"
          "Our `export_llm_onnx(weights=\"int4\")` of SmolLM2-135M-Instruct quantized round to nearest (lm_head ignored "
          "by the quantization), one file per row: MatMulNBits block = the group size, `sym` without zero points (as "
          "llama.cpp's Q4_0), `asym` with them; `level`: MatMulNBits accuracy_level (0: float32 activations, 4: int8 "
          "activations per block); lm_head float32, 8-bit (`lm_head=\"int8\"`, blocks of 32, llama.cpp's Q8_0 default "
          "for this tied embedding) or 4-bit g32 (quantized with the layers); `attention as before`: q/k/v split and "
          "two RotaryEmbedding nodes per layer before GroupQueryAttention (now: the packed q/k/v output is the op's "
          "query, RoPE in the op). `ppl_ort`: perplexity from ONNX Runtime's own logits on 8 held-out windows of 256 "
          f"tokens (stdlib code, as `llm_llamacpp`); the float32 file gives {float_ppl:.3f}. Decode: a {len(prompt)}-token "
          f"prompt then {new} greedy tokens, {args.rounds} rounds after a warm-up round, all rows in this one run: each "
          "round prefills every file of a group, then its files take turns step by step; `prefill_ms`: median over the rounds, "
          "`decode_tok_s`: 1 / the median step.\n\n"
          + table(rows, ["file", "MiB", "file_nodes", "ppl_ort"])
          + "\nDecode, timed in groups of up to four files, each group with the default file at 1 thread (its row "
          "repeated per group; `vs_default`: tokens/s over the default's in the same group, the figure to compare "
          "across groups):\n\n"
          + table(speed, ["file", "threads", "prefill_ms", "decode_tok_s", "vs_default"])
          + f"\nThe default file under ORT's profiler (1 thread, {prof['steps']} decode steps after the prompt; per step): "
          f"`run` {prof['model_run_ms']:.2f} ms, kernels {prof['node_ms']:.2f} ms, so per-node overhead (executor, "
          f"inputs, outputs) {prof['model_run_ms'] - prof['node_ms']:.2f} ms "
          f"({(prof['model_run_ms'] - prof['node_ms']) / prof['model_run_ms']:.0%}) over {prof['nodes_per_step']:.0f} "
          f"nodes; lm_head {prof['lm_head_ms']:.2f} ms. Per op type (1% of kernel time or more):\n\n"
          + table(top, ["op", "ms_per_step", "nodes_per_step", "share"])
          + f"\nMachine load at start (1/5/15 min): {tuple(round(x, 1) for x in load)}; a 2-core machine shared with "
          "other engineers' jobs, so 2-thread rows compete with them.\n")
    write_section("ort_decode_sweep", md, {"rows": rows, "speed": speed, "profile": prof, "float_ppl": float_ppl,
                                           "load": load})
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
