"""FP8Linear: a float8 (e4m3) W8A8 Linear for CUDA, run by cuBLASLt through ``torch._scaled_mm``.

Built from a calibrated QuantLinear whose weights and inputs are ``fp8_e4m3`` (the ``FP8`` and
``FP8_DYNAMIC`` presets): the weight is stored once as float8 codes ``[out, in]`` with float32
per-tensor or per-output-channel scales; inputs are quantized at run time by the Triton kernel of
:mod:`quantization.lowering.kernels.quant` (per token, or with the calibrated per-tensor scale) into
float8 codes, and one ``torch._scaled_mm`` call multiplies the codes and applies both scales and
the bias in its epilogue. The codes are exactly the fake-quant model's (the same clamp and
round-to-nearest-even cast), so the converted model differs from it only by accumulation order.

FP8 tensor cores exist from Ada (sm89) and Hopper (sm90) on; on older GPUs ``_scaled_mm`` refuses
and the converter keeps the layer float with that reason. Like the int8 modules, it runs on CUDA, or
on CPU only under ``TRITON_INTERPRET=1`` (tests; PyTorch has a CPU ``_scaled_mm``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from compress.quantization.lowering.fused_norm import claim
from compress.quantization.lowering.kernels import load
from compress.quantization.lowering.kernels.ops import compiling, ops
from compress.quantization.lowering.kernels.ops import register as register_ops
from compress.quantization.lowering.shared_input import SharedCodes
from compress.quantization.numerics.fake_quant import FakeQuantizer
from compress.quantization.numerics.primitives import SCALE_EPS
from torch import nn

from compress.core.errors import CompressError, UnsupportedModelError

_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# cuBLASLt's fp8 GEMM wants K and N multiples of 16 (the 16-byte alignment of e4m3 rows)
_ALIGN = 16


def fp8_capable(device: torch.device) -> tuple[bool, str]:
    """Whether ``device`` has fp8 tensor cores (CUDA compute capability 8.9 or later), and why not."""
    if device.type != "cuda":
        return True, ""  # CPU: PyTorch's reference _scaled_mm (tests under the interpreter)
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return False, f"fp8 tensor cores need compute capability 8.9 or later (this GPU is {major}.{minor})"
    return True, ""


def _fp8_weight(mod: Any) -> tuple[torch.Tensor, torch.Tensor]:
    wq: FakeQuantizer | None = mod.weight_quantizer
    if wq is None or not wq.enabled or not wq.spec.is_fp8:
        raise UnsupportedModelError("its weights are not fp8")
    s = wq.spec
    if s.granularity not in ("tensor", "channel") or (s.granularity == "channel" and s.axis not in (0, -2)):
        raise UnsupportedModelError(f"its fp8 weight scales are per {s.granularity}; the GEMM takes per tensor or per output channel")
    if not wq.calibrated:
        raise UnsupportedModelError("its weight quantizer is not calibrated")
    with torch.no_grad():
        codes = wq.int_repr(mod.weight.detach().float())
        scale = wq.scale.detach().float().clamp(min=SCALE_EPS).reshape(-1).clone()
    return codes.contiguous(), scale


class FP8Linear(nn.Module):
    """W8A8 Linear in float8 e4m3: fp8 weight ``[out, in]`` with per-tensor or per-channel scales,
    fp8 activations (dynamic per token or static per tensor), cuBLASLt ``_scaled_mm``."""

    weight_fp8: torch.Tensor
    weight_scale: torch.Tensor
    input_scale: torch.Tensor
    bias: torch.Tensor | None
    pre_quant_scale: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        register_ops()  # torch.ops.compress.*, called under torch.compile
        self.in_features, self.out_features = in_features, out_features
        self.input_mode = "token"
        self.activation = "none"
        self.output_quantizer: FakeQuantizer | None = None

    @classmethod
    def from_quant(cls, mod: Any, *, activation: str = "none", input_quantizer: FakeQuantizer | None = None) -> FP8Linear:
        """An FP8Linear computing what the fake-quant fp8 ``QuantLinear`` ``mod`` computes."""
        if activation != "none":
            raise UnsupportedModelError("fused activations are not taken by the fp8 GEMM")  # converter passes none
        weight: torch.Tensor = mod.weight
        n, k = weight.shape
        if k % _ALIGN or n % _ALIGN:
            raise UnsupportedModelError(f"its shape [{n}, {k}] is not a multiple of {_ALIGN} (cuBLASLt's fp8 GEMM needs it)")
        ok, why = fp8_capable(weight.device)
        if not ok:
            raise UnsupportedModelError(why)
        iq = input_quantizer or mod.input_quantizer
        if iq is None or not iq.enabled:
            raise UnsupportedModelError("its inputs are not quantized (weight-only fp8 has no kernel here)")
        if not iq.spec.is_fp8:
            raise UnsupportedModelError(f"its weights are fp8 but its inputs are {iq.spec.dtype}")
        new = cls(k, n)
        if iq.spec.dynamic:
            if iq.spec.granularity not in ("token", "tensor"):
                raise UnsupportedModelError(f"dynamic per-{iq.spec.granularity} fp8 inputs are not supported")
            new.input_mode = "token" if iq.spec.granularity == "token" else "dynamic_tensor"
            new.register_buffer("input_scale", torch.ones(1))
        else:
            if iq.spec.granularity != "tensor" or not iq.calibrated:
                raise UnsupportedModelError("its static fp8 inputs need one calibrated scale")
            new.input_mode = "static"
            new.register_buffer("input_scale", iq.scale.detach().float().clamp(min=SCALE_EPS).reshape(1).clone())
        pqs = iq.pre_quant_scale
        new.register_buffer("pre_quant_scale", None if pqs is None else pqs.detach().float().clone())
        codes, scale = _fp8_weight(mod)
        new.register_buffer("weight_fp8", codes)
        new.register_buffer("weight_scale", scale)
        b = mod.bias
        new.register_buffer("bias", None if b is None else b.detach().float().clone())
        new.output_quantizer = copy.deepcopy(mod.output_quantizer)
        return new.to(weight.device)

    shared_codes: SharedCodes | None = None

    def input_signature(self) -> tuple[Any, ...]:
        """What determines this layer's input codes (see quantization/lowering/shared_input.py)."""
        pqs = self.pre_quant_scale
        return (type(self).__name__, self.input_mode,
                tuple(self.input_scale.reshape(-1).tolist()) if self.input_mode == "static" else None,
                None if pqs is None else tuple(pqs.reshape(-1).tolist()))

    def _quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pqs = self.pre_quant_scale
        traced = compiling()
        quant = None if traced else load("quant")
        if self.input_mode == "token":
            if quant is None:
                q, s = ops().quantize_per_token(x, -448, 448, True, pqs)
                return q, s
            return quant.quantize_per_token(x, fp8=True, pre_scale=pqs)
        if self.input_mode == "dynamic_tensor":
            if pqs is not None:
                x, pqs = x * pqs.to(x.dtype), None
            scale = torch.clamp(x.detach().abs().amax().float().reshape(1) / 448.0, min=SCALE_EPS)
        else:
            scale = self.input_scale
        if quant is None:
            return ops().quantize_static(x, scale, 0, -448, 448, True, pqs), scale
        return quant.quantize_static(x, scale=scale, fp8=True, pre_scale=pqs), scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in _OUT_DTYPES:
            raise CompressError(f"FP8Linear: inputs must be float16, bfloat16 or float32 (got {x.dtype})")
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        if self.input_mode == "token" and not compiling():  # a FusedRMSNorm's output (fused_norm.py)
            claim(x, self, qmin=-448, qmax=448, fp8=True)
        if self.shared_codes is not None and not compiling():
            xq, sa = self.shared_codes.get(x, lambda: self._quantize_input(flat))
        else:
            xq, sa = self._quantize_input(flat)
        y = fp8_gemm(xq, self.weight_fp8, a_scale=sa, b_scale=self.weight_scale, bias=self.bias, out_dtype=x.dtype)
        y = y.reshape(*lead, self.out_features)
        return self.output_quantizer(y) if self.output_quantizer is not None else y

    def extra_repr(self) -> str:
        w = "channel" if self.weight_scale.numel() > 1 else "tensor"
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3 weights per {w}, input={self.input_mode}"


