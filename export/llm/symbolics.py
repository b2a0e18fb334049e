"""Fixes to the TorchScript ONNX exporter that the decomposed generation graph needs, registered
only while :func:`export.llm.onnx.export_llm_onnx` traces.

``aten::repeat_interleave`` with an int repeat count: the built-in symbolic loses the tensor's rank
when its shape is dynamic (Cohere's interleaved rotary ``repeat_interleave(freqs, 2, dim=-1)``
came out as rank 6 two ops later, and the key/value Concat then failed), so it is written here as
Unsqueeze + Expand + Reshape over the input's runtime shape, which needs no static rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

_BIG = 2**62  # a Slice end past any dimension


def _repeat_interleave(g: Any, x: Any, repeats: Any, dim: Any = None, output_size: Any = None) -> Any:
    from torch.onnx import symbolic_helper as sh
    from torch.onnx._internal.torchscript_exporter import symbolic_opset13

    r, d = sh._maybe_get_const(repeats, "i"), sh._maybe_get_const(dim, "i")
    if not isinstance(r, int) or not isinstance(d, int):  # tensor repeats or a flattened input: the built-in
        return symbolic_opset13.repeat_interleave(g, x, repeats, dim, output_size)

    def const(v: list[int]) -> Any:
        return g.op("Constant", value_t=torch.tensor(v, dtype=torch.int64))

    shape = g.op("Shape", x)

    def part(start: int, end: int) -> Any:
        return g.op("Slice", shape, const([start]), const([end]))

    # dims up to d, then r, then the rest; a negative d counts from the end (-1: nothing after it)
    head = part(0, d + 1) if d >= 0 or d < -1 else shape
    tail = part(d + 1, _BIG) if d >= 0 or d < -1 else None
    new_axis = d + 1 if d >= 0 else d
    expanded = g.op("Expand", g.op("Unsqueeze", x, const([new_axis])),
                    g.op("Concat", *[p for p in (head, const([r]), tail) if p is not None], axis_i=0))
    merged = g.op("Concat", *[p for p in (part(0, d), const([-1]), tail) if p is not None], axis_i=0)
    return g.op("Reshape", expanded, merged)


@contextlib.contextmanager
def exporter_fixes(opset: int) -> Iterator[None]:
    """Register the symbolics above for ``opset`` (a custom symbolic only wins over the built-in one
    registered at the export's own opset) and remove them afterwards."""
    torch.onnx.register_custom_op_symbolic("aten::repeat_interleave", _repeat_interleave, opset)
    try:
        yield
    finally:
        torch.onnx.unregister_custom_op_symbolic("aten::repeat_interleave", opset)
