# mypy: disable-error-code="no-untyped-def"
# (Triton kernels annotate only their constexpr parameters; the rest are typed by the JIT.)
"""W4A16 GEMM: int4 weights dequantized in registers, fp16/bf16 (or fp32) activations (Triton).

``Y[M, N] = act(X @ W^T + bias)`` with ``W[n, k] = (u[n, k] - z[n, g]) * s[n, g]``, ``g = g_idx[k]``
(or ``k // group_size``): ``u`` unsigned 4-bit codes packed two per byte along K (``w_packed``
uint8 ``[N, K/2]``, feature 2i in the low nibble), ``s`` float32 group scales ``[N, G]``, ``z``
uint8 zero points ``[N, G]`` (or the constant 8 for symmetric int4). See quantization/lowering/int4.py.

A tile of packed bytes ``[BLOCK_N, BLOCK_K/2]`` is loaded contiguously along K (16-byte vector
loads: each byte holds a pair of features), split into its low and high nibbles, dequantized in
float32 (the fake-quant arithmetic) and rounded to the activation dtype; the even and odd
features of X meet them in two products. The weight never exists in memory as fp16. When the
K-tile lies inside one group (``group_size % BLOCK_K == 0``, no g_idx) a tile needs one scale
(and zero point) per row; otherwise, or with act_order's g_idx, each feature gathers its group's.

Five ways to run, by the number of rows M and the dtype (``path``):
- ``fused`` with ``BLOCK_M < 16`` (decode, M = 1..4): no tensor cores; products are summed on
  the CUDA cores, so the 16-row minimum of ``tl.dot`` is not paid for 1 row.
- ``fused`` with ``BLOCK_M >= 16``: ``tl.dot`` (tensor cores) with float32 accumulation.
- ``fused`` with a ``scaled_acc`` config (fp16/bf16, K-tiles inside one group; kernels/w4a16_mma.py):
  tensor cores on the int4 codes themselves, the group scale applied to the float32 sum per tile.
  At decode shapes on an H200 the tuner picked it at every LLaMA-7B shape (benchmarks/RESULTS.md).
- ``fused`` with a ``gemv`` config (decode, M = 1..4; kernels/w4a16_gemv.py): CUDA cores on the
  codes, two instructions and one FMA per row for each code, the group scale on each group's sum.
- ``dequant`` (prefill, large M): one kernel writes the dequantized weight in the activation
  dtype, then cuBLAS multiplies. At large M the product is compute-bound and re-dequantizing a
  weight tile for every M-tile costs more than writing it once.
Decode is bound by reading the weight, and a 4096-wide layer has too few N-tiles to keep every
SM busy, so the fused kernel splits K (``split_k``): each split writes float32 partial sums and a
second kernel adds them in a fixed order (deterministic, unlike atomics), then applies bias and
activation. On CUDA the tile and split are tuned per (M bucket, N, K, group, flags) by timing
candidates on first use; under ``TRITON_INTERPRET=1`` fixed tiles run on CPU tensors.

Numerics: the dequantized weight is bit-exact against :func:`quantization.lowering.int4.dequantize_int4`
cast to the activation dtype on the dequantizing paths (tested through an identity activation); the
fused product differs from torch's only by float32 accumulation order, the dequant path's is cuBLAS's
on that same weight (bias added in the activation dtype, as nn.Linear does). The ``scaled_acc``
kernel multiplies the exact int4 weight (float32 scales, no rounding of the weight to fp16).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from compress.quantization.lowering.kernels.gemm import GemmConfig, m_bucket
from compress.quantization.lowering.kernels.runtime import ACTIVATIONS, check_device, interpret_mode
from compress.quantization.lowering.kernels.w4_common import (
    W4Config,
    _finish,
    _first_w,
    _round_bf16,
    _tile_loads,
    _tile_start,
    _Weight,
    k_splits,
)

from compress.core.errors import CompressError

log = logging.getLogger(__name__)
INTERPRETED = interpret_mode()
_ACT_CODE = {name: i for i, name in enumerate(ACTIVATIONS)}
_X_KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
PATHS = ("auto", "fused", "dequant")
# From this many rows on, "auto" dequantizes once and lets cuBLAS multiply; below it the fused
# kernel, which reads 4x fewer weight bytes, is faster. On an H100 at LLaMA-7B shapes (benchmarks/
# RESULTS.md, "W4A16") fused won at 16 rows and dequant at 64 on all three; 32 lies between.
DEQUANT_MIN_M = 32


@triton.jit
def _as_act(w, X_KIND: tl.constexpr, INTERP_BF16: tl.constexpr):
    """float32 ``w`` rounded to the activation dtype (0 fp32, 1 fp16, 2 bf16), kept as float32."""
    r = w
    if X_KIND == 1:
        r = w.to(tl.float16).to(tl.float32)
    elif X_KIND == 2:
        if INTERP_BF16:
            r = _round_bf16(w)
        else:
            r = w.to(tl.bfloat16).to(tl.float32)
    return r


@triton.jit
def _feature_qparams(s_ptr, z_ptr, g_ptr, rows, kk, K, GROUP_SIZE, ZP_CONST, stride_sn, stride_sg, stride_zn,
                     stride_zg, HAS_ZP: tl.constexpr, HAS_GIDX: tl.constexpr):
    """Scale ``[rows, kk]`` and zero point of each (row, feature): the feature's group is act_order's
    ``g_idx[k]`` or ``k // GROUP_SIZE``. Features past K read the last one's (their x or store is masked)."""
    kc = tl.minimum(kk, K - 1)
    if HAS_GIDX:
        g = tl.load(g_ptr + kc)
    else:
        g = kc // GROUP_SIZE
    s = tl.load(s_ptr + rows[:, None] * stride_sn + g[None, :] * stride_sg)
    if HAS_ZP:
        z = tl.load(z_ptr + rows[:, None] * stride_zn + g[None, :] * stride_zg).to(tl.int32)
    else:
        z = ZP_CONST
    return s, z


