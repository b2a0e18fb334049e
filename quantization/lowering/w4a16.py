"""W4A16Linear: a weight-only int4 Linear running the Triton W4A16 kernel (CUDA; CPU under the interpreter).

Built from a calibrated QuantLinear whose weights are 4-bit and whose inputs are not quantized
(``w4_weight_only_g128``, GPTQ, AWQ): the weight is stored once as packed nibbles with float32
group scales and uint8 zero points (:mod:`quantization.lowering.int4`), activations stay fp16/bf16 (or
fp32) and the weight is dequantized inside the kernel (decode), or once per call into the
activation dtype for cuBLAS from 32 rows on (prefill; see quantization/lowering/kernels/w4a16.py). The
dequantized weight is exactly the fake-quant model's, so outputs differ from it only by
accumulation order.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from compress.quantization.lowering.int4 import (
    Int4Weight,
    int4_weight,
    is_int4_weight_only,
    pack_nibbles,
    unpack_nibbles,
)
from compress.quantization.lowering.kernels import ACTIVATIONS, load
from compress.quantization.lowering.kernels.ops import compiling, ops
from compress.quantization.lowering.kernels.ops import register as register_ops
from torch import nn

from compress.core.errors import CompressError, UnsupportedModelError

log = logging.getLogger(__name__)

#: group sizes PyTorch's int4 kernel (tinygemm, ``aten._weight_int4pack_mm``) takes
TINYGEMM_GROUPS = (32, 64, 128, 256)
BACKENDS = ("auto", "triton", "tinygemm")


def tinygemm_refusal(n: int, k: int, group_size: int, has_g_idx: bool) -> str | None:
    """Why PyTorch's int4 kernel cannot run this weight (None when it can)."""
    if has_g_idx:
        return "act_order's g_idx reorders groups; tinygemm takes contiguous groups"
    if group_size not in TINYGEMM_GROUPS or k % group_size:
        return f"tinygemm takes groups of {'/'.join(map(str, TINYGEMM_GROUPS))} dividing K (got {group_size}, K={k})"
    if n % 8 or k % 32:
        return f"tinygemm needs N % 8 == 0 and K % 32 == 0 (got N={n}, K={k})"
    return None


