"""Runtimes that run exported ONNX files, in a registry: onnxruntime and openvino. Each loads a file
into a session with ``run(feeds) -> outputs``. (The recipe's ``cuda`` runtime is not one of them: it
runs the PyTorch model on the project's int8 kernels, export/validation/cuda.py, and export.validation.measure calls it.)"""

from __future__ import annotations

import logging
import tempfile
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import onnx
from compress.export.validation.parity import resize_batch

from compress.core.errors import ExportError
from compress.core.imports import install_hint
from compress.core.machine import usable_cores
from compress.core.ort import inference_session, session_options
from compress.core.registry import Registry

log = logging.getLogger(__name__)


class RuntimeSession(Protocol):
    """A loaded model: named inputs, and a run on numpy feeds returning outputs in graph order."""

    input_names: list[str]
    #: static input shapes (None for a symbolic dim), by input name
    input_shapes: dict[str, list[int | None]]
    device: str

    def run(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]: ...


Loader = Callable[[Path, int], RuntimeSession]
RUNTIMES: Registry[Loader] = Registry("runtime")


def default_threads() -> int:
    """All cores this process may use."""
    return usable_cores()


def load_session(runtime: str, path: Path, *, threads: int | None = None) -> RuntimeSession:
    """Open ``path`` in ``runtime`` with ``threads`` intra-op threads (all cores when None)."""
    loader = RUNTIMES.get(runtime)
    return loader(Path(path), threads or default_threads())


def _onnx_shapes(values: Any) -> dict[str, list[int | None]]:
    out: dict[str, list[int | None]] = {}
    for v in values:
        dims = getattr(v, "shape", None)
        out[v.name] = [d if isinstance(d, int) else None for d in (dims or [])]
    return out


# ---- onnxruntime ---------------------------------------------------------------------------------------
_ORT_PREFERENCE = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")


def ort_providers() -> list[str]:
    """The providers this onnxruntime build offers, best first (TensorRT, CUDA, CPU)."""
    import onnxruntime as ort

    have = set(ort.get_available_providers())
    return [p for p in _ORT_PREFERENCE if p in have] or ["CPUExecutionProvider"]


def ort_disabled_optimizers(path: Path) -> list[str]:
    """ORT fusions to turn off for a file: for blocked (int4) weights, MatMulAddFusion, which would
    turn ``MatMul(x, DQ(W)) + b`` into a float Gemm before ORT can fuse the DQ into MatMulNBits."""
    try:
        m = onnx.load(str(path), load_external_data=False)
    except Exception:  # ORT reports unreadable files itself
        return []
    props = {p.key: p.value for p in m.metadata_props}
    return ["MatMulAddFusion"] if props.get("compress.blocked_weights", "0") != "0" else []


