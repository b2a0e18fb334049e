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


def _text(cls_name: str, cfg_name: str, vocab: int = 256, seq: int = 32, **cfg: Any) -> Callable[[int], SuiteModel]:
    def build(seed: int = 0) -> SuiteModel:
        import transformers

        torch.manual_seed(seed)
        config = getattr(transformers, cfg_name)(vocab_size=vocab, **cfg)
        if hasattr(config, "use_cache"):
            config.use_cache = False
        model = getattr(transformers, cls_name)(config).eval()
        data = _tokens(4, 4, seq, vocab, seed + 1)
        return SuiteModel(cls_name, model, {"input_ids": data[0]["input_ids"][:2]}, data, "text")

    return build


def suite(layers: int = 2) -> dict[str, Callable[[int], SuiteModel]]:
    """The small configs; ``layers``: transformer layers of ViT and the text models (the tests take 1)."""
    return {
        "resnet": _vision("ResNetForImageClassification", "ResNetConfig", 64, embedding_size=32,
                          hidden_sizes=[32, 64, 128, 128], depths=[1, 1, 1, 1], num_labels=10),
        "convnext": _vision("ConvNextForImageClassification", "ConvNextConfig", 64, hidden_sizes=[32, 64, 96, 128],
                            depths=[1, 1, 1, 1], num_labels=10),
        "mobilenetv2": _vision("MobileNetV2ForImageClassification", "MobileNetV2Config", 64, depth_multiplier=0.5,
                               num_labels=10),
        "regnet": _vision("RegNetForImageClassification", "RegNetConfig", 64, embedding_size=16,
                          hidden_sizes=[32, 64, 96, 128], depths=[1, 1, 1, 1], groups_width=16, num_labels=10),
        "vit": _vision("ViTForImageClassification", "ViTConfig", 32, image_size=32, patch_size=8, hidden_size=64,
                       num_hidden_layers=layers, num_attention_heads=4, intermediate_size=128, num_labels=10),
        "swin": _vision("SwinForImageClassification", "SwinConfig", 64, image_size=64, patch_size=4, embed_dim=32,
                        depths=[1, 1], num_heads=[2, 4], window_size=4, num_labels=10),
        "mobilevit": _vision("MobileViTForImageClassification", "MobileViTConfig", 64, image_size=64,
                             hidden_sizes=[32, 48, 64], neck_hidden_sizes=[8, 16, 24, 32, 48, 64, 96], num_labels=10),
        "levit": _vision("LevitForImageClassification", "LevitConfig", 64, image_size=64, hidden_sizes=[32, 48, 64],
                         num_attention_heads=[2, 3, 4], depths=[1, 1, 1], key_dim=[8, 8, 8], num_labels=10),
        "bert": _text("BertModel", "BertConfig", hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                      intermediate_size=128),
        "gpt2": _text("GPT2LMHeadModel", "GPT2Config", n_embd=64, n_layer=layers, n_head=4),
        "llama": _text("LlamaForCausalLM", "LlamaConfig", hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2),
        "qwen2": _text("Qwen2ForCausalLM", "Qwen2Config", hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2),
    }


SUITE = suite()

#: The same architectures at the widths of their published base configs (ResNet-18, ConvNeXt-T,
#: MobileNetV2 1.0, RegNetY-800MF, ViT-S/16, Swin-T, MobileViT-S, LeViT-128S, BERT-base, GPT-2 small,
#: Llama/Qwen2 at 1024/896 wide), fewer blocks so a CPU benchmark stays minutes long: per-layer costs
#: and so int8/fp32 speed ratios depend on width and resolution, not on depth. The small suite above
#: is all Q/DQ overhead (32-128 channels at 64 px) and says little about serving speed.
SERVING: dict[str, Callable[[int], SuiteModel]] = {
    "resnet": _vision("ResNetForImageClassification", "ResNetConfig", 112, embedding_size=64, layer_type="basic",
                      hidden_sizes=[64, 128, 256, 512], depths=[2, 2, 2, 2], num_labels=1000),
    "convnext": _vision("ConvNextForImageClassification", "ConvNextConfig", 112, hidden_sizes=[96, 192, 384, 768],
                        depths=[1, 1, 3, 1], num_labels=1000),
    "mobilenetv2": _vision("MobileNetV2ForImageClassification", "MobileNetV2Config", 112, depth_multiplier=1.0,
                           num_labels=1000),
    "regnet": _vision("RegNetForImageClassification", "RegNetConfig", 112, embedding_size=32,
                      hidden_sizes=[64, 144, 320, 784], depths=[1, 3, 4, 2], groups_width=16, num_labels=1000),
    "vit": _vision("ViTForImageClassification", "ViTConfig", 160, image_size=160, patch_size=16, hidden_size=384,
                   num_hidden_layers=4, num_attention_heads=6, intermediate_size=1536, num_labels=1000),
    "swin": _vision("SwinForImageClassification", "SwinConfig", 112, image_size=112, patch_size=4, embed_dim=96,
                    depths=[2, 2, 2], num_heads=[3, 6, 12], window_size=7, num_labels=1000),
    "mobilevit": _vision("MobileViTForImageClassification", "MobileViTConfig", 128, image_size=128, num_labels=1000),
    "levit": _vision("LevitForImageClassification", "LevitConfig", 112, image_size=112, hidden_sizes=[128, 256, 384],
                     num_attention_heads=[4, 6, 8], depths=[2, 3, 4], key_dim=[16, 16, 16], num_labels=1000),
    "bert": _text("BertModel", "BertConfig", vocab=8192, seq=128, hidden_size=768, num_hidden_layers=4,
                  num_attention_heads=12, intermediate_size=3072),
    "gpt2": _text("GPT2LMHeadModel", "GPT2Config", vocab=8192, seq=128, n_embd=768, n_layer=4, n_head=12),
    "llama": _text("LlamaForCausalLM", "LlamaConfig", vocab=8192, seq=128, hidden_size=1024, intermediate_size=2816,
                   num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4),
    "qwen2": _text("Qwen2ForCausalLM", "Qwen2Config", vocab=8192, seq=128, hidden_size=896, intermediate_size=4864,
                   num_hidden_layers=4, num_attention_heads=14, num_key_value_heads=2),
}
