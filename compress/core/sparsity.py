"""Weight sparsity masks: the zeros SparseGPT and Wanda make stay zero through every later stage.

A pruned Linear holds its mask as a non-persistent buffer ``weight_mask`` (bool, True where the
weight is kept, the weight's shape). Non-persistent: the state_dict, and every checkpoint and export
written from it, is unchanged (the zeros are in the weight itself); the buffer moves with the module
(``.to(device)``) and a module swap that keeps the weight (QuantLinear.from_float / to_float) carries
it over (:func:`carry_mask`).

Who respects it: GPTQ rounds with the mask (no error is propagated into a pruned weight, and the
pruned weights round to the exact zero code); the session re-applies every mask after each optimizer
step it is told of and at the end of every stage (:func:`apply_masks`), and so does the built-in
Trainer without a session, so QAT and distillation fine-tuning keep the zeros. A loop of one's own
outside a session calls :func:`apply_masks` after ``optimizer.step()``.

This is the core floor: quantization/ (GPTQ), pruning/ (SparseGPT, Wanda) and the session all read
masks from here, none from another.
"""

from __future__ import annotations

import torch
from torch import nn

#: the buffer name a pruned module's mask is held under
MASK = "weight_mask"


def set_mask(module: nn.Module, keep: torch.Tensor) -> None:
    """Give ``module`` the mask ``keep`` (True: kept) and zero its pruned weights now."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or keep.shape != weight.shape:
        raise ValueError(f"a sparsity mask needs the weight's shape, got {tuple(keep.shape)}")
    keep = keep.to(device=weight.device, dtype=torch.bool)
    if MASK in module._buffers:
        module._buffers[MASK] = keep
    else:
        module.register_buffer(MASK, keep, persistent=False)
    with torch.no_grad():
        weight.masked_fill_(~keep, 0)


def mask_of(module: nn.Module) -> torch.Tensor | None:
    """The module's mask (True: kept), None when it was not pruned."""
    m = module._buffers.get(MASK)
    return m if isinstance(m, torch.Tensor) else None


def carry_mask(src: nn.Module, dst: nn.Module) -> None:
    """Give ``dst`` (a module swapped in for ``src``, sharing its weight) ``src``'s mask, if any."""
    m = mask_of(src)
    if m is not None:
        dst.register_buffer(MASK, m, persistent=False)


def masked_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The modules of ``model`` that hold a mask, by name."""
    return {n: m for n, m in model.named_modules() if mask_of(m) is not None}


@torch.no_grad()
def apply_masks(model: nn.Module) -> int:
    """Zero every masked module's pruned weights again (after an optimizer step); returns how many
    modules hold a mask."""
    n = 0
    for mod in model.modules():
        keep = mask_of(mod)
        if keep is None:
            continue
        weight = mod.weight
        if not isinstance(weight, torch.Tensor) or weight.shape != keep.shape:
            raise ValueError(f"{type(mod).__name__}: its weight no longer has its sparsity "
                             f"mask's shape {tuple(keep.shape)} (was it pruned structurally after?)")
        weight.masked_fill_(~keep.to(weight.device), 0)
        n += 1
    return n


def nm_groups_ok(weight: torch.Tensor, n: int, m: int) -> bool:
    """Whether every group of ``m`` consecutive input columns of ``weight`` holds at most ``n`` non-zeros."""
    rows, cols = weight.shape
    if cols % m:
        return False
    return bool(((weight.reshape(rows, cols // m, m) != 0).sum(-1) <= n).all())
