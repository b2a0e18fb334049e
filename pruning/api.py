"""``compress.prune``: dependency-aware structured pruning that physically shrinks a model."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, cast

import numpy as np
import torch
import torch.nn.functional as F
from compress.pruning.apply import apply_slices, slices_from_keep
from compress.pruning.counting import count_macs, count_params
from compress.pruning.graph import DependencyGraph
from compress.pruning.importance import IMPORTANCE, atom_scores
from compress.pruning.plan import PruningPlan
from compress.pruning.recalibrate import recalibrate_bn
from compress.pruning.select import CostModel, SelectionRules, choose, override_pairs, search_ratio
from compress.pruning.trace import trace_dependencies
from pydantic import Field, field_validator
from torch import nn

from compress.core.batching import (
    CalibrationData,
    as_batches,
    call_model,
    is_forward_function,
    primary_output,
    require_module,
    split_batch,
    to_device,
)
from compress.core.errors import CalibrationError, RecipeError, UnsupportedModelError
from compress.core.moe import is_packed_experts, unpack_experts
from compress.core.params import Selection, refuse_renamed
from compress.core.progress import bar, with_progress
from compress.core.targets import select_modules
from compress.core.tracing import iter_tensors

log = logging.getLogger(__name__)


class PruneParams(Selection):
    """The settings of structured pruning: :func:`prune` takes them and the ``prune`` recipe
    modifier is made of them (pruning/modifiers.py).

    ``ratio`` (in [0, 1)) of every coupled group's channels goes, or the model is cut until it has
    ``budget`` of its original size, ``{"macs": 0.5}`` or ``{"params": 0.3}`` (exactly one of the
    two). ``importance``: how channels are scored (``l1``, ``l2``, ``bn_scale``, ``taylor``,
    ``random``, ``activation``). ``ignore``: module patterns whose outputs keep every channel (the
    model's outputs always do); ``targets`` restricts pruning to groups whose producing modules match
    (e.g. only attention heads). ``round_to`` keeps channel counts multiples of N.
    ``mode``: ``local`` removes the ratio from every coupled group, ``global`` ranks all groups'
    channels against one threshold. ``max_ratio`` caps what any group may lose. ``overrides`` maps
    module patterns to their own ratio. ``num_batches``: how many batches taylor / activation
    importance read (None: 4 for taylor, 8 for activation). ``bn_recalibration_batches``
    re-estimates BatchNorm statistics on that many batches after the cut (0: off; nothing happens
    without data). ``grouped_conv``: ``groups`` removes whole groups of grouped convs (RegNet,
    ResNeXt); ``width`` keeps the group count and narrows every group alike, which keeps more of the
    network where the runtime runs any group width (ONNX Runtime and PyTorch do).
    """

    ratio: float | None = None
    budget: dict[str, float] | None = None
    importance: str = "l2"
    round_to: int = Field(1, ge=1)
    mode: Literal["local", "global"] = "local"
    max_ratio: float = Field(0.9, gt=0, lt=1)
    overrides: dict[str, float] = Field(default_factory=dict)
    bn_recalibration_batches: int = Field(8, ge=0)
    #: random importance's seed (numpy's default_rng: a non-negative integer)
    seed: int = Field(0, ge=0)
    grouped_conv: Literal["groups", "width"] = "groups"

    renamed: ClassVar[dict[str, str]] = {
        **Selection.renamed, "target": "budget", "taylor_batches": "num_batches", "activation_batches": "num_batches",
    }

    @field_validator("importance")
    @classmethod
    def _known_importance(cls, v: str) -> str:
        try:
            IMPORTANCE.get(v)
        except RecipeError as exc:
            raise ValueError(str(exc)) from None
        return v

    @field_validator("overrides")
    @classmethod
    def _ratios(cls, v: dict[str, float]) -> dict[str, float]:
        for k, r in v.items():
            if not 0 <= r < 1:
                raise ValueError(f"override ratio for '{k}' must be in [0, 1), got {r}")
        return v

    def importance_batches(self) -> int:
        """How many batches taylor / activation importance read."""
        return self.num_batches or (4 if self.importance == "taylor" else 8)


@dataclass
class PruneResult:
    """The pruned model (the same object that was passed in), its plan and size before/after."""

    model: nn.Module
    plan: PruningPlan
    params_before: int
    params_after: int
    macs_before: int
    macs_after: int
    groups: list[dict[str, Any]] = field(default_factory=list)
    #: groups kept whole because cutting them broke the model: modules, units, reason
    pinned: list[dict[str, Any]] = field(default_factory=list)

    @property
    def params_ratio(self) -> float:
        return self.params_after / max(1, self.params_before)

    @property
    def macs_ratio(self) -> float:
        return self.macs_after / max(1, self.macs_before)

    def metrics(self, prefix: str = "") -> dict[str, float]:
        return {
            f"{prefix}params_before": self.params_before,
            f"{prefix}params_after": self.params_after,
            f"{prefix}macs_before": self.macs_before,
            f"{prefix}macs_after": self.macs_after,
            f"{prefix}params_ratio": round(self.params_ratio, 4),
            f"{prefix}macs_ratio": round(self.macs_ratio, 4),
        }


def check_ratio(ratio: float | None, budget: Mapping[str, float] | None, *, where: str = "prune") -> None:
    """Exactly one of ``ratio`` in [0, 1) or ``budget`` ``{params|macs: fraction in (0, 1]}``."""
    if (ratio is None) == (budget is None):
        raise RecipeError(f"{where}: set exactly one of ratio (fraction of channels to remove) or budget ({{macs: 0.5}})")
    if ratio is not None and not (isinstance(ratio, (int, float)) and 0 <= ratio < 1):
        raise RecipeError(f"{where}: ratio must be in [0, 1), got {ratio!r}")
    if budget is not None:
        if len(budget) != 1 or next(iter(budget)) not in ("params", "macs"):
            raise RecipeError(f"{where}: budget takes one key, params or macs, got {dict(budget)!r}")
        frac = next(iter(budget.values()))
        if not (isinstance(frac, (int, float)) and 0 < frac <= 1):
            raise RecipeError(f"{where}: budget {next(iter(budget))} must be a fraction in (0, 1], got {frac!r}")


def _modules_of(model: nn.Module, patterns: Sequence[str], where: str) -> set[str]:
    if not patterns:
        return set()
    return set(select_modules(model, list(patterns), where=where))


def taylor_grads(
    model: nn.Module,
    data: Iterable[Any],
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    batches: int = 4,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """Gradients of the loss summed over ``batches`` batches, by parameter name."""
    params = dict(model.named_parameters())
    grads = {n: torch.zeros_like(p) for n, p in params.items() if p.requires_grad}
    was_training = model.training
    model.eval()
    seen = 0
    try:
        for i, batch in enumerate(bar(data, desc="taylor importance", cap=batches, unit="batch")):
            if i >= batches:
                break
            inputs, targets = split_batch(batch)
            inputs = to_device(inputs, device)
            with torch.enable_grad():
                out = call_model(model, inputs)
                if loss_fn is not None:
                    loss = loss_fn(out, to_device(targets, device))
                elif targets is not None:
                    loss = F.cross_entropy(primary_output(out), to_device(targets, device))
                else:
                    raise CalibrationError("taylor importance needs batches with targets, or a loss_fn")
                g = torch.autograd.grad(loss, [params[n] for n in grads], allow_unused=True)
            for n, gi in zip(grads, g):
                if gi is not None:
                    grads[n] += gi.detach()
            seen += 1
    finally:
        model.train(was_training)
    if not seen:
        raise CalibrationError("taylor importance got no batches")
    return grads


class Pruner:
    """One pruning pass: trace, score, choose, cut, check. Used by :func:`prune` and the modifier."""

    def __init__(self, params: PruneParams | None = None, *, where: str = "prune") -> None:
        self.params = params or PruneParams()
        self.where = where
        #: groups the last cut left whole because cutting them broke the model (modules, reason)
        self.pinned: list[dict[str, Any]] = []
        self._last_slices: dict[str, list[tuple[int, list[int]]]] = {}

    def trace(self, model: nn.Module, example_inputs: Any) -> DependencyGraph:
        packed = next((n for n, m in model.named_modules() if n and is_packed_experts(m)), None)
        if packed is not None:  # unpacking here would swap Parameters under a training loop's optimizer
            raise UnsupportedModelError(
                f"{self.where}: {packed} holds packed MoE experts (3D Parameters), which cannot be sliced per "
                "channel; call compress.core.moe.unpack_experts(model) before building the optimizer "
                "(compress.prune does it itself)")
        graph = trace_dependencies(model, example_inputs, grouped_conv=self.params.grouped_conv)
        graph.finalize(ignore_modules=_modules_of(model, self.params.ignore, f"{self.where}: ignore"))
        return graph

    def rules(self, model: nn.Module) -> SelectionRules:
        o = self.params
        eligible = None if o.targets == ["*"] else frozenset(_modules_of(model, o.targets, f"{self.where}: targets"))
        for pattern in o.overrides:
            _modules_of(model, [pattern], f"{self.where}: overrides")
        return SelectionRules(o.mode, o.max_ratio, o.round_to, override_pairs(o.overrides), eligible)

    def select(
        self,
        model: nn.Module,
        graph: DependencyGraph,
        *,
        ratio: float | None,
        budget: Mapping[str, float] | None,
        grads: Mapping[str, torch.Tensor] | None = None,
        base_sizes: Mapping[int, int] | None = None,
    ) -> np.ndarray:
        scores = atom_scores(graph, model, self.params.importance, grads=grads, seed=self.params.seed)
        rules = self.rules(model)
        if budget is not None:
            metric, frac = next(iter(budget.items()))
            r, keep = search_ratio(graph, scores, rules, CostModel(graph, model), metric=metric, fraction=frac)
            log.info("%s: budget %s=%.3g reached at ratio %.3f", self.where, metric, frac, r)
            return keep
        return choose(graph, scores, float(ratio or 0.0), rules, base_sizes=base_sizes)

    def cut(
        self,
        model: nn.Module,
        graph: DependencyGraph,
        keep: np.ndarray,
        example_inputs: Any,
        *,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> dict[str, list[tuple[int, list[int]]]]:
        """Apply the cut; a model that then fails to run (or changes its output shapes) is restored.

        When the whole cut fails, each group's part is tried alone: the groups whose cut breaks the
        model (code that hard-codes their width somewhere the trace cannot see) keep all their units
        and are listed in :attr:`pinned` with the error; the rest is cut. Only when no group alone
        is at fault is the model refused.
        """
        self.pinned = []
        failure = self._try(model, graph, keep, example_inputs, optimizer=optimizer, commit=True)
        if failure is None:
            return self._last_slices
        keep = keep.copy()
        for g in graph.groups:
            removed = [a for a in g.atoms if not keep[a]]
            if not removed:
                continue
            alone = np.ones_like(keep)
            alone[removed] = False
            why = self._try(model, graph, alone, example_inputs, optimizer=None, commit=False)
            if why is not None and self._other_width_attrs(model, graph, alone, example_inputs):
                why = None
            if why is not None:
                keep[removed] = True
                self.pinned.append({"modules": ", ".join(g.modules[:4]), "units": len(g.atoms), "reason": why})
                log.warning("%s: group of %s kept whole: cutting it alone breaks the model (%s)", self.where, ", ".join(g.modules[:3]), why)
        again = self._try(model, graph, keep, example_inputs, optimizer=optimizer, commit=True)
        if again is not None:
            culprit = "" if self.pinned else "; no group alone is at fault"
            raise UnsupportedModelError(f"{self.where}: the pruned {type(model).__name__} {again}{culprit}. Model restored.")
        return self._last_slices

    def _other_width_attrs(self, model: nn.Module, graph: DependencyGraph, keep: np.ndarray, example_inputs: Any) -> bool:
        """Try the other readings of the width attributes this cut changes until the cut runs: another
        attribute of the same value (one module), or none (the value came from elsewhere and only
        matched). Every combination, up to 64 tries."""
        import itertools

        removed = ~keep
        open_ = [
            i for i, (cands, labels) in enumerate(graph.width_attrs)
            if bool(removed[graph.label_atoms(labels).clamp(min=0).numpy()].any())
        ]
        if not open_:
            return False
        before = {i: graph.width_choice.get(i, 0) for i in open_}
        combos = itertools.product(*[range(len(graph.width_attrs[i][0]) + 1) for i in open_])
        for n, combo in enumerate(combos):
            if n >= 64:
                break
            graph.width_choice.update(zip(open_, combo))
            if self._try(model, graph, keep, example_inputs, optimizer=None, commit=False) is None:
                return True
        graph.width_choice.update(before)
        return False

    def _try(
        self,
        model: nn.Module,
        graph: DependencyGraph,
        keep: np.ndarray,
        example_inputs: Any,
        *,
        optimizer: torch.optim.Optimizer | None,
        commit: bool,
    ) -> str | None:
        """Cut, run once; restore and say why when it fails; restore anyway unless ``commit``."""
        slices = slices_from_keep(graph, keep)
        undo = apply_slices(model, slices, optimizer=optimizer)
        why: str | None = None
        was_training = model.training
        try:
            model.train()  # drops eval-mode caches of derived tensors (LeViT's biases): they hold old widths
            model.eval()
            with torch.no_grad():
                out = call_model(model, example_inputs)
            shapes = [tuple(t.shape) for t in iter_tensors(out)]
            if shapes != graph.output_shapes:
                why = f"changes the output shapes {graph.output_shapes} -> {shapes}"
        except Exception as exc:  # any failure of the user's forward: the model is restored below
            first = str(exc).splitlines()[0] if str(exc) else ""
            why = f"no longer runs ({type(exc).__name__}: {first})"
        finally:
            model.train()
            model.train(was_training)
        if why is not None or not commit:
            undo.undo()
            model.train()
            model.train(was_training)
        self._last_slices = slices
        return why


@with_progress
@refuse_renamed(target="budget", options="params")
def prune(
    model: nn.Module,
    example_inputs: Any,
    *,
    ratio: float | None = None,
    budget: Mapping[str, float] | None = None,
    importance: str | None = None,
    ignore: Sequence[str] | None = None,
    round_to: int | None = None,
    params: PruneParams | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    data: CalibrationData | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    progress: bool = True,
) -> PruneResult:
    """Remove ``ratio`` of the channels (or reach ``budget``, e.g. ``{"macs": 0.5}`` of the original)
    from every coupled group of ``model``, in place, and return a :class:`PruneResult`.

    ``example_inputs`` (a tensor, tuple or dict of keyword inputs) is run once to trace the channel
    dependencies. ``ratio``, ``budget``, ``importance``, ``ignore`` and ``round_to`` are the
    :class:`PruneParams` settings of the same names (where the others are). ``optimizer`` state is
    sliced along with the parameters. ``data`` (batches, or a forward function ``fn(model)``, as
    every one-shot call takes) feeds ``importance="activation"`` (Minitron: activation magnitudes,
    inputs only) and BatchNorm recalibration after the cut; ``importance="taylor"`` needs batches
    of ``(inputs, targets)`` (with ``loss_fn``, default cross-entropy). ``progress``: bars over the
    batches read (on a terminal) and the log lines; False: silent.
    """
    require_module(model, "prune: model")
    p = (params or PruneParams()).given("prune", ratio=ratio, budget=budget, importance=importance, ignore=ignore,
                                        round_to=round_to)
    importance = p.importance
    if example_inputs is None:
        raise RecipeError("prune: example_inputs is None; pass one batch the model takes (a tensor, a tuple "
                          "or a dict of keyword inputs): it is run once to trace the channel dependencies")
    check_ratio(p.ratio, p.budget)
    if optimizer is not None and any(is_packed_experts(m) for m in model.modules()):
        # checked before anything changes: unpacking makes new Parameters the optimizer does not hold
        raise UnsupportedModelError("prune: the model holds packed MoE experts; unpack them into per-expert Linears "
                                    "(compress.core.moe.unpack_experts) before building the optimizer")
    unpack_experts(model)
    if importance == "taylor" and data is not None and is_forward_function(data):
        raise CalibrationError("prune: importance='taylor' needs batches of (inputs, targets), not a forward function")
    pruner = Pruner(p)
    batches: Iterable[Any] | None = None
    if data is not None and is_forward_function(data):
        # run on the model as it is now, for as many batches as the steps below read (none: not at all)
        needed = max(p.importance_batches() if importance == "activation" else 0,
                     p.bn_recalibration_batches)
        batches = as_batches(data, model, max_batches=needed) if needed else None
    elif data is not None:
        batches = cast(Iterable[Any], data)  # batches as given: each step reads its own count
    params_before, macs_before = count_params(model), count_macs(model, example_inputs)
    graph = pruner.trace(model, example_inputs)
    grads = None
    if importance == "taylor":
        if batches is None:
            raise CalibrationError("prune: importance='taylor' needs data (batches of (inputs, targets))")
        device = next(model.parameters()).device
        grads = taylor_grads(model, batches, loss_fn=loss_fn, batches=p.importance_batches(), device=device)
    elif importance == "activation":
        if batches is None:
            raise CalibrationError("prune: importance='activation' needs data (calibration batches)")
        from compress.pruning.activation import activation_stats

        device = next(model.parameters()).device
        grads = activation_stats(model, batches, batches=p.importance_batches(), device=device)
    keep = pruner.select(model, graph, ratio=p.ratio, budget=p.budget, grads=grads)
    slices = pruner.cut(model, graph, keep, example_inputs, optimizer=optimizer)
    if batches is not None and p.bn_recalibration_batches:
        device = next(model.parameters()).device
        recalibrate_bn(model, batches, batches=p.bn_recalibration_batches, device=device)
    plan = PruningPlan()
    plan.add_step(slices)
    result = PruneResult(
        model,
        plan,
        params_before,
        count_params(model),
        macs_before,
        count_macs(model, example_inputs),
        graph.describe(),
        list(pruner.pinned),
    )
    plan.summary = dict[str, Any](result.metrics())
    if pruner.pinned:
        plan.summary["pinned"] = pruner.pinned
    log.info(
        "pruned %s: params %d -> %d, MACs %d -> %d",
        type(model).__name__,
        result.params_before,
        result.params_after,
        result.macs_before,
        result.macs_after,
    )
    return result

