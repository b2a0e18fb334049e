"""Typed quantization specs: how one tensor is quantized (QuantSpec) and a whole layer (QuantScheme).

Conventions (read by export and the int8 converter, keep stable):
- ``qmin``/``qmax`` follow from ``dtype`` and ``bits``: int8 is [-2^(b-1), 2^(b-1)-1], uint8 is
  [0, 2^b-1]; ``fp8_e4m3`` (OCP E4M3FN, 8 bits, always symmetric) is [-448, 448], its largest
  finite value, and rounds to the nearest e4m3 value rather than to an integer; ``narrow_range`` drops the most negative int level (int8 [-127, 127]);
  ``reduce_range`` keeps 8-bit int8 codes in [-64, 63] (ORT's reduce_range: on x86 CPUs without
  VNNI, u8s8 kernels add pairs of products in int16, which 7-bit weights cannot overflow).
- Symmetric specs use ``scale = amax / (qmax - zero_point)`` with zero_point 0 (int8) or 2^(b-1)
  (uint8), so +amax maps exactly to qmax; signed grids of 4 bits and fewer map the range's larger
  end to qmin: ``scale = min / qmin`` when ``|min| >= max``, else ``max / qmin``, a negative scale
  (4 bits: a step of amax / 8, not amax / 7); asymmetric specs map [min, max] (widened to include 0)
  onto [qmin, qmax] with an integer zero_point.
- Granularity: ``tensor`` one scale; ``channel`` one scale per index of ``axis`` (0 = output
  channel of a weight); ``group`` one scale per ``group_size`` consecutive input features of each
  output channel (weights); ``token`` one scale per row (all dims but the last), computed at run
  time (``dynamic`` must be set).
- ``fp4_e2m1`` (OCP FP4: values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) is always symmetric
  and per group; ``scale_dtype`` says how a group's scale is stored: ``fp8_e4m3`` is NVFP4 (groups
  of 16, each scale an e4m3 value divided by one fp32 global scale per tensor, ``448 * 6 / amax``),
  ``e8m0`` is MX (groups of 32, power-of-two scales), ``float32`` a plain ``amax / 6``. Weights hold
  the group's *effective* scale (the e4m3 or power-of-two value already applied); activations get
  theirs at run time (``dynamic``), NVFP4's global scale from calibration.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, model_validator

from compress.core.errors import RecipeError, did_you_mean, validation_message

Granularity = Literal["tensor", "channel", "token", "group"]
#: the largest finite float8 e4m3fn value: fp8 scales are amax / 448
FP8_E4M3_MAX = 448
#: the largest fp4 e2m1 value: fp4 group scales are amax / 6
FP4_E2M1_MAX = 6
ScaleDtype = Literal["float32", "fp8_e4m3", "e8m0"]


class QuantSpec(BaseModel):
    """How one tensor is quantized: bit width, integer type, symmetry, granularity and observer.

    ``observer`` names a registered observer (minmax, ema, percentile, entropy, mse) and
    ``observer_params`` its typed parameters (validated when the quantizer is built).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    bits: Literal[2, 3, 4, 8] = 8
    symmetric: bool = True
    dtype: Literal["int8", "uint8", "fp8_e4m3", "fp4_e2m1"] = "int8"
    narrow_range: bool = False
    reduce_range: bool = False
    granularity: Granularity = "tensor"
    #: the channel axis of ``channel`` granularity, negative from the end; no tensor a layer quantizes
    #: has more than 8 dims (the tensor's own rank is checked when the quantizer first sees it)
    axis: int = Field(0, ge=-8, le=7)
    group_size: int | None = Field(None, ge=2)
    dynamic: bool = False
    observer: str = "minmax"
    observer_params: dict[str, Any] = Field(default_factory=dict)
    #: how each scale is stored (fp4 groups: NVFP4 ``fp8_e4m3``, MX ``e8m0``); integer grids: float32
    scale_dtype: ScaleDtype = "float32"

    @model_validator(mode="after")
    def _consistent(self) -> QuantSpec:
        if self.dtype == "fp4_e2m1":
            if self.bits != 4 or not self.symmetric or self.narrow_range or self.reduce_range or self.granularity != "group":
                raise ValueError("fp4_e2m1 is 4-bit, symmetric and per group (no narrow_range or reduce_range)")
            if self.scale_dtype == "fp8_e4m3" and self.group_size != 16:
                raise ValueError("fp4_e2m1 with fp8_e4m3 scales is NVFP4: group_size 16")
            if self.scale_dtype == "e8m0" and self.group_size != 32:
                raise ValueError("fp4_e2m1 with e8m0 scales is MXFP4: group_size 32")
        elif self.scale_dtype != "float32":
            raise ValueError(f"scale_dtype '{self.scale_dtype}' is for fp4_e2m1 groups (NVFP4, MXFP4)")
        if self.granularity == "group" and self.group_size is None:
            raise ValueError("granularity 'group' needs group_size")
        if self.granularity != "group" and self.group_size is not None:
            raise ValueError(f"group_size is only used with granularity 'group' (got '{self.granularity}')")
        if self.granularity == "token" and not self.dynamic:
            raise ValueError("granularity 'token' is computed at run time: set dynamic: true")
        if self.dtype == "fp8_e4m3" and (self.bits != 8 or not self.symmetric or self.narrow_range
                                         or self.reduce_range or self.granularity == "group"):
            raise ValueError("fp8_e4m3 is 8-bit and symmetric, per tensor, channel or token "
                             "(no narrow_range, reduce_range or groups)")
        if self.narrow_range and self.dtype == "uint8":
            raise ValueError("narrow_range applies to int8 only")
        if self.reduce_range and (self.dtype != "int8" or self.bits != 8 or self.narrow_range):
            raise ValueError("reduce_range applies to 8-bit int8 (weights) without narrow_range")
        return self

    @property
    def is_float(self) -> bool:
        """Whether codes are floating point (fp8 or fp4) rather than integers."""
        return self.dtype in ("fp8_e4m3", "fp4_e2m1")

    @property
    def is_fp4(self) -> bool:
        """Whether codes are fp4 e2m1 (NVFP4, MXFP4)."""
        return self.dtype == "fp4_e2m1"

    @property
    def is_fp8(self) -> bool:
        """Whether codes are float8 e4m3."""
        return self.dtype == "fp8_e4m3"

    @property
    def qmin(self) -> int:
        if self.dtype == "fp4_e2m1":
            return -FP4_E2M1_MAX
        if self.dtype == "fp8_e4m3":
            return -FP8_E4M3_MAX
        if self.dtype == "uint8":
            return 0
        if self.reduce_range:
            return -64
        return -(2 ** (self.bits - 1)) + (1 if self.narrow_range else 0)

    @property
    def qmax(self) -> int:
        if self.dtype == "fp4_e2m1":
            return FP4_E2M1_MAX
        if self.dtype == "fp8_e4m3":
            return FP8_E4M3_MAX
        if self.reduce_range:
            return 63
        return 2**self.bits - 1 if self.dtype == "uint8" else 2 ** (self.bits - 1) - 1

    def with_(self, **changes: Any) -> QuantSpec:
        """A copy with ``changes`` applied and validated."""
        return QuantSpec.model_validate({**self.model_dump(), **changes})


