"""Fused norms: a converted model's RMSNorms and LayerNorms, each as one kernel that also quantizes
its output for the int8/fp8 layers reading it (quantization/lowering/kernels/norm.py).

Which modules: a candidate is a module whose class name ends in ``RMSNorm`` or ``LayerNorm`` (or an
``nn.LayerNorm``) with a 1-D ``weight`` (optional for ``nn.LayerNorm(elementwise_affine=False)``),
an optional 1-D ``bias`` and an ``eps`` or ``variance_epsilon``. It is replaced only when a numeric
proof at conversion passes: the original module and the kernel (its formula in torch where the
kernel cannot run) agree on probe inputs within the bound of that form (:func:`rms_tolerance`,
:func:`layernorm_tolerance`). The forms are tried in turn (``RMSNorm`` candidates: the RMSNorm form;
``LayerNorm`` ones: LayerNorm, then RMSNorm, e.g. T5's ``T5LayerNorm`` is an RMSNorm); a norm no
form proves (Gemma's ``(1 + weight)``) stays as it is, with the reasons.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F
from compress.quantization.lowering.kernels import interpret_mode, load
from compress.quantization.lowering.kernels.ops import compiling
from compress.quantization.lowering.shared_input import SharedCodes
from torch import nn

from compress.core.errors import UnsupportedModelError

log = logging.getLogger(__name__)

_TAG = "_compress_fused_norm"  # the attribute a fused norm sets on its output while it seeks a reader
_F32_EPS = torch.finfo(torch.float32).eps


@dataclass(frozen=True)
class _Consumer:
    """The input quantization of the layers the norm quantizes for."""

    layer: Any  # read for its pre_quant_scale at each call: a later .to() replaces that buffer
    cache: SharedCodes
    qmin: int
    qmax: int
    fp8: bool


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """What the RMSNorm kernel computes, in torch: transformers' LlamaRMSNorm."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def layernorm_reference(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                        eps: float) -> torch.Tensor:
    """What the LayerNorm kernel computes, in torch (output in ``x``'s dtype, as torch's)."""
    f32 = torch.float32
    return F.layer_norm(x.to(f32), (x.shape[-1],), None if weight is None else weight.to(f32),
                        None if bias is None else bias.to(f32), eps).to(x.dtype)