# Output dtypes cuBLASLt refused once for a scaling kind (row-wise scaling took bf16 only in some
# PyTorch releases): later calls go straight to bf16 and cast, without a failing call each time.
_REFUSED: set[tuple[torch.dtype, bool]] = set()


def fp8_gemm(
    a: torch.Tensor, b: torch.Tensor, *, a_scale: torch.Tensor, b_scale: torch.Tensor,
    bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``(a @ b.T) * a_scale * b_scale + bias`` as ``out_dtype`` ``[M, N]`` from float8 e4m3 codes.

    ``a`` fp8 ``[M, K]``; ``b`` fp8 ``[N, K]``; ``a_scale`` float32 of 1 or M elements (per token);
    ``b_scale`` float32 of 1 or N elements (per output channel). One ``torch._scaled_mm`` call:
    both scales and the bias are applied in cuBLASLt's epilogue.
    """
    if a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn:
        raise CompressError(f"fp8_gemm: operands must be float8_e4m3fn (got {a.dtype} and {b.dtype})")
    m, n = a.shape[0], b.shape[0]
    rowwise = a_scale.numel() != 1 or b_scale.numel() != 1
    sa = a_scale.reshape(-1, 1).float() if rowwise else a_scale.reshape(()).float()
    sb = b_scale.reshape(1, -1).float() if rowwise else b_scale.reshape(()).float()
    if rowwise:  # row-wise scaling takes both scales as vectors
        sa = sa.expand(m, 1).contiguous() if sa.numel() == 1 else sa
        sb = sb.expand(1, n).contiguous() if sb.numel() == 1 else sb
    if m == 0:
        return torch.empty((0, n), device=a.device, dtype=out_dtype)
    if out_dtype == torch.float32 and rowwise:
        # row-wise scaling may refuse outputs other than bf16 (PyTorch 2.4-2.6 did); fp32 callers
        # (parity checks) want fp32: unit scales with an fp32 result, then the scales and bias here
        one = torch.ones((), device=a.device, dtype=torch.float32)
        y = torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        y = y * sa * sb
        return y if bias is None else y + bias.float()
    dtype = out_dtype
    if (dtype, rowwise) in _REFUSED or (rowwise and compiling()):
        # a traced graph takes one path: row-wise scaling's bf16 output (always accepted), then cast
        dtype = torch.bfloat16
    while True:
        try:
            y = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=dtype,
                                 bias=None if bias is None else bias.to(dtype))
            break
        except RuntimeError:
            if dtype == torch.bfloat16:
                raise
            _REFUSED.add((out_dtype, rowwise))
            dtype = torch.bfloat16
    return y if y.dtype == out_dtype else y.to(out_dtype)
