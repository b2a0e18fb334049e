"""Standard-op forms the runtimes run faster, applied to every export (float and QDQ alike, so the
two files keep the same graph around the quantized ops).

A mean over all spatial dims of an image tensor (``AdaptiveAvgPool2d(1)``, ``x.mean((2, 3))``) leaves
the exporter as ReduceMean. ORT has no integer ReduceMean and its NHWC layout pass cannot move one,
so in a QDQ graph it runs in float between a DequantizeLinear and a QuantizeLinear, behind a
Transpose back to NCHW. As GlobalAveragePool it fuses into QLinearGlobalAveragePool, which reads the
NHWC codes the integer convolutions wrote (and fp32 runs it in the NCHWc layout of its convs).
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
from onnx import helper

from export.qdq_graph import static_shapes
from export.qdq_ir import QdqGraph, constant_value, node_attr

log = logging.getLogger(__name__)


def spatial_means_to_pools(model: onnx.ModelProto) -> int:
    """Rewrite each ReduceMean over exactly the spatial dims (2 .. rank-1) of a rank >= 4 tensor as
    GlobalAveragePool (plus a Squeeze of those dims where the mean dropped them, put after the
    mean's QuantizeLinear when one reads it alone). Returns how many were rewritten; the values are
    the same.

    Rank 3 is left alone: a mean over the last dim of (batch, tokens, hidden) is a norm's statistic,
    whose ReduceMean ORT's LayerNormalization fusions look for."""
    if not any(n.op_type == "ReduceMean" for n in model.graph.node):
        return 0  # shape inference of a large graph is not free
    shapes = static_shapes(model)
    g = QdqGraph(model.graph)
    done = 0
    for n in [n for n in g.g.node if n.op_type == "ReduceMean"]:
        rank = len(shapes.get(n.input[0], ()))
        axes = _axes(g, n)
        if rank < 4 or axes is None or sorted(a % rank for a in axes) != list(range(2, rank)):
            continue
        out = n.output[0]
        keep = int(node_attr(n, "keepdims", 1))  # type: ignore[call-overload]
        pool = helper.make_node("GlobalAveragePool", [n.input[0]], [out if keep else g.unique(f"{out}_pool")],
                                name=f"{n.name}_pool")
        if keep:
            g.replace([n], [pool])
            done += 1
            continue
        squeeze_axes = g.unique(f"{n.name}_spatial_axes")
        g.set_init(squeeze_axes, np.arange(2, rank, dtype=np.int64))
        readers = g.consumers.get(out, [])
        q = readers[0] if len(readers) == 1 and out not in g.outputs else None
        if q is not None and q.op_type == "QuantizeLinear" and _per_tensor(g, q):
            # the Squeeze moves onto the codes: DQ -> GlobalAveragePool -> Q stays one fusable group
            codes = g.unique(f"{q.output[0]}_pooled")
            squeeze = helper.make_node("Squeeze", [codes, squeeze_axes], [q.output[0]], name=f"{n.name}_squeeze")
            q.input[0] = pool.output[0]
            q.output[0] = codes
            g.replace([n], [pool])
            g.replace([q], [q, squeeze])
        else:
            squeeze = helper.make_node("Squeeze", [pool.output[0], squeeze_axes], [out], name=f"{n.name}_squeeze")
            g.replace([n], [pool, squeeze])
        g.refresh()
        done += 1
    if done:
        log.debug("ReduceMean over spatial dims -> GlobalAveragePool: %d", done)
    return done


def _axes(g: QdqGraph, n: onnx.NodeProto) -> list[int] | None:
    if len(n.input) > 1 and n.input[1]:  # opset >= 18: axes are an input
        value = constant_value(g, n.input[1])
        return None if value is None else [int(a) for a in np.atleast_1d(value)]
    attr = node_attr(n, "axes")
    return None if attr is None else [int(a) for a in attr]  # type: ignore[attr-defined]


def _per_tensor(g: QdqGraph, q: onnx.NodeProto) -> bool:
    scale = constant_value(g, q.input[1])
    return scale is not None and scale.size == 1

