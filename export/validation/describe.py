"""Helpers for validating ONNX files given from outside a run: what a file holds (an ExportRecord),
a reference ONNX model run as a module, and the data to validate on."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from compress.export.records import DECOMPOSED_KEY, ExportRecord, Role
from compress.export.validation.runtimes import OrtSession, default_threads, ort_coverage, run_session
from torch import nn

from compress.core.errors import CompressError, DataError, RecipeError

log = logging.getLogger(__name__)


def file_size(path: Path) -> int:
    """Bytes of the model file plus its external-data file, if any."""
    data = path.with_name(path.name + ".data")
    return path.stat().st_size + (data.stat().st_size if data.exists() else 0)


def describe_onnx(path: Path, *, role: Role = "final", count_integer: bool = True) -> ExportRecord:
    """An ExportRecord for an ONNX file: precision from its ops and initializers, the integer
    kernels of ORT's optimized graph for QDQ models."""
    if not path.is_file():
        raise CompressError(f"model file '{path}' not found")
    try:
        m = onnx.load(str(path), load_external_data=False)
    except Exception as exc:
        raise RecipeError(f"'{path}' is not a readable ONNX model: {str(exc).splitlines()[0]}") from None
    check_io(m, path)
    ops = {n.op_type for n in m.graph.node}
    qdq = "DequantizeLinear" in ops or "QuantizeLinear" in ops
    fp16 = any(t.data_type == onnx.TensorProto.FLOAT16 for t in m.graph.initializer)
    nbits = "MatMulNBits" in ops  # ORT's int4 weight-only layers (LLM exports)
    precision = "int8" if qdq else ("int4" if nbits else ("fp16" if fp16 else "fp32"))
    fmt = {"int8": "onnx-int8-qdq", "int4": "onnx-int4-matmulnbits", "fp16": "onnx-fp16", "fp32": "onnx-fp32"}[precision]
    if qdq and fp16:
        fmt += "-fp16"
    cov = ort_coverage(path) if (qdq or nbits) and count_integer else None
    ints, int_ops = (sum(cov.integer_ops.values()), cov.integer_ops) if cov is not None else (None, {})
    init = {t.name for t in m.graph.initializer}
    inputs = [i for i in m.graph.input if i.name not in init]
    dyn = all(i.type.tensor_type.shape.dim and not i.type.tensor_type.shape.dim[0].HasField("dim_value") for i in inputs)
    opset = next((o.version for o in m.opset_import if o.domain in ("", "ai.onnx")), None)
    floats = cov.float_nodes if cov is not None else []
    return ExportRecord(
        path=path, format=fmt, role=role, precision=precision, size_bytes=file_size(path), integer_nodes=ints,
        integer_ops=int_ops, float_nodes=floats, opset=opset, dynamic_batch=dyn, inputs=[i.name for i in inputs],
        outputs=[o.name for o in m.graph.output], kept_float=_decomposed_reasons(m, floats),
        reduce_range=_weights_7bit(m) if qdq else None,
    )


def _weights_7bit(m: onnx.ModelProto) -> bool | None:
    """Whether every int8 weight feeding a DequantizeLinear fits 7 bits ([-64, 63]: the codes of
    ``reduce_range``, exact in ORT's u8s8 kernels on CPUs without VNNI); None when no weight is
    stored inline (external data is not read here)."""
    from onnx import numpy_helper

    init = {t.name: t for t in m.graph.initializer}
    seen = False
    for n in m.graph.node:
        t = init.get(n.input[0]) if n.op_type == "DequantizeLinear" and n.input else None
        if t is None or t.data_type != onnx.TensorProto.INT8 or t.data_location == onnx.TensorProto.EXTERNAL:
            continue
        codes = numpy_helper.to_array(t)
        if codes.size < 16:  # a bias or a scalar: not a GEMM weight
            continue
        seen = True
        if codes.min() < -64 or codes.max() > 63:
            return False
    return True if seen else None


