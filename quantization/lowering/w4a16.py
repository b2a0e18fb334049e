"""W4A16Linear: a weight-only int4 Linear running the Triton W4A16 kernel (CUDA; CPU under the interpreter).

Built from a calibrated QuantLinear whose weights are 4-bit and whose inputs are not quantized
(``w4_weight_only_g128``, GPTQ, AWQ): the weight is stored once as packed nibbles with float32
group scales and uint8 zero points (:mod:`quantization.lowering.int4`), activations stay fp16/bf16 (or
fp32) and the weight is dequantized inside the kernel (decode), or once per call into the
activation dtype for cuBLAS from 32 rows on (prefill; see quantization/lowering/kernels/w4a16.py). The
dequantized weight is exactly the fake-quant model's, so outputs differ from it only by
accumulation order.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from compress.core.errors import CompressError, UnsupportedModelError
from quantization.lowering.int4 import Int4Weight, int4_weight, is_int4_weight_only, pack_nibbles
from quantization.lowering.kernels import ACTIVATIONS, load


class W4A16Linear(nn.Module):
    """Linear with int4 weights ``[out, in/2]`` packed two per byte, group scales, fp16/bf16 activations."""

    weight_packed: torch.Tensor
    weight_scale: torch.Tensor
    weight_zero_point: torch.Tensor | None
    g_idx: torch.Tensor | None
    bias: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, *, group_size: int) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.activation = "none"

    @classmethod
    def from_int4(cls, w: Int4Weight, bias: torch.Tensor | None, *, activation: str = "none") -> W4A16Linear:
        n, k = w.shape
        if k % 2:
            raise UnsupportedModelError(f"it has {k} input features; the int4 kernel packs pairs (an even count)")
        new = cls(k, n, group_size=w.group_size)
        new.register_buffer("weight_packed", pack_nibbles(w.codes))
        new.register_buffer("weight_scale", w.scale.float().contiguous())
        # symmetric int4 has zero point 8 everywhere: the kernel uses the constant instead of loading it
        sym = bool((w.zero_point == 8).all())
        new.register_buffer("weight_zero_point", None if sym else w.zero_point.contiguous())
        new.register_buffer("g_idx", w.g_idx)
        new.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        if activation not in ACTIVATIONS:
            raise CompressError(f"unknown fused activation '{activation}'; valid: {', '.join(ACTIVATIONS)}")
        new.activation = activation
        return new

    @classmethod
    def from_quant(cls, mod: Any, *, activation: str = "none", input_quantizer: Any = None) -> W4A16Linear:
        """A W4A16Linear computing what the weight-only int4 ``QuantLinear`` ``mod`` computes
        (``input_quantizer`` is accepted for the converter's one call form; weight-only layers have none)."""
        if not is_int4_weight_only(mod):
            raise UnsupportedModelError("it is not a weight-only 4-bit layer")
        if getattr(mod, "output_quantizer", None) is not None:
            raise UnsupportedModelError("it has an output quantizer; the W4A16 kernel has no output quantization")
        new = cls.from_int4(int4_weight(mod), mod.bias, activation=activation)
        return new.to(mod.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = load("w4a16").w4a16_gemm(
            x.reshape(-1, self.in_features), self.weight_packed, scale=self.weight_scale, group_size=self.group_size,
            zero_point=self.weight_zero_point, g_idx=self.g_idx, bias=self.bias, activation=self.activation,
        )
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        zp = "asym" if self.weight_zero_point is not None else "sym"
        act = ", act_order" if self.g_idx is not None else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, int4 {zp} g{self.group_size}{act}, "
            f"act={self.activation}"
        )
