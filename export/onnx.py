"""``export_onnx``: a PyTorch model (fp32, pruned or fake-quant) to one checked ONNX file.

The dynamo exporter traces the model; fake-quant models are exported as QDQ (see export/qdq/swap.py).
The result is checked (onnx.checker with full shape inference) and written atomically
(export/files.py), so an interrupted export leaves no partial file.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
import os
import re
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
import torch
from compress.export import edge, graph_forms
from compress.export.files import atomic_save, check_model, check_writable
from compress.export.qdq.graph import tidy_qdq_graph
from compress.export.qdq.swap import ActDtype, swap_quantizers, translation_table
from compress.export.records import DECOMPOSED_KEY
from compress.quantization.view import QuantizedView, is_quantized, tracking_unseen, view
from torch import nn

from compress.core.batching import call_model, require_module
from compress.core.errors import ExportError, RecipeError
from compress.core.moe import unpacked_experts
from compress.core.precision import float32_inputs, float32_weights

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class OnnxOptions:
    """How a file is written: :func:`export_onnx`'s keywords (see there) as the one object the code
    below it receives, built once per export."""

    opset: int | None = None
    dynamic_batch: bool = True
    activation_dtype: ActDtype = "uint8"
    reduce_range: bool = False
    quantize_embeddings: bool = False
    fp16: bool = False
    simplify: bool = True
    input_names: list[str] | None = None
    output_names: list[str] | None = None
    metadata: Mapping[str, str] | None = None


@dataclass(frozen=True)
class OnnxFile:
    """A written file and its model's read view, built once for the export: after it, ``kept_float``
    also names the calls only the export's trace made."""

    path: Path
    placed: QuantizedView


