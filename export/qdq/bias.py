"""Bias passes of the QDQ graph (run by :func:`export.qdq.graph.tidy_qdq_graph`): a Linear's
``MatMul + Add`` becomes the Gemm ORT fuses with its bias into QGemm, and float biases of layers
with dequantized inputs become int32 codes with scale ``s_x * s_w`` (weight scales raised where a
bias would overflow them), as ORT's QDQ selectors need to fuse the layer."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np
import onnx
from compress.export.qdq.ir import QdqGraph, quant_axis
from onnx import helper

log = logging.getLogger(__name__)


def matmul_bias_to_gemm(g: QdqGraph, shapes: Mapping[str, tuple[int | None, ...]] | None = None) -> int:
    """``Add(MatMul(DQ(x), DQ(W)), b)`` (a Linear on 3-D input, as the exporter writes it) ->
    ``Reshape(Gemm(DQ(Reshape(q_x, [-1, K])), DQ(W), b), [..., N])``: ORT fuses the Gemm with its bias
    into one QGemm, where the MatMul form leaves a float Add after MatMulIntegerToFloat. The reshape
    runs on the 8-bit codes, so the DequantizeLinear still feeds the Gemm directly.

    ``shapes`` (tensor -> dims, None where symbolic; :func:`static_shapes`): where at most one dim of
    ``x`` is symbolic (the batch), the output shape is a constant (``[-1, S, N]``); only where more
    are does the pass compute it at run time (Shape, Slice, Concat), which the float export does not
    have and ORT cannot fold away (the windowed-attention Swin: 16 Shape chains per 4 blocks)."""
    done = 0
    shapes = shapes or {}
    for n in list(g.g.node):
        if n.op_type != "MatMul":
            continue
        dqx, dqw = g.producer.get(n.input[0]), g.producer.get(n.input[1])
        if dqx is None or dqw is None or dqx.op_type != "DequantizeLinear" or dqw.op_type != "DequantizeLinear":
            continue
        if dqw.input[0] not in g.init or dqx.input[1] not in g.init or g.array(dqx.input[1]).ndim != 0:
            continue
        if any(a.name == "block_size" and helper.get_attribute_value(a) for a in dqw.attribute):
            continue
        w = g.array(dqw.input[0])
        cons = g.consumers.get(n.output[0], [])
        if w.ndim != 2 or len(cons) != 1 or cons[0].op_type != "Add" or n.output[0] in g.outputs:
            continue
        add = cons[0]
        bias_name = add.input[1] if add.input[0] == n.output[0] else add.input[0]
        if bias_name not in g.init or g.array(bias_name).shape != (w.shape[1],):
            continue
        k, cols = w.shape
        u = {s_: g.unique(f"{n.name}_{s_}") for s_ in ("shape", "lead", "flat", "codes2d", "x2d", "gemm", "outshape",
                                                    "k", "n", "start", "end")}
        codes = dqx.input[0]
        dq_args = list(dqx.input[1:])
        lead = shapes.get(codes, (None, None, None))[:-1]
        if len(lead) == 1:  # already 2-D: the Gemm takes the DequantizeLinear as it is
            new = [helper.make_node("Gemm", [n.input[0], n.input[1], bias_name], [add.output[0]], name=u["gemm"])]
        else:
            g.set_init(u["k"], np.array([-1, k], dtype=np.int64))
            flat = [helper.make_node("Reshape", [codes, u["k"]], [u["codes2d"]], name=u["codes2d"]),
                    helper.make_node("DequantizeLinear", [u["codes2d"], *dq_args], [u["x2d"]], name=u["x2d"]),
                    helper.make_node("Gemm", [u["x2d"], n.input[1], bias_name], [u["gemm"]], name=u["gemm"])]
            if sum(d is None for d in lead) <= 1:  # static but for one dim: a constant shape, as fp32's
                g.set_init(u["outshape"], np.array([-1 if d is None else d for d in lead] + [cols], dtype=np.int64))
                new = [*flat, helper.make_node("Reshape", [u["gemm"], u["outshape"]], [add.output[0]],
                                               name=f"{n.name}_out")]
            else:
                g.set_init(u["n"], np.array([cols], dtype=np.int64))
                g.set_init(u["start"], np.array([0], dtype=np.int64))
                g.set_init(u["end"], np.array([-1], dtype=np.int64))
                new = [
                    helper.make_node("Shape", [codes], [u["shape"]], name=u["shape"]),
                    helper.make_node("Slice", [u["shape"], u["start"], u["end"]], [u["lead"]], name=u["lead"]),
                    *flat,
                    helper.make_node("Concat", [u["lead"], u["n"]], [u["outshape"]], name=u["outshape"], axis=0),
                    helper.make_node("Reshape", [u["gemm"], u["outshape"]], [add.output[0]], name=f"{n.name}_out"),
                ]
        g.replace([n, add], new)
        g.refresh()
        done += 1
    return done


def _fit_bias_in_int32(g: QdqGraph, n: onnx.NodeProto, dqw: onnx.NodeProto, bias: np.ndarray, sx: float) -> bool:
    """An int32 bias code is ``bias / (s_x * s_w)``: a channel with near-zero weights (tiny ``s_w``)
    behind a tiny activation scale overflows it and would silently lose its bias. Raise those
    channels' weight scales until the bias fits (their weights are ~0, so the codes barely move), as
    ORT's own quantizer does. False when the weight cannot be edited: the bias then stays float."""
    limit = float(2**31 - 1)
    sw = g.array(dqw.input[1]).astype(np.float64)
    need = np.abs(bias.astype(np.float64)) / (sx * limit) * 1.001
    if sw.ndim == 0:
        need = np.asarray(need.max() if need.size else 0.0)
    if not np.any(np.abs(sw) < need):  # magnitudes: a low-bit weight scale may carry a sign
        return True
    if dqw.input[0] not in g.init or len(g.consumers.get(dqw.output[0], [])) != 1 or sw.shape != need.shape:
        log.warning("%s: its bias does not fit int32 codes at these scales; it stays float", n.name)
        return False
    codes = g.array(dqw.input[0])
    zp = g.array(dqw.input[2]).astype(np.float64) if len(dqw.input) > 2 and dqw.input[2] else np.zeros_like(sw)
    new_sw = np.where(sw < 0, -1.0, 1.0) * np.maximum(np.abs(sw), need)
    shape = [1] * codes.ndim
    if sw.ndim:
        shape[quant_axis(dqw) % codes.ndim] = -1
    info = np.iinfo(codes.dtype)
    requant = np.rint((codes - zp.reshape(shape)) * (sw / new_sw).reshape(shape)) + zp.reshape(shape)
    raised = int(np.sum(np.abs(sw) < need))
    cn, sn = g.unique(f"{dqw.input[0]}_fit"), g.unique(f"{dqw.input[1]}_fit")
    g.set_init(cn, np.clip(requant, info.min, info.max).astype(codes.dtype))
    g.set_init(sn, new_sw.astype(g.array(dqw.input[1]).dtype))
    dqw.input[0], dqw.input[1] = cn, sn
    g.refresh()
    log.warning("%s: raised the weight scale of %d channel(s) so the bias fits int32 codes", n.name, raised)
    return True


