# mypy: disable-error-code="no-untyped-def"
# (Triton kernels annotate only their constexpr parameters; the rest are typed by the JIT.)
"""int8 x int8 -> int32 GEMM with a fused dequantization epilogue (Triton).

``C[M, N] = act((A_q @ B_q^T - zp_a * colsum(B_q)) * s_a * s_b + bias)`` with ``A_q`` int8 ``[M, K]``
(activations, any strides), ``B_q`` int8 ``[N, K]`` (weights, K contiguous), ``s_a`` per tensor or
per row (token), ``s_b`` per column (output channel).

Tiling is the classic one, sized for int8 tensor cores: 128x128 / 128x256 output tiles with K-tiles
of 64-128 bytes, 3-4 pipeline stages, 4-8 warps, and grouped program ordering (``GROUP_M`` row
tiles share a band of B) so that neighbouring programs reuse B tiles from L2. Small-M (decode)
shapes get 16/32/64-row tiles with deeper K-tiles. Loads use wrapped row/column indices (no M/N
masks in the hot loop; only the store is masked) and K is masked only when it is ragged.

Autotuning keys on (M bucket, N, K) so that a new sequence length does not retune; configurations
are chosen per architecture (Hopper: larger tiles and deeper pipelines than Ampere's 164 KB of
shared memory allow). Under ``TRITON_INTERPRET=1`` there is no autotuning: one small tile (or the
one a test passes) runs on CPU tensors, with int32 accumulation bit-exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from compress.quantization.lowering.kernels.runtime import ACTIVATIONS, check_device, interpret_mode

from compress.core.errors import CompressError

INTERPRETED = interpret_mode()  # fixed at import, as Triton fixes it when it decorates the kernels
_ACT_CODE = {name: i for i, name in enumerate(ACTIVATIONS)}
_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class GemmConfig:
    """One tile configuration (what the autotuner picks from; tests pass one explicitly)."""

    block_m: int = 32
    block_n: int = 32
    block_k: int = 32
    group_m: int = 4
    num_warps: int = 4
    num_stages: int = 2
    split_k: int = 1  # programs sharing one output tile's K range (decode: more programs than tiles)


# Without autotuning (interpreter): large tiles mean few programs, which is what costs time there.
INTERPRET_CONFIG = GemmConfig(64, 64, 64)


def tile_config(bm: int, bn: int, bk: int, stages: int, warps: int, group: int = 8, split: int = 1) -> triton.Config:
    return triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group, "SPLIT_K": split},
        num_stages=stages, num_warps=warps,
    )


# Hopper (sm90): 228 KB shared memory, so 128x256 tiles with 128-byte K-tiles fit 3 stages.
HOPPER_CONFIGS = [
    tile_config(128, 256, 128, 3, 8),
    tile_config(256, 128, 128, 3, 8),
    tile_config(128, 128, 128, 4, 8),
    tile_config(128, 128, 128, 4, 4),
    tile_config(128, 256, 64, 4, 8),
    tile_config(128, 128, 64, 4, 4),
    tile_config(64, 128, 128, 4, 4),
    tile_config(128, 64, 128, 4, 4),
    tile_config(64, 64, 128, 4, 4),
    tile_config(64, 128, 256, 3, 4),
    tile_config(32, 128, 128, 4, 4),
    tile_config(32, 64, 256, 4, 4),
    tile_config(16, 128, 128, 4, 4),
    tile_config(16, 64, 256, 4, 4),
    # decode (M <= 16): narrow column tiles put more programs on the 132 SMs (N=4096 in 64-wide tiles
    # is 64 programs on 132 SMs), deep K-tiles keep each one's weight stream long; measured 5-7% faster at M=1-16
    tile_config(16, 32, 256, 4, 4),
    tile_config(16, 32, 512, 3, 4),
    tile_config(16, 16, 512, 3, 2),
    tile_config(16, 64, 512, 3, 4),
    # decode, split K: at M <= 16 a layer's weight streams through few programs (N=4096 in 32-wide
    # tiles is 128 programs, each 8 K-tiles deep: pipeline fill is a large share of its time);
    # splitting K gives each SM several short, independent weight streams. The only kernels that
    # reached ~2.2 TB/s of ~4.8 without it (benchmarks/RESULTS.md)
    tile_config(16, 64, 256, 4, 4, split=2),
    tile_config(16, 64, 256, 4, 4, split=4),
    tile_config(16, 64, 256, 4, 4, split=8),
    tile_config(16, 32, 512, 3, 4, split=2),
    tile_config(16, 32, 512, 3, 4, split=4),
    tile_config(16, 64, 512, 3, 4, split=2),
    tile_config(16, 64, 512, 3, 4, split=4),
    tile_config(16, 128, 128, 4, 4, split=4),
    tile_config(16, 128, 128, 4, 4, split=8),
    tile_config(16, 16, 512, 3, 2, split=2),
]
# Ampere (sm80/86/89): 100-164 KB shared memory; K-tiles of 64-128 bytes, 3-5 stages.
AMPERE_CONFIGS = [
    tile_config(128, 256, 64, 3, 8),
    tile_config(256, 128, 64, 3, 8),
    tile_config(128, 128, 128, 3, 8),
    tile_config(128, 128, 64, 4, 4),
    tile_config(128, 64, 64, 4, 4),
    tile_config(64, 128, 64, 4, 4),
    tile_config(64, 64, 128, 4, 4),
    tile_config(32, 128, 128, 4, 4),
    tile_config(32, 64, 128, 4, 4),
    tile_config(16, 128, 128, 4, 4),
    tile_config(16, 64, 128, 5, 4),
]


def m_bucket(m: int) -> int:
    """The autotuning bucket of ``M``: the next power of two, capped (large M tunes alike)."""
    return min(triton.next_power_of_2(max(m, 1)), 4096)


SPLIT_MAX_M = 16  # split-K candidates are timed only for decode-sized M (larger M has tiles enough)


def _prune(configs: list[triton.Config], named_args: dict[str, object], **_: object) -> list[triton.Config]:
    # pick the architecture's list, then drop tiles much taller than M (padding rows waste the MMA),
    # and split-K where M is not decode-sized or a split would get fewer than two K-tiles
    major = torch.cuda.get_device_capability()[0] if torch.cuda.is_available() else 8
    arch = HOPPER_CONFIGS if major >= 9 else AMPERE_CONFIGS
    mb = int(named_args["M_BUCKET"])  # type: ignore[call-overload]
    k = int(named_args.get("K", 1 << 30))  # type: ignore[call-overload]
    pool = [c for c in configs if c in arch] or configs
    pool = [c for c in pool if c.kwargs.get("SPLIT_K", 1) == 1
            or (mb <= SPLIT_MAX_M and triton.cdiv(k, c.kwargs["BLOCK_K"]) >= 2 * c.kwargs["SPLIT_K"])] or pool
    return [c for c in pool if c.kwargs["BLOCK_M"] <= max(16, mb)] or pool


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program ``pid`` in grouped order: GROUP_M row tiles walk the same
    column band, keeping the weight tiles hot in L2."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def epilogue(
    acc, rm, rn, M, N, a_scale_ptr, b_scale_ptr, bias_ptr, colsum_ptr, a_zp,
    A_PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ZP: tl.constexpr, ACT: tl.constexpr,
):
    """int32 tile -> float32 output tile: zero-point correction, scales, bias, activation."""
    mask_m = rm < M
    mask_n = rn < N
    if HAS_ZP:
        cs = tl.load(colsum_ptr + rn, mask=mask_n, other=0)
        acc = acc - a_zp * cs[None, :]
    if A_PER_ROW:
        sa = tl.load(a_scale_ptr + rm, mask=mask_m, other=0.0)
        y = acc.to(tl.float32) * sa[:, None]
    else:
        y = acc.to(tl.float32) * tl.load(a_scale_ptr)
    sb = tl.load(b_scale_ptr + rn, mask=mask_n, other=0.0)
    y = y * sb[None, :]
    return bias_activation(y, rn[None, :], N, bias_ptr, HAS_BIAS, ACT)


@triton.jit
def bias_activation(y, rn, N, bias_ptr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr):
    """float32 ``y`` plus the bias of columns ``rn`` (shaped to broadcast against ``y``), then the
    activation (``ACTIVATIONS`` index: 1 ReLU, 2 erf-GELU)."""
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + rn, mask=rn < N, other=0.0)
    if ACT == 1:
        y = tl.maximum(y, 0.0)
    elif ACT == 2:
        y = 0.5 * y * (1.0 + tl.math.erf(y * 0.7071067811865476))
    return y


@triton.jit
def _gemm_kernel(
    a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, colsum_ptr, ws_ptr, a_zp,
    M, N, K, M_BUCKET,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn, SPLIT_K,
    A_PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ZP: tl.constexpr, ACT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, SPLIT: tl.constexpr,
):
    tile = tl.program_id(0)
    pid_m, pid_n = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # wrapped indices: out-of-range rows/columns re-read valid memory and are masked at the store
    ram = tl.max_contiguous(tl.multiple_of(rm % M, BLOCK_M), BLOCK_M)
    rbn = tl.max_contiguous(tl.multiple_of(rn % N, BLOCK_N), BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k_tiles = tl.cdiv(K, BLOCK_K)
    k_first = 0
    k_last = k_tiles
    if SPLIT:  # this program's share of the K-tiles (the last share may be shorter, or empty)
        per_split = tl.cdiv(k_tiles, SPLIT_K)
        k_first = tl.program_id(1) * per_split
        k_last = tl.minimum(k_first + per_split, k_tiles)
    a_ptrs = a_ptr + ram[:, None] * stride_am + (k_first * BLOCK_K + rk)[None, :] * stride_ak
    b_ptrs = b_ptr + (k_first * BLOCK_K + rk)[:, None] * stride_bk + rbn[None, :] * stride_bn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k in range(k_first, k_last):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=rk[None, :] < k_left, other=0)
            b = tl.load(b_ptrs, mask=rk[:, None] < k_left, other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if SPLIT:
        # Split K without a second kernel: every split adds its int32 partial sums into a zeroed
        # workspace (integer atomics: exact, so the order of arrival cannot change the result), then
        # counts itself in on the tile's counter; the last to arrive reads the sums back, zeroes the
        # workspace and the counter for the next call (CUDA-graph replays included), and runs the
        # epilogue. The barrier makes this program's adds land before its arrival is counted.
        inside = (rm < M)[:, None] & (rn < N)[None, :]
        ws_ptrs = ws_ptr + rm[:, None] * N + rn[None, :]
        tl.atomic_add(ws_ptrs, acc, mask=inside, sem="relaxed")
        tl.debug_barrier()
        cnt_ptr = ws_ptr + M * N + tile
        if tl.atomic_add(cnt_ptr, 1, sem="acq_rel") == SPLIT_K - 1:
            total = tl.atomic_xchg(ws_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32), mask=inside, sem="relaxed")
            tl.atomic_xchg(cnt_ptr, 0, sem="relaxed")
            _epilogue_store(total, rm, rn, M, N, c_ptr, stride_cm, stride_cn, a_scale_ptr, b_scale_ptr, bias_ptr,
                            colsum_ptr, a_zp, A_PER_ROW, HAS_BIAS, HAS_ZP, ACT)
    else:
        _epilogue_store(acc, rm, rn, M, N, c_ptr, stride_cm, stride_cn, a_scale_ptr, b_scale_ptr, bias_ptr,
                        colsum_ptr, a_zp, A_PER_ROW, HAS_BIAS, HAS_ZP, ACT)


@triton.jit
def _epilogue_store(acc, rm, rn, M, N, c_ptr, stride_cm, stride_cn, a_scale_ptr, b_scale_ptr, bias_ptr, colsum_ptr,
                    a_zp, A_PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ZP: tl.constexpr, ACT: tl.constexpr):
    y = epilogue(acc, rm, rn, M, N, a_scale_ptr, b_scale_ptr, bias_ptr, colsum_ptr, a_zp,
                 A_PER_ROW, HAS_BIAS, HAS_ZP, ACT)
    c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
    tl.store(c_ptrs, y.to(c_ptr.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


_even_k = triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0,
                             "SPLIT": lambda args: args["SPLIT_K"] > 1})
_gemm_fixed = _even_k(_gemm_kernel)


def tuned_gemm(configs: list[triton.Config], *, do_bench: Any = None) -> Any:
    """The autotuned GEMM launcher over ``configs`` (``do_bench`` replaces timing, for tests)."""
    return triton.autotune(
        configs=configs, key=["M_BUCKET", "N", "K"], prune_configs_by={"early_config_prune": _prune}, do_bench=do_bench
    )(_even_k(_gemm_kernel))


_gemm_tuned = None if INTERPRETED else tuned_gemm(HOPPER_CONFIGS + [c for c in AMPERE_CONFIGS if c not in HOPPER_CONFIGS])


def _vec(t: torch.Tensor | None, n: int, what: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    if t is None:
        return None
    t = t.reshape(-1)
    if t.numel() != n:
        raise CompressError(f"int8_gemm: {what} has {t.numel()} elements, expected {n}")
    return t.to(device=device, dtype=dtype).contiguous()


def int8_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    a_zero_point: int = 0,
    b_colsum: torch.Tensor | None = None,
    activation: str = "none",
    out_dtype: torch.dtype = torch.float16,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """``act((a @ b.T - zp * colsum(b)) * a_scale * b_scale + bias)`` as ``out_dtype`` ``[M, N]``.

    ``a`` int8 ``[M, K]``; ``b`` int8 ``[N, K]``; ``a_scale`` float32 of 1 (per tensor) or M (per
    row) elements; ``b_scale`` float32 of N elements; ``bias`` N elements or None. ``a_zero_point``
    is the activation zero point in int8 code space (uint8 codes minus 128) and then ``b_colsum``
    (int32 ``b.sum(1)``) is required. ``config`` fixes the tile (default: autotuned on CUDA).
    """
    check_device(a, "int8_gemm")
    if a.dtype != torch.int8 or b.dtype != torch.int8:
        raise CompressError(f"int8_gemm: operands must be int8 (got {a.dtype} and {b.dtype})")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise CompressError(f"int8_gemm: shapes {tuple(a.shape)} and {tuple(b.shape)} do not make [M,K] x [N,K]")
    if b.device != a.device:
        raise CompressError(f"int8_gemm: operands on {a.device} and {b.device}")
    if activation not in _ACT_CODE:
        raise CompressError(f"int8_gemm: activation '{activation}' unknown; valid: {', '.join(ACTIVATIONS)}")
    if out_dtype not in _OUT_DTYPES:
        raise CompressError(f"int8_gemm: out_dtype {out_dtype} unsupported; use float16, bfloat16 or float32")
    m, k = a.shape
    n = b.shape[0]
    dev = a.device
    out = torch.empty((m, n), device=dev, dtype=out_dtype)
    if m == 0 or n == 0:
        return out
    per_row = a_scale.numel() != 1
    sa = _vec(a_scale, m if per_row else 1, "a_scale", torch.float32, dev)
    sb = _vec(b_scale, n, "b_scale", torch.float32, dev)
    bias_v = _vec(bias, n, "bias", torch.float32, dev)
    has_zp = int(a_zero_point) != 0
    colsum = _vec(b_colsum, n, "b_colsum", torch.int32, dev) if has_zp else None
    if has_zp and colsum is None:
        raise CompressError("int8_gemm: a non-zero a_zero_point needs b_colsum (int32 row sums of b)")
    if k == 0:
        a = torch.zeros((m, 1), dtype=torch.int8, device=dev)  # empty reduction: bias and activation only
        b = torch.zeros((n, 1), dtype=torch.int8, device=dev)
        k = 1
    tuned = config is None and _gemm_tuned is not None
    c = config or INTERPRET_CONFIG
    if c.split_k < 1:
        raise CompressError(f"int8_gemm: split_k must be >= 1 (got {c.split_k})")
    # split-K partial sums and tile counters (whichever tile the tuner picks: tiles are >= 16 x 16)
    may_split = m <= SPLIT_MAX_M if tuned else c.split_k > 1
    ws = sb
    if may_split and tuned and dev.type == "cuda" and torch.cuda.is_current_stream_capturing() \
            and tuned_split(m, n, k) == 1:
        # under capture a workspace costs the graph a memset: none where the tuned tile (chosen in an
        # eager call: the tuner cannot time inside a capture) does not split K; an int32 stand-in
        # keeps the kernel's signature, so nothing compiles inside the capture
        ws = torch.empty(1, dtype=torch.int32, device=dev)
    elif may_split:
        ws = split_workspace(dev, m * n + triton.cdiv(m, 16) * triton.cdiv(n, 16))
    args = (
        a, b, out, sa, sb, bias_v if bias_v is not None else sb, colsum if colsum is not None else sb, ws,
        int(a_zero_point), m, n, k, m_bucket(m),
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
    )
    flags = {"A_PER_ROW": per_row, "HAS_BIAS": bias_v is not None, "HAS_ZP": has_zp, "ACT": _ACT_CODE[activation]}
    if tuned and _gemm_tuned is not None:
        def grid(meta: dict[str, int]) -> tuple[int, int]:
            return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"])

        _gemm_tuned[grid](*args, **flags)
        return out
    grid_fixed = (triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n), c.split_k)
    _gemm_fixed[grid_fixed](
        *args, **flags, SPLIT_K=c.split_k, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
        GROUP_M=c.group_m, num_warps=c.num_warps, num_stages=c.num_stages,
    )
    return out


def tuned_split(m: int, n: int, k: int) -> int | None:
    """The split of the tile the autotuner chose for this shape's (M bucket, N, K), None if untuned."""
    for key, cfg in getattr(_gemm_tuned, "cache", {}).items():
        if tuple(key[:3]) == (m_bucket(m), n, k):
            return int(cfg.kwargs.get("SPLIT_K", 1))
    return None


