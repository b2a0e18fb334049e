"""Shared, module-heavy fixtures for the export tests: a small ResNet trained on digits, its w8a8
fake-quant copy and their exports, built once per session (dynamo export takes seconds)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from compress.data import build_data
from compress.models import build_zoo_model
from compress.recipe import DataSpec, ExportSpec


@pytest.fixture(scope="session")
def digits() -> Any:
    return build_data(DataSpec(source="digits", eval_samples=256), batch_size=64, seed=0)


@pytest.fixture(scope="session")
def trained_resnet(digits: Any) -> nn.Module:
    """ResNet (16/32/64 channels) trained 2 epochs on digits: confident enough that int8 keeps its top-1."""
    torch.manual_seed(0)
    model = build_zoo_model("resnet", {"width": 16})
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(2):
        for x, y in digits.train:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    return model.eval()


@pytest.fixture(scope="session")
def quantized_resnet(trained_resnet: nn.Module, digits: Any) -> nn.Module:
    from compress.quantization.api import quantize

    torch.manual_seed(0)
    return quantize(copy.deepcopy(trained_resnet), "w8a8", digits.calibration).eval()


@pytest.fixture(scope="session")
def resnet_exports(quantized_resnet: nn.Module, trained_resnet: nn.Module, digits: Any, tmp_path_factory: Any) -> Any:
    """The pipeline's records: final int8 QDQ file and fp32 baseline."""
    from compress.export.pipeline import export_model

    out = tmp_path_factory.mktemp("resnet")
    return export_model(quantized_resnet, digits.example_inputs, ExportSpec(), out, baseline=trained_resnet,
                        metadata={"recipe.hash": "abc123"})


@pytest.fixture(scope="session")
def int8_path(resnet_exports: Any) -> Path:
    return next(r.path for r in resnet_exports if r.role == "final")


@pytest.fixture(scope="session")
def fp32_path(resnet_exports: Any) -> Path:
    return next(r.path for r in resnet_exports if r.role == "baseline")


def _tiny_bert() -> nn.Module:
    """A 2-layer BertModel with random weights: the MiniLM architecture at test size."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=64)
    return BertModel(cfg).eval()


def _text_batch(n: int, length: int, *, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 300, (n, length), generator=g)
    mask = torch.ones(n, length, dtype=torch.long)
    mask[: n // 2, length - 3 :] = 0
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros(n, length, dtype=torch.long)}


@pytest.fixture(scope="session")
def tiny_bert() -> Any:
    """Factory of fresh tiny BertModels (same seed, same weights)."""
    return _tiny_bert


@pytest.fixture(scope="session")
def text_batch() -> Any:
    """Factory of random token batches ``(n, length, seed=)`` with some padding."""
    return _text_batch


@pytest.fixture(scope="session")
def smollm2(smollm2_dir: str) -> Any:
    """``(model_dir, tokenizer)`` of the real SmolLM2-135M-Instruct: the float32 directory compress'
    GGUF loader caches (the root conftest's ``smollm2_dir``, shared with the other real-model tests)."""
    from transformers import AutoTokenizer

    return Path(smollm2_dir), AutoTokenizer.from_pretrained(smollm2_dir)