def quantize_biases(g: QdqGraph) -> int:
    """Float bias of a Conv/Gemm whose input and weight come from DequantizeLinear -> int32 codes with
    scale ``s_x * s_w`` and a DequantizeLinear (what ORT's QDQ selectors need to fuse the op)."""
    done = 0
    for n in list(g.g.node):
        if n.op_type not in ("Conv", "Gemm") or len(n.input) < 3 or n.input[2] not in g.init:
            continue
        dqx, dqw = g.producer.get(n.input[0]), g.producer.get(n.input[1])
        if dqx is None or dqw is None or dqx.op_type != "DequantizeLinear" or dqw.op_type != "DequantizeLinear":
            continue
        if dqx.input[1] not in g.init or dqw.input[1] not in g.init:
            continue
        bias = g.array(n.input[2])
        if bias.dtype != np.float32:
            continue
        sx, sw = g.array(dqx.input[1]), g.array(dqw.input[1])
        if sx.ndim != 0:
            continue
        if not _fit_bias_in_int32(g, n, dqw, bias, float(sx)):
            continue
        sw = g.array(dqw.input[1])
        scale = (sx.astype(np.float64) * sw.astype(np.float64)).astype(np.float32)
        scale = np.broadcast_to(scale, bias.shape).copy() if scale.ndim else scale
        safe = np.where(scale == 0, 1.0, scale)
        codes = np.clip(np.rint(bias / safe), -(2**31), 2**31 - 1).astype(np.int32)
        qn, sn, on = (g.unique(f"{n.input[2]}_{s}") for s in ("quantized", "scale", "dq"))
        g.set_init(qn, codes)
        g.set_init(sn, scale)
        # no zero point: it is 0 (int32 codes' default), and a per-channel one would store 4 bytes more per bias
        dq = helper.make_node("DequantizeLinear", [qn, sn], [on], name=g.unique(f"{n.name}_bias_dq"), axis=0)
        idx = list(g.g.node).index(n)
        g.g.node.insert(idx, dq)
        old = n.input[2]
        n.input[2] = on
        if not g.consumers.get(old) or g.consumers[old] == [n]:  # shared (deduplicated) biases stay for the others
            g.g.initializer.remove(g.init[old])
        g.refresh()
        done += 1
    return done