@triton.jit
def _per_group(v, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILE_GROUPS: tl.constexpr):
    """``[BLOCK_N, TILE_GROUPS]`` per-group values spread over the tile's ``BLOCK_K / 2`` bytes (byte b
    holds features 2b, 2b + 1, both in group ``2b // group``)."""
    v3 = tl.broadcast_to(v[:, :, None], (BLOCK_N, TILE_GROUPS, BLOCK_K // TILE_GROUPS // 2))
    return tl.reshape(v3, (BLOCK_N, BLOCK_K // 2))


@triton.jit
def _w4a16_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, g_ptr, bias_ptr, y_ptr, ws_ptr,
    M, N, K, GROUP_SIZE, ZP_CONST, TILES_PER_SPLIT,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sg, stride_zn, stride_zg,
    stride_ym, stride_yn,
    HAS_ZP: tl.constexpr, HAS_GIDX: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
    X_KIND: tl.constexpr, INTERP_BF16: tl.constexpr, DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr, TILE_IN_GROUP: tl.constexpr, ACC3: tl.constexpr, PREFETCH: tl.constexpr,
    TILE_GROUPS: tl.constexpr = 1,
):
    rm, rn, rbn, rb, k_start, k_stop, x_ptrs, w_ptrs = _tile_start(
        x_ptr, w_ptr, M, N, K, TILES_PER_SPLIT, stride_xm, stride_xk, stride_wn, stride_wk, BLOCK_M, BLOCK_N, BLOCK_K)
    pid_k = tl.program_id(1)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if ACC3:  # CUDA cores: elementwise partial sums, one reduction over K after the loop
        acc3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K // 2), dtype=tl.float32)
    wb_next = _first_w(w_ptrs, rb, k_start, K, EVEN_K, PREFETCH)
    for k0 in range(k_start, k_stop, BLOCK_K):
        wb, xe, xo, wb_next = _tile_loads(x_ptrs, w_ptrs, wb_next, rb, k0, k_stop, K, stride_xk, stride_wk, BLOCK_K,
                                          EVEN_K, PREFETCH)
        lo = (wb & 0xF).to(tl.int32)  # [BLOCK_N, BLOCK_K/2]
        hi = (wb >> 4).to(tl.int32)
        if TILE_IN_GROUP:
            g = k0 // GROUP_SIZE
            s = tl.load(s_ptr + rbn * stride_sn + g * stride_sg)[:, None]
            if HAS_ZP:
                z = tl.load(z_ptr + rbn * stride_zn + g * stride_zg).to(tl.int32)[:, None]
            else:
                z = ZP_CONST
            we = (lo - z).to(tl.float32) * s  # float32, as the fake quantizer computes it
            wo = (hi - z).to(tl.float32) * s
        elif TILE_GROUPS > 1:
            # a K-tile TILE_GROUPS groups deep (a power-of-two group): one scale per (row, group),
            # broadcast over the group's bytes; groups past K re-read the last one (their x is masked)
            gi = tl.minimum(k0 // GROUP_SIZE + tl.arange(0, TILE_GROUPS), (K - 1) // GROUP_SIZE)
            s = _per_group(tl.load(s_ptr + rbn[:, None] * stride_sn + gi[None, :] * stride_sg), BLOCK_N, BLOCK_K,
                           TILE_GROUPS)
            if HAS_ZP:
                z = _per_group(tl.load(z_ptr + rbn[:, None] * stride_zn + gi[None, :] * stride_zg).to(tl.int32),
                               BLOCK_N, BLOCK_K, TILE_GROUPS)
            else:
                z = ZP_CONST
            we = (lo - z).to(tl.float32) * s
            wo = (hi - z).to(tl.float32) * s
        else:
            se, ze = _feature_qparams(s_ptr, z_ptr, g_ptr, rbn, k0 + 2 * rb, K, GROUP_SIZE, ZP_CONST, stride_sn,
                                      stride_sg, stride_zn, stride_zg, HAS_ZP, HAS_GIDX)
            so, zo = _feature_qparams(s_ptr, z_ptr, g_ptr, rbn, k0 + 2 * rb + 1, K, GROUP_SIZE, ZP_CONST, stride_sn,
                                      stride_sg, stride_zn, stride_zg, HAS_ZP, HAS_GIDX)
            we = (lo - ze).to(tl.float32) * se
            wo = (hi - zo).to(tl.float32) * so
        if DOT:
            if X_KIND == 0:
                acc = tl.dot(xe, tl.trans(we), acc, input_precision="ieee")
                acc = tl.dot(xo, tl.trans(wo), acc, input_precision="ieee")
            elif INTERP_BF16:
                # the interpreter's dot has no bf16 (numpy): bf16 x bf16 products are exact in float32,
                # so float32 operands holding the bf16-rounded values compute what the GPU's bf16 MMA does
                acc = tl.dot(xe.to(tl.float32), tl.trans(_round_bf16(we)), acc, input_precision="ieee")
                acc = tl.dot(xo.to(tl.float32), tl.trans(_round_bf16(wo)), acc, input_precision="ieee")
            else:
                acc = tl.dot(xe, tl.trans(we.to(xe.dtype)), acc)
                acc = tl.dot(xo, tl.trans(wo.to(xo.dtype)), acc)
        else:
            # products of two fp16/bf16 values are exact in float32; only the sums round
            we = _as_act(we, X_KIND, INTERP_BF16)
            wo = _as_act(wo, X_KIND, INTERP_BF16)
            prod = we[None, :, :] * xe.to(tl.float32)[:, None, :] + wo[None, :, :] * xo.to(tl.float32)[:, None, :]
            if ACC3:
                acc3 += prod
            else:
                acc += tl.sum(prod, axis=2)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += (BLOCK_K // 2) * stride_wk
    if ACC3:
        acc = tl.sum(acc3, axis=2)

    mask = (rm < M)[:, None] & (rn < N)[None, :]
    if not SPLIT:
        y = _finish(acc, rn[None, :], bias_ptr, N, HAS_BIAS, ACT, INTERP_BF16)
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :] * stride_yn, y.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(ws_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :], acc, mask=mask)


@triton.jit
def _splitk_reduce_kernel(
    ws_ptr, bias_ptr, y_ptr, M, N, stride_ym, stride_yn,
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, INTERP_BF16: tl.constexpr, BLOCK: tl.constexpr,
):
    """Sum the float32 partials of every split in split order, then bias, activation and the cast."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for sk in range(SPLIT_K):
        acc += tl.load(ws_ptr + sk * M * N + offs, mask=inside, other=0.0)
    m = offs // N
    n = offs % N
    y = _finish(acc, n, bias_ptr, N, HAS_BIAS, ACT, INTERP_BF16)
    tl.store(y_ptr + m * stride_ym + n * stride_yn, y.to(y_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _dequant_kernel(
    w_ptr, s_ptr, z_ptr, g_ptr, out_ptr, N, K, GROUP_SIZE, ZP_CONST,
    stride_wn, stride_wk, stride_sn, stride_sg, stride_zn, stride_zg, stride_on, stride_ok,
    HAS_ZP: tl.constexpr, HAS_GIDX: tl.constexpr, X_KIND: tl.constexpr, INTERP_BF16: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILE_IN_GROUP: tl.constexpr,
):
    """``out[N, K]`` = the dequantized weight in the activation dtype (what the fused kernel multiplies)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    rb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    mask = (rn < N)[:, None] & ((2 * rb) < K)[None, :]
    wb = tl.load(w_ptr + rn[:, None] * stride_wn + rb[None, :] * stride_wk, mask=mask, other=0)
    if TILE_IN_GROUP:  # one scale (and zero point) per row of the tile
        g = k0 // GROUP_SIZE
        se = tl.load(s_ptr + rn * stride_sn + g * stride_sg, mask=rn < N, other=0.0)[:, None]
        so = se
        if HAS_ZP:
            ze = tl.load(z_ptr + rn * stride_zn + g * stride_zg, mask=rn < N, other=0).to(tl.int32)[:, None]
        else:
            ze = ZP_CONST
        zo = ze
    else:
        rows = rn % N  # wrapped: rows past N read valid scales, and their stores are masked
        se, ze = _feature_qparams(s_ptr, z_ptr, g_ptr, rows, 2 * rb, K, GROUP_SIZE, ZP_CONST, stride_sn, stride_sg,
                                  stride_zn, stride_zg, HAS_ZP, HAS_GIDX)
        so, zo = _feature_qparams(s_ptr, z_ptr, g_ptr, rows, 2 * rb + 1, K, GROUP_SIZE, ZP_CONST, stride_sn,
                                  stride_sg, stride_zn, stride_zg, HAS_ZP, HAS_GIDX)
    we = _as_act(((wb & 0xF).to(tl.int32) - ze).to(tl.float32) * se, X_KIND, INTERP_BF16)
    wo = _as_act(((wb >> 4).to(tl.int32) - zo).to(tl.float32) * so, X_KIND, INTERP_BF16)
    # features 2b, 2b + 1 side by side: one contiguous row segment per tile row
    w = tl.interleave(we, wo).to(out_ptr.dtype.element_ty)
    rk = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + rn[:, None] * stride_on + rk[None, :] * stride_ok, w, mask=(rn < N)[:, None] & (rk < K)[None, :])


def dequantize_w4(
    w_packed: torch.Tensor, *, scale: torch.Tensor, group_size: int, k: int, dtype: torch.dtype,
    zero_point: torch.Tensor | None = None, g_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """The weight ``[N, k]`` in ``dtype``, dequantized on the device: :func:`quantization.lowering.int4.dequantize_int4`
    rounded to ``dtype``, bit for bit."""
    check_device(w_packed, "dequantize_w4")
    dev = w_packed.device
    wt = _weight(w_packed, scale, zero_point, g_idx, group_size, dev)
    n = w_packed.shape[0]
    out = torch.empty((n, k), device=dev, dtype=dtype)
    bn, bk = (32, 32) if INTERPRETED else (32, 128)
    tile_in_group = g_idx is None and group_size % bk == 0
    if not tile_in_group and g_idx is None and group_size >= 16 and group_size & (group_size - 1) == 0:
        bk, tile_in_group = group_size, True  # a smaller power-of-two group: tiles one group deep
    _dequant_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk))](
        *wt.pointer_args(), out, n, k, group_size, 8, *wt.stride_args(), out.stride(0), out.stride(1),
        HAS_ZP=wt.zp is not None, HAS_GIDX=wt.g_idx is not None, X_KIND=_X_KIND[dtype],
        INTERP_BF16=INTERPRETED and dtype == torch.bfloat16, BLOCK_N=bn, BLOCK_K=bk, TILE_IN_GROUP=tile_in_group,
        num_warps=4,
    )
    return out


