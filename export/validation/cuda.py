"""CUDA validation runtime: the fake-quant model converted to the project's Triton int8 kernels,
checked for accuracy, parity and speed against the same model in fp16.

:func:`validate_cuda` measures, on the eval data, in one pass:

- accuracy (the task metric) of the fp32 reference, the reference in fp16/bf16, the fake-quant
  model and the int8 model (fp16/bf16 activations, as deployed);
- parity of the int8 model with the fake-quant model it came from, both with fp32 activations:
  only float accumulation order differs, so SQNR is high (>60 dB typical) and argmax agreement ~1
  (this copy keeps every activation quantizer; the deployed copy drops those that emulate integer
  ops CUDA runs in float, and keeps float, by timing, the layers whose kernels are slower);
- fidelity of the int8 model to fp32: SQNR, mean cosine, top-1 agreement;
- latency of the reference in fp16 and of the int8 model, timed side by side (alternating runs,
  CUDA events, median), through CUDA graphs for batches up to ``cuda_graph_max_batch`` so that
  small batches measure kernels rather than Python launch overhead.

It works on the PyTorch model (the kernels are Triton, not an ONNX runtime). On a CPU it runs only
under ``TRITON_INTERPRET=1`` with ``device="cpu"`` (tests: slow, untimed figures are meaningless).
"""

from __future__ import annotations

import copy
import functools
import logging
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from compress.core.batching import batch_size_of, call_model, primary_output, split_batch, to_device
from compress.core.errors import CompressError, ExportError
from compress.core.metrics import make_metric
from compress.core.size import state_size_bytes

log = logging.getLogger(__name__)

_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def _check_device(device: str) -> torch.device:
    from compress.quantization.lowering.kernels import interpret_mode, require_triton

    require_triton("runtime 'cuda'")
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ExportError("runtime 'cuda' needs a CUDA device; none is available")
        return dev
    if dev.type == "cpu" and interpret_mode():
        return dev
    raise ExportError(f"runtime 'cuda' runs on a CUDA device (got '{device}'; CPU only under TRITON_INTERPRET=1)")


