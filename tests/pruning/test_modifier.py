"""The ``prune`` modifier through a Session: one-shot, iterative (AGP) with the live optimizer,
sparsity phases, the training-only-when-iterative rule, and metrics."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import compress
from compress.core.errors import RecipeError
from compress.models.zoo import build_zoo_model

X = torch.randn(32, 1, 8, 8)
Y = torch.randint(0, 10, (32,))
LOADER = [(X[i : i + 8], Y[i : i + 8]) for i in range(0, 32, 8)]


def _recipe(*stages: dict[str, Any]) -> dict[str, Any]:
    return {"version": 1, "model": {"name": "resnet"}, "stages": list(stages)}


def _train(recipe: dict[str, Any], model: torch.nn.Module, out_dir: Path | None = None) -> compress.Session:
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    s = compress.Session(
        recipe, model, optimizer=opt, steps_per_epoch=len(LOADER), example_inputs=X[:2], train_data=LOADER, out_dir=out_dir
    )
    with s:
        for _ in range(s.total_epochs):
            for xb, yb in LOADER:
                out = s.model(xb)
                loss = s.loss(F.cross_entropy(out, yb), inputs=xb, outputs=out)
                s.optimizer.zero_grad()  # type: ignore[union-attr]
                loss.backward()
                s.optimizer.step()  # type: ignore[union-attr]
                s.step()
            s.epoch_end()
    return s


def test_one_shot_stage_reports_params_and_macs(tmp_path: Path) -> None:
    model = build_zoo_model("resnet", {"width": 8})
    s = _train(_recipe({"name": "p", "modifiers": [{"type": "prune", "ratio": 0.5}]}), model, tmp_path)
    m = s.results[0].metrics
    assert m["prune_params_after"] < m["prune_params_before"] and m["prune_macs_after"] < m["prune_macs_before"]
    assert m["prune_steps"] == 1
    rows = s.results[0].tables["pruned_groups"]
    assert rows and all(r["removed"] == r["units"] // 2 for r in rows)
    assert s.results[0].artifacts and Path(s.results[0].artifacts[0]).is_file()


def test_iterative_schedule_prunes_between_epochs_with_live_optimizer() -> None:
    model = build_zoo_model("resnet", {"width": 8})
    recipe = _recipe(
        {
            "name": "iter",
            "epochs": 4,
            "modifiers": [{"type": "prune", "ratio": 0.5, "steps": 3, "interval_epochs": 1, "schedule": "linear"}],
        }
    )
    s = _train(recipe, model)
    m = s.results[0].metrics
    assert m["prune_steps"] == 3
    # linear schedule: cumulative 1/6, 2/6, 3/6 of 8 channels, floored at each step -> 7, 6, 4
    assert model.layer1[0].conv1.out_channels == 4
    # the optimizer that trained between steps holds the pruned parameters
    opt = s.optimizer
    assert opt is not None
    params = {id(p) for g in opt.param_groups for p in g["params"]}
    assert all(id(p) in params for p in model.parameters())
    for p in model.parameters():
        buf = opt.state[p].get("momentum_buffer")
        assert buf is None or buf.shape == p.shape


@pytest.mark.parametrize("kind", ["bn_l1", "group_lasso"])
def test_sparsity_phase_adds_a_penalty_before_the_first_cut(kind: str) -> None:
    from compress.core.modifier import State
    from compress.modifiers import modifier_class

    spec = modifier_class("prune").spec_cls.model_validate(
        {"type": "prune", "ratio": 0.5, "sparsity": {"kind": kind, "weight": 0.1, "epochs": 1}}
    )
    mod = modifier_class("prune")(spec)
    model = build_zoo_model("resnet", {"width": 8})
    state = State(model=model, example_inputs=X[:2])
    mod.initialize(state)
    assert mod.done == 0  # the cut waits for the sparsity epoch
    base = torch.tensor(1.0)
    loss = mod.loss(state, base, X[:2], None)
    assert loss.item() > 1.0
    loss.backward()
    # bn_l1 pulls on BN scales only; group lasso on the conv weights of each channel too
    assert model.layer1[0].bn1.weight.grad.abs().sum() > 0
    conv_grad = model.layer1[0].conv1.weight.grad
    assert (conv_grad is not None and conv_grad.abs().sum() > 0) == (kind == "group_lasso")
    state.epoch = 1.0
    mod.epoch_end(state)
    assert mod.done == 1 and model.layer1[0].conv1.out_channels == 4
    assert mod.loss(state, base, X[:2], None) is base  # no penalty after the cut


def test_iterative_prune_needs_a_training_stage() -> None:
    with pytest.raises(RecipeError, match="'prune' needs training; give stage 'p' epochs"):
        compress.load_recipe(_recipe({"name": "p", "modifiers": [{"type": "prune", "ratio": 0.5, "steps": 2}]}))


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"ratio": 1.2}, r"ratio must be in \[0, 1\)"),
        ({"ratio": 0.5, "budget": {"macs": 0.5}}, "exactly one of ratio"),
        ({"ratio": 0.5, "importance": "l3"}, "importance"),
        ({"ratio": 0.5, "sparsity": {"kind": "l0"}}, "sparsity"),
        ({"ratio": 0.5, "overrides": {"a": 1.0}}, "override ratio"),
    ],
)
def test_prune_spec_errors_name_the_field(fields: dict[str, Any], match: str) -> None:
    with pytest.raises(RecipeError, match=match):
        compress.load_recipe(_recipe({"name": "p", "epochs": 1, "modifiers": [{"type": "prune", **fields}]}))


def test_unmatched_pattern_fails_before_the_model_is_touched() -> None:
    model = build_zoo_model("resnet", {"width": 8})
    recipe = _recipe({"name": "p", "modifiers": [{"type": "prune", "ratio": 0.5, "ignore": ["layer9"]}]})
    with pytest.raises(compress.TargetMatchError, match="ignore: pattern 'layer9' matches no module"):
        _train(recipe, model)
    assert model.layer1[0].conv1.out_channels == 8