def _weight(w_packed: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, g_idx: torch.Tensor | None,
            group_size: int, dev: torch.device) -> _Weight:
    return _Weight(
        w_packed, scale.to(device=dev, dtype=torch.float32),
        None if zero_point is None else zero_point.to(device=dev, dtype=torch.uint8),
        None if g_idx is None else g_idx.to(device=dev, dtype=torch.int32).contiguous(), group_size,
    )


def _launch_fused(x: torch.Tensor, wt: _Weight, bias: torch.Tensor | None, act: int, out: torch.Tensor,
                  c: W4Config) -> None:
    m, k = x.shape
    n = wt.packed.shape[0]
    if c.scaled_acc:
        from compress.quantization.lowering.kernels import w4a16_mma

        if c.block_m < 16 or not w4a16_mma.supports(x.dtype, wt.group_size, c.block_k, wt.g_idx is not None):
            raise CompressError(
                f"w4a16_gemm: scaled_acc tiles need block_m >= 16, fp16/bf16 activations, no g_idx and a block_k of "
                f"at least 32 dividing the group (got block {c.block_m}x{c.block_k}, {x.dtype}, group {wt.group_size})")
        w4a16_mma.launch(x, wt, bias, act, out, c)
        return
    if c.gemv:
        from compress.quantization.lowering.kernels import w4a16_gemv

        if not w4a16_gemv.supports(m, k, wt.group_size, c.block_m, c.block_k, wt.g_idx is not None):
            raise CompressError(
                f"w4a16_gemm: gemv tiles need block_m <= 4, K and the group multiples of 8, no g_idx and a "
                f"power-of-two block_k inside one group or spanning whole power-of-two groups (got block "
                f"{c.block_m}x{c.block_k}, K={k}, group {wt.group_size})")
        w4a16_gemv.launch(x, wt, bias, act, out, c)
        return
    if c.block_k % 2:
        raise CompressError(f"w4a16_gemm: block_k must be even (got {c.block_k})")
    if c.block_m >= 16 and c.block_k < 32:  # each of the two tl.dot calls reduces over block_k / 2 >= 16
        raise CompressError(f"w4a16_gemm: tensor-core tiles (block_m >= 16) need block_k >= 32 (got {c.block_k})")
    split, tiles_per_split = k_splits(k, c)
    ws = torch.empty((split, m, n), device=x.device, dtype=torch.float32) if split > 1 else out
    tile_in_group = wt.g_idx is None and wt.group_size % c.block_k == 0
    tile_groups = multi_group_tile(c.block_k, wt.group_size) if wt.g_idx is None and not tile_in_group else 1
    flags = {
        "HAS_ZP": wt.zp is not None, "HAS_GIDX": wt.g_idx is not None, "HAS_BIAS": bias is not None, "ACT": act,
        "X_KIND": _X_KIND[x.dtype], "INTERP_BF16": INTERPRETED and x.dtype == torch.bfloat16,
    }
    grid = (triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n), split)
    _w4a16_kernel[grid](
        x, *wt.pointer_args(), bias if bias is not None else wt.scale, out, ws,
        m, n, k, wt.group_size, 8, tiles_per_split,
        x.stride(0), x.stride(1), *wt.stride_args(), out.stride(0), out.stride(1),
        **flags, DOT=c.block_m >= 16, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, SPLIT=split > 1,
        EVEN_K=k % c.block_k == 0, TILE_IN_GROUP=tile_in_group, TILE_GROUPS=tile_groups,
        ACC3=c.acc3 and c.block_m < 16, PREFETCH=c.prefetch, num_warps=c.num_warps, num_stages=c.num_stages,
    )
    if split > 1:
        block = 1024 if not INTERPRETED else 256
        _splitk_reduce_kernel[(triton.cdiv(m * n, block),)](
            ws, bias if bias is not None else wt.scale, out, m, n, out.stride(0), out.stride(1),
            SPLIT_K=split, HAS_BIAS=bias is not None, ACT=act, INTERP_BF16=flags["INTERP_BF16"], BLOCK=block,
        )


