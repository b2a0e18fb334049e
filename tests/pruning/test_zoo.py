"""Every zoo model pruned at 30/50/70%: runs, same output shape, parameters and MACs fall as the cost
model predicts, exact where no LayerNorm spans pruned channels, plan replay, ONNX Runtime parity."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from compress.pruning.counting import count_macs, count_params
from compress.pruning.plan import PruningPlan
from compress.pruning.select import CostModel
from pruning_blocks import onnx_outputs, prune_with_graph, run, zeroed_copy

from compress.models.zoo import build_zoo_model

ZOO = {
    "resnet": {"width": 8, "depth": 1},
    "mobilenetv2": {"width_mult": 0.5},
    "vit": {"dim": 32, "depth": 1, "heads": 4},
    "vit_mha": {"dim": 32, "depth": 1, "heads": 4, "attn": "mha"},
    "mlp": {"hidden": 32},
}
# models whose pruned channels never pass through a LayerNorm: pruned == original with them zeroed
EXACT = {"resnet", "mobilenetv2", "mlp"}


def build(name: str) -> torch.nn.Module:
    return build_zoo_model(name.removesuffix("_mha"), ZOO[name]).eval()


@pytest.mark.parametrize("ratio", [0.3, 0.5, 0.7])
@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_model_prunes(name: str, ratio: float) -> None:
    import copy

    model = build(name)
    x = torch.randn(2, 1, 8, 8)
    reference = copy.deepcopy(model)
    y0 = run(model, x)
    params0, macs0 = count_params(model), count_macs(model, x)
    from compress.pruning.api import Pruner

    pruner = Pruner()
    graph = pruner.trace(model, x)
    keep = pruner.select(model, graph, ratio=ratio, budget=None)
    cost = CostModel(graph, model)
    predicted = (cost.params(keep), cost.macs(keep) // 2)
    slices = pruner.cut(model, graph, keep, x)
    y = run(model, x)
    assert y.shape == y0.shape and torch.isfinite(y).all()
    params1, macs1 = count_params(model), count_macs(model, x)
    assert (params1, macs1) == predicted  # the cost model the MAC/param targets use is exact
    # channels fall roughly quadratically in params: at least the ratio itself is gone from the prunable part
    assert params1 < params0 * (1 - ratio * 0.5) and macs1 < macs0
    if name in EXACT:
        torch.testing.assert_close(y, run(zeroed_copy(reference, graph, keep), x), atol=1e-5, rtol=1e-4)
    fresh = build(name)
    plan = PruningPlan()
    plan.add_step(slices)
    plan.apply(fresh)
    fresh.load_state_dict(model.state_dict(), strict=True)
    torch.testing.assert_close(run(fresh, x), y, atol=0, rtol=0)


@pytest.mark.parametrize("name", ["resnet", "vit_mha"])
def test_pruned_zoo_model_runs_in_onnxruntime(name: str) -> None:
    model = build(name)
    x = torch.randn(2, 1, 8, 8)
    prune_with_graph(model, x, 0.5)
    np.testing.assert_allclose(onnx_outputs(model, x), run(model, x).numpy(), atol=1e-4, rtol=1e-4)


def test_vit_mha_becomes_pruned_attention() -> None:
    from compress.pruning.attention import PrunedMultiheadAttention

    model = build("vit_mha")
    x = torch.randn(2, 1, 8, 8)
    prune_with_graph(model, x, 0.5)
    attn = model.blocks[0].attn.mha
    assert isinstance(attn, PrunedMultiheadAttention)
    assert attn.num_heads == 2 and attn.in_proj_weight.shape == (3 * 2 * 8, 16)
    # need_weights=True takes the explicit path; both paths agree
    t = torch.randn(2, 5, 16)
    out_fast, _ = attn(t, t, t, need_weights=False)
    out_slow, w = attn(t, t, t, need_weights=True)
    torch.testing.assert_close(out_fast, out_slow, atol=1e-5, rtol=1e-4)
    assert w is not None and w.shape == (2, 5, 5)
