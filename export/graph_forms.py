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
import math

import numpy as np
import onnx
from compress.export.qdq.graph import static_shapes
from compress.export.qdq.ir import QdqGraph, constant_value, node_attr
from onnx import helper

log = logging.getLogger(__name__)


def spatial_means_to_pools(model: onnx.ModelProto) -> int:
    """Rewrite each ReduceMean over exactly the spatial dims (2 .. rank-1) of a rank >= 4 tensor as
    GlobalAveragePool (plus a Squeeze of those dims where the mean dropped them, put after the
    mean's QuantizeLinear when one reads it alone). Returns how many were rewritten; the values are
    the same.

    Rank 3 is left alone: a mean over the last dim of (batch, tokens, hidden) is a norm's statistic,
    whose ReduceMean ORT's LayerNormalization fusions look for."""
    g = QdqGraph(model.graph)
    # spatial dims of a rank >= 4 tensor are two or more: a one-axis mean (a norm's statistic, in
    # every transformer) is no candidate, and shape inference of a large graph is not free
    candidates = [(n, axes) for n in g.g.node if n.op_type == "ReduceMean"
                  and (axes := _axes(g, n)) is not None and len(axes) >= 2]
    if not candidates:
        return 0
    shapes = static_shapes(model)
    done = 0
    for n, axes in candidates:
        rank = len(shapes.get(n.input[0], ()))
        if rank < 4 or sorted(a % rank for a in axes) != list(range(2, rank)):
            continue
        out, spatial = n.output[0], shapes[n.input[0]][2:]
        readers = g.consumers.get(out, [])
        q = readers[0] if len(readers) == 1 and out not in g.outputs else None
        q = q if q is not None and q.op_type == "QuantizeLinear" else None
        image = math.prod(d for d in spatial if d is not None)
        if not _in_kernel_range(g, g.producer.get(n.input[0]), q, image, known=None not in spatial):
            continue
        keep = int(node_attr(n, "keepdims", 1))  # type: ignore[call-overload]
        pool = helper.make_node("GlobalAveragePool", [n.input[0]], [out if keep else g.unique(f"{out}_pool")],
                                name=f"{n.name}_pool")
        if keep:
            g.replace([n], [pool])
            g.refresh()
            done += 1
            continue
        squeeze_axes = g.unique(f"{n.name}_spatial_axes")
        g.set_init(squeeze_axes, np.arange(2, rank, dtype=np.int64))
        if q is not None and _scalar(g, q.input[1]) is not None:
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


def _scalar(g: QdqGraph, name: str) -> float | None:
    value = constant_value(g, name)
    return float(value.reshape(-1)[0]) if value is not None and value.size == 1 else None


#: MLAS's QLinearGlobalAveragePool refuses (raises at run time) unless input scale / (output scale x
#: image size) lies in [2^-32, 256) and the image holds under 2^24 values
_KERNEL_RATIO = (2.0**-32, 256.0)
_KERNEL_IMAGE = 2**24


def _in_kernel_range(g: QdqGraph, dq: onnx.NodeProto | None, q: onnx.NodeProto | None, image: int, *,
                     known: bool) -> bool:
    """False where ORT would fuse DQ -> GlobalAveragePool -> Q into a kernel that refuses these
    scales (a QAT-learned output scale far below the input's, say): the mean then stays ReduceMean,
    run in float between its DQ and Q, as before the rewrite. ``image``: the product of the known
    spatial dims; with some unknown, every size from it up to the kernel's limit must pass."""
    if dq is None or q is None or dq.op_type != "DequantizeLinear":
        return True  # no fusion: a float GlobalAveragePool takes any values
    sx, sy = _scalar(g, dq.input[1]), _scalar(g, q.input[1])
    if sx is None or sy is None:
        return True  # per-channel or computed scales: ORT's selector does not fuse these
    sizes = (image,) if known else (image, _KERNEL_IMAGE - 1)
    ok = all(s < _KERNEL_IMAGE and _KERNEL_RATIO[0] <= sx / (sy * s) < _KERNEL_RATIO[1] for s in sizes)
    if not ok:
        log.debug("%s: scales %g -> %g over %s values: out of QLinearGlobalAveragePool's range, kept ReduceMean",
                  dq.output[0], sx, sy, image if known else f">= {image}")
    return ok

