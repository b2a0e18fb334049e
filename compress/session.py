"""Session: drives a recipe's modifiers through the lifecycle from any training loop.

    with compress.Session(recipe, model, optimizer=opt, steps_per_epoch=len(loader)) as s:
        for epoch in range(s.total_epochs):
            for x, y in loader:
                out = s.model(x)
                loss = s.loss(F.cross_entropy(out, y), inputs=x, outputs=out)
                loss.backward(); opt.step(); opt.zero_grad(); s.step()
            s.epoch_end()
    compressed = s.model

Stages run in order, each on its pipeline (compress.pipelines: training, sequential, calibration
or data-free). The caller's loop feeds a training stage, which ends after its epochs (``epoch_end``)
or steps (``step``); a one-shot stage (no epochs or steps: PTQ, GPTQ, one-shot pruning) is one the
loop cannot feed, so the session runs it on its pipeline as soon as it reaches it: on entering, for
a leading one, and when the stage before it ends. ``compress apply`` instead runs every stage itself
(:meth:`Session.drive`, :meth:`Session.run_stage`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar, cast

import torch
from pydantic import ValidationError
from torch import nn

from compress.core.batching import require_module
from compress.core.errors import CompressError, RecipeError
from compress.core.modifier import Modifier, Phase, State
from compress.core.sparsity import apply_masks
from compress.core.trust import allow_code
from compress.distributed import DistributedSpec, distribute, gather, is_sharded
from compress.modifiers import modifier_class
from compress.pipelines import StageRun, pipeline_for, pipeline_name
from compress.recipe import Recipe, Stage, load_recipe

log = logging.getLogger(__name__)

PROGRESS_FORMAT = "compress.session-progress/1"


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
               "_state_dict_hooks", "_load_state_dict_pre_hooks")


def _hook_ids(model: nn.Module) -> set[tuple[int, str, int]]:
    """(module id, hook dict, handle id) of every hook on ``model``'s modules."""
    return {(id(m), d, h) for m in model.modules() for d in _HOOK_DICTS for h in getattr(m, d, {})}


def _remove_hooks_since(model: nn.Module, before: set[tuple[int, str, int]]) -> int:
    n = 0
    for m in model.modules():
        for d in _HOOK_DICTS:
            hooks = getattr(m, d, None)
            if not hooks:
                continue
            for h in [h for h in hooks if (id(m), d, h) not in before]:
                del hooks[h]
                n += 1
    return n


_F = TypeVar("_F", bound=Callable[..., Any])


def _trusted_calls(method: _F) -> _F:
    """Run a lifecycle method with the recipe's code allowed when the session trusts it: a modifier
    may load a teacher from its factory in any stage."""

    @functools.wraps(method)
    def wrapper(self: Session, *args: Any, **kwargs: Any) -> Any:
        with allow_code(self.trust_code):
            return method(self, *args, **kwargs)

    return cast(_F, wrapper)


def _distributed_spec(value: DistributedSpec | Mapping[str, Any]) -> DistributedSpec:
    if isinstance(value, DistributedSpec):
        return value
    try:
        return DistributedSpec.model_validate(dict(value))
    except (ValidationError, TypeError, ValueError) as exc:
        errs = exc.errors() if isinstance(exc, ValidationError) else None
        what = f"{'.'.join(str(p) for p in errs[0]['loc'])}: {errs[0]['msg']}" if errs else str(exc)
        raise RecipeError(f"Session(distributed=...): {what}") from None


@dataclass
class StageResult:
    """What a finished stage reported: its modifiers' metrics and tables."""

    name: str
    metrics: dict[str, Any] = field(default_factory=dict)
    tables: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    artifacts: list[str] = field(default_factory=list)


