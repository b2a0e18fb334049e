"""The ``prune`` recipe modifier: one-shot, or iterative over epochs with fine-tuning in between,
with an optional sparsity-inducing phase (BN L1 or group lasso) before the first cut.

    - type: prune
      ratio: 0.5            # or target: {macs: 0.5}
      importance: l2        # l1 | l2 | bn_scale | taylor | random | activation
      steps: 4              # > 1: iterative; needs a training stage
      interval_epochs: 1
      schedule: agp         # cumulative ratio 1 - (1 - k/N)^3 (Zhu & Gupta) or linear
      sparsity: {kind: bn_l1, weight: 1.0e-4, epochs: 2}
      bn_recalibration_batches: 8   # re-estimate BatchNorm statistics after each cut (0: off)
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from compress.pruning.api import PruneParams, Pruner, check_ratio, taylor_grads
from compress.pruning.counting import count_macs, count_params
from compress.pruning.graph import DependencyGraph
from compress.pruning.plan import PruningPlan
from compress.pruning.recalibrate import recalibrate_bn
from compress.pruning.select import CostModel, eligible_groups, search_ratio
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

from compress.core.batching import split_batch
from compress.core.errors import CalibrationError, CompressError
from compress.core.modifier import Modifier, ModifierSpec, State, register_modifier
from compress.core.progress import report

log = logging.getLogger(__name__)


class SparsitySpec(BaseModel):
    """A regularizer added to the loss for ``epochs`` before the first pruning step."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["bn_l1", "group_lasso"] = "bn_l1"
    weight: float = Field(1e-4, gt=0)
    epochs: float = Field(1.0, gt=0)


class _PruneType(ModifierSpec):
    type: Literal["prune"] = "prune"


# Settings class first: its fields follow ModifierSpec's in the resolved recipe, then this class's own.
class PruneSpec(PruneParams, _PruneType):
    """Structured pruning: the settings of :class:`~compress.pruning.api.PruneParams` (what
    ``compress.prune`` takes: ``ratio`` or ``budget``, importance, ignore, ...), applied in ``steps``
    spaced ``interval_epochs`` apart along an ``agp`` or ``linear`` schedule, after an optional
    ``sparsity`` regularizer."""

    steps: int = Field(1, ge=1)
    interval_epochs: float = Field(1.0, gt=0)
    schedule: Literal["agp", "linear"] = "agp"
    sparsity: SparsitySpec | None = None

    kind: ClassVar[str] = "prune"

    @property
    def needs(self) -> frozenset[str]:  # type: ignore[override]  # training only when iterative
        needs = {"training"} if self.iterative else set()
        if self.importance == "activation":
            needs.add("calibration")  # the runner checks that calibration batches exist
        return frozenset(needs)

    @property
    def iterative(self) -> bool:
        return self.steps > 1 or self.sparsity is not None or self.start_epoch > 0

    @model_validator(mode="after")
    def _ratio_or_target(self) -> PruneSpec:
        from compress.core.errors import RecipeError

        try:
            check_ratio(self.ratio, self.budget, where="prune")
        except RecipeError as exc:
            raise ValueError(str(exc).removeprefix("prune: ")) from None
        return self

    def progress(self, k: int) -> float:
        """Fraction of the final sparsity reached after step ``k`` (1-based) of ``steps``."""
        t = k / self.steps
        return 1 - (1 - t) ** 3 if self.schedule == "agp" else t


