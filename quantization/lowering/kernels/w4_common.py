# mypy: disable-error-code="no-untyped-def"
# (Triton kernels annotate only their constexpr parameters; the rest are typed by the JIT.)
"""What the two W4A16 kernel modules share (kernels/w4a16.py, the dequantizing kernels and the tuner;
kernels/w4a16_mma.py, the tensor-core kernel on the codes; kernels/w4a16_gemv.py, the decode kernel on the
codes): the launch configuration, the weight's
device tensors, and the epilogue."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from compress.quantization.lowering.kernels.gemm import GemmConfig, bias_activation, split_workspace


@dataclass(frozen=True)
class W4Config(GemmConfig):
    """One launch configuration of the fused kernel (a GemmConfig's tile; ``group_m`` unused).
    ``block_m < 16`` sums on CUDA cores (decode); ``block_m >= 16`` uses ``tl.dot``. ``split_k``
    programs share each output tile's K range."""

    acc3: bool = False  # CUDA cores: accumulate elementwise, reduce over K once at the end
    prefetch: bool = False  # load the next weight tile before dequantizing this one
    # tensor cores on the codes, group scale on the accumulator (kernels/w4a16_mma.py; fp16/bf16,
    # K-tiles inside one group): no per-weight conversion or scale multiply
    scaled_acc: bool = False
    # decode (block_m <= 4) on CUDA cores on the codes, the group scale on each row's group sum
    # (kernels/w4a16_gemv.py): two instructions and one FMA per row for each code
    gemv: bool = False


@triton.jit
def _round_bf16(v):
    """float32 -> the nearest bf16 value (ties to even), still as float32 (finite inputs).

    The GPU's float32 -> bf16 cast rounds this way; the interpreter's truncates, so its bf16 path
    rounds here first and then casts exactly."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _finish(y, rn, bias_ptr, N, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, INTERP_BF16: tl.constexpr):
    """Bias and activation on float32 ``y`` (columns ``rn``): what is stored, before its cast."""
    y = bias_activation(y, rn, N, bias_ptr, HAS_BIAS, ACT)
    if INTERP_BF16:
        y = _round_bf16(y)  # exact in bf16 now: the interpreter's truncating cast keeps it
    return y



@triton.jit
def _store_tile(acc, rm, rn, M, N, tile, pid_k, y_ptr, stride_ym, stride_yn, ws_ptr, cnt_ptr, bias_ptr,
                HAS_BIAS: tl.constexpr, ACT: tl.constexpr, INTERP_BF16: tl.constexpr, SPLIT: tl.constexpr):
    """Store float32 tile ``acc`` (rows ``rm``, columns ``rn``) with bias and activation; with ``SPLIT``
    (the number of K splits) above 1, as split ``pid_k``'s partial of output tile ``tile`` (workspace
    ``ws_ptr``, counters ``cnt_ptr``).

    Split K in one kernel: each split stores its partial, then counts itself in on the tile's counter;
    the last to arrive adds the partials in split order (deterministic), re-zeroes the counter (CUDA-graph
    replays stay right) and runs the epilogue. The split count is a compile-time constant so that the
    last program's reads of the partials are unrolled and all in flight at once: a loop over a runtime
    count issued them a few at a time, one L2 round trip after another."""
    inside = (rm < M)[:, None] & (rn < N)[None, :]
    y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :] * stride_yn
    if SPLIT > 1:
        ws_tile = ws_ptr + rm[:, None] * N + rn[None, :]
        tl.store(ws_tile + pid_k * M * N, acc, mask=inside)
        tl.debug_barrier()  # every thread's partials are stored before the arrival is counted
        if tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel") == SPLIT - 1:
            total = tl.zeros(acc.shape, dtype=tl.float32)
            for sk in tl.static_range(SPLIT):  # split order: the sum does not depend on arrival order
                # .cg: read from L2, where the other programs' stores are, not a stale L1 line
                total += tl.load(ws_tile + sk * M * N, mask=inside, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed")
            y = _finish(total, rn[None, :], bias_ptr, N, HAS_BIAS, ACT, INTERP_BF16)
            tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=inside)
    else:
        y = _finish(acc, rn[None, :], bias_ptr, N, HAS_BIAS, ACT, INTERP_BF16)
        tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=inside)

@triton.jit
def _tile_start(x_ptr, w_ptr, M, N, K, TILES_PER_SPLIT, stride_xm, stride_xk, stride_wn, stride_wk,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's output tile (``program_id(0)``) and K split (``program_id(1)``): its rows and
    columns, the wrapped column indices, the byte offsets of a K-tile, its K range and the first
    x and packed-weight pointers."""
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m = tl.program_id(0) // num_pid_n
    pid_n = tl.program_id(0) % num_pid_n
    pid_k = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # wrapped indices: out-of-range rows/columns re-read valid memory and are masked at the store
    ram = rm % M
    rbn = tl.max_contiguous(tl.multiple_of(rn % N, BLOCK_N), BLOCK_N)
    rb = tl.arange(0, BLOCK_K // 2)  # byte b of a K-tile holds features 2b (low nibble) and 2b + 1
    # a split is a whole number of K-tiles, so its byte offset keeps 16-byte alignment (vector loads)
    k_start = pid_k * TILES_PER_SPLIT * BLOCK_K
    k_stop = tl.minimum(k_start + TILES_PER_SPLIT * BLOCK_K, K)
    x_ptrs = x_ptr + ram[:, None] * stride_xm + (k_start + 2 * rb)[None, :] * stride_xk
    w_ptrs = w_ptr + rbn[:, None] * stride_wn + (k_start // 2 + rb)[None, :] * stride_wk
    return rm, rn, rbn, rb, k_start, k_stop, x_ptrs, w_ptrs


@triton.jit
def _first_w(w_ptrs, rb, k_start, K, EVEN_K: tl.constexpr, PREFETCH: tl.constexpr):
    """With PREFETCH the split's first packed-weight tile, loaded before the loop; else a 0 the loop
    carries unused. Splits are never empty."""
    r = 0
    if PREFETCH:
        if EVEN_K:
            r = tl.load(w_ptrs)
        else:
            r = tl.load(w_ptrs, mask=((2 * rb) < (K - k_start))[None, :], other=0)
    return r


@triton.jit
def _tile_loads(x_ptrs, w_ptrs, wb_next, rb, k0, k_stop, K, stride_xk, stride_wk, BLOCK_K: tl.constexpr,
                EVEN_K: tl.constexpr, PREFETCH: tl.constexpr):
    """The K-tile at ``k0``: its packed weights ``[BLOCK_N, BLOCK_K/2]`` (with PREFETCH the tile loaded
    one step earlier, while the next goes in flight), x's even and odd features (0 past K), and the
    next prefetched tile."""
    in_k = (2 * rb) < (K - k0)  # K is even: a pair is inside K when its even feature is
    if PREFETCH:
        wb = wb_next
        nxt = k0 + BLOCK_K
        if EVEN_K:  # one scalar mask for the whole tile keeps the loads 16 bytes wide
            more = tl.full((1, BLOCK_K // 2), 1, tl.int1) & (nxt < k_stop)
            wb_next = tl.load(w_ptrs + (BLOCK_K // 2) * stride_wk, mask=more, other=0)
        else:
            wb_next = tl.load(w_ptrs + (BLOCK_K // 2) * stride_wk, mask=((2 * rb) < (k_stop - nxt))[None, :],
                              other=0)
    elif EVEN_K:
        wb = tl.load(w_ptrs)
    else:
        wb = tl.load(w_ptrs, mask=in_k[None, :], other=0)
    if EVEN_K:
        xe = tl.load(x_ptrs)
        xo = tl.load(x_ptrs + stride_xk)
    else:  # past K: x is 0, so the codes' value there does not matter
        xe = tl.load(x_ptrs, mask=in_k[None, :], other=0.0)
        xo = tl.load(x_ptrs + stride_xk, mask=in_k[None, :], other=0.0)
    return wb, xe, xo, wb_next


def k_splits(k: int, c: W4Config) -> tuple[int, int]:
    """``(split, tiles_per_split)`` for K split ``c.split_k`` ways into K-tiles of ``c.block_k``: at
    most one split per tile, and no empty split."""
    k_tiles = triton.cdiv(k, c.block_k)
    tiles_per_split = triton.cdiv(k_tiles, max(1, min(c.split_k, k_tiles)))
    return triton.cdiv(k_tiles, tiles_per_split), tiles_per_split


def one_kernel_split(m: int, n: int, k: int, c: W4Config, out: torch.Tensor) -> tuple[int, int, int, torch.Tensor,
                                                                                       torch.Tensor]:
    """``(tiles, split, tiles_per_split, workspace, counters)`` of a launch that sums its K splits in
    the same kernel (:func:`_store_tile`): float32 partials ``[split, m, n]`` and one zeroed counter
    per output tile, or ``out`` twice (unused) without a split."""
    split, tiles_per_split = k_splits(k, c)
    tiles = triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n)
    if split == 1:
        return tiles, split, tiles_per_split, out, out
    ws = torch.empty((split, m, n), device=out.device, dtype=torch.float32)
    return tiles, split, tiles_per_split, ws, split_workspace(out.device, tiles)


@dataclass(frozen=True)
class _Weight:
    """The packed weight's tensors on the activation's device, with placeholders for absent ones."""

    packed: torch.Tensor
    scale: torch.Tensor
    zp: torch.Tensor | None
    g_idx: torch.Tensor | None
    group_size: int

    def pointer_args(self) -> tuple[Any, ...]:
        z = self.zp if self.zp is not None else self.scale
        return (self.packed, self.scale, z, self.g_idx if self.g_idx is not None else self.scale)

    def stride_args(self) -> tuple[int, ...]:
        z = self.zp if self.zp is not None else self.scale
        return (self.packed.stride(0), self.packed.stride(1), self.scale.stride(0), self.scale.stride(1),
                z.stride(0), z.stride(1))
