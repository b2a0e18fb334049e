"""The ``distill`` recipe modifier: adds distillation terms to the task loss during a training stage.

    - type: distill
      teacher: self                      # or {name: resnet, kwargs: {width: 32}, checkpoint: t.pt}
      losses:
        - {type: kd, temperature: 4, weight: 1.0}
        - {type: feature, layers: {layer3: layer3}, weight: 0.5}

It combines with ``prune`` and ``qat`` in the same stage: feature hooks follow swapped modules and
adapters follow pruned widths. Per stage it reports the last epoch's mean of every term and, on
the calibration batches at the end, the divergence to the teacher (``distill.teacher_kl``,
``distill.top1_agreement``).
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar, Literal

import torch
from compress.distillation.api import Distiller, DistillParams
from compress.distillation.capture import check_layers
from compress.distillation.spec import FeatureLoss, TeacherSpec
from compress.distillation.teacher import build_teacher
from pydantic import Field, field_serializer, field_validator, model_validator
from torch import nn

from compress.core.modifier import Modifier, ModifierSpec, State, register_modifier

log = logging.getLogger(__name__)


class _DistillType(ModifierSpec):
    type: Literal["distill"] = "distill"
    teacher: TeacherSpec | None = None  # None is "self"; written "self" in recipes


# Settings class first: its fields follow ModifierSpec's and the teacher in the resolved recipe.
class DistillSpec(DistillParams, _DistillType):
    """Knowledge distillation from ``teacher`` (``self``, the default: the model before compression),
    with the settings of :class:`~compress.distillation.api.DistillParams` (what the Distiller takes:
    losses, task_weight, teacher_dtype). ``eval_batches`` calibration batches measure the divergence
    to the teacher when the stage ends (0: skip).
    """

    eval_batches: int = Field(8, ge=0)

    kind: ClassVar[str] = "distill"
    needs: ClassVar[frozenset[str]] = frozenset({"training"})

    @property
    def wants_snapshot(self) -> bool:  # type: ignore[override]  # the session reads it per spec
        """Only teacher ``self`` needs the session's frozen copy of the uncompressed model."""
        return self.teacher is None

    @field_validator("teacher", mode="before")
    @classmethod
    def _self_teacher(cls, v: Any) -> Any:
        # "self" and a model spec as one field: a union would report the wrong member's error
        if isinstance(v, str):
            if v == "self":
                return None
            raise ValueError(f"teacher must be 'self' or a model spec (name or hf_path, checkpoint, ...), not {v!r}")
        return v

    @field_serializer("teacher")
    def _write_teacher(self, v: TeacherSpec | None) -> Any:
        return "self" if v is None else v.model_dump(mode="json")

    @model_validator(mode="after")
    def _schedule_window(self) -> DistillSpec:
        if any(t.scheduled for t in self.losses) and self.end_epoch is None and self.end_step is None:
            raise ValueError("scheduled loss weights need end_epoch or end_step on the modifier (the schedule's length)")
        return self


@register_modifier
class DistillModifier(Modifier[DistillSpec]):
    """Handler of ``type: distill``."""

    spec_cls = DistillSpec

    def __init__(self, spec: DistillSpec, *, where: str = "") -> None:
        super().__init__(spec, where=where)
        self.distiller: Distiller | None = None
        self._sums: dict[str, torch.Tensor] = {}
        self._count = 0
        self._epoch_means: dict[str, float] = {}

    def plan(self, model: nn.Module) -> list[str]:
        layers = [s for t in self.spec.losses if isinstance(t, FeatureLoss) for s in t.layers]
        check_layers(model, layers, where=self.where, role="student")
        return list(dict.fromkeys(layers))

    def on_initialize(self, state: State) -> None:
        teacher = build_teacher(self.spec.teacher, state, dtype=self.spec.teacher_dtype, where=self.where)
        state.companions.append(teacher.model)  # sharded beside the student under FSDP2
        self.distiller = Distiller(teacher, state.model, params=self.spec, where=self.where)
        probe = _first_inputs(state)
        if probe is not None:
            # check the mapping and build adapters before the first step
            from compress.core.batching import to_device

            self.distiller.probe(to_device(probe, state.device))
        self.distiller.bind_optimizer(state.optimizer)

    def on_loss(self, state: State, loss: torch.Tensor, inputs: Any, outputs: Any) -> torch.Tensor:
        d = self._live()
        if state.model is not d.student:
            d.retarget(state.model)
        d.bind_optimizer(state.optimizer)  # the runner may build a new optimizer per stage
        total = d(inputs, outputs, loss, progress=self._progress(state))
        for k, v in d.last.items():
            self._sums[k] = self._sums[k] + v if k in self._sums else v.clone()
        self._count += 1
        return total

    def on_epoch_end(self, state: State) -> None:
        self._close_epoch()

    def progress_state(self, state: State) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The last epoch's term means and the feature adapters' weights (trained with the student;
        their optimizer state is the optimizer's). The teacher is a companion: the session saves it."""
        d = self._live()
        tensors = {f"adapters.{k}": v.detach().clone() for k, v in d.adapters.modules.state_dict().items()}
        return {"epoch_means": dict(self._epoch_means)}, tensors

    def load_progress(self, state: State, data: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        d = self._live()
        self._epoch_means = {k: float(v) for k, v in data["epoch_means"].items()}
        adapters = {k.removeprefix("adapters."): v for k, v in tensors.items() if k.startswith("adapters.")}
        if adapters:
            d.adapters.modules.load_state_dict(adapters)
        # in the optimizer before its saved state is loaded: the saved state holds the adapters' too
        d.bind_optimizer(state.optimizer)

    def on_finalize(self, state: State) -> None:
        d = self._live()
        self._close_epoch()
        for k, v in self._epoch_means.items():
            state.metrics[f"distill.train_{k}"] = v
        rows = [
            {"term": name, "type": t.type, "weight": t.weight_at(1.0), "last_epoch_mean": self._epoch_means.get(name)}
            for name, t in zip(d.names, d.terms)
        ]
        if self.spec.eval_batches and state.calibration_data is not None:
            for k, v in d.evaluate(state.calibration_data, max_batches=self.spec.eval_batches).items():
                state.metrics[f"distill.{k}"] = v
        state.tables[f"distill ({state.stage_name})"] = rows
        d.remove()
        state.companions[:] = [m for m in state.companions if m is not d.teacher.model]
        self.distiller = None

    # ---- helpers ---------------------------------------------------------------------------------
    def _live(self) -> Distiller:
        if self.distiller is None:
            from compress.core.errors import CompressError

            raise CompressError(f"{self.where}: the distiller is not set up")
        return self.distiller

    def _close_epoch(self) -> None:
        if self._count:
            self._epoch_means = {k: float(v) / self._count for k, v in self._sums.items()}
        self._sums, self._count = {}, 0

    def _progress(self, state: State) -> float:
        s = self.spec
        if s.end_step is not None:
            start = s.start_step or 0
            return (state.stage_step - start) / max(s.end_step - start, 1)
        if s.end_epoch is not None:
            return (state.stage_epoch - s.start_epoch) / max(s.end_epoch - s.start_epoch, 1e-9)
        return 0.0


def _first_inputs(state: State) -> Any:
    """One batch of inputs to probe with: the example inputs, else the first calibration or training batch."""
    if state.example_inputs is not None:
        return state.example_inputs
    from compress.core.batching import split_batch

    for source in (state.calibration_data, state.train_data):
        if source is None:
            continue
        for batch in source:
            return split_batch(batch)[0]
    return None
