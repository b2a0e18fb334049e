"""Preparing a model for static activation quantization on its traced graph.

``prepare`` (quantization/preparation.py) calls in here when the scheme quantizes activations
statically: trace the forward pass, pair convs with the BatchNorms that read them (also inside
users' own modules, where nn.Sequential adjacency shows nothing), pick first/last layers by data
flow, and, after the layers are swapped, trace again and place the activation quantizers with the
target runtime's profile. Without example inputs, placement waits for the first forward pass
(``ensure_placed`` runs one calibration batch for it).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from compress.quantization.numerics.spec import QuantSpec
from compress.quantization.placement.cost_table import CostTable
from compress.quantization.placement.graph_patterns import weighted_operands
from compress.quantization.placement.mode import (
    QuantizerGraph,
    attach,
    build_quantizers,
    calibrate_weights,
    graph_of,
)
from compress.quantization.placement.place import place
from compress.quantization.placement.records import Placement
from compress.quantization.placement.runtimes import get_profile
from compress.quantization.placement.settings import PrepareParams
from compress.quantization.placement.trace import OpGraph, OpNode, trace_ops
from torch import nn

from compress.core.errors import CalibrationError, CompressError
from compress.core.targets import pattern_matches
from compress.core.tracing import tensor_leaves

log = logging.getLogger(__name__)


@dataclass
class GraphConfig:
    """What placement needs besides the graph; kept on a pending QuantizerGraph until it is placed."""

    params: PrepareParams  # what it applies to, the runtime, quantize_ops, quantize_embeddings
    activation_spec: QuantSpec
    weight_spec: QuantSpec | None
    swapped: set[str] = field(default_factory=set)
    skip_layers: dict[str, str] = field(default_factory=dict)  # layer -> why it stays float
    #: why the whole model stays float (the cost table's model-level check): nothing is placed
    model_float: str | None = None
    float_ops: dict[str, str] = field(default_factory=dict)  # attention call (op key) -> why it stays float
    serving_batch: int = 1  # the largest batch the model will be served at (integer_chains.float_islands)
    cost_table: CostTable | None = None  # the target's: prices elementwise chains at serving_batch


#: an embedding table is stored int8 only when its dequantized form is this close to the float table
#: (SQNR, dB): Gaussian-like tables measure 38-45 dB per-row (MiniLM's word and position tables 42.8
#: and 38.9, the reference LLM's 43.7); rows with a few outliers fall below it (MiniLM's 2-row
#: token-type table, 29.3 dB), and storing a tiny table in int8 saves nothing worth that noise
TABLE_MIN_SQNR_DB = 30.0


def example_args(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` for a model call from model inputs (a tensor, a tuple, a dict or an
    ExampleCall)."""
    if isinstance(inputs, ExampleCall):
        return inputs.args, inputs.kwargs
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, tuple):
        return inputs, {}
    return (inputs,), {}


def targeted_fn(model: nn.Module, targets: Sequence[str], ignore: Sequence[str]) -> Callable[[str], bool]:
    """``scope -> bool``: a module is targeted when it or an ancestor matches a target pattern and
    neither it nor an ancestor matches an ignore pattern."""
    mods = dict(model.named_modules())
    everything = list(targets) == ["*"]
    cache: dict[str, bool] = {}

    def chain(scope: str) -> list[str]:
        parts = scope.split(".") if scope else []
        return [".".join(parts[: i + 1]) for i in range(len(parts))]

    def fn(scope: str) -> bool:
        if scope in cache:
            return cache[scope]
        names = chain(scope)
        hit_t = everything or any(pattern_matches(p, n, mods[n]) for n in names if n in mods for p in targets)
        hit_i = any(pattern_matches(p, n, mods[n]) for n in names if n in mods for p in ignore)
        cache[scope] = hit_t and not hit_i
        return cache[scope]

    return fn


#: reshapes that keep row-major order: one that keeps the last dimension's size keeps every
#: element's index in it (flat index mod C), so a BatchNorm over that dimension still sees channels
_ROW_MAJOR = frozenset({"reshape", "view", "flatten", "reshape_as", "view_as", "contiguous"})


#: calls that read only the shape (or dtype) of their second tensor: ``y.reshape_as(x)`` leaves x free
_SHAPE_ONLY = frozenset({"reshape_as", "view_as", "expand_as", "type_as"})


def _value_readers(graph: OpGraph, key: str) -> int:
    return sum(1 for c, o in graph.consumers(key) if not (c.func in _SHAPE_ONLY and o.position == 1))


