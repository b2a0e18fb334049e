# mypy: disable-error-code="no-untyped-def"
# (Triton kernels annotate only their constexpr parameters; the rest are typed by the JIT.)
"""Activation quantization kernels: fused dynamic per-token (absmax, scale, round, pack in one pass)
and static per-tensor (one scale and zero point), to int8 codes or to float8 e4m3 codes.

Both reproduce ``quantization.numerics.primitives`` exactly: ``q = clamp(round(x * (1/scale)) + zp, qmin,
qmax)`` in float32 with round-half-to-even, and for dynamic symmetric rows ``scale =
max(absmax / (qmax - zp), eps)``. Codes are written as int8; uint8 ranges arrive already shifted
into int8 code space by the caller (``qmin - 128``, ``qmax - 128``, ``zp - 128``).

The per-token kernel reads each row once when it fits one block (up to 16K elements, every
transformer width that matters) and keeps it in registers between the reduction and the store;
longer rows fall back to a two-sweep loop.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from compress.quantization.lowering.kernels.runtime import check_device, interpret_mode

from compress.core.errors import CompressError

INTERPRETED: tl.constexpr = tl.constexpr(interpret_mode())
_SINGLE_MAX = 16384
_FP8_MAX = 448  # the largest finite float8 e4m3fn value


@triton.jit
def _round_clamp(v, lo, hi):
    # clamp first (integer bounds commute with rounding), then round half-to-even exactly
    v = tl.minimum(tl.maximum(v, lo), hi)
    return (v + 12582912.0) - 12582912.0


@triton.jit
def _e4m3_grid(v):
    """float32 ``v`` (|v| <= 448) rounded to the nearest e4m3 value, ties to even, still float32.

    The interpreter's float32 -> e4m3 cast drops the carry when rounding up crosses a power of two
    (124.2 became 64); rounding here first leaves the cast nothing to round."""
    e = ((v.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32)
    e = tl.maximum(e, 127 - 6)  # below 2^-6 the grid is the subnormal one, steps of 2^-9
    ulp = ((e - 3) << 23).to(tl.float32, bitcast=True)  # 2^(exponent - 3): 3 mantissa bits
    return ((v / ulp + 12582912.0) - 12582912.0) * ulp


@triton.jit
def _store_codes(ptrs, v, lo, hi, mask, FP8: tl.constexpr):
    # fp8: clamp to the e4m3 range, round to nearest-even (torch's cast does the same); the GPU's
    # cast rounds correctly by itself, the interpreter's needs the grid first. (One store per
    # branch: Triton's compiler wants one return type from a jit function.)
    if FP8:
        c = tl.minimum(tl.maximum(v, lo), hi)
        if INTERPRETED:
            c = _e4m3_grid(c)
        tl.store(ptrs, c.to(tl.float8e4nv), mask=mask)
    else:
        tl.store(ptrs, _round_clamp(v, lo, hi).to(tl.int8), mask=mask)


@triton.jit
def _load_scaled(ptrs, mask, pqs_ptrs, HAS_PQS: tl.constexpr):
    # SmoothQuant's pre_quant_scale, multiplied in the input's own dtype exactly like the
    # fake-quant forward (``x * pqs.to(x.dtype)``), then widened: saves a full pass over x
    x = tl.load(ptrs, mask=mask, other=0.0)
    if HAS_PQS:
        x = x * tl.load(pqs_ptrs, mask=mask, other=0.0).to(x.dtype)
    return x.to(tl.float32)


@triton.jit
def _per_token_kernel(
    x_ptr, q_ptr, scale_ptr, pqs_ptr, K, stride_xm, stride_xk, stride_qm,
    QMIN: tl.constexpr, QMAX: tl.constexpr, EPS: tl.constexpr, BLOCK_K: tl.constexpr, SINGLE: tl.constexpr,
    HAS_PQS: tl.constexpr, FP8: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    cols = tl.arange(0, BLOCK_K)
    if SINGLE:
        mask = cols < K
        x = _load_scaled(x_row + cols * stride_xk, mask, pqs_ptr + cols, HAS_PQS)
        amax = tl.max(tl.abs(x), axis=0)
        # div_rn: IEEE division, as torch computes the reference; the GPU's default fp32 `/` is
        # approximate (up to 2 ulp) and moved a scale by one ulp in the CUDA tests
        scale = tl.maximum(tl.math.div_rn(amax, QMAX), EPS)
        inv = tl.math.div_rn(1.0, scale)
        _store_codes(q_row + cols, x * inv, QMIN, QMAX, mask, FP8)
    else:
        amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            mask = cols + k0 < K
            x = _load_scaled(x_row + (cols + k0) * stride_xk, mask, pqs_ptr + cols + k0, HAS_PQS)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), QMAX), EPS)
        inv = tl.math.div_rn(1.0, scale)
        for k0 in range(0, K, BLOCK_K):
            mask = cols + k0 < K
            x = _load_scaled(x_row + (cols + k0) * stride_xk, mask, pqs_ptr + cols + k0, HAS_PQS)
            _store_codes(q_row + cols + k0, x * inv, QMIN, QMAX, mask, FP8)
    tl.store(scale_ptr + row, scale)


@triton.jit
def _static_kernel(x_ptr, q_ptr, scale_ptr, pqs_ptr, numel, K, zp, QMIN: tl.constexpr, QMAX: tl.constexpr,
                   BLOCK: tl.constexpr, HAS_PQS: tl.constexpr, FP8: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = _load_scaled(x_ptr + offs, mask, pqs_ptr + offs % K, HAS_PQS)
    inv = tl.math.div_rn(1.0, tl.load(scale_ptr))
    # zp is a runtime argument: one compiled kernel serves every layer's zero point
    if FP8:
        _store_codes(q_ptr + offs, x * inv, QMIN, QMAX, mask, FP8)
    else:
        q = _round_clamp(x * inv, QMIN - zp, QMAX - zp) + zp
        tl.store(q_ptr + offs, q.to(tl.int8), mask=mask)


def _check_float(x: torch.Tensor, what: str) -> None:
    check_device(x, what)
    if not x.is_floating_point():
        raise CompressError(f"{what}: expects a float tensor (got {x.dtype})")


def _pre_scale(pre_scale: torch.Tensor | None, k: int, x: torch.Tensor, what: str) -> torch.Tensor | None:
    if pre_scale is None:
        return None
    if pre_scale.numel() != k:
        raise CompressError(f"{what}: pre_scale has {pre_scale.numel()} elements, the last dim has {k}")
    return pre_scale.reshape(-1).to(device=x.device, dtype=torch.float32).contiguous()


def quantize_per_token(
    x: torch.Tensor,
    *,
    qmin: int = -128,
    qmax: int = 127,
    eps: float = 1.1920928955078125e-07,
    pre_scale: torch.Tensor | None = None,
    fp8: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric dynamic quantization of each row of ``x`` (all dims but the last are rows).

    Returns int8 codes (``fp8``: float8 e4m3 codes, range [-448, 448]) shaped like ``x`` and float32
    scales ``[rows]``; ``scale = max(absmax / qmax, eps)``. Rows may be strided; the codes are
    contiguous. ``pre_scale`` (one factor per column, SmoothQuant's) multiplies ``x`` first, in ``x``'s dtype.
    """
    _check_float(x, "quantize_per_token")
    if fp8:
        qmin, qmax = -_FP8_MAX, _FP8_MAX
    elif not -128 <= qmin < 0 < qmax <= 127:
        raise CompressError(f"quantize_per_token: symmetric int8 range expected, got [{qmin}, {qmax}]")
    k = x.shape[-1] if x.dim() else 1
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn if fp8 else torch.int8, device=x.device)
    scale = torch.empty((m,), dtype=torch.float32, device=x.device)
    pqs = _pre_scale(pre_scale, k, x, "quantize_per_token")
    if m and k:
        single = k <= _SINGLE_MAX
        block = triton.next_power_of_2(k) if single else 4096
        warps = 4 if block <= 2048 else 8 if block <= 8192 else 16
        _per_token_kernel[(m,)](
            x2, q, scale, pqs if pqs is not None else scale, k, x2.stride(0), x2.stride(1), q.stride(0),
            QMIN=float(qmin) if fp8 else qmin, QMAX=float(qmax), EPS=float(eps), BLOCK_K=block, SINGLE=single,
            HAS_PQS=pqs is not None, FP8=fp8, num_warps=warps,
        )
    elif m:
        scale.fill_(eps)
    return q.reshape(x.shape), scale


