# mypy: disable-error-code="no-untyped-def"
# (Triton kernels annotate only their constexpr parameters; the rest are typed by the JIT.)
"""RMSNorm and LayerNorm with the next layer's activation quantization in the same pass.

One program per row reads ``x`` once (rows up to 16K elements; longer ones in sweeps) and writes
``y``, either transformers' Llama-family RMSNorm::

    h = x.float(); h = h * rsqrt(mean(h^2) + eps); y = weight * h.to(x.dtype)

(the product in ``promote(weight.dtype, x.dtype)``), or torch's LayerNorm (``F.layer_norm``, biased
variance, weight and bias optional)::

    h = x.float(); mu = mean(h); r = 1 / sqrt(mean((h - mu)^2) + eps); y = ((h - mu) * r * w + b).to(x.dtype)

(all in float32, one rounding, as torch computes it for 16-bit inputs on CPU and CUDA), and, unless
told not to, the dynamic per-token codes of ``y`` and their float32 scales: exactly what
:func:`quantize_per_token` writes given that ``y`` (the same ``y`` rounded to its dtype, the same
SmoothQuant pre-scale in ``y``'s dtype, the same ``div_rn`` and rounding helpers). A norm then
replaces its eager kernels and the per-token quantize kernel of the layers that read it by one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from compress.quantization.lowering.kernels.quant import (
    _FP8_MAX,
    _SINGLE_MAX,
    INTERPRETED,
    _pre_scale,
    _store_codes,
)
from compress.quantization.lowering.kernels.runtime import check_device

from compress.core.errors import CompressError


@triton.jit
def _to(v, dtype: tl.constexpr, BF16: tl.constexpr):
    """float32 ``v`` cast to ``dtype`` with round-to-nearest-even. The interpreter's float32 ->
    bfloat16 cast truncates; rounding the bits here first leaves it nothing to round."""
    if BF16 and INTERPRETED:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        v = bits.to(tl.float32, bitcast=True)
    return v.to(dtype)


@triton.jit
def _norm_y(x_row, w_ptr, b_ptr, offs, mask, mean, rinv, Y_DTYPE: tl.constexpr, X_BF16: tl.constexpr,
            Y_BF16: tl.constexpr, LAYER: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr):
    """y of the columns ``offs`` in y's dtype: RMSNorm's ``weight * (x * rinv).to(x.dtype)``, or
    LayerNorm's ``(x - mean) * rinv * weight + bias`` in float32, rounded once."""
    x = tl.load(x_row + offs, mask=mask, other=0.0)
    if LAYER:
        # torch's layer_norm: every step in float32 (its accumulate type), one rounding to x's dtype
        h = (x.to(tl.float32) - mean) * rinv
        if HAS_W:
            h = h * tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_B:
            h = h + tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        return _to(h, Y_DTYPE, Y_BF16)
    else:
        h = x.to(tl.float32) * rinv
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        # h.to(x.dtype), then the product widened: exact in float32 for 16-bit operands, so one rounding
        # to y's dtype, as torch's elementwise multiply does
        return _to(w * _to(h, x.dtype, X_BF16).to(tl.float32), Y_DTYPE, Y_BF16)


@triton.jit
def _scaled(y, pqs_ptr, offs, mask, HAS_PQS: tl.constexpr):
    """quant.py's _load_scaled on y: the very same ops (the interpreter's bf16 casts there truncate, here too)."""
    if HAS_PQS:
        y = y * tl.load(pqs_ptr + offs, mask=mask, other=0.0).to(y.dtype)
    return y.to(tl.float32)