def _eps_of(mod: nn.Module) -> float | None:
    for attr in ("variance_epsilon", "eps"):
        v = getattr(mod, attr, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


def _vector(mod: nn.Module, attr: str) -> torch.Tensor | None:
    """``mod.<attr>`` when it is a 1-D float tensor, else None."""
    t = getattr(mod, attr, None)
    return t if isinstance(t, torch.Tensor) and t.dim() == 1 and t.is_floating_point() else None


def _ulps_apart(a: torch.Tensor, b: torch.Tensor, ulps: float) -> bool:
    """Whether ``a`` and ``b`` agree elementwise within ``ulps`` units of ``b``'s dtype (relative)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    af, bf = a.float(), b.float()
    eps = torch.finfo(b.dtype).eps
    tol = ulps * eps * bf.abs() + eps * 1e-3 * float(bf.abs().max())
    return bool(((af - bf).abs() <= tol).all())


def layernorm_tolerance(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                        ref: torch.Tensor) -> torch.Tensor:
    """The bound the LayerNorm kernel keeps to torch's LayerNorm ``ref`` of ``x``, per element.

    Both compute in float32 and round once to the output dtype, but sum in other orders (and the
    GPU's rsqrt is approximate): the float32 values differ by a few float32 ulps of the terms (the
    mean's error, ``|x|``-sized, times ``|w| r``; the affine's, ``|b|``-sized), 16 ulps allowed (log2
    of the widest rows summed); rounding that to the output dtype adds at most one unit in its last
    place (``eps * |ref|``, plus the smallest normal for subnormal outputs)."""
    xd = x.detach().double()
    mu = xd.mean(-1, keepdim=True)
    r = (xd.var(-1, unbiased=False, keepdim=True) + eps).rsqrt()
    w = weight.detach().double().abs() if weight is not None else 1.0
    b = bias.detach().double().abs() if bias is not None else 0.0
    f32 = 16 * _F32_EPS * (w * r * ((xd - mu).abs() + xd.abs().mean(-1, keepdim=True)) + b)
    out = torch.finfo(ref.dtype)
    return (out.eps * ref.detach().double().abs() + out.tiny + f32).to(ref.device)


def _kernel_runs_on(device: torch.device) -> bool:
    return device.type == "cuda" or (device.type == "cpu" and interpret_mode())


def _probe(k: int, rows: int, seed: int, offset: float, like: torch.Tensor | None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # rows of different magnitudes: a norm that is not scale-free (a missing rsqrt) fails too; an
    # offset: a norm that does not subtract the mean fails the LayerNorm form
    x = (torch.randn(rows, k, generator=g) + offset) * torch.logspace(-2, 2, rows).reshape(-1, 1)
    return x if like is None else x.to(device=like.device, dtype=like.dtype)


class FusedNorm(nn.Module):
    """A norm run by one Triton kernel that also quantizes its output for the dynamic per-token
    int8/fp8 layers that read it (see the module docstring). Subclasses give the form."""

    form: ClassVar[str]
    weight: torch.Tensor | None
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, *, source: str) -> None:
        super().__init__()
        self.register_parameter("weight", _param(weight))
        self.register_parameter("bias", _param(bias))
        self.eps = eps
        self.source = source
        self._consumer: _Consumer | None = None

    @staticmethod
    def candidate(mod: nn.Module) -> bool:
        """Whether ``mod`` may be a norm of this form (the proof decides)."""
        raise NotImplementedError

    @staticmethod
    def prove(mod: nn.Module) -> str | None:
        """None when ``mod`` computes this form on probe inputs, else why not."""
        raise NotImplementedError

    @classmethod
    def from_module(cls, mod: nn.Module) -> FusedNorm:
        """The fused form of the norm ``mod`` (sharing its parameters), or UnsupportedModelError why not."""
        if not cls.candidate(mod):
            raise UnsupportedModelError(f"it is not a candidate {cls.form} (a 1-D weight and eps)")
        why = cls.prove(mod)
        if why is not None:
            raise UnsupportedModelError(why)
        return cls._new(mod)

    @classmethod
    def _new(cls, mod: nn.Module) -> FusedNorm:
        raise NotImplementedError

    def _kernel(self, x: torch.Tensor, **kw: Any) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        raise NotImplementedError

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

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
            return self._reference(x)
        c = self._consumer
        # the codes only where the reader reuses them: SharedCodes shares nothing under autograd,
        # nor for torch.inference_mode's tensors (no version counter to check)
        if c is None or torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            y = self._kernel(x, codes=False)[0]
            if c is None:
                setattr(y, _TAG, self)
            return y
        y, q, s = self._kernel(x, qmin=c.qmin, qmax=c.qmax, fp8=c.fp8, pre_scale=c.layer.pre_quant_scale)
        c.cache.put(y, (q, s))
        return y

    def extra_repr(self) -> str:
        k = None if self.weight is None else tuple(self.weight.shape)
        return f"{k}, eps={self.eps}, bias={self.bias is not None}, from={self.source}, fused={self.fused}"


def _param(t: torch.Tensor | None) -> nn.Parameter | None:
    if t is None or isinstance(t, nn.Parameter):
        return t
    return nn.Parameter(t, requires_grad=False)


class FusedRMSNorm(FusedNorm):
    """A Llama-family RMSNorm (``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``) as one kernel."""

    form = "RMSNorm"
    weight: torch.Tensor

    def __init__(self, weight: torch.Tensor, eps: float, *, source: str = "RMSNorm") -> None:
        super().__init__(weight, None, eps, source=source)

    @classmethod
    def _new(cls, mod: nn.Module) -> FusedRMSNorm:
        return cls(cast(torch.Tensor, _vector(mod, "weight")), cast(float, _eps_of(mod)), source=type(mod).__name__)

    @property
    def variance_epsilon(self) -> float:
        return self.eps

    @staticmethod
    def candidate(mod: nn.Module) -> bool:
        return _vector(mod, "weight") is not None and _eps_of(mod) is not None

    @staticmethod
    def prove(mod: nn.Module, *, rows: int = 8, seed: int = 0) -> str | None:
        eps, w = _eps_of(mod), _vector(mod, "weight")
        if eps is None or w is None:
            return "it has no 1-D weight and eps"
        if _vector(mod, "bias") is not None:
            return "it has a bias (an RMSNorm has none)"
        x = _probe(w.numel(), rows, seed, 0.0, w)
        with torch.no_grad():
            ref = _run_module(mod, x)
            if isinstance(ref, str):
                return ref
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

    def _kernel(self, x: torch.Tensor, **kw: Any) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        return load("norm").rmsnorm_quantize(x, self.weight, self.eps, **kw)

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        return rmsnorm_reference(x, self.weight, self.eps)


class FusedLayerNorm(FusedNorm):
    """A LayerNorm over the last dim (torch's ``F.layer_norm``: biased variance; weight and bias
    optional) as one kernel."""

    form = "LayerNorm"

    @staticmethod
    def _width(mod: nn.Module) -> int | None:
        w = _vector(mod, "weight")
        if w is not None:
            return w.numel()
        if isinstance(mod, nn.LayerNorm) and mod.weight is None and len(mod.normalized_shape) == 1:
            return int(mod.normalized_shape[0])  # elementwise_affine=False: no weight to size it
        return None

    @classmethod
    def _new(cls, mod: nn.Module) -> FusedLayerNorm:
        return cls(_vector(mod, "weight"), _vector(mod, "bias"), cast(float, _eps_of(mod)), source=type(mod).__name__)

    @staticmethod
    def candidate(mod: nn.Module) -> bool:
        return _eps_of(mod) is not None and (isinstance(mod, nn.LayerNorm) or _vector(mod, "weight") is not None)

    @staticmethod
    def prove(mod: nn.Module, *, rows: int = 8, seed: int = 0) -> str | None:
        eps = _eps_of(mod)
        if eps is None:
            return "it has no eps"
        if isinstance(mod, nn.LayerNorm) and len(mod.normalized_shape) != 1:
            return f"it normalizes over the last {len(mod.normalized_shape)} dims {tuple(mod.normalized_shape)}, the kernel over one"
        k = FusedLayerNorm._width(mod)
        if k is None:
            return "it has no 1-D weight"
        w, b = _vector(mod, "weight"), _vector(mod, "bias")
        if getattr(mod, "bias", None) is not None and b is None:
            return "its bias is not a 1-D float tensor"
        like = w if w is not None else b
        with torch.no_grad():
            for offset in (0.0, 3.0):  # centred rows, and rows whose mean the norm must subtract
                x = _probe(k, rows, seed, offset, like)
                ref = _run_module(mod, x)
                if isinstance(ref, str):
                    return ref
                if _kernel_runs_on(x.device):
                    got = load("norm").layernorm_quantize(x, w, b, eps, codes=False)[0]
                else:
                    got = layernorm_reference(x, w, b, eps)
                if got.shape != ref.shape or got.dtype != ref.dtype:
                    return f"its output ({ref.dtype}, {tuple(ref.shape)}) is not the input's dtype and shape"
                diff = (got.double() - ref.double()).abs()
                if not bool((diff <= layernorm_tolerance(x, w, b, eps, ref)).all()):
                    return (f"its output is not (x - mean) / sqrt(var + eps) * weight + bias on a probe input (max "
                            f"difference {diff.max().item():.3g}; e.g. an unbiased variance or a mean not subtracted)")
        return None

    def _kernel(self, x: torch.Tensor, **kw: Any) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        return load("norm").layernorm_quantize(x, self.weight, self.bias, self.eps, **kw)

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


def _run_module(mod: nn.Module, x: torch.Tensor) -> torch.Tensor | str:
    """``mod(x)``, or why it does not run as a plain norm."""
    try:
        out = mod(x)
    except Exception as exc:  # a module with another call signature is no plain norm
        return f"it does not run as norm(x) ({type(exc).__name__}: {exc})"
    return out if isinstance(out, torch.Tensor) else f"it returns {type(out).__name__}, not a tensor"


def _forms_for(mod: nn.Module) -> tuple[type[FusedNorm], ...]:
    """The forms a module may be, in the order they are tried (by its class name; none: not a norm)."""
    name = type(mod).__name__
    if name.endswith("RMSNorm"):
        return (FusedRMSNorm,)
    if isinstance(mod, nn.LayerNorm) or name.endswith("LayerNorm"):
        return (FusedLayerNorm, FusedRMSNorm)
    return ()


def prove(mod: nn.Module) -> str | None:
    """None when ``mod`` computes one of the kernel's forms on probe inputs, else why not (each form's reason)."""
    forms = [f for f in _forms_for(mod) if f.candidate(mod)]
    reasons = []
    for form in forms:
        why = form.prove(mod)
        if why is None:
            return None
        reasons.append(f"as {form.form}: {why}" if len(forms) > 1 else why)
    return "; ".join(reasons) if reasons else "it is not a norm with a 1-D weight and eps"


def fuse_norms(root: nn.Module, *, record: Callable[[str, str, str | None, str], None],
               forms: Sequence[type[FusedNorm]] = (FusedRMSNorm, FusedLayerNorm)) -> dict[str, int]:
    """Replace every norm of ``root`` that one of ``forms`` proves by that fused norm; ``record(name,
    type, reason, fused type)`` is called for each candidate (reason None: fused). Returns how many
    were fused, per form."""
    fused: dict[str, int] = {}
    for name, mod in list(root.named_modules()):
        if not name or isinstance(mod, FusedNorm):
            continue
        own = _forms_for(mod)
        tried = [f for f in own if f in forms and f.candidate(mod)] if own and own[0] in forms else []
        if not tried:
            continue
        reasons = []
        for form in tried:
            try:
                new = form.from_module(mod)
            except UnsupportedModelError as exc:
                reasons.append(f"as {form.form}: {exc}" if len(tried) > 1 else str(exc))
                continue
            root.set_submodule(name, new)
            record(name, type(mod).__name__, None, type(new).__name__)
            fused[form.form] = fused.get(form.form, 0) + 1
            break
        else:
            why = "; ".join(reasons)
            log.info("convert: %s (%s) stays as it is: %s", name, type(mod).__name__, why)
            record(name, type(mod).__name__, why, "")
    return fused


def fuse_rmsnorms(root: nn.Module, *, record: Callable[[str, str, str | None], None]) -> int:
    """:func:`fuse_norms` for the RMSNorms alone (``record(name, type, reason)``); how many were fused."""
    return sum(fuse_norms(root, record=lambda n, t, why, _: record(n, t, why), forms=(FusedRMSNorm,)).values())


def claim(x: torch.Tensor, layer: Any, *, qmin: int, qmax: int, fp8: bool) -> None:
    """Called by a dynamic per-token layer with its input: when ``x`` came from a fused norm still
    seeking a reader, that norm quantizes for ``layer``'s group from its next call on."""
    norm = x.__dict__.get(_TAG)
    if norm is not None:
        del x.__dict__[_TAG]
        norm.adopt(layer, qmin=qmin, qmax=qmax, fp8=fp8)
