"""Half-precision models (how LLMs are loaded) widened to float32 where float32 is what counts:
an ONNX export (ORT's CPU kernels and Q/DQ scales are float32), the reference a file is validated
against, and the numerical proofs of scale folds (bf16 rounding would hide whether a fold is exact)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

log = logging.getLogger(__name__)

HALF = (torch.bfloat16, torch.float16)


@contextlib.contextmanager
def float32_weights(model: nn.Module) -> Iterator[bool]:
    """``model``'s bf16/fp16 parameters and buffers widened to float32 in place inside the block and
    given back their dtypes after (bf16/fp16 -> float32 -> back is exact). Yields whether anything
    was widened."""
    params = [(p, p.dtype) for p in model.parameters() if p.dtype in HALF]
    buffers = [(m, name, b.dtype) for m in model.modules() for name, b in m._buffers.items()
               if b is not None and b.dtype in HALF]
    if not params and not buffers:
        yield False
        return
    log.info("%d bf16/fp16 tensors of %s widened to float32", len(params) + len(buffers), type(model).__name__)
    for p, _ in params:
        p.data = p.data.float()
    for m, name, _ in buffers:
        m._buffers[name] = m._buffers[name].float()  # type: ignore[union-attr]
    try:
        yield True
    finally:
        for p, dtype in params:
            p.data = p.data.to(dtype)
        for m, name, dtype in buffers:
            m._buffers[name] = m._buffers[name].to(dtype)  # type: ignore[union-attr]


def float32_inputs(inputs: Any) -> Any:
    """``inputs`` (any nesting of tensors) with bf16/fp16 tensors cast to float32."""
    return pytree.tree_map(lambda t: t.float() if isinstance(t, torch.Tensor) and t.dtype in HALF else t, inputs)
