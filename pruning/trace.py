"""Build the dependency graph from one forward pass with a ``__torch_function__`` mode.

Why not autograd (DepGraph) or torch.export: the mode sees every torch call with its arguments,
under ``no_grad`` too, through Python control flow and Hugging Face models that export cannot
capture. Every floating tensor the model computes carries a *label tensor* of the same shape
holding item ids (-1: no channel identity). Shape ops (view, permute, cat, split, index...) are
replayed on the labels, so index mappings through concat, chunk, flatten and head reshapes come
out exact; mixing ops (conv, linear, norms, matmul) join items by rules (:mod:`pruning.rules` for
ops without parameters, :mod:`pruning.rules_modules`, :mod:`pruning.rules_attention`; what they
share is :mod:`pruning.rule_helpers`). This module holds the table of which rule runs for which op.
An op the rules do not know stops the trace with UnsupportedModelError naming it and its module.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from compress.pruning import rules, rules_attention, rules_modules
from compress.pruning.graph import ELEMENT, DependencyGraph
from compress.pruning.rule_helpers import PendingSplit, Rule, resolve
from torch import nn

from compress.core.batching import call_model
from compress.core.errors import UnsupportedModelError
from compress.core.tracing import ObserverMode, iter_tensors, op_name

log = logging.getLogger(__name__)


def func_name(func: Callable[..., Any]) -> str:
    """The op name the rules key on: a function, its method and its operator and in-place forms fold
    into one (``__radd__``/``__iadd__``/``add_``/``Tensor.add`` -> ``add``), except the reflected
    operators whose operand order matters; property reads are ``get:<property>`` (see
    compress.core.tracing.op_name, which gives the name as written)."""
    name = op_name(func)
    if name.startswith("get:"):
        return name
    if name in ("__rmatmul__", "__rsub__", "__rtruediv__", "__rdiv__", "__rpow__"):
        return name  # operand order matters
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
        if (name.startswith("i") and name[1:] in ("add", "sub", "mul", "truediv", "div", "and", "or", "pow")) or (name.startswith("r") and name[1:] in ("add", "mul", "and", "or")):
            name = name[1:]
    elif name.endswith("_") and not name.startswith("_"):
        name = name[:-1]
    return name


def _rule_table() -> dict[str, Rule]:
    table: dict[str, Rule] = dict(rules.RULES)
    table.update(rules_attention.RULES)
    return table


#: the rule of each op without parameters, by :func:`func_name`
RULES: dict[str, Rule] = _rule_table()
#: the rules of ops that own parameters (conv, linear, norms...): they run even on unlabeled inputs
MODULE_OPS: dict[str, Rule] = rules_modules.MODULE_OPS
#: modules traced as a whole (their internals are not followed), by type
LEAVES: dict[type[nn.Module], Callable[..., None]] = rules_attention.LEAVES


class Tracer(ObserverMode):
    """Records label tensors for every floating tensor of a forward pass into ``graph``."""

    def __init__(self, model: nn.Module, graph: DependencyGraph) -> None:
        super().__init__()
        self.model = model
        self.graph = graph
        self.names: dict[int, str] = {}
        self._param_ids: set[int] = set()
        for n, p in model.named_parameters(remove_duplicate=False):
            self.names.setdefault(id(p), n)
            self._param_ids.add(id(p))
        for n, b in model.named_buffers(remove_duplicate=False):
            self.names.setdefault(id(b), n)
        self._labels: dict[int, torch.Tensor] = {}
        self._alive: list[torch.Tensor] = []  # keeps ids unique while tracing
        self.stack: list[tuple[str, nn.Module]] = []
        self.leaf_depth = 0
        self.calls: dict[str, int] = {}
        #: tensor id -> the channel split it carries, while the unit is undecided (rule_helpers)
        self.pending: dict[int, PendingSplit] = {}

    # ---- labels ------------------------------------------------------------------------------
    def set_labels(self, t: torch.Tensor, labels: torch.Tensor) -> None:
        if tuple(labels.shape) != tuple(t.shape):
            raise UnsupportedModelError(f"internal: label shape {tuple(labels.shape)} != {tuple(t.shape)} {self.where()}")
        self._labels[id(t)] = labels
        self._alive.append(t)

    def labels(self, t: torch.Tensor, *, bare: bool = True, buffers: bool = False) -> torch.Tensor | None:
        """Labels of ``t``; a model parameter used directly gets one item per element.

        A buffer is a constant (RoPE's ``inv_freq``, a fixed sin-cos table): what is computed from
        it carries no channel identity, else its elements would tie every channel they meet into
        one unit. Only an op that combines a buffer itself with channels (``x + pos_buffer``) asks
        for its elements (``buffers=True``), so that they are sliced with those channels.
        """
        got = self._labels.get(id(t))
        if got is not None:
            return got
        if not bare or not t.is_floating_point():
            return None
        name = self.names.get(id(t))
        if name is None or (not buffers and id(t) not in self._param_ids):
            return None
        mod = name.rsplit(".", 1)[0] if "." in name else ""
        c = self.graph.coord(name, None, t.numel(), ELEMENT, mod, tuple(t.shape))
        lab = self.graph.item_labels(c).view(t.shape)
        self.set_labels(t, lab)
        return lab

    def labels_or_blank(self, t: torch.Tensor) -> torch.Tensor:
        lab = self.labels(t)
        return lab if lab is not None else torch.full(t.shape, -1, dtype=torch.int64)

    def is_param(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and id(t) in self.names

    def param_name(self, t: torch.Tensor | None) -> str | None:
        return None if t is None else self.names.get(id(t))

    # ---- where ---------------------------------------------------------------------------------
    def where(self) -> str:
        if not self.stack:
            return f"in {type(self.model).__name__}.forward"
        name, mod = self.stack[-1]
        return f"in module '{name or '<root>'}' ({type(mod).__name__})"

    def module_name(self) -> str:
        return self.stack[-1][0] if self.stack else ""

    def unsupported(self, op: str, why: str = "") -> UnsupportedModelError:
        extra = f": {why}" if why else ""
        return UnsupportedModelError(f"pruning cannot trace channels through op '{op}' {self.where()}{extra}")

    # ---- the mode ------------------------------------------------------------------------------
    def observe(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        if self.leaf_depth:
            return
        name = func_name(func)
        self.calls[name] = self.calls.get(name, 0) + 1
        handle(self, name, func, args, kwargs, out)


def handle(tr: Tracer, name: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
    """Apply the rule for op ``name``; ops on unlabeled tensors only are left alone."""
    module_rule = MODULE_OPS.get(name)
    if module_rule is not None:
        settle(tr, args, kwargs)
        module_rule(tr, name, func, args, kwargs, out)
        return
    if name == "setitem":
        rules.setitem(tr, name, func, args, kwargs, out)
        return
    if not any(True for _ in iter_tensors(out)):
        return  # sizes, dtypes, flags: no tensor comes out
    if not any(tr.labels(t) is not None for t in iter_tensors((args, kwargs))):
        return
    rule = RULES.get(name)
    if rule is None:
        raise tr.unsupported(name)
    if rule is not rules.layout:
        settle(tr, args, kwargs)
    rule(tr, name, func, args, kwargs, out)


def settle(tr: Tracer, args: Any, kwargs: Any) -> None:
    """A split channel dim reaching a computing op: its outer rows are the units (heads)."""
    if tr.pending:
        for t in iter_tensors((args, kwargs)):
            p = tr.pending.get(id(t))
            if p is not None:
                resolve(tr, p, pieces=False)


def leaf_rule(mod: nn.Module) -> Callable[..., None] | None:
    """A rule for a module traced as a whole (its internals are not followed), or None."""
    return LEAVES.get(type(mod))


def _hooks(tracer: Tracer, model: nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
    handles = []
    for name, mod in model.named_modules():
        leaf = leaf_rule(mod)

        def pre(m: nn.Module, args: Any, kwargs: Any, *, _n: str = name, _leaf: bool = leaf is not None) -> None:
            tracer.stack.append((_n, m))
            if _leaf or tracer.leaf_depth:
                tracer.leaf_depth += 1

        def post(
            m: nn.Module, args: Any, kwargs: Any, output: Any, *, _leaf: Callable[..., None] | None = leaf
        ) -> None:
            if _leaf is not None or tracer.leaf_depth:
                tracer.leaf_depth -= 1
                if _leaf is not None and not tracer.leaf_depth:
                    _leaf(tracer, m, args, kwargs, output)
            tracer.stack.pop()

        handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(mod.register_forward_hook(post, with_kwargs=True, always_call=True))
    return handles


def trace_dependencies(model: nn.Module, example_inputs: Any, *, grouped_conv: str = "groups") -> DependencyGraph:
    """Run ``model`` once on ``example_inputs`` and return its (unfinalized) dependency graph.

    The model runs in eval mode (restored after) so that tracing changes no statistics.
    ``grouped_conv``: ``groups`` removes whole groups of a grouped conv; ``width`` narrows every
    group alike (the group count stays; depthwise convs prune by channel either way).
    """
    graph = DependencyGraph()
    graph.grouped_conv = grouped_conv
    tracer = Tracer(model, graph)
    handles = _hooks(tracer, model)
    was_training = model.training
    # train() then eval(): modules that cache derived tensors in eval mode (LeViT's attention-bias
    # cache) drop them on train(), so the trace sees them computed from their parameters
    model.train()
    model.eval()
    try:
        with tracer:
            out = call_model(model, example_inputs)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    for p in tracer.pending.values():
        resolve(tracer, p, pieces=False)
    outs = list(iter_tensors(out))
    if not outs:
        raise UnsupportedModelError(f"{type(model).__name__} returned no tensor to trace")
    for t in outs:
        graph.output_shapes.append(tuple(t.shape))
        lab = tracer.labels(t, bare=False)
        if lab is not None:
            graph.pin(lab, "model output")
    log.debug("traced %s: %d items, ops %s", type(model).__name__, graph.num_items, tracer.calls)
    return graph
