# mypy: disable-error-code="no-untyped-def"
# (Triton kernels annotate only their constexpr parameters; the rest are typed by the JIT.)
"""int8 2-D convolution on channels-last tensors, sharing the GEMM's fused epilogue.

- 1x1, stride 1, no padding: a plain GEMM on the ``[N*H*W, C]`` view of the NHWC input.
- Everything else (kxk, strides, padding, dilation): implicit GEMM. Output pixels are GEMM rows,
  ``(kh, kw, c)`` the reduction; the weight is stored ``[O, KH, KW, C]`` so that both operands are
  read C-contiguous. One flat K loop walks (filter tap, channel block) pairs, so addresses and
  padding masks are computed per tap rather than per element, the loop stays pipelinable, and no
  im2col buffer is written. Padded taps read the activation zero point (the code of a real 0), which the
  epilogue's ``zp * colsum(w)`` correction then cancels exactly.

Groups other than 1 (depthwise) are not handled here: they have too little reuse for a GEMM, so
the converter leaves them float with a reason.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from compress.quantization.lowering.kernels.gemm import (
    INTERPRET_CONFIG,
    INTERPRETED,
    GemmConfig,
    epilogue,
    grouped_tile,
    int8_gemm,
    m_bucket,
)
from compress.quantization.lowering.kernels.runtime import ACTIVATIONS, check_device

from compress.core.errors import CompressError

_ACT_CODE = {name: i for i, name in enumerate(ACTIVATIONS)}


def tile_config(bm: int, bn: int, bk: int, stages: int, warps: int, group: int = 8) -> triton.Config:
    """One implicit-GEMM tile for the autotuner (the conv kernel has no split K: its M is large)."""
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group},
                         num_stages=stages, num_warps=warps)

CONV_CONFIGS = [
    tile_config(128, 128, 64, 4, 4),
    tile_config(128, 128, 64, 3, 8),
    tile_config(128, 256, 64, 3, 8),
    tile_config(256, 128, 64, 3, 8),
    tile_config(128, 64, 64, 4, 4),
    tile_config(64, 128, 64, 4, 4),
    tile_config(64, 64, 64, 4, 4),
    tile_config(128, 128, 128, 3, 8),
    tile_config(128, 64, 32, 4, 4),
    tile_config(64, 64, 32, 4, 4),
]


def _prune(configs: list[triton.Config], named_args: dict[str, object], **_: object) -> list[triton.Config]:
    # K-tiles no deeper than the channel count (C=64 wastes half of a 128-deep tile), rows <= M
    c = int(named_args["C"])  # type: ignore[call-overload]
    mb = int(named_args["M_BUCKET"])  # type: ignore[call-overload]
    keep = [
        cf for cf in configs
        if cf.kwargs["BLOCK_K"] <= max(32, triton.next_power_of_2(c)) and cf.kwargs["BLOCK_M"] <= max(32, mb)
    ]
    return keep or configs[:1]


@triton.jit
def _conv_kernel(
    x_ptr, w_ptr, c_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, colsum_ptr, a_zp,
    M, N, C, H, W, OH, OW, M_BUCKET,
    stride_xn, stride_xh, stride_xw, stride_wn,
    SH, SW, PH, PW, DH, DW,
    KH: tl.constexpr, KW: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_ZP: tl.constexpr, ACT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ram = rm % M
    rbn = rn % N
    ohw = OH * OW
    n_idx = ram // ohw
    rem = ram % ohw
    ih0 = (rem // OW) * SH - PH
    iw0 = (rem % OW) * SW - PW
    rk = tl.arange(0, BLOCK_K)
    x_img = x_ptr + n_idx.to(tl.int64) * stride_xn
    w_col = w_ptr + rbn * stride_wn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    # one flat loop over (tap, channel block) so that the compiler pipelines it (num_stages); the
    # per-iteration index math is scalar, the per-tap padding mask one vector compare
    c_blocks = tl.cdiv(C, BLOCK_K)
    for it in range(0, KH * KW * c_blocks):
        tap = it // c_blocks
        c0 = (it - tap * c_blocks) * BLOCK_K
        kh = tap // KW
        kw = tap - kh * KW
        ih = ih0 + kh * DH
        iw = iw0 + kw * DW
        inside = (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
        ck = c0 + rk
        cmask = ck < C
        a = tl.load((x_img + ih * stride_xh + iw * stride_xw)[:, None] + ck[None, :],
                    mask=inside[:, None] & cmask[None, :], other=0)
        if HAS_ZP:
            # padding holds the code of a real 0; the epilogue's zp*colsum cancels it
            a = tl.where(inside[:, None], a, a_zp).to(tl.int8)
        b = tl.load((w_col + tap * C)[None, :] + ck[:, None], mask=cmask[:, None], other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)

    y = epilogue(acc, rm, rn, M, N, a_scale_ptr, b_scale_ptr, bias_ptr, colsum_ptr, a_zp,
                 False, HAS_BIAS, HAS_ZP, ACT)
    c_ptrs = c_ptr + rm[:, None] * N + rn[None, :]
    tl.store(c_ptrs, y.to(c_ptr.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


def tuned_conv(configs: list[triton.Config], *, do_bench: Any = None) -> Any:
    """The autotuned implicit-GEMM launcher over ``configs`` (``do_bench`` replaces timing, for tests)."""
    return triton.autotune(
        configs=configs,
        key=["M_BUCKET", "N", "C", "H", "W", "KH", "KW", "SH", "SW"],
        prune_configs_by={"early_config_prune": _prune},
        do_bench=do_bench,
    )(_conv_kernel)


_conv_tuned = None if INTERPRETED else tuned_conv(CONV_CONFIGS)


def _pair(v: int | tuple[int, ...]) -> tuple[int, int]:
    if isinstance(v, int):
        return v, v
    return int(v[0]), int(v[1])


def int8_conv2d(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    a_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    a_zero_point: int = 0,
    w_colsum: torch.Tensor | None = None,
    stride: int | tuple[int, int] = 1,
    padding: int | tuple[int, int] = 0,
    dilation: int | tuple[int, int] = 1,
    activation: str = "none",
    out_dtype: torch.dtype = torch.float16,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """Convolution of int8 NCHW ``x`` (stored channels-last) with int8 ``w`` ``[O, KH, KW, C]``.

    Returns ``out_dtype`` NCHW in channels-last memory. Scales, bias, zero point and activation as
    in :func:`quantization.lowering.kernels.gemm.int8_gemm` (``a_scale`` per tensor here: one output pixel
    reads many input pixels).
    """
    check_device(x, "int8_conv2d")
    if x.dtype != torch.int8 or w.dtype != torch.int8 or x.dim() != 4 or w.dim() != 4:
        raise CompressError(f"int8_conv2d: int8 4-D operands expected (got {x.dtype} {x.dim()}-D, {w.dtype} {w.dim()}-D)")
    n, c, h, wd = x.shape
    o, kh, kw, wc = w.shape
    if wc != c:
        raise CompressError(f"int8_conv2d: input has {c} channels, weight expects {wc} (weight layout [O, KH, KW, C])")
    if activation not in _ACT_CODE:
        raise CompressError(f"int8_conv2d: activation '{activation}' unknown; valid: {', '.join(ACTIVATIONS)}")
    if a_scale.numel() != 1:
        raise CompressError("int8_conv2d: the activation scale must be per tensor")
    sh, sw = _pair(stride)
    ph, pw = _pair(padding)
    dh, dw = _pair(dilation)
    oh = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    ow = (wd + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    if oh <= 0 or ow <= 0:
        raise CompressError(f"int8_conv2d: input {h}x{wd} is too small for kernel {kh}x{kw} with padding {ph},{pw}")
    x = x.contiguous(memory_format=torch.channels_last)
    w = w.contiguous()
    if kh == kw == 1 and sh == sw == 1 and ph == pw == 0:
        y2 = int8_gemm(
            x.permute(0, 2, 3, 1).reshape(n * h * wd, c), w.reshape(o, c), a_scale=a_scale, b_scale=w_scale,
            bias=bias, a_zero_point=a_zero_point, b_colsum=w_colsum, activation=activation,
            out_dtype=out_dtype, config=config,
        )
        return y2.view(n, h, wd, o).permute(0, 3, 1, 2)
    m = n * oh * ow
    out = torch.empty((m, o), dtype=out_dtype, device=x.device)
    dev = x.device
    sa = a_scale.reshape(1).to(device=dev, dtype=torch.float32)
    sb = w_scale.reshape(-1).to(device=dev, dtype=torch.float32).contiguous()
    if sb.numel() != o:
        raise CompressError(f"int8_conv2d: w_scale has {sb.numel()} elements, expected {o}")
    bias_v = None if bias is None else bias.reshape(-1).to(device=dev, dtype=torch.float32).contiguous()
    has_zp = int(a_zero_point) != 0
    if has_zp and w_colsum is None:
        raise CompressError("int8_conv2d: a non-zero a_zero_point needs w_colsum (int32 sums of each filter)")
    colsum = w_colsum.reshape(-1).to(device=dev, dtype=torch.int32).contiguous() if has_zp and w_colsum is not None else sb
    args = (
        x, w, out, sa, sb, bias_v if bias_v is not None else sb, colsum, int(a_zero_point),
        m, o, c, h, wd, oh, ow, m_bucket(m),
        x.stride(0), x.stride(2), x.stride(3), w.stride(0),
        sh, sw, ph, pw, dh, dw,
    )
    flags = {"KH": kh, "KW": kw, "HAS_BIAS": bias_v is not None, "HAS_ZP": has_zp, "ACT": _ACT_CODE[activation]}
    if config is None and _conv_tuned is not None:
        def grid(meta: dict[str, int]) -> tuple[int]:
            return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(o, meta["BLOCK_N"]),)

        _conv_tuned[grid](*args, **flags)
    else:
        cf = config or INTERPRET_CONFIG
        _conv_kernel[(triton.cdiv(m, cf.block_m) * triton.cdiv(o, cf.block_n),)](
            *args, **flags, BLOCK_M=cf.block_m, BLOCK_N=cf.block_n, BLOCK_K=cf.block_k, GROUP_M=cf.group_m,
            num_warps=cf.num_warps, num_stages=cf.num_stages,
        )
    return out.view(n, oh, ow, o).permute(0, 3, 1, 2)