class Session:
    """Applies a recipe's stages to ``model`` as the caller's loop reports progress.

    ``calibration_data`` (an iterable of batches) feeds calibration modifiers; ``train_data``,
    ``loss_fn`` and ``evaluate`` are optional extras some modifiers use (Taylor importance,
    accuracy-aware PTQ; ``higher_is_better`` is the direction of its metric); ``select_evaluate``,
    the same metric on other data than ``evaluate``'s, is what accuracy-aware PTQ chooses on when given. The model is changed in
    place; ``s.model`` is the same object. A recipe naming its own code (a teacher's factory) is
    refused unless it was loaded with ``trust_code=True`` or ``trust_code=True`` is given here.

    Entered with ``with`` (:meth:`initialize`), the session follows the caller's loop: a one-shot
    stage runs on its pipeline when the session reaches it (a leading one on entering), since the
    loop cannot feed it. :meth:`drive` and :meth:`run_stage` run the stages explicitly instead.
    """

    def __init__(
        self,
        recipe: Recipe | str | Path | Mapping[str, Any],
        model: nn.Module,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        steps_per_epoch: int | None = None,
        calibration_data: Iterable[Any] | None = None,
        train_data: Iterable[Any] | None = None,
        example_inputs: Any = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        evaluate: Callable[[nn.Module], float] | None = None,
        select_evaluate: Callable[[nn.Module], float] | None = None,
        higher_is_better: bool = True,
        device: torch.device | str | None = None,
        out_dir: str | Path | None = None,
        distributed: DistributedSpec | Mapping[str, Any] | None = None,
        trust_code: bool = False,
    ) -> None:
        # a Recipe built in code (no source) has not been through load_recipe's needs and order
        # checks: run them, so that such a recipe fails here and not halfway through a run
        self.recipe = (recipe if isinstance(recipe, Recipe) and recipe.source is not None
                       else load_recipe(recipe, trust_code=trust_code))
        #: whether the recipe's own code (a teacher's factory, a metric) may run in this session
        self.trust_code = trust_code or self.recipe.trusts_code
        if not self.trust_code:
            self.recipe.require_trust()
        #: how :meth:`distribute` trains under torchrun: the recipe's ``distributed`` unless given here
        self.distributed = self.recipe.distributed if distributed is None else _distributed_spec(distributed)
        require_module(model, "Session: model")
        if device is None:
            p = next(model.parameters(), None)
            device = p.device if p is not None else torch.device("cpu")
        self.state = State(
            model=model,
            optimizer=optimizer,
            device=torch.device(device),
            steps_per_epoch=steps_per_epoch,
            calibration_data=calibration_data,
            train_data=train_data,
            example_inputs=example_inputs,
            loss_fn=loss_fn,
            evaluate=evaluate,
            select_evaluate=select_evaluate,
            higher_is_better=higher_is_better,
            out_dir=Path(out_dir) if out_dir is not None else None,
            serving_batch_sizes=(tuple(self.recipe.validate_.batch_sizes) or None) if self.recipe.validate_.enabled else None,
        )
        self.modifiers: list[list[Modifier[Any]]] = [
            [
                modifier_class(spec.type)(spec, where=self.recipe.where(f"stages.{i}.modifiers.{j}"))
                for j, spec in enumerate(stage.modifiers)
            ]
            for i, stage in enumerate(self.recipe.stages)
        ]
        self.results: list[StageResult] = []
        self._index = -1  # the stage in progress, or (between stages) the next one
        self._entered = False  # whether stage _index is in progress
        self._follow = False  # initialize: run the stages that follow one that ended (the caller's loop)
        self._initialized = False
        self._closed = False
        self._stage_callbacks: list[Callable[[Session], None]] = []
        self._stage_end_callbacks: list[Callable[[Session, StageResult], None]] = []
        self._epochs_done = 0
        self._epoch_steps = 0
        self._hooks_before: set[tuple[int, str, int]] = set()
        self._resume: dict[str, Any] | None = None  # a mid-stage checkpoint's progress, until initialize
        self._pending: dict[str, Any] | None = None  # ... then until the resumed stage starts

    # ---- properties ------------------------------------------------------------------------------
    @property
    def model(self) -> nn.Module:
        return self.state.model

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.state.optimizer

    @optimizer.setter
    def optimizer(self, opt: torch.optim.Optimizer | None) -> None:
        self.state.optimizer = opt

    @property
    def steps_per_epoch(self) -> int | None:
        """Optimizer steps per epoch (fractional epochs in schedules); a trainer may set it once."""
        return self.state.steps_per_epoch

    @steps_per_epoch.setter
    def steps_per_epoch(self, n: int | None) -> None:
        self.state.steps_per_epoch = n

    @property
    def finished(self) -> bool:
        """True once every stage has run."""
        return self._index >= len(self.recipe.stages)

    @property
    def stage_index(self) -> int:
        """The index of the stage in progress in ``recipe.stages`` (-1 before initialize; between
        stages run by :meth:`run_stage`, the next one's)."""
        return self._index

    @property
    def stage(self) -> Stage | None:
        """The stage in progress (None before initialize, between stages run by :meth:`run_stage`
        and after the last stage)."""
        return self.recipe.stages[self._index] if self._entered else None

    @property
    def total_epochs(self) -> int:
        """Epochs the caller's loop should run to pass through every training stage."""
        return sum(math.ceil(s.epochs) for s in self.recipe.stages if s.steps is None)

    def distribute(self) -> nn.Module:
        """The model to call in a training loop under torchrun, by :attr:`distributed`: the model in
        one process; a DDP wrapper; or (``fsdp``) the model sharded in place with FSDP2, the
        session's optimizer moved onto its shards and a distillation teacher sharded too. Call it
        once a training stage has started (build the optimizer first); the session gathers the
        weights back before the stage's modifiers finalize, so call it again in the next stage."""
        st = self.state
        return distribute(st.model, self.distributed, device=st.device, optimizer=st.optimizer,
                          companions=st.companions)

    def gather(self) -> None:
        """Undo :meth:`distribute`'s sharding: every rank gets the full plain weights back (the
        optimizer's state follows), e.g. to evaluate mid-stage; a collective, every rank calls it.
        No-op unless sharded; the next :meth:`distribute` shards again."""
        st = self.state
        if is_sharded(st.model) or any(is_sharded(c) for c in st.companions):
            gather(st.model, optimizer=st.optimizer, companions=st.companions)

    def on_stage_start(self, fn: Callable[[Session], None]) -> None:
        """Call ``fn(session)`` whenever a training stage starts (e.g. a callback that rebuilds its
        optimizer per stage; the built-in runner builds one per stage in ``Trainer.fit`` instead)."""
        self._stage_callbacks.append(fn)

    def on_stage_end(self, fn: Callable[[Session, StageResult], None]) -> None:
        """Call ``fn(session, result)`` after each stage's modifiers finalize (the runner measures there)."""
        self._stage_end_callbacks.append(fn)

    # ---- lifecycle -------------------------------------------------------------------------------
    @_trusted_calls
    def initialize(self) -> Session:
        """Check every modifier's targets against the model, then enter the first stage, running
        the one-shot stages in front of the first training stage (the caller's loop feeds that one).
        From here on the session follows the loop: when a stage ends, the next ones start."""
        self._begin("initialize")
        self._follow = True
        self._advance()
        return self

    @_trusted_calls
    def begin(self) -> Session:
        """What :meth:`initialize` checks and prepares, entering no stage: the caller then runs
        each stage with :meth:`run_stage` (see :meth:`drive`)."""
        self._begin("begin")
        return self

    @contextlib.contextmanager
    def drive(self) -> Iterator[Session]:
        """``with session.drive():`` :meth:`begin`s the session for the caller to run each stage
        with :meth:`run_stage` (what ``compress apply`` does); on leaving it finalizes (running any
        stage left), or aborts when the block raised, as ``with session:`` does."""
        try:
            self.begin()
            yield self
        except BaseException:
            self.abort()  # a stage that failed may have attached hooks already
            raise
        if not self._closed:
            self.finalize()

    @_trusted_calls
    def run_stage(self, feed: Callable[[Session], None] | None = None) -> Stage:
        """Enter the next stage and run it on its pipeline (:func:`compress.pipelines.pipeline_for`);
        returns it. A one-shot stage runs whole and ends here. A training stage is fed by
        ``feed(session)`` (e.g. a ``Trainer.fit`` with this session) until it ends; without ``feed``
        it is left in progress for the caller's loop (:meth:`step`, :meth:`epoch_end`)."""
        self._require_live("run_stage")
        if self.stage is not None:
            raise CompressError(f"Session.run_stage: stage '{self.stage.name}' is still in progress")
        if self.finished:
            raise CompressError("Session.run_stage: every stage has run")
        return self._run_next(feed)

    def _begin(self, event: str) -> None:
        if self._initialized:
            raise CompressError(f"Session.{event} called twice")
        self._initialized = True
        self._hooks_before = _hook_ids(self.state.model)
        # targets are checked for all stages before anything touches the model
        for mods in self.modifiers:
            for m in mods:
                m.plan(self.state.model)
        if any(spec.wants_snapshot for st in self.recipe.stages for spec in st.modifiers):
            self.state.original_model = copy.deepcopy(self.state.model).eval()
            for p in self.state.original_model.parameters():
                p.requires_grad_(False)
        self._index = 0
        if self._resume is not None:
            self._pending, self._resume = self._resume, None
            self._restore_finished(self._pending)

    # ---- mid-stage checkpoints -------------------------------------------------------------------
    @property
    def resumable(self) -> bool:
        """Whether the training stage in progress can be checkpointed mid-way (:meth:`progress`): every
        modifier in it saves what it changes mid-stage (a pruning schedule, which reshapes the model
        between its steps, does not: such a stage resumes from its start)."""
        stage = self.stage
        return stage is not None and stage.trains and all(m.resumes_mid_stage for m in self._current())

    def progress(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Where the session is, for a checkpoint at the end of an epoch of a training stage: JSON-ready
        data (the stage, the counters, what the finished stages built, as :mod:`compress.state` saves
        it, and each current modifier's :meth:`~compress.core.modifier.Modifier.progress_state`) and
        the modifiers' tensors. The model's and optimizer's state (and the companions') are the
        caller's to save beside it; :meth:`resume` and :meth:`load_progress` continue from both."""
        self._require_live("progress")
        stage = self.stage
        if stage is None or not stage.trains:
            raise CompressError("Session.progress: no training stage in progress")
        if not self.resumable:
            names = [m.spec.type for m in self._current() if not m.resumes_mid_stage]
            raise CompressError(f"Session.progress: stage '{stage.name}' cannot be resumed mid-way ({', '.join(names)})")
        st = self.state
        finished = [[{"type": m.spec.type, "state": m.save_state(st.model)} for m in mods]
                    for mods in self.modifiers[: self._index]]
        tensors: dict[str, torch.Tensor] = {}
        current = []
        for j, m in enumerate(self._current()):
            data, ts = m.progress_state(st)
            current.append(data)
            tensors.update({f"{j}.{k}": v for k, v in ts.items()})
        progress = {
            "format": PROGRESS_FORMAT, "stage": self._index, "stage_name": stage.name,
            "epochs_done": self._epochs_done, "epoch": st.epoch, "step": st.step,
            "stage_start_epoch": st.stage_start_epoch, "stage_start_step": st.stage_start_step,
            "finished": finished, "results": [dataclasses.asdict(r) for r in self.results],
            "metrics": st.metrics, "tables": st.tables, "artifacts": st.artifacts, "modifiers": current,
        }
        return progress, tensors

    def resume(self, progress: Mapping[str, Any]) -> None:
        """Continue from a :meth:`progress` checkpoint instead of from the first stage; call it
        before ``initialize`` on a session built as the checkpointed one was (same recipe, the
        model as it was before the first stage). ``initialize`` then rebuilds what the finished
        stages made from their saved state (no training, no calibration), initializes the
        checkpoint's stage and sets the counters to the checkpoint's epoch; then set the optimizer,
        call :meth:`load_progress` and load the model's and optimizer's saved state."""
        if self._initialized:
            raise CompressError("Session.resume: call it before initialize")
        if progress.get("format") != PROGRESS_FORMAT:
            raise CompressError(f"Session.resume: not a session checkpoint (format {progress.get('format')!r})")
        k = int(progress["stage"])
        if not 0 <= k < len(self.recipe.stages) or self.recipe.stages[k].name != progress["stage_name"]:
            raise CompressError(f"Session.resume: the checkpoint's stage {k} '{progress['stage_name']}' is not "
                                "a stage of this recipe")
        self._resume = dict(progress)

    def load_progress(self, progress: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> None:
        """Give the resumed stage's modifiers what :meth:`progress` saved of them (after
        ``initialize`` with :meth:`resume`, once the optimizer is set)."""
        self._require_live("load_progress")
        if int(progress["stage"]) != self._index:
            raise CompressError(f"Session.load_progress: the checkpoint is of stage {progress['stage']}, "
                                f"the session is in stage {self._index}")
        for j, (m, data) in enumerate(zip(self._current(), progress["modifiers"])):
            prefix = f"{j}."
            m.load_progress(self.state, data, {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)})

    def _restore_finished(self, progress: Mapping[str, Any]) -> None:
        """Rebuild the finished stages' structure from their saved state (pruning plans replayed,
        quantizers prepared), as :func:`compress.state.restore_compressed` does for a final model."""
        k = int(progress["stage"])
        for i, saved in enumerate(progress["finished"][:k]):
            for j, (m, entry) in enumerate(zip(self.modifiers[i], saved)):
                if entry["state"] is not None:
                    modifier_class(entry["type"]).restore_state(
                        self.state.model, entry["state"], where=self.recipe.where(f"stages.{i}.modifiers.{j}"))
                m.phase = Phase.FINALIZED
                # it never ran here: what it saves (into final.pt, the next checkpoint) is what it saved then
                setattr(m, "save_state", lambda model, data=entry["state"]: data)  # noqa: B010
        self.results = [StageResult(**r) for r in progress["results"]]
        st = self.state
        self._index = k
        st.epoch, st.step = float(progress["stage_start_epoch"]), int(progress["stage_start_step"])
        log.info("resuming stage '%s' at epoch %d: %d finished stage(s) rebuilt from their saved state",
                 progress["stage_name"], progress["epochs_done"], k)

    def plan(self) -> list[dict[str, Any]]:
        """The resolved plan: per stage, the pipeline it runs on, each modifier and the modules it
        matches (no changes made)."""
        out = []
        for stage, mods in zip(self.recipe.stages, self.modifiers):
            out.append(
                {
                    "stage": stage.name,
                    "epochs": stage.epochs,
                    "steps": stage.steps,
                    "pipeline": pipeline_name(stage),
                    "modifiers": [{"type": m.spec.type, "modules": m.plan(self.state.model)} for m in mods],
                }
            )
        return out

    def _require_live(self, event: str) -> None:
        if not self._initialized:
            raise CompressError(f"Session.{event} called before initialize (use 'with Session(...)')")
        if self._closed:
            raise CompressError(f"Session.{event} called after finalize")

    def _advance(self) -> None:
        """Run the next stages on their pipelines until one waits for the caller's loop (a training
        stage) or none is left."""
        while not self.finished and self.stage is None:
            self._run_next(None)

    def _run_next(self, feed: Callable[[Session], None] | None) -> Stage:
        """Enter stage ``_index`` and have its pipeline run it (a resumed stage: as it was at its start)."""
        k, stage = self._index, self.recipe.stages[self._index]
        st = self.state
        st.stage_index, st.stage_name = k, stage.name
        st.stage_start_epoch, st.stage_start_step = st.epoch, st.step
        st.metrics, st.tables, st.artifacts = {}, {}, []
        self._epochs_done, self._epoch_steps = 0, 0
        self._entered = True
        pipeline = pipeline_for(stage)
        log.info("stage '%s' starts (%s pipeline)", stage.name, pipeline.name)
        run = StageRun(
            name=stage.name, state=st, modifiers=self.modifiers[k], started=self._stage_started,
            end=self._end_stage, in_progress=lambda: self._entered and self._index == k,
        )
        st.resuming = self._pending is not None
        try:
            pipeline.run(run, None if feed is None else lambda: feed(self))
        finally:
            st.resuming = False
        return stage

    def _stage_started(self) -> None:
        """A training stage's modifiers started: tell the callbacks; a resumed stage gets its counters back."""
        for fn in self._stage_callbacks:
            fn(self)
        progress, self._pending = self._pending, None
        if progress is None:
            return
        st = self.state
        st.resuming = False
        st.epoch, st.step = float(progress["epoch"]), int(progress["step"])
        self._epochs_done = int(progress["epochs_done"])
        st.metrics, st.tables = dict(progress["metrics"]), dict(progress["tables"])
        st.artifacts = list(progress["artifacts"])

    def _end_stage(self) -> None:
        stage = self.recipe.stages[self._index]
        self.gather()  # modifiers finalize on plain weights (calibration, pruning surgery, saving, export)
        apply_masks(self.state.model)
        for m in self.modifiers[self._index]:
            m.finalize(self.state)
        result = StageResult(stage.name, dict(self.state.metrics), dict(self.state.tables), list(self.state.artifacts))
        self.results.append(result)
        for fn in self._stage_end_callbacks:
            fn(self, result)
        log.info("stage '%s' done", stage.name)
        self._entered = False
        self._index += 1

    def _stage_done(self) -> None:
        """The training stage's epochs or steps are done: end it; following the caller's loop, run
        the next stages (the one-shot ones whole)."""
        self._end_stage()
        if self._follow:
            self._advance()

    @_trusted_calls
    def step(self) -> None:
        """Report one optimizer step."""
        self._require_live("step")
        st = self.state
        # pruned weights (SparseGPT, Wanda) stay zero whatever the optimizer did to them
        apply_masks(st.model)
        st.step += 1
        self._epoch_steps += 1
        if st.steps_per_epoch:
            frac = min(self._epoch_steps / st.steps_per_epoch, 1.0 - 1e-9)
            st.epoch = st.stage_start_epoch + self._epochs_done + frac
        for m in self._current():
            m.step(st)
        stage = self.stage
        if stage is not None and stage.steps is not None and st.stage_step >= stage.steps:
            self._stage_done()

    @_trusted_calls
    def epoch_end(self) -> None:
        """Report the end of an epoch; ends the stage when its epochs are done."""
        self._require_live("epoch_end")
        st = self.state
        self._epochs_done += 1
        self._epoch_steps = 0
        st.epoch = st.stage_start_epoch + self._epochs_done
        for m in self._current():
            m.epoch_end(st)
        stage = self.stage
        if stage is not None and stage.steps is None and self._epochs_done >= stage.epochs - 1e-9:
            self._stage_done()

    def loss(self, loss: torch.Tensor, *, inputs: Any = None, outputs: Any = None) -> torch.Tensor:
        """The loss to backpropagate: ``loss`` plus any terms the active modifiers add."""
        self._require_live("loss")
        for m in self._current():
            loss = m.loss(self.state, loss, inputs, outputs)
        return loss

    @_trusted_calls
    def finalize(self) -> nn.Module:
        """Finish the current stage and run any stages left (a training stage left ends at once,
        untrained); returns the compressed model."""
        self._require_live("finalize")
        while not self.finished:
            stage = self.stage
            if stage is None:
                self._run_next(None)
                continue
            if stage.trains and self.state.stage_epoch <= 0 and self.state.stage_step == 0:
                log.warning("stage '%s' ended before any training", stage.name)
            self._end_stage()
        self._closed = True
        return self.state.model

    def _current(self) -> list[Modifier[Any]]:
        return self.modifiers[self._index] if self._entered else []

    def __enter__(self) -> Session:
        try:
            return self.initialize()
        except BaseException:
            self.abort()  # a stage that failed to start may have attached hooks already
            raise

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None and not self._closed:
            self.finalize()
        elif not self._closed:
            self.abort()
        self._closed = True

    def abort(self) -> None:
        """End the session after the caller's loop failed: the current stage's modifiers release what
        they attached, and every hook added to the model since initialize is removed. The model keeps
        the changes finished stages made; it is not finalized (no calibration, no pruning surgery)."""
        if self._closed or not self._initialized:
            self._closed = True
            return
        self._closed = True
        for m in self._current():
            try:
                m.abort(self.state)
            except Exception:  # the caller's exception is the one to see; log this one
                log.exception("%s: abort failed", m.where)
        removed = _remove_hooks_since(self.state.model, self._hooks_before)
        if removed:
            log.info("session aborted: removed %d hook(s) left on the model", removed)
