"""The ``distill`` modifier through a Session: KD lowers the divergence, metrics, hooks, errors."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from compress.distillation.losses import kd_kl
from torch import nn

from compress.core.batching import split_batch
from compress.core.errors import RecipeError, TargetMatchError
from compress.data import build_data
from compress.models import build_zoo_model
from compress.recipe import load_recipe
from compress.session import Session
from compress.training import evaluate, fit, seed_everything


@pytest.fixture(scope="module")
def digits() -> Any:
    return build_data({"source": "digits", "calibration_samples": 128}, batch_size=64, seed=0)


@pytest.fixture(scope="module")
def teacher_ckpt(digits: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    seed_everything(0)
    teacher = build_zoo_model("mlp", {"hidden": 64})
    fit(teacher, digits.train, epochs=4, device="cpu")
    assert evaluate(teacher, digits.eval) > 0.85
    path = tmp_path_factory.mktemp("teacher") / "teacher.pt"
    torch.save(teacher.state_dict(), path)
    return path


def _recipe(modifier: dict[str, Any], *, epochs: float = 2, stages: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "version": 1,
        "model": {"name": "mlp", "kwargs": {"hidden": 16}},
        "stages": stages or [{"name": "kd", "epochs": epochs, "modifiers": [modifier]}],
    }


def _run(session: Session, loader: Any, *, lr: float = 0.05) -> None:
    """An ordinary training loop driving the session (what the built-in trainer does)."""
    opt = torch.optim.SGD(session.model.parameters(), lr=lr, momentum=0.9)
    session.optimizer = opt
    with session:
        for _ in range(session.total_epochs):
            for batch in loader:
                x, y = split_batch(batch)
                out = session.model(x)
                loss = session.loss(F.cross_entropy(out, y), inputs=x, outputs=out)
                opt.zero_grad()
                loss.backward()
                opt.step()
                session.step()
            session.epoch_end()


@torch.no_grad()
def _kl_to(teacher: nn.Module, student: nn.Module, loader: Any) -> float:
    teacher.eval()
    student.eval()
    vals = [kd_kl(student(x), teacher(x), temperature=1.0).item() for x, _ in loader]
    return sum(vals) / len(vals)


def test_kd_lowers_the_divergence_to_the_teacher(digits: Any, teacher_ckpt: Path) -> None:
    teacher = build_zoo_model("mlp", {"hidden": 64})
    teacher.load_state_dict(torch.load(teacher_ckpt, weights_only=True))
    seed_everything(1)
    init = build_zoo_model("mlp", {"hidden": 16})
    before = _kl_to(teacher, init, digits.eval)

    def train(modifiers: list[dict[str, Any]]) -> nn.Module:
        seed_everything(2)
        student = copy.deepcopy(init)
        recipe = _recipe({}, stages=[{"name": "ft", "epochs": 2, "modifiers": modifiers}])
        _run(Session(recipe, student, calibration_data=digits.calibration), digits.train)
        return student

    teacher_spec = {"name": "mlp", "kwargs": {"hidden": 64}, "checkpoint": str(teacher_ckpt)}
    kd = train([{"type": "distill", "teacher": teacher_spec, "losses": [{"type": "kd", "temperature": 4}]}])
    plain = train([])
    kl_kd, kl_plain = _kl_to(teacher, kd, digits.eval), _kl_to(teacher, plain, digits.eval)
    assert kl_kd < 0.5 * before
    assert kl_kd < kl_plain


def test_self_teacher_stage_reports_metrics_and_restores_the_model(digits: Any, teacher_ckpt: Path) -> None:
    model = build_zoo_model("mlp", {"hidden": 64})
    model.load_state_dict(torch.load(teacher_ckpt, weights_only=True))
    hooks_before = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    mod = {
        "type": "distill",
        "losses": [{"type": "kd", "temperature": 2}, {"type": "feature", "layers": {"body.1": "body.1"}, "weight": 0.1}],
    }
    session = Session(_recipe(mod, epochs=1), model, calibration_data=digits.calibration)
    _run(session, digits.train)
    metrics = session.results[0].metrics
    for key in ("distill.train_kd", "distill.train_feature", "distill.teacher_kl", "distill.top1_agreement"):
        assert key in metrics, key
    assert 0.0 <= metrics["distill.top1_agreement"] <= 1.0
    assert metrics["distill.train_kd"] >= 0.0
    rows = next(iter(session.results[0].tables.values()))
    assert [r["term"] for r in rows] == ["kd", "feature"]
    # hooks gone, forward the plain model's
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == hooks_before
    x = next(iter(digits.eval))[0]
    clone = copy.deepcopy(model).eval()
    assert torch.equal(model.eval()(x), clone(x))
    # the snapshot teacher was never trained
    snap = session.state.original_model
    assert snap is not None and all(not p.requires_grad for p in snap.parameters())


def test_adapters_train_in_the_stage_optimizer_and_leave_it_at_finalize(digits: Any, teacher_ckpt: Path) -> None:
    seed_everything(3)
    student = build_zoo_model("mlp", {"hidden": 16})
    mod = {
        "type": "distill",
        "teacher": {"name": "mlp", "kwargs": {"hidden": 64}, "checkpoint": str(teacher_ckpt)},
        "losses": [{"type": "feature", "layers": {"body.1": "body.1"}}],
    }
    opt = torch.optim.SGD(student.parameters(), lr=0.05)
    n_model = len(list(student.parameters()))
    session = Session(_recipe(mod, epochs=1), student, optimizer=opt, example_inputs=next(iter(digits.train))[0])
    with session:
        assert session.state.original_model is None  # an external teacher: no snapshot of the student
        modifier: Any = session.modifiers[0][0]
        adapter = modifier.distiller.adapters.modules["feature:body__1"]
        assert (adapter.in_features, adapter.out_features) == (16, 64)
        in_opt = [p for g in opt.param_groups for p in g["params"]]
        assert any(p is adapter.weight for p in in_opt)
        w0 = adapter.weight.detach().clone()
        x, y = next(iter(digits.train))
        out = student(x)
        session.loss(F.cross_entropy(out, y), inputs=x, outputs=out).backward()
        opt.step()
        assert not torch.equal(adapter.weight, w0)
        session.epoch_end()
    assert sum(len(g["params"]) for g in opt.param_groups) == n_model


def test_teacher_trained_first_when_it_has_no_checkpoint(digits: Any) -> None:
    seed_everything(4)
    student = build_zoo_model("mlp", {"hidden": 16})
    mod = {"type": "distill", "teacher": {"name": "mlp", "kwargs": {"hidden": 32}, "train_epochs": 2, "train_lr": 0.05}}
    session = Session(
        _recipe(mod, epochs=1), student, train_data=digits.train,
        evaluate=lambda m: evaluate(m, digits.eval),
    )
    _run(session, digits.train)
    metrics = session.results[0].metrics
    assert metrics["distill.teacher_metric"] > 0.5  # a trained teacher, not a random one (0.1)
    assert "distill.teacher_train_loss" in metrics


def test_recipe_errors_name_the_field(tmp_path: Path) -> None:
    def load(mod: dict[str, Any], **kw: Any) -> Any:
        return load_recipe(_recipe(mod, **kw))

    with pytest.raises(RecipeError, match="teacher 'resnet' has no weights"):
        load({"type": "distill", "teacher": {"name": "resnet"}})
    with pytest.raises(RecipeError, match="need end_epoch or end_step"):
        load({"type": "distill", "losses": [{"type": "kd", "weight_end": 0, "weight_schedule": "linear"}]})
    with pytest.raises(RecipeError, match="teacher must be 'self' or a model spec"):
        load({"type": "distill", "teacher": "slef"})
    assert load({"type": "distill"}).to_dict()["stages"][0]["modifiers"][0]["teacher"] == "self"
    spec = {"name": "mlp", "checkpoint": "t.pt"}
    dumped = load({"type": "distill", "teacher": spec}).to_dict()["stages"][0]["modifiers"][0]["teacher"]
    assert load({"type": "distill", "teacher": dumped}).stages[0].modifiers[0].teacher.checkpoint == "t.pt"  # type: ignore[attr-defined]
    with pytest.raises(RecipeError, match="needs training"):
        load({"type": "distill"}, epochs=0)
    with pytest.raises(RecipeError, match=r"stages\.0\.modifiers\.0\.losses\.0\.layers: required field is missing"):
        load({"type": "distill", "losses": [{"type": "feature"}]})
    with pytest.raises(RecipeError, match=r"losses\.1\.layerz: unknown field 'layerz'.*did you mean 'layers'"):
        load({"type": "distill", "losses": [{"type": "kd"}, {"type": "feature", "layerz": {"a": "b"}}]})
    with pytest.raises(RecipeError, match=r"losses\.0\.type: unknown loss type 'kld'.*did you mean 'kd'"):
        load({"type": "distill", "losses": [{"type": "kld"}]})
    path = tmp_path / "r.yaml"
    path.write_text(
        "version: 1\nmodel: {name: mlp}\nstages:\n  - name: kd\n    epochs: 1\n    modifiers:\n"
        "      - type: distill\n        temperature: 3\n"
    )
    with pytest.raises(RecipeError, match=r"r.yaml:8: .*unknown field 'temperature'"):
        load_recipe(path)
    path.write_text(
        "version: 1\nmodel: {name: mlp}\nstages:\n  - name: kd\n    epochs: 1\n    modifiers:\n"
        "      - type: distill\n        losses:\n          - type: kd\n            temperatur: 3\n"
    )
    with pytest.raises(RecipeError, match=r"r.yaml:10: stages.0.modifiers.0.losses.0.temperatur: unknown field"):
        load_recipe(path)


def test_a_missing_student_layer_fails_before_training() -> None:
    model = build_zoo_model("mlp", {"hidden": 16})
    mod = {"type": "distill", "losses": [{"type": "feature", "layers": {"body.9": "body.1"}}]}
    with pytest.raises(TargetMatchError, match=r"student layer 'body\.9'"):
        Session(_recipe(mod), model).initialize()


def test_scheduled_weight_follows_the_modifier_window(digits: Any) -> None:
    model = build_zoo_model("mlp", {"hidden": 16})
    mod = {
        "type": "distill", "end_step": 4,
        "losses": [{"type": "kd", "weight": 0.0, "weight_end": 1.0, "weight_schedule": "linear"}],
    }
    session = Session(_recipe(mod, epochs=1), model)
    x, y = next(iter(digits.train))
    with session:
        out = model(x)
        task = F.cross_entropy(out, y)
        assert session.loss(task, inputs=x, outputs=out).item() == pytest.approx(task.item())  # weight 0 at start
        for _ in range(2):
            session.step()
        out = model(x)
        total = session.loss(F.cross_entropy(out, y), inputs=x, outputs=out)
        kd = session.modifiers[0][0].distiller.last["kd"]  # type: ignore[attr-defined]
        assert total.item() == pytest.approx(F.cross_entropy(out, y).item() + 0.5 * kd.item(), rel=1e-5)
        session.epoch_end()


def test_distill_and_qat_in_one_stage_follow_the_module_swap(digits: Any, teacher_ckpt: Path) -> None:
    pytest.importorskip("compress.quantization.modifiers")
    model = build_zoo_model("mlp", {"hidden": 64})
    model.load_state_dict(torch.load(teacher_ckpt, weights_only=True))
    original = type(model.body[0])
    mod = {"type": "distill", "losses": [{"type": "kd"}, {"type": "feature", "layers": {"body.0": "body.0"}}]}
    stages = [{"name": "qat", "epochs": 1, "modifiers": [mod, {"type": "qat"}]}]  # distill hooks first, then the swap
    session = Session(_recipe({}, stages=stages), model, calibration_data=digits.calibration)
    _run(session, digits.train, lr=0.01)
    swapped = model.body[0]
    assert type(swapped) is not original  # QAT replaced the Linear
    metrics = session.results[0].metrics
    assert metrics["distill.train_feature"] >= 0.0 and metrics["distill.top1_agreement"] > 0.8
    ours = [
        h for m in model.modules() for h in (*m._forward_hooks.values(), *m._forward_pre_hooks.values())
        if "FeatureCapture" in getattr(h, "__qualname__", "")
    ]
    assert ours == []


def test_distill_after_pruning_in_one_stage_adapts_the_narrowed_features(digits: Any, teacher_ckpt: Path) -> None:
    pytest.importorskip("compress.pruning.modifiers")
    model = build_zoo_model("mlp", {"hidden": 64})
    model.load_state_dict(torch.load(teacher_ckpt, weights_only=True))
    mod = {"type": "distill", "losses": [{"type": "kd"}, {"type": "feature", "layers": {"body.1": "body.1"}}]}
    stages = [{"name": "prune", "epochs": 1, "modifiers": [mod, {"type": "prune", "ratio": 0.5}]}]
    x = next(iter(digits.train))[0]
    session = Session(_recipe({}, stages=stages), model, calibration_data=digits.calibration, example_inputs=x[:2])
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    session.optimizer = opt
    with session:
        distill: Any = session.modifiers[0][0]
        assert model.body[0].out_features == 32  # pruned at stage start, after distill set up its hooks
        for batch in digits.train:
            xb, yb = split_batch(batch)
            out = model(xb)
            loss = session.loss(F.cross_entropy(out, yb), inputs=xb, outputs=out)
            opt.zero_grad()
            loss.backward()
            opt.step()
            session.step()
            adapter = distill.distiller.adapters.modules["feature:body__1"]
            assert (adapter.in_features, adapter.out_features) == (32, 64)
            assert any(p is adapter.weight for g in opt.param_groups for p in g["params"])
        session.epoch_end()
    metrics = session.results[0].metrics
    assert metrics["prune_params_after"] < metrics["prune_params_before"]
    assert metrics["distill.top1_agreement"] > 0.8
