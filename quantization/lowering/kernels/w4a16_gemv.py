# mypy: disable-error-code="no-untyped-def"
# (Triton kernels annotate only their constexpr parameters; the rest are typed by the JIT.)
"""W4A16 for decode (M = 1..4 rows) on the CUDA cores, on the codes: the group scale meets each
row's per-group sum, not each weight.

``Y = act(X @ W^T + bias)`` with ``W[n, k] = (u[n, k] - z[n, g]) * s[n, g]`` as in
:mod:`quantization.lowering.kernels.w4a16`. A one-token product is bound by reading the weight; a
16-row tensor-core tile for one row pays the conversion of every code to a float and spends 15/16
of the MMA on padding. Here each thread reads the packed weight as 32-bit words (eight codes, 128-bit
vector loads of four words), and per code runs two instructions plus one FMA per row of X (the sm90
SASS: a LOP3, an FADD, an FFMA):

- ``(w & (0xF << 4p)) | 0x4B000000`` is the float32 ``2^23 + u * 16^p`` exactly (no conversion
  instruction; int-to-float converts run at a quarter rate). Codes 0-3 of a word sit at positions
  p = 0-3 of ``w``, codes 4-7 at p = 1-4 of ``w >> 12`` (one shift per word: a lone code at position 0
  of a shifted word compiles to a shift and a bit-field extract instead of one LOP3).
- Subtracting ``2^23 + z * 16^p`` (computed once per tile) leaves ``(u - z) * 16^p`` exactly
  (integers below 2^24).
- The FMA multiplies it by ``x * 16^-p`` (exact: a power-of-two scaling), so the product is
  ``(u - z) * x`` exactly in float32 and only the sums round.

Per row and group the float32 sum of those products is multiplied by the group's scale ``s``, the
scale applied once per group and output as in the tensor-core kernel (kernels/w4a16_mma.py), and
the product is of the exact int4 weight (float32 scales, not rounded to fp16). A K-tile holds one
group or several whole groups. Split K (a 4096-wide layer has few column tiles for 132 SMs) sums in
the same kernel in split order (:func:`~quantization.lowering.kernels.w4_common._store_tile`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from compress.quantization.lowering.kernels.runtime import interpret_mode
from compress.quantization.lowering.kernels.w4_common import W4Config, _store_tile, _Weight, one_kernel_split

INTERPRETED = interpret_mode()


@triton.jit
def _spread(v, BLOCK_N: tl.constexpr, TG: tl.constexpr, GW: tl.constexpr):
    """``[BLOCK_N, TG]`` per-group values repeated over each group's ``GW`` words: ``[BLOCK_N, TG * GW]``."""
    return tl.reshape(tl.broadcast_to(v[:, :, None], (BLOCK_N, TG, GW)), (BLOCK_N, TG * GW))


@triton.jit
def _group_sums(part, s, BLOCK_N: tl.constexpr, TG: tl.constexpr, GW: tl.constexpr):
    """Per row: the words' sums ``part`` ``[BLOCK_N, TG * GW]`` added per group, times the group's
    scale ``s`` (``[BLOCK_N]`` when TG is 1, else ``[BLOCK_N, TG]``), added over the groups."""
    if TG == 1:
        r = tl.sum(part, axis=1) * s
    else:
        r = tl.sum(tl.sum(tl.reshape(part, (BLOCK_N, TG, GW)), axis=2) * s, axis=1)
    return r


