"""Edge-ready options for exported models: fp16 float parts, graph simplification, metadata props,
and an NVIDIA Triton Inference Server model-repository layout."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import onnx
import torch
from torch import nn

from compress.core.batching import call_model
from compress.core.errors import ExportError

log = logging.getLogger(__name__)


class Float16Wrapper(nn.Module):
    """Runs ``model`` in half precision behind float32 inputs and outputs, so the exported graph
    stores fp16 weights and computes in fp16 while callers keep feeding float32."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model.half()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        def half(t: Any) -> Any:
            return t.half() if isinstance(t, torch.Tensor) and t.is_floating_point() else t

        out = call_model(self.model, {k: half(v) for k, v in kwargs.items()}) if kwargs else call_model(
            self.model, tuple(half(a) for a in args)
        )
        return _to_float(out)


def _to_float(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.float() if out.is_floating_point() else out
    if isinstance(out, Mapping) or hasattr(out, "to_tuple"):
        items = out.items() if isinstance(out, Mapping) else vars(out).items()
        return {k: _to_float(v) for k, v in items if v is not None}
    if isinstance(out, (tuple, list)):
        return type(out)(_to_float(v) for v in out)
    return out


def _constant_dequantizes(proto: onnx.ModelProto) -> int:
    """DequantizeLinear nodes reading stored codes (initializers or Constant nodes): the ones
    constant folding would turn back into float tensors."""
    consts = {i.name for i in proto.graph.initializer}
    consts.update(o for n in proto.graph.node if n.op_type == "Constant" for o in n.output)
    return sum(1 for n in proto.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in consts)


def simplify(proto: onnx.ModelProto) -> onnx.ModelProto:
    """Constant folding and dead-code removal with onnxscript's optimizer, keeping every
    DequantizeLinear of stored codes (folding a weight's DequantizeLinear would store it as float).
    An activation's Q/DQ pair whose only reader was a shape computation may go with it."""
    import onnxscript.optimizer
    from onnxscript import ir

    before = _constant_dequantizes(proto)
    try:
        model = ir.from_proto(proto)  # a copy: the fallback below stays intact
        onnxscript.optimizer.optimize_ir(model)
        _register_orphan_constants(model.graph)
        out = ir.to_proto(model)
    except Exception as exc:  # the optimizer is best effort: an unoptimized model is still correct
        log.warning("graph simplification skipped: %s", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return proto
    if _constant_dequantizes(out) < before:
        log.warning("graph simplification folded DequantizeLinear nodes; keeping the unsimplified graph")
        return proto
    dangling = _dangling_input(out)
    if dangling is not None:
        log.warning("graph simplification left input %r unproduced; keeping the unsimplified graph", dangling)
        return proto
    del out.graph.value_info[:]  # the optimizer's inferred shapes: every runtime infers its own
    return out


def _register_orphan_constants(graph: Any) -> None:
    # onnxscript 0.7 can fold a shape into a constant value that a node reads but that is neither
    # produced nor registered as an initializer (seen on LeViT's reshape_as chains)
    for node in graph:
        for v in node.inputs:
            if v is not None and v.producer() is None and v.const_value is not None and v not in graph.inputs \
                    and v.name not in graph.initializers:
                graph.register_initializer(v)


def _dangling_input(proto: onnx.ModelProto) -> str | None:
    """The first node input that no earlier node, graph input or initializer provides."""
    seen = {i.name for i in proto.graph.input} | {i.name for i in proto.graph.initializer}
    for n in proto.graph.node:
        for name in n.input:
            if name and name not in seen:
                return name
        seen.update(n.output)
    return None


def set_metadata(proto: onnx.ModelProto, props: Mapping[str, str]) -> None:
    """Set ``metadata_props`` (recipe hash, quant scheme, toolkit version ...); replaces equal keys."""
    from compress.core.version import __version__

    merged = {"compress.version": __version__, **{str(k): str(v) for k, v in props.items()}}
    keep = [p for p in proto.metadata_props if p.key not in merged]
    del proto.metadata_props[:]
    for p in keep:
        proto.metadata_props.append(p)
    for k, v in merged.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = k, v
    proto.producer_name = "compress"
    proto.producer_version = __version__


# ---- Triton Inference Server ---------------------------------------------------------------------------
_TRITON_TYPES = {
    onnx.TensorProto.FLOAT: "TYPE_FP32",
    onnx.TensorProto.FLOAT16: "TYPE_FP16",
    onnx.TensorProto.DOUBLE: "TYPE_FP64",
    onnx.TensorProto.INT64: "TYPE_INT64",
    onnx.TensorProto.INT32: "TYPE_INT32",
    onnx.TensorProto.INT8: "TYPE_INT8",
    onnx.TensorProto.UINT8: "TYPE_UINT8",
    onnx.TensorProto.BOOL: "TYPE_BOOL",
}


def _io_block(kind: str, values: Any, batched: bool) -> str:
    entries = []
    for v in values:
        t = v.type.tensor_type
        if t.elem_type not in _TRITON_TYPES:
            raise ExportError(f"Triton config: {kind} '{v.name}' has an unsupported element type {t.elem_type}")
        dims = [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim]
        if batched:
            dims = dims[1:]
        entries.append(
            f'  {{\n    name: "{v.name}"\n    data_type: {_TRITON_TYPES[t.elem_type]}\n    dims: [ {", ".join(map(str, dims))} ]\n  }}'
        )
    return f"{kind} [\n" + ",\n".join(entries) + "\n]\n"


def triton_config(model_path: Path, name: str, *, max_batch_size: int = 32, threads: int | None = None) -> str:
    """config.pbtxt text for serving ``model_path`` with Triton's onnxruntime backend."""
    m = onnx.load(str(model_path), load_external_data=False)
    inputs = [i for i in m.graph.input if i.name not in {t.name for t in m.graph.initializer}]
    batched = all(
        i.type.tensor_type.shape.dim and not i.type.tensor_type.shape.dim[0].HasField("dim_value")
        for i in [*inputs, *m.graph.output]
    )
    text = f'name: "{name}"\nbackend: "onnxruntime"\nmax_batch_size: {max_batch_size if batched else 0}\n'
    text += _io_block("input", inputs, batched) + _io_block("output", m.graph.output, batched)
    text += 'instance_group [ { kind: KIND_CPU, count: 1 } ]\n'
    if batched:
        text += "dynamic_batching { }\n"
    if threads:
        text += (
            f'parameters {{ key: "intra_op_thread_count" value: {{ string_value: "{threads}" }} }}\n'
        )
    return text


def write_triton_repository(model_path: Path, repo_dir: Path, *, name: str, max_batch_size: int = 32) -> Path:
    """Lay out ``repo_dir/name/{config.pbtxt, 1/model.onnx}`` (Triton's model repository); returns the
    model directory. Files are written atomically."""
    model_dir = repo_dir / name
    version_dir = model_dir / "1"
    try:
        version_dir.mkdir(parents=True, exist_ok=True)
        config = triton_config(model_path, name, max_batch_size=max_batch_size)
        _atomic_copy(model_path, version_dir / "model.onnx")
        data = model_path.with_name(model_path.name + ".data")
        if data.exists():
            _atomic_copy(data, version_dir / data.name)
        _atomic_text(model_dir / "config.pbtxt", config)
    except OSError as exc:
        raise ExportError(f"cannot write Triton repository '{model_dir}': {exc.strerror or exc}") from None
    return model_dir


def _atomic_copy(src: Path, dst: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _atomic_text(dst: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