def export_onnx(
    model: nn.Module,
    example_inputs: Any,
    path: str | os.PathLike[str],
    *,
    opset: int | None = None,
    dynamic_batch: bool = True,
    activation_dtype: ActDtype = "uint8",
    reduce_range: bool = False,
    quantize_embeddings: bool = False,
    fp16: bool = False,
    simplify: bool = True,
    input_names: list[str] | None = None,
    output_names: list[str] | None = None,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Export ``model`` to ONNX at ``path`` and return the path.

    ``example_inputs``: a tensor, a tuple of tensors, or a dict of keyword tensors (HF models).
    A model holding enabled fake-quantizers exports as QDQ int8 (weights stored as int8,
    ``activation_dtype`` activations, 7-bit weights with ``reduce_range``; embedding tables the
    quantization placed int8 rows on (the default of static schemes, fidelity-checked there) as int8
    rows; ``quantize_embeddings`` also stores the large float Gather tables left unquantized
    (targets that excluded them, ``quantize_embeddings=False`` at quantization time) as per-row int8,
    unchecked: MiniLM's file drops from 0.65x to 0.25x of fp32). ``dynamic_batch`` makes
    dim 0 of every input symbolic (and dim 1 of integer 2-D inputs: token sequences); otherwise all
    shapes are those of the example. ``fp16`` stores the float parts in half precision with float32
    inputs and outputs; ``simplify`` runs onnxscript's optimizer (constant folding, dead code).
    Raises ExportError naming the cause for anything that stops a correct file being written.
    """
    options = OnnxOptions(
        opset=opset, dynamic_batch=dynamic_batch, activation_dtype=activation_dtype, reduce_range=reduce_range,
        quantize_embeddings=quantize_embeddings, fp16=fp16, simplify=simplify, input_names=input_names,
        output_names=output_names, metadata=metadata,
    )
    return write_onnx(model, example_inputs, path, options).path


def write_onnx(model: nn.Module, example_inputs: Any, path: str | os.PathLike[str], options: OnnxOptions) -> OnnxFile:
    """:func:`export_onnx` with its settings as one object; also returns the model's read view."""
    path = Path(path)
    require_module(model, "export_onnx: model")
    if options.activation_dtype not in ("uint8", "int8"):
        raise RecipeError(f"activation_dtype must be 'uint8' or 'int8', got '{options.activation_dtype}'")
    check_writable(path)
    placed = view(model)
    with unpacked_experts(model):
        # transformers' packed MoE experts run a grouped-matmul op ONNX has no function for: as
        # per-expert Linears (exact; views, put back after) the graph exports
        return _export_model(model, example_inputs, path, options, placed)


def _export_model(model: nn.Module, example_inputs: Any, path: Path, options: OnnxOptions,
                  placed: QuantizedView) -> OnnxFile:
    was_training = model.training
    model.eval()
    # a single-pass graph has no KV cache: a Hugging Face model would return one (DynamicCache, which
    # the exporter cannot trace) unless told not to; generation files are export.llm.onnx's job
    config = getattr(model, "config", None)
    use_cache = getattr(config, "use_cache", None)
    if use_cache:
        config.use_cache = False  # type: ignore[union-attr]
    try:
        # ORT's CPU kernels and Q/DQ scales are float32: a half-precision graph would not run
        # (fp16=True writes an fp16 file on purpose, from the float32 weights)
        with float32_weights(model) as widened:
            if widened:
                example_inputs = float32_inputs(example_inputs)
            return _export(model, example_inputs, path, options, placed)
    finally:
        model.train(was_training)
        if use_cache:
            config.use_cache = use_cache  # type: ignore[union-attr]


def _export(model: nn.Module, example_inputs: Any, path: Path, options: OnnxOptions, placed: QuantizedView) -> OnnxFile:
    args, kwargs = _split_inputs(example_inputs)
    outputs = _run_example(model, args, kwargs)
    quantized = is_quantized(model)
    blocked = 0
    opset, fp16 = options.opset, options.fp16
    if quantized:
        target, summary = swap_quantizers(model, activation_dtype=options.activation_dtype,
                                          reduce_range=options.reduce_range)
        if summary.blocked_weights:  # blocked DequantizeLinear is opset 21
            if opset is not None and opset < 21:
                raise ExportError(f"per-group (blocked) weights need opset >= 21, got opset={opset}")
            opset = max(opset or 21, 21)
            blocked = summary.blocked_weights
        log.info(
            "QDQ export: %d int8 weights (%d per-channel), %d %s activation pairs%s",
            summary.weights, summary.per_channel_weights, summary.activations, options.activation_dtype,
            ", reduce_range" if options.reduce_range else "",
        )
    else:
        target = model
        float_why = placed.model_float
        if float_why is not None:  # quantize() kept the whole model float: the file is the float model
            log.warning("export: %s holds the float model (no Q/DQ): %s", Path(path).name, float_why)
    if fp16:
        target = edge.Float16Wrapper(copy.deepcopy(target) if target is model else target)
    args, kwargs = _exportable_batch(args, kwargs, options.dynamic_batch)
    in_names = options.input_names or _input_names(args, kwargs)
    out_names = options.output_names or _output_names(outputs)
    # calls only the export's path made are recorded on the model: its export record names them
    with tracking_unseen(model) as unseen:
        proto = _dynamo_export(target, args, kwargs, in_names, out_names, opset=opset,
                               dynamic_batch=options.dynamic_batch, quantized=quantized)
    placed = placed.with_unseen(unseen)
    # both files: the float baseline keeps the same graph around the ops the int8 one quantizes
    graph_forms.spatial_means_to_pools(proto)
    if quantized:
        stats = tidy_qdq_graph(proto, quantize_embeddings=options.quantize_embeddings,
                               ort_float_weights=placed.target == "onnxruntime")
        log.info("QDQ graph passes: %s", ", ".join(f"{k} {v}" for k, v in stats.items() if v) or "nothing to do")
    if options.simplify:
        proto = edge.simplify(proto)
    decomposed = decomposed_compute(proto) if quantized else {}
    _strip_trace_metadata(proto)
    _rename_io(proto, out_names)
    props = {"compress.precision": _precision(quantized, fp16), **(options.metadata or {})}
    if decomposed:  # read by describe_onnx: these float nodes are named with their reason
        props[DECOMPOSED_KEY] = json.dumps(decomposed, sort_keys=True)
    if blocked:  # read by the runtimes: ORT needs one fusion off to run blocked weights as MatMulNBits
        props["compress.blocked_weights"] = str(blocked)
    edge.set_metadata(proto, props)
    check_model(proto, path)
    atomic_save(proto, path)
    log.info("exported %s (%s, %d bytes)", path, _precision(quantized, fp16), path.stat().st_size)
    return OnnxFile(path, placed)


def _precision(quantized: bool, fp16: bool) -> str:
    if quantized:
        return "int8-qdq" + ("+fp16" if fp16 else "")
    return "fp16" if fp16 else "fp32"


# ---- inputs --------------------------------------------------------------------------------------------
def _split_inputs(example_inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(example_inputs, Mapping):
        return (), dict(example_inputs)
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    raise RecipeError(
        f"example_inputs must be a tensor, a tuple of tensors or a dict of tensors, got {type(example_inputs).__name__}"
    )


def _describe(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    def one(t: Any) -> str:
        return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" if isinstance(t, torch.Tensor) else type(t).__name__

    parts = [one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()]
    return ", ".join(parts)


def _run_example(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run the model once on the example: a wrong shape or dtype fails here with a clear message,
    not deep inside the tracer."""
    try:
        with torch.no_grad():
            return call_model(model, kwargs) if kwargs else call_model(model, args)
    except Exception as exc:  # any model error: the example does not fit the model
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ExportError(
            f"example input [{_describe(args, kwargs)}] does not fit {type(model).__name__}: {first}"
        ) from exc


def _exportable_batch(args: tuple[Any, ...], kwargs: dict[str, Any], dynamic: bool) -> tuple[
    tuple[Any, ...], dict[str, Any]
]:
    """torch.export specializes dims of size 1, so a dynamic batch needs an example batch >= 2."""
    if not dynamic:
        return args, kwargs

    def grow(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == 1:
            return torch.cat([t, t], dim=0)
        return t

    return tuple(grow(a) for a in args), {k: grow(v) for k, v in kwargs.items()}


def _input_names(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
    if kwargs:
        return [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    return ["input"] if len(args) == 1 else [f"input_{i}" for i in range(len(args))]


def _output_names(outputs: Any) -> list[str]:
    if isinstance(outputs, torch.Tensor):
        return ["output"]
    if isinstance(outputs, Mapping) or hasattr(outputs, "to_tuple"):
        items = outputs.items() if isinstance(outputs, Mapping) else vars(outputs).items()
        return [k for k, v in items if isinstance(v, torch.Tensor)]
    if isinstance(outputs, (tuple, list)):
        return [f"output_{i}" for i in range(len(outputs))]
    return ["output"]


def _dynamic_shapes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    batch = torch.export.Dim("batch")
    seq = torch.export.Dim("sequence")

    def dims(t: Any) -> dict[int, Any] | None:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return None
        d: dict[int, Any] = {0: batch}
        if t.dim() == 2 and not t.is_floating_point():  # token ids / masks: variable length
            d[1] = seq
        return d

    if kwargs:
        return {k: dims(v) for k, v in kwargs.items()}
    return tuple(dims(a) for a in args)


# ---- export --------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _quiet() -> Iterator[io.StringIO]:
    """The dynamo exporter prints progress to stdout and warns a lot; keep them out of users' logs."""
    buf = io.StringIO()
    # it logs one warning per torchvision op it cannot register (torchvision is not a dependency)
    registration = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registration.level
    registration.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(buf):
            warnings.simplefilter("ignore")
            yield buf
    finally:
        registration.setLevel(level)


_UNSUPPORTED = re.compile(
    r"(UnsupportedOperatorException: \S+|No decompositions? registered for \S+|"
    r"Unsupported FX nodes: \{[^}]*\}|not supported by the ONNX exporter[^\n]*|No ONNX function found for \S+)"
)


def _dynamo_export(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    in_names: list[str],
    out_names: list[str],
    *,
    opset: int | None,
    dynamic_batch: bool,
    quantized: bool,
) -> onnx.ModelProto:
    options: dict[str, Any] = {}
    if opset is not None:
        options["opset_version"] = opset
    if dynamic_batch:
        shapes = _dynamic_shapes(args, kwargs)
        if isinstance(model, edge.Float16Wrapper):  # forward(*args, **kwargs): shapes nest one level down
            shapes = {"kwargs": shapes} if kwargs else (shapes,)
        options["dynamic_shapes"] = shapes
    if not kwargs:
        options["input_names"] = in_names
    if quantized:
        options["custom_translation_table"] = translation_table()
    try:
        with _quiet(), torch.no_grad():
            program = torch.onnx.export(
                model, args, kwargs=kwargs or None, dynamo=True, external_data=False, optimize=True,
                verbose=False, report=False, **options,
            )
    except Exception as exc:
        text = str(exc)
        hit = _UNSUPPORTED.search(text)
        detail = hit.group(1) if hit else _summary_line(text) or type(exc).__name__
        if "Constraints violated" in text or "specialized" in text:
            detail = "a dimension marked dynamic (batch/sequence) was specialized by the model; use dynamic_batch=False"
        raise ExportError(f"ONNX export of {type(model).__name__} failed: {detail}") from exc
    if program is None:
        raise ExportError(f"ONNX export of {type(model).__name__} returned no program")
    proto = program.model_proto
    if len(proto.graph.output) != len(out_names):
        log.warning("model has %d outputs but %d names were given; keeping exporter names",
                    len(proto.graph.output), len(out_names))
    return proto


def _summary_line(text: str) -> str:
    """The line that says what went wrong in the exporter's long report (its 'Exception summary')."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for k, ln in enumerate(lines):
        if ln.startswith("## Exception summary") and k + 1 < len(lines):
            return re.sub(r"^<class '([\w.]+)'>: ", lambda m: m.group(1).rsplit(".", 1)[-1] + ": ", lines[k + 1])
    return lines[0] if lines else ""


def _rename_io(proto: onnx.ModelProto, out_names: list[str]) -> None:
    """Graph outputs get the model's names (``logits``, ``last_hidden_state``, ...), not node names."""
    g = proto.graph
    if len(g.output) != len(out_names):
        return
    mapping = {o.name: new for o, new in zip(g.output, out_names) if o.name != new}
    if not mapping:
        return
    taken = {n for node in g.node for n in list(node.input) + list(node.output)} | {i.name for i in g.initializer}
    for new in mapping.values():
        if new in taken and new not in mapping:
            raise ExportError(f"output name '{new}' clashes with a tensor in the graph; pass output_names")
    for node in g.node:
        for k, n in enumerate(node.output):
            if n in mapping:
                node.output[k] = mapping[n]
        for k, n in enumerate(node.input):
            if n in mapping:
                node.input[k] = mapping[n]
    for o in g.output:
        o.name = mapping.get(o.name, o.name)
    for vi in list(g.value_info):
        if vi.name in mapping:
            g.value_info.remove(vi)


_COMPUTE_TYPES = frozenset({"Add", "MatMul", "Gemm", "Conv"})
#: aten ops whose own work an Add/MatMul/Gemm/Conv node is (the ops the placement quantizes)
_OWN_OPS = re.compile(r"aten\.(add|add_|sub|rsub|linear|addmm|matmul|mm|bmm|baddbmm|einsum|conv\w*|"
                      r"_convolution|scaled_dot_product_attention|\w*attention\w*)\.|operator\.|^<")


def decomposed_compute(proto: onnx.ModelProto) -> dict[str, str]:
    """``{node: torch op}`` for the Add/MatMul/Gemm/Conv nodes the exporter wrote as part of another
    op (GroupNorm's affine Add after InstanceNormalization): float as that op is, in any placement,
    and no layer or add of the model. Read from the exporter's per-node FX metadata, before it is
    stripped."""
    out = {}
    for n in proto.graph.node:
        if n.op_type not in _COMPUTE_TYPES:
            continue
        fx = next((p.value for p in n.metadata_props if p.key == "pkg.torch.onnx.fx_node"), "")
        hit = re.search(r"target=([\w.]+)", fx)
        if hit and not _OWN_OPS.search(hit.group(1)):
            out[n.name] = hit.group(1).removeprefix("torch.ops.")
    return out


def _strip_trace_metadata(proto: onnx.ModelProto) -> None:
    """Drop the exporter's per-node stack traces and FX names: they can outweigh a small int8 model."""

    def strip(graph: onnx.GraphProto) -> None:
        for container in (graph.node, graph.value_info, graph.input, graph.output, graph.initializer):
            for item in container:
                del item.metadata_props[:]
                if item.doc_string:
                    item.doc_string = ""
        for node in graph.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    strip(attr.g)

    strip(proto.graph)
    for fn in proto.functions:
        for node in fn.node:
            del node.metadata_props[:]
