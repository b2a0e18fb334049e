"""Importance criteria, local/global modes, the per-group cap, overrides, round_to, targets."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from compress.pruning.api import PruneParams, Pruner, prune
from compress.pruning.counting import count_macs, count_params
from compress.pruning.importance import atom_scores
from pruning_blocks import Residual
from torch import nn

from compress.models.zoo import build_zoo_model


class TwoLayer(nn.Module):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, hidden)
        self.bn = nn.BatchNorm1d(hidden)
        self.fc2 = nn.Linear(hidden, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.bn(self.fc1(x))))


def _kept_rows(model: TwoLayer, before: torch.Tensor) -> set[int]:
    return {int(torch.nonzero((before == r).all(1))[0]) for r in model.fc1.weight.detach()}


@pytest.mark.parametrize("criterion", ["l1", "l2"])
def test_magnitude_criteria_drop_the_weakest_channels(criterion: str) -> None:
    model = TwoLayer()
    with torch.no_grad():
        model.fc1.weight[[2, 5, 11]] *= 1e-3
        model.fc2.weight[:, [2, 5, 11]] *= 1e-3
    w = model.fc1.weight.detach().clone()
    prune(model, torch.randn(4, 6), ratio=3 / 16, importance=criterion)
    assert model.fc1.out_features == 13
    assert not {2, 5, 11} & _kept_rows(model, w)


def test_bn_scale_reads_gamma() -> None:
    model = TwoLayer()
    with torch.no_grad():
        model.bn.weight.fill_(1.0)
        model.bn.weight[[0, 7]] = 1e-4
    w = model.fc1.weight.detach().clone()
    prune(model, torch.randn(4, 6), ratio=2 / 16, importance="bn_scale")
    assert not {0, 7} & _kept_rows(model, w)


def test_taylor_uses_gradients_of_the_loss() -> None:
    model = TwoLayer().eval()
    x, y = torch.randn(32, 6), torch.randint(0, 3, (32,))
    with torch.no_grad():
        model.fc2.weight[:, [1, 4]] = 0.0  # channels that cannot change the loss: zero gradient
    w = model.fc1.weight.detach().clone()
    prune(model, x[:4], ratio=2 / 16, importance="taylor", data=[(x, y)])
    assert not {1, 4} & _kept_rows(model, w)


def test_random_is_seeded() -> None:
    g = Pruner().trace(TwoLayer(), torch.randn(4, 6))
    a = atom_scores(g, TwoLayer(), "random", seed=1)
    b = atom_scores(g, TwoLayer(), "random", seed=1)
    c = atom_scores(g, TwoLayer(), "random", seed=2)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def _widths(model: nn.Module) -> dict[str, int]:
    return {n: m.out_channels for n, m in model.named_modules() if isinstance(m, nn.Conv2d)}


def test_round_to_keeps_multiples() -> None:
    model = build_zoo_model("resnet", {"width": 16})
    prune(model, torch.randn(2, 1, 8, 8), ratio=0.3, round_to=8)
    assert all(w % 8 == 0 for w in _widths(model).values()), _widths(model)


def test_overrides_and_cap() -> None:
    model = Residual()
    x = torch.randn(2, 3, 8, 8)
    prune(model, x, ratio=0.5, params=PruneParams(overrides={"b1.0": 0.25}, max_ratio=0.4))
    assert model.b1[0].out_channels == 18  # override 0.25 of 24
    assert model.stem[0].out_channels == 10  # 0.5 capped at 0.4 of 16 (floor 6 removed)


def test_targets_restrict_pruning() -> None:
    model = Residual()
    prune(model, torch.randn(2, 3, 8, 8), ratio=0.5, params=PruneParams(targets=["b1.0"]))
    assert model.b1[0].out_channels == 12 and model.stem[0].out_channels == 16


def test_ignore_keeps_outputs_of_a_layer() -> None:
    model = Residual()
    prune(model, torch.randn(2, 3, 8, 8), ratio=0.5, ignore=["stem.0"])
    assert model.stem[0].out_channels == 16 and model.b1[0].out_channels == 12


def test_global_mode_prunes_unevenly() -> None:
    model2 = build_zoo_model("resnet", {"width": 8})
    with torch.no_grad():  # make one group much weaker: global mode takes more from it
        model2.layer3[0].conv2.weight.mul_(1e-3)
        model2.layer3[0].shortcut[0].weight.mul_(1e-3)
    res = prune(model2, torch.randn(2, 1, 8, 8), ratio=0.3, params=PruneParams(mode="global"))
    widths = _widths(model2)
    assert widths["layer3.0.conv2"] < 32 * 0.7 - 1  # more than the uniform 30% from the weak group
    assert res.params_after < res.params_before


@pytest.mark.parametrize("metric", ["params", "macs"])
@pytest.mark.parametrize("mode", ["local", "global"])
def test_target_fraction_is_reached(metric: str, mode: str) -> None:
    model = build_zoo_model("mobilenetv2", {"width_mult": 0.5})
    x = torch.randn(2, 1, 8, 8)
    before = count_params(model) if metric == "params" else count_macs(model, x)
    res = prune(model, x, budget={metric: 0.5}, params=PruneParams(mode=mode))
    after = count_params(model) if metric == "params" else count_macs(model, x)
    assert after <= 0.5 * before and after > 0.4 * before  # the smallest ratio that gets there
    assert (res.params_after if metric == "params" else res.macs_after) == after


def test_optimizer_state_is_sliced() -> None:
    model = TwoLayer()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    F.cross_entropy(model(x), y).backward()
    opt.step()
    old_w = model.fc1.weight.detach().clone()
    old_buf = opt.state[model.fc1.weight]["momentum_buffer"].clone()
    prune(model, x, ratio=0.5, optimizer=opt)
    kept = sorted(_kept_rows(model, old_w))
    buf = opt.state[model.fc1.weight]["momentum_buffer"]
    assert buf.shape == model.fc1.weight.shape
    torch.testing.assert_close(buf, old_buf[kept], atol=0, rtol=0)
    params = {id(p) for g in opt.param_groups for p in g["params"]}
    assert all(id(p) in params for p in model.parameters())
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()  # the optimizer keeps training the pruned model


def test_bn_recalibration_reestimates_statistics() -> None:
    from compress.pruning.recalibrate import recalibrate_bn

    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Dropout(0.5)).eval()
    x = torch.randn(16, 1, 8, 8) * 3 + 1
    assert recalibrate_bn(model, [(x, None), (x, None)], batches=1) == 1
    bn = model[1]
    with torch.no_grad():
        conv = model[0](x)
    torch.testing.assert_close(bn.running_mean, conv.mean((0, 2, 3)), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(bn.running_var, conv.var((0, 2, 3)), atol=1e-4, rtol=1e-4)
    assert bn.momentum == 0.1 and not model.training and not model[2].training