@triton.jit
def _norm_quant_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, q_ptr, scale_ptr, pqs_ptr, K, stride_xm, stride_ym, stride_qm, eps,
    QMIN: tl.constexpr, QMAX: tl.constexpr, QEPS: tl.constexpr, BLOCK_K: tl.constexpr, SINGLE: tl.constexpr,
    CODES: tl.constexpr, HAS_PQS: tl.constexpr, FP8: tl.constexpr, X_BF16: tl.constexpr, Y_BF16: tl.constexpr,
    LAYER: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    y_row = y_ptr + row * stride_ym
    q_row = q_ptr + row * stride_qm
    cols = tl.arange(0, BLOCK_K)
    if SINGLE:  # the row stays in registers: x read once
        mask = cols < K
        h = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        mean = 0.0
        if LAYER:  # two passes over the registers: the mean, then the biased variance around it
            mean = tl.math.div_rn(tl.sum(h, axis=0), K * 1.0)
            h = tl.where(mask, h - mean, 0.0)
        var = tl.math.div_rn(tl.sum(h * h, axis=0), K * 1.0)
        # sqrt_rn and div_rn: correctly rounded like torch's rsqrt on CPU (the GPU's approximate
        # rsqrt is up to 2 ulp off); the reduction order still differs from torch's: a float tolerance
        rinv = tl.math.div_rn(1.0, tl.sqrt_rn(var + eps))
        y = _norm_y(x_row, w_ptr, b_ptr, cols, mask, mean, rinv, y_ptr.dtype.element_ty, X_BF16, Y_BF16, LAYER, HAS_W, HAS_B)
        tl.store(y_row + cols, y, mask=mask)
        if CODES:
            v = _scaled(y, pqs_ptr, cols, mask, HAS_PQS)
            scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(v), axis=0), QMAX), QEPS)
            _store_codes(q_row + cols, v * tl.math.div_rn(1.0, scale), QMIN, QMAX, mask, FP8)
            tl.store(scale_ptr + row, scale)
    else:  # longer rows: sweeps over x (the mean; the squares; y and its absmax; the codes from y recomputed)
        mean = 0.0
        if LAYER:
            acc = tl.zeros((BLOCK_K,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                acc += tl.load(x_row + cols + k0, mask=cols + k0 < K, other=0.0).to(tl.float32)
            mean = tl.math.div_rn(tl.sum(acc, axis=0), K * 1.0)
        acc = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            mask = cols + k0 < K
            h = tl.load(x_row + cols + k0, mask=mask, other=0.0).to(tl.float32)
            if LAYER:
                h = tl.where(mask, h - mean, 0.0)
            acc += h * h
        rinv = tl.math.div_rn(1.0, tl.sqrt_rn(tl.math.div_rn(tl.sum(acc, axis=0), K * 1.0) + eps))
        amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            mask = cols + k0 < K
            y = _norm_y(x_row, w_ptr, b_ptr, cols + k0, mask, mean, rinv, y_ptr.dtype.element_ty, X_BF16, Y_BF16, LAYER, HAS_W, HAS_B)
            tl.store(y_row + cols + k0, y, mask=mask)
            if CODES:
                amax = tl.maximum(amax, tl.abs(_scaled(y, pqs_ptr, cols + k0, mask, HAS_PQS)))
        if CODES:
            scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), QMAX), QEPS)
            inv = tl.math.div_rn(1.0, scale)
            for k0 in range(0, K, BLOCK_K):
                mask = cols + k0 < K
                y = _norm_y(x_row, w_ptr, b_ptr, cols + k0, mask, mean, rinv, y_ptr.dtype.element_ty, X_BF16, Y_BF16, LAYER, HAS_W,
                            HAS_B)
                _store_codes(q_row + cols + k0, _scaled(y, pqs_ptr, cols + k0, mask, HAS_PQS) * inv, QMIN, QMAX,
                             mask, FP8)
            tl.store(scale_ptr + row, scale)


def _check(x: torch.Tensor, k: int, what: str, name: str, t: torch.Tensor | None) -> None:
    if t is None:
        return
    if not t.is_floating_point():
        raise CompressError(f"{what}: expects a float {name} (got {t.dtype})")
    if t.dim() != 1 or t.numel() != k:
        raise CompressError(f"{what}: {name} of shape {tuple(t.shape)} for rows of {k}")
    if t.device != x.device:
        raise CompressError(f"{what}: {name} on {t.device}, input on {x.device}")


