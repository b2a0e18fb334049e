# mypy: disable-error-code="no-untyped-def"
# (Triton kernels annotate only their constexpr parameters; the rest are typed by the JIT.)
"""RMSNorm with the next layer's activation quantization in the same pass.

One program per row reads ``x`` once (rows up to 16K elements; longer ones in sweeps) and writes
``y``, transformers' Llama-family RMSNorm::

    h = x.float(); h = h * rsqrt(mean(h^2) + eps); y = weight * h.to(x.dtype)

(the product in ``promote(weight.dtype, x.dtype)``), and, unless told not to, the dynamic per-token
codes of ``y`` and their float32 scales: exactly what :func:`quantize_per_token` writes given that
``y`` (the same ``y`` rounded to its dtype, the same SmoothQuant pre-scale in ``y``'s dtype, the same
``div_rn`` and rounding helpers). A decoder's norm then replaces about six eager kernels and the
per-token quantize kernel of the layers that read it by one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from compress.core.errors import CompressError
from quantization.lowering.kernels.quant import _FP8_MAX, _SINGLE_MAX, INTERPRETED, _pre_scale, _store_codes
from quantization.lowering.kernels.runtime import check_device


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
def _norm_y(x_row, w_ptr, offs, mask, rinv, Y_DTYPE: tl.constexpr, X_BF16: tl.constexpr, Y_BF16: tl.constexpr):
    """y of the columns ``offs``: ``weight * (x * rinv).to(x.dtype)`` in y's dtype."""
    x = tl.load(x_row + offs, mask=mask, other=0.0)
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
def _rmsnorm_quant_kernel(
    x_ptr, w_ptr, y_ptr, q_ptr, scale_ptr, pqs_ptr, K, stride_xm, stride_ym, stride_qm, eps,
    QMIN: tl.constexpr, QMAX: tl.constexpr, QEPS: tl.constexpr, BLOCK_K: tl.constexpr, SINGLE: tl.constexpr,
    CODES: tl.constexpr, HAS_PQS: tl.constexpr, FP8: tl.constexpr, X_BF16: tl.constexpr, Y_BF16: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    y_row = y_ptr + row * stride_ym
    q_row = q_ptr + row * stride_qm
    cols = tl.arange(0, BLOCK_K)
    if SINGLE:  # the row stays in registers: x read once
        mask = cols < K
        h = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        var = tl.math.div_rn(tl.sum(h * h, axis=0), K * 1.0)
        # sqrt_rn and div_rn: correctly rounded like torch's rsqrt on CPU (the GPU's approximate
        # rsqrt is up to 2 ulp off); the reduction order still differs from torch's: a float tolerance
        rinv = tl.math.div_rn(1.0, tl.sqrt_rn(var + eps))
        y = _norm_y(x_row, w_ptr, cols, mask, rinv, y_ptr.dtype.element_ty, X_BF16, Y_BF16)
        tl.store(y_row + cols, y, mask=mask)
        if CODES:
            v = _scaled(y, pqs_ptr, cols, mask, HAS_PQS)
            scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(v), axis=0), QMAX), QEPS)
            _store_codes(q_row + cols, v * tl.math.div_rn(1.0, scale), QMIN, QMAX, mask, FP8)
            tl.store(scale_ptr + row, scale)
    else:  # longer rows: sweeps over x (sum of squares; y and its absmax; the codes from y recomputed)
        acc = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            h = tl.load(x_row + cols + k0, mask=cols + k0 < K, other=0.0).to(tl.float32)
            acc += h * h
        rinv = tl.math.div_rn(1.0, tl.sqrt_rn(tl.math.div_rn(tl.sum(acc, axis=0), K * 1.0) + eps))
        amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            mask = cols + k0 < K
            y = _norm_y(x_row, w_ptr, cols + k0, mask, rinv, y_ptr.dtype.element_ty, X_BF16, Y_BF16)
            tl.store(y_row + cols + k0, y, mask=mask)
            if CODES:
                amax = tl.maximum(amax, tl.abs(_scaled(y, pqs_ptr, cols + k0, mask, HAS_PQS)))
        if CODES:
            scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), QMAX), QEPS)
            inv = tl.math.div_rn(1.0, scale)
            for k0 in range(0, K, BLOCK_K):
                mask = cols + k0 < K
                y = _norm_y(x_row, w_ptr, cols + k0, mask, rinv, y_ptr.dtype.element_ty, X_BF16, Y_BF16)
                _store_codes(q_row + cols + k0, _scaled(y, pqs_ptr, cols + k0, mask, HAS_PQS) * inv, QMIN, QMAX,
                             mask, FP8)
            tl.store(scale_ptr + row, scale)


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
    check_device(x, "rmsnorm_quantize")
    if not x.is_floating_point() or not weight.is_floating_point():
        raise CompressError(f"rmsnorm_quantize: expects float tensors (got {x.dtype} input, {weight.dtype} weight)")
    k = x.shape[-1] if x.dim() else 0
    if weight.dim() != 1 or weight.numel() != k:
        raise CompressError(f"rmsnorm_quantize: weight of shape {tuple(weight.shape)} for rows of {k}")
    if fp8:
        qmin, qmax = -_FP8_MAX, _FP8_MAX
    elif codes and not -128 <= qmin < 0 < qmax <= 127:
        raise CompressError(f"rmsnorm_quantize: symmetric int8 range expected, got [{qmin}, {qmax}]")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty((m, k), dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    w = weight.detach().contiguous()
    q = s = None
    if codes:
        q = torch.empty((m, k), dtype=torch.float8_e4m3fn if fp8 else torch.int8, device=x.device)
        s = torch.empty((m,), dtype=torch.float32, device=x.device)
    pqs = _pre_scale(pre_scale, k, x, "rmsnorm_quantize") if codes else None
    if m and k:
        single = k <= _SINGLE_MAX
        block = triton.next_power_of_2(k) if single else 4096
        warps = 4 if block <= 2048 else 8 if block <= 8192 else 16
        _rmsnorm_quant_kernel[(m,)](
            x2, w, y, q if q is not None else y, s if s is not None else y, pqs if pqs is not None else w, k,
            x2.stride(0), y.stride(0), q.stride(0) if q is not None else 0, float(eps),
            QMIN=float(qmin) if fp8 else qmin, QMAX=float(qmax), QEPS=float(qeps), BLOCK_K=block, SINGLE=single, CODES=codes,
            HAS_PQS=pqs is not None, FP8=fp8, X_BF16=x.dtype == torch.bfloat16, Y_BF16=y.dtype == torch.bfloat16,
            num_warps=warps,
        )
    elif m and s is not None:
        s.fill_(qeps)
    return y.reshape(x.shape), q, s
