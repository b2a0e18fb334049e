"""The kernels as PyTorch custom operators (``torch.ops.compress.*``), for ``torch.compile``.

Eager code calls the Python launchers directly. Under ``torch.compile`` a Triton launcher with
autotuning and a grid callback is not something Dynamo traces, so the converted modules call these
operators instead: opaque to the compiler (each runs the same kernel as eager, bit for bit), with a
shape-only fake implementation so the compiler can trace around them. What the compiler then does
with the rest of the model (fusing norms, rotary embeddings, residual adds and activation glue into
few kernels, deduplicating identical activation quantizations of one tensor) is what shrinks the
float part of a converted model's time. Registered on first use (Triton loads only then).
"""

from __future__ import annotations

import functools

import torch
from compress.quantization.lowering.kernels.runtime import ACTIVATIONS, load

_NS = "compress"


@functools.cache
def register() -> None:
    """Define the ``compress::`` operators once per process."""
    lib = torch.library

    @lib.custom_op(f"{_NS}::quantize_per_token", mutates_args=())
    def quantize_per_token(x: torch.Tensor, qmin: int, qmax: int, fp8: bool,
                           pre_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        q, s = load("quant").quantize_per_token(x, qmin=qmin, qmax=qmax, fp8=fp8, pre_scale=pre_scale)
        return q, s

    @quantize_per_token.register_fake
    def _(x: torch.Tensor, qmin: int, qmax: int, fp8: bool, pre_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
        return (torch.empty(x.shape, dtype=torch.float8_e4m3fn if fp8 else torch.int8, device=x.device),
                torch.empty((rows,), dtype=torch.float32, device=x.device))

    @lib.custom_op(f"{_NS}::quantize_static", mutates_args=())
    def quantize_static(x: torch.Tensor, scale: torch.Tensor, zero_point: int, qmin: int, qmax: int, fp8: bool,
                        pre_scale: torch.Tensor | None) -> torch.Tensor:
        return load("quant").quantize_static(x, scale=scale, zero_point=zero_point, qmin=qmin, qmax=qmax, fp8=fp8,
                                             pre_scale=pre_scale)

    @quantize_static.register_fake
    def _(x: torch.Tensor, scale: torch.Tensor, zero_point: int, qmin: int, qmax: int, fp8: bool,
          pre_scale: torch.Tensor | None) -> torch.Tensor:
        cl = pre_scale is None and x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last)
        return torch.empty_like(x, dtype=torch.float8_e4m3fn if fp8 else torch.int8,
                                memory_format=torch.channels_last if cl else torch.contiguous_format)

    @lib.custom_op(f"{_NS}::int8_gemm", mutates_args=())
    def int8_gemm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                  bias: torch.Tensor | None, a_zero_point: int, b_colsum: torch.Tensor | None, activation: int,
                  out_dtype: torch.dtype) -> torch.Tensor:
        return load("gemm").int8_gemm(a, b, a_scale=a_scale, b_scale=b_scale, bias=bias, a_zero_point=a_zero_point,
                                      b_colsum=b_colsum, activation=ACTIVATIONS[activation], out_dtype=out_dtype)

    @int8_gemm.register_fake
    def _(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor, bias: torch.Tensor | None,
          a_zero_point: int, b_colsum: torch.Tensor | None, activation: int, out_dtype: torch.dtype) -> torch.Tensor:
        return torch.empty((a.shape[0], b.shape[0]), dtype=out_dtype, device=a.device)

    @lib.custom_op(f"{_NS}::int8_conv2d", mutates_args=())
    def int8_conv2d(x: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                    bias: torch.Tensor | None, a_zero_point: int, w_colsum: torch.Tensor | None, stride: list[int],
                    padding: list[int], dilation: list[int], activation: int, out_dtype: torch.dtype) -> torch.Tensor:
        return load("conv").int8_conv2d(
            x, w, a_scale=a_scale, w_scale=w_scale, bias=bias, a_zero_point=a_zero_point, w_colsum=w_colsum,
            stride=tuple(stride), padding=tuple(padding), dilation=tuple(dilation),
            activation=ACTIVATIONS[activation], out_dtype=out_dtype)

    @int8_conv2d.register_fake
    def _(x: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
          a_zero_point: int, w_colsum: torch.Tensor | None, stride: list[int], padding: list[int], dilation: list[int],
          activation: int, out_dtype: torch.dtype) -> torch.Tensor:
        n, _, h, wd = x.shape
        kh, kw = w.shape[1], w.shape[2]
        oh = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
        ow = (wd + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
        return torch.empty((n, w.shape[0], oh, ow), dtype=out_dtype, device=x.device,
                           memory_format=torch.channels_last)

    @lib.custom_op(f"{_NS}::w4a16_gemm", mutates_args=())
    def w4a16_gemm(x: torch.Tensor, w_packed: torch.Tensor, scale: torch.Tensor, group_size: int,
                   zero_point: torch.Tensor | None, g_idx: torch.Tensor | None, bias: torch.Tensor | None,
                   activation: int) -> torch.Tensor:
        return load("w4a16").w4a16_gemm(x, w_packed, scale=scale, group_size=group_size, zero_point=zero_point,
                                        g_idx=g_idx, bias=bias, activation=ACTIVATIONS[activation])

    @w4a16_gemm.register_fake
    def _(x: torch.Tensor, w_packed: torch.Tensor, scale: torch.Tensor, group_size: int, zero_point: torch.Tensor | None,
          g_idx: torch.Tensor | None, bias: torch.Tensor | None, activation: int) -> torch.Tensor:
        return torch.empty((x.shape[0], w_packed.shape[0]), dtype=x.dtype, device=x.device)

    @lib.custom_op(f"{_NS}::fake_quantize_static", mutates_args=())
    def fake_quantize_static(x: torch.Tensor, scale: torch.Tensor, zero_point: int, qmin: int, qmax: int) -> torch.Tensor:
        return load("quant").fake_quantize_static(x, scale=scale, zero_point=zero_point, qmin=qmin, qmax=qmax)

    @fake_quantize_static.register_fake
    def _(x: torch.Tensor, scale: torch.Tensor, zero_point: int, qmin: int, qmax: int) -> torch.Tensor:
        cl = x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last)
        return torch.empty_like(x, memory_format=torch.channels_last if cl else torch.contiguous_format)


def compiling() -> bool:
    """Whether the caller is being traced by ``torch.compile`` (then the modules call the operators)."""
    return bool(torch.compiler.is_compiling())


def ops() -> torch._ops._OpNamespace:
    """``torch.ops.compress`` (registered by the converter, before any tracing can reach here)."""
    return torch.ops.compress
