"""FusedRMSNorm: a converted model's RMSNorm as one kernel that also quantizes its output for the
int8/fp8 layers reading it (quantization/lowering/kernels/norm.py).

Which modules: any module whose class name ends in ``RMSNorm`` with a 1-D ``weight`` and an
``variance_epsilon`` or ``eps`` attribute, replaced only when a numeric proof at conversion passes:
the original module and the kernel's formula (the kernel itself where it can run) agree on a probe
input within a few units in the last place. A norm of another form (Gemma's ``(1 + weight)``) fails
the proof and stays as it is, with the reason.

How its readers get the codes: the norm cannot know its consumers (transformers models do not trace).
Until it has one, it tags each output tensor; the first dynamic per-token Int8Linear/FP8Linear to
read a tagged tensor (:func:`claim`) tells the norm its input quantization and its SharedCodes
group. From then on the norm's kernel also writes that quantization of its output and puts it in
the group's cache, where the layer and the others of its group (q/k/v, gate/up) find it: no
quantize kernel runs for them. A reader quantizing differently quantizes for itself. The choice is
made in eager calls (warm-up), before any CUDA-graph capture; under torch.compile the norm is the
original float math (inductor fuses it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from compress.core.errors import UnsupportedModelError
from quantization.lowering.kernels import interpret_mode, load
from quantization.lowering.kernels.ops import compiling
from quantization.lowering.shared_input import SharedCodes

log = logging.getLogger(__name__)

_TAG = "_compress_fused_norm"  # the attribute a FusedRMSNorm sets on its output while it seeks a reader


@dataclass(frozen=True)
class _Consumer:
    """The input quantization of the layers the norm quantizes for."""

    layer: Any  # read for its pre_quant_scale at each call: a later .to() replaces that buffer
    cache: SharedCodes
    qmin: int
    qmax: int
    fp8: bool


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """What the kernel computes, in torch: transformers' LlamaRMSNorm."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _eps_of(mod: nn.Module) -> float | None:
    for attr in ("variance_epsilon", "eps"):
        v = getattr(mod, attr, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


def is_candidate(mod: nn.Module) -> bool:
    """A module that may be an RMSNorm of the kernel's form (the proof decides)."""
    w = getattr(mod, "weight", None)
    return (type(mod).__name__.endswith("RMSNorm") and isinstance(w, torch.Tensor) and w.dim() == 1
            and w.is_floating_point() and _eps_of(mod) is not None)


def _kernel_runs_on(device: torch.device) -> bool:
    return device.type == "cuda" or (device.type == "cpu" and interpret_mode())


def _ulps_apart(a: torch.Tensor, b: torch.Tensor, ulps: float) -> bool:
    """Whether ``a`` and ``b`` agree elementwise within ``ulps`` units of ``b``'s dtype (relative)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    af, bf = a.float(), b.float()
    eps = torch.finfo(b.dtype).eps
    tol = ulps * eps * bf.abs() + eps * 1e-3 * float(bf.abs().max())
    return bool(((af - bf).abs() <= tol).all())


def prove(mod: nn.Module, *, rows: int = 8, seed: int = 0) -> str | None:
    """None when ``mod`` computes the kernel's RMSNorm on a probe input (on its device, in its
    weight's dtype), else why not. Where the kernel cannot run (a CPU model outside the interpreter)
    the kernel's formula in torch stands in for it."""
    eps = _eps_of(mod)
    w: torch.Tensor = getattr(mod, "weight", None)  # type: ignore[assignment]
    if eps is None or not isinstance(w, torch.Tensor):
        return "it has no 1-D weight and eps"
    k = w.numel()
    g = torch.Generator().manual_seed(seed)
    # rows of different magnitudes: a norm that is not scale-free (a missing rsqrt) fails too
    x = torch.randn(rows, k, generator=g) * torch.logspace(-2, 2, rows).reshape(-1, 1)
    x = x.to(device=w.device, dtype=w.dtype)
    with torch.no_grad():
        try:
            ref = mod(x)
        except Exception as exc:  # a module with another call signature is no plain RMSNorm
            return f"it does not run as norm(x) ({type(exc).__name__}: {exc})"
        if not isinstance(ref, torch.Tensor):
            return f"it returns {type(ref).__name__}, not a tensor"
        if _kernel_runs_on(w.device):
            got = load("norm").rmsnorm_quantize(x, w, eps, codes=False)[0]
        else:
            got = rmsnorm_reference(x, w, eps)
    # float32: the kernel sums in another order than torch (a few ulp); 16-bit: one rounding apart
    ulps = 64.0 if w.dtype == torch.float32 else 2.0
    if not _ulps_apart(got, ref, ulps):
        diff = (got.float() - ref.float()).abs().max().item() if got.shape == ref.shape else float("nan")
        return (f"its output is not weight * (x * rsqrt(mean(x^2) + eps)) on a probe input (max difference "
                f"{diff:.3g}; e.g. a (1 + weight) or another cast order)")
    return None


class FusedRMSNorm(nn.Module):
    """A Llama-family RMSNorm run by one Triton kernel that also quantizes its output for the
    dynamic per-token int8/fp8 layers that read it (see the module docstring)."""

    weight: torch.Tensor

    def __init__(self, weight: torch.Tensor, eps: float, *, source: str = "RMSNorm") -> None:
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.variance_epsilon = eps
        self.source = source
        self._consumer: _Consumer | None = None

    @classmethod
    def from_module(cls, mod: nn.Module) -> FusedRMSNorm:
        """The fused form of the RMSNorm ``mod`` (sharing its weight), or UnsupportedModelError why not."""
        if not is_candidate(mod):
            raise UnsupportedModelError("it is not an RMSNorm with a 1-D weight and eps")
        why = prove(mod)
        if why is not None:
            raise UnsupportedModelError(why)
        return cls(cast(torch.Tensor, mod.weight), cast(float, _eps_of(mod)), source=type(mod).__name__)

    @property
    def fused(self) -> bool:
        """Whether the norm now writes the codes of a reader's group."""
        return self._consumer is not None

    def adopt(self, layer: Any, *, qmin: int, qmax: int, fp8: bool) -> None:
        """Quantize for ``layer``'s group from now on (first reader wins), with ``layer``'s
        ``pre_quant_scale`` (SmoothQuant's, or None)."""
        if self._consumer is not None:
            return
        cache = getattr(layer, "shared_codes", None)
        if cache is None:  # a lone reader: a group of one, so the layer looks up the norm's codes
            cache = SharedCodes()
            object.__setattr__(layer, "shared_codes", cache)
        self._consumer = _Consumer(layer, cache, qmin, qmax, fp8)

    def release(self) -> None:
        """Stop quantizing for the adopted reader (the next eager call seeks one again)."""
        self._consumer = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if compiling():
            return rmsnorm_reference(x, self.weight, self.variance_epsilon)
        c = self._consumer
        # the codes only where the reader reuses them: SharedCodes shares nothing under autograd,
        # nor for torch.inference_mode's tensors (no version counter to check)
        if c is None or torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            y = load("norm").rmsnorm_quantize(x, self.weight, self.variance_epsilon, codes=False)[0]
            if c is None:
                setattr(y, _TAG, self)
            return y
        y, q, s = load("norm").rmsnorm_quantize(x, self.weight, self.variance_epsilon, qmin=c.qmin, qmax=c.qmax,
                                                fp8=c.fp8, pre_scale=c.layer.pre_quant_scale)
        c.cache.put(y, (q, s))
        return y

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, from={self.source}, fused={self.fused}"


def claim(x: torch.Tensor, layer: Any, *, qmin: int, qmax: int, fp8: bool) -> None:
    """Called by a dynamic per-token layer with its input: when ``x`` came from a FusedRMSNorm still
    seeking a reader, that norm quantizes for ``layer``'s group from its next call on."""
    norm = x.__dict__.get(_TAG)
    if norm is not None:
        del x.__dict__[_TAG]
        norm.adopt(layer, qmin=qmin, qmax=qmax, fp8=fp8)


def fuse_rmsnorms(root: nn.Module, *, record: Callable[[str, str, str | None], None]) -> int:
    """Replace every RMSNorm of ``root`` that passes the proof by a FusedRMSNorm; ``record(name,
    type, reason)`` is called for each candidate (reason None: fused). Returns how many were fused."""
    fused = 0
    for name, mod in list(root.named_modules()):
        if not name or isinstance(mod, FusedRMSNorm) or not is_candidate(mod):
            continue
        try:
            new = FusedRMSNorm.from_module(mod)
        except UnsupportedModelError as exc:
            log.info("convert: %s (%s) stays as it is: %s", name, type(mod).__name__, exc)
            record(name, type(mod).__name__, str(exc))
            continue
        root.set_submodule(name, new)
        record(name, type(mod).__name__, None)
        fused += 1
    return fused