def _w(**kw: Any) -> QuantSpec:
    return QuantSpec(**{"granularity": "channel", "axis": 0, **kw})


# uint8 asymmetric activations: what ORT's u8s8 kernels want on CPUs without VNNI (DESIGN.md).
_A_STATIC = QuantSpec(dtype="uint8", symmetric=False, granularity="tensor")
_A_TOKEN = QuantSpec(dtype="int8", symmetric=True, granularity="token", dynamic=True)
_FP8 = QuantSpec(dtype="fp8_e4m3")
_NVFP4 = QuantSpec(bits=4, dtype="fp4_e2m1", granularity="group", group_size=16, scale_dtype="fp8_e4m3")
_MXFP4 = QuantSpec(bits=4, dtype="fp4_e2m1", granularity="group", group_size=32, scale_dtype="e8m0")

PRESETS: dict[str, dict[str, Any]] = {
    "w8a8": {"weights": _w(), "inputs": _A_STATIC},
    "w8a8_dynamic": {"weights": _w(), "inputs": _A_TOKEN},
    "w8_weight_only": {"weights": _w(), "inputs": None},
    "w4_weight_only_g128": {"weights": QuantSpec(bits=4, granularity="group", group_size=128), "inputs": None},
    "w4_weight_only": {"weights": _w(bits=4), "inputs": None},
    "w3_weight_only_g128": {"weights": QuantSpec(bits=3, granularity="group", group_size=128), "inputs": None},
}


