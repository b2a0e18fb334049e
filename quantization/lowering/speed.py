"""The converter's speed check: a layer whose integer kernel is slower than the float layer it replaces,
at the shape the model feeds it, stays float (fp16/bf16 on the GPU) and says why.

Per-kernel speed is not end-to-end speed: on an H100 int8 convolutions ran 0.30-0.98x of cuDNN fp16
at ResNet-50 shapes while the GEMMs ran 1.4-1.8x (benchmarks/RESULTS.md). The check times, on the
device, the converted module (activation quantization included) against ``mod.to_float()`` in the
deployed dtype, both replayed as CUDA graphs (what a deployed model runs), on the input shape each
layer saw in one forward of the example inputs. A keep-float decision is made per layer and shape,
once; the reason names both times.
"""

from __future__ import annotations

import copy
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)


def layer_input_shapes(model: nn.Module, names: list[str], example: Any) -> dict[str, tuple[int, ...]]:
    """The shape of the first input each named layer receives in one forward of ``example``."""
    from compress.core.batching import call_model

    shapes: dict[str, tuple[int, ...]] = {}
    handles = []
    for name in names:
        def hook(_m: nn.Module, args: tuple[Any, ...], name: str = name) -> None:
            if args and isinstance(args[0], torch.Tensor) and name not in shapes:
                shapes[name] = tuple(args[0].shape)

        handles.append(model.get_submodule(name).register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            call_model(model, example)
    finally:
        for h in handles:
            h.remove()
    return shapes


def _graph_ms(fn: Callable[[], Any], device: torch.device, runs: int = 20) -> float:
    """Median milliseconds of ``fn`` replayed as a CUDA graph (on CPU: wall clock of eager calls)."""
    if device.type != "cuda":
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up: Triton compiles and tunes here, outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    out = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    return statistics.median(out)


def time_layers(quantized: nn.Module, floating: nn.Module, shape: tuple[int, ...], dtype: torch.dtype,
                device: torch.device) -> tuple[float, float]:
    """``(quantized_ms, float_ms)`` of the two modules on one random input of ``shape`` in ``dtype``."""
    x = torch.randn(shape, device=device, dtype=dtype)
    if x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)  # both sides' fast layout on CUDA
        floating = floating.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    with torch.no_grad():
        q_ms = _graph_ms(lambda: quantized(x), device)
        f_ms = _graph_ms(lambda: floating(x), device)
    return q_ms, f_ms


def keep_float_reason(name: str, quantized: nn.Module, mod: Any, shape: tuple[int, ...], dtype: torch.dtype,
                      timer: Callable[..., tuple[float, float]] | None = None) -> str | None:
    """Why ``name`` should stay float (its kernel is slower than ``mod.to_float()`` in ``dtype`` at
    ``shape``), or None when the quantized module is at least as fast."""
    device = next(iter(quantized.buffers())).device
    # to_float() shares the fake-quant layer's parameters: cast a copy, never the model's weights
    floating = copy.deepcopy(mod.to_float()).to(device=device, dtype=dtype).eval()
    q_ms, f_ms = (timer or time_layers)(quantized, floating, shape, dtype, device)
    name_dt = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}.get(dtype, str(dtype))
    log.info("speed check %s %s: quantized %.4f ms, %s %.4f ms", name, list(shape), q_ms, name_dt, f_ms)
    if q_ms <= f_ms:
        return None
    return (f"speed check: its kernel took {q_ms:.4f} ms where {name_dt} took {f_ms:.4f} ms "
            f"({f_ms / q_ms:.2f}x) at input {list(shape)}")
