"""Triton int8 kernels for CUDA: W8A8 GEMM and convolution with fused epilogues, activation quantization.

Nothing here imports Triton at import time: ``import quantization`` must work without the
``compress[triton]`` extra. The kernel modules (``gemm``, ``quant``, ``conv``) import Triton and are
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

import functools
import importlib
import importlib.util
import os
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from compress.core.errors import CompressError

INSTALL_HINT = "pip install 'compress[triton]'"
ACTIVATIONS = ("none", "relu", "gelu")


@functools.cache
def triton_available() -> bool:
    """Whether the Triton package is importable (cached: every kernel launch checks it)."""
    return importlib.util.find_spec("triton") is not None


def interpret_mode() -> bool:
    """Whether ``TRITON_INTERPRET`` is set (kernels then run on CPU tensors, slowly, bit-exact)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() not in ("", "0", "false", "no")


def require_triton(what: str = "int8 kernels") -> None:
    """Raise a CompressError naming the extra to install when Triton is missing."""
    if not triton_available():
        raise CompressError(f"{what} need Triton: {INSTALL_HINT}")


def check_device(t: torch.Tensor, what: str) -> None:
    """Raise unless ``t`` can run through the Triton kernels (CUDA, or CPU under the interpreter)."""
    require_triton(what)
    if t.is_cuda:
        if _loaded_interpreted():
            raise CompressError(
                f"{what}: the kernels were loaded with TRITON_INTERPRET=1 (CPU interpreter); unset it for CUDA tensors"
            )
        return
    if t.device.type == "cpu" and interpret_mode():
        if _loaded_interpreted() is False:
            raise CompressError(
                f"{what}: TRITON_INTERPRET=1 was set after the kernels were compiled for CUDA; set it before importing"
            )
        return
    raise CompressError(
        f"{what} run on CUDA devices (got a {t.device.type} tensor); move the model to 'cuda', "
        "or keep the fake-quant model for CPU (TRITON_INTERPRET=1 runs the kernels on CPU for testing)"
    )


def _loaded_interpreted() -> bool | None:
    """Whether the loaded kernel modules were jitted for the interpreter (None: not loaded yet)."""
    mod = _MODULES.get("gemm")
    if mod is None:
        return None
    return bool(getattr(mod, "INTERPRETED", False))


_MODULES: dict[str, ModuleType] = {}


def load(name: str) -> ModuleType:
    """The kernel module ``name`` (``gemm``, ``quant``, ``conv`` or ``w4a16``), importing Triton on first use."""
    require_triton()
    if name not in _MODULES:
        if name != "gemm":
            load("gemm")  # gemm decides (and records) interpreter vs compiled mode for all
        _MODULES[name] = importlib.import_module(f"quantization.kernels.{name}")
    return _MODULES[name]


_LAZY = {
    "int8_gemm": "gemm",
    "GemmConfig": "gemm",
    "quantize_per_token": "quant",
    "quantize_static": "quant",
    "int8_conv2d": "conv",
    "w4a16_gemm": "w4a16",
}


def __getattr__(name: str) -> object:
    # the public kernel entry points, resolved on first use so that Triton loads only when needed
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'quantization.kernels' has no attribute '{name}'")
    return getattr(load(mod), name)


if TYPE_CHECKING:  # the lazy names above, for type checkers (importing them loads Triton)
    from quantization.kernels.conv import int8_conv2d as int8_conv2d
    from quantization.kernels.gemm import GemmConfig as GemmConfig
    from quantization.kernels.gemm import int8_gemm as int8_gemm
    from quantization.kernels.quant import quantize_per_token as quantize_per_token
    from quantization.kernels.quant import quantize_static as quantize_static
    from quantization.kernels.w4a16 import w4a16_gemm as w4a16_gemm
