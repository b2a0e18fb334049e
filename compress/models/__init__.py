"""Models: the zoo (resnet, mobilenetv2, vit, mlp), Hugging Face directories and GGUF files, and ``load_model``."""

from __future__ import annotations

from compress.models.hf import (
    MINILM,
    SMOLLM2,
    gguf_directory,
    load_hf_model,
    load_tokenizer,
    minilm_dir,
    resolve_hf_path,
)
from compress.models.loading import apply_pruning_plan, check_state_dict, load_checkpoint, load_model
from compress.models.mlp import MLP
from compress.models.mobilenetv2 import MobileNetV2
from compress.models.resnet import ResNet
from compress.models.vit import Attention, ViT
from compress.models.zoo import ZOO, build_zoo_model, zoo_kwargs

__all__ = [
    "MINILM",
    "MLP",
    "SMOLLM2",
    "ZOO",
    "Attention",
    "MobileNetV2",
    "ResNet",
    "ViT",
    "apply_pruning_plan",
    "build_zoo_model",
    "check_state_dict",
    "gguf_directory",
    "load_checkpoint",
    "load_hf_model",
    "load_model",
    "load_tokenizer",
    "minilm_dir",
    "resolve_hf_path",
    "zoo_kwargs",
]
