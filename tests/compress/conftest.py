"""Shared fixtures for the core tests: test-only modifiers that record what the session tells them.

The modifier types are prefixed ``test_`` so that they never collide with the real ones (ptq, qat,
prune, distill) that quantization/, pruning/ and distillation/ register. Each records its lifecycle
events, with the progress counters it saw, into one shared log that the ``events`` fixture clears.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import pytest
import torch
from pydantic import Field
from torch import nn

from compress.core.modifier import MODIFIERS, Modifier, ModifierSpec, State, register_modifier
from compress.core.targets import select_modules

#: (modifier label, event, stage name, stage_epoch, stage_step) in the order the events arrived
EVENTS: list[tuple[str, str, str, float, int]] = []


class _Recording(Modifier[Any]):
    """Records every hook; ``label`` (from the spec) tells instances of one type apart."""

    def _rec(self, event: str, state: State) -> None:
        EVENTS.append(
            (self.spec.label or self.spec.type, event, state.stage_name, state.stage_epoch, state.stage_step)
        )

    def on_initialize(self, state: State) -> None:
        self._rec("initialize", state)

    def on_calibrate(self, state: State) -> None:
        self._rec("calibrate", state)

    def on_step(self, state: State) -> None:
        self._rec("step", state)

    def on_epoch_end(self, state: State) -> None:
        self._rec("epoch_end", state)

    def on_finalize(self, state: State) -> None:
        self._rec("finalize", state)

    def plan(self, model: nn.Module) -> list[str]:
        targets = getattr(self.spec, "targets", [])
        if not targets:
            return []
        return list(select_modules(model, targets, ignore=getattr(self.spec, "ignore", []), where=self.where))


class NoopSpec(ModifierSpec):
    """A modifier of kind "other" that needs nothing; varied fields for the recipe tests."""

    type: Literal["test_noop"] = "test_noop"
    label: str = ""
    targets: list[str] = Field(default_factory=list)
    ignore: list[str] = Field(default_factory=list)
    weight: float = Field(1.0, ge=0, le=10)
    mode: Literal["fast", "exact"] = "fast"
    options: dict[str, int] = Field(default_factory=dict)


class NoopModifier(_Recording):
    spec_cls = NoopSpec


class CalibSpec(ModifierSpec):
    """A quantize-kind modifier that needs calibration data (like PTQ)."""

    type: Literal["test_calib"] = "test_calib"
    label: str = ""
    bits: int = Field(8, ge=2, le=16)
    max_batches: int | None = Field(None, ge=1)

    kind: ClassVar[str] = "quantize"
    needs: ClassVar[frozenset[str]] = frozenset({"calibration"})


class CalibModifier(_Recording):
    """Runs ``state.forward_loop`` during calibration and reports what it saw into the metrics."""

    spec_cls = CalibSpec

    def on_calibrate(self, state: State) -> None:
        self._rec("calibrate", state)
        seen: list[tuple[int, bool, bool]] = []

        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            seen.append((int(args[0].shape[0]), module.training, torch.is_grad_enabled()))

        handle = state.model.register_forward_pre_hook(hook)
        try:
            samples = state.forward_loop(state.model, max_batches=self.spec.max_batches)
        finally:
            handle.remove()
        state.metrics["calib_samples"] = samples
        state.metrics["calib_batch_sizes"] = [n for n, _, _ in seen]
        state.metrics["calib_in_train_mode"] = any(t for _, t, _ in seen)
        state.metrics["calib_grad_enabled"] = any(g for _, _, g in seen)


class TrainingSpec(ModifierSpec):
    """A prune-kind modifier that needs training (like gradual pruning)."""

    type: Literal["test_train"] = "test_train"
    label: str = ""
    targets: list[str] = Field(default_factory=list)

    kind: ClassVar[str] = "prune"
    needs: ClassVar[frozenset[str]] = frozenset({"training"})


class TrainModifier(_Recording):
    spec_cls = TrainingSpec

    def on_finalize(self, state: State) -> None:
        self._rec("finalize", state)
        state.metrics["steps_seen"] = sum(
            1 for e in EVENTS if e[0] == (self.spec.label or self.spec.type) and e[1] == "step"
        )


class LossSpec(ModifierSpec):
    """A distill-kind modifier that snapshots the original model and adds ``scale`` to the loss."""

    type: Literal["test_loss"] = "test_loss"
    label: str = ""
    scale: float = 1.0

    kind: ClassVar[str] = "distill"
    wants_snapshot: ClassVar[bool] = True


class LossModifier(_Recording):
    spec_cls = LossSpec

    def on_loss(self, state: State, loss: torch.Tensor, inputs: Any, outputs: Any) -> torch.Tensor:
        self._rec("loss", state)
        return loss + self.spec.scale


TEST_MODIFIERS: dict[str, type[Modifier[Any]]] = {
    "test_noop": NoopModifier,
    "test_calib": CalibModifier,
    "test_train": TrainModifier,
    "test_loss": LossModifier,
}

for _name, _cls in TEST_MODIFIERS.items():
    if _name not in MODIFIERS:
        register_modifier(_cls)


@pytest.fixture
def events() -> list[tuple[str, str, str, float, int]]:
    """The shared event log, cleared for this test."""
    EVENTS.clear()
    yield EVENTS
    EVENTS.clear()


@pytest.fixture
def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


@pytest.fixture
def base_recipe() -> dict[str, Any]:
    """A small valid recipe as plain data: every section, a stage per test modifier."""
    return {
        "version": 1,
        "name": "base",
        "model": {"name": "tiny_mlp", "kwargs": {"hidden": 8}},
        "data": {"source": "synthetic", "calibration_samples": 16, "calibration_batch_size": 4},
        "train": {"epochs": 1, "batch_size": 8, "optimizer": "adamw", "lr": 0.01},
        "stages": [
            {
                "name": "prune",
                "epochs": 2,
                "modifiers": [{"type": "test_train", "label": "p", "end_epoch": 1.5}],
            },
            {"name": "calibrate", "modifiers": [{"type": "test_calib", "bits": 8}]},
            {"name": "polish", "steps": 4, "modifiers": [{"type": "test_noop", "update_every": 2}]},
        ],
        "export": {"opset": 17, "dynamic_batch": False},
        "validate": {
            "runtimes": ["onnxruntime"],
            "batch_sizes": [1, 4],
            "thresholds": {"max_accuracy_drop": 0.02},
        },
    }