def _g128(bits: int, *, symmetric: bool = True) -> QuantSpec:
    return QuantSpec(bits=bits, granularity="group", group_size=128, symmetric=symmetric)


#: the preset names of llm-compressor, vLLM and compressed-tensors, with their meaning there (upper
#: case, as they write them; ours are lower case): WnA16 are weight-only groups of 128, symmetric;
#: W8A8 (alias INT8) is int8 per-channel weights with *dynamic per-token* int8 activations, which
#: our lower-case ``w8a8`` (static per-tensor activations, for ONNX QDQ) is not; FP8 and
#: FP8_DYNAMIC are float8 e4m3 (CUDA: torch._scaled_mm on Hopper and Ada); NVFP4 and MXFP4 are
#: fp4 e2m1 weights (W4A4: with fp4 activations in the same groups, scaled at run time; NVFP4's
#: activation global scale is calibrated), NVFP4A16 and MXFP4A16 their weight-only forms.
ECOSYSTEM_PRESETS: dict[str, dict[str, Any]] = {
    "W3A16": {"weights": _g128(3), "inputs": None},
    "W4A16": {"weights": _g128(4), "inputs": None},
    "W4A16_ASYM": {"weights": _g128(4, symmetric=False), "inputs": None},
    "W8A16": {"weights": _g128(8), "inputs": None},
    "W4A8": {"weights": _g128(4), "inputs": _A_TOKEN},
    "W8A8": {"weights": _w(), "inputs": _A_TOKEN},
    "INT8": {"weights": _w(), "inputs": _A_TOKEN},
    # compressed-tensors' meanings: FP8 is static per-tensor weights and inputs, FP8_DYNAMIC
    # per-channel weights with dynamic per-token inputs (the one that needs no calibration data)
    "FP8": {"weights": _FP8, "inputs": _FP8},
    "FP8_DYNAMIC": {"weights": _FP8.with_(granularity="channel"),
                    "inputs": _FP8.with_(granularity="token", dynamic=True)},
    "NVFP4A16": {"weights": _NVFP4, "inputs": None},
    "NVFP4": {"weights": _NVFP4, "inputs": _NVFP4.with_(dynamic=True)},
    "MXFP4A16": {"weights": _MXFP4, "inputs": None},
    "MXFP4": {"weights": _MXFP4, "inputs": _MXFP4.with_(dynamic=True)},
}


