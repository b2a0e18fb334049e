"""Clear errors for what a user can get wrong, and for models pruning cannot handle."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from compress.pruning.api import PruneParams, prune
from pruning_blocks import Residual, run
from torch import nn

from compress.core.errors import RecipeError, TargetMatchError, UnsupportedModelError


@pytest.mark.parametrize("ratio", [-0.1, 1.0, 1.5])
def test_ratio_outside_unit_interval(ratio: float) -> None:
    with pytest.raises(RecipeError, match=r"ratio must be in \[0, 1\)"):
        prune(Residual(), torch.randn(2, 3, 8, 8), ratio=ratio)


@pytest.mark.parametrize(
    ("ratio", "budget", "match"),
    [
        (None, None, "exactly one of ratio"),
        (0.5, {"macs": 0.5}, "exactly one of ratio"),
        (None, {"flops": 0.5}, "one key, params or macs"),
        (None, {"macs": 0.0}, r"fraction in \(0, 1\]"),
    ],
)
def test_bad_ratio_or_budget(ratio: float | None, budget: dict[str, float] | None, match: str) -> None:
    with pytest.raises(RecipeError, match=match):
        prune(Residual(), torch.randn(2, 3, 8, 8), ratio=ratio, budget=budget)


def test_unknown_importance_suggests_the_closest() -> None:
    with pytest.raises(RecipeError, match="did you mean 'taylor'"):
        prune(Residual(), torch.randn(2, 3, 8, 8), ratio=0.5, importance="tayler")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"ignore": ["nothing.here"]}, "ignore"),
        ({"params": PruneParams(targets=["re:layer9.*"])}, "targets"),
        ({"params": PruneParams(overrides={"stem.9": 0.2})}, "overrides"),
    ],
)
def test_pattern_matching_nothing(kwargs: dict, field: str) -> None:
    model = Residual()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(TargetMatchError, match=f"prune: {field}: pattern '.*' matches no module"):
        prune(model, torch.randn(2, 3, 8, 8), ratio=0.5, **kwargs)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # untouched


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_tracing_under_no_grad_gives_the_same_result(context: type) -> None:
    """The tracer reads torch calls, not autograd: no_grad/inference_mode change nothing."""
    x = torch.randn(2, 3, 8, 8)
    a, b = Residual().eval(), None
    b = copy.deepcopy(a)
    ra = prune(a, x, ratio=0.5)
    with context():
        rb = prune(b, x, ratio=0.5)
    assert ra.plan.to_dict()["steps"] == rb.plan.to_dict()["steps"]
    torch.testing.assert_close(run(a, x), run(b, x))


class TensordotNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 16)
        self.mix = nn.Parameter(torch.randn(16, 16))
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tensordot(self.proj(x), self.mix, dims=1))


def test_unsupported_op_names_op_and_module() -> None:
    model = TensordotNet()
    with pytest.raises(UnsupportedModelError, match=r"op 'tensordot' in .*TensordotNet"):
        prune(model, torch.randn(3, 8), ratio=0.5)


class HardCoded(nn.Module):
    """Reshapes with a literal channel count: no trace can know the 16 is a channel count. The MLP
    beside it has no such problem."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.head = nn.Linear(16 * 64, 2)
        self.fc1, self.fc2 = nn.Linear(3, 12), nn.Linear(12, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.head(F.relu(self.conv(x)).reshape(x.shape[0], 16 * 64))
        return y + self.fc2(F.relu(self.fc1(x.mean((2, 3)))))


def test_hard_coded_channel_count_pins_only_that_group() -> None:
    model = HardCoded().eval()
    x = torch.randn(2, 3, 8, 8)
    result = prune(model, x, ratio=0.5)
    # the conv's cut alone breaks the forward: it keeps its channels, named with the error
    assert model.conv.out_channels == 16 and model.conv.weight.shape[0] == 16
    (pinned,) = result.pinned
    assert pinned["modules"] == "conv" and "no longer runs" in pinned["reason"]
    assert result.plan.summary["pinned"] == result.pinned
    # the rest is pruned
    assert model.fc1.out_features == 6 and model.fc2.in_features == 6


def test_model_refused_and_restored_when_no_group_alone_breaks_it() -> None:
    class Pair(nn.Module):
        """Code that needs 12 features in total: either branch may be cut, not both."""

        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 8), nn.Linear(4, 8)
            self.head_a, self.head_b = nn.Linear(8, 2), nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            ha, hb = self.a(x), self.b(x)
            if ha.shape[-1] + hb.shape[-1] < 12:
                raise ValueError("needs at least 12 features")
            return self.head_a(ha) + self.head_b(hb)

    model = Pair().eval()
    x = torch.randn(2, 4)
    y = run(model, x)
    with pytest.raises(UnsupportedModelError, match=r"no group alone is at fault\. Model restored"):
        prune(model, x, ratio=0.5)
    assert model.a.out_features == 8 and model.b.out_features == 8
    torch.testing.assert_close(run(model, x), y, atol=0, rtol=0)


def test_slicing_channels_with_fixed_indices_keeps_them() -> None:
    class Slicer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 12)
            self.b = nn.Linear(6, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x)[:, :6])

    model = Slicer()
    result = prune(model, torch.randn(2, 4), ratio=0.5)
    assert model.a.out_features == 12 and result.params_after == result.params_before
