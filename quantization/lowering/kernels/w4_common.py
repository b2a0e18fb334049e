# mypy: disable-error-code="no-untyped-def"
# (Triton kernels annotate only their constexpr parameters; the rest are typed by the JIT.)
"""What the two W4A16 kernel modules share (kernels/w4a16.py, the dequantizing kernels and the tuner;
kernels/w4a16_mma.py, the tensor-core kernel on the codes): the launch configuration, the weight's
device tensors, and the epilogue."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from quantization.lowering.kernels.gemm import GemmConfig, bias_activation


@dataclass(frozen=True)
class W4Config(GemmConfig):
    """One launch configuration of the fused kernel (a GemmConfig's tile; ``group_m`` unused).
    ``block_m < 16`` sums on CUDA cores (decode); ``block_m >= 16`` uses ``tl.dot``. ``split_k``
    programs share each output tile's K range."""

    acc3: bool = False  # CUDA cores: accumulate elementwise, reduce over K once at the end
    prefetch: bool = False  # load the next weight tile before dequantizing this one
    # tensor cores on the codes, group scale on the accumulator (kernels/w4a16_mma.py; fp16/bf16,
    # K-tiles inside one group): no per-weight conversion or scale multiply
    scaled_acc: bool = False


@triton.jit
def _round_bf16(v):
    """float32 -> the nearest bf16 value (ties to even), still as float32 (finite inputs).

    The GPU's float32 -> bf16 cast rounds this way; the interpreter's truncates, so its bf16 path
    rounds here first and then casts exactly."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _finish(y, rn, bias_ptr, N, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, INTERP_BF16: tl.constexpr):
    """Bias and activation on float32 ``y`` (columns ``rn``): what is stored, before its cast."""
    y = bias_activation(y, rn, N, bias_ptr, HAS_BIAS, ACT)
    if INTERP_BF16:
        y = _round_bf16(y)  # exact in bf16 now: the interpreter's truncating cast keeps it
    return y


@dataclass(frozen=True)
class _Weight:
    """The packed weight's tensors on the activation's device, with placeholders for absent ones."""

    packed: torch.Tensor
    scale: torch.Tensor
    zp: torch.Tensor | None
    g_idx: torch.Tensor | None
    group_size: int

    def pointer_args(self) -> tuple[Any, ...]:
        z = self.zp if self.zp is not None else self.scale
        return (self.packed, self.scale, z, self.g_idx if self.g_idx is not None else self.scale)

    def stride_args(self) -> tuple[int, ...]:
        z = self.zp if self.zp is not None else self.scale
        return (self.packed.stride(0), self.packed.stride(1), self.scale.stride(0), self.scale.stride(1),
                z.stride(0), z.stride(1))