def cast_float_layers(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast the float parameters and buffers of ``model`` to ``dtype`` in place, except those of int8
    modules and quantizers (their scales must stay float32 to keep the integer codes exact)."""
    from compress.quantization.lowering.fp8 import FP8Linear
    from compress.quantization.lowering.int8 import Int8Conv2d, Int8Linear
    from compress.quantization.lowering.w4a16 import W4A16Linear
    from compress.quantization.view import FakeQuantizer

    # float8 codes count as floating point to torch; W4A16's group scales stay float32 like int8's
    keep = (Int8Linear, Int8Conv2d, FP8Linear, W4A16Linear, FakeQuantizer)
    skip: set[int] = set()
    for m in model.modules():
        if isinstance(m, keep):
            skip.update(id(t) for t in m.modules())
    for m in model.modules():
        if id(m) in skip:
            continue
        for p in list(m.parameters(recurse=False)):
            if p.is_floating_point():
                p.data = p.data.to(dtype)
        for name, b in list(m.named_buffers(recurse=False)):
            if b is not None and b.is_floating_point():
                setattr(m, name, b.to(dtype))
    return model


def _cast_inputs(inputs: Any, dtype: torch.dtype) -> Any:
    if isinstance(inputs, torch.Tensor):
        return inputs.to(dtype) if inputs.is_floating_point() else inputs
    if isinstance(inputs, Mapping):
        return {k: _cast_inputs(v, dtype) for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(_cast_inputs(v, dtype) for v in inputs)
    return inputs


def _resize_batch(inputs: Any, n: int) -> Any:
    """``inputs`` with exactly ``n`` samples (repeating rows when the eval batch is smaller)."""
    if isinstance(inputs, torch.Tensor):
        reps = -(-n // inputs.shape[0])
        return inputs.repeat(reps, *([1] * (inputs.dim() - 1)))[:n].contiguous()
    if isinstance(inputs, Mapping):
        return {k: _resize_batch(v, n) for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(_resize_batch(v, n) for v in inputs)
    return inputs


class _Fidelity:
    """Running comparison of a model's outputs against a reference's: SQNR, cosine, agreement."""

    def __init__(self) -> None:
        self.signal = self.noise = self.cos = 0.0
        self.max_abs = 0.0
        self.rows = self.agree = 0

    def update(self, ref: torch.Tensor, out: torch.Tensor) -> None:
        r, o = ref.detach().double().reshape(ref.shape[0], -1), out.detach().double().reshape(out.shape[0], -1)
        self.signal += float(r.pow(2).sum())
        self.noise += float((r - o).pow(2).sum())
        self.max_abs = max(self.max_abs, float((r - o).abs().max()) if r.numel() else 0.0)
        self.cos += float(torch.nn.functional.cosine_similarity(r, o, dim=1, eps=1e-12).sum())
        self.rows += r.shape[0]
        if ref.dim() == 2 and ref.shape[-1] > 1:  # logits: top-1 agreement
            self.agree += int((ref.argmax(-1) == out.argmax(-1)).sum())

    def result(self, *, classify: bool) -> dict[str, float | None]:
        sqnr = 10.0 * torch.log10(torch.tensor(self.signal / max(self.noise, 1e-300))).item() if self.rows else None
        return {
            "sqnr_db": sqnr,
            "cosine": self.cos / self.rows if self.rows else None,
            "max_abs_diff": self.max_abs,
            "top1_agreement": self.agree / self.rows if classify and self.rows else None,
        }


def _graphed(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` captured in a CUDA graph (warm-up, Triton autotuning included, happens first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def time_side_by_side(
    fns: Mapping[str, Callable[[], Any]], *, warmup: int, runs: int, device: torch.device, graphs: bool
) -> tuple[dict[str, float], bool]:
    """Median milliseconds of each function, runs alternating between them; whether graphs were used."""
    used = False
    if device.type == "cuda" and graphs:
        try:
            fns = {k: _graphed(f) for k, f in fns.items()}  # replaces the mapping, never mutates it
            used = True
        except Exception as exc:  # an op that cannot be captured: time eagerly rather than fail
            log.warning("CUDA graph capture failed (%s); timing eagerly", exc)
    for _ in range(warmup):
        for f in fns.values():
            f()
    times: dict[str, list[float]] = {k: [] for k in fns}
    order = list(fns)
    for i in range(runs):
        for k in order if i % 2 == 0 else reversed(order):  # alternate who goes first
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fns[k]()
                end.record()
                end.synchronize()
                times[k].append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fns[k]()
                times[k].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}, used


def validate_cuda(
    model: nn.Module,
    *,
    eval_loader: Iterable[Any],
    reference: nn.Module,
    batch_sizes: Sequence[int] = (1, 32),
    warmup: int = 5,
    runs: int = 20,
    metric: str | None = "accuracy",
    eval_samples: int | None = None,
    dtype: torch.dtype = torch.float16,
    cuda_graph_max_batch: int = 32,
    device: str = "cuda",
    speed_check: bool = True,
) -> dict[str, Any]:
    """Convert the fake-quant ``model`` to int8 kernels and validate it against ``reference`` (fp32).

    Two conversions: one that keeps every placed activation quantizer (``parity``: the kernels
    against the fake-quant model, exact up to accumulation order) and the deployed one, whose
    accuracy, fidelity and latency are reported: the activation quantizers that only emulate
    integer ops CUDA runs in float are dropped, and with ``speed_check`` every layer whose kernel is
    slower than ``dtype`` at the shape of the first eval batch stays float, named with both times.

    ``metric`` names a compress metric (None: fidelity only); ``dtype`` is the deployed activation
    type of both the float baseline and the int8 model. Returns a JSON-ready dict: ``accuracy``
    (fp32, the half dtype, fakequant, int8), ``accuracy_drop``, ``parity`` (int8 vs fake-quant),
    ``fidelity`` (int8 vs fp32), ``latency`` rows ``{batch, float_ms, int8_ms, speedup, cuda_graphs}``,
    ``min_speedup``, ``size`` and the per-layer ``conversion``. Neither input model is modified.
    """
    from compress.quantization.lowering.convert import convert_with_report

    dev = _check_device(device)
    if dtype not in _DTYPE_NAMES:
        raise CompressError(f"validate_cuda: dtype must be float16, bfloat16 or float32 (got {dtype})")
    if not batch_sizes or min(batch_sizes) < 1:
        raise CompressError(f"validate_cuda: batch_sizes must be positive (got {list(batch_sizes)})")
    half = _DTYPE_NAMES[dtype]
    fq = copy.deepcopy(model).to(dev).eval()
    ref32 = copy.deepcopy(reference).to(dev).eval()
    i8_32, capable = convert_with_report(fq, placed="fuse")
    i8_32 = i8_32.to(dev).eval()
    example = None
    if speed_check and dev.type == "cuda":
        example = split_batch(to_device(next(iter(eval_loader)), dev))[0]
    deployed, report = convert_with_report(fq, placed="drop", speed_check=example, speed_dtype=dtype)
    i8_h = cast_float_layers(deployed.to(dev), dtype).eval()
    ref_h = copy.deepcopy(ref32).to(dtype).eval()
    converted = [r for r in report if r.converted and r.kind == "layer"]
    if not any(r.converted for r in capable):
        raise ExportError("runtime 'cuda': no layer of the model could be converted to int8 kernels")
    models: dict[str, nn.Module] = {"fp32": ref32, **({half: ref_h} if half != "fp32" else {}), "fakequant": fq, "int8": i8_h, "int8_fp32": i8_32}
    metrics = {k: make_metric(metric) for k in models if k != "int8_fp32"} if metric else {}
    parity, fidelity, fidelity_h = _Fidelity(), _Fidelity(), _Fidelity()
    classify = True
    seen = 0
    first_inputs: Any = None
    with torch.no_grad():
        for batch in eval_loader:
            if eval_samples is not None and seen >= eval_samples:
                break
            inputs, targets = split_batch(to_device(batch, dev))
            first_inputs = inputs if first_inputs is None else first_inputs
            outs = {}
            for k, m in models.items():
                x = _cast_inputs(inputs, dtype) if k in (half, "int8") else inputs
                outs[k] = call_model(m, x)
            ref_out = primary_output(outs["fp32"]).float()
            classify = classify and ref_out.dim() == 2
            parity.update(primary_output(outs["fakequant"]).float(), primary_output(outs["int8_fp32"]).float())
            fidelity.update(ref_out, primary_output(outs["int8"]).float())
            if half in outs:
                fidelity_h.update(ref_out, primary_output(outs[half]).float())
            for k, mt in metrics.items():
                if mt.needs_targets and targets is None:
                    raise CompressError(f"validate_cuda: metric '{metric}' needs labelled eval data")
                mt.update(outs[k], targets, inputs=inputs, reference=outs["fp32"])
            seen += batch_size_of(inputs)
    if first_inputs is None:
        raise CompressError("validate_cuda: the eval data is empty")
    accuracy = {k: mt.compute() for k, mt in metrics.items()}
    latency = []
    for b in batch_sizes:
        x = _cast_inputs(_resize_batch(first_inputs, b), dtype)
        fns: dict[str, Callable[[], Any]] = {
            "float": functools.partial(call_model, ref_h, x),
            "int8": functools.partial(call_model, i8_h, x),
        }
        with torch.no_grad():
            ms, graphs = time_side_by_side(
                fns, warmup=warmup, runs=runs, device=dev, graphs=b <= cuda_graph_max_batch
            )
        latency.append({
            "batch": b, "float_ms": ms["float"], "int8_ms": ms["int8"], "speedup": ms["float"] / ms["int8"],
            "cuda_graphs": graphs,
        })
        log.info("cuda b=%d: %s %.3f ms, int8 %.3f ms (%.2fx)", b, half, ms["float"], ms["int8"], latency[-1]["speedup"])
    size_i8, size_32 = state_size_bytes(i8_h), state_size_bytes(ref32)
    return {
        "runtime": "cuda",
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (TRITON_INTERPRET)",
        "float_dtype": half,
        "samples": seen,
        "metric": metric,
        "accuracy": accuracy,
        "accuracy_drop": accuracy["fp32"] - accuracy["int8"] if accuracy else None,
        "parity": parity.result(classify=classify),
        "fidelity": {"int8": fidelity.result(classify=classify), half: fidelity_h.result(classify=classify)},
        "latency": latency,
        "min_speedup": min(r["speedup"] for r in latency),
        "size": {"int8_bytes": size_i8, "fp32_bytes": size_32, "ratio": size_i8 / max(size_32, 1)},
        "conversion": {
            "int8_layers": len(converted),
            "float_layers": [{"name": r.name, "type": r.quant_type, "reason": r.reason} for r in report
                             if not r.converted and r.kind == "layer"],
            "fused_norms": sum(r.converted for r in report if r.kind == "norm"),
            "norms_kept": [{"name": r.name, "type": r.quant_type, "reason": r.reason} for r in report
                           if not r.converted and r.kind == "norm"],
            "fused_activations": {r.name: r.activation for r in converted if r.activation != "none"},
        },
    }