@triton.jit
def _w4a16_gemv_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, ws_ptr, cnt_ptr,
    M, N, K, TILES_PER_SPLIT,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sg, stride_zn, stride_zg,
    stride_ym, stride_yn,
    HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, INTERP_BF16: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, EVEN_K: tl.constexpr, PREFETCH: tl.constexpr,
):
    BW: tl.constexpr = BLOCK_K // 8  # 32-bit words per row of a K-tile
    TG: tl.constexpr = BLOCK_K // GROUP if BLOCK_K > GROUP else 1  # groups per K-tile
    GW: tl.constexpr = BW // TG  # words per group inside the tile
    num_pid_n = tl.cdiv(N, BLOCK_N)
    tile = tl.program_id(0)
    pid_m = tile // num_pid_n
    pid_n = tile % num_pid_n
    pid_k = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ram = rm % M  # wrapped: rows and columns past the ends re-read valid memory, their stores are masked
    rbn = tl.max_contiguous(tl.multiple_of(rn % N, BLOCK_N), BLOCK_N)
    rw = tl.arange(0, BW)
    k_start = pid_k * TILES_PER_SPLIT * BLOCK_K
    k_stop = tl.minimum(k_start + TILES_PER_SPLIT * BLOCK_K, K)
    w_ptrs = w_ptr + rbn[:, None] * stride_wn + (k_start // 8 + rw)[None, :] * stride_wk
    x_ptrs = x_ptr + ram[:, None] * stride_xm + (k_start + 8 * rw)[None, :] * stride_xk  # feature 8w + j: + j

    if PREFETCH:  # the next tile's words are in flight while this one is summed
        if EVEN_K:
            w_next = tl.load(w_ptrs)
        else:
            w_next = tl.load(w_ptrs, mask=(8 * rw < K - k_start)[None, :], other=0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):
        in_k = 8 * rw < K - k0  # K is a multiple of 8: a word is inside K when its first feature is
        if PREFETCH:
            w = w_next
            nxt = k0 + BLOCK_K
            if EVEN_K:
                more = tl.full((1, BW), 1, tl.int1) & (nxt < k_stop)  # one scalar mask keeps 16-byte loads
                w_next = tl.load(w_ptrs + BW * stride_wk, mask=more, other=0)
            else:
                w_next = tl.load(w_ptrs + BW * stride_wk, mask=(8 * rw < k_stop - nxt)[None, :], other=0)
        elif EVEN_K:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=in_k[None, :], other=0)
        w_hi = w >> 12  # codes 4..7 at bits 4..19: one masked OR each, like codes 1..3
        g0 = k0 // GROUP
        if TG == 1:
            s = tl.load(s_ptr + rbn * stride_sn + g0 * stride_sg)
            if HAS_ZP:
                zw = tl.load(z_ptr + rbn * stride_zn + g0 * stride_zg).to(tl.float32)[:, None]
            else:
                zw = 8.0
        else:  # groups past K (a shorter last tile) read group 0: their words and x are masked to 0
            gi = g0 + tl.arange(0, TG)
            gi = tl.where(gi * GROUP < K, gi, 0)
            s = tl.load(s_ptr + rbn[:, None] * stride_sn + gi[None, :] * stride_sg)
            if HAS_ZP:
                zw = _spread(tl.load(z_ptr + rbn[:, None] * stride_zn + gi[None, :] * stride_zg).to(tl.float32),
                             BLOCK_N, TG, GW)
            else:
                zw = 8.0
        # 2^23 + z * 16^p for the five code positions p in use, once per tile (not per code)
        zf0 = 8388608.0 + zw
        zf1 = 8388608.0 + zw * 16.0
        zf2 = 8388608.0 + zw * 256.0
        zf3 = 8388608.0 + zw * 4096.0
        zf4 = 8388608.0 + zw * 65536.0
        if BLOCK_M == 1:
            part = tl.zeros((BLOCK_N, BW), dtype=tl.float32)
        else:
            part = tl.zeros((BLOCK_M, BLOCK_N, BW), dtype=tl.float32)
        for j in tl.static_range(8):
            # code j sits at nibble position p: j of w for j < 4, j - 3 of w >> 12 (a lone code at
            # position 0 of a shifted word compiles to a shift and a bit-field extract, not one OR)
            if j < 4:
                word = w
                p = j
            else:
                word = w_hi
                p = j - 3
            if p == 0:
                zf = zf0
            elif p == 1:
                zf = zf1
            elif p == 2:
                zf = zf2
            elif p == 3:
                zf = zf3
            else:
                zf = zf4
            # the bits of 2^23 + u * 16^p (u * 16^p < 2^20), exact; minus 2^23 + z * 16^p: (u - z) * 16^p, exact
            code = ((word & (0xF << (4 * p))) | 0x4B000000).to(tl.float32, bitcast=True) - zf
            if EVEN_K:
                xj = tl.load(x_ptrs + j * stride_xk)
            else:
                xj = tl.load(x_ptrs + j * stride_xk, mask=in_k[None, :], other=0.0)
            xj = xj.to(tl.float32) * (1.0 / (1 << (4 * p)))  # a power of two: exact, as is each product
            if BLOCK_M == 1:
                part += code * xj
            else:
                part += code[None, :, :] * xj[:, None, :]
        if BLOCK_M == 1:
            acc += _group_sums(part, s, BLOCK_N, TG, GW)[None, :]
        elif TG == 1:
            acc += tl.sum(part, axis=2) * s[None, :]
        else:
            acc += tl.sum(tl.sum(tl.reshape(part, (BLOCK_M, BLOCK_N, TG, GW)), axis=3) * s[None, :, :], axis=2)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BW * stride_wk

    _store_tile(acc, rm, rn, M, N, tile, pid_k, y_ptr, stride_ym, stride_yn, ws_ptr, cnt_ptr, bias_ptr, HAS_BIAS, ACT,
                INTERP_BF16, SPLIT)


def supports(m: int, k: int, group_size: int, block_m: int, block_k: int, has_g_idx: bool) -> bool:
    """Whether this kernel can run a weight: at most 4 rows per tile, K and the group multiples of 8
    (a word's eight codes share one group), and K-tiles of one group or of whole power-of-two groups."""
    if has_g_idx or block_m > 4 or k % 8 or group_size % 8 or block_k < 8 or block_k & (block_k - 1):
        return False
    if group_size % block_k == 0:
        return True
    return block_k % group_size == 0 and group_size & (group_size - 1) == 0


def launch(x: torch.Tensor, wt: _Weight, bias: torch.Tensor | None, act: int, out: torch.Tensor, c: W4Config) -> None:
    """Run the kernel with launch configuration ``c`` (see :func:`supports`)."""
    m, k = x.shape
    n = wt.packed.shape[0]
    words = wt.packed.view(torch.int32) if wt.packed.stride(1) == 1 else wt.packed.contiguous().view(torch.int32)
    tiles, split, tiles_per_split, ws, cnt = one_kernel_split(m, n, k, c, out)
    z = wt.zp if wt.zp is not None else wt.scale
    _w4a16_gemv_kernel[(tiles, split)](
        x, words, wt.scale, z, bias if bias is not None else wt.scale, out, ws, cnt,
        m, n, k, tiles_per_split,
        x.stride(0), x.stride(1), words.stride(0), words.stride(1), wt.scale.stride(0), wt.scale.stride(1),
        z.stride(0), z.stride(1), out.stride(0), out.stride(1),
        HAS_ZP=wt.zp is not None, HAS_BIAS=bias is not None, ACT=act,
        INTERP_BF16=INTERPRETED and x.dtype == torch.bfloat16, GROUP=wt.group_size, BLOCK_M=c.block_m,
        BLOCK_N=c.block_n, BLOCK_K=c.block_k, SPLIT=split, EVEN_K=k % c.block_k == 0, PREFETCH=c.prefetch,
        num_warps=c.num_warps, num_stages=c.num_stages,
    )
