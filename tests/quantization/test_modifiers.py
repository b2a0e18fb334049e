"""ptq and qat modifiers through the Session: calibration, QAT gradients (scales learn, loss falls),
BN freeze and folding, accuracy-aware PTQ and sensitivity."""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from compress.quantization import QuantConv2d, QuantLinear, input_quantizer, quantizers, set_quantizers
from compress.quantization.modifiers import scales_of
from torch import nn

from compress.core.errors import RecipeError
from compress.recipe import load_recipe
from compress.session import Session


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn(self.conv(x)))
        h = F.relu(self.conv2(h))
        return self.fc(h.mean((2, 3)))


def _task(n: int = 256, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A learnable 4-class task on 1x6x6 images: the class is which quadrant is bright."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=g)
    x = torch.randn(n, 1, 6, 6, generator=g) * 0.5
    for i in range(n):
        r, c = divmod(int(y[i]), 2)
        x[i, 0, r * 3 : r * 3 + 3, c * 3 : c * 3 + 3] += 1.5
    return [(x[i : i + 32], y[i : i + 32]) for i in range(0, n, 32)]


def _recipe(mods: list[dict[str, Any]], epochs: float = 0) -> Any:
    return load_recipe(
        {"version": 1, "model": {"name": "mlp"}, "stages": [{"name": "q", "epochs": epochs, "modifiers": mods}]}
    )


def _accuracy(model: nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    model.eval()
    with torch.no_grad():
        hits = sum(int((model(x).argmax(1) == y).sum()) for x, y in data)
    return hits / sum(len(y) for _, y in data)


def _trained(epochs: int = 4) -> Net:
    return copy.deepcopy(_train_once(epochs))


@functools.lru_cache(maxsize=2)
def _train_once(epochs: int) -> Net:
    torch.manual_seed(0)
    m = Net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    for _ in range(epochs):
        for x, y in _task():
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            opt.step()
    return m.eval()


def test_ptq_modifier_through_session() -> None:
    m = _trained()
    data = _task(seed=1)
    acc = _accuracy(m, data)
    with Session(_recipe([{"type": "ptq", "scheme": "w8a8", "num_batches": 4}]), m, calibration_data=data) as s:
        pass
    assert isinstance(s.model.conv, QuantConv2d) and isinstance(s.model.bn, nn.Identity)
    assert s.results[0].metrics["quantized_modules"] == 3
    assert abs(_accuracy(s.model, data) - acc) <= 0.02


def test_ptq_modifier_speed_check_keeps_layers_float_by_their_times() -> None:
    m = _trained()
    data = _task(seed=1)
    recipe = _recipe([{"type": "ptq", "scheme": "w8a8", "num_batches": 2,
                       "speed_check": {"batch": 64, "runs": 4, "min_speedup": 1e6}}])
    with Session(recipe, m, calibration_data=data) as s:
        pass
    # no int8 kernel is a million times faster: every layer stays float, each with its measured times
    assert s.results[0].metrics["quantized_modules"] == 0, s.model
    floats = s.model.quantizer_graph.placement.floats
    assert {k for k, v in floats.items() if "measured placement" in v and "at input [64, " in v} == {
        "conv:conv#0", "conv2:conv#0", "fc:linear#0"}, floats


def test_ptq_spec_errors_name_the_field() -> None:
    with pytest.raises(RecipeError, match=r"speed_check\.batch"):
        _recipe([{"type": "ptq", "speed_check": {"batch": 0}}])
    with pytest.raises(RecipeError, match="unknown quantization scheme 'w8a9'"):
        _recipe([{"type": "ptq", "scheme": "w8a9"}])
    with pytest.raises(RecipeError, match="smoothquant"):
        _recipe([{"type": "ptq", "smoothquant": 2.0}])
    with pytest.raises(RecipeError, match="unknown field 'observr'"):
        _recipe([{"type": "ptq", "observr": "mse"}])


def test_qat_scales_learn_loss_falls_bn_freezes_and_folds() -> None:
    m = _trained(epochs=2).train()  # QAT fine-tunes a partly trained model
    data = _task()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    recipe = _recipe([{"type": "qat", "lsq": True, "freeze_bn_epoch": 2, "num_batches": 2}], epochs=3)
    losses = []
    with Session(recipe, m, optimizer=opt, steps_per_epoch=len(data), calibration_data=data) as s:
        conv = s.model.conv
        assert isinstance(conv, QuantConv2d) and conv.bn is not None
        first = scales_of(s.model)
        assert all(q.learnable for _, q in quantizers(s.model))
        for epoch in range(3):
            total = 0.0
            s.model.train()
            for x, y in data:
                opt.zero_grad()
                loss = s.loss(F.cross_entropy(s.model(x), y), inputs=x, outputs=None)
                loss.backward()
                if epoch == 0:
                    grads = [q.scale.grad for _, q in quantizers(s.model)]
                    assert all(g is not None and torch.isfinite(g).all() for g in grads)
                opt.step()
                s.step()
                total += float(loss.detach())
            losses.append(total / len(data))
            if epoch == 2:
                assert conv.bn_frozen  # frozen from epoch 2 on
                rm = conv.bn.running_mean.clone()
                s.model(data[0][0])
                assert torch.equal(rm, conv.bn.running_mean)
            s.epoch_end()
    assert losses[-1] < losses[0] * 0.8
    last = scales_of(s.model)
    assert any(not torch.equal(first[k], last[k]) for k in first)  # LSQ moved the scales
    # finalized: BN folded into the conv, scales are buffers again, model runs quantized
    assert s.model.conv.bn is None and not any(q.learnable for _, q in quantizers(s.model))
    test = _task(seed=3)
    acc_q = _accuracy(s.model, test)
    set_quantizers(s.model, enabled=False)
    acc_f = _accuracy(s.model, test)
    assert acc_q > 0.7 and abs(acc_q - acc_f) <= 0.05, (acc_q, acc_f)


def test_qat_observers_track_then_freeze() -> None:
    torch.manual_seed(0)
    m = Net()
    data = _task()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    recipe = _recipe([{"type": "qat", "freeze_observers_epoch": 1, "num_batches": 1}], epochs=2)
    with Session(recipe, m, optimizer=opt, steps_per_epoch=len(data), train_data=data) as s:
        iq = input_quantizer(s.model, "fc")
        assert iq is not None and isinstance(s.model.fc, QuantLinear) and iq.observing and iq.observer.spec.observer == "ema"
        for epoch in range(2):
            for x, y in data:
                opt.zero_grad()
                F.cross_entropy(s.model(x * (1 + epoch)), y).backward()
                opt.step()
                s.step()
            if epoch == 0:
                s.epoch_end()
                assert not iq.observing  # frozen at epoch 1
                frozen = iq.scale.clone()
        s.epoch_end()
    assert torch.equal(iq.scale, frozen)  # inputs doubled in epoch 2, but ranges were frozen


def test_accuracy_aware_ptq_keeps_sensitive_layers_float(tmp_path: Any) -> None:
    m = _trained()
    data = _task(seed=1)

    def evaluate(model: nn.Module) -> float:
        return _accuracy(model, data)

    float_acc = evaluate(copy.deepcopy(m))
    # 3-bit-like damage: 4-bit per-tensor weights hurt; a zero budget forces float layers back
    recipe = _recipe(
        [
            {
                "type": "ptq",
                "scheme": {"weights": {"bits": 4, "granularity": "tensor"}, "inputs": None},
                "sensitivity": "metric",
                "max_accuracy_drop": 0.0,
            }
        ]
    )
    with Session(recipe, m, calibration_data=data, evaluate=evaluate, out_dir=tmp_path) as s:
        pass
    res = s.results[0]
    rows = res.tables["quantization_sensitivity"]
    assert {r["layer"] for r in rows} == {"conv", "conv2", "fc"}
    assert rows[0]["drop"] >= rows[-1]["drop"]
    kept = [r["layer"] for r in res.tables["quantization_kept_float"]]
    assert res.metrics["met_budget"] and evaluate(s.model) >= float_acc
    for name in kept:
        assert type(s.model.get_submodule(name)) in (nn.Conv2d, nn.Linear)
    assert res.artifacts and res.artifacts[0].endswith(".png")


def test_accuracy_aware_ptq_reads_a_lower_is_better_metric_the_right_way(tmp_path: Any) -> None:
    """An error rate (perplexity-like: lower is better) under the same zero budget: the modifier must
    see quantization's rise as the drop and keep layers float until the error is back down."""
    m = _trained()
    data = _task(seed=1)

    def error(model: nn.Module) -> float:
        return 1.0 - _accuracy(model, data)

    float_err = error(copy.deepcopy(m))
    # 3-bit narrow-range ([-3, 3]) per-tensor weights: enough damage that the quantized error is
    # above the float one (the full [-4, 3] grid, with its signed scale, is not, on this small task)
    recipe = _recipe([{"type": "ptq", "scheme": {"weights": {"bits": 3, "granularity": "tensor", "narrow_range": True},
                                                 "inputs": None},
                       "sensitivity": "metric", "max_accuracy_drop": 0.0}])
    with Session(recipe, m, calibration_data=data, evaluate=error, higher_is_better=False, out_dir=tmp_path) as s:
        pass
    res = s.results[0]
    rows = res.tables["quantization_sensitivity"]
    assert rows[0]["drop"] >= rows[-1]["drop"]
    assert res.metrics["quantized_metric"] <= float_err and res.metrics["met_budget"]
    assert res.tables["quantization_kept_float"]


def test_accuracy_control_ranks_only_when_the_budget_is_missed(tmp_path: Any) -> None:
    """Without a sensitivity table asked for, the units are ranked (one metric run each) only when the
    quantized model misses the budget: a generous budget reverts nothing and runs no ranking."""
    m = _trained()
    data = _task(seed=1)
    calls = []

    def evaluate(model: nn.Module) -> float:
        calls.append(1)
        return _accuracy(model, data)

    scheme = {"weights": {"bits": 4, "granularity": "tensor"}, "inputs": None}
    for budget, reverts in ((1.0, False), (0.0, True)):
        calls.clear()
        recipe = _recipe([{"type": "ptq", "scheme": scheme, "max_accuracy_drop": budget}])
        with Session(recipe, copy.deepcopy(m), calibration_data=data, evaluate=evaluate, out_dir=tmp_path) as s:
            pass
        res = s.results[0]
        assert "quantization_sensitivity" not in res.tables and res.metrics["met_budget"]
        assert bool(res.tables["quantization_kept_float"]) is reverts
        if not reverts:
            assert len(calls) == 2  # the float metric and the quantized one
