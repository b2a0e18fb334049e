"""Hidden-state, attention and sentence-embedding distillation on Hugging Face BERT models."""

from __future__ import annotations

import pytest
import torch
from compress.distillation.api import Distiller
from compress.distillation.losses import attention_kl, cosine_loss, feature_mse, mean_pool

from compress.core.errors import RecipeError

transformers = pytest.importorskip("transformers")


def _bert(hidden: int, layers: int, heads: int = 4, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(
        vocab_size=100, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=2 * hidden, max_position_embeddings=32,
    )
    return transformers.BertModel(cfg, add_pooling_layer=True)


@pytest.fixture
def batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[0, 5:] = 0  # a padded sequence: padding must not count
    return {"input_ids": torch.randint(1, 100, (3, 7), generator=g), "attention_mask": mask}


def test_hidden_state_attention_and_cosine_terms_match_references(batch: dict[str, torch.Tensor]) -> None:
    teacher, student = _bert(32, 4, seed=0), _bert(16, 2, seed=1)
    losses = [{"type": "hidden_states"}, {"type": "attention"}, {"type": "cosine"}]
    d = Distiller(teacher, student, losses=losses, example_inputs=batch)
    assert student.config.output_hidden_states and student.config.output_attentions
    assert student.config._attn_implementation == "eager"
    # uniform mapping: student states 0,1,2 -> teacher 0,2,4; attention layers 0,1 -> 1,3
    adapters = dict(d.adapters.modules.items())
    assert set(adapters) == {"hidden_states:0", "hidden_states:1", "hidden_states:2", "cosine:embedding"}
    assert all((a.in_features, a.out_features) == (16, 32) for a in adapters.values())
    student.eval()
    out = student(**batch)
    d(batch, out)
    with torch.no_grad():
        t = teacher(**batch, output_hidden_states=True, output_attentions=True)
        m = batch["attention_mask"]
        ref_h = sum(
            feature_mse(adapters[f"hidden_states:{i}"](out.hidden_states[i]), t.hidden_states[j], mask=m)
            for i, j in {0: 0, 1: 2, 2: 4}.items()
        ) / 3
        ref_a = (attention_kl(out.attentions[0], t.attentions[1], mask=m)
                 + attention_kl(out.attentions[1], t.attentions[3], mask=m)) / 2
        es = adapters["cosine:embedding"](mean_pool(out.last_hidden_state, m))
        ref_c = cosine_loss(es, mean_pool(t.last_hidden_state, m))
    assert d.last["hidden_states"].item() == pytest.approx(ref_h.item(), rel=1e-5)
    assert d.last["attention"].item() == pytest.approx(ref_a.item(), rel=1e-5)
    assert d.last["cosine"].item() == pytest.approx(ref_c.item(), rel=1e-5)
    d.remove()
    assert not student.config.output_hidden_states and not student.config.output_attentions
    assert student.config._attn_implementation == "sdpa"
    assert teacher.config._attn_implementation == "sdpa"


def test_training_lowers_the_embedding_distance(batch: dict[str, torch.Tensor]) -> None:
    teacher, student = _bert(32, 2, seed=0), _bert(16, 1, seed=1)
    d = Distiller(teacher, student, losses=[{"type": "cosine"}, {"type": "hidden_states", "weight": 0.1}], example_inputs=batch)
    opt = torch.optim.AdamW([*student.parameters(), *d.parameters()], lr=3e-3)
    first = None
    for _ in range(15):
        loss = d(batch, student(**batch))
        first = first if first is not None else d.last["cosine"].item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    d(batch, student(**batch))
    assert d.last["cosine"].item() < 0.5 * first
    d.remove()


def test_attention_needs_equal_heads_and_transformer_outputs(batch: dict[str, torch.Tensor]) -> None:
    teacher, student = _bert(32, 2, heads=4), _bert(16, 2, heads=2, seed=1)
    with pytest.raises(RecipeError, match="equal head counts"):
        Distiller(teacher, student, losses=[{"type": "attention"}], example_inputs=batch)
    with pytest.raises(RecipeError, match="out of range"):
        Distiller(teacher, _bert(16, 2, seed=1), losses=[{"type": "hidden_states", "layers": {0: 9}}], example_inputs=batch)
    with pytest.raises(RecipeError, match="not one"):
        Distiller(teacher, torch.nn.Linear(4, 4), losses=[{"type": "hidden_states"}])
