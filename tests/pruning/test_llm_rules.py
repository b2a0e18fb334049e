"""Decoder LLMs (transformers' Llama and Qwen2, grouped-query attention): RoPE's constant buffers
stay constants, and query head h is tied to key/value head h // n_rep, in SDPA and in eager code."""

from __future__ import annotations

import copy

import pytest
import torch
from pruning_blocks import prune_with_graph, run, zeroed_copy
from torch import nn

transformers = pytest.importorskip("transformers")

HEADS_AND_MLP = ["re:.*(q|k|v|gate|up)_proj"]


def _llm(kind: str, attn: str) -> nn.Module:
    torch.manual_seed(0)
    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[kind]
    cfg = cfg_cls(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, attn_implementation=attn,
    )
    return model_cls(cfg).eval()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_gqa_groups_prune_whole(kind: str, attn: str) -> None:
    from compress.pruning.api import PruneParams

    model = _llm(kind, attn)
    ids = torch.randint(0, 128, (2, 9))
    reference = copy.deepcopy(model)
    graph, keep, _ = prune_with_graph(model, ids, 0.5, params=PruneParams(targets=HEADS_AND_MLP))
    for layer in model.model.layers:
        a = layer.self_attn
        # one of two GQA groups left: 1 kv head (8 wide) and its 4 query heads
        assert a.k_proj.out_features == a.v_proj.out_features == 8
        assert a.q_proj.out_features == a.o_proj.in_features == 32
        assert layer.mlp.gate_proj.out_features == layer.mlp.up_proj.out_features == 48
    # each kept kv head j keeps exactly query heads 4j..4j+3: the pruned model computes what the
    # original computes with the removed groups and channels zeroed
    y = run(model, ids).logits
    torch.testing.assert_close(y, run(zeroed_copy(reference, graph, keep), ids).logits, atol=1e-5, rtol=1e-4)


def test_rope_buffer_is_no_channel() -> None:
    """inv_freq reaches every q/k head of every layer; as channels it would tie them all into one unit."""
    from compress.pruning.api import Pruner

    graph = Pruner().trace(_llm("llama", "eager"), torch.randint(0, 128, (2, 9)))
    assert not any("inv_freq" in c.key for c in graph.coords)
    heads = [g for g in graph.prunable_groups() if any(m.endswith("k_proj") for m in g.modules)]
    assert len(heads) == 2 and all(len(g.atoms) == 2 for g in heads)  # per layer, 2 GQA groups


class BufferPos(nn.Module):
    """A fixed positional table registered as a buffer and added to channels: sliced with them."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.register_buffer("pos", torch.randn(1, 5, 16))
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.inp(x) + self.pos)).mean(1)


def test_buffer_added_to_channels_is_sliced() -> None:
    model = BufferPos().eval()
    x = torch.randn(2, 5, 6)
    reference = copy.deepcopy(model)
    graph, keep, _ = prune_with_graph(model, x, 0.5)
    assert model.pos.shape == (1, 5, 8) and model.inp.out_features == 8
    torch.testing.assert_close(run(model, x), run(zeroed_copy(reference, graph, keep), x), atol=1e-5, rtol=1e-4)


def test_activation_importance_reads_what_flows_into_the_next_layer() -> None:
    """Minitron's criterion: an MLP channel whose activation into down_proj is silenced on the
    calibration data goes first, whatever its weight norms say; heads likewise by o_proj's input."""
    from compress.pruning.api import PruneParams, prune

    model = _llm("llama", "sdpa")
    mlp = model.model.layers[0].mlp
    with torch.no_grad():
        mlp.up_proj.weight[:48] *= 1e-4  # channels 0..47 carry almost nothing into down_proj
        mlp.down_proj.weight[:, :48] *= 50.0  # ... while their down_proj weights are the largest
    ids = torch.randint(0, 128, (4, 9))
    data = [{"input_ids": ids[i : i + 2]} for i in (0, 2)]
    kept = {}
    for importance in ("activation", "l2"):
        m = copy.deepcopy(model)
        prune(m, ids[:2], ratio=0.5, importance=importance, data=data, params=PruneParams(targets=HEADS_AND_MLP))
        w = m.model.layers[0].mlp.down_proj.weight  # the kept columns, matched back to the original
        full = mlp.down_proj.weight
        kept[importance] = {int(torch.nonzero((full == w[:, j : j + 1]).all(0))[0]) for j in range(w.shape[1])}
    assert kept["activation"] == set(range(48, 96))
    assert len(kept["l2"] & set(range(48))) >= 12  # weight magnitude keeps many silenced channels


def test_activation_importance_needs_data() -> None:
    from compress.pruning.api import prune

    from compress.core.errors import CalibrationError

    with pytest.raises(CalibrationError, match="activation"):
        prune(_llm("llama", "sdpa"), torch.randint(0, 128, (2, 5)), ratio=0.5, importance="activation")
