"""The public real-model suite: transformers' own ViT, Swin, MobileViT, LeViT, DINOv2, ConvNext,
ResNet, RegNet, MobileNetV2, BERT, GPT-2 (Conv1D), T5, Llama and Qwen2 (GQA), built from configs
with random weights, each pruned at ratio 0.5: the forward runs with the same output shapes, at
most 0.8 of the parameters remain, and the plan rebuilds the pruned model on a fresh instance.
Two of them (a ViT, a GQA Llama) also go through ONNX Runtime; benchmarks/pruning_real.py checks
the export of every one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from compress.pruning.api import prune
from compress.pruning.counting import count_params
from compress.pruning.plan import PruningPlan

from benchmarks.pruning_real import build, check, names, onnx_parity, run


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.mark.parametrize("name", names())
def test_real_model_prunes_at_half(name: str) -> None:
    model, x = build(name)
    shapes = [tuple(t.shape) for t in run(model, x)]
    before = count_params(model)
    result = prune(model, x, ratio=0.5)
    assert check(model, x, shapes) == "ok"
    assert count_params(model) == result.params_after <= 0.8 * before
    fresh, _ = build(name, seed=1)
    PruningPlan.from_dict(result.plan.to_dict()).apply(fresh)
    fresh.load_state_dict(model.state_dict(), strict=True)
    for a, b in zip(run(fresh, x), run(model, x)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("name", ["vit", "llama"])
def test_real_model_pruned_runs_in_onnxruntime(name: str, tmp_path: Path) -> None:
    model, x = build(name)
    prune(model, x, ratio=0.5)
    assert onnx_parity(model, x, tmp_path / f"{name}.onnx") <= 1e-4
