"""Graph passes over a QDQ ONNX model so that ONNX Runtime fuses it into integer kernels: weights in
the layout their consumer reads, int32 biases, no duplicate or re-quantizing Q/DQ pairs, no dead
initializers, int8 embedding tables gathered row by row (and, opt-in, int8 rows for the float tables
of Gathers)."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from export import qdq_moves
from export.qdq_ir import QdqGraph, constant_value, node_attr

log = logging.getLogger(__name__)


def _axis(node: onnx.NodeProto) -> int:
    for a in node.attribute:
        if a.name == "axis":
            return int(helper.get_attribute_value(a))
    return 1


def _set_axis(node: onnx.NodeProto, axis: int) -> None:
    for a in list(node.attribute):
        if a.name == "axis":
            node.attribute.remove(a)
    node.attribute.append(helper.make_attribute("axis", axis))


def fold_weight_transposes(g: QdqGraph) -> int:
    """``DQ(W) -> Transpose -> op`` becomes ``DQ(W^T) -> op`` so ORT sees DQ feeding the op directly."""
    done = 0
    for t in list(g.g.node):
        if t.op_type != "Transpose":
            continue
        dq = g.producer.get(t.input[0])
        if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in g.init:
            continue
        if len(g.consumers.get(dq.output[0], [])) != 1 or t.output[0] in g.outputs:
            continue
        perm = next((list(helper.get_attribute_value(a)) for a in t.attribute if a.name == "perm"), None)
        codes = g.array(dq.input[0])
        perm = perm if perm is not None else list(reversed(range(codes.ndim)))
        if len(g.consumers.get(dq.input[0], [])) != 1:
            continue
        scale = g.array(dq.input[1])
        if scale.ndim == codes.ndim and scale.ndim > 1:  # blocked: scales and zero points transpose too
            if any(len(g.consumers.get(n, [])) != 1 for n in dq.input[1:3]):
                continue
            g.set_init(dq.input[1], np.ascontiguousarray(np.transpose(scale, perm)))
            if len(dq.input) > 2 and dq.input[2]:
                g.set_init(dq.input[2], np.ascontiguousarray(np.transpose(g.array(dq.input[2]), perm)))
        g.set_init(dq.input[0], np.ascontiguousarray(np.transpose(codes, perm)))
        if scale.ndim >= 1:
            ax = _axis(dq) % codes.ndim
            _set_axis(dq, perm.index(ax))
        dq.output[0] = t.output[0]
        g.g.node.remove(t)
        g.refresh()
        done += 1
    return done


def _constant_pieces(g: QdqGraph, node: onnx.NodeProto, shape: tuple[int, ...]) -> list[tuple[int, slice]] | None:
    """For a Split or Slice with constant parameters on a tensor of ``shape``: ``(axis, slice)`` of
    each output (None when not constant or not along one axis)."""
    dim = len(shape)
    if node.op_type == "Split":
        axis = int(node_attr(node, "axis", 0)) % dim  # type: ignore[call-overload]
        if len(node.input) > 1 and node.input[1]:
            if node.input[1] not in g.init:
                return None
            sizes = [int(v) for v in g.array(node.input[1])]
        else:  # equal parts, the last one smaller (ONNX Split's num_outputs)
            parts = int(node_attr(node, "num_outputs", len(node.output)))  # type: ignore[call-overload]
            step = -(-shape[axis] // parts)
            sizes = [min(step, shape[axis] - k * step) for k in range(parts)]
        starts = np.cumsum([0, *sizes])
        return [(axis, slice(int(a), int(b))) for a, b in itertools.pairwise(starts)]
    if node.op_type == "Slice":
        args = [node.input[i] if len(node.input) > i else "" for i in range(1, 5)]
        if any(a and a not in g.init for a in args) or not args[0] or not args[1]:
            return None
        starts, ends = g.array(args[0]), g.array(args[1])
        axes = g.array(args[2]) if args[2] else np.arange(len(starts))
        steps = g.array(args[3]) if args[3] else np.ones(len(starts), dtype=np.int64)
        if len(starts) != 1:
            return None
        return [(int(axes[0]) % dim, slice(int(starts[0]), int(ends[0]), int(steps[0])))]
    return None


def fold_weight_slices(g: QdqGraph) -> int:
    """``DQ(W) -> Split/Slice -> op`` becomes ``DQ(W piece) -> op`` (per-channel scales cut along
    with the rows), and a Split/Slice of a float initializer becomes initializers: a weight sliced
    from a packed parameter (cross-attention's ``in_proj_weight.split``) then reaches its MatMul from
    a DequantizeLinear, and its bias is a constant, which is what ORT needs to fuse them."""
    done = 0
    for node in list(g.g.node):
        src = node.input[0] if node.op_type in ("Split", "Slice") and node.input else ""
        dq = g.producer.get(src)
        is_dq = dq is not None and dq.op_type == "DequantizeLinear" and all(i in g.init for i in dq.input if i)
        if not (is_dq or src in g.init) or any(o in g.outputs for o in node.output):
            continue
        data = g.array(dq.input[0] if is_dq else src)  # type: ignore[union-attr]
        pieces = _constant_pieces(g, node, data.shape)
        if pieces is None or len(pieces) != len(node.output):
            continue
        new: list[onnx.NodeProto] = []
        for out, (axis, cut) in zip(node.output, pieces):
            index = tuple(cut if d == axis else slice(None) for d in range(data.ndim))
            if not is_dq:
                g.set_init(out, np.ascontiguousarray(data[index]))
                continue
            assert dq is not None
            names = [g.unique(f"{out}_{s}") for s in ("codes", "scale", "zero_point")]
            g.set_init(names[0], np.ascontiguousarray(data[index]))
            dq_axis = _axis(dq) % data.ndim
            for k, name in zip((1, 2), names[1:]):
                if len(dq.input) <= k or not dq.input[k]:
                    continue
                arr = g.array(dq.input[k])
                g.set_init(name, np.ascontiguousarray(arr[cut]) if arr.ndim == 1 and dq_axis == axis else arr)
            attrs = {a.name: helper.get_attribute_value(a) for a in dq.attribute}
            inputs = names[: len([i for i in dq.input if i])]
            new.append(helper.make_node("DequantizeLinear", inputs, [out], name=g.unique(f"{out}_dq"), **attrs))
        idx = list(g.g.node).index(node)
        g.g.node.remove(node)
        for k, n in enumerate(new):
            g.g.node.insert(idx + k, n)
        if is_dq and dq is not None and not any(src in n.input for n in g.g.node):
            g.g.node.remove(dq)
        g.refresh()
        done += 1
    return done


def _block_size(node: onnx.NodeProto) -> int:
    return next((int(helper.get_attribute_value(a)) for a in node.attribute if a.name == "block_size"), 0)


def blocked_gemm_to_matmul(g: QdqGraph) -> int:
    """``Gemm(x, DQ_blocked(W), b, transB=1)`` -> ``MatMul(x, DQ_blocked(W^T)) + b``: ORT fuses a
    blocked DequantizeLinear into MatMulNBits only in front of a MatMul, with blocks along K."""
    done = 0
    for n in list(g.g.node):
        if n.op_type != "Gemm":
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        if attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0:
            continue
        dq = g.producer.get(n.input[1])
        if dq is None or dq.op_type != "DequantizeLinear" or not _block_size(dq) or dq.input[0] not in g.init:
            continue
        if len(g.consumers.get(dq.output[0], [])) != 1:
            continue
        if attrs.get("transB", 0):
            t_out = g.unique(f"{dq.output[0]}_t")
            transpose = helper.make_node("Transpose", [dq.output[0]], [t_out], perm=[1, 0], name=g.unique("wt"))
            g.g.node.insert(list(g.g.node).index(n), transpose)
            weight = t_out
        else:
            weight = n.input[1]
        has_bias = len(n.input) > 2 and bool(n.input[2])
        mm_out = g.unique(f"{n.output[0]}_matmul") if has_bias else n.output[0]
        nodes = [helper.make_node("MatMul", [n.input[0], weight], [mm_out], name=g.unique(f"{n.name}_matmul"))]
        if has_bias:
            nodes.append(helper.make_node("Add", [mm_out, n.input[2]], [n.output[0]], name=g.unique(f"{n.name}_bias")))
        idx = list(g.g.node).index(n)
        g.g.node.remove(n)
        for k, node in enumerate(nodes):
            g.g.node.insert(idx + k, node)
        g.refresh()
        done += 1
    return done


def pack_int4(g: QdqGraph) -> int:
    """Blocked DequantizeLinear inputs whose codes fit 4 bits -> INT4 initializers (two per byte)."""
    import ml_dtypes

    done = 0
    for n in g.g.node:
        if n.op_type != "DequantizeLinear" or not _block_size(n) or n.input[0] not in g.init:
            continue
        codes = g.array(n.input[0])
        zp = g.array(n.input[2]) if len(n.input) > 2 and n.input[2] in g.init else None
        if codes.dtype != np.int8 or codes.min() < -8 or codes.max() > 7:
            continue
        if zp is not None and (zp.min() < -8 or zp.max() > 7):
            continue
        g.set_init(n.input[0], codes.astype(ml_dtypes.int4))
        if zp is not None:
            g.set_init(n.input[2], zp.astype(ml_dtypes.int4))
        done += 1
    return done


def _same_params(g: QdqGraph, a: onnx.NodeProto, b: onnx.NodeProto) -> bool:
    try:
        sa, sb = g.array(a.input[1]), g.array(b.input[1])
        za, zb = g.array(a.input[2]), g.array(b.input[2])
    except KeyError:
        return False
    return (
        sa.shape == sb.shape
        and za.dtype == zb.dtype
        and bool(np.array_equal(sa, sb))
        and bool(np.array_equal(za, zb))
        and (sa.ndim == 0 or _axis(a) == _axis(b))
    )


def merge_duplicate_pairs(g: QdqGraph) -> int:
    """Drop redundant Q/DQ pairs: twins quantizing one tensor with equal params, and a pair that
    re-quantizes the output of an identical pair (``Q->DQ->Q'->DQ'`` with Q' == Q)."""
    removed = 0
    changed = True
    while changed:
        changed = False
        for q in list(g.g.node):
            if q.op_type != "QuantizeLinear":
                continue
            src = g.producer.get(q.input[0])
            # (a) Q'->DQ' right after a DQ with the same params: values already lie on the grid
            prev_q = g.producer.get(src.input[0]) if src is not None and src.op_type == "DequantizeLinear" else None
            twins = [
                o for o in g.consumers.get(q.input[0], [])
                if o is not q and o.op_type == "QuantizeLinear" and _same_params(g, o, q)
            ]
            victim_dq = [d for d in g.consumers.get(q.output[0], []) if d.op_type == "DequantizeLinear"]
            if len(victim_dq) != len(g.consumers.get(q.output[0], [])) or not victim_dq:
                continue
            if any(d.output[0] in g.outputs for d in victim_dq):
                continue
            keep: str | None = None
            if prev_q is not None and prev_q.op_type == "QuantizeLinear" and _same_params(g, prev_q, q) and all(
                _same_params(g, d, q) for d in victim_dq
            ):
                keep = q.input[0]
            elif twins:
                twin = twins[0]
                tw_dq = [d for d in g.consumers.get(twin.output[0], []) if d.op_type == "DequantizeLinear"]
                if tw_dq and all(_same_params(g, d, q) for d in victim_dq + tw_dq):
                    keep = tw_dq[0].output[0]
            if keep is None:
                continue
            for d in victim_dq:
                g.rewire(d.output[0], keep)
                g.g.node.remove(d)
            g.g.node.remove(q)
            g.refresh()
            removed += 1
            changed = True
            break
    return removed


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
        idx = list(g.g.node).index(n)
        g.g.node.remove(n)
        g.g.node.remove(add)
        for j, node in enumerate(new):
            g.g.node.insert(idx + j, node)
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
        shape[_axis(dqw) % codes.ndim] = -1
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


def _gather_rows(g: QdqGraph, n: onnx.NodeProto, codes: str, row_scale: str) -> None:
    """Replace the Gather ``n`` by ``Gather(codes) -> Cast -> Mul(Gather(row_scale))`` (same output)."""
    out = n.output[0]
    gq, gc, gs = (g.unique(f"{out}_{s}") for s in ("codes", "float", "scale"))
    idx = list(g.g.node).index(n)
    new = [
        helper.make_node("Gather", [codes, n.input[1]], [gq], name=g.unique(f"{n.name}_int8"), axis=0),
        helper.make_node("Cast", [gq], [gc], name=g.unique(f"{n.name}_cast"), to=onnx.TensorProto.FLOAT),
        helper.make_node("Gather", [row_scale, n.input[1]], [gs], name=g.unique(f"{n.name}_scale"), axis=0),
        helper.make_node("Mul", [gc, gs], [out], name=g.unique(f"{n.name}_dequant")),
    ]
    g.g.node.remove(n)
    for k, node in enumerate(new):
        g.g.node.insert(idx + k, node)


def quantize_embedding_tables(g: QdqGraph, *, min_numel: int = 1 << 16) -> int:
    """Large float tables read by Gather (token embeddings) -> int8 rows with one fp32 scale per row:
    ``Gather(codes) -> Cast -> Mul(Gather(scales))``. The table is most of a small transformer's file;
    per-row symmetric int8 keeps each looked-up vector within half a step of its row's scale."""
    done = 0
    for n in list(g.g.node):
        if n.op_type != "Gather" or n.input[0] not in g.init or n.input[1] in g.init:
            continue
        if any(a.name == "axis" and helper.get_attribute_value(a) != 0 for a in n.attribute):
            continue
        table = g.array(n.input[0])
        if table.dtype != np.float32 or table.ndim != 2 or table.size < min_numel:
            continue
        if len(g.consumers.get(n.input[0], [])) != 1:
            continue
        amax = np.abs(table).max(axis=1)
        scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
        codes = np.clip(np.rint(table / scale[:, None]), -127, 127).astype(np.int8)
        cn, sn = g.unique(f"{n.input[0]}_int8"), g.unique(f"{n.input[0]}_row_scale")
        g.set_init(cn, codes)
        g.set_init(sn, scale[:, None].copy())
        _gather_rows(g, n, cn, sn)
        g.g.initializer.remove(g.init[n.input[0]])
        g.refresh()
        done += 1
    return done


def gather_int8_tables(g: QdqGraph) -> int:
    """``Gather(DequantizeLinear(int8 table, per-row scale), ids)`` (an embedding quantized by the
    placement) -> ``Gather(codes, ids) -> Cast -> Mul(Gather(row scales, ids))``: the same values,
    computed for the looked-up rows only (a DequantizeLinear of the whole table would run on every
    call: ORT does not constant-fold it). A table whose codes another DequantizeLinear also reads
    (a tied lm_head) gets its own copy of the codes, so that layer's weight can still be laid out
    for its MatMul."""
    done = 0
    for n in list(g.g.node):
        if n.op_type != "Gather" or any(a.name == "axis" and helper.get_attribute_value(a) != 0 for a in n.attribute):
            continue
        dq = g.producer.get(n.input[0])
        if dq is None or dq.op_type != "DequantizeLinear" or not all(i in g.init for i in dq.input if i):
            continue
        codes, scale = g.array(dq.input[0]), g.array(dq.input[1])
        zp = g.array(dq.input[2]) if len(dq.input) > 2 and dq.input[2] else np.zeros_like(scale, dtype=np.int8)
        if codes.dtype != np.int8 or codes.ndim != 2 or scale.shape != (codes.shape[0],) or _axis(dq) % 2 != 0:
            continue
        if np.any(zp != 0) or n.input[1] in g.init:
            continue
        table = dq.input[0]
        others = [c for c in g.consumers.get(table, []) if c is not dq] + [
            c for c in g.consumers.get(dq.output[0], []) if c is not n]
        if others:
            table = g.unique(f"{dq.input[0]}_gather")
            g.set_init(table, codes)
        sn = g.unique(f"{dq.input[0]}_row_scale")
        g.set_init(sn, scale.astype(np.float32)[:, None].copy())
        _gather_rows(g, n, table, sn)
        g.refresh()
        if not g.consumers.get(dq.output[0]) and dq.output[0] not in g.outputs:
            g.g.node.remove(dq)
            g.refresh()
        done += 1
    return done


def float_weights_for_float_layers(g: QdqGraph) -> int:
    """A Conv/Gemm/MatMul that ORT will not fuse into an integer kernel keeps its fast float kernel:
    its weight becomes the dequantized float initializer instead of a DequantizeLinear, which ORT's
    float kernels cannot pre-pack (a Conv fed by a DQ weight also loses the blocked NCHWc kernel).
    ORT fuses only when the data input comes from a DequantizeLinear and, for Conv, the output goes
    to one QuantizeLinear alone. The values are the same, so the output does not change."""
    done = 0
    for n in list(g.g.node):
        if n.op_type not in ("Conv", "Gemm", "MatMul") or len(n.input) < 2:
            continue
        dqw, dqx = g.producer.get(n.input[1]), g.producer.get(n.input[0])
        if dqw is None or dqw.op_type != "DequantizeLinear" or not all(i in g.init for i in dqw.input if i):
            continue
        if any(a.name == "block_size" and helper.get_attribute_value(a) for a in dqw.attribute):
            continue
        fused = dqx is not None and dqx.op_type == "DequantizeLinear"
        if n.op_type == "Conv":
            out = n.output[0]
            outs = g.consumers.get(out, [])
            while len(outs) == 1 and outs[0].op_type in ("Relu", "Clip") and out not in g.outputs:
                out = outs[0].output[0]  # ORT removes a Relu/Clip whose range the Q after it clamps anyway
                outs = g.consumers.get(out, [])
            fused = fused and len(outs) == 1 and outs[0].op_type == "QuantizeLinear" and out not in g.outputs
        if fused:
            continue
        codes = g.array(dqw.input[0]).astype(np.float32)
        scale = g.array(dqw.input[1]).astype(np.float32)
        zp = g.array(dqw.input[2]).astype(np.float32) if len(dqw.input) > 2 and dqw.input[2] else np.zeros_like(scale)
        if scale.ndim:
            axis = next((helper.get_attribute_value(a) for a in dqw.attribute if a.name == "axis"), 1)
            shape = [1] * codes.ndim
            shape[axis % codes.ndim] = -1
            scale, zp = scale.reshape(shape), zp.reshape(shape)
        name = g.unique(f"{n.input[1]}_float")
        g.set_init(name, ((codes - zp) * scale).astype(np.float32))
        n.input[1] = name
        g.refresh()
        done += 1
    return done


def _zero_pad_spatial(g: QdqGraph, pad: onnx.NodeProto) -> list[int] | None:
    """Spatial begin/end pads of a constant-zero Pad that leaves batch and channel alone, else None."""
    if pad.op_type != "Pad" or len(pad.input) > 3 or any(
        a.name == "mode" and helper.get_attribute_value(a) not in (b"constant", "constant") for a in pad.attribute
    ):
        return None
    if len(pad.input) < 2 or pad.input[1] not in g.init:
        return None
    value = pad.input[2] if len(pad.input) == 3 else ""
    if value and (value not in g.init or np.any(g.array(value) != 0)):
        return None
    pads = [int(v) for v in g.array(pad.input[1]).reshape(-1)]
    rank = len(pads) // 2
    begin, end = pads[:rank], pads[rank:]
    if rank < 3 or begin[:2] != [0, 0] or end[:2] != [0, 0] or min(pads) < 0:
        return None
    return begin[2:] + end[2:]


def pads_into_convs(g: QdqGraph) -> int:
    """``DQ(q) -> Pad(0) -> Q -> DQ -> Conv`` (explicit "same" padding, as TF-ported models write it)
    -> ``DQ(q) -> Conv(pads += p)``. ORT runs a Pad between Q/DQ pairs in float and cannot fuse the
    conv; a quantized zero is the zero point, so padding inside QLinearConv gives the same values."""
    done = 0
    touched: list[onnx.NodeProto] = []
    for pad in list(g.g.node):
        extra = _zero_pad_spatial(g, pad)
        dq_a = g.producer.get(pad.input[0]) if extra is not None else None
        if extra is None or dq_a is None or dq_a.op_type != "DequantizeLinear":
            continue
        for q in list(g.consumers.get(pad.output[0], [])):
            if q.op_type != "QuantizeLinear" or not _same_params(g, q, dq_a):
                continue
            for dq_b in list(g.consumers.get(q.output[0], [])):
                if dq_b.op_type != "DequantizeLinear" or not _same_params(g, dq_b, dq_a):
                    continue
                for conv in list(g.consumers.get(dq_b.output[0], [])):
                    attrs = {a.name: helper.get_attribute_value(a) for a in conv.attribute}
                    if conv.op_type != "Conv" or conv.input[0] != dq_b.output[0] or attrs.get("auto_pad", b"NOTSET") not in (
                        b"NOTSET", "NOTSET"
                    ):
                        continue
                    old = list(attrs.get("pads", [0] * len(extra)))
                    if len(old) != len(extra):
                        continue
                    for a in list(conv.attribute):
                        if a.name == "pads":
                            conv.attribute.remove(a)
                    conv.attribute.append(helper.make_attribute("pads", [a + b for a, b in zip(old, extra, strict=True)]))
                    conv.input[0] = dq_a.output[0]
                    touched += [pad, q, dq_b]
                    done += 1
        g.refresh()
    for n in reversed(touched):  # readers before producers: a DQ, then its Q, then the Pad
        if n in g.g.node and not any(g.consumers.get(o) or o in g.outputs for o in n.output):
            g.g.node.remove(n)
            g.refresh()
    return done


#: deterministic ops a constant subgraph may hold (index and mask arithmetic, table gathers, layout)
_PURE = frozenset({
    "Constant", "Identity", "Gather", "Reshape", "Transpose", "Unsqueeze", "Squeeze", "Flatten", "Slice", "Concat",
    "Expand", "Tile", "Cast", "Shape", "Range", "ConstantOfShape", "Equal", "Not", "Where", "Add", "Sub", "Mul", "Div",
    "Neg", "ScatterND", "QuantizeLinear", "DequantizeLinear",
})

#: a constant subgraph is evaluated at export only up to this many input elements
_MAX_CONSTANT_NUMEL = 1 << 22


def _constant_subgraph(g: QdqGraph, name: str) -> list[onnx.NodeProto] | None:
    """The nodes computing ``name`` from initializers alone through :data:`_PURE` ops, in graph
    order (None where a graph input, a non-pure op or too large a constant is upstream)."""
    seen: dict[str, onnx.NodeProto] = {}
    stack, numel = [name], 0
    while stack:
        t = stack.pop()
        if not t or t in g.init:
            numel += int(np.prod(g.init[t].dims)) if t else 0
            continue
        node = g.producer.get(t)
        if node is None or node.op_type not in _PURE:
            return None
        if node.output[0] in seen:
            continue
        seen[node.output[0]] = node
        stack.extend(node.input)
    if not seen or numel > _MAX_CONSTANT_NUMEL:
        return None
    return [n for n in g.g.node if n.output and n.output[0] in seen]


def fold_constant_subgraphs(g: QdqGraph) -> int:
    """A quantizer's input computed from constants only (Swin's relative-position bias gathered from
    its table and permuted, a shift mask built from zeros and filled) -> one initializer, so
    :func:`fold_constant_quantize` stores its codes. The float export gets the same folding from ORT's
    optimizer; the int8 one does not, because ORT does not fold through QuantizeLinear and leaves the
    Gather/Reshape/Transpose/Unsqueeze chain running on every call."""
    from onnx.reference import ReferenceEvaluator

    done = 0
    for q in list(g.g.node):
        if q.op_type != "QuantizeLinear" or constant_value(g, q.input[0]) is not None or q.input[0] in g.outputs:
            continue
        nodes = _constant_subgraph(g, q.input[0])
        if nodes is None:
            continue
        used = {i for n in nodes for i in n.input if i in g.init}
        sub = helper.make_graph(
            nodes, "constant", [], [helper.make_tensor_value_info(q.input[0], TensorProto.UNDEFINED, None)],
            [i for i in g.g.initializer if i.name in used])
        try:
            value = ReferenceEvaluator(helper.make_model(sub, opset_imports=[helper.make_opsetid("", 21)])).run(None, {})[0]  # type: ignore[index]
        except Exception as exc:  # a subgraph the reference cannot run stays as it is
            log.debug("constant subgraph of %s not folded: %s", q.input[0], exc)
            continue
        if not isinstance(value, np.ndarray) or value.dtype != np.float32:
            continue
        g.producer[q.input[0]].output[0] = g.unique(f"{q.input[0]}_unfolded")
        g.set_init(q.input[0], value)
        g.refresh()
        done += 1
    if done:  # the chains nothing reads any more
        changed = True
        while changed:
            changed = False
            for n in list(g.g.node):
                if n.op_type in _PURE and not any(g.consumers.get(o) or o in g.outputs for o in n.output):
                    g.g.node.remove(n)
                    changed = True
            g.refresh()
    return done


_LAYOUT = frozenset({"Reshape", "Transpose", "Unsqueeze", "Squeeze", "Flatten", "Expand"})


def layout_into_constant_codes(g: QdqGraph) -> int:
    """``Unsqueeze(DQ(codes))`` (any :data:`_LAYOUT` op on a per-tensor dequantized initializer) ->
    ``DQ(Unsqueeze(codes))`` with the new codes stored: the last layout step of a constant operand
    (the bias's ``unsqueeze(0)``) then runs at export, and the add still reads a DequantizeLinear."""
    from onnx.reference import ReferenceEvaluator

    done = 0
    for n in list(g.g.node):
        if n.op_type not in _LAYOUT or not n.input:
            continue
        dq = g.producer.get(n.input[0])
        if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in g.init:
            continue
        if any(i not in g.init for i in [*dq.input[1:], *n.input[1:]] if i) or g.array(dq.input[1]).ndim:
            continue
        if len(g.consumers.get(dq.output[0], [])) != 1:
            continue
        used = [i for i in n.input if i]
        sub = helper.make_graph([helper.make_node(n.op_type, list(n.input), ["y"], **{
            a.name: helper.get_attribute_value(a) for a in n.attribute})], "layout", [],
            [helper.make_tensor_value_info("y", TensorProto.UNDEFINED, None)],
            [g.init[i] for i in used[1:]] + [numpy_helper.from_array(g.array(dq.input[0]), n.input[0])])
        try:
            codes = ReferenceEvaluator(helper.make_model(sub, opset_imports=[helper.make_opsetid("", 21)])).run(None, {})[0]  # type: ignore[index]
        except Exception as exc:  # left as it is
            log.debug("layout of %s not folded: %s", n.name, exc)
            continue
        name = g.unique(f"{dq.input[0]}_{n.op_type.lower()}")
        g.set_init(name, np.asarray(codes))
        g.g.node.remove(n)
        dq.input[0] = name
        dq.output[0] = n.output[0]
        g.refresh()
        done += 1
    return done


def fold_constant_quantize(g: QdqGraph) -> int:
    """``QuantizeLinear(constant)`` -> its integer codes as an initializer: a constant operand placed
    with a quantizer of its own (a position embedding, ``eps`` of ``var + eps``, an attention bias) is
    stored as uint8/int8 codes + DequantizeLinear, the form ORT fuses into QLinearAdd, never as a float
    copy. Codes follow ONNX's QuantizeLinear: round half to even, add the zero point, saturate."""
    done = 0
    for q in list(g.g.node):
        if q.op_type != "QuantizeLinear" or len(q.input) < 3 or q.output[0] in g.outputs:
            continue
        x, scale, zp = (constant_value(g, i) for i in q.input[:3])
        if x is None or scale is None or zp is None or x.dtype != np.float32:
            continue
        if scale.ndim:
            shape = [1] * x.ndim
            shape[_axis(q) % x.ndim] = -1
            scale, zp = scale.reshape(shape), zp.reshape(shape)
        info = np.iinfo(zp.dtype)
        with np.errstate(over="ignore"):  # a mask fill (float32's lowest) saturates to the grid's lowest code
            codes = np.clip(np.rint(x / scale.astype(np.float32)) + zp.astype(np.float32), info.min, info.max)
        out = q.output[0]
        g.g.node.remove(q)
        g.set_init(out, codes.astype(zp.dtype))
        g.refresh()
        done += 1
    if done:  # Constant nodes nothing reads any more
        for n in [n for n in g.g.node if n.op_type == "Constant" and not g.consumers.get(n.output[0])]:
            if n.output[0] not in g.outputs:
                g.g.node.remove(n)
        g.refresh()
    return done


def remove_unused_initializers(g: QdqGraph) -> int:
    used = {i for n in g.g.node for i in n.input} | g.outputs
    dead = [i for i in g.g.initializer if i.name not in used]
    for i in dead:
        g.g.initializer.remove(i)
    graph_inputs = [i for i in g.g.input if i.name in {d.name for d in dead}]
    for i in graph_inputs:
        g.g.input.remove(i)
    g.refresh()
    return len(dead)


def fold_constant_where(g: QdqGraph, shapes: Mapping[str, tuple[int | None, ...]]) -> int:
    """``Where(c, x, y)`` with a constant ``c`` that is all True (or all False) -> ``x`` (or ``y``),
    where that operand already has the output's shape. The decomposed attention's ``masked_fill`` of
    a boolean mask that masks nothing (no padding, fixed shapes) leaves such Wheres, which the float
    export's SDPA does not have."""
    done = 0
    for n in list(g.g.node):
        if n.op_type != "Where" or n.output[0] in g.outputs:
            continue
        c = constant_value(g, n.input[0])
        if c is None or c.dtype != np.bool_ or not (c.all() or not c.any()):
            continue
        pick = n.input[1] if c.all() else n.input[2]
        want = shapes.get(n.output[0])
        if want is None or shapes.get(pick) != want:
            continue
        g.rewire(n.output[0], pick)
        g.g.node.remove(n)
        g.refresh()
        done += 1
    return done


def static_shapes(model: onnx.ModelProto) -> dict[str, tuple[int | None, ...]]:
    """Each tensor's dims by ONNX shape inference (on a copy), None for a symbolic or unknown dim;
    tensors of unknown rank are left out."""
    # the exporter's value_info predates the passes that edit weights (fold_weight_slices): infer anew
    kept = list(model.graph.value_info)
    del model.graph.value_info[:]
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception as exc:  # a graph inference cannot read only loses the constant shapes
        log.debug("shape inference failed (%s): Linear outputs keep run-time shapes", exc)
        return {}
    finally:
        model.graph.value_info.extend(kept)
    out: dict[str, tuple[int | None, ...]] = {}
    g = inferred.graph
    for v in [*g.input, *g.value_info, *g.output]:
        t = v.type.tensor_type
        if t.HasField("shape"):
            out[v.name] = tuple(d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim)
    return out


def tidy_qdq_graph(model: onnx.ModelProto, *, quantize_embeddings: bool = False, ort_float_weights: bool = True) -> dict[str, int]:
    """Run the QDQ passes in place; returns how many edits each made. ``ort_float_weights``: give
    layers ORT will not fuse float weights (only for files ORT runs: other runtimes fuse otherwise)."""
    g = QdqGraph(model.graph)
    stats = {
        "int8_embedding_tables": quantize_embedding_tables(g) if quantize_embeddings else 0,
        "int8_gathers": gather_int8_tables(g),
        "constant_subgraphs": fold_constant_subgraphs(g),
        "constant_codes": fold_constant_quantize(g),
        "constant_layouts": layout_into_constant_codes(g),
        "unused_initializers": remove_unused_initializers(g),
        "weight_slices": fold_weight_slices(g),
        "blocked_gemms": blocked_gemm_to_matmul(g),
        "weight_transposes": fold_weight_transposes(g),
        "int4_weights": pack_int4(g),
        "redundant_pairs": merge_duplicate_pairs(g),
    }
    shapes = static_shapes(model)
    stats |= {
        "constant_wheres": fold_constant_where(g, shapes),
        "bias_gemms": matmul_bias_to_gemm(g, shapes),
        "pads_into_convs": pads_into_convs(g),
        # after the pads a conv absorbs: the rest of the moves between a DQ and a same-params Q
        "moves_on_codes": qdq_moves.moves_on_codes(g),
        # weight-only models (no activation Q) keep int8 weights: their point is the file size
        "float_weights": float_weights_for_float_layers(g)
        if ort_float_weights and any(n.op_type == "QuantizeLinear" for n in g.g.node) else 0,
        "int32_biases": quantize_biases(g),
    }
    stats["unused_initializers"] += remove_unused_initializers(g)
    if any(stats.values()):  # shapes of edited tensors changed: let shape inference redo them
        del model.graph.value_info[:]
    log.debug("QDQ graph passes: %s", stats)
    return stats
