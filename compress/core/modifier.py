"""Modifier specs, the modifier registry, lifecycle guards and the recipe's order rules.

A modifier spec (pydantic, ``extra="forbid"``) says *what* to do; a Modifier subclass is its one
handler and says *how*. Specs are discriminated by their ``type`` literal. Packages register their
modifiers with :func:`register_modifier`; compress.modifiers (the top floor) imports the built-in
modifier packages by name, so this module never imports quantization/, pruning/ or distillation/.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

from compress.core.errors import CompressError, RecipeError
from compress.core.registry import Registry

log = logging.getLogger(__name__)

class ModifierSpec(BaseModel):
    """Fields every modifier has: its ``type`` and its schedule inside the stage.

    Epochs and steps count from the start of the stage the modifier belongs to; ``end_*`` is
    exclusive and None means "until the stage ends". ``update_every`` spaces step updates.
    """

    # allow_inf_nan=False: like every recipe section, no modifier number means anything as inf or nan
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    type: str
    start_epoch: float = Field(0.0, ge=0)
    end_epoch: float | None = Field(None, ge=0)
    start_step: int | None = Field(None, ge=0)
    end_step: int | None = Field(None, ge=0)
    update_every: int = Field(1, ge=1)

    #: what the modifier does, for the order rules: "quantize", "prune", "sparsify", "rotate", "distill" or "other"
    kind: ClassVar[str] = "other"
    #: what the stage must provide: "calibration" (calibration batches) and/or "training" (epochs)
    needs: ClassVar[frozenset[str]] = frozenset()
    #: how its calibrate step runs the calibration batches: "whole-model" (each batch through the
    #: whole model) or "layer-by-layer" (one decoder layer at a time: the sequential pipeline)
    calibration_flow: ClassVar[str] = "whole-model"
    #: whether the session must snapshot the uncompressed model before anything touches it
    wants_snapshot: ClassVar[bool] = False

    @model_validator(mode="after")
    def _schedule_order(self) -> ModifierSpec:
        if self.end_epoch is not None and self.end_epoch <= self.start_epoch:
            raise ValueError(f"end_epoch ({self.end_epoch}) must be greater than start_epoch ({self.start_epoch})")
        if self.end_step is not None and self.end_step <= (self.start_step or 0):
            raise ValueError(f"end_step ({self.end_step}) must be greater than start_step ({self.start_step or 0})")
        return self


@dataclass
class State:
    """What modifiers see of the run: the model, the optimizer, progress and data.

    ``epoch`` and ``step`` are global; ``stage_epoch`` and ``stage_step`` count from the start of
    the current stage (what modifier schedules use). ``forward_loop(model)`` runs the model over
    the calibration batches; ``evaluate(model)`` returns the task metric on eval data;
    ``select_evaluate(model)`` the same metric on data kept apart from it, on which accuracy-aware
    quantization and metric sensitivity choose (``evaluate`` when None, so that a figure reported
    on eval data was not also tuned on it); any may be None when not provided.
    ``companions`` are the models a modifier runs beside ``model`` during training (its teacher).
    Modifiers report into ``metrics`` (scalars, per stage), ``tables`` (name -> rows, rendered in
    report.md) and may write files (plots) under ``out_dir`` (None outside a run folder), listing
    their paths in ``artifacts``.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    epoch: float = 0.0
    step: int = 0
    stage_index: int = 0
    stage_name: str = ""
    stage_start_epoch: float = 0.0
    stage_start_step: int = 0
    steps_per_epoch: int | None = None
    calibration_data: Iterable[Any] | None = None
    train_data: Iterable[Any] | None = None
    example_inputs: Any = None
    original_model: nn.Module | None = None
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    evaluate: Callable[[nn.Module], float] | None = None
    select_evaluate: Callable[[nn.Module], float] | None = None
    higher_is_better: bool = True  # of evaluate's metric (perplexity: False); a drop is a worsening
    metrics: dict[str, Any] = field(default_factory=dict)
    tables: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    out_dir: Path | None = None
    artifacts: list[str] = field(default_factory=list)
    #: models a modifier runs beside ``model`` while it trains (a distillation teacher): under FSDP2
    #: they are sharded and gathered with it
    companions: list[nn.Module] = field(default_factory=list)
    #: True while a stage resumed from a mid-stage checkpoint initializes: what initialize would
    #: compute and the checkpoint holds anyway (a teacher's training) may be skipped
    resuming: bool = False
    #: the batch sizes the run's model will be served and timed at (the recipe's validate.batch_sizes;
    #: None without validation): the cost table's model-level check decides int8 vs float for them
    serving_batch_sizes: tuple[int, ...] | None = None

    @property
    def stage_epoch(self) -> float:
        return self.epoch - self.stage_start_epoch

    @property
    def stage_step(self) -> int:
        return self.step - self.stage_start_step

    def forward_loop(self, model: nn.Module, *, max_batches: int | None = None, share: bool = False) -> int:
        """Run ``model`` over the calibration batches without grad; returns the sample count.

        ``share``: under torchrun, this rank's share of the batches only (:class:`RankShare`), for
        calibrations that reduce their statistics across the ranks."""
        from compress.core.batching import RankShare, batch_size_of, run_batch, split_batch, to_device

        if self.calibration_data is None:
            from compress.core.errors import CalibrationError

            raise CalibrationError("no calibration data: set data.calibration_samples in the recipe")
        seen = 0
        was_training = model.training
        model.eval()
        data: Iterable[Any] = self.calibration_data
        if share:
            data, max_batches = RankShare(data, max_batches=max_batches), None
        with torch.no_grad():
            for i, batch in enumerate(data):
                if max_batches is not None and i >= max_batches:
                    break
                inputs, _ = split_batch(batch)
                inputs = to_device(inputs, self.device)
                run_batch(model, inputs)
                seen += batch_size_of(inputs)
        model.train(was_training)
        return seen