class QuantScheme(BaseModel):
    """What a quantized layer quantizes: its weights, its inputs and (optionally) its outputs.

    ``inputs: None`` is weight-only quantization. ``outputs`` adds output quantizers to Linear and
    Conv layers; residual adds and attention matmuls always get one from ``outputs`` (or, when
    unset, from ``inputs``) because integer kernels need the output scale there.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    weights: QuantSpec | None = Field(default_factory=_w)
    inputs: QuantSpec | None = _A_STATIC
    outputs: QuantSpec | None = None

    @model_validator(mode="after")
    def _consistent(self) -> QuantScheme:
        for name in ("inputs", "outputs"):
            s: QuantSpec | None = getattr(self, name)
            if s is None:
                continue
            if s.is_fp4:
                if not s.dynamic:
                    raise ValueError(f"{name}: fp4 activations are scaled per group at run time (dynamic: true)")
                continue
            if s.bits != 8:
                raise ValueError(f"{name}: activations are quantized to 8 bits or fp4 (3- and 4-bit integers are for weights)")
            if s.granularity == "group":
                raise ValueError(f"{name}: granularity 'group' is for weights and fp4 activations")
        if self.outputs is not None and self.outputs.dynamic:
            raise ValueError("outputs: output quantizers are static (dynamic: false)")
        if self.weights is not None and (self.weights.dynamic or self.weights.granularity == "token"):
            raise ValueError("weights: weights are quantized statically (per tensor, channel or group)")
        if self.outputs is not None and self.outputs.is_fp4:
            raise ValueError("outputs: fp4 quantizes weights and Linear inputs, not outputs")
        if self.weights is None and self.inputs is None:
            raise ValueError("a scheme quantizes weights, inputs or both")
        return self

    @classmethod
    def preset(cls, name: str) -> QuantScheme:
        """One of the named presets: w8a8, w8a8_dynamic, w8_weight_only, w4_weight_only_g128,
        w4_weight_only (per channel), w3_weight_only_g128; or an llm-compressor / vLLM name
        (W4A16, W4A16_ASYM, W8A16, W3A16, W4A8, W8A8, INT8, FP8, FP8_DYNAMIC, NVFP4A16, NVFP4,
        MXFP4A16, MXFP4: see ``ECOSYSTEM_PRESETS``)."""
        if name in PRESETS:
            return cls(**PRESETS[name])
        # exact upper case, or any case that is not one of ours (``w4a16``; but ``w8a8`` is ours)
        key = name if name in ECOSYSTEM_PRESETS else name.upper()
        if key in ECOSYSTEM_PRESETS and (key == name or name.lower() not in PRESETS):
            return cls(**ECOSYSTEM_PRESETS[key])
        names = [*PRESETS, *ECOSYSTEM_PRESETS]
        raise RecipeError(f"unknown quantization scheme '{name}'; {did_you_mean(name, names)}")

    @property
    def static_activations(self) -> bool:
        """Whether calibration data is needed (a static input or output quantizer exists)."""
        return (self.inputs is not None and not self.inputs.dynamic) or self.outputs is not None

    @property
    def needs_data(self) -> bool:
        """Whether calibration data is needed: static activations, or NVFP4 inputs (their per-tensor
        global scale is calibrated; the group scales are computed at run time)."""
        return self.static_activations or (self.inputs is not None and self.inputs.is_fp4
                                           and self.inputs.scale_dtype == "fp8_e4m3")


def resolve_scheme(scheme: QuantScheme | str | dict[str, Any]) -> QuantScheme:
    """A QuantScheme from a scheme, a preset name, or a mapping (``preset`` key allowed as a base)."""
    if isinstance(scheme, QuantScheme):
        return scheme
    if isinstance(scheme, str):
        return QuantScheme.preset(scheme)
    if not isinstance(scheme, Mapping):
        raise RecipeError(
            f"scheme: {type(scheme).__name__} {scheme!r} is not a QuantScheme, a preset name or a mapping "
            f"(presets: {', '.join(sorted(PRESETS))})"
        )
    data = dict(scheme)
    base = data.pop("preset", None)
    if base is not None:
        merged = QuantScheme.preset(str(base)).model_dump()
        for key, val in data.items():
            if isinstance(val, dict) and isinstance(merged.get(key), dict):
                merged[key] = {**merged[key], **val}
            else:
                merged[key] = val
        data = merged
    try:
        return QuantScheme.model_validate(data)
    except pydantic.ValidationError as exc:
        raise RecipeError(f"scheme: {validation_message(exc)}") from None
