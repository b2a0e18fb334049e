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
from torch import nn

from compress.errors import CalibrationError, CompressError
from compress.targets import pattern_matches
from quantization.graph import OpGraph, tensor_leaves, trace_graph
from quantization.hooks import QuantizerGraph, attach, build_quantizers, calibrate_weights, graph_of
from quantization.placement import Placement, place, weighted_operands
from quantization.profiles import get_profile
from quantization.spec import QuantSpec

log = logging.getLogger(__name__)


@dataclass
class GraphConfig:
    """What placement needs besides the graph; kept on a pending QuantizerGraph until it is placed."""

    target: str
    targets: list[str]
    ignore: list[str]
    quantize_ops: bool
    activation_spec: QuantSpec
    weight_spec: QuantSpec | None
    swapped: set[str] = field(default_factory=set)
    skip_layers: set[str] = field(default_factory=set)


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


def bn_pairs_from_graph(model: nn.Module, graph: OpGraph) -> dict[str, str]:
    """``{conv: bn}`` for every conv call whose output only a BatchNorm module reads (any module
    structure: the graph shows the data flow that nn.Sequential adjacency guesses)."""
    from quantization.bn import _compatible

    mods = dict(model.named_modules())
    pairs: dict[str, str] = {}
    for n in graph.nodes.values():
        if n.kind != "batch_norm" or not n.operands or n.operands[0].source != "op":
            continue
        prod = graph.nodes.get(str(n.operands[0].producer))
        if prod is None or prod.kind != "conv" or len(graph.consumers(prod.key)) != 1:
            continue
        w = weighted_operands(prod)
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
    qg = QuantizerGraph(Placement(target=config.target), activation_spec=config.activation_spec,
                        weight_spec=config.weight_spec, pending=True)
    qg.placer = functools.partial(_place, config=config)
    attach(model, qg)
    return qg


def _place(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *, config: GraphConfig) -> None:
    place_graph(model, config, args, kwargs)


def place_graph(model: nn.Module, config: GraphConfig, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Placement:
    """Trace ``model`` on the example call and place its quantizers in its QuantizerGraph."""
    qg = graph_of(model)
    if qg is None:
        raise CompressError("place_graph: the model has no quantizer graph; prepare() it first")
    was_training, placing = model.training, qg.placing
    model.eval()  # trace the inference graph: dropout and BN in training mode take other calls
    qg.placing = True
    try:
        graph = trace_graph(model, args, kwargs)
    finally:
        model.train(was_training)
        qg.placing = placing
    placement = place(
        graph, get_profile(config.target), targeted=targeted_fn(model, config.targets, config.ignore),
        swapped=config.swapped, skip_layers=config.skip_layers, quantize_ops=config.quantize_ops,
    )
    qg.placement, qg.pending = placement, False
    build_quantizers(qg)
    calibrate_weights(qg, model)
    device = next((t.device for _, t in tensor_leaves(args, kwargs)), None)
    if device is not None:
        qg.to(device)
    log.info(
        "placed %d activation quantizers on %d op calls for %s (%d functional weights, %d ops left float)",
        len(placement.activations), len(placement.entries), config.target, len(placement.weights), len(placement.floats),
    )
    return placement


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
