"""Calibration data as LLM users hold it: a Hugging Face ``datasets.Dataset`` (raw rows or
``with_format("torch")``) and a DataLoader of tokenized dicts, fed to gptq and quantize on a
transformers Llama built from a config; unusable columns are named."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import compress
from compress.core.errors import CalibrationError

datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama() -> Any:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def rows() -> Any:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (8, 16), generator=g)
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})


@pytest.mark.parametrize("form", ["raw", "torch", "dataloader"])
def test_gptq_takes_a_datasets_dataset(llama: Any, rows: Any, form: str) -> None:
    data = {"raw": rows, "torch": rows.with_format("torch"),
            "dataloader": torch.utils.data.DataLoader(rows.with_format("torch"), batch_size=4)}[form]
    model = copy.deepcopy(llama)
    before = model.model.layers[0].mlp.down_proj.weight.detach().clone()
    compress.gptq(model, data, scheme="w4_weight_only", ignore=["lm_head"])
    after = model.model.layers[0].mlp.down_proj
    w = after.weight if hasattr(after, "weight") else after.linear.weight  # QuantLinear keeps the float weight
    assert w.shape == before.shape and torch.isfinite(w).all()
    ids = torch.tensor(rows["input_ids"][:2])
    assert torch.isfinite(model(input_ids=ids).logits).all()


def test_quantize_takes_dataset_rows(llama: Any, rows: Any) -> None:
    model = copy.deepcopy(llama)
    compress.quantize(model, "w8a8", rows.with_format("torch"))
    ids = torch.tensor(rows["input_ids"][:2])
    ref = llama(input_ids=ids).logits
    out = model(input_ids=ids).logits
    assert torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0) > 0.9


def test_a_text_column_is_named(llama: Any) -> None:
    raw = datasets.Dataset.from_dict({"text": ["def f(x):", "return x"]})
    with pytest.raises(CalibrationError, match=r"field 'text' of calibration batch 1 holds text; .*tokenize first"):
        compress.quantize(copy.deepcopy(llama), "w8a8", raw)


def test_a_loader_that_cannot_collate_is_named(llama: Any) -> None:
    ragged = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5]]})
    loader = torch.utils.data.DataLoader(ragged.with_format("torch"), batch_size=2)
    with pytest.raises(CalibrationError, match="making calibration batch 1 failed"):
        compress.gptq(copy.deepcopy(llama), loader, scheme="w4_weight_only", ignore=["lm_head"])
