"""Stage pipelines: which one a stage runs on, the registry, the explicit calibrate step, the plan
naming them, and a session driven stage by stage (what ``compress apply`` does)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from compress.cli import main
from compress.core.errors import CompressError, RecipeError
from compress.core.modifier import Modifier, Phase, State
from compress.modifiers import modifier_class
from compress.pipelines import PIPELINES, Pipeline, TrainingPipeline, pipeline_for, pipeline_name
from compress.recipe import Stage, load_recipe
from compress.runner import plan
from compress.session import Session

Event = tuple[str, str, str, float, int]


def recipe(*stages: dict[str, Any], **top: Any) -> dict[str, Any]:
    return {"version": 1, "model": {"name": "m"}, "stages": list(stages), **top}


def loader(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 4, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(n)]


# ---- which pipeline a stage runs on ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("stage", "expected"),
    [
        ({"name": "s", "epochs": 2, "modifiers": [{"type": "test_noop"}]}, "training"),
        ({"name": "s", "steps": 5, "modifiers": [{"type": "test_train"}]}, "training"),
        # a training stage hosts calibrating modifiers: they calibrate when it starts
        ({"name": "s", "epochs": 1, "modifiers": [{"type": "ptq"}, {"type": "test_train"}]}, "training"),
        ({"name": "s", "modifiers": [{"type": "ptq"}]}, "calibration"),
        ({"name": "s", "modifiers": [{"type": "test_calib"}]}, "calibration"),
        ({"name": "s", "modifiers": [{"type": "prune", "ratio": 0.5, "importance": "activation"}]}, "calibration"),
        ({"name": "s", "modifiers": [{"type": "gptq"}]}, "sequential"),
        ({"name": "s", "modifiers": [{"type": "awq"}]}, "sequential"),
        # whole-model and layer-by-layer calibrators in one one-shot stage: the sequential pipeline
        ({"name": "s", "modifiers": [{"type": "ptq"}, {"type": "gptq"}]}, "sequential"),
        ({"name": "s", "modifiers": [{"type": "prune", "ratio": 0.5, "importance": "l2"}]}, "data-free"),
        ({"name": "s", "modifiers": [{"type": "test_noop"}]}, "data-free"),
        ({"name": "s"}, "data-free"),
    ],
)
def test_the_pipeline_follows_the_stage_and_its_modifiers_needs(stage: dict[str, Any], expected: str) -> None:
    st = Stage.model_validate(stage)
    assert pipeline_name(st) == expected
    p = pipeline_for(st)
    assert p is PIPELINES.get(expected) and p.name == expected
    assert isinstance(p, TrainingPipeline) == (expected == "training")


def test_a_one_shot_stage_with_a_modifier_that_needs_training_is_refused_at_load() -> None:
    with pytest.raises(RecipeError, match=r"stages\.0\.modifiers\.1: 'test_train' needs training; give stage 'q'"):
        load_recipe(recipe({"name": "q", "modifiers": [{"type": "test_calib"}, {"type": "test_train"}]}))


def test_the_registry_names_the_pipelines_on_a_miss() -> None:
    assert PIPELINES.names() == ["calibration", "data-free", "sequential", "training"]
    with pytest.raises(RecipeError) as exc:
        PIPELINES.get("sequentail")
    assert str(exc.value) == (
        "unknown pipeline 'sequentail'; valid: calibration, data-free, sequential, training (did you mean 'sequential'?)"
    )
    with pytest.raises(ValueError, match="pipeline 'training' is already registered"):
        PIPELINES.add("training", Pipeline("training", "again"))


# ---- initialize never calibrates; calibrate is a guarded step of its own ---------------------------------


def _calib_modifier(tiny_model: nn.Module) -> tuple[Modifier[Any], State]:
    r = load_recipe(recipe({"name": "q", "modifiers": [{"type": "test_calib"}]}))
    mod = modifier_class("test_calib")(r.stages[0].modifiers[0], where="stages.0.modifiers.0")
    return mod, State(model=tiny_model, calibration_data=loader(2))


def test_initialize_does_not_calibrate(tiny_model: nn.Module, events: list[Event]) -> None:
    mod, state = _calib_modifier(tiny_model)
    mod.initialize(state)
    assert [e[1] for e in events] == ["initialize"] and "calib_samples" not in state.metrics
    mod.calibrate(state)
    assert [e[1] for e in events] == ["initialize", "calibrate"] and state.metrics["calib_samples"] == 8
    mod.finalize(state)
    assert mod.phase is Phase.FINALIZED


def test_calibrate_is_guarded(tiny_model: nn.Module, events: list[Event]) -> None:
    mod, state = _calib_modifier(tiny_model)
    with pytest.raises(CompressError, match=r"^stages\.0\.modifiers\.0: 'calibrate' called while the modifier is new$"):
        mod.calibrate(state)
    mod.initialize(state)
    mod.calibrate(state)
    with pytest.raises(CompressError, match=r"^stages\.0\.modifiers\.0: 'calibrate' called twice$"):
        mod.calibrate(state)
    mod.finalize(state)
    with pytest.raises(CompressError, match="'calibrate' called while the modifier is finalized"):
        mod.calibrate(state)
    noop = modifier_class("test_noop")(load_recipe(recipe({"name": "a", "modifiers": [{"type": "test_noop"}]}))
                                       .stages[0].modifiers[0], where="m")
    noop.initialize(state)
    with pytest.raises(CompressError, match=r"^m: 'calibrate' called, but 'test_noop' needs no calibration$"):
        noop.calibrate(state)
    assert [e[1] for e in events] == ["initialize", "calibrate", "finalize", "initialize"]


def test_each_modifier_calibrates_before_the_next_one_initializes(tiny_model: nn.Module, events: list[Event]) -> None:
    r = recipe({"name": "q", "modifiers": [{"type": "test_calib", "label": "a"}, {"type": "test_noop", "label": "b"},
                                           {"type": "test_calib", "label": "c"}]})
    with Session(r, tiny_model, calibration_data=loader(1)):
        pass
    assert [e[:2] for e in events] == [
        ("a", "initialize"), ("a", "calibrate"), ("b", "initialize"), ("c", "initialize"), ("c", "calibrate"),
        ("a", "finalize"), ("b", "finalize"), ("c", "finalize"),
    ]


# ---- the plan names each stage's pipeline -------------------------------------------------------------


STAGES = (
    {"name": "prune", "modifiers": [{"type": "test_noop"}]},
    {"name": "tune", "epochs": 1, "modifiers": [{"type": "test_train"}]},
    {"name": "quant", "modifiers": [{"type": "test_calib"}]},
)


def test_session_plan_names_the_pipelines(tiny_model: nn.Module, events: list[Event]) -> None:
    planned = Session(recipe(*STAGES), tiny_model).plan()
    assert [(s["stage"], s["pipeline"]) for s in planned] == [
        ("prune", "data-free"), ("tune", "training"), ("quant", "calibration"),
    ]
    assert events == []  # planning runs nothing


def test_dry_run_names_the_pipelines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    data = {
        "version": 1, "name": "tiny",
        "model": {"name": "mlp", "kwargs": {"hidden": 16, "depth": 1, "num_classes": 10, "in_features": 64}},
        "data": {"source": "digits", "calibration_samples": 32},
        "stages": [{"name": "ptq", "modifiers": [{"type": "ptq"}]},
                   {"name": "qat", "epochs": 1, "modifiers": [{"type": "qat"}]}],
        "export": {"enabled": False},
    }
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    assert [(s["stage"], s["pipeline"]) for s in plan(path)["stages"]] == [("ptq", "calibration"), ("qat", "training")]
    assert main(["apply", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "stage ptq (one-shot, calibration pipeline)" in out and "stage qat (1.0 epochs, training pipeline)" in out


# ---- a session driven stage by stage; the caller's loop ----------------------------------------------


def test_a_driven_session_runs_each_stage_when_asked(tiny_model: nn.Module, events: list[Event]) -> None:
    opt = torch.optim.SGD(tiny_model.parameters(), lr=0.1)
    data = loader(2)
    fed: list[str] = []

    def feed(s: Session) -> None:
        assert s.stage is not None
        fed.append(s.stage.name)
        for x, y in data:
            out = s.model(x)
            s.loss(F.cross_entropy(out, y), inputs=x, outputs=out).backward()
            opt.step()
            s.step()
        s.epoch_end()

    s = Session(recipe(*STAGES), tiny_model, optimizer=opt, steps_per_epoch=2, calibration_data=loader(1))
    with s.drive():
        assert events == [] and s.stage is None and not s.finished  # begun, no stage entered yet
        assert s.run_stage(feed).name == "prune"
        assert [e[:2] for e in events] == [("test_noop", "initialize"), ("test_noop", "finalize")]
        assert s.stage is None and s.stage_index == 1
        assert s.run_stage(feed).name == "tune"
        assert fed == ["tune"] and s.stage is None  # the feed ran until the stage ended; no stage follows by itself
        assert [e[:2] for e in events[2:]] == [
            ("test_train", "initialize"), ("test_train", "step"), ("test_train", "step"), ("test_train", "epoch_end"),
            ("test_train", "finalize"),
        ]
        s.run_stage()
        assert s.finished
        with pytest.raises(CompressError, match=r"^Session\.run_stage: every stage has run$"):
            s.run_stage()
    assert [r.name for r in s.results] == ["prune", "tune", "quant"]
    assert [e[:2] for e in events[-3:]] == [
        ("test_calib", "initialize"), ("test_calib", "calibrate"), ("test_calib", "finalize"),
    ]


def test_run_stage_refuses_while_a_stage_is_in_progress(tiny_model: nn.Module, events: list[Event]) -> None:
    s = Session(recipe(*STAGES), tiny_model, calibration_data=loader(1))
    with s.drive():
        s.run_stage()
        s.run_stage()  # a training stage without a feed: left in progress for the caller's loop
        assert s.stage is not None and s.stage.name == "tune"
        with pytest.raises(CompressError, match=r"^Session\.run_stage: stage 'tune' is still in progress$"):
            s.run_stage()
    # leaving the block finalized what was left: the untrained stage, then the one-shot one
    assert s.finished and [r.name for r in s.results] == ["prune", "tune", "quant"]


def test_drive_aborts_when_the_block_raises(tiny_model: nn.Module, events: list[Event]) -> None:
    s = Session(recipe(*STAGES), tiny_model, calibration_data=loader(1))
    with pytest.raises(RuntimeError, match="boom"), s.drive():
        s.run_stage()
        s.run_stage()
        raise RuntimeError("boom")
    assert s.modifiers[1][0].phase is Phase.FINALIZED and s.modifiers[2][0].phase is Phase.NEW
    assert [r.name for r in s.results] == ["prune"]  # the stage in progress was aborted, not finalized
    with pytest.raises(CompressError, match="called after finalize"):
        s.run_stage()


def test_entering_a_session_runs_its_leading_one_shot_stages(tiny_model: nn.Module, events: list[Event]) -> None:
    r = recipe(STAGES[0], STAGES[2], {"name": "tune", "epochs": 1, "modifiers": [{"type": "test_noop", "label": "t"}]})
    with Session(r, tiny_model, calibration_data=loader(1)) as s:
        # both one-shot stages ran on entering (the loop cannot feed them); the training stage waits for it
        assert [x.name for x in s.results] == ["prune", "quant"]
        assert s.stage is not None and s.stage.name == "tune"
        assert ("test_calib", "calibrate") in [e[:2] for e in events]
        s.epoch_end()
        assert s.finished