def quantize_static(
    x: torch.Tensor,
    *,
    scale: torch.Tensor | float,
    zero_point: int = 0,
    qmin: int = -128,
    qmax: int = 127,
    pre_scale: torch.Tensor | None = None,
    fp8: bool = False,
) -> torch.Tensor:
    """int8 codes of ``x`` with one scale and zero point (int8 code space), contiguous like ``x``;
    ``fp8``: float8 e4m3 codes (symmetric, range [-448, 448], ``zero_point`` 0).

    ``x`` keeps its memory format (a channels-last NCHW tensor gives channels-last codes).
    ``pre_scale`` (one factor per last-dim column) multiplies ``x`` first, in ``x``'s dtype.
    """
    _check_float(x, "quantize_static")
    if fp8:
        qmin, qmax = -_FP8_MAX, _FP8_MAX
        if zero_point:
            raise CompressError(f"quantize_static: fp8 codes are symmetric (zero_point 0, got {zero_point})")
    elif not -128 <= qmin <= zero_point <= qmax <= 127:
        raise CompressError(f"quantize_static: need -128 <= qmin <= zero_point <= qmax <= 127 (got {qmin}, {zero_point}, {qmax})")
    fmt = (
        torch.channels_last
        if pre_scale is None and x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last)
        else None
    )
    xc = x if fmt is not None else x.contiguous()
    q = torch.empty_like(xc, dtype=torch.float8_e4m3fn if fp8 else torch.int8)
    s = torch.as_tensor(scale, dtype=torch.float32, device=x.device).reshape(-1)
    if s.numel() != 1:
        raise CompressError(f"quantize_static: one scale expected (got {s.numel()})")
    k = x.shape[-1] if x.dim() else 1
    pqs = _pre_scale(pre_scale, k, x, "quantize_static")
    n = xc.numel()
    if n:
        block = 1024
        # flat indexing over storage: valid for contiguous and channels-last alike (pre_scale: contiguous)
        _static_kernel[(triton.cdiv(n, block),)](
            xc, q, s, pqs if pqs is not None else s, n, k, int(zero_point), QMIN=float(qmin) if fp8 else qmin,
            QMAX=float(qmax) if fp8 else qmax, BLOCK=block, HAS_PQS=pqs is not None, FP8=fp8,
        )
    return q


