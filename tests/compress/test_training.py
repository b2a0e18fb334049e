"""Trainer, schedules, evaluate and the metrics registry."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from compress.core.errors import CompressError, RecipeError
from compress.core.metrics import make_metric, mean_pool
from compress.core.trust import allow_code
from compress.recipe import TrainSpec
from compress.training import Trainer, build_optimizer, build_schedule, evaluate, fit, task_loss


def _loader(n: int = 128, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    return DataLoader(TensorDataset(x, y), batch_size=16)


def test_fit_lowers_the_loss_and_learns() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))
    before = evaluate(model, _loader())
    res = fit(model, _loader(), epochs=5, spec=TrainSpec(lr=0.1, device="cpu"))
    assert res.epochs == 5 and res.steps == 5 * 8
    assert res.losses[-1] < res.losses[0] * 0.6
    assert evaluate(model, _loader()) > max(before, 0.9)


def test_steps_limit_and_grad_clip() -> None:
    torch.manual_seed(0)
    model = nn.Linear(6, 2)
    spec = TrainSpec(lr=0.1, grad_clip=1e-3, momentum=0.0, weight_decay=0.0, schedule="constant", device="cpu")
    w0 = model.weight.detach().clone()
    res = Trainer(spec, progress=False).fit(model, _loader(), epochs=1, steps=3)
    assert res.steps == 3
    # each step moves the weights by at most lr * clip
    assert float((model.weight.detach() - w0).norm()) <= 3 * 0.1 * 1e-3 * 1.0001


def test_cosine_and_step_schedules() -> None:
    p = nn.Parameter(torch.randn(2))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = build_schedule(opt, TrainSpec(schedule="cosine", warmup_epochs=1), total_steps=20, steps_per_epoch=5)
    lrs = []
    for _ in range(20):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(1 / 5) and lrs[4] == pytest.approx(1.0)
    assert lrs[5 + 15 // 2] == pytest.approx(0.5 * (1 + math.cos(math.pi * 7 / 15)))
    opt2 = torch.optim.SGD([p], lr=1.0)
    s2 = build_schedule(opt2, TrainSpec(schedule="step", step_size=2, gamma=0.5), total_steps=30, steps_per_epoch=5)
    for _ in range(10):
        opt2.step()
        s2.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(0.5)


def test_optimizer_has_no_decay_on_biases_and_norms() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    opt = build_optimizer(model, TrainSpec(optimizer="adamw", weight_decay=0.1))
    assert isinstance(opt, torch.optim.AdamW)
    decayed = {id(p) for p in opt.param_groups[0]["params"]}
    assert decayed == {id(model[0].weight)}
    assert opt.param_groups[1]["weight_decay"] == 0.0


def test_unlabelled_batches_without_a_training_signal_are_an_error() -> None:
    x = torch.randn(32, 6)
    loader = DataLoader(TensorDataset(x), batch_size=8)
    with pytest.raises(CompressError, match="no gradient"):
        fit(nn.Linear(6, 2), loader, epochs=1, spec=TrainSpec(device="cpu"))
    assert float(task_loss(torch.randn(3, 2), None)) == 0.0


def test_metrics_registry_and_user_metric() -> None:
    logits = torch.tensor([[0.1, 0.9, 0.0], [0.8, 0.1, 0.1], [0.2, 0.3, 0.5], [0.4, 0.35, 0.25]])
    y = torch.tensor([1, 1, 2, 1])
    m = make_metric("accuracy")
    m.update(logits, y)
    assert m.compute() == pytest.approx(0.5)
    t5 = make_metric("top5")
    t5.update(logits, y)
    assert t5.compute() == 1.0
    with pytest.raises(RecipeError, match="did you mean 'accuracy'"):
        make_metric("acuracy")
    with pytest.raises(RecipeError, match="runs such code only when you trust it"):
        make_metric("tests.compress.test_training:_neg_l1")  # a user function: the recipe's code
    with allow_code():
        with pytest.raises(RecipeError, match="cannot import"):
            make_metric("no_such_module_xyz:fn")
        user = make_metric("tests.compress.test_training:_neg_l1")
    user.update(logits, y, inputs=logits)
    assert user.compute() == pytest.approx(_neg_l1(logits, y))


def _neg_l1(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    return -float(outputs.abs().mean())


def test_embedding_cosine_uses_the_attention_mask() -> None:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 4, 8, generator=g)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    pooled = mean_pool(h, mask)
    assert torch.allclose(pooled[0], h[0, :2].mean(0))
    other = h.clone()
    other[0, 2:] = torch.randn(2, 8, generator=g)  # masked positions: must not change the score
    m = make_metric("embedding_cosine")
    m.update(other, None, inputs={"attention_mask": mask}, reference=h)
    assert m.compute() == pytest.approx(1.0, abs=1e-6)
    m2 = make_metric("embedding_cosine")
    m2.update(-h, None, inputs={"attention_mask": mask}, reference=h)
    assert m2.compute() == pytest.approx(-1.0, abs=1e-6)
