"""FakeQuantizer: the module that observes a tensor and fake-quantizes it.

Attributes read by export (QDQ ONNX) and the int8 converter, kept stable:

- ``spec`` (QuantSpec), ``qmin``/``qmax`` (ints), ``axis`` (int for per-channel, else None),
  ``group_size`` (int for per-group, else None; the effective size after short rows).
- ``scale`` (float32) and ``zero_point`` (int32): shape ``()`` per tensor, ``(C,)`` per channel,
  ``(C, G)`` per group (G = ceil(K / group_size), the last group
  shorter when K is not a multiple); empty until calibrated; absent in meaning for ``spec.dynamic`` quantizers,
  which compute per-token qparams at run time. ``scale`` is an ``nn.Parameter`` while LSQ learns it.
- ``global_scale`` (float32 ``(1,)`` or None): NVFP4's per-tensor global scale (``448 * 6 / amax``);
  weights: from the weight, with ``scale`` the effective group scales (``e4m3 / global_scale``);
  fp4 inputs: calibrated (their group scales are computed at run time under it).
- ``pre_quant_scale`` (float32 ``(K,)`` or None): SmoothQuant's per-input-channel factor,
  multiplied into the input *before* quantization (a Mul in the exported graph).
- ``enabled``: whether forward fake-quantizes; ``observing``: whether forward feeds the observer.

The observer is a plain attribute, not a submodule, so ``state_dict`` holds only scale and
zero_point (plus pre_quant_scale when set).
"""

from __future__ import annotations

from typing import Any

import torch
from compress.quantization.numerics.observers import Observer, build_observer
from compress.quantization.numerics.primitives import (
    MIN_RANGE_SCALE,
    clamp_scale,
    dynamic_qparams,
    fake_quantize_spec,
    grad_scale,
    group_size_for,
    lsq_grad_factor,
    nvfp4_global_scale,
    quantize_spec,
    spec_qparams,
    stat_shape,
    to_rows,
)
from compress.quantization.numerics.spec import QuantSpec
from torch import nn

from compress.core.errors import CalibrationError, UnsupportedModelError