def _run(what: str, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
         y_dtype: torch.dtype, *, layer: bool, codes: bool, qmin: int, qmax: int, qeps: float,
         pre_scale: torch.Tensor | None, fp8: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Both norms' launch: checks, buffers, the kernel over every row of ``x``."""
    check_device(x, what)
    if not x.is_floating_point():
        raise CompressError(f"{what}: expects a float input (got {x.dtype})")
    k = x.shape[-1] if x.dim() else 0
    _check(x, k, what, "weight", weight)
    _check(x, k, what, "bias", bias)
    if fp8:
        qmin, qmax = -_FP8_MAX, _FP8_MAX
    elif codes and not -128 <= qmin < 0 < qmax <= 127:
        raise CompressError(f"{what}: symmetric int8 range expected, got [{qmin}, {qmax}]")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty((m, k), dtype=y_dtype, device=x.device)
    w = weight.detach().contiguous() if weight is not None else None
    b = bias.detach().contiguous() if bias is not None else None
    q = s = None
    if codes:
        q = torch.empty((m, k), dtype=torch.float8_e4m3fn if fp8 else torch.int8, device=x.device)
        s = torch.empty((m,), dtype=torch.float32, device=x.device)
    pqs = _pre_scale(pre_scale, k, x, what) if codes else None
    if m and k:
        single = k <= _SINGLE_MAX
        block = triton.next_power_of_2(k) if single else 4096
        warps = 4 if block <= 2048 else 8 if block <= 8192 else 16
        _norm_quant_kernel[(m,)](
            x2, w if w is not None else y, b if b is not None else y, y, q if q is not None else y,
            s if s is not None else y, pqs if pqs is not None else y, k,
            x2.stride(0), y.stride(0), q.stride(0) if q is not None else 0, float(eps),
            QMIN=float(qmin) if fp8 else qmin, QMAX=float(qmax), QEPS=float(qeps), BLOCK_K=block, SINGLE=single, CODES=codes,
            HAS_PQS=pqs is not None, FP8=fp8, X_BF16=x.dtype == torch.bfloat16, Y_BF16=y.dtype == torch.bfloat16,
            LAYER=layer, HAS_W=w is not None, HAS_B=b is not None, num_warps=warps,
        )
    elif m and s is not None:
        s.fill_(qeps)
    return y.reshape(x.shape), q, s


def rmsnorm_quantize(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    codes: bool = True,
    qmin: int = -128,
    qmax: int = 127,
    qeps: float = 1.1920928955078125e-07,
    pre_scale: torch.Tensor | None = None,
    fp8: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(y, codes, scales)``: the RMSNorm of ``x`` over its last dim (``y`` shaped like ``x``, dtype
    ``promote(weight.dtype, x.dtype)``) and, with ``codes``, ``quantize_per_token(y, qmin=, qmax=,
    eps=qeps, pre_scale=, fp8=)``'s codes ``[rows, K]`` and float32 scales ``[rows]``, bit for bit.
    ``codes=False``: the norm alone (``(y, None, None)``)."""
    if not x.is_floating_point() or not weight.is_floating_point():
        raise CompressError(f"rmsnorm_quantize: expects float tensors (got {x.dtype} input, {weight.dtype} weight)")
    return _run("rmsnorm_quantize", x, weight, None, eps, torch.promote_types(weight.dtype, x.dtype), layer=False,
                codes=codes, qmin=qmin, qmax=qmax, qeps=qeps, pre_scale=pre_scale, fp8=fp8)


def layernorm_quantize(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    *,
    codes: bool = True,
    qmin: int = -128,
    qmax: int = 127,
    qeps: float = 1.1920928955078125e-07,
    pre_scale: torch.Tensor | None = None,
    fp8: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(y, codes, scales)``: ``F.layer_norm(x, (K,), weight, bias, eps)`` over the last dim (``y``
    shaped like ``x``, in ``x``'s dtype; weight and bias optional, any float dtype) and, with
    ``codes``, ``quantize_per_token(y, ...)``'s codes and scales bit for bit, as :func:`rmsnorm_quantize`.
    The statistics, the normalization and the affine run in float32, y rounded once, as torch does;
    the kernel's summation order is its own (the mean and variance agree with torch's within a few
    float32 ulps)."""
    return _run("layernorm_quantize", x, weight, bias, eps, x.dtype, layer=True, codes=codes, qmin=qmin, qmax=qmax,
                qeps=qeps, pre_scale=pre_scale, fp8=fp8)
