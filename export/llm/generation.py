"""The recipe's ``export: {generation: true}`` for decoder LLMs: the ONNX files that generate with a
KV cache (:func:`export.llm.onnx.export_llm_onnx`) instead of the single-pass graph, and their
validation as generation: greedy tokens against the PyTorch model's, prefill latency and decode
tokens/s in ONNX Runtime, the final file against the fp32 baseline timed side by side.

The weights a file gets follow the model: weight-only 4-bit Linears as MatMulNBits (``int4``),
Linears with quantized inputs as integer ops (``w8a8``), float32 otherwise.
"""

from __future__ import annotations

import inspect
import logging
import statistics
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from compress.export.records import ExportRecord, Role, ValidationRecord, slower_note
from compress.export.specs import ExportSpec, ValidateSpec
from compress.export.validation.describe import describe_onnx
from compress.export.validation.runtimes import ort_coverage
from compress.quantization.view import is_quantized, quantizers
from torch import nn

from compress.core.errors import CompressError, ExportError
from compress.core.precision import float32_weights

log = logging.getLogger(__name__)

#: the file kind per weights: (name suffix, record format, precision)
_KINDS = {"int4": (".int4", "onnx-generation-int4", "int4"), "w8a8": (".w8a8", "onnx-generation-w8a8", "int8"),
          "fp32": (".fp32", "onnx-generation-fp32", "fp32")}


def generation_weights(model: nn.Module) -> str:
    """``"w8a8"`` when any activation is quantized, ``"int4"`` for weight-only quantized, else ``"fp32"``."""
    if not is_quantized(model):
        return "fp32"
    enabled = [q for _, q in quantizers(model) if q.enabled]
    return "w8a8" if any(q.role != "weight" for q in enabled) else "int4"


def export_generation(
    model: nn.Module, spec: ExportSpec, out_dir: Path, *, name: str = "model", baseline: nn.Module | None = None,
    metadata: Mapping[str, str] | None = None,
) -> list[ExportRecord]:
    """Write ``out_dir/NAME.{int4,w8a8,fp32}.onnx`` for ``model`` and, with ``spec.baseline``, the fp32
    ``baseline`` as ``NAME.fp32.onnx``; each file is checked in ONNX Runtime against the traced module
    and carries ``compress.role`` and ``metadata`` in its metadata_props. Beside them, the runtime
    files of the final one (:func:`export.llm.genai.write_runtime_files`: genai_config.json, config.json)."""
    from compress.export.llm.onnx import export_llm_onnx

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    jobs: list[tuple[nn.Module, str, Role]] = [(model, generation_weights(model), "final")]
    if spec.baseline and baseline is not None:
        if is_quantized(baseline):
            raise ExportError("export: the baseline model holds enabled fake-quantizers; pass the fp32 model")
        if jobs[0][1] != "fp32":  # a float final model is its own baseline
            jobs.append((baseline, "fp32", "baseline"))
    records = []
    for m, weights, role in jobs:
        suffix, fmt, precision = _KINDS[weights]
        path = export_llm_onnx(m, out_dir / f"{name}{suffix}.onnx", weights=weights,  # type: ignore[arg-type]
                               accuracy_level=spec.accuracy_level, attention=spec.attention, lm_head=spec.lm_head,
                               logits=spec.logits,
                               metadata={"compress.role": role, **(metadata or {})})
        rec = describe_onnx(path, role=role, count_integer=False)
        if weights != "fp32":  # integer ops as ORT runs the file; what stays float is named
            cov = ort_coverage(path)
            rec.integer_nodes, rec.integer_ops, rec.float_nodes = (sum(cov.integer_ops.values()), cov.integer_ops,
                                                                    cov.float_nodes)
        records.append(rec.model_copy(update={"format": fmt, "precision": precision}))
        if role == "final" and hasattr(getattr(m, "config", None), "to_dict"):
            from compress.export.llm.genai import write_runtime_files

            # genai_config.json (naming the final file), config.json, generation_config.json: the
            # folder then loads in ONNX Runtime GenAI as it is
            write_runtime_files(path, m)
        log.info("export %s: %s %s, %d bytes", role, path.name, fmt, rec.size_bytes)
    return records


def prompts_from(batches: Any, *, count: int, new_tokens: int, max_positions: int | None = None) -> np.ndarray:
    """``[count, length]`` prompt ids from the first eval windows: as long as leaves room for
    ``new_tokens`` inside the windows (and ``max_positions``, the model's context), the length the
    model was measured on."""
    rows: list[torch.Tensor] = []
    for batch in batches:
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        rows.extend(x["input_ids"] if isinstance(x, Mapping) else x)
        if len(rows) >= count:
            break
    seq = int(rows[0].numel()) if rows else 0
    length = min(seq, max_positions or seq) - new_tokens
    if length < 1:
        raise CompressError(f"validate.generate_tokens: {new_tokens} tokens leave no prompt in {seq}-token eval windows")
    return torch.stack([r[:length] for r in rows[:count]]).long().numpy()


