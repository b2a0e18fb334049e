"""Parameter and MAC counts measured on a model (conv, linear, matmul, attention), per sample."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from compress.batching import batch_size_of, call_model
from pruning.observe import ObserverMode


def count_params(model: nn.Module) -> int:
    """Number of parameters (tied parameters once)."""
    return sum(p.numel() for p in model.parameters())


class _MacCounter(ObserverMode):
    def __init__(self) -> None:
        super().__init__()
        self.macs = 0

    def observe(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        name = getattr(func, "__name__", "")
        # an unusual call signature is not a MAC op we count
        with contextlib.suppress(IndexError, TypeError, AttributeError, RuntimeError):
            self.macs += _macs(name, args, kwargs, out)


def _macs(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    if name in ("conv1d", "conv2d", "conv3d"):
        w = args[1] if len(args) > 1 else kwargs["weight"]
        return int(out.numel() * w[0].numel())
    if name.startswith("conv_transpose"):
        x, w = args[0], args[1] if len(args) > 1 else kwargs["weight"]
        return int(x.numel() * w[0].numel())
    if name == "linear":
        w = args[1] if len(args) > 1 else kwargs["weight"]
        return int(out.numel() * w.shape[1])
    if name == "addmm":
        return int(out.numel() * args[1].shape[-1])
    if name in ("matmul", "mm", "bmm", "__matmul__", "__rmatmul__"):
        a, b = (args[1], args[0]) if name == "__rmatmul__" else (args[0], args[1])
        if a.dim() < 2 or b.dim() < 2:
            return int(a.numel() if a.dim() == 1 else b.numel())
        return int(out.numel() * a.shape[-1])
    if name == "scaled_dot_product_attention":
        q, k, v = args[:3]
        batch = math.prod(q.shape[:-2])
        return int(batch * q.shape[-2] * k.shape[-2] * (q.shape[-1] + v.shape[-1]))
    if name == "multi_head_attention_forward":
        q, k = args[0], args[1]
        e = q.shape[-1]
        w_in = args[5] if len(args) > 5 else kwargs.get("in_proj_weight")
        w_out = args[11] if len(args) > 11 else kwargs.get("out_proj_weight")
        if w_in is None or w_out is None:
            return 0
        inner = w_in.shape[0] // 3
        tq, tk = q.numel() // e, k.numel() // e
        heads_batch = q.shape[1] if q.dim() == 3 else 1
        per = (tq // heads_batch) * (tk // heads_batch) * heads_batch
        return int((tq + 2 * tk) * inner * e + tq * inner * w_out.shape[0] + 2 * per * inner)
    return 0


def count_macs(model: nn.Module, example_inputs: Any) -> int:
    """Multiply-accumulates of one forward pass, divided by the batch size (MACs per sample)."""
    counter = _MacCounter()
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), counter:
            call_model(model, example_inputs)
    finally:
        model.train(was_training)
    return counter.macs // max(1, batch_size_of(example_inputs))