def _bn_producer(graph: OpGraph, bn: OpNode) -> OpNode | None:
    """The weighted op whose output only ``bn`` reads: directly (conv -> BatchNorm), or for a Linear
    through row-major reshapes that keep its feature dimension last, into a BatchNorm over 2-D
    ``(tokens, features)`` input (LeViT's Linear -> flatten -> BatchNorm1d)."""
    if not bn.operands or bn.operands[0].source != "op":
        return None
    shape = bn.operands[0].shape
    prod = graph.nodes.get(str(bn.operands[0].producer))
    while prod is not None and prod.kind == "reshape" and len(shape) == 2:
        if (prod.func not in _ROW_MAJOR or _value_readers(graph, prod.key) != 1 or not prod.operands
                or prod.operands[0].source != "op" or prod.out_shapes[0][-1:] != shape[-1:]):
            return None
        prod = graph.nodes.get(str(prod.operands[0].producer))
    if prod is None or _value_readers(graph, prod.key) != 1:
        return None
    if prod.kind == "conv":
        return prod
    if prod.kind == "linear" and len(shape) == 2 and prod.out_shapes[0][-1:] == shape[-1:]:
        return prod
    return None


def bn_pairs_from_graph(model: nn.Module, graph: OpGraph) -> dict[str, str]:
    """``{layer: bn}`` for every conv (or Linear, see :func:`_bn_producer`) call whose output only a
    BatchNorm module reads (any module structure: the graph shows the data flow that nn.Sequential
    adjacency guesses)."""
    from compress.quantization.algorithms.bn_fold import _compatible

    mods = dict(model.named_modules())
    pairs: dict[str, str] = {}
    for n in graph.nodes.values():
        if n.kind != "batch_norm":
            continue
        prod = _bn_producer(graph, n)
        w = weighted_operands(prod) if prod is not None else None
        if w is None or not w[1].name:
            continue
        conv_name = w[1].name.rsplit(".", 1)[0]
        bn = mods.get(n.scope)
        conv = mods.get(conv_name)
        if conv is None or bn is None or not _compatible(conv, bn):
            continue
        if type(bn).forward is not nn.modules.batchnorm._BatchNorm.forward:
            continue  # a fused norm+activation module: replacing it would drop its activation
        pairs[conv_name] = n.scope
    return pairs


def layers_by_flow(graph: OpGraph) -> list[str]:
    """Names of the layers whose weights the graph's weighted ops read, in call order."""
    out: list[str] = []
    for n in graph.nodes.values():
        w = weighted_operands(n)
        if w is not None and w[1].name and "." in w[1].name:
            name = w[1].name.rsplit(".", 1)[0]
            if name not in out:
                out.append(name)
    return out


def new_graph(model: nn.Module, config: GraphConfig) -> QuantizerGraph:
    """Attach a pending QuantizerGraph to ``model``: placed by :func:`place_graph` now, or on the
    first forward pass."""
    qg = QuantizerGraph(Placement(target=config.params.runtime), activation_spec=config.activation_spec,
                        weight_spec=config.weight_spec, pending=True)
    qg.placer = functools.partial(_place, config=config)
    attach(model, qg)
    return qg


def _place(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *, config: GraphConfig) -> None:
    place_graph(model, config, args, kwargs)