def _data_parallel_world() -> int:
    """The ranks a training batch is split over (1 outside torchrun)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class FakeQuantizer(nn.Module):
    """Observes and fake-quantizes one tensor according to ``spec``.

    ``role`` is "weight", "input" or "output". A weight quantizer's statistics are those of the
    current tensor only (each observation replaces the last), so in QAT they follow the weights.
    """

    scale: torch.Tensor
    zero_point: torch.Tensor
    pre_quant_scale: torch.Tensor | None
    global_scale: torch.Tensor | None

    def __init__(self, spec: QuantSpec, *, role: str = "input", name: str = "quantizer") -> None:
        super().__init__()
        self.spec = spec
        self.role = role
        self.name = name
        self.qmin = spec.qmin
        self.qmax = spec.qmax
        self.axis: int | None = spec.axis if spec.granularity == "channel" else None
        self.group_size: int | None = spec.group_size if spec.granularity == "group" else None
        self.enabled = True
        self.observing = False
        self.register_buffer("scale", torch.empty(0))
        self.register_buffer("zero_point", torch.empty(0, dtype=torch.int32))
        self.register_buffer("pre_quant_scale", None)
        self.register_buffer("global_scale", None)
        #: NVFP4 weights: the global scale was set for a group of layers (share_global_scales) and is
        #: kept when the group scales are recomputed
        self.fixed_global = False
        #: NVFP4 inputs: dynamic group scales under a calibrated global scale, so a per-tensor range is observed
        self.calibrated_global = spec.dynamic and spec.is_fp4 and spec.scale_dtype == "fp8_e4m3"
        observed = QuantSpec(granularity="tensor") if self.calibrated_global else spec
        self.observer: Observer | None = (build_observer(observed, where=name)
                                          if not spec.dynamic or self.calibrated_global else None)
        self._stat_shape: tuple[int, ...] | None = None

    # ---- state -------------------------------------------------------------------------------------
    @property
    def calibrated(self) -> bool:
        """Whether static qparams are set (always True for dynamic quantizers but NVFP4 inputs, whose
        global scale is calibrated)."""
        if self.calibrated_global:
            return self.global_scale is not None
        return self.spec.dynamic or self.scale.numel() > 0

    @property
    def learnable(self) -> bool:
        return isinstance(self.scale, nn.Parameter)

    def extra_repr(self) -> str:
        s = self.spec
        g = s.granularity + (f"(axis={s.axis})" if s.granularity == "channel" else "")
        g += f"({self.group_size})" if self.group_size else ""
        state = "dynamic" if s.dynamic else ("calibrated" if self.calibrated else "uncalibrated")
        flags = "" if self.enabled else ", disabled"
        return f"{s.bits}bit {s.dtype} {'sym' if s.symmetric else 'asym'} {g}, {s.observer}, {state}{flags}"

    # ---- calibration ---------------------------------------------------------------------------------
    def observe(self, x: torch.Tensor) -> None:
        """Feed ``x`` to the observer."""
        if self.observer is None:
            return
        self._check_layout(x)
        if self.role == "weight":
            self.observer.reset()
        if self.calibrated_global:
            self.observer.update(x.detach().reshape(1, -1))
            return
        self.observer.update(to_rows(x.detach(), self.spec))
        self._stat_shape = stat_shape(x, self.spec)

    def compute_qparams(self) -> None:
        """Set ``scale``/``zero_point`` from the observer's range."""
        if self.observer is None:
            return
        mn, mx = self.observer.compute()
        if self.calibrated_global:
            self.global_scale = nvfp4_global_scale(torch.maximum(-mn, mx))
            return
        if self.spec.is_fp4 and self.spec.scale_dtype == "fp8_e4m3" and not (self.fixed_global and self.global_scale is not None):
            self.global_scale = nvfp4_global_scale(torch.maximum(-mn, mx))  # one weight's groups: its global scale
        scale, zp = spec_qparams(mn, mx, self.spec, global_scale=self.global_scale, min_scale=MIN_RANGE_SCALE)
        shape = self._stat_shape if self._stat_shape is not None else tuple(scale.shape)
        self.set_qparams(scale.reshape(shape), zp.reshape(shape))

    def set_qparams(self, scale: torch.Tensor, zero_point: torch.Tensor) -> None:
        """Set the static qparams (keeps a learnable scale a Parameter)."""
        if self.learnable:
            with torch.no_grad():
                self.scale.data = scale.detach().to(self.scale.dtype).clone()
        else:
            self.scale = scale.detach().float().clone()
        self.zero_point = zero_point.detach().to(torch.int32).clone()

    def finish_calibration(self) -> None:
        """Merge statistics across ranks, set qparams, stop observing and start quantizing."""
        if self.observer is not None:
            self.observer.all_reduce()
            self.compute_qparams()
        self.observing = False
        self.enabled = True

    def enable_lsq(self) -> nn.Parameter:
        """Make ``scale`` a learnable Parameter (LSQ); needs calibrated qparams."""
        if self.spec.dynamic:
            raise CalibrationError(f"{self.name}: dynamic quantizers have no scale to learn")
        if self.spec.is_fp4:
            raise CalibrationError(f"{self.name}: fp4 group scales are fixed by the format (e4m3 or powers "
                                   "of two); LSQ learns integer-grid scales")
        if not self.calibrated:
            raise CalibrationError(f"{self.name}: calibrate before enabling LSQ")
        if not self.learnable:
            data = self._buffers.pop("scale")
            assert data is not None
            self.scale = nn.Parameter(data.clone())
        self.observing = False
        return self.scale  # type: ignore[return-value]

    def disable_lsq(self) -> None:
        """Turn a learned scale back into a buffer."""
        if self.learnable:
            data = self._parameters.pop("scale")
            assert data is not None
            self.register_buffer("scale", data.detach().clone())

    # ---- forward --------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_quant_scale is not None:
            x = x * self.pre_quant_scale.to(x.dtype)
        if self.observing:
            self.observe(x)
            if self.enabled:
                self.compute_qparams()
        if not self.enabled:
            return x
        if self.spec.dynamic:
            if self.calibrated_global and self.global_scale is None:
                raise CalibrationError(f"{self.name}: NVFP4 inputs need a calibrated global scale (run a forward loop first)")
            scale, zp = dynamic_qparams(x, self.spec, self.global_scale)
            return fake_quantize_spec(x, scale, zp, self.spec)
        if not self.calibrated:
            raise CalibrationError(f"{self.name}: used before calibration (run a forward loop first)")
        scale = self.scale
        if self.learnable:
            # LSQ's gradient scale, times the scale's magnitude: updates are relative (first-order
            # log-scale learning), so small scales cannot step across zero under plain SGD
            n = x.numel() // max(scale.numel(), 1)
            if self.role != "weight" and x.dim() > 1 and x.shape[0] > 1:
                # an activation's N counts the global batch: under data parallelism each rank holds
                # 1/world of it, and a rank's N alone would scale the gradient up by sqrt(world).
                # A leading dimension of 1 is taken for a tensor the batch broadcasts (a rotary
                # table), whole on every rank (so one sample per rank is left uncorrected)
                n *= _data_parallel_world()
            factor = lsq_grad_factor(n, self.qmax)
            scale = clamp_scale(grad_scale(scale, scale.detach().abs() * factor))
        return fake_quantize_spec(x, scale, self.zero_point, self.spec)

    def int_repr(self, x: torch.Tensor) -> torch.Tensor:
        """Integer codes of ``x`` with the current static qparams (for converters); shape of ``x``."""
        if not self.calibrated or self.spec.dynamic:
            raise CalibrationError(f"{self.name}: int_repr needs calibrated static qparams")
        if self.pre_quant_scale is not None:
            x = x * self.pre_quant_scale.to(x.dtype)
        return quantize_spec(x, self.scale.detach(), self.zero_point, self.spec)

    def _check_layout(self, x: torch.Tensor) -> None:
        s = self.spec
        if s.granularity == "channel" and not -x.dim() <= s.axis < x.dim():
            raise UnsupportedModelError(f"{self.name}: axis {s.axis} is out of range for a {x.dim()}-D tensor")
        if s.granularity == "group":
            if x.dim() < 2:
                raise UnsupportedModelError(f"{self.name}: group quantization needs a weight of 2 or more dims")
            # a row not divisible by the group size gets a shorter last group (primitives.to_groups)
            self.group_size = group_size_for(x, s)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # calibrated shapes differ from the empty placeholders; adopt the incoming ones
        for key in ("scale", "zero_point", "pre_quant_scale", "global_scale"):
            t = state_dict.get(prefix + key)
            if t is None:
                continue
            if key in self._parameters and self._parameters[key] is not None:
                p = self._parameters[key]
                assert p is not None
                if p.shape != t.shape:
                    p.data = torch.empty_like(t, dtype=p.dtype, device=p.device)
            else:
                cur = self._buffers.get(key)
                if cur is None or cur.shape != t.shape:
                    dev = cur.device if cur is not None else t.device
                    self._buffers[key] = torch.empty_like(t, device=dev)
        super()._load_from_state_dict(state_dict, prefix, *args)