def multi_group_tile(block_k: int, group_size: int) -> int:
    """How many whole groups a K-tile of ``block_k`` spans when it can take their scales as one
    ``[rows, groups]`` load (power-of-two group, tile a multiple of it), else 1 (per-feature scales)."""
    if group_size >= 2 and group_size & (group_size - 1) == 0 and block_k > group_size and block_k % group_size == 0:
        return block_k // group_size
    return 1


def _sm_count() -> int:
    return int(torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count)


def _candidates(m: int, n: int, k: int, group_size: int, tile_in_group_ok: bool,
                x_dtype: torch.dtype = torch.float16) -> list[W4Config]:
    """Launch configurations worth timing for this shape on CUDA."""
    sms = _sm_count()
    bks = [bk for bk in (64, 128, 256) if not tile_in_group_ok or group_size % bk == 0] or [64]
    out: list[W4Config] = []
    # (block_m, block_n, block_k, [(acc3, prefetch)]): CUDA cores for 1..4 rows, where a 16-row
    # MMA tile is mostly padding; tensor cores always (at 1..4 rows they won on an H100). Variants
    # that never won there at these sizes are not timed (halves the first-use tuning): CUDA-core
    # tiles accumulate elementwise and prefetch; 16/32-row MMA tiles prefetch.
    # Decode also gets K-tiles several groups deep (one [rows, groups] scale load per tile): a
    # tile one group deep is 64 bytes per row at g128, too little weight in flight per SM
    deep = [bk for bk in (256, 512) if tile_in_group_ok and multi_group_tile(bk, group_size) > 1 and k % bk == 0]
    tiles: list[tuple[int, int, int, list[tuple[bool, bool]]]] = []
    gemv = _gemv_candidates(m, n, k, group_size, tile_in_group_ok, sms)
    if m <= 4 and not gemv:
        # the dequantizing CUDA-core tiles only where the gemv kernel cannot run (act_order, K not a
        # multiple of 8): on an H200 at LLaMA-7B decode shapes the tensor-core tiles beat them at every
        # shape, and each candidate costs a compile at first use
        bm = triton.next_power_of_2(m)
        tiles += [(bm, bn, bk, [(True, True)]) for bn in (32, 64, 128) for bk in bks + deep if bm * bn * bk <= 16384]
    bm = max(16, min(triton.next_power_of_2(m), 128))
    mma = [(False, True)] if bm <= 32 else [(False, False), (False, True)]
    tiles += [(bm, bn, bk, mma) for bn in (32, 64, 128) for bk in bks if bk <= 128]
    if bm == 16:
        tiles += [(bm, bn, bk, mma) for bn in (32, 64) for bk in deep if bk == 256]
    out += _scaled_acc_candidates(m, n, k, group_size, tile_in_group_ok, x_dtype, sms)
    out += gemv
    for bm, bn, bk, variants in tiles:
        programs = triton.cdiv(m, bm) * triton.cdiv(n, bn)
        k_tiles = triton.cdiv(k, bk)
        for split in _splits(programs, k_tiles, sms):
            for acc3, prefetch in variants:
                out.append(W4Config(bm, bn, bk, num_warps=4 if bm * bn < 8192 else 8, num_stages=3, split_k=split,
                                    acc3=acc3, prefetch=prefetch))
    return out