@register_modifier
class PruneModifier(Modifier[PruneSpec]):
    """Runs the prune schedule; reports params/MACs before and after into ``state.metrics``."""

    spec_cls = PruneSpec
    # its steps reshape the model mid-stage (and the optimizer with it): a stage holding it resumes
    # from its start
    resumes_mid_stage = False

    def __init__(self, spec: PruneSpec, *, where: str = "") -> None:
        super().__init__(spec, where=where)
        self.pruner = Pruner(spec, where=self.where)
        self.pruning_plan = PruningPlan()
        self.done = 0
        self._example: Any = None
        self._before: tuple[int, int] = (0, 0)
        self._lasso: list[tuple[str, int, torch.Tensor]] = []
        self._lasso_atoms: torch.Tensor | None = None
        self._sizes: dict[str, int] = {}  # group key -> atom count before the first step
        self._rows: list[dict[str, Any]] = []  # per step and group: units and how many went

    def save_state(self, model: nn.Module) -> dict[str, Any]:
        return {"plan": self.pruning_plan.to_dict()}

    @classmethod
    def restore_state(cls, model: nn.Module, data: dict[str, Any], *, where: str) -> None:
        PruningPlan.from_dict(data["plan"], where=f"{where}: plan").apply(model)

    # ---- schedule -----------------------------------------------------------------------------
    def _epoch_of(self, k: int) -> float:
        """Stage epoch at which step ``k`` (0-based) runs."""
        s = self.spec
        lead = s.sparsity.epochs if s.sparsity is not None else 0.0
        return s.start_epoch + lead + k * s.interval_epochs

    def plan(self, model: nn.Module) -> list[str]:
        """Layers whose channels this modifier may remove (targets minus ignore; the model's
        outputs are always kept, which only the trace at run time can tell)."""
        from compress.pruning.api import _modules_of

        from compress.core.targets import select_modules

        self.pruner.rules(model)  # checks targets/overrides patterns before anything runs
        ignored = _modules_of(model, self.spec.ignore, f"{self.where}: ignore")
        kinds = (nn.modules.conv._ConvNd, nn.Linear, nn.MultiheadAttention, nn.Embedding)
        picked = select_modules(model, self.spec.targets, where=f"{self.where}: targets")
        return [n for n, m in picked.items() if isinstance(m, kinds) and n not in ignored]

    def on_initialize(self, state: State) -> None:
        self._example = _example_inputs(state, self.where)
        model = state.model
        self._before = (count_params(model), count_macs(model, self._example))
        if self.spec.sparsity is not None and self.spec.sparsity.kind == "group_lasso":
            self._prepare_lasso(model)
        self._run_due(state)

    def on_epoch_end(self, state: State) -> None:
        self._run_due(state)

    def on_loss(self, state: State, loss: torch.Tensor, inputs: Any, outputs: Any) -> torch.Tensor:
        sp = self.spec.sparsity
        if sp is None or self.done > 0 or state.stage_epoch >= self._epoch_of(0):
            return loss
        return loss + sp.weight * self._penalty(state.model)

    def on_finalize(self, state: State) -> None:
        if self.done < self.spec.steps:
            log.warning(
                "%s: stage ended after %d of %d prune steps; the remaining ones run now, without fine-tuning",
                self.where, self.done, self.spec.steps,
            )
            while self.done < self.spec.steps:
                self._step(state)
        after = (count_params(state.model), count_macs(state.model, self._example))
        state.metrics.update(
            {
                "prune_params_before": self._before[0],
                "prune_params_after": after[0],
                "prune_macs_before": self._before[1],
                "prune_macs_after": after[1],
                "prune_params_ratio": round(after[0] / max(1, self._before[0]), 4),
                "prune_macs_ratio": round(after[1] / max(1, self._before[1]), 4),
                "prune_steps": self.done,
            }
        )
        self.pruning_plan.summary = {k: state.metrics[k] for k in state.metrics if k.startswith("prune_")}
        state.tables["pruned_groups"] = self._rows
        if state.out_dir is not None:
            path = self.pruning_plan.save(state.out_dir / f"pruning_plan_{state.stage_name or 'stage'}.json")
            state.artifacts.append(str(path))

    def _run_due(self, state: State) -> None:
        while self.done < self.spec.steps and state.stage_epoch >= self._epoch_of(self.done) - 1e-9:
            self._step(state)

    # ---- one pruning step ----------------------------------------------------------------------
    def _step(self, state: State) -> None:
        s = self.spec
        model = state.model
        k = self.done + 1
        graph = self.pruner.trace(model, self._example)
        grads = None
        if s.importance == "taylor":
            data = state.train_data or state.calibration_data
            if data is None:
                raise CalibrationError(f"{self.where}: taylor importance needs training or calibration data")
            grads = taylor_grads(model, data, loss_fn=state.loss_fn, batches=s.importance_batches(), device=state.device)
        elif s.importance == "activation":
            from compress.pruning.activation import activation_stats

            data = state.calibration_data or state.train_data
            if data is None:
                raise CalibrationError(f"{self.where}: activation importance needs calibration or training data")
            grads = activation_stats(model, data, batches=s.importance_batches(), device=state.device)
        if s.ratio is not None and s.mode == "local":
            # cumulative ratios against each group's size before the first step (no compounding floors)
            base = {}
            for g in graph.prunable_groups():
                key = _group_key(graph, g)
                base[g.index] = self._sizes.setdefault(key, len(g.atoms))
            keep = self.pruner.select(
                model, graph, ratio=s.ratio * s.progress(k), budget=None, grads=grads, base_sizes=base
            )
        elif s.ratio is not None:
            prev = s.ratio * s.progress(k - 1)
            step_ratio = 1 - (1 - s.ratio * s.progress(k)) / (1 - prev)
            keep = self.pruner.select(model, graph, ratio=step_ratio, budget=None, grads=grads)
        else:
            assert s.budget is not None
            metric, frac = next(iter(s.budget.items()))
            goal = 1 - (1 - frac) * s.progress(k)
            keep = self._target_keep(model, graph, metric, goal, grads)
        for g in graph.prunable_groups():
            removed = int(sum(not keep[a] for a in g.atoms))
            if removed:
                self._rows.append(
                    {"step": k, "modules": ", ".join(g.modules[:3]) + (", ..." if len(g.modules) > 3 else ""),
                     "units": len(g.atoms), "removed": removed, "unit_width": g.width(graph)}
                )
        slices = self.pruner.cut(model, graph, keep, self._example, optimizer=state.optimizer)
        self.pruning_plan.add_step(slices)
        data = state.calibration_data or state.train_data
        if s.bn_recalibration_batches and data is not None:
            recalibrate_bn(model, data, batches=s.bn_recalibration_batches, device=state.device)
        self.done = k
        report(
            log, "%s: step %d/%d at epoch %.2f: params %d, MACs %d",
            self.where, k, s.steps, state.stage_epoch, count_params(model), count_macs(model, self._example),
        )

    def _target_keep(
        self, model: nn.Module, graph: DependencyGraph, metric: str, goal: float, grads: Any
    ) -> np.ndarray:
        from compress.pruning.importance import atom_scores

        cost = CostModel(graph, model)
        full = np.ones(len(graph.atoms), dtype=bool)
        now = cost.params(full) if metric == "params" else cost.macs(full) / max(1, _batch(self._example))
        original = self._before[0] if metric == "params" else self._before[1]
        frac = min(1.0, goal * original / max(1.0, now))
        scores = atom_scores(graph, model, self.spec.importance, grads=grads, seed=self.spec.seed)
        _, keep = search_ratio(graph, scores, self.pruner.rules(model), cost, metric=metric, fraction=frac)
        return keep

    # ---- sparsity ------------------------------------------------------------------------------
    def _prepare_lasso(self, model: nn.Module) -> None:
        graph = self.pruner.trace(model, self._example)
        groups = eligible_groups(graph, self.pruner.rules(model))
        prunable = np.zeros(len(graph.atoms), dtype=bool)
        for g in groups:
            for a in g.atoms:
                prunable[a] = graph.atoms[a].prunable
        params = dict(model.named_parameters())
        for c in graph.coords:
            p = params.get(c.key)
            if c.axis is None or p is None or not p.requires_grad:
                continue
            self._lasso.append((c.key, c.axis, torch.from_numpy(graph.coord_atoms(c).copy())))
        self._lasso_atoms = torch.from_numpy(prunable)

    def _penalty(self, model: nn.Module) -> torch.Tensor:
        sp = self.spec.sparsity
        assert sp is not None
        if sp.kind == "bn_l1":
            terms = [
                m.weight.abs().sum()
                for m in model.modules()
                if isinstance(m, (nn.modules.batchnorm._NormBase, nn.GroupNorm)) and m.weight is not None
            ]
            if not terms:
                raise CompressError(f"{self.where}: sparsity kind bn_l1 needs BatchNorm/GroupNorm layers; the model has none")
            return torch.stack(terms).sum()
        assert self._lasso_atoms is not None
        params = dict(model.named_parameters())
        sq = torch.zeros(self._lasso_atoms.numel(), device=next(model.parameters()).device)
        for key, axis, atoms in self._lasso:
            p = params[key]
            dims = [d for d in range(p.dim()) if d != axis]
            per = p.pow(2).sum(dim=dims) if dims else p.pow(2)
            sq = sq.index_add(0, atoms.to(sq.device), per)
        mask = self._lasso_atoms.to(sq.device)
        return torch.sqrt(sq[mask] + 1e-12).sum()


def _group_key(graph: DependencyGraph, g: Any) -> str:
    """A name for a group that survives pruning: its first producing tensor."""
    from compress.pruning.graph import OUT

    keys = sorted(graph.coords[ci].key for ci in g.coords if OUT in graph.coords[ci].roles)
    return keys[0] if keys else f"#{g.index}"


def _batch(inputs: Any) -> int:
    from compress.core.batching import batch_size_of

    return batch_size_of(inputs)


def _example_inputs(state: State, where: str) -> Any:
    if state.example_inputs is not None:
        return state.example_inputs
    for data in (state.calibration_data, state.train_data):
        if data is not None:
            for batch in data:
                inputs, _ = split_batch(batch)
                from compress.core.batching import to_device

                return to_device(inputs, state.device)
    raise CalibrationError(f"{where}: pruning needs example inputs (or calibration/training data) to trace the model")