def tinygemm_pack(packed: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, k: int) -> tuple[
    torch.Tensor, torch.Tensor, int
]:
    """Our packed int4 weight as tinygemm's operands on ``packed``'s (CUDA) device: the tiled int4
    weight, the bf16 ``[G, N, 2]`` scales-and-zeros and the inner K-tile count.

    tinygemm dequantizes ``(u - 8) * s + z`` with a float zero ``z``; ours is ``(u - zp) * s``,
    so ``z = (8 - zp) * s`` (0 for symmetric int4). Scales and zeros are rounded to bf16 there."""
    codes = unpack_nibbles(packed, k)  # [N, K] uint8, 0..15
    # tinygemm's packer wants the even feature in the high nibble (ours keeps it in the low one)
    hi_first = ((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8).contiguous()
    inner = 8 if k % 128 == 0 else 4 if k % 64 == 0 else 2
    tiled = torch.ops.aten._convert_weight_to_int4pack(hi_first, inner)
    return tiled, tinygemm_scales_and_zeros(scale, zero_point), inner


def tinygemm_scales_and_zeros(scale: torch.Tensor, zero_point: torch.Tensor | None) -> torch.Tensor:
    """tinygemm's bf16 ``[G, N, 2]`` operand for our ``[N, G]`` scales and uint8 zero points: it
    dequantizes ``(u - 8) * s + z``, ours ``(u - zp) * s``, so ``z = (8 - zp) * s``."""
    s = scale.float()
    zeros = torch.zeros_like(s) if zero_point is None else (8.0 - zero_point.float()) * s
    return torch.stack([s.t(), zeros.t()], dim=-1).to(torch.bfloat16).contiguous()


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` ``[N, G]`` with ``N`` contiguous (strides ``(1, N)``)."""
    return t.t().contiguous().t()


class W4A16Linear(nn.Module):
    """Linear with int4 weights ``[out, in/2]`` packed two per byte, group scales, fp16/bf16 activations."""

    weight_packed: torch.Tensor
    weight_scale: torch.Tensor
    weight_zero_point: torch.Tensor | None
    g_idx: torch.Tensor | None
    bias: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, *, group_size: int) -> None:
        super().__init__()
        register_ops()  # torch.ops.compress.*, called under torch.compile
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.activation = "none"
        self.backend = "auto"
        self._tinygemm_refusal: str | None = "not built"

    def set_backend(self, backend: str) -> W4A16Linear:
        """Which kernel runs: ``triton`` (ours, exact scales), ``tinygemm`` (PyTorch's
        ``_weight_int4pack_mm``, computing in bf16) or ``auto`` (the faster per shape, timed once,
        for fp16/bf16 inputs; fp32 inputs keep ours)."""
        if backend not in BACKENDS:
            raise CompressError(f"W4A16Linear: backend '{backend}' unknown; valid: {', '.join(BACKENDS)}")
        if backend == "tinygemm" and self._tinygemm_refusal is not None:
            raise UnsupportedModelError(f"W4A16Linear: {self._tinygemm_refusal}")
        self.backend = backend
        return self

    @classmethod
    def from_int4(cls, w: Int4Weight, bias: torch.Tensor | None, *, activation: str = "none") -> W4A16Linear:
        n, k = w.shape
        if k % 2:
            raise UnsupportedModelError(f"it has {k} input features; the int4 kernel packs pairs (an even count)")
        new = cls(k, n, group_size=w.group_size)
        new.register_buffer("weight_packed", pack_nibbles(w.codes))
        # scales and zero points [N, G] stored column-major: a K-tile's BLOCK_N values are adjacent
        new.register_buffer("weight_scale", _column_major(w.scale.float()))
        # symmetric int4 has zero point 8 everywhere: the kernel uses the constant instead of loading it
        sym = bool((w.zero_point == 8).all())
        new.register_buffer("weight_zero_point", None if sym else _column_major(w.zero_point))
        new.register_buffer("g_idx", w.g_idx)
        new._tinygemm_refusal = tinygemm_refusal(n, k, w.group_size, w.g_idx is not None)
        new.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        if activation not in ACTIVATIONS:
            raise CompressError(f"unknown fused activation '{activation}'; valid: {', '.join(ACTIVATIONS)}")
        new.activation = activation
        return new

    @classmethod
    def from_quant(cls, mod: Any, *, activation: str = "none", input_quantizer: Any = None) -> W4A16Linear:
        """A W4A16Linear computing what the weight-only int4 ``QuantLinear`` ``mod`` computes
        (``input_quantizer`` is accepted for the converter's one call form; weight-only layers have none)."""
        if not is_int4_weight_only(mod):
            raise UnsupportedModelError("it is not a weight-only 4-bit layer")
        if getattr(mod, "output_quantizer", None) is not None:
            raise UnsupportedModelError("it has an output quantizer; the W4A16 kernel has no output quantization")
        new = cls.from_int4(int4_weight(mod), mod.bias, activation=activation)
        return new.to(mod.weight.device)

    def _tinygemm_operands(self) -> tuple[torch.Tensor, torch.Tensor]:
        """tinygemm's weight layout, built on first use on the device (the packer runs on CUDA only)."""
        dev = self.weight_packed.device
        cached = getattr(self, "_tinygemm", None)
        if cached is None or cached[0].device != dev:
            tiled, sz, _ = tinygemm_pack(self.weight_packed, self.weight_scale, self.weight_zero_point, self.in_features)
            cached = (tiled, sz)
            self._tinygemm = cached
        return cached

    def _run_tinygemm(self, x2: torch.Tensor, operands: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        tiled, sz = operands if operands is not None else self._tinygemm_operands()
        y = torch.ops.aten._weight_int4pack_mm(x2.to(torch.bfloat16), tiled, self.group_size, sz)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        if self.activation == "relu":
            y = torch.relu_(y)
        elif self.activation == "gelu":
            y = torch.nn.functional.gelu(y)
        return y.to(x2.dtype)

    def _use_tinygemm(self, x2: torch.Tensor) -> bool:
        if self.backend == "triton" or not x2.is_cuda or self._tinygemm_refusal is not None:
            return False
        if self.backend == "tinygemm":
            return True
        # auto: the faster of the two at this shape, timed once. tinygemm computes in bf16 (scales,
        # zeros, activations): for fp16 models that rounding (2^-9 relative) sits far below the
        # int4 weights' own error; fp32 inputs ask for exact arithmetic and keep ours
        return x2.dtype in (torch.float16, torch.bfloat16) and _faster_is_tinygemm(self, x2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if compiling():  # no timing while traced: tinygemm only when asked for
            if self.backend == "tinygemm" and x2.is_cuda:
                return self._run_tinygemm(x2).reshape(*lead, self.out_features)
            y = ops().w4a16_gemm(x2, self.weight_packed, self.weight_scale, self.group_size, self.weight_zero_point,
                                 self.g_idx, self.bias, ACTIVATIONS.index(self.activation))
            return y.reshape(*lead, self.out_features)
        if self._use_tinygemm(x2):
            return self._run_tinygemm(x2).reshape(*lead, self.out_features)
        y = load("w4a16").w4a16_gemm(
            x.reshape(-1, self.in_features), self.weight_packed, scale=self.weight_scale, group_size=self.group_size,
            zero_point=self.weight_zero_point, g_idx=self.g_idx, bias=self.bias, activation=self.activation,
        )
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        zp = "asym" if self.weight_zero_point is not None else "sym"
        act = ", act_order" if self.g_idx is not None else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, int4 {zp} g{self.group_size}{act}, "
            f"act={self.activation}, backend={self.backend}"
        )


_FASTER: dict[tuple[Any, ...], bool] = {}


def _faster_is_tinygemm(layer: W4A16Linear, x2: torch.Tensor) -> bool:
    """Whether tinygemm beats our kernel at this layer's shape and M bucket (timed once per key)."""
    from compress.quantization.lowering.kernels.gemm import m_bucket

    key = (m_bucket(x2.shape[0]), layer.out_features, layer.in_features, layer.group_size, x2.dtype,
           layer.weight_zero_point is not None, layer.bias is not None, layer.activation)
    if key not in _FASTER:
        # CUDA-graph replays, as the fused kernel's tuner times: eager timings of microsecond kernels
        # rank launch overhead (on an H200 they chose tinygemm at 16 rows of 4096x4096, 0.0225 ms in
        # graph replays against our 0.0160)
        from triton.testing import do_bench_cudagraph as do_bench

        k4 = load("w4a16")
        # each timed on copies of the weight that together exceed L2: decode reads every layer from
        # device memory, and the L2-hot timing ranked the two the other way round (kernels/w4a16.py
        # hbm_copies)
        mine = k4._weight(layer.weight_packed, layer.weight_scale, layer.weight_zero_point, layer.g_idx,
                          layer.group_size, x2.device)
        copies = k4.hbm_copies(mine)
        tiled, sz = layer._tinygemm_operands()
        tg_copies = [(tiled, sz)] + [(tiled.clone(), sz.clone()) for _ in copies[1:]]

        def ours() -> list[torch.Tensor]:
            return [k4.w4a16_gemm(x2, w.packed, scale=w.scale, group_size=layer.group_size, zero_point=w.zp,
                                  g_idx=layer.g_idx, bias=layer.bias, activation=layer.activation) for w in copies]

        def theirs() -> list[torch.Tensor]:
            return [layer._run_tinygemm(x2, ops) for ops in tg_copies]

        t_ours = float(do_bench(ours, rep=20, return_mode="median")) / len(copies)
        t_tg = float(do_bench(theirs, rep=20, return_mode="median")) / len(copies)
        _FASTER[key] = t_tg < t_ours
        log.info("W4A16 [%d x %d] M<=%d: tinygemm %.4f ms, triton %.4f ms: %s", layer.out_features,
                 layer.in_features, key[0], t_tg, t_ours, "tinygemm" if _FASTER[key] else "triton")
    return _FASTER[key]
