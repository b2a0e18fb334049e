"""llama.cpp on our GGUF files of the real SmolLM2-135M, beside llama.cpp's own quantization of the
same float model, and beside our ONNX int4 file in ONNX Runtime for CPU decode speed.

    python -m benchmarks.llm_llamacpp [--gptq] [--threads 1]     (needs llama-cpp-python: the `llamacpp` extra)

Files, all read by llama.cpp itself (``llama_cpp.Llama``):
- the float model as an F32 GGUF (``save_gguf`` of the unquantized model);
- ours: RTN (and GPTQ with ``--gptq``, at both types) at 4 bits, groups of 32, symmetric, written as Q4_0 blocks with our
  codes; 8 bits as Q8_0;
- llama.cpp's: ``llama_model_quantize`` of that F32 file to Q4_0 and Q8_0, once with its defaults (the
  token embedding quantized too) and once with the token embedding kept F32, as ours keeps it.
Perplexity over held-out windows of stdlib code (disjoint from the calibration text), each file
evaluated by llama.cpp on the same token ids; greedy tokens of llama.cpp on our files against our
fake-quant PyTorch model on held-out prompts; decode speed (prefill ms, decode tokens/s) of llama.cpp
on the Q4_0 files and of ONNX Runtime on our MatMulNBits int4 export of the same weights, threads stated.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import logging
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks._results import table, write_section

log = logging.getLogger("benchmarks.llm_llamacpp")


def _windows(tok: Any, n: int, length: int) -> list[list[int]]:
    root = Path(os.path.dirname(os.__file__))
    text = "".join((root / f).read_text() for f in ("json/decoder.py", "json/encoder.py", "argparse.py"))
    ids = tok(text)["input_ids"]
    return [ids[i * length : (i + 1) * length] for i in range(n) if len(ids) >= (i + 1) * length]


def _llama(path: Path, ctx: int, threads: int, logits_all: bool) -> Any:
    from llama_cpp import Llama

    return Llama(model_path=str(path), n_ctx=ctx, n_threads=threads, n_threads_batch=threads, logits_all=logits_all,
                 verbose=False, n_batch=ctx)


def llamacpp_ppl(path: Path, windows: list[list[int]], threads: int) -> tuple[float, np.ndarray]:
    """Perplexity llama.cpp computes from ``path`` over ``windows`` (token ids, one sequence each),
    and its top-1 prediction at every position (teacher-forced)."""
    llm = _llama(path, len(windows[0]), threads, logits_all=True)
    nll, count, top = 0.0, 0, []
    for w in windows:
        llm.reset()
        llm.eval(w)
        logits = np.asarray(llm.scores[: len(w) - 1], dtype=np.float64)
        top.append(logits.argmax(-1))
        logits -= logits.max(-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        nll -= float(logp[np.arange(len(w) - 1), w[1:]].sum())
        count += len(w) - 1
    return math.exp(nll / count), np.concatenate(top)


def torch_ppl(model: Any, windows: list[list[int]]) -> tuple[float, np.ndarray]:
    nll, count, top = 0.0, 0, []
    with torch.no_grad():
        for w in windows:
            ids = torch.tensor([w])
            logits = model(input_ids=ids).logits[0, :-1].double()
            top.append(logits.argmax(-1).numpy())
            logp = torch.log_softmax(logits, -1)
            nll -= float(logp.gather(1, ids[0, 1:, None]).sum())
            count += len(w) - 1
    return math.exp(nll / count), np.concatenate(top)


def _agreement(a: np.ndarray, b: np.ndarray) -> float:
    return float((a == b).mean())


def _same_prefix(a: list[int], b: list[int], start: int) -> int:
    """How many generated tokens agree before the first difference."""
    n = 0
    for x, y in zip(a[start:], b[start:]):
        if x != y:
            break
        n += 1
    return n


def _last_argmax(llm: Any) -> int:
    # without logits_all the binding keeps no scores: read the last token's logits from the context
    return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))


def llamacpp_greedy(path: Path, prompt: list[int], new: int, threads: int) -> list[int]:
    llm = _llama(path, len(prompt) + new + 8, threads, logits_all=False)
    llm.reset()
    llm.eval(prompt)
    out = list(prompt)
    for _ in range(new):
        nxt = _last_argmax(llm)
        out.append(nxt)
        llm.eval([nxt])
    return out


def torch_greedy(model: Any, prompt: list[int], new: int) -> list[int]:
    """Plain argmax decoding with the model's KV cache (no generation-config processors)."""
    out, past, ids = list(prompt), None, torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(new):
            res = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = res.past_key_values
            nxt = int(res.logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.tensor([[nxt]])
    return out


Timer = Callable[[], tuple[float, float]]


def llamacpp_timer(path: Path, prompt: list[int], new: int, threads: int) -> Timer:
    """One ``(prefill ms, decode tokens/s)`` measurement of llama.cpp on ``path`` per call."""
    llm = _llama(path, len(prompt) + new + 8, threads, logits_all=False)

    def once() -> tuple[float, float]:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        t1 = time.perf_counter()
        nxt = _last_argmax(llm)
        for _ in range(new):
            llm.eval([nxt])
            nxt = _last_argmax(llm)
        return (t1 - t0) * 1e3, new / (time.perf_counter() - t1)
    return once


def ort_timer(path: Path, prompt: list[int], new: int, threads: int) -> Timer:
    """One ``(prefill ms, decode tokens/s)`` measurement of ONNX Runtime on ``path`` per call."""
    from compress.export.llm.onnx import OrtGenerator

    gen = OrtGenerator(path, threads=threads)
    ids = np.asarray([prompt], dtype=np.int64)

    def once() -> tuple[float, float]:
        t0 = time.perf_counter()
        logits = gen.prefill(ids, None)
        t1 = time.perf_counter()
        for _ in range(new):
            logits = gen.step(logits.argmax(-1).astype(np.int64))
        return (t1 - t0) * 1e3, new / (time.perf_counter() - t1)
    return once


def interleaved(timers: dict[str, Timer], rounds: int = 5) -> dict[str, tuple[float, float]]:
    """Medians of ``rounds`` measurements per timer after one warm-up each, the timers taking turns
    within every round, so that a burst of load on the shared machine falls on all of them alike."""
    for once in timers.values():
        once()
    got: dict[str, list[tuple[float, float]]] = {k: [] for k in timers}
    for _ in range(rounds):
        for k, once in timers.items():
            got[k].append(once())
    return {k: (statistics.median(p for p, _ in v), statistics.median(d for _, d in v)) for k, v in got.items()}


Stepper = tuple[Callable[[], None], Callable[[], None]]


def llamacpp_stepper(path: Path, prompt: list[int], new: int, threads: int) -> Stepper:
    """``(prefill, step)`` of llama.cpp on ``path``: the prompt from an empty cache, then one greedy token."""
    llm = _llama(path, len(prompt) + 8 * new + 8, threads, logits_all=False)
    state = {"next": 0}

    def prefill() -> None:
        llm.reset()
        llm.eval(prompt)
        state["next"] = _last_argmax(llm)

    def step() -> None:
        llm.eval([state["next"]])
        state["next"] = _last_argmax(llm)
    return prefill, step


def ort_stepper(path: Path, prompt: list[int], threads: int) -> Stepper:
    """``(prefill, step)`` of ONNX Runtime on ``path`` (:class:`export.llm.onnx.OrtGenerator`)."""
    from compress.export.llm.onnx import OrtGenerator

    gen = OrtGenerator(path, threads=threads)
    ids = np.asarray([prompt], dtype=np.int64)
    state: dict[str, np.ndarray] = {}

    def prefill() -> None:
        state["logits"] = gen.prefill(ids, None)

    def step() -> None:
        state["logits"] = gen.step(state["logits"].argmax(-1).astype(np.int64))
    return prefill, step


def interleaved_steps(steppers: dict[str, Stepper], new: int, rounds: int = 5) -> dict[str, tuple[float, float]]:
    """``(prefill ms, decode tokens/s)`` per stepper: each round prefills every one, then runs ``new``
    decode steps taking turns step by step (the order reversed every other step), so a burst of load
    on the shared machine falls on all of them alike; medians over the rounds (prefill) and over
    every step (decode), after one warm-up round."""
    pre: dict[str, list[float]] = {k: [] for k in steppers}
    dec: dict[str, list[float]] = {k: [] for k in steppers}
    keys = list(steppers)
    for r in range(rounds + 1):
        for k in keys:
            t0 = time.perf_counter()
            steppers[k][0]()
            if r:
                pre[k].append((time.perf_counter() - t0) * 1e3)
        for i in range(new):
            for k in keys if i % 2 == 0 else keys[::-1]:
                t0 = time.perf_counter()
                steppers[k][1]()
                if r:
                    dec[k].append(time.perf_counter() - t0)
    return {k: (statistics.median(pre[k]), 1 / statistics.median(dec[k])) for k in keys}


def llamacpp_quantize(src: Path, dst: Path, ftype: str, *, keep_embedding: bool) -> Path:
    """llama.cpp's own quantization of ``src`` to ``ftype`` (Q4_0, Q8_0)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = 1
    if keep_embedding:
        params.token_embedding_type = llama_cpp.GGML_TYPE_F32
        params.output_tensor_type = llama_cpp.GGML_TYPE_F32
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({ftype}) returned {rc}")
    return dst


def _greedy(path: Path, model: Any, prompts: list[list[int]], threads: int, new: int = 16) -> str:
    """Greedy continuations by llama.cpp on ``path`` and by ``model`` (PyTorch): per prompt, how many of
    the ``new`` tokens agree before the first difference."""
    agree = []
    for p in prompts:
        ours = torch_greedy(model, p, new)
        agree.append(_same_prefix(llamacpp_greedy(path, p, new, threads), ours, len(p)))
    return " ".join(f"{a}/{new}" for a in agree)


def main(argv: list[str] | None = None) -> None:
    from compress.export.llm.gguf_file import save_gguf
    from compress.export.llm.onnx import export_llm_onnx

    import compress
    from benchmarks.llm_runtimes import load_smollm2

    try:
        import llama_cpp
    except ImportError:
        raise SystemExit("needs llama-cpp-python (pip install -e '.[llamacpp]'; it builds llama.cpp from source)") from None
    ap = argparse.ArgumentParser(prog="python -m benchmarks.llm_llamacpp", description=__doc__.splitlines()[0])
    ap.add_argument("--gptq", action="store_true", help="also GPTQ at Q4_0 and Q8_0 (16 calibration windows of 256 tokens)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--windows", type=int, default=8, help="held-out windows of 256 tokens")
    ap.add_argument("--rounds", type=int, default=5, help="decode timing rounds (prompt + 64 steps each)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    load = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="llm_llamacpp."))
    fp, tok = load_smollm2(work / "smollm2")
    windows = _windows(tok, args.windows, 256)
    cal_ids = tok(Path(os.__file__).read_text()[:60000])["input_ids"]
    cal = [torch.tensor([cal_ids[i * 256 : (i + 1) * 256]]) for i in range(16)]
    prompts = [w[:32] for w in windows[:4]]
    rows: list[dict[str, Any]] = []
    f32 = save_gguf(fp, work / "f32.gguf", tokenizer=tok)
    ppl_c, top_c = llamacpp_ppl(f32, windows, args.threads)
    ppl_t, top_t = torch_ppl(fp, windows)
    rows.append({"file": "float (F32 GGUF)", "by": "-", "MiB": f32.stat().st_size / 2**20, "ppl_llamacpp": ppl_c,
                 "ppl_torch": ppl_t, "top1_vs_torch": _agreement(top_c, top_t),
                 "greedy_prefix": _greedy(f32, fp, prompts, args.threads)})
    log.info("%s", rows[-1])
    ours: dict[str, tuple[Any, Path]] = {}
    for bits, qtype in ((4, "Q4_0"), (8, "Q8_0")):
        scheme = compress.QuantScheme(weights=compress.QuantSpec(bits=bits, granularity="group", group_size=32),
                                      inputs=None)
        methods = ["RTN"] + (["GPTQ"] if args.gptq else [])
        for method in methods:
            t0 = time.perf_counter()
            if method == "GPTQ":
                q = compress.gptq(copy.deepcopy(fp), cal, scheme=scheme, ignore=["lm_head"])
            else:
                q = compress.quantize(copy.deepcopy(fp), scheme, ignore=["lm_head"])
            path = save_gguf(q, work / f"ours.{method}.{qtype}.gguf", tokenizer=tok)
            ours[f"{method} {qtype}"] = (q, path)
            seconds = time.perf_counter() - t0
            ppl_c, top_c = llamacpp_ppl(path, windows, args.threads)
            ppl_t, top_t = torch_ppl(q, windows)
            rows.append({"file": f"ours {method} {qtype}", "by": "compress", "MiB": path.stat().st_size / 2**20,
                         "ppl_llamacpp": ppl_c, "ppl_torch": ppl_t, "top1_vs_torch": _agreement(top_c, top_t),
                         "greedy_prefix": _greedy(path, q, prompts, args.threads), "quantize_s": seconds})
            log.info("%s", rows[-1])
        for keep in (False, True):
            dst = llamacpp_quantize(f32, work / f"llamacpp.{qtype}.{'f32emb' if keep else 'default'}.gguf", qtype,
                                    keep_embedding=keep)
            rows.append({"file": f"llama.cpp {qtype}" + (" (embedding F32)" if keep else " (defaults)"),
                         "by": f"llama.cpp {llama_cpp.__version__}", "MiB": dst.stat().st_size / 2**20,
                         "ppl_llamacpp": llamacpp_ppl(dst, windows, args.threads)[0]})
            log.info("%s", rows[-1])
    prompt, new = windows[0][:128], 64
    q4, p4 = ours["RTN Q4_0"]
    files: dict[str, tuple[str, Path, Stepper]] = {
        "ours RTN Q4_0 GGUF (embedding F32)": (f"llama.cpp {llama_cpp.__version__}", p4,
                                               llamacpp_stepper(p4, prompt, new, args.threads))}
    # a file with the last position's logits only computes the same numbers at that position: its
    # perplexity (every position's logits) is read from the same file written with all of them
    ppl_of: dict[str, Path] = {}
    # lm_head F32 on both sides: our int4 file at accuracy_level 0 (float activations) and 4 (int8 activations
    # per block, as llama.cpp's Q4_0 x Q8_0 dot products), attention fused (q/k/v packed into GroupQueryAttention);
    # llama.cpp's prefill computes the last prompt position's logits only (logits_all off), as our files
    # with logits="last" do
    for level, logits in ((0, "all"), (4, "all"), (4, "last")):
        onnx4 = export_llm_onnx(q4, work / f"int4_l{level}_{logits}" / "model.onnx", weights="int4", accuracy_level=level,
                                lm_head="float", logits=logits)  # type: ignore[arg-type]
        key = f"ours int4 MatMulNBits (accuracy_level {level}), lm_head F32" + (", last logits" if logits == "last" else "")
        files[key] = ("onnxruntime", onnx4, ort_stepper(onnx4, prompt, args.threads))
        ppl_of[key] = work / f"int4_l{level}_all" / "model.onnx"
    # not the like-for-like comparison (the rows above keep the tied embedding/lm_head F32 on both sides): a
    # quantized lm_head on each side, llama.cpp's defaults file (Q8_0 token_embd, read as the output) against
    # our export's default (lm_head 8-bit MatMulNBits, blocks of 32) and with lm_head int4 g32
    onnx_default = export_llm_onnx(q4, work / "int4_default" / "model.onnx", weights="int4")
    files["ours int4 MatMulNBits, export defaults (accuracy_level 4, lm_head 8-bit g32)"] = (
        "onnxruntime", onnx_default, ort_stepper(onnx_default, prompt, args.threads))
    onnx_last = export_llm_onnx(q4, work / "int4_default_last" / "model.onnx", weights="int4", logits="last")
    files["ours int4 MatMulNBits, export defaults, last logits"] = (
        "onnxruntime", onnx_last, ort_stepper(onnx_last, prompt, args.threads))
    ppl_of["ours int4 MatMulNBits, export defaults, last logits"] = onnx_default
    head4 = compress.quantize(copy.deepcopy(fp), compress.QuantScheme(
        weights=compress.QuantSpec(bits=4, granularity="group", group_size=32), inputs=None))
    onnx_head = export_llm_onnx(head4, work / "int4_head4" / "model.onnx", weights="int4")
    files["ours int4 MatMulNBits (accuracy_level 4), lm_head int4 g32 too"] = (
        "onnxruntime", onnx_head, ort_stepper(onnx_head, prompt, args.threads))
    default_q4 = work / "llamacpp.Q4_0.default.gguf"
    files["llama.cpp Q4_0 GGUF (defaults: token_embd / output Q8_0)"] = (
        f"llama.cpp {llama_cpp.__version__}", default_q4, llamacpp_stepper(default_q4, prompt, new, args.threads))
    timed = interleaved_steps({k: t for k, (_, _, t) in files.items()}, new, rounds=args.rounds)
    from benchmarks.ort_decode_sweep import ort_ppl

    speed = [{"runtime": runtime, "file": k, "MiB": path.stat().st_size / 2**20, "prefill_ms": timed[k][0],
              "decode_tok_s": timed[k][1],
              "ppl": (ort_ppl(ppl_of.get(k, path), windows) if runtime == "onnxruntime"
                      else llamacpp_ppl(path, windows, args.threads)[0])}
             for k, (runtime, path, _) in files.items()]
    for row in speed:
        log.info("%s", row)
    md = ("## llama.cpp on our GGUF files, real SmolLM2-135M (`python -m benchmarks.llm_llamacpp`)\n\n"
          f"Perplexity by llama.cpp itself on {len(windows)} held-out windows of 256 tokens of stdlib code "
          "(json/decoder.py, json/encoder.py, argparse.py; calibration for GPTQ: os.py), every file on the same "
          "token ids; `ppl_torch` is our PyTorch fake-quant model on the same windows. Ours keep the token "
          "embedding F32 (llama.cpp's quantizer is shown with its defaults and with the embedding F32). "
          "`top1_vs_torch`: share of positions where llama.cpp's top-1 equals the PyTorch model's (teacher-forced, "
          "same windows; llama.cpp's Q4_0/Q8_0 dot products quantize activations to 8 bits, ours are float). "
          f"`greedy_prefix`: 4 prompts of 32 tokens, tokens generated alike before the first difference. Threads: "
          f"{args.threads}.\n\n"
          + table(rows, ["file", "by", "MiB", "ppl_llamacpp", "ppl_torch", "top1_vs_torch", "greedy_prefix", "quantize_s"])
          + f"\nCPU decode, prompt of {len(prompt)} tokens then {new} greedy tokens, {args.rounds} rounds after a "
          "warm-up round, every row in this one run: each round prefills every file, then the files take turns "
          "step by step; `prefill_ms`: median over the rounds, `decode_tok_s`: 1 / the median step; threads: "
          f"{args.threads}. The first four rows keep the tied embedding / lm_head F32 on both sides; the last four "
          "quantize the lm_head (llama.cpp's defaults file: token_embd Q8_0, read as the output; ours: the export's "
          "default 8-bit MatMulNBits in blocks of 32, or 4-bit g32 quantized with the layers). `last logits`: "
          "`export_llm_onnx(logits=\"last\")`, the lm_head run on the last prompt position only, as llama.cpp's "
          "prefill does (its `logits_all` off); their `ppl` is the same file's with every position's logits. "
          "Our files: q/k/v packed "
          "into one MatMulNBits whose output is GroupQueryAttention's packed query, RoPE in that op. `ppl`: each "
          "runtime's own logits on the held-out windows above (ONNX Runtime's for ours, llama.cpp's for its files):\n\n"
          + table(speed, ["runtime", "file", "MiB", "prefill_ms", "decode_tok_s", "ppl"])
          + f"\nMachine load at start (1/5/15 min): {tuple(round(x, 1) for x in load)}.\n")
    write_section("llm_llamacpp", md, {"rows": rows, "speed": speed, "threads": args.threads})
    print(md)


if __name__ == "__main__":
    main()