def _splits(programs: int, k_tiles: int, sms: int) -> list[int]:
    """The K splits worth timing for ``programs`` output tiles of ``k_tiles`` K-tiles each."""
    out = []
    for split in (1, 2, 4, 8, 16):
        # splitting K pays while the programs do not yet fill the SMs a few times over; each
        # split keeps at least two K-tiles
        if split > 1 and (k_tiles < 2 * split or programs * split > 4 * sms):
            continue
        if programs * split < sms and split < 16 and k_tiles >= 4 * split:
            continue  # too few programs for the SMs while a larger split exists
        out.append(split)
    return out


def _scaled_acc_candidates(m: int, n: int, k: int, group_size: int, tile_in_group_ok: bool, x_dtype: torch.dtype,
                           sms: int) -> list[W4Config]:
    """Tensor-core tiles on the codes (kernels/w4a16_mma.py) for decode and small prefill (M < 32)."""
    from compress.quantization.lowering.kernels import w4a16_mma

    if m >= DEQUANT_MIN_M or not tile_in_group_ok:
        return []
    bm = 16 if m <= 16 else 32
    out = []
    for bn in (32, 64, 128):
        for bk in (64, 128):
            if not w4a16_mma.supports(x_dtype, group_size, bk, False):
                continue
            programs = triton.cdiv(m, bm) * triton.cdiv(n, bn)
            for split in _splits(programs, triton.cdiv(k, bk), sms):
                # software pipelining (stages) or a register prefetch of the next tile: which keeps
                # more weight bytes in flight depends on the tile, so both are timed
                for stages, prefetch in ((4, False), (2, True)):
                    out.append(W4Config(bm, bn, bk, num_warps=4, num_stages=stages, split_k=split, prefetch=prefetch,
                                        scaled_acc=True))
    return out


