"""Weight passes of the QDQ graph (run by :func:`export.qdq.graph.tidy_qdq_graph`): weight
initializers in the layout and form their consumer reads. Transposes and Split/Slice cuts of a
dequantized weight fold into its codes, a blocked Gemm becomes the MatMul ORT fuses into
MatMulNBits, 4-bit codes pack two per byte, layers ORT will not fuse get float weights back, and
int8 embedding tables are gathered row by row (opt-in: int8 rows for float tables too)."""

from __future__ import annotations

import itertools

import numpy as np
import onnx
from compress.export.qdq.ir import QdqGraph, node_attr, quant_axis
from onnx import helper


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
            ax = quant_axis(dq) % codes.ndim
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
            dq_axis = quant_axis(dq) % data.ndim
            for k, name in zip((1, 2), names[1:]):
                if len(dq.input) <= k or not dq.input[k]:
                    continue
                arr = g.array(dq.input[k])
                g.set_init(name, np.ascontiguousarray(arr[cut]) if arr.ndim == 1 and dq_axis == axis else arr)
            attrs = {a.name: helper.get_attribute_value(a) for a in dq.attribute}
            inputs = names[: len([i for i in dq.input if i])]
            new.append(helper.make_node("DequantizeLinear", inputs, [out], name=g.unique(f"{out}_dq"), **attrs))
        g.replace([node], new)
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
        g.replace([n], nodes)
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


def _gather_rows(g: QdqGraph, n: onnx.NodeProto, codes: str, row_scale: str) -> None:
    """Replace the Gather ``n`` by ``Gather(codes) -> Cast -> Mul(Gather(row_scale))`` (same output)."""
    out = n.output[0]
    gq, gc, gs = (g.unique(f"{out}_{s}") for s in ("codes", "float", "scale"))
    new = [
        helper.make_node("Gather", [codes, n.input[1]], [gq], name=g.unique(f"{n.name}_int8"), axis=0),
        helper.make_node("Cast", [gq], [gc], name=g.unique(f"{n.name}_cast"), to=onnx.TensorProto.FLOAT),
        helper.make_node("Gather", [row_scale, n.input[1]], [gs], name=g.unique(f"{n.name}_scale"), axis=0),
        helper.make_node("Mul", [gc, gs], [out], name=g.unique(f"{n.name}_dequant")),
    ]
    g.replace([n], new)


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
        if codes.dtype != np.int8 or codes.ndim != 2 or scale.shape != (codes.shape[0],) or quant_axis(dq) % 2 != 0:
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