def torch_greedy(model: nn.Module, prompts: np.ndarray, new: int) -> torch.Tensor:
    """``[B, new]`` greedy tokens of the PyTorch model with its KV cache: the argmax of each step's
    last logits, as generate_ort does (not ``model.generate``, whose generation config may suppress
    EOS before a minimum length or apply a repetition penalty)."""
    x = torch.from_numpy(prompts).long()
    mask = torch.ones_like(x)
    tokens = []
    # transformers 5 names the KV cache ``cache`` (``past_key_values`` is deprecated); 4.x the other
    params = inspect.signature(model.forward).parameters
    key = "cache" if "cache" in params else "past_key_values"
    # the last position's logits only: a prompt's full-vocabulary logits are never read (with a
    # 262k vocabulary, 4 prompts of 480 tokens would be 2 GB)
    last = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
    with torch.no_grad():
        out: Any = model(input_ids=x, attention_mask=mask, use_cache=True, **last)
        for _ in range(new):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(nxt)
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
            past = out["cache"] if "cache" in out else getattr(out, "past_key_values", None)
            out = model(input_ids=nxt, attention_mask=mask, use_cache=True, **{key: past}, **last)
    return torch.cat(tokens, dim=1)


def time_generation(gen: Any, ids: np.ndarray, new: int) -> tuple[float, float]:
    """(prefill ms, median decode ms per token) of one greedy run of ``ids`` on an OrtGenerator
    (the argmax between steps is not timed)."""
    t0 = time.perf_counter()
    logits = gen.prefill(ids)
    prefill = (time.perf_counter() - t0) * 1e3
    steps = []
    for _ in range(new):
        nxt = logits.argmax(-1).astype(np.int64)
        t0 = time.perf_counter()
        logits = gen.step(nxt)
        steps.append((time.perf_counter() - t0) * 1e3)
    return prefill, statistics.median(steps)


def validate_generation(
    records: list[ExportRecord], spec: ValidateSpec, prompts: np.ndarray, *, reference: nn.Module,
    baseline_reference: nn.Module | None,
) -> list[ValidationRecord]:
    """Each generation file in ONNX Runtime: greedy continuations of ``prompts`` against the PyTorch
    model behind it (``parity``: ``top1_agreement`` = generated tokens equal position by position,
    ``prompts_identical``), prefill and decode latency timed interleaved over ``spec.runs`` after
    ``spec.warmup`` (all figures in ``generation``; ``latency_ms``/``speedup`` hold the decode time per
    token under key 1, so ``min_speedup`` reads decode speed), and the size against the baseline file."""
    from compress.export.llm.onnx import OrtGenerator, generate_ort
    from compress.export.validation.runtimes import default_threads

    runtimes = [rt for rt in spec.runtimes if rt == "onnxruntime"]
    for rt in spec.runtimes:
        if rt != "onnxruntime":
            log.warning("validate: generation files run in onnxruntime only; runtime '%s' skipped", rt)
    if not runtimes:
        return []
    threads = spec.threads or default_threads()
    new = spec.generate_tokens
    refs = {"final": reference, "baseline": baseline_reference}
    gens = {r.role: OrtGenerator(r.path, threads=threads) for r in records}
    agreement: dict[str, dict[str, float]] = {}
    for r in records:
        ref = refs[r.role]
        if ref is None:
            continue
        with float32_weights(ref):  # the file computes in float32, a bf16 model's own rounding aside
            want = torch_greedy(ref, prompts, new)
        got = generate_ort(gens[r.role], prompts, max_new_tokens=new)[:, prompts.shape[1]:]
        agreement[r.role] = {"top1_agreement": float((got == want).float().mean()),
                             "prompts_identical": float((got == want).all(1).float().mean())}
    ids = prompts[:1]
    for _ in range(spec.warmup):
        for g in gens.values():
            time_generation(g, ids, min(new, 4))
    runs: dict[str, list[tuple[float, float]]] = {role: [] for role in gens}
    for _ in range(spec.runs):
        for role, g in gens.items():  # interleaved: each repeat times every file back to back
            runs[role].append(time_generation(g, ids, new))
    med = {role: (statistics.median(p for p, _ in v), statistics.median(d for _, d in v)) for role, v in runs.items()}
    base = next((r for r in records if r.role == "baseline"), None)
    out = []
    for r in records:
        pre, dec = med[r.role]
        b = med.get("baseline")
        out.append(ValidationRecord(
            runtime="onnxruntime", device="cpu", precision=r.precision, format=r.format, model_path=r.path,
            role=r.role, metric="greedy tokens", samples=int(prompts.shape[0]), parity=agreement.get(r.role, {}),
            latency_ms={1: dec}, speedup={1: b[1] / dec} if b is not None else None, size_bytes=r.size_bytes,
            size_ratio=r.size_bytes / base.size_bytes if base is not None else None, threads=threads,
            integer_nodes=r.integer_nodes, warmup=spec.warmup, runs=spec.runs,
            generation={"prompt_tokens": float(ids.shape[1]), "new_tokens": float(new), "prefill_ms": pre,
                        "decode_ms_per_token": dec, "tokens_per_s": 1e3 / dec,
                        **({"prefill_speedup": b[0] / pre, "decode_speedup": b[1] / dec} if b is not None else {})},
        ))
        if b is not None and r.role == "final":
            slow = {k: x for k, x in (("prefill", b[0] / pre), ("decode", b[1] / dec)) if x < 1.0}
            if slow:
                out[-1].notes.append(slower_note(r.precision, slow))
        log.info("validate %s: prefill %.1f ms, decode %.2f ms/token (%.0f tokens/s), tokens = PyTorch %s",
                 r.path.name, pre, dec, 1e3 / dec, agreement.get(r.role, {}).get("top1_agreement"))
    return out
