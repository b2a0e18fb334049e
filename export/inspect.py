"""``compress inspect MODEL.onnx``: a readable summary of an ONNX file (what it takes and returns,
its precision, size, ops, ORT's integer kernels and its metadata)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import onnx

from compress.errors import RecipeError
from export import describe


def _shape(v: onnx.ValueInfoProto) -> str:
    t = v.type.tensor_type
    dims = [str(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?") for d in t.shape.dim]
    return f"{v.name}: {onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)}[{', '.join(dims)}]"


def inspect_onnx(path: Path) -> str:
    """A multi-line description of the ONNX model at ``path``."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"{path}: file not found")
    rec = describe.describe_onnx(path)
    m = onnx.load(str(path), load_external_data=False)
    init = {t.name for t in m.graph.initializer}
    ops = Counter(n.op_type for n in m.graph.node)
    lines = [
        f"{path}: {rec.format}, opset {rec.opset}, {rec.size_bytes / 1e6:.3f} MB, "
        f"{'dynamic' if rec.dynamic_batch else 'static'} batch",
        "  inputs:  " + "; ".join(_shape(i) for i in m.graph.input if i.name not in init),
        "  outputs: " + "; ".join(_shape(o) for o in m.graph.output),
        "  ops: " + ", ".join(f"{k} x{v}" for k, v in ops.most_common()),
    ]
    if rec.integer_nodes is not None:
        kinds = ", ".join(f"{k} x{v}" for k, v in rec.integer_ops.items()) or "none: ORT runs it in float"
        lines.append(f"  integer kernels in ORT's optimized graph: {rec.integer_nodes} ({kinds})")
    if m.metadata_props:
        lines.append("  metadata: " + ", ".join(f"{p.key}={p.value}" for p in m.metadata_props))
    return "\n".join(lines)