# Eager calls: one zeroed int32 buffer per (device, stream), grown by replacement; kernels leave it
# zeroed, so consecutive GEMMs of one stream share it, and GEMMs on different streams (which may
# overlap in time) do not. Under CUDA-graph capture every split GEMM gets a buffer of its own from
# the graph's pool, zeroed by a memset the graph replays before it: graphs replayed concurrently, or
# one replayed before another that shares a capture stream ever ran, never share partial sums.
_WORKSPACE: dict[tuple[str, int], torch.Tensor] = {}
_WORKSPACE_MIN = 1 << 18  # 1 MB: decode at M <= 16 up to N = 16K


def split_workspace(dev: torch.device, numel: int) -> torch.Tensor:
    """A zeroed int32 buffer of at least ``numel`` elements for split-K sums and tile counters."""
    if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(numel, dtype=torch.int32, device=dev)
    stream = torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else 0
    key = (str(dev), stream)
    buf = _WORKSPACE.get(key)
    if buf is None or buf.numel() < numel:  # the old one is freed in stream order (the allocator's)
        buf = torch.zeros(max(numel, _WORKSPACE_MIN, 2 * (buf.numel() if buf is not None else 0)),
                          dtype=torch.int32, device=dev)
        _WORKSPACE[key] = buf
    return buf