class Phase(enum.Enum):
    NEW = "new"
    INITIALIZED = "initialized"
    FINALIZED = "finalized"


S = TypeVar("S", bound=ModifierSpec)


class Modifier(Generic[S]):
    """Base handler. Subclasses set ``spec_cls`` and override the ``on_*`` hooks they need.

    The public methods (initialize, calibrate, step, epoch_end, loss, finalize) guard the lifecycle:
    events before initialize or after finalize are errors, not silent no-ops. ``calibrate`` is a
    step of its own, which the stage's pipeline (compress.pipelines) calls after ``initialize`` for
    a modifier whose spec needs calibration; ``initialize`` never calibrates.
    """

    spec_cls: ClassVar[type[ModifierSpec]]
    #: whether :meth:`progress_state` captures all this modifier changes mid-stage (False: a stage
    #: holding it is not checkpointed mid-way, and resumes from its start)
    resumes_mid_stage: ClassVar[bool] = True

    def __init__(self, spec: S, *, where: str = "") -> None:
        self.spec = spec
        self.where = where or f"modifier '{spec.type}'"
        self.phase = Phase.NEW
        self._calibrated = False

    # ---- hooks for subclasses -------------------------------------------------------------
    def on_initialize(self, state: State) -> None:
        """Called once at stage start, before any data flows (after the model is on its device)."""

    def on_calibrate(self, state: State) -> None:
        """Called by :meth:`calibrate`, once, after initialize (the spec needs calibration data)."""

    def on_step(self, state: State) -> None:
        """Called after each optimizer step while the schedule is active."""

    def on_epoch_end(self, state: State) -> None:
        """Called at the end of every epoch of the stage."""

    def on_loss(self, state: State, loss: torch.Tensor, inputs: Any, outputs: Any) -> torch.Tensor:
        """Return the loss to backpropagate (e.g. with distillation terms added)."""
        return loss

    def on_finalize(self, state: State) -> None:
        """Called once at stage end; must leave the model runnable without this modifier."""

    def on_abort(self, state: State) -> None:
        """Called instead of finalize when the caller's loop raised: release what initialize attached
        (hooks on the model, a teacher, ...). The Session also removes any hook left on the model."""

    def plan(self, model: nn.Module) -> list[str]:
        """Names of the modules this modifier would touch (for ``--dry-run``)."""
        return []

    # ---- saved state: structure as data (compress/state.py iterates over the modifiers) ---------
    def save_state(self, model: nn.Module) -> dict[str, Any] | None:
        """JSON-ready data from which :meth:`restore_state` rebuilds, on the fresh float model, the
        structure this modifier gave ``model`` (None: no structure changed; the state_dict suffices)."""
        return None

    @classmethod
    def restore_state(cls, model: nn.Module, data: dict[str, Any], *, where: str) -> None:
        """Rebuild on ``model`` what :meth:`save_state` described, before the saved state_dict is loaded."""
        raise CompressError(f"{where}: modifier type '{cls.spec_cls.model_fields['type'].default}' saves no state")

    # ---- mid-stage checkpoints (the session saves them at a training epoch's end) --------------
    def progress_state(self, state: State) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """What this initialized modifier holds besides the model's state_dict and the optimizer's
        state, for a checkpoint at an epoch's end: JSON-ready data and tensors (which may differ
        between ranks). :meth:`load_progress` puts it back after the resumed stage initialized."""
        return {}, {}

    def load_progress(self, state: State, data: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Put back what :meth:`progress_state` saved; called once the resumed stage initialized and the
        optimizer is set, before the model's and the optimizer's saved state are loaded."""

    # ---- schedule ----------------------------------------------------------------------------
    def active(self, state: State) -> bool:
        """Whether the schedule covers the current stage epoch/step."""
        s = self.spec
        e = state.stage_epoch
        if e < s.start_epoch or (s.end_epoch is not None and e >= s.end_epoch):
            return False
        st = state.stage_step
        if s.start_step is not None and st < s.start_step:
            return False
        return not (s.end_step is not None and st >= s.end_step)

    # ---- guarded lifecycle ----------------------------------------------------------------
    def _require(self, phase: Phase, event: str) -> None:
        if self.phase is not phase:
            raise CompressError(f"{self.where}: '{event}' called while the modifier is {self.phase.value}")

    def initialize(self, state: State) -> None:
        self._require(Phase.NEW, "initialize")
        self.on_initialize(state)
        self.phase = Phase.INITIALIZED

    def calibrate(self, state: State) -> None:
        """Run the calibration step (``on_calibrate``): once, after initialize, for a spec that
        needs calibration data."""
        self._require(Phase.INITIALIZED, "calibrate")
        if "calibration" not in self.spec.needs:
            raise CompressError(f"{self.where}: 'calibrate' called, but '{self.spec.type}' needs no calibration")
        if self._calibrated:
            raise CompressError(f"{self.where}: 'calibrate' called twice")
        self._calibrated = True  # before the hook: a calibration that failed half-way is not run again
        self.on_calibrate(state)

    def step(self, state: State) -> None:
        self._require(Phase.INITIALIZED, "step")
        if self.active(state) and state.stage_step % self.spec.update_every == 0:
            self.on_step(state)

    def epoch_end(self, state: State) -> None:
        self._require(Phase.INITIALIZED, "epoch_end")
        self.on_epoch_end(state)

    def loss(self, state: State, loss: torch.Tensor, inputs: Any, outputs: Any) -> torch.Tensor:
        self._require(Phase.INITIALIZED, "loss")
        if not self.active(state):
            return loss
        return self.on_loss(state, loss, inputs, outputs)

    def finalize(self, state: State) -> None:
        self._require(Phase.INITIALIZED, "finalize")
        self.on_finalize(state)
        self.phase = Phase.FINALIZED

    def abort(self, state: State) -> None:
        """End an initialized modifier without finalizing it (the loop feeding it raised)."""
        if self.phase is Phase.INITIALIZED:
            self.phase = Phase.FINALIZED
            self.on_abort(state)


MODIFIERS: Registry[type[Modifier[Any]]] = Registry("modifier type")


def register_modifier(cls: type[Modifier[Any]]) -> type[Modifier[Any]]:
    """Class decorator: registers a Modifier under its spec's ``type`` literal."""
    default = cls.spec_cls.model_fields["type"].default
    if not isinstance(default, str):
        raise TypeError(f"{cls.spec_cls.__name__}.type needs a string default (its Literal)")
    MODIFIERS.add(default, cls)
    return cls


# ---- order rules: data, checked before the model is touched ---------------------------------


@dataclass(frozen=True)
class OrderRule:
    """``then`` may not come in a later stage than ``first`` (``within_stage``: nor after it in the
    same stage, where modifiers start in recipe order); ``why`` is the message."""

    first: str
    then: str
    why: str
    within_stage: bool = False


ORDER_RULES: tuple[OrderRule, ...] = (
    OrderRule(
        "quantize",
        "rotate",
        "rotations come before quantization (a rotation after it would move the weights off their "
        "calibrated grids); put the rotate modifier first",
        within_stage=True,
    ),
    OrderRule(
        "sparsify",
        "rotate",
        "a rotation mixes every weight of a row, so the pruned zeros would be filled; rotate first, then sparsify",
        within_stage=True,
    ),
    OrderRule(
        "quantize",
        "prune",
        "pruning after quantization would slice calibrated quantizers; put the prune stage first",
    ),
    OrderRule(
        "quantize",
        "sparsify",
        "sparsity comes before quantization (the quantizer's grid and GPTQ's updates are made for the weights "
        "as pruned); put the sparsity stage first",
        within_stage=True,
    ),
    OrderRule(
        "sparsify",
        "prune",
        "structured pruning after weight sparsity would cut the Linears whose masks keep the zeros; "
        "put the prune stage first",
        within_stage=True,
    ),
)


def check_order(kinds_per_stage: Sequence[Sequence[tuple[str, str]]]) -> None:
    """Raise RecipeError for a modifier that breaks an order rule.

    ``kinds_per_stage[i]`` lists ``(kind, where)`` of stage i's modifiers; ``where`` names the
    modifier (field path and line) in the message.
    """
    seen: dict[str, str] = {}
    for stage in kinds_per_stage:
        here: dict[str, str] = {}
        for kind, where in stage:
            for rule in ORDER_RULES:
                first = seen.get(rule.first) or (here.get(rule.first) if rule.within_stage else None)
                if kind == rule.then and first is not None:
                    raise RecipeError(f"{where}: '{kind}' after '{rule.first}' ({first}): {rule.why}")
            here.setdefault(kind, where)
        for kind, where in stage:
            seen.setdefault(kind, where)
