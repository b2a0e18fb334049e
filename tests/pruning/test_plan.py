"""PruningPlan: JSON round trip, replay through the model loader, and clear errors on a bad plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from compress.pruning.api import prune
from compress.pruning.plan import PruningPlan

from compress.core.errors import CompressError, RecipeError
from compress.models.zoo import build_zoo_model


def test_plan_round_trip_and_checkpoint_load(tmp_path: Path) -> None:
    from compress.models import load_model
    from compress.recipe import ModelSpec

    kwargs = {"width": 8, "depth": 1}
    model = build_zoo_model("resnet", kwargs).eval()
    x = torch.randn(2, 1, 8, 8)
    result = prune(model, x, ratio=0.5)
    plan_path = result.plan.save(tmp_path / "plan.json")
    ckpt = tmp_path / "pruned.pt"
    torch.save(model.state_dict(), ckpt)
    data = json.loads(plan_path.read_text())
    assert data["format"] == "compress.pruning_plan" and data["summary"]["params_after"] == result.params_after
    rebuilt = load_model(ModelSpec(name="resnet", kwargs=kwargs, pruning_plan=str(plan_path), checkpoint=str(ckpt)))
    with torch.no_grad():
        torch.testing.assert_close(rebuilt.eval()(x), model(x), atol=0, rtol=0)


def test_iterative_plan_replays_every_step() -> None:
    model = build_zoo_model("mlp", {"hidden": 32}).eval()
    x = torch.randn(2, 1, 8, 8)
    plan = PruningPlan()
    for _ in range(2):
        plan.steps.extend(prune(model, x, ratio=0.25).plan.steps)
    fresh = PruningPlan.from_dict(plan.to_dict()).apply(build_zoo_model("mlp", {"hidden": 32}))
    assert fresh.body[0].out_features == model.body[0].out_features == 18  # 32 -> 24 -> 18
    fresh.load_state_dict(model.state_dict(), strict=True)


def test_plan_that_does_not_fit_is_refused() -> None:
    model = build_zoo_model("mlp", {"hidden": 32})
    with pytest.raises(CompressError, match="does not have"):
        PruningPlan(steps=[{"nope.weight": [(0, [0])]}]).apply(model)
    with pytest.raises(CompressError, match=r"does not fit 'body\.0\.weight'"):
        PruningPlan(steps=[{"body.0.weight": [(0, [0, 99])]}]).apply(model)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"format": "other"}, "not a pruning plan"),
        ({"format": "compress.pruning_plan", "version": 9, "steps": []}, "unsupported pruning plan version"),
        ({"format": "compress.pruning_plan", "version": 1, "steps": [{"a.weight": [[0]]}]}, r"\[axis, \[kept"),
    ],
)
def test_malformed_plan(data: dict, match: str, tmp_path: Path) -> None:
    p = tmp_path / "plan.json"
    p.write_text(json.dumps(data))
    with pytest.raises(RecipeError, match=match):
        PruningPlan.load(p)


def test_missing_plan_file(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="pruning plan not found"):
        PruningPlan.load(tmp_path / "none.json")
