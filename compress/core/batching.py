"""The batch convention shared by the trainer, calibration loops and modifiers.

A batch is ``(inputs, targets)``: ``inputs`` a Tensor or a dict of Tensors (Hugging Face style
keyword inputs), ``targets`` a Tensor or None. A bare Tensor or dict is a batch without targets.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

Inputs = torch.Tensor | Mapping[str, torch.Tensor]


def split_batch(batch: Any) -> tuple[Any, Any]:
    """``(inputs, targets)`` of a batch; targets is None for unlabelled batches."""
    if isinstance(batch, (tuple, list)):
        if len(batch) == 2:
            return batch[0], batch[1]
        if len(batch) == 1:
            return batch[0], None
    return batch, None


def call_model(model: nn.Module, inputs: Any) -> Any:
    """Run ``model`` on inputs in either convention (positional tensor or keyword dict)."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)


def to_device(obj: Any, device: torch.device | str) -> Any:
    """Move tensors nested in tuples, lists and dicts to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, Mapping):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


def primary_output(outputs: Any) -> torch.Tensor:
    """The tensor a metric or loss reads: logits, or an HF model's first output."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, Mapping):
        for key in ("logits", "last_hidden_state", "pooler_output"):
            if key in outputs:
                return outputs[key]
        return next(iter(outputs.values()))
    if isinstance(outputs, (tuple, list)):
        return primary_output(outputs[0])
    if hasattr(outputs, "logits"):
        return outputs.logits
    if hasattr(outputs, "last_hidden_state"):
        return outputs.last_hidden_state
    raise TypeError(f"cannot find a tensor in model outputs of type {type(outputs).__name__}")


def batch_size_of(inputs: Any) -> int:
    """Number of samples in ``inputs``."""
    if isinstance(inputs, torch.Tensor):
        return int(inputs.shape[0])
    if isinstance(inputs, Mapping):
        return batch_size_of(next(iter(inputs.values())))
    if isinstance(inputs, (tuple, list)):
        return batch_size_of(inputs[0])
    raise TypeError(f"cannot tell the batch size of {type(inputs).__name__}")