class OrtSession:
    """An onnxruntime InferenceSession with all graph optimizations on."""

    def __init__(self, path: Path, threads: int, *, providers: list[str] | None = None) -> None:
        # idle pool threads of one session spin and steal the cores of the next when sessions are
        # timed interleaved (side by side); measured 2-3x inflated MiniLM latency with spinning on
        so = session_options(threads=threads, inter_op_threads=1, spinning=False)
        self.sess = inference_session(path, so, providers=providers or ort_providers(),
                                      disabled_optimizers=ort_disabled_optimizers(path))
        self.input_names = [i.name for i in self.sess.get_inputs()]
        self.input_shapes = _onnx_shapes(self.sess.get_inputs())
        self.device = "onnxruntime:" + self.sess.get_providers()[0].removesuffix("ExecutionProvider")

    def run(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        return [np.asarray(o) for o in self.sess.run(None, dict(feeds))]


RUNTIMES.add("onnxruntime", lambda path, threads: OrtSession(path, threads))


# ---- openvino ------------------------------------------------------------------------------------------
class OpenVinoSession:
    """An OpenVINO compiled model on CPU (reads QDQ ONNX and runs its int8 parts in int8)."""

    def __init__(self, path: Path, threads: int) -> None:
        try:
            import openvino as ov
        except ImportError:
            raise ExportError(f"runtime 'openvino' needs the openvino package: {install_hint('openvino')}") from None
        core = ov.Core()
        try:
            model = core.read_model(str(path))
            self.compiled = core.compile_model(model, "CPU", {"INFERENCE_NUM_THREADS": threads})
        except Exception as exc:
            raise ExportError(f"openvino cannot load '{path}': {str(exc).splitlines()[0]}") from exc
        self.request = self.compiled.create_infer_request()
        self.input_names = [p.get_any_name() for p in self.compiled.inputs]
        self.input_shapes = {
            p.get_any_name(): [d.get_length() if d.is_static else None for d in p.get_partial_shape()]
            for p in self.compiled.inputs
        }
        self.outputs = list(self.compiled.outputs)
        self.device = "openvino:CPU"

    def run(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        res = self.request.infer(dict(feeds))
        return [np.asarray(res[o]) for o in self.outputs]


RUNTIMES.add("openvino", lambda path, threads: OpenVinoSession(path, threads))


# ---- integer kernels in ORT's optimized graph ----------------------------------------------------------
_INTEGER_OPS = {
    "ConvInteger", "MatMulInteger", "QGemm", "MatMulIntegerToFloat", "DynamicQuantizeMatMul", "QAttention",
    "MatMulNBits", "QEmbedLayerNormalization", "QOrderedMatMul", "DynamicQuantizeLSTM",
}


def is_integer_kernel(op_type: str) -> bool:
    """Whether an op of ORT's optimized graph computes on integers (QLinear*, *Integer*, QGemm ...)."""
    return op_type.startswith("QLinear") or op_type in _INTEGER_OPS or op_type.startswith("NhwcQLinear")


def ort_optimized_graph(path: Path) -> onnx.ModelProto:
    """The graph ORT actually runs on CPU after its optimizations (incl. QDQ fusion)."""
    with tempfile.TemporaryDirectory() as tmp:
        optimized = Path(tmp) / "optimized.onnx"
        inference_session(path, session_options(threads=1, optimized_path=optimized),
                          disabled_optimizers=ort_disabled_optimizers(path))
        return onnx.load(str(optimized), load_external_data=False)


def ort_optimized_ops(path: Path) -> Counter[str]:
    """Op types of the graph ORT actually runs on CPU after its optimizations (incl. QDQ fusion)."""
    return Counter(n.op_type for n in ort_optimized_graph(path).graph.node)


#: float compute ops of ORT's optimized CPU graph (what a QDQ model should have turned into integers)
FLOAT_COMPUTE_OPS = frozenset({"Conv", "FusedConv", "NhwcFusedConv", "MatMul", "FusedMatMul", "Gemm", "FusedGemm", "Add"})
#: integer ops that do the work of a Conv/MatMul/Gemm/Add
INTEGER_COMPUTE_OPS = frozenset({
    "QLinearConv", "NhwcQLinearConv", "QLinearMatMul", "MatMulIntegerToFloat", "QGemm", "QLinearAdd",
    "ConvInteger", "MatMulInteger", "DynamicQuantizeMatMul", "MatMulNBits", "QAttention",
})


#: float ops of ORT's optimized CPU graph that ORT also has an integer kernel for (QLinearMul,
#: QLinearSoftmax, QLinearWhere, ...): a quantized model's float work left, counted beside its
#: integer kernels so that one QGemm and a QLinearMatMul + QLinearAdd pair compare fairly
FLOAT_LEFT_OPS = FLOAT_COMPUTE_OPS | frozenset({
    "Mul", "Softmax", "Where", "Sigmoid", "Concat", "AveragePool", "GlobalAveragePool", "LeakyRelu",
})


@dataclass
class Coverage:
    """Which Conv/MatMul/Gemm/Add work ORT runs in integers in a QDQ model, and what stays float."""

    integer_ops: dict[str, int]
    float_nodes: list[str]
    #: every float op of FLOAT_LEFT_OPS left in the graph, by type
    float_left: dict[str, int] = field(default_factory=dict)

    @property
    def integer(self) -> int:
        return sum(v for k, v in self.integer_ops.items() if k in INTEGER_COMPUTE_OPS)

    @property
    def share(self) -> float:
        """Integer compute kernels over all compute kernels (1.0: nothing runs in float)."""
        total = self.integer + len(self.float_nodes)
        return self.integer / total if total else 1.0


_INT_TYPES = frozenset({onnx.TensorProto.INT64, onnx.TensorProto.INT32, onnx.TensorProto.INT8, onnx.TensorProto.UINT8,
                        onnx.TensorProto.INT16, onnx.TensorProto.UINT16, onnx.TensorProto.BOOL})


#: ops whose output has their first input's element type
_TYPE_KEEPING = frozenset({"Concat", "Split", "Slice", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten",
                           "Expand", "Identity", "Tile", "Pad"})


def ort_coverage(path: Path) -> Coverage:
    """The integer kernels of ORT's optimized CPU graph, and the float Conv/MatMul/Gemm/Add nodes
    left in it (``OpType:node_name``). Adds on integer tensors (shape arithmetic such as
    ``seq_len + 1``, position-bucket indices; typed by ONNX shape inference) are not float compute
    and are not counted."""
    proto = ort_optimized_graph(path)
    try:  # types the tensors ORT's saved graph leaves untyped (index arithmetic on Cast/Where results)
        proto = onnx.shape_inference.infer_shapes(proto)
    except Exception as exc:  # contrib ops it cannot read leave the graph as saved
        log.debug("shape inference on ORT's graph failed: %s", exc)
    g = proto.graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*g.value_info, *g.output, *g.input]}
    types.update({i.name: i.data_type for i in g.initializer})
    for n in g.node:  # what inference left untyped behind a contrib op: moves keep their input's type
        if n.op_type in _TYPE_KEEPING and n.input and types.get(n.input[0]):
            for o in n.output:
                types.setdefault(o, types[n.input[0]])
        elif n.op_type.startswith(("QLinear", "NhwcQLinear")):  # 8-bit codes out, typed like the input codes
            codes = [types[i] for i in n.input if types.get(i) in (onnx.TensorProto.INT8, onnx.TensorProto.UINT8)]
            if codes:
                types.setdefault(n.output[0], codes[0])
        elif n.op_type == "QGemm" and len(n.input) > 8 and types.get(n.input[8]):  # y_zero_point given: codes out
            types.setdefault(n.output[0], types[n.input[8]])  # (without it QGemm writes float)

    def integer(n: onnx.NodeProto) -> bool:  # Add's inputs and output share one type
        return any(types.get(t) in _INT_TYPES for t in [*n.output, *n.input])

    ints = Counter(n.op_type for n in g.node if is_integer_kernel(n.op_type))
    # a Concat of integer codes (one scale for all inputs) does QLinearConcat's work without requantizing
    ints.update(f"{n.op_type} (codes)" for n in g.node
                if n.op_type == "Concat" and types.get(n.output[0]) in (onnx.TensorProto.INT8, onnx.TensorProto.UINT8))
    floats = [f"{n.op_type}:{n.name}" for n in g.node if n.op_type in FLOAT_COMPUTE_OPS and not integer(n)]
    # by the output's type: a Where's condition is boolean whatever it selects
    left = Counter(n.op_type for n in g.node if n.op_type in FLOAT_LEFT_OPS and types.get(n.output[0]) not in _INT_TYPES)
    return Coverage(dict(sorted(ints.items())), floats, dict(sorted(left.items())))


def integer_kernel_count(path: Path) -> tuple[int, dict[str, int]]:
    """How many nodes of ORT's optimized CPU graph are integer kernels, and which."""
    ops = ort_optimized_ops(path)
    ints = {k: v for k, v in sorted(ops.items()) if is_integer_kernel(k)}
    return sum(ints.values()), ints


def run_session(session: RuntimeSession, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Run ``feeds`` through ``session``; a model exported with a static batch runs in chunks of it."""
    static = {session.input_shapes.get(k, [None])[0] for k in feeds}
    b0 = next(iter(static)) if len(static) == 1 else None
    n = next(iter(feeds.values())).shape[0]
    if not isinstance(b0, int) or b0 == n:
        return session.run(feeds)
    chunks: list[list[np.ndarray]] = []
    for start in range(0, n, b0):
        part = {k: v[start : start + b0] for k, v in feeds.items()}
        m = next(iter(part.values())).shape[0]
        outs = session.run(resize_batch(part, b0) if m < b0 else part)
        chunks.append([o[:m] for o in outs])
    return [np.concatenate([c[i] for c in chunks], axis=0) for i in range(len(chunks[0]))]
