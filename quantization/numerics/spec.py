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


class QuantSpec(BaseModel):
    """How one tensor is quantized: bit width, integer type, symmetry, granularity and observer.

    ``observer`` names a registered observer (minmax, ema, percentile, entropy, mse) and
    ``observer_params`` its typed parameters (validated when the quantizer is built).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    bits: Literal[2, 3, 4, 8] = 8
    symmetric: bool = True
    dtype: Literal["int8", "uint8", "fp8_e4m3"] = "int8"
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

    @model_validator(mode="after")
    def _consistent(self) -> QuantSpec:
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
        """Whether codes are floating point (fp8) rather than integers."""
        return self.dtype == "fp8_e4m3"

    @property
    def qmin(self) -> int:
        if self.dtype == "fp8_e4m3":
            return -FP8_E4M3_MAX
        if self.dtype == "uint8":
            return 0
        if self.reduce_range:
            return -64
        return -(2 ** (self.bits - 1)) + (1 if self.narrow_range else 0)

    @property
    def qmax(self) -> int:
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
#: FP8_DYNAMIC are float8 e4m3 (CUDA: torch._scaled_mm on Hopper and Ada).
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
            if s.bits != 8:
                raise ValueError(f"{name}: activations are quantized to 8 bits (3 and 4 bits are for weights)")
            if s.granularity == "group":
                raise ValueError(f"{name}: granularity 'group' is for weights")
        if self.outputs is not None and self.outputs.dynamic:
            raise ValueError("outputs: output quantizers are static (dynamic: false)")
        if self.weights is not None and (self.weights.dynamic or self.weights.granularity == "token"):
            raise ValueError("weights: weights are quantized statically (per tensor, channel or group)")
        if self.weights is None and self.inputs is None:
            raise ValueError("a scheme quantizes weights, inputs or both")
        return self

    @classmethod
    def preset(cls, name: str) -> QuantScheme:
        """One of the named presets: w8a8, w8a8_dynamic, w8_weight_only, w4_weight_only_g128,
        w4_weight_only (per channel), w3_weight_only_g128; or an llm-compressor / vLLM name
        (W4A16, W4A16_ASYM, W8A16, W3A16, W4A8, W8A8, INT8, FP8, FP8_DYNAMIC: see ``ECOSYSTEM_PRESETS``)."""
        if name in PRESETS:
            return cls(**PRESETS[name])
        # exact upper case, or any case that is not one of ours (``w4a16``; but ``w8a8`` is ours)
        key = name if name in ECOSYSTEM_PRESETS else name.upper()
        if key in ECOSYSTEM_PRESETS and (key == name or name.lower() not in PRESETS):
            return cls(**ECOSYSTEM_PRESETS[key])
        names = [*PRESETS, *ECOSYSTEM_PRESETS]
        if name.upper().startswith(("NVFP4", "MXFP4", "FP4")):
            raise RecipeError(f"quantization scheme '{name}': 4-bit floating-point formats are not available here; "
                              f"presets: {', '.join(names)}")
        raise RecipeError(f"unknown quantization scheme '{name}'; {did_you_mean(name, names)}")

    @property
    def static_activations(self) -> bool:
        """Whether calibration data is needed (a static input or output quantizer exists)."""
        return (self.inputs is not None and not self.inputs.dynamic) or self.outputs is not None


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
