"""Graph passes over a QDQ ONNX model so that ONNX Runtime fuses it into integer kernels: weights in
the layout their consumer reads, int32 biases, no duplicate or re-quantizing Q/DQ pairs, no dead
initializers, int8 embedding tables gathered row by row (and, opt-in, int8 rows for the float tables
of Gathers). :func:`tidy_qdq_graph` runs them in order; the passes themselves live by what they edit:
export/qdq/weights.py, export/qdq/constants.py, export/qdq/pairs.py, export/qdq/bias.py and
export/qdq/moves.py."""

from __future__ import annotations

import logging

import onnx
from compress.export.qdq import moves
from compress.export.qdq.bias import matmul_bias_to_gemm, quantize_biases
from compress.export.qdq.constants import (
    fold_constant_quantize,
    fold_constant_subgraphs,
    fold_constant_where,
    layout_into_constant_codes,
    remove_unused_initializers,
)
from compress.export.qdq.ir import QdqGraph
from compress.export.qdq.pairs import merge_duplicate_pairs, pads_into_convs
from compress.export.qdq.weights import (
    blocked_gemm_to_matmul,
    float_weights_for_float_layers,
    fold_weight_slices,
    fold_weight_transposes,
    gather_int8_tables,
    pack_int4,
    quantize_embedding_tables,
)

log = logging.getLogger(__name__)


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
        "moves_on_codes": moves.moves_on_codes(g),
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