def call_batch(args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> int | None:
    """The batch of a model call: its first tensor's leading dimension (None for none)."""
    leaves = tensor_leaves((args, kwargs or {}))
    return int(leaves[0][1].shape[0]) if leaves and leaves[0][1].dim() else None


def place_graph(model: nn.Module, config: GraphConfig, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Placement:
    """Trace ``model`` on the example call and place its quantizers in its QuantizerGraph."""
    qg = graph_of(model)
    if qg is None:
        raise CompressError("place_graph: the model has no quantizer graph; prepare() it first")
    was_training, placing = model.training, qg.placing
    model.eval()  # trace the inference graph: dropout and BN in training mode take other calls
    qg.placing = True
    try:
        graph = trace_ops(model, args, kwargs)
    finally:
        model.train(was_training)
        qg.placing = placing
    placement = place(
        graph, get_profile(config.params.runtime), targeted=targeted_fn(model, config.params.targets, config.params.ignore),
        swapped=config.swapped, skip_layers=config.skip_layers, quantize_ops=config.params.quantize_ops,
        embeddings=config.params.quantize_embeddings, tied=tied_weights(model, config.swapped), model_float=config.model_float,
        float_ops=config.float_ops, serving_batch=config.serving_batch, cost_table=config.cost_table,
        example_batch=call_batch(args, kwargs),
    )
    placement.cost_table = config.cost_table.name if config.cost_table is not None else None
    qg.placement, qg.pending = placement, False
    build_quantizers(qg)
    calibrate_weights(qg, model)
    keep_lossy_tables_float(qg, model)
    device = next((t.device for _, t in tensor_leaves((args, kwargs or {}))), None)
    if device is not None:
        qg.to(device)
    log.info(
        "placed %d activation quantizers on %d op calls for %s (%d functional weights, %d ops left float)",
        len(placement.activations), len(placement.entries), config.params.runtime, len(placement.weights), len(placement.floats),
    )
    return placement


def tied_weights(model: nn.Module, swapped: set[str]) -> dict[str, str]:
    """``{parameter name: swapped layer}`` for parameters that are also a swapped layer's weight
    under another name (GPT-2's lm_head shares the token embedding): the name is the one the graph
    sees (``named_parameters`` keeps the first of tied names)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, str] = {}
    for layer in sorted(swapped):
        w = getattr(model.get_submodule(layer), "weight", None)
        q = getattr(model.get_submodule(layer), "weight_quantizer", None)
        name = names.get(id(w))
        spec = getattr(q, "spec", None)
        # the layer's quantizer serves the table only when it is per output row (axis 0), 8-bit
        if name is None or name == f"{layer}.weight" or spec is None:
            continue
        if spec.granularity == "channel" and spec.axis == 0 and spec.bits == 8 and not spec.dynamic:
            out[name] = layer
    return out


def _sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    noise = (ref.double() - approx.double()).pow(2).sum()
    signal = ref.double().pow(2).sum()
    return float("inf") if noise == 0 else float(10 * torch.log10(signal / noise))


def keep_lossy_tables_float(qg: QuantizerGraph, model: nn.Module, min_db: float = TABLE_MIN_SQNR_DB) -> None:
    """Embedding tables whose int8 form is less than ``min_db`` SQNR from the float table stay float:
    their quantizer leaves the placement and ``floats`` names the measured reason."""
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    pl = qg.placement
    for qid, use in list(pl.weights.items()):
        w = tensors.get(use.param)
        if not use.table or w is None:
            continue
        q = qg.quantizers[qid] if qid in qg.quantizers else (
            getattr(model.get_submodule(use.module), "weight_quantizer", None) if use.module else None)
        if not isinstance(q, nn.Module):
            continue
        with torch.no_grad():
            db = _sqnr_db(w.detach(), q(w.detach()))
        if db >= min_db:
            continue
        del pl.weights[qid]
        if qid in qg.quantizers:
            del qg.quantizers[qid]
        for key, entry in pl.entries.items():
            if entry.get("1") == qid:
                del entry["1"]
                pl.floats[key] = f"embedding table kept float: int8 per-row SQNR {db:.1f} dB < {min_db:.0f} dB"
        log.info("embedding table %s kept float (int8 SQNR %.1f dB)", use.param, db)
    for key in [k for k, e in pl.entries.items() if not e]:
        del pl.entries[key]


class _Captured(Exception):
    pass


@dataclass
class ExampleCall:
    """The arguments of one model call, as a forward loop made it."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def capture_first_call(model: nn.Module, forward_loop: Callable[[nn.Module], Any]) -> ExampleCall | None:
    """The arguments of the first call ``forward_loop`` makes to ``model`` (the loop is stopped
    there); None when it makes none."""
    seen: list[ExampleCall] = []

    def grab(mod: nn.Module, args: Any, kwargs: Any) -> None:
        seen.append(ExampleCall(tuple(args), dict(kwargs)))
        raise _Captured

    h = model.register_forward_pre_hook(grab, with_kwargs=True, prepend=True)
    try:
        with torch.no_grad():
            forward_loop(model)
    except _Captured:
        pass
    finally:
        h.remove()
    return seen[0] if seen else None


def ensure_placed(model: nn.Module, forward_loop: Callable[[nn.Module], Any]) -> None:
    """Place a pending QuantizerGraph on the first call ``forward_loop`` makes; nothing to do when
    the model is placed already."""
    qg = graph_of(model)
    if qg is None or not qg.pending or qg.placer is None:
        return
    call = capture_first_call(model, forward_loop)
    if call is None:
        raise CalibrationError("calibration: the forward loop fed no data (empty calibration set?)")
    qg.placer(model, call.args, call.kwargs)
