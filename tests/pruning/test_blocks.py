"""Tricky blocks at several ratios: runs, same output shape, fewer params, exact surgery, replay."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from compress.pruning.counting import count_params
from compress.pruning.plan import PruningPlan
from pruning_blocks import BLOCKS, Tricky, onnx_outputs, prune_with_graph, run, zeroed_copy


@pytest.mark.parametrize("ratio", [0.3, 0.5, 0.7])
@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_block_prunes_exactly(name: str, ratio: float) -> None:
    cls, make_x = BLOCKS[name]
    model = cls().eval()
    x = make_x()
    before = count_params(model)
    reference = copy.deepcopy(model)
    y0 = run(model, x)
    graph, keep, slices = prune_with_graph(model, x, ratio)
    y = run(model, x)
    assert y.shape == y0.shape
    after = count_params(model)
    assert after < before
    # every prunable group lost floor(ratio * units) units (the cap of 0.9 never binds here)
    for g in graph.prunable_groups():
        removed = sum(not keep[a] for a in g.atoms)
        prunable = sum(graph.atoms[a].prunable for a in g.atoms)
        assert removed == min(int(np.floor(ratio * len(g.atoms) + 1e-9)), prunable, len(g.atoms) - 1)
    # the pruned model computes what the original computes with the removed channels zeroed
    expected = run(zeroed_copy(reference, graph, keep), x)
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-4)
    # the plan rebuilds the same architecture on a fresh instance, and the pruned weights load
    fresh = cls().eval()
    plan = PruningPlan()
    plan.add_step(slices)
    PruningPlan.from_dict(plan.to_dict()).apply(fresh)
    assert {k: v.shape for k, v in fresh.state_dict().items()} == {k: v.shape for k, v in model.state_dict().items()}
    fresh.load_state_dict(model.state_dict(), strict=True)
    torch.testing.assert_close(run(fresh, x), y, atol=0, rtol=0)


def test_block_couplings() -> None:
    """Spot checks of the groups the tracer finds."""
    from compress.pruning.api import Pruner

    def groups(model: torch.nn.Module, x: torch.Tensor) -> list[list[str]]:
        g = Pruner().trace(model, x)
        return [p.modules for p in g.prunable_groups()]

    res = groups(BLOCKS["residual"][0](), torch.randn(2, 3, 8, 8))
    assert ["b1.3", "stem.0"] in res  # the residual add couples both producers
    cat = BLOCKS["concat_flatten"][0]()
    g = Pruner().trace(cat, torch.randn(2, 3, 8, 8))
    (grp,) = [p for p in g.prunable_groups() if "a" in p.modules]
    assert grp.modules == ["a", "b"] and len(grp.atoms) == 20  # concat: one group, 8 + 12 channels
    fc_in = g.find_coord("head.weight", 1)
    assert fc_in is not None
    atoms = g.coord_atoms(fc_in)
    assert len(set(atoms[:16].tolist())) == 1  # flatten: 16 spatial features per channel
    chunk = Pruner().trace(BLOCKS["chunk_split"][0](), torch.randn(3, 10))
    gate = [p for p in chunk.prunable_groups() if p.modules == ["a"]]
    assert len(gate) == 1 and len(gate[0].atoms) == 16  # chunk(2): value i and gate i go together
    assert not [p for p in chunk.prunable_groups() if "b" in p.modules]  # split(h, 12): sizes are fixed
    attn = BLOCKS["attention"][0]()
    g = Pruner().trace(attn, torch.randint(0, 50, (2, 6)))
    heads = [p for p in g.prunable_groups() if "attn.q" in p.modules]
    assert len(heads) == 1 and len(heads[0].atoms) == 4 and heads[0].width(g) == 8
    q_rows = g.find_coord("sdpa_q.weight", 0)
    kv_rows = g.find_coord("sdpa_kv.weight", 0)
    assert q_rows is not None and kv_rows is not None
    q_atoms, kv_atoms = g.coord_atoms(q_rows), g.coord_atoms(kv_rows)
    assert len(set(q_atoms.tolist())) == 3  # sdpa heads: 3 units of 8 query rows
    for h in range(3):  # head h of q goes with head h of k and of v (both from the chunk of kv)
        assert set(kv_atoms[h * 16 : (h + 1) * 16].tolist()) == {q_atoms[h * 8]}


def test_attention_heads_update_module_attributes() -> None:
    cls, make_x = BLOCKS["attention"]
    model = cls().eval()
    prune_with_graph(model, make_x(), 0.5)
    assert model.attn.num_heads == 2 and model.attn.q.out_features == 16 and model.attn.head_dim == 8


def test_tricky_model_exports_to_onnx() -> None:
    model = Tricky().eval()
    x = torch.randn(2, 3, 8, 8)
    prune_with_graph(model, x, 0.5)
    got = onnx_outputs(model, x)
    np.testing.assert_allclose(got, run(model, x).numpy(), atol=1e-4, rtol=1e-4)
