# mypy: disable-error-code="no-untyped-def"
# (Triton kernels annotate only their constexpr parameters; the rest are typed by the JIT.)
"""W4A16 GEMM: int4 weights dequantized in registers, fp16/bf16 (or fp32) activations (Triton).

``Y[M, N] = act(X @ W^T + bias)`` with ``W[n, k] = (u[n, k] - z[n, g]) * s[n, g]``, ``g = g_idx[k]``
(or ``k // group_size``): ``u`` unsigned 4-bit codes packed two per byte along K (``w_packed``
uint8 ``[N, K/2]``, feature 2i in the low nibble), ``s`` float32 group scales ``[N, G]``, ``z``
uint8 zero points ``[N, G]`` (or the constant 8 for symmetric int4). See quantization/int4.py.

Each K-tile of packed bytes is loaded once per pair of features, unpacked with a shift and mask,
dequantized in float32 (the fake-quant arithmetic) and cast to the activation dtype, then fed to
``tl.dot`` with float32 accumulation: the weight never exists in memory as fp16. When the K-tile
lies inside one group (``group_size % BLOCK_K == 0``, no g_idx) a tile needs one row of scales
(and zero points); otherwise, or with act_order's g_idx, each feature gathers its group's.

Shapes: decode (M = 1..16) is bandwidth-bound on the weight, so its tiles are 16 rows (the
smallest ``tl.dot``) by narrow N-tiles with deep K-tiles, which keeps enough programs in flight
for 4096-wide layers; prefill takes the GEMM tiles of the int8 kernel. Autotuning keys on
(M bucket, N, K, group size); under ``TRITON_INTERPRET=1`` one fixed tile runs on CPU tensors.

Numerics: the dequantized weight is bit-exact against :func:`quantization.int4.dequantize_int4`
cast to the activation dtype (tested through an identity activation); the product differs from
torch's only by float32 accumulation order.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from compress.errors import CompressError
from quantization.kernels import ACTIVATIONS, check_device, interpret_mode
from quantization.kernels.gemm import GemmConfig, grouped_tile, m_bucket, tile_config

INTERPRETED = interpret_mode()
_ACT_CODE = {name: i for i, name in enumerate(ACTIVATIONS)}
_X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INTERPRET_CONFIG = GemmConfig(16, 32, 32)


# Decode: 16-row tiles; N-tiles narrow enough that a 4096-wide layer launches >= 128 programs.
DECODE_CONFIGS = [
    tile_config(16, 32, 128, 4, 4),
    tile_config(16, 32, 256, 3, 4),
    tile_config(16, 64, 128, 4, 4),
    tile_config(16, 64, 256, 3, 4),
    tile_config(16, 128, 128, 3, 4),
    tile_config(16, 16, 256, 4, 2),
    tile_config(32, 64, 128, 3, 4),
]
# Prefill: tensor-core GEMM tiles; K-tiles of 64 or 128 keep one scale row per tile at g128.
PREFILL_CONFIGS = [
    tile_config(128, 128, 64, 4, 8),
    tile_config(128, 256, 64, 3, 8),
    tile_config(128, 128, 128, 3, 8),
    tile_config(64, 128, 64, 4, 4),
    tile_config(64, 256, 64, 3, 8),
    tile_config(128, 64, 64, 4, 4),
    tile_config(64, 64, 128, 4, 4),
]


def _prune(configs: list[triton.Config], named_args: dict[str, object], **_: object) -> list[triton.Config]:
    mb = int(named_args["M_BUCKET"])  # type: ignore[call-overload]
    if mb <= 16:
        return [c for c in configs if c.kwargs["BLOCK_M"] <= 32]
    if mb <= 64:
        return [c for c in configs if c.kwargs["BLOCK_M"] <= 64]
    return [c for c in configs if c.kwargs["BLOCK_M"] >= 64]


@triton.jit
def _round_bf16(v):
    """float32 -> the nearest bf16 value (ties to even), still as float32 (finite inputs).

    The GPU's float32 -> bf16 cast rounds this way; the interpreter's truncates, so its bf16 path
    rounds here first and then casts exactly."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _w4a16_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, g_ptr, bias_ptr, y_ptr,
    M, N, K, M_BUCKET, GROUP_SIZE, ZP_CONST,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sg, stride_zn, stride_zg,
    stride_ym, stride_yn,
    HAS_ZP: tl.constexpr, HAS_GIDX: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, TILE_IN_GROUP: tl.constexpr, DOT_F32: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # wrapped indices: out-of-range rows/columns re-read valid memory and are masked at the store
    ram = tl.max_contiguous(tl.multiple_of(rm % M, BLOCK_M), BLOCK_M)
    rbn = tl.max_contiguous(tl.multiple_of(rn % N, BLOCK_N), BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    shift = ((rk % 2) * 4).to(tl.uint8)[:, None]  # even features in the low nibble
    x_ptrs = x_ptr + ram[:, None] * stride_xm + rk[None, :] * stride_xk
    w_ptrs = w_ptr + (rk // 2)[:, None] * stride_wk + rbn[None, :] * stride_wn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        k0 = kt * BLOCK_K
        if EVEN_K:
            x = tl.load(x_ptrs)
            wb = tl.load(w_ptrs)
        else:
            k_left = K - k0
            x = tl.load(x_ptrs, mask=rk[None, :] < k_left, other=0.0)
            wb = tl.load(w_ptrs, mask=rk[:, None] < k_left, other=0)
        u = ((wb >> shift) & 0xF).to(tl.int32)  # [BLOCK_K, BLOCK_N] codes 0..15
        if TILE_IN_GROUP:
            g = k0 // GROUP_SIZE
            s = tl.load(s_ptr + rbn * stride_sn + g * stride_sg)[None, :]
            if HAS_ZP:
                z = tl.load(z_ptr + rbn * stride_zn + g * stride_zg).to(tl.int32)[None, :]
            else:
                z = ZP_CONST
        else:
            kk = tl.minimum(k0 + rk, K - 1)  # ragged tail: any valid group (its codes are masked to 0 rows of x)
            if HAS_GIDX:
                gk = tl.load(g_ptr + kk)
            else:
                gk = kk // GROUP_SIZE
            s = tl.load(s_ptr + rbn[None, :] * stride_sn + gk[:, None] * stride_sg)
            if HAS_ZP:
                z = tl.load(z_ptr + rbn[None, :] * stride_zn + gk[:, None] * stride_zg).to(tl.int32)
            else:
                z = ZP_CONST
        w = (u - z).to(tl.float32) * s  # float32, as the fake quantizer computes it
        if x.dtype == tl.float32:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        elif DOT_F32:
            # the interpreter's dot has no bf16 (numpy): bf16 x bf16 products are exact in float32,
            # so float32 operands holding the bf16-rounded values compute what the GPU's bf16 MMA does
            acc = tl.dot(x.to(tl.float32), _round_bf16(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w.to(x.dtype), acc)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += (BLOCK_K // 2) * stride_wk

    y = acc
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + rn, mask=rn < N, other=0.0)[None, :]
    if ACT == 1:
        y = tl.maximum(y, 0.0)
    elif ACT == 2:
        y = 0.5 * y * (1.0 + tl.math.erf(y * 0.7071067811865476))
    y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :] * stride_yn
    if DOT_F32:
        y = _round_bf16(y)  # exact in bf16 now: the interpreter's truncating cast below keeps it
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


_heuristics = triton.heuristics(
    {
        "EVEN_K": lambda a: a["K"] % a["BLOCK_K"] == 0,
        "TILE_IN_GROUP": lambda a: (not a["HAS_GIDX"]) and a["GROUP_SIZE"] % a["BLOCK_K"] == 0,
    }
)
_w4a16_fixed = _heuristics(_w4a16_kernel)


def tuned_w4a16(configs: list[triton.Config], *, do_bench: Any = None) -> Any:
    """The autotuned launcher over ``configs`` (``do_bench`` replaces timing, for tests)."""
    return triton.autotune(
        configs=configs, key=["M_BUCKET", "N", "K", "GROUP_SIZE"], prune_configs_by={"early_config_prune": _prune},
        do_bench=do_bench,
    )(_heuristics(_w4a16_kernel))


_w4a16_tuned = None if INTERPRETED else tuned_w4a16(DECODE_CONFIGS + PREFILL_CONFIGS)


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
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """``act(x @ W^T + bias)`` in ``x``'s dtype, ``W`` dequantized from int4 inside the kernel.

    ``x`` float16/bfloat16/float32 ``[M, K]`` (any strides); ``w_packed`` uint8 ``[N, K/2]``;
    ``scale`` float32 ``[N, ceil(K / group_size)]``; ``zero_point`` uint8 ``[N, G]`` or None (symmetric: 8);
    ``g_idx`` int32 ``[K]`` or None (``k // group_size``); ``bias`` ``N`` floats or None.
    ``config`` fixes the tile (default: autotuned on CUDA).
    """
    check_device(x, "w4a16_gemm")
    if x.dtype not in _X_DTYPES:
        raise CompressError(f"w4a16_gemm: activations must be float16, bfloat16 or float32 (got {x.dtype})")
    if w_packed.dtype != torch.uint8 or w_packed.dim() != 2:
        raise CompressError(f"w4a16_gemm: w_packed must be 2-D uint8 (got {w_packed.dtype}, {w_packed.dim()}-D)")
    if x.dim() != 2 or x.shape[1] % 2 or w_packed.shape[1] * 2 != x.shape[1]:
        raise CompressError(
            f"w4a16_gemm: shapes {tuple(x.shape)} and packed {tuple(w_packed.shape)} do not make [M,K] x [N,K/2] (K even)"
        )
    if activation not in _ACT_CODE:
        raise CompressError(f"w4a16_gemm: activation '{activation}' unknown; valid: {', '.join(ACTIVATIONS)}")
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
    out = torch.empty((m, n), device=dev, dtype=x.dtype)
    if m == 0 or n == 0:
        return out
    s = scale.to(device=dev, dtype=torch.float32)
    z = None if zero_point is None else zero_point.to(device=dev, dtype=torch.uint8)
    gi = None if g_idx is None else g_idx.to(device=dev, dtype=torch.int32).contiguous()
    b = None if bias is None else bias.reshape(-1).to(device=dev, dtype=torch.float32).contiguous()
    args = (
        x, w_packed, s, z if z is not None else s, gi if gi is not None else s, b if b is not None else s, out,
        m, n, k, m_bucket(m), group_size, 8,
        x.stride(0), x.stride(1), w_packed.stride(0), w_packed.stride(1), s.stride(0), s.stride(1),
        (z if z is not None else s).stride(0), (z if z is not None else s).stride(1), out.stride(0), out.stride(1),
    )
    flags = {"HAS_ZP": z is not None, "HAS_GIDX": gi is not None, "HAS_BIAS": b is not None, "ACT": _ACT_CODE[activation],
             "DOT_F32": INTERPRETED and x.dtype == torch.bfloat16}
    if config is None and _w4a16_tuned is not None:
        def grid(meta: dict[str, int]) -> tuple[int]:
            return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

        _w4a16_tuned[grid](*args, **flags)
        return out
    c = config or INTERPRET_CONFIG
    if c.block_k % 2:
        raise CompressError(f"w4a16_gemm: block_k must be even (got {c.block_k})")
    grid_fixed = (triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n),)
    _w4a16_fixed[grid_fixed](
        *args, **flags, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m,
        num_warps=c.num_warps, num_stages=c.num_stages,
    )
    return out
