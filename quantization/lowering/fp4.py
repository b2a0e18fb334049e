"""The integer form of an fp4 layer (NVFP4, MXFP4) that checkpoint writers read: e2m1 nibbles and
the group scales as the formats store them.

- ``nibbles``: uint8 ``[N, K]``, bit 3 the sign, bits 0-2 the index of ``|value|`` in (0, 0.5, 1,
  1.5, 2, 3, 4, 6) (compressed-tensors' and llama.cpp's code);
- ``scale``: the effective group scales, float32 ``[N, G]`` (NVFP4: e4m3 / global);
- ``global_scale``: NVFP4's float32 ``[1]``, else None; ``e4m3_scale``: NVFP4's stored group scales
  (``scale * global_scale`` in float8 e4m3, exact); ``e8m0``: MXFP4's stored exponents (uint8).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from compress.quantization.numerics.primitives import e8m0_codes, fp4_codes

from compress.core.errors import UnsupportedModelError


@dataclass
class Fp4Weight:
    """An fp4 layer's weight as its codes and stored scales (see the module docstring)."""

    nibbles: torch.Tensor
    scale: torch.Tensor
    group_size: int
    global_scale: torch.Tensor | None
    e4m3_scale: torch.Tensor | None
    e8m0: torch.Tensor | None


def fp4_weight(mod: Any, *, where: str = "layer") -> Fp4Weight:
    """The fp4 form of ``mod``'s weight, or UnsupportedModelError saying why it has none."""
    wq = getattr(mod, "weight_quantizer", None)
    if wq is None or not wq.enabled or not wq.spec.is_fp4:
        raise UnsupportedModelError(f"{where}: its weights are not fp4")
    if not wq.calibrated:
        raise UnsupportedModelError(f"{where}: its weight quantizer is not calibrated")
    with torch.no_grad():
        values = wq.int_repr(mod.weight.detach().float())  # e2m1 values, [N, K]
        n = values.shape[0]
        scale = wq.scale.detach().float().reshape(n, -1)
        g = wq.global_scale.detach().float().reshape(1).clone() if wq.spec.scale_dtype == "fp8_e4m3" else None
        return Fp4Weight(
            nibbles=fp4_codes(values), scale=scale, group_size=int(wq.spec.group_size),
            global_scale=g, e4m3_scale=(scale * g).to(torch.float8_e4m3fn) if g is not None else None,
            e8m0=e8m0_codes(scale) if wq.spec.scale_dtype == "e8m0" else None)


def pack_pairs(nibbles: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K]`` nibbles -> ``[N, K/2]`` bytes, element ``2j`` low, ``2j + 1`` high
    (compressed-tensors' fp4 packing)."""
    return (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).contiguous()