@triton.jit
def _qdq_kernel(x_ptr, y_ptr, scale_ptr, numel, zp, QMIN: tl.constexpr, QMAX: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(scale_ptr)
    inv = tl.math.div_rn(1.0, s)
    q = _round_clamp(x * inv, QMIN - zp, QMAX - zp)  # codes minus the zero point
    tl.store(y_ptr + offs, (q * s).to(y_ptr.dtype.element_ty), mask=mask)


def fake_quantize_static(x: torch.Tensor, *, scale: torch.Tensor, zero_point: int, qmin: int, qmax: int) -> torch.Tensor:
    """``(clamp(round(x / scale) + zp, qmin, qmax) - zp) * scale`` in float32, cast to ``x``'s dtype:
    the fake quantizer's per-tensor forward as one pass (a placed activation quantizer that a
    converted model keeps for a float consumer, e.g. a residual add). Memory format is kept."""
    _check_float(x, "fake_quantize_static")
    fmt = x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last)
    xc = x if fmt else x.contiguous()
    y = torch.empty_like(xc)
    n = xc.numel()
    if n:
        block = 1024
        _qdq_kernel[(triton.cdiv(n, block),)](xc, y, scale.reshape(1).float(), n, int(zero_point), QMIN=qmin,
                                              QMAX=qmax, BLOCK=block)
    return y