def _decomposed_reasons(m: onnx.ModelProto, float_nodes: list[str]) -> dict[str, str]:
    """The float nodes the exporter made as part of another torch op, with that reason."""
    raw = next((p.value for p in m.metadata_props if p.key == DECOMPOSED_KEY), None)
    try:
        made: dict[str, str] = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    out = {}
    for entry in float_nodes:
        node = entry.split(":", 1)[-1]
        if node in made:
            out[f"ONNX {entry}"] = (f"part of {made[node]} as the exporter writes it: float as that op is in any "
                                    "placement (not a layer or an add of the model)")
    return out


class OnnxModule(nn.Module):
    """An ONNX model run by onnxruntime behind a module interface (a reference for parity)."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self.session = OrtSession(path, default_threads())

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        from compress.export.validation.parity import to_numpy_feeds

        inputs: Any = kwargs if kwargs else (args[0] if len(args) == 1 else args)
        feeds = to_numpy_feeds(inputs, self.session.input_names)
        return torch.from_numpy(np.ascontiguousarray(run_session(self.session, feeds)[0]))


def check_io(m: onnx.ModelProto, path: Path, *, where: str | None = None) -> None:
    """RecipeError (exit 2) naming the file when its graph takes no inputs (initializers aside) or
    returns no outputs: such a file has nothing to feed or nothing to compare, time or serve.
    ``where`` prefixes the message (the argument that named the file)."""
    at = f"{where}: " if where else ""
    init = {t.name for t in m.graph.initializer}
    if not any(i.name not in init for i in m.graph.input):
        raise RecipeError(f"{at}'{path}' is an ONNX model without inputs (its graph computes constants only): "
                          "nothing to feed it; export the model with its inputs")
    if not m.graph.output:
        raise RecipeError(f"{at}'{path}' is an ONNX model without outputs: nothing to compare or time; "
                          "export the model with its outputs")


def onnx_reference(path: Path, *, model: Path | None = None) -> OnnxModule:
    """``path`` run in onnxruntime as a module; with ``model``, its outputs must be shaped like the
    model's (a reference of another task cannot measure parity)."""
    if not path.is_file():
        raise CompressError(f"reference model '{path}' not found")
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as exc:
        raise RecipeError(f"reference: '{path}' is not a readable ONNX model: {str(exc).splitlines()[0]}") from None
    check_io(proto, path, where="reference")
    if model is not None:
        ours, theirs = _io_shapes(model)[1], _io_shapes(path)[1]
        if ours and theirs and not _fits(theirs[0][1], ours[0][1]):
            raise DataError(
                f"--reference {path}: its output '{theirs[0][0]}' has shape {_show(theirs[0][1])}, the model's "
                f"'{ours[0][0]}' has {_show(ours[0][1])}; a reference must compute the same outputs"
            )
    return OnnxModule(path)


Dims = list[int | str]


def _io_shapes(path: Path) -> tuple[list[tuple[str, Dims]], list[tuple[str, Dims]]]:
    """(name, dims) of a model's graph inputs (initializers excluded) and outputs, from one read of
    the file; symbolic dims as their names."""
    m = onnx.load(str(path), load_external_data=False)
    init = {t.name for t in m.graph.initializer}

    def dims(v: Any) -> Dims:
        return [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in v.type.tensor_type.shape.dim]

    return ([(v.name, dims(v)) for v in m.graph.input if v.name not in init],
            [(v.name, dims(v)) for v in m.graph.output])


def _fits(shape: Any, dims: Dims) -> bool:
    """Whether a concrete ``shape`` fits ``dims`` (same rank, equal wherever both are fixed)."""
    shape = list(shape)
    return len(shape) == len(dims) and all(
        not isinstance(d, int) or not isinstance(s, int) or d == 0 or s == 0 or d == s for s, d in zip(shape, dims)
    )


def _show(dims: Any) -> str:
    return "[" + ", ".join(str(d) for d in dims) + "]"


def check_eval_batches(data: Any, model_path: Path, *, eval_samples: int | None) -> Any:
    """``data`` checked to be an iterable of ``(inputs, targets)`` eval batches (data source names
    are resolved on compress's side: ``compress.validate``); each batch is then checked against the
    model's inputs as it is read (DataError naming the input and both shapes), and labels the
    model's output cannot predict are warned about once."""
    if isinstance(data, (str, bytes)) or not hasattr(data, "__iter__"):
        raise CompressError(
            f"validate: data must be an iterable of (inputs, targets) batches, not {type(data).__name__} "
            "(compress.validate also takes a data source name such as 'digits')"
        )
    return _CheckedBatches(data, model_path)


