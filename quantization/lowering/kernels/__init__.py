"""Triton int8 kernels for CUDA: W8A8 GEMM and convolution with fused epilogues, activation quantization.

Nothing here imports Triton at import time: ``import quantization`` must work without the
``the triton extra`` extra. The kernel modules (``gemm``, ``quant``, ``conv``) import Triton and are
loaded on first use through :func:`load`.

Design, shared by all kernels:

- Integers stay int8 end to end: weights are stored once as int8 ``[N, K]`` (K contiguous, the
  operand layout int8 tensor cores want), activations are quantized to int8 in one pass. uint8
  (asymmetric) codes are shifted by -128 into int8 with the zero point shifted the same way, so a
  single int8 x int8 -> int32 ``tl.dot`` serves both; the zero point's contribution
  ``zp * sum_k w[n, k]`` is subtracted in the epilogue from a precomputed column sum.
- The epilogue is fused before the one store: int32 accumulator -> float32, times the activation
  scale (per tensor or per row/token), times the weight scale (per output channel), plus bias,
  optional ReLU/GELU, cast to fp16/bf16/fp32. The float math follows the same order as the torch
  reference so that tests compare it tightly.
- Rounding is round-half-to-even like ``torch.round`` (hence bit-identical codes to the fake-quant
  model), done by the float32 magic-number trick after clamping: portable to the interpreter and
  immune to FMA contraction because the clamp sits between the multiply and the add.
- On CPU tensors the kernels run only under ``TRITON_INTERPRET=1`` (set before this package's
  kernel modules are imported); otherwise they raise rather than fall back silently.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from compress.quantization.lowering.kernels.runtime import ACTIVATIONS as ACTIVATIONS
from compress.quantization.lowering.kernels.runtime import INSTALL_HINT as INSTALL_HINT
from compress.quantization.lowering.kernels.runtime import check_device as check_device
from compress.quantization.lowering.kernels.runtime import interpret_mode as interpret_mode
from compress.quantization.lowering.kernels.runtime import load as load
from compress.quantization.lowering.kernels.runtime import require_triton as require_triton
from compress.quantization.lowering.kernels.runtime import triton_available as triton_available

_LAZY = {
    "int8_gemm": "gemm",
    "GemmConfig": "gemm",
    "quantize_per_token": "quant",
    "quantize_static": "quant",
    "int8_conv2d": "conv",
    "w4a16_gemm": "w4a16",
    "rmsnorm_quantize": "norm",
    "layernorm_quantize": "norm",
}


def __getattr__(name: str) -> object:
    # the public kernel entry points, resolved on first use so that Triton loads only when needed
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'compress.quantization.lowering.kernels' has no attribute '{name}'")
    return getattr(load(mod), name)


if TYPE_CHECKING:  # the lazy names above, for type checkers (importing them loads Triton)
    from compress.quantization.lowering.kernels.conv import int8_conv2d as int8_conv2d
    from compress.quantization.lowering.kernels.gemm import GemmConfig as GemmConfig
    from compress.quantization.lowering.kernels.gemm import int8_gemm as int8_gemm
    from compress.quantization.lowering.kernels.norm import layernorm_quantize as layernorm_quantize
    from compress.quantization.lowering.kernels.norm import rmsnorm_quantize as rmsnorm_quantize
    from compress.quantization.lowering.kernels.quant import quantize_per_token as quantize_per_token
    from compress.quantization.lowering.kernels.quant import quantize_static as quantize_static
    from compress.quantization.lowering.kernels.w4a16 import w4a16_gemm as w4a16_gemm
