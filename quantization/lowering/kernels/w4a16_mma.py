# mypy: disable-error-code="no-untyped-def"
# (Triton kernels annotate only their constexpr parameters; the rest are typed by the JIT.)
"""W4A16 on tensor cores with the group scale applied to the accumulator (fp16/bf16 activations).

``Y = act(X @ W^T + bias)`` with ``W[n, k] = (u[n, k] - z[n, g]) * s[n, g]`` as in
:mod:`quantization.lowering.kernels.w4a16`, computed per K-tile (inside one group) as
``acc += s[n, g] * (X_tile @ (u - z)_tile^T)``. The integers ``u - z`` (-15..15) are exact in
fp16 and bf16, so the MMA multiplies the codes themselves and the scale meets the float32 sum once
per tile and output, not once per weight. The codes become floats without a conversion
instruction (int-to-float converts run at a quarter of the rate of other arithmetic on these
GPUs, and a decode GEMV needs two per weight byte): a small integer ``c`` OR-ed into the bits of
1024 (fp16 ``0x6400``) or 128 (bf16 ``0x4300``) is the number ``1024 + c`` / ``128 + c`` exactly,
and subtracting a constant in the same dtype leaves ``v - z`` exactly (Marlin's trick; the zero
point enters as an integer add, ``c = v + 16 - z``).

Numerics: the product is of the exact int4 weight (float32 scale, no rounding of the weight to
the activation dtype, unlike the dequantizing kernels, which reproduce the fp16 fake-quant weight
bit for bit); only the float32 sums' order and the output's rounding differ from fp64.

Split K (decode: a 4096-wide layer has too few column tiles for 132 SMs) runs in one kernel:
each split stores its float32 partial tile, then counts itself in on the tile's counter; the last
to arrive adds the partials in split order (deterministic), re-zeroes the counter (CUDA-graph
replays) and runs the epilogue. Only for K-tiles inside one group (``group_size % BLOCK_K == 0``)
and without act_order's g_idx; the tuner in :mod:`~quantization.lowering.kernels.w4a16` times it
beside the dequantizing kernel and keeps the faster per shape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from compress.quantization.lowering.kernels.runtime import interpret_mode
from compress.quantization.lowering.kernels.w4_common import (
    W4Config,
    _first_w,
    _store_tile,
    _tile_loads,
    _tile_start,
    _Weight,
    one_kernel_split,
)

INTERPRETED = interpret_mode()


@triton.jit
def _codes_minus_zp(v, z, HAS_ZP: tl.constexpr, X_KIND: tl.constexpr, INTERP_BF16: tl.constexpr):
    """uint8 nibbles ``v`` (0..15) minus their row's zero point (``z``: ``[rows, 1]`` int16, or the
    constant 8), as exact small integers in the activation dtype.

    ``c = v + 16 - z`` (1..31) goes into the low mantissa bits of ``base`` (1024 in fp16, 128 in
    bf16: both hold every integer up to base + 127 exactly), and ``base + 16`` is subtracted in that
    dtype: no conversion instruction, and the zero point stays an integer add, which the compiler
    cannot turn into per-weight conversions."""
    # the constants are literals: a float variable would be float32 and promote the codes to it
    if HAS_ZP:
        c = v.to(tl.int16) + (16 - z)
    else:
        c = v.to(tl.int16)
    if INTERP_BF16:  # the interpreter has no bf16 arithmetic: the same integers, through float32
        if HAS_ZP:
            r = c.to(tl.float32) - 16.0
        else:
            r = c.to(tl.float32) - 8.0
    elif X_KIND == 1:
        if HAS_ZP:
            r = (c | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1040.0
        else:
            r = (c | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1032.0
    else:
        if HAS_ZP:
            r = (c | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True) - 144.0
        else:
            r = (c | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True) - 136.0
    return r


@triton.jit
def _w4a16_mma_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, ws_ptr, cnt_ptr,
    M, N, K, GROUP_SIZE, TILES_PER_SPLIT,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sg, stride_zn, stride_zg,
    stride_ym, stride_yn,
    HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, X_KIND: tl.constexpr,
    INTERP_BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, EVEN_K: tl.constexpr, PREFETCH: tl.constexpr,
):
    tile = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm, rn, rbn, rb, k_start, k_stop, x_ptrs, w_ptrs = _tile_start(
        x_ptr, w_ptr, M, N, K, TILES_PER_SPLIT, stride_xm, stride_xk, stride_wn, stride_wk, BLOCK_M, BLOCK_N, BLOCK_K)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    wb_next = _first_w(w_ptrs, rb, k_start, K, EVEN_K, PREFETCH)  # PREFETCH: the next tile in flight meanwhile
    for k0 in range(k_start, k_stop, BLOCK_K):
        wb, xe, xo, wb_next = _tile_loads(x_ptrs, w_ptrs, wb_next, rb, k0, k_stop, K, stride_xk, stride_wk, BLOCK_K,
                                          EVEN_K, PREFETCH)
        g = k0 // GROUP_SIZE
        s = tl.load(s_ptr + rbn * stride_sn + g * stride_sg)
        if HAS_ZP:
            z = tl.load(z_ptr + rbn * stride_zn + g * stride_zg).to(tl.int16)[:, None]
        else:
            z = 8
        we = _codes_minus_zp(wb & 0xF, z, HAS_ZP, X_KIND, INTERP_BF16)
        wo = _codes_minus_zp(wb >> 4, z, HAS_ZP, X_KIND, INTERP_BF16)
        if INTERP_BF16:
            part = tl.dot(xe.to(tl.float32), tl.trans(we), input_precision="ieee")
            part = tl.dot(xo.to(tl.float32), tl.trans(wo), part, input_precision="ieee")
        else:
            part = tl.dot(xe, tl.trans(we))
            part = tl.dot(xo, tl.trans(wo), part)
        acc += part * s[None, :]
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += (BLOCK_K // 2) * stride_wk

    _store_tile(acc, rm, rn, M, N, tile, pid_k, y_ptr, stride_ym, stride_yn, ws_ptr, cnt_ptr, bias_ptr, HAS_BIAS, ACT,
                INTERP_BF16, SPLIT)

_X_KIND = {torch.float16: 1, torch.bfloat16: 2}


def supports(x_dtype: torch.dtype, group_size: int, block_k: int, has_g_idx: bool) -> bool:
    """Whether this kernel can run a weight: fp16/bf16 activations, K-tiles inside one group."""
    return x_dtype in _X_KIND and not has_g_idx and block_k >= 32 and group_size % block_k == 0


def launch(x: torch.Tensor, wt: _Weight, bias: torch.Tensor | None, act: int, out: torch.Tensor, c: W4Config) -> None:
    """Run the kernel with launch configuration ``c`` (``c.block_m >= 16``; see :func:`supports`)."""
    m, k = x.shape
    n = wt.packed.shape[0]
    tiles, split, tiles_per_split, ws, cnt = one_kernel_split(m, n, k, c, out)
    z = wt.zp if wt.zp is not None else wt.scale
    _w4a16_mma_kernel[(tiles, split)](
        x, wt.packed, wt.scale, z, bias if bias is not None else wt.scale, out, ws, cnt,
        m, n, k, wt.group_size, tiles_per_split,
        x.stride(0), x.stride(1), wt.packed.stride(0), wt.packed.stride(1), wt.scale.stride(0), wt.scale.stride(1),
        z.stride(0), z.stride(1), out.stride(0), out.stride(1),
        HAS_ZP=wt.zp is not None, HAS_BIAS=bias is not None, ACT=act, X_KIND=_X_KIND[x.dtype],
        INTERP_BF16=INTERPRETED and x.dtype == torch.bfloat16, BLOCK_M=c.block_m, BLOCK_N=c.block_n,
        BLOCK_K=c.block_k, SPLIT=split, EVEN_K=k % c.block_k == 0, PREFETCH=c.prefetch,
        num_warps=c.num_warps, num_stages=c.num_stages,
    )
