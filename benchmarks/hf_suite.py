"""Widely used model definitions nobody on this project wrote: Hugging Face transformers' vision and
language architectures built from small configs with random weights (no download), for the
real-model suites of quantization (benchmarks/real_models.py, tests/quantization/test_real_models.py).

Each entry builds ``(model, example_inputs, calibration batches)``. BatchNorm layers get real
statistics from a few forward passes in train mode, so folding them is not folding identities.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class SuiteModel:
    """One model of the suite: the module, an example input and calibration inputs."""

    name: str
    model: nn.Module
    example: Any
    calibration: list[Any]
    kind: str  # "conv" | "vit" | "text"


def _images(n: int, batch: int, size: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, 3, size, size, generator=g) for _ in range(n)]


def _tokens(n: int, batch: int, seq: int, vocab: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, vocab, (batch, seq), generator=g)} for _ in range(n)]


def _bn_stats(model: nn.Module, data: list[Any]) -> None:
    if not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        return
    model.train()
    with torch.no_grad():
        for x in data:
            model(x) if isinstance(x, torch.Tensor) else model(**x)
    model.eval()


def _vision(cls_name: str, cfg_name: str, size: int, **cfg: Any) -> Callable[[int], SuiteModel]:
    def build(seed: int = 0) -> SuiteModel:
        import transformers

        torch.manual_seed(seed)
        config = getattr(transformers, cfg_name)(**cfg)
        model = getattr(transformers, cls_name)(config).eval()
        data = _images(4, 8, size, seed + 1)
        _bn_stats(model, data)
        kind = "conv" if any(isinstance(m, nn.Conv2d) and m.kernel_size != (1, 1) and m.kernel_size[0] < size // 4
                             for m in model.modules()) and "ViT" not in cfg_name else "vit"
        return SuiteModel(cls_name.replace("ForImageClassification", ""), model, data[0][:2], data, kind)

    return build


def _text(cls_name: str, cfg_name: str, vocab: int = 256, **cfg: Any) -> Callable[[int], SuiteModel]:
    def build(seed: int = 0) -> SuiteModel:
        import transformers

        torch.manual_seed(seed)
        config = getattr(transformers, cfg_name)(vocab_size=vocab, **cfg)
        if hasattr(config, "use_cache"):
            config.use_cache = False
        model = getattr(transformers, cls_name)(config).eval()
        data = _tokens(4, 4, 32, vocab, seed + 1)
        return SuiteModel(cls_name, model, {"input_ids": data[0]["input_ids"][:2]}, data, "text")

    return build


SUITE: dict[str, Callable[[int], SuiteModel]] = {
    "resnet": _vision("ResNetForImageClassification", "ResNetConfig", 64, embedding_size=32,
                      hidden_sizes=[32, 64, 128, 128], depths=[1, 1, 1, 1], num_labels=10),
    "convnext": _vision("ConvNextForImageClassification", "ConvNextConfig", 64, hidden_sizes=[32, 64, 96, 128],
                        depths=[1, 1, 1, 1], num_labels=10),
    "mobilenetv2": _vision("MobileNetV2ForImageClassification", "MobileNetV2Config", 64, depth_multiplier=0.5,
                           num_labels=10),
    "regnet": _vision("RegNetForImageClassification", "RegNetConfig", 64, embedding_size=16,
                      hidden_sizes=[32, 64, 96, 128], depths=[1, 1, 1, 1], groups_width=16, num_labels=10),
    "vit": _vision("ViTForImageClassification", "ViTConfig", 32, image_size=32, patch_size=8, hidden_size=64,
                   num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, num_labels=10),
    "swin": _vision("SwinForImageClassification", "SwinConfig", 64, image_size=64, patch_size=4, embed_dim=32,
                    depths=[1, 1], num_heads=[2, 4], window_size=4, num_labels=10),
    "mobilevit": _vision("MobileViTForImageClassification", "MobileViTConfig", 64, image_size=64,
                         hidden_sizes=[32, 48, 64], neck_hidden_sizes=[8, 16, 24, 32, 48, 64, 96], num_labels=10),
    "levit": _vision("LevitForImageClassification", "LevitConfig", 64, image_size=64, hidden_sizes=[32, 48, 64],
                     num_attention_heads=[2, 3, 4], depths=[1, 1, 1], key_dim=[8, 8, 8], num_labels=10),
    "bert": _text("BertModel", "BertConfig", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=128),
    "gpt2": _text("GPT2LMHeadModel", "GPT2Config", n_embd=64, n_layer=2, n_head=4),
    "llama": _text("LlamaForCausalLM", "LlamaConfig", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2),
    "qwen2": _text("Qwen2ForCausalLM", "Qwen2Config", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2),
}
