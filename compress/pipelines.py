"""Stage pipelines: how data flows through one stage of a recipe.

Every stage runs on one pipeline, picked from the stage (epochs/steps) and its modifiers' declared
needs (:attr:`~compress.core.modifier.ModifierSpec.needs`,
:attr:`~compress.core.modifier.ModifierSpec.calibration_flow`) by :func:`pipeline_name`:

- ``training``: the stage has epochs or steps; a training loop (the built-in Trainer, or the
  caller's own loop around a Session) feeds it batches, and the session ends it when they are done;
- ``sequential``: a one-shot stage with a modifier that calibrates layer by layer (gptq, awq);
- ``calibration``: a one-shot stage with a modifier that runs calibration batches through the whole
  model (ptq, activation-importance pruning);
- ``data-free``: a one-shot stage that needs no data (one-shot pruning by weight magnitude).

Mixed needs share one pipeline by this rule: a stage with epochs or steps is a training stage, and
its calibrating modifiers calibrate when it starts, before the first batch; in a one-shot stage the
sequential pipeline hosts whole-model calibrators too. A one-shot stage whose modifier needs
training is refused when the recipe loads (compress.recipe), so no stage lacks a pipeline.

In every pipeline the modifiers start in recipe order and each one that needs calibration
calibrates right after it initializes, before the next one initializes: each sees the model as the
modifiers before it in the stage left it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from compress.core.modifier import Modifier, State
from compress.core.registry import Registry
from compress.recipe import Stage

#: feeds the training stage in progress with batches (e.g. one Trainer.fit call); the session ends
#: the stage when its epochs or steps are done
Feed = Callable[[], None]


@dataclass(frozen=True)
class StageRun:
    """One entered stage, as the session hands it to the stage's pipeline."""

    name: str
    state: State
    modifiers: Sequence[Modifier[Any]]
    #: the stage's data starts flowing (the session calls its on_stage_start callbacks)
    started: Callable[[], None]
    #: finalize the stage's modifiers and record its result
    end: Callable[[], None]
    #: whether the stage has not ended yet
    in_progress: Callable[[], bool]


class Pipeline:
    """Runs one stage: starts its modifiers (initialize, then calibrate where needed), then lets its
    data flow; ``summary`` says how, in the plan and the log."""

    def __init__(self, name: str, summary: str) -> None:
        self.name = name
        self.summary = summary

    def run(self, stage: StageRun, feed: Feed | None = None) -> None:
        """Run ``stage``: a one-shot pipeline ends it before returning; see :class:`TrainingPipeline`."""
        self.start(stage)
        self.flow(stage, feed)

    def start(self, stage: StageRun) -> None:
        for m in stage.modifiers:
            m.initialize(stage.state)
            if "calibration" in m.spec.needs:
                m.calibrate(stage.state)

    def flow(self, stage: StageRun, feed: Feed | None) -> None:
        """One-shot: everything happened in :meth:`start`; the stage ends now."""
        stage.end()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class TrainingPipeline(Pipeline):
    """Epochs or steps of training: once the modifiers started, ``feed`` (the runner's Trainer) runs
    until the session ends the stage. Without a feed the stage is left in progress for the caller's
    own loop, which reports each step and epoch to the session."""

    def flow(self, stage: StageRun, feed: Feed | None) -> None:
        stage.started()
        if feed is None:
            return
        while stage.in_progress():
            feed()


PIPELINES: Registry[Pipeline] = Registry("pipeline")
for _p in (
    TrainingPipeline("training", "epochs or steps of training batches"),
    Pipeline("sequential", "calibration batches through one decoder layer at a time"),
    Pipeline("calibration", "calibration batches through the whole model"),
    Pipeline("data-free", "no data"),
):
    PIPELINES.add(_p.name, _p)


def pipeline_name(stage: Stage) -> str:
    """The name of the pipeline ``stage`` runs on (the rule in this module's docstring)."""
    if stage.trains:
        return "training"
    calibrating = [spec for spec in stage.modifiers if "calibration" in spec.needs]
    if any(spec.calibration_flow == "layer-by-layer" for spec in calibrating):
        return "sequential"
    return "calibration" if calibrating else "data-free"


def pipeline_for(stage: Stage) -> Pipeline:
    """The pipeline ``stage`` runs on."""
    return PIPELINES.get(pipeline_name(stage))