class _CheckedBatches:
    """Re-iterable view of eval batches that checks each against the model's declared inputs."""

    def __init__(self, data: Any, model_path: Path) -> None:
        self.data = data
        self.model_path = model_path
        self.inputs, outputs = _io_shapes(model_path)
        last = outputs[0][1][-1] if outputs and outputs[0][1] else None
        # a classifier's class count: the first output's last dim, when static and > 1
        self.classes = last if isinstance(last, int) and last > 1 and len(outputs[0][1]) == 2 else None
        self.warned = False

    def __len__(self) -> int:
        return len(self.data)

    def __iter__(self) -> Iterator[Any]:
        for batch in self.data:
            self._check(batch)
            yield batch

    def _check(self, batch: Any) -> None:
        inputs, targets = (batch[0], batch[1]) if isinstance(batch, (tuple, list)) and len(batch) == 2 else (batch, None)
        tensors = (
            [inputs[n] for n, _ in self.inputs if n in inputs] if isinstance(inputs, dict)
            else [inputs] if hasattr(inputs, "shape") else list(inputs) if isinstance(inputs, (tuple, list)) else []
        )
        for (name, dims), t in zip(self.inputs, tensors):
            # the batch dim is free: validation cuts batches to a static-batch model's size
            if hasattr(t, "shape") and (len(t.shape) != len(dims) or not _fits(tuple(t.shape)[1:], dims[1:])):
                raise DataError(
                    f"validate data: input '{name}' of {self.model_path.name} takes shape {_show(dims)}, the data "
                    f"gives {_show(tuple(t.shape))}; use a data source of the model's input shape"
                )
        if self.classes is not None and torch.is_tensor(targets) and not targets.is_floating_point() \
                and targets.numel() and not self.warned and int(targets.max()) >= self.classes:
            self.warned = True
            log.warning(
                "validate data: label %d but %s predicts %d classes: the data's label set does not fit the "
                "model, accuracy is not meaningful", int(targets.max()), self.model_path.name, self.classes,
            )


_ONNX_TO_NUMPY = {
    onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.FLOAT16: np.float16, onnx.TensorProto.INT64: np.int64,
    onnx.TensorProto.INT32: np.int32, onnx.TensorProto.BOOL: np.bool_, onnx.TensorProto.UINT8: np.uint8,
}


def random_batches(path: Path, *, batches: int = 4, batch: int = 8, seq: int = 16, seed: int = 0) -> Iterator[Any]:
    """Random inputs shaped like the model's (symbolic dims: ``batch``, then ``seq``), no targets;
    integer inputs are token ids below 100 and masks of ones."""
    m = onnx.load(str(path), load_external_data=False)
    init = {t.name for t in m.graph.initializer}
    rng = np.random.default_rng(seed)
    specs = []
    for i in m.graph.input:
        if i.name in init:
            continue
        t = i.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else (batch if k == 0 else seq) for k, d in enumerate(t.shape.dim)]
        specs.append((i.name, dims, _ONNX_TO_NUMPY.get(t.elem_type, np.float32)))
    out = []
    for _ in range(batches):
        feeds: dict[str, torch.Tensor] = {}
        for name, dims, dt in specs:
            arr: np.ndarray
            if np.issubdtype(dt, np.floating):
                arr = rng.standard_normal(dims).astype(dt)
            elif "mask" in name or dt == np.bool_:
                arr = np.ones(dims, dtype=dt)
            elif "type" in name:
                arr = np.zeros(dims, dtype=dt)
            else:
                arr = rng.integers(0, 100, size=dims).astype(dt)
            feeds[name] = torch.from_numpy(arr)
        out.append((feeds if len(feeds) > 1 else next(iter(feeds.values())), None))
    log.info("validate: no data given; %d random batches of %d shaped like %s", batches, batch, path.name)
    return iter(out)
