"""Where the Triton kernels may run and how they are loaded: the Triton and device checks, and the
kernel modules imported on first use (the interpreter-or-compiled choice is made once, by gemm)."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from types import ModuleType

import torch

from compress.core.errors import CompressError
from compress.core.imports import install_hint

INSTALL_HINT = install_hint("triton")
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
    """The kernel module ``name`` (``gemm``, ``quant``, ``conv``, ``w4a16`` or ``norm``), importing Triton on first use."""
    require_triton()
    if name not in _MODULES:
        if name != "gemm":
            load("gemm")  # gemm decides (and records) interpreter vs compiled mode for all
        _MODULES[name] = importlib.import_module(f"compress.quantization.lowering.kernels.{name}")
    return _MODULES[name]