def _gemv_candidates(m: int, n: int, k: int, group_size: int, tile_in_group_ok: bool, sms: int) -> list[W4Config]:
    """CUDA-core tiles on the codes (kernels/w4a16_gemv.py) for decode (M <= 4)."""
    from compress.quantization.lowering.kernels import w4a16_gemv

    if m > 4 or not tile_in_group_ok:
        return []
    bm = triton.next_power_of_2(m)
    out = []
    for bn in (32, 64, 128, 256) if bm > 1 else (64, 128, 256):
        for bk in (128, 256, 512):
            if not w4a16_gemv.supports(m, k, group_size, bm, bk, False):
                continue
            # 32-bit words per thread: 4 warps, or 8 where a tile would hold more than 16 words per
            # thread; above that (x the rows' partial sums) the sm90 compile neared 255 registers
            warps = 4 if bn * bk // 8 <= 16 * 128 else 8
            if bn * bk // 8 > 16 * 32 * warps or bm * bn * bk // 8 > 32 * 32 * warps:
                continue
            programs = triton.cdiv(m, bm) * triton.cdiv(n, bn)
            k_tiles = triton.cdiv(k, bk)
            # enough programs for 2-8 per SM: each keeps only its own tile's weight bytes in flight,
            # and a memory-bound GEMV needs tens of KB in flight per SM
            splits = [sp for sp in (1, 2, 4, 8, 16, 32) if sp <= k_tiles and sms <= programs * sp <= 8 * sms]
            for split in splits[-2:] or [max(1, min(k_tiles, -(-sms // programs)))]:
                # a split of one tile has nothing to prefetch
                for prefetch in (False, True) if triton.cdiv(k_tiles, split) > 1 else (False,):
                    out.append(W4Config(bm, bn, bk, num_warps=warps, num_stages=1, split_k=split, prefetch=prefetch,
                                        gemv=True))
    return out


def copies_beyond_l2(nbytes: int, l2_bytes: int) -> int:
    """How many copies of ``nbytes`` together exceed twice an L2 cache of ``l2_bytes`` (1 to 32)."""
    return max(1, min(32, -(-2 * l2_bytes // max(nbytes, 1))))


def hbm_copies(wt: _Weight) -> list[_Weight]:
    """The weight and enough copies that together they exceed twice the L2 cache (CUDA; else just the
    weight). A tuner timing one weight over and over times it from L2 (an H200's 50 MB holds any
    LLaMA-7B layer in int4), where a model's decode reads every layer from device memory: on an H200
    the L2-hot choice put our kernel before tinygemm at one token on 4096x4096, which from device
    memory ran 0.0098 ms against tinygemm's 0.0074 (benchmarks/RESULTS.md, ``w4a16``)."""
    if wt.packed.device.type != "cuda":
        return [wt]
    nbytes = wt.packed.numel() + 4 * wt.scale.numel() + (wt.zp.numel() if wt.zp is not None else 0)
    n = copies_beyond_l2(nbytes, int(torch.cuda.get_device_properties(wt.packed.device).L2_cache_size))
    return [wt] + [_Weight(wt.packed.clone(), wt.scale.clone(), None if wt.zp is None else wt.zp.clone(), wt.g_idx,
                           wt.group_size) for _ in range(n - 1)]


_TUNED: dict[tuple[Any, ...], W4Config] = {}


def tune_key(m: int, n: int, k: int, group_size: int, dtype: torch.dtype, *, has_zp: bool = False,
             has_gidx: bool = False, has_bias: bool = False, act: int = 0) -> tuple[Any, ...]:
    """What the tuner keys its choice on (``_TUNED``): M bucket, shape, group size, dtype and flags."""
    return (m_bucket(m), n, k, group_size, dtype, has_zp, has_gidx, has_bias, act)


def _pick(x: torch.Tensor, wt: _Weight, bias: torch.Tensor | None, act: int, out: torch.Tensor,
          timer: Any = None) -> W4Config:
    """The fastest candidate for this shape and flag set, timed once (``timer``: triton's
    do_bench_cudagraph, CUDA-graph replays) and cached."""
    m, k = x.shape
    n = wt.packed.shape[0]
    key = tune_key(m, n, k, wt.group_size, x.dtype, has_zp=wt.zp is not None, has_gidx=wt.g_idx is not None,
                   has_bias=bias is not None, act=act)
    if key in _TUNED:
        return _TUNED[key]
    if timer is None:
        from triton.testing import do_bench_cudagraph

        def timer(fn: Any) -> float:
            # replayed as a CUDA graph: a decode-sized launch runs for microseconds, about as long as
            # launching it, so eager timings ranked candidates by host overhead (measured on an H200:
            # the eager pick ran 1.5x slower than the best candidate in graph replays)
            return float(do_bench_cudagraph(fn, rep=20, return_mode="median"))

    cands = _candidates(m, n, k, wt.group_size, wt.g_idx is None, x.dtype)
    copies = hbm_copies(wt)
    # first use of a shape: compiling and timing the candidates takes seconds, once per process
    log.info("w4a16_gemm: tuning %d launch configurations for M<=%d, N=%d, K=%d", len(cands), key[0], n, k)
    best: tuple[float, W4Config] | None = None
    failed: Exception | None = None
    for c in cands:
        try:
            def run(c: W4Config = c) -> None:
                for w in copies:
                    _launch_fused(x, w, bias, act, out, c)

            t = float(timer(run)) / len(copies)
        except Exception as exc:  # a tile this device cannot compile (shared memory, registers): skip it
            log.debug("w4a16_gemm: %s skipped: %s", c, exc)
            failed = exc
            continue
        if best is None or t < best[0]:
            best = (t, c)
    if best is None:
        raise CompressError(f"w4a16_gemm: no kernel configuration ran for M={m}, N={n}, K={k} "
                            f"(last error: {type(failed).__name__}: {failed})")
    _TUNED[key] = best[1]
    return best[1]


def w4a16_gemm(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    *,
    scale: torch.Tensor,
    group_size: int,
    zero_point: torch.Tensor | None = None,
    g_idx: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    config: W4Config | GemmConfig | None = None,
    path: str = "auto",
) -> torch.Tensor:
    """``act(x @ W^T + bias)`` in ``x``'s dtype, ``W`` dequantized from int4 inside the kernel.

    ``x`` float16/bfloat16/float32 ``[M, K]`` (any strides); ``w_packed`` uint8 ``[N, K/2]``;
    ``scale`` float32 ``[N, ceil(K / group_size)]``; ``zero_point`` uint8 ``[N, G]`` or None (symmetric: 8);
    ``g_idx`` int32 ``[K]`` or None (``k // group_size``); ``bias`` ``N`` floats or None.
    ``path``: ``fused`` (one kernel, weight dequantized in registers), ``dequant`` (dequantize once,
    then cuBLAS) or ``auto`` (dequant from :data:`DEQUANT_MIN_M` rows on CUDA). ``config`` fixes the
    fused kernel's launch (default: tuned on CUDA).
    """
    check_device(x, "w4a16_gemm")
    if x.dtype not in _X_KIND:
        raise CompressError(f"w4a16_gemm: activations must be float16, bfloat16 or float32 (got {x.dtype})")
    if w_packed.dtype != torch.uint8 or w_packed.dim() != 2:
        raise CompressError(f"w4a16_gemm: w_packed must be 2-D uint8 (got {w_packed.dtype}, {w_packed.dim()}-D)")
    if x.dim() != 2 or x.shape[1] % 2 or w_packed.shape[1] * 2 != x.shape[1]:
        raise CompressError(
            f"w4a16_gemm: shapes {tuple(x.shape)} and packed {tuple(w_packed.shape)} do not make [M,K] x [N,K/2] (K even)"
        )
    if activation not in _ACT_CODE:
        raise CompressError(f"w4a16_gemm: activation '{activation}' unknown; valid: {', '.join(ACTIVATIONS)}")
    if path not in PATHS:
        raise CompressError(f"w4a16_gemm: path '{path}' unknown; valid: {', '.join(PATHS)}")
    m, k = x.shape
    n = w_packed.shape[0]
    if group_size < 2:
        raise CompressError(f"w4a16_gemm: group_size must be >= 2 (got {group_size})")
    # a K not divisible by the group size has a shorter last group with its own scale
    groups = -(-k // group_size) if g_idx is None else scale.shape[-1]
    if scale.shape != (n, groups):
        raise CompressError(f"w4a16_gemm: scale has shape {tuple(scale.shape)}, expected {(n, groups)}")
    if zero_point is not None and zero_point.shape != scale.shape:
        raise CompressError(f"w4a16_gemm: zero_point has shape {tuple(zero_point.shape)}, expected {tuple(scale.shape)}")
    if g_idx is not None and g_idx.numel() != k:
        raise CompressError(f"w4a16_gemm: g_idx has {g_idx.numel()} entries, expected K={k}")
    dev = x.device
    if m == 0 or n == 0:
        return torch.empty((m, n), device=dev, dtype=x.dtype)
    if path == "auto":
        path = "dequant" if config is None and not INTERPRETED and m >= DEQUANT_MIN_M else "fused"
    if path == "dequant":
        w = dequantize_w4(w_packed, scale=scale, group_size=group_size, k=k, dtype=x.dtype, zero_point=zero_point,
                          g_idx=g_idx)
        y = F.linear(x, w, None if bias is None else bias.to(device=dev, dtype=x.dtype).reshape(-1))
        if activation == "relu":
            y = torch.relu_(y)
        elif activation == "gelu":
            y = F.gelu(y)
        return y
    out = torch.empty((m, n), device=dev, dtype=x.dtype)
    wt = _weight(w_packed, scale, zero_point, g_idx, group_size, dev)
    b = None if bias is None else bias.reshape(-1).to(device=dev, dtype=torch.float32).contiguous()
    act = _ACT_CODE[activation]
    if config is not None and not isinstance(config, W4Config):
        config = W4Config(config.block_m, config.block_n, config.block_k, num_warps=config.num_warps,
                          num_stages=config.num_stages)
    if config is None:
        if INTERPRETED:  # few, large programs: what costs time in the interpreter is the program count
            config = W4Config(min(triton.next_power_of_2(m), 4), 32, 64) if m <= 4 else W4Config(16, 32, 64)
        else:
            config = _pick(x, wt, b, act, out)
    _launch_fused(x, wt, b, act, out, config)
    return out
