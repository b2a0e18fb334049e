"""Session lifecycle: stages, schedules, calibration, loss chaining, snapshots and guards, driven from a
plain training loop and from a Lightning-style callback object."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import compress
from compress.core.errors import CalibrationError, CompressError, TargetMatchError
from compress.core.modifier import Modifier, Phase, State
from compress.modifiers import modifier_class
from compress.recipe import load_recipe
from compress.session import Session, StageResult

Event = tuple[str, str, str, float, int]


def recipe(*stages: dict[str, Any], **top: Any) -> dict[str, Any]:
    return {"version": 1, "model": {"name": "m"}, "stages": list(stages), **top}


def rounded(events: list[Event]) -> list[Event]:
    return [(a, b, c, round(e, 6), s) for a, b, c, e, s in events]


def loader(n_batches: int, batch_size: int = 4, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch_size, 4, generator=g), torch.randint(0, 3, (batch_size,), generator=g))
        for _ in range(n_batches)
    ]


def train_step(s: Session, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = s.model(x)
    loss = s.loss(F.cross_entropy(out, y), inputs=x, outputs=out)
    opt.zero_grad()
    loss.backward()
    opt.step()
    s.step()
    return loss


# ---- a plain training loop ----------------------------------------------------------------------


PIPELINE = recipe(
    {
        "name": "sparse",
        "epochs": 2,
        "modifiers": [
            {"type": "test_train", "label": "p", "end_epoch": 1},
            {"type": "test_noop", "label": "e", "update_every": 2},
        ],
    },
    {"name": "calib", "modifiers": [{"type": "test_calib", "label": "c"}]},
    {"name": "tune", "steps": 3, "modifiers": [{"type": "test_noop", "label": "n"}]},
)


def test_plain_training_loop_events_in_order(tiny_model: nn.Module, events: list[Event]) -> None:
    data = loader(3)
    opt = torch.optim.SGD(tiny_model.parameters(), lr=0.1)
    with Session(
        PIPELINE, tiny_model, optimizer=opt, steps_per_epoch=3, calibration_data=loader(2, seed=1)
    ) as s:
        assert s.total_epochs == 2  # the steps stage is not counted in epochs
        assert s.stage is not None and s.stage.name == "sparse"
        while not s.finished:
            for x, y in data:
                train_step(s, opt, x, y)
                if s.finished:
                    break
            else:
                s.epoch_end()
        assert s.stage is None
    third = 1 / 3
    assert rounded(events) == [
        ("p", "initialize", "sparse", 0.0, 0),
        ("e", "initialize", "sparse", 0.0, 0),
        # epoch 0: p steps every step (end_epoch 1), e every other step
        ("p", "step", "sparse", round(third, 6), 1),
        ("p", "step", "sparse", round(2 * third, 6), 2),
        ("e", "step", "sparse", round(2 * third, 6), 2),
        ("p", "step", "sparse", 1.0, 3),
        ("p", "epoch_end", "sparse", 1.0, 3),
        ("e", "epoch_end", "sparse", 1.0, 3),
        # epoch 1: p's schedule is over
        ("e", "step", "sparse", round(1 + third, 6), 4),
        ("e", "step", "sparse", 2.0, 6),
        ("p", "epoch_end", "sparse", 2.0, 6),
        ("e", "epoch_end", "sparse", 2.0, 6),
        ("p", "finalize", "sparse", 2.0, 6),
        ("e", "finalize", "sparse", 2.0, 6),
        # a one-shot stage runs straight through as soon as it is reached
        ("c", "initialize", "calib", 0.0, 0),
        ("c", "calibrate", "calib", 0.0, 0),
        ("c", "finalize", "calib", 0.0, 0),
        # a steps stage ends after its steps, counting from its own start
        ("n", "initialize", "tune", 0.0, 0),
        ("n", "step", "tune", round(third, 6), 1),
        ("n", "step", "tune", round(2 * third, 6), 2),
        ("n", "step", "tune", 1.0, 3),
        ("n", "finalize", "tune", 1.0, 3),
    ]
    assert s.state.step == 9 and s.model is tiny_model
    assert [r.name for r in s.results] == ["sparse", "calib", "tune"]
    assert all(isinstance(r, StageResult) for r in s.results)
    assert s.results[0].metrics == {"steps_seen": 3}
    assert s.results[1].metrics["calib_samples"] == 8 and s.results[1].metrics["calib_batch_sizes"] == [4, 4]
    assert s.results[2].metrics == {}  # metrics are per stage


def test_calibration_forward_loop_runs_in_eval_mode_without_grad(
    tiny_model: nn.Module, events: list[Event]
) -> None:
    tiny_model.train()
    calib = loader(5, batch_size=3, seed=2)
    r = recipe({"name": "ptq", "modifiers": [{"type": "test_calib", "max_batches": 2}]})
    with Session(r, tiny_model, calibration_data=calib) as s:
        pass
    m = s.results[0].metrics
    assert m["calib_samples"] == 6 and m["calib_batch_sizes"] == [3, 3]  # max_batches stops the loop
    assert m["calib_in_train_mode"] is False and m["calib_grad_enabled"] is False
    assert tiny_model.training  # the mode is restored


def test_forward_loop_accepts_bare_tensors_and_dict_batches() -> None:
    seen: list[Any] = []

    class Kw(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(x.shape[0])
            return x

    state = State(
        model=Kw(), calibration_data=[torch.ones(2, 1), {"x": torch.ones(5, 1)}, (torch.ones(4, 1),)]
    )
    assert state.forward_loop(state.model) == 11
    assert seen == [2, 5, 4]


def test_calibration_without_data_is_a_calibration_error(tiny_model: nn.Module, events: list[Event]) -> None:
    r = recipe({"name": "ptq", "modifiers": [{"type": "test_calib"}]})
    with pytest.raises(CalibrationError, match="no calibration data"), Session(r, tiny_model):
        pass


# ---- a Lightning-style callback -------------------------------------------------------------------


class CompressCallback:
    """What a Lightning callback wrapping a Session looks like: the session is a context manager
    entered when training starts and left when it ends; batches and epochs are reported to it."""

    def __init__(self, recipe: Any, **session_kwargs: Any) -> None:
        self.recipe = recipe
        self.kwargs = session_kwargs
        self.session: Session | None = None

    def on_train_start(self, trainer: FakeTrainer, module: FakeModule) -> None:
        self.session = Session(self.recipe, module.net, optimizer=trainer.optimizer, **self.kwargs)
        self.session.__enter__()
        module.session = self.session

    def on_train_batch_end(
        self, trainer: FakeTrainer, module: FakeModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        assert self.session is not None
        self.session.step()

    def on_train_epoch_end(self, trainer: FakeTrainer, module: FakeModule) -> None:
        assert self.session is not None
        self.session.epoch_end()

    def on_train_end(self, trainer: FakeTrainer, module: FakeModule) -> None:
        assert self.session is not None
        self.session.__exit__(None, None, None)


class FakeModule:
    def __init__(self, net: nn.Module) -> None:
        self.net = net
        self.session: Session | None = None
        self.losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        out = self.net(x)
        loss = F.cross_entropy(out, y)
        if self.session is not None:
            loss = self.session.loss(loss, inputs=x, outputs=out)
        self.losses.append(loss.detach().item())
        return loss


class FakeTrainer:
    """Calls callback hooks in the order Lightning does (no Lightning needed)."""

    def __init__(self, callbacks: list[CompressCallback], max_epochs: int) -> None:
        self.callbacks = callbacks
        self.max_epochs = max_epochs
        self.optimizer: torch.optim.Optimizer | None = None

    def fit(self, module: FakeModule, data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.optimizer = torch.optim.SGD(module.net.parameters(), lr=0.5)
        for cb in self.callbacks:
            cb.on_train_start(self, module)
        for _ in range(self.max_epochs):
            for i, batch in enumerate(data):
                loss = module.training_step(batch)
                self.optimizer.zero_grad()
                loss.backward()
                self.optimizer.step()
                for cb in self.callbacks:
                    cb.on_train_batch_end(self, module, loss, batch, i)
            for cb in self.callbacks:
                cb.on_train_epoch_end(self, module)
        for cb in self.callbacks:
            cb.on_train_end(self, module)


def test_lightning_style_callback_drives_the_session(tiny_model: nn.Module, events: list[Event]) -> None:
    before = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    r = recipe(
        {
            "name": "distill",
            "epochs": 2,
            "modifiers": [{"type": "test_loss", "label": "d", "scale": 0.5, "start_epoch": 1}],
        },
        {"name": "calib", "modifiers": [{"type": "test_calib", "label": "c"}]},
    )
    cb = CompressCallback(r, steps_per_epoch=2, calibration_data=loader(1, seed=3))
    module = FakeModule(tiny_model)
    FakeTrainer([cb], max_epochs=2).fit(module, loader(2))
    s = cb.session
    assert s is not None and s.finished
    assert rounded(events) == [
        ("d", "initialize", "distill", 0.0, 0),
        ("d", "epoch_end", "distill", 1.0, 2),
        # start_epoch 1 gates loss and step; the loss is asked for before the step is reported,
        # so it sees the steps completed so far
        ("d", "loss", "distill", 1.0, 2),
        ("d", "step", "distill", 1.5, 3),
        ("d", "loss", "distill", 1.5, 3),
        ("d", "step", "distill", 2.0, 4),
        ("d", "epoch_end", "distill", 2.0, 4),
        ("d", "finalize", "distill", 2.0, 4),
        ("c", "initialize", "calib", 0.0, 0),
        ("c", "calibrate", "calib", 0.0, 0),
        ("c", "finalize", "calib", 0.0, 0),
    ]
    assert [r.name for r in s.results] == ["distill", "calib"]
    # the snapshot taken at initialize is the untrained model, frozen, and training did not reach it
    orig = s.state.original_model
    assert orig is not None and orig is not tiny_model and not orig.training
    assert all(not p.requires_grad for p in orig.parameters())
    for k, v in orig.state_dict().items():
        assert torch.equal(v, before[k])
    assert any(not torch.equal(v, before[k]) for k, v in tiny_model.state_dict().items())


# ---- schedules ------------------------------------------------------------------------------------


def run_steps(s: Session, n: int) -> None:
    for _ in range(n):
        s.step()


def step_events(events: list[Event], label: str) -> list[int]:
    return [st for lab, ev, _, _, st in events if lab == label and ev == "step"]


def test_start_end_step_and_update_every(tiny_model: nn.Module, events: list[Event]) -> None:
    r = recipe(
        {
            "name": "s",
            "steps": 10,
            "modifiers": [
                {"type": "test_noop", "label": "a", "start_step": 2, "end_step": 7, "update_every": 2},
                {"type": "test_noop", "label": "b", "end_step": 3},
                {"type": "test_noop", "label": "c", "update_every": 3},
            ],
        }
    )
    with Session(r, tiny_model) as s:
        run_steps(s, 10)
        assert s.finished
    assert step_events(events, "a") == [2, 4, 6]
    assert step_events(events, "b") == [1, 2]  # end_step is exclusive
    assert step_events(events, "c") == [3, 6, 9]


def test_start_end_epoch_with_steps_per_epoch(tiny_model: nn.Module, events: list[Event]) -> None:
    r = recipe(
        {
            "name": "s",
            "epochs": 3,
            "modifiers": [{"type": "test_noop", "label": "a", "start_epoch": 1, "end_epoch": 2}],
        }
    )
    with Session(r, tiny_model, steps_per_epoch=2) as s:
        for _ in range(3):
            run_steps(s, 2)
            s.epoch_end()
        assert s.finished
    assert step_events(events, "a") == [3, 4]
    assert [round(e, 6) for lab, ev, _, e, _ in events if ev == "step"] == [1.5, 2.0]


def test_epoch_schedule_without_steps_per_epoch_uses_whole_epochs(
    tiny_model: nn.Module, events: list[Event]
) -> None:
    r = recipe(
        {
            "name": "s",
            "epochs": 3,
            "modifiers": [{"type": "test_noop", "label": "a", "start_epoch": 1, "end_epoch": 2}],
        }
    )
    with Session(r, tiny_model) as s:
        for _ in range(3):
            run_steps(s, 4)
            s.epoch_end()
    assert step_events(events, "a") == [5, 6, 7, 8]


def test_schedules_count_from_the_start_of_their_stage(tiny_model: nn.Module, events: list[Event]) -> None:
    r = recipe(
        {"name": "first", "steps": 5, "modifiers": [{"type": "test_noop", "label": "x"}]},
        {
            "name": "second",
            "epochs": 2,
            "modifiers": [{"type": "test_noop", "label": "y", "start_epoch": 1, "start_step": 5}],
        },
    )
    with Session(r, tiny_model, steps_per_epoch=4) as s:
        run_steps(s, 5)
        assert s.stage is not None and s.stage.name == "second"
        assert s.state.stage_start_step == 5 and s.state.stage_step == 0
        for _ in range(2):
            run_steps(s, 4)
            s.epoch_end()
        assert s.finished
    assert step_events(events, "x") == [1, 2, 3, 4, 5]
    assert step_events(events, "y") == [5, 6, 7, 8]
    assert s.state.step == 13


def test_epoch_stage_ends_after_its_epochs_and_starts_the_next(
    tiny_model: nn.Module, events: list[Event]
) -> None:
    r = recipe(
        {"name": "a", "epochs": 1, "modifiers": [{"type": "test_noop", "label": "a"}]},
        {"name": "b", "epochs": 1, "modifiers": [{"type": "test_noop", "label": "b"}]},
    )
    with Session(r, tiny_model) as s:
        run_steps(s, 2)
        assert s.stage is not None and s.stage.name == "a"
        s.epoch_end()
        assert s.stage is not None and s.stage.name == "b" and s.state.stage_index == 1
        assert [e[:2] for e in events[-3:]] == [("a", "epoch_end"), ("a", "finalize"), ("b", "initialize")]
        assert s.state.stage_start_epoch == 1.0 and s.state.stage_epoch == 0.0
    assert events[-1][:2] == ("b", "finalize") and step_events(events, "b") == []


# ---- one-shot stages, finalize, total_epochs, callbacks --------------------------------------------


def test_leading_one_shot_stages_run_at_initialize(tiny_model: nn.Module, events: list[Event]) -> None:
    r = recipe(
        {"name": "o1", "modifiers": [{"type": "test_noop", "label": "o1"}]},
        {"name": "o2", "modifiers": [{"type": "test_noop", "label": "o2"}]},
        {"name": "t", "epochs": 1, "modifiers": [{"type": "test_noop", "label": "t"}]},
    )
    s = Session(r, tiny_model)
    assert events == [] and s.stage is None
    s.initialize()
    assert [e[:2] for e in events] == [
        ("o1", "initialize"),
        ("o1", "finalize"),
        ("o2", "initialize"),
        ("o2", "finalize"),
        ("t", "initialize"),
    ]
    assert [x.name for x in s.results] == ["o1", "o2"]
    assert s.stage is not None and s.stage.name == "t"
    s.finalize()


def test_finalize_runs_the_remaining_stages(
    tiny_model: nn.Module, events: list[Event], caplog: pytest.LogCaptureFixture
) -> None:
    r = recipe(
        {"name": "t", "epochs": 3, "modifiers": [{"type": "test_noop", "label": "t"}]},
        {"name": "o1", "modifiers": [{"type": "test_noop", "label": "o1"}]},
        {"name": "o2", "modifiers": [{"type": "test_calib", "label": "o2"}]},
    )
    s = Session(r, tiny_model, calibration_data=loader(1)).initialize()
    with caplog.at_level(logging.WARNING, logger="compress.session"):
        out = s.finalize()
    assert out is tiny_model
    assert "stage 't' ended before any training" in caplog.text
    assert [e[:2] for e in events] == [
        ("t", "initialize"),
        ("t", "finalize"),
        ("o1", "initialize"),
        ("o1", "finalize"),
        ("o2", "initialize"),
        ("o2", "calibrate"),
        ("o2", "finalize"),
    ]
    assert s.finished and [x.name for x in s.results] == ["t", "o1", "o2"]
    assert all(m.phase is Phase.FINALIZED for mods in s.modifiers for m in mods)


def test_recipe_without_stages(tiny_model: nn.Module) -> None:
    with Session(recipe(), tiny_model) as s:
        assert s.finished and s.total_epochs == 0
        s.step()  # nothing to drive, not an error
    assert s.results == [] and s.state.step == 1


def test_total_epochs(tiny_model: nn.Module) -> None:
    r = recipe(
        {"name": "a", "epochs": 1.5},
        {"name": "b"},
        {"name": "c", "epochs": 3, "steps": 10},  # ends by steps: not counted
        {"name": "d", "epochs": 2},
    )
    assert Session(r, tiny_model).total_epochs == 4


def test_on_stage_start_called_for_training_stages(tiny_model: nn.Module, events: list[Event]) -> None:
    r = recipe(
        {"name": "one", "modifiers": [{"type": "test_noop"}]},
        {"name": "a", "epochs": 1},
        {"name": "b", "steps": 2},
    )
    s = Session(r, tiny_model, optimizer=torch.optim.SGD(tiny_model.parameters(), lr=0.1))
    started: list[tuple[str, int]] = []
    ended: list[str] = []

    def rebuild(sess: Session) -> None:
        assert sess.stage is not None
        started.append((sess.stage.name, sess.state.step))
        sess.optimizer = torch.optim.AdamW(sess.model.parameters(), lr=1e-3)

    s.on_stage_start(rebuild)
    s.on_stage_end(lambda sess, res: ended.append(res.name))
    s.initialize()
    assert started == [("a", 0)] and isinstance(s.state.optimizer, torch.optim.AdamW)
    assert ended == ["one"]
    run_steps(s, 3)
    s.epoch_end()
    assert started == [("a", 0), ("b", 3)]
    run_steps(s, 2)
    assert s.finished and ended == ["one", "a", "b"]
    s.finalize()


def test_loss_chains_every_modifier_of_the_stage(tiny_model: nn.Module, events: list[Event]) -> None:
    r = recipe(
        {
            "name": "d",
            "epochs": 1,
            "modifiers": [
                {"type": "test_loss", "label": "l1", "scale": 1.0},
                {"type": "test_noop", "label": "n"},
                {"type": "test_loss", "label": "l2", "scale": 2.5},
                {"type": "test_loss", "label": "late", "scale": 100.0, "start_step": 1},
            ],
        }
    )
    with Session(r, tiny_model) as s:
        base = torch.tensor(0.25, requires_grad=True)
        out = s.loss(base, inputs=None, outputs=None)
        assert out.detach().item() == pytest.approx(3.75)  # "late" is not active at step 0
        out.backward()
        assert base.grad is not None and float(base.grad) == 1.0
        s.step()
        assert float(s.loss(torch.tensor(0.0))) == pytest.approx(103.5)
    assert [e[0] for e in events if e[1] == "loss"] == ["l1", "l2", "l1", "l2", "late"]


def test_snapshot_only_when_a_modifier_wants_it(tiny_model: nn.Module) -> None:
    with Session(recipe({"name": "a", "modifiers": [{"type": "test_noop"}]}), tiny_model) as s:
        assert s.state.original_model is None
    with Session(recipe({"name": "a", "modifiers": [{"type": "test_loss"}]}), tiny_model) as s:
        orig = s.state.original_model
        assert orig is not None
        with torch.no_grad():
            tiny_model[0].weight.add_(1.0)  # type: ignore[index]
        assert not torch.equal(orig[0].weight, tiny_model[0].weight)  # type: ignore[index]


# ---- targets are checked before anything touches the model ------------------------------------------


def test_unmatched_target_fails_initialize_before_any_modifier_runs(
    tmp_path: Path, tiny_model: nn.Module, events: list[Event]
) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(
        "version: 1\n"
        "model: {name: m}\n"
        "stages:\n"
        "  - name: a\n"
        "    modifiers: [{type: test_noop, targets: ['0']}]\n"
        "  - name: b\n"
        "    modifiers:\n"
        "      - type: test_noop\n"
        "        targets: ['9', '2']\n"
    )
    s = Session(path, tiny_model)
    with pytest.raises(TargetMatchError) as info:
        s.initialize()
    assert str(info.value).startswith(
        f"{path}:8: stages.1.modifiers.0: pattern '9' matches no module in Sequential"
    )
    assert events == []


def test_plan_lists_matched_modules_without_changes(tiny_model: nn.Module, events: list[Event]) -> None:
    r = recipe(
        {
            "name": "a",
            "epochs": 1,
            "modifiers": [{"type": "test_noop", "targets": ["type:Linear"], "ignore": ["2"]}],
        },
        {"name": "b", "steps": 3, "modifiers": [{"type": "test_train", "targets": ["re:[02]"]}]},
    )
    s = Session(r, tiny_model)
    assert s.plan() == [
        {"stage": "a", "epochs": 1.0, "steps": None, "pipeline": "training",
         "modifiers": [{"type": "test_noop", "modules": ["0"]}]},
        {
            "stage": "b",
            "epochs": 0.0,
            "steps": 3,
            "pipeline": "training",
            "modifiers": [{"type": "test_train", "modules": ["0", "2"]}],
        },
    ]
    assert events == []


def test_session_takes_a_recipe_path_or_object(tmp_path: Path, tiny_model: nn.Module) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(
        "version: 1\nmodel: {name: m}\nstages:\n  - name: a\n    modifiers: [{type: test_noop}]\n"
    )
    s1 = compress.Session(path, tiny_model)
    s2 = Session(load_recipe(path), tiny_model)
    assert s1.recipe.to_dict() == s2.recipe.to_dict()
    assert s1.modifiers[0][0].where == f"{path}:5: stages.0.modifiers.0"


# ---- guards ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("event", ["step", "epoch_end", "finalize"])
def test_events_before_initialize_are_errors(tiny_model: nn.Module, event: str) -> None:
    s = Session(recipe({"name": "a", "epochs": 1}), tiny_model)
    with pytest.raises(
        CompressError, match=rf"^Session\.{event} called before initialize \(use 'with Session\(\.\.\.\)'\)$"
    ):
        getattr(s, event)()
    with pytest.raises(CompressError, match=r"Session\.loss called before initialize"):
        s.loss(torch.tensor(1.0))


def test_events_after_finalize_are_errors(tiny_model: nn.Module) -> None:
    with Session(recipe({"name": "a", "epochs": 1}), tiny_model) as s:
        pass
    for call in (s.step, s.epoch_end, s.finalize, lambda: s.loss(torch.tensor(1.0))):
        with pytest.raises(CompressError, match=r"called after finalize$"):
            call()


def test_initialize_twice_is_an_error(tiny_model: nn.Module) -> None:
    s = Session(recipe({"name": "a", "epochs": 1}), tiny_model)
    s.initialize()
    with pytest.raises(CompressError, match=r"^Session\.initialize called twice$"):
        s.initialize()
    s.finalize()
    with pytest.raises(CompressError, match="called twice"):
        s.initialize()


def test_an_exception_in_the_loop_does_not_finalize(tiny_model: nn.Module, events: list[Event]) -> None:
    r = recipe({"name": "a", "epochs": 1, "modifiers": [{"type": "test_noop", "label": "a"}]})
    with pytest.raises(RuntimeError, match="boom"), Session(r, tiny_model) as s:
        s.step()
        raise RuntimeError("boom")
    assert [e[1] for e in events] == ["initialize", "step"]  # no finalize on a failed run
    with pytest.raises(CompressError, match="after finalize"):
        s.step()


def test_modifier_guards_name_the_modifier_and_its_phase(tiny_model: nn.Module) -> None:
    r = load_recipe(recipe({"name": "a", "epochs": 1, "modifiers": [{"type": "test_noop"}]}))
    spec = r.stages[0].modifiers[0]
    mod: Modifier[Any] = modifier_class("test_noop")(spec, where="stages.0.modifiers.0")
    state = State(model=tiny_model)
    with pytest.raises(
        CompressError, match=r"^stages\.0\.modifiers\.0: 'step' called while the modifier is new$"
    ):
        mod.step(state)
    for event in ("epoch_end", "finalize"):
        with pytest.raises(CompressError, match=f"'{event}' called while the modifier is new"):
            getattr(mod, event)(state)
    with pytest.raises(CompressError, match="'loss' called while the modifier is new"):
        mod.loss(state, torch.tensor(1.0), None, None)
    mod.initialize(state)
    with pytest.raises(CompressError, match="'initialize' called while the modifier is initialized"):
        mod.initialize(state)
    mod.finalize(state)
    assert mod.phase is Phase.FINALIZED
    with pytest.raises(CompressError, match="'step' called while the modifier is finalized"):
        mod.step(state)
    with pytest.raises(CompressError, match="'finalize' called while the modifier is finalized"):
        mod.finalize(state)
    default_where = modifier_class("test_noop")(spec)
    assert default_where.where == "modifier 'test_noop'"


def test_a_recipe_built_in_code_gets_the_needs_and_order_checks(tiny_model: nn.Module) -> None:
    from compress.core.errors import RecipeError
    from compress.recipe import Recipe

    def built(*stages: dict[str, Any], **top: Any) -> Recipe:
        return Recipe.model_validate(recipe(*stages, **top))

    with pytest.raises(RecipeError, match=r"^recipe: stages\.0\.modifiers\.0: 'test_train' needs training"):
        Session(built({"name": "p", "modifiers": [{"type": "test_train"}]}), tiny_model)
    with pytest.raises(RecipeError, match=r"^recipe: stages\.1\.modifiers\.0: 'prune' after 'quantize'"):
        Session(
            built(
                {"name": "q", "modifiers": [{"type": "test_calib"}]},
                {"name": "p", "epochs": 1, "modifiers": [{"type": "test_train"}]},
            ),
            tiny_model,
        )
    with pytest.raises(RecipeError, match=r"needs calibration data but data\.calibration_samples is 0"):
        Session(
            built({"name": "q", "modifiers": [{"type": "test_calib"}]}, data={"calibration_samples": 0}),
            tiny_model,
        )
    ok = built({"name": "q", "modifiers": [{"type": "test_calib", "bits": 5}]})
    s = Session(ok, tiny_model)
    assert s.recipe.to_dict() == ok.to_dict() and s.recipe.stages[0].modifiers[0].bits == 5  # type: ignore[attr-defined]
    loaded = load_recipe(recipe({"name": "a"}))
    assert Session(loaded, tiny_model).recipe is loaded  # a loaded recipe is used as it is
