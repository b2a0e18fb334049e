"""Weight-only int4 layers as integers: codes, group scales and zero points read from a QuantLinear.

One representation (:class:`Int4Weight`) that every int4 consumer reads — the Triton W4A16 kernel,
the compressed-tensors checkpoint and the ONNX MatMulNBits export — so all of them dequantize to
exactly the fake-quant model's weight:

- ``codes``: uint8 ``[N, K]`` with values 0..15, the quantizer's integer codes shifted by
  ``offset`` (8 for signed int4, whose codes are -8..7; 0 for uint4), so every runtime sees
  unsigned nibbles;
- ``scale``: float32 ``[N, G]``; ``zero_point``: uint8 ``[N, G]`` in the same shifted code space
  (8 everywhere for symmetric signed int4);
- ``group_size``: input features per group (K for per-channel scales, G = 1); when it does not
  divide K the last group is shorter (G = ceil(K / group_size)), as the quantizer makes it;
- ``g_idx``: int32 ``[K]`` or None: the group of each input feature. None means the contiguous
  ``k // group_size``; GPTQ's act_order quantizes features in another order and sets it.

``w[n, k] = (codes[n, k] - zero_point[n, g]) * scale[n, g]`` with ``g = g_idx[k]``, computed in
float32 (:func:`dequantize_int4`), which is bit-identical to the fake-quantizer's output.

Packing: :func:`pack_nibbles` stores two codes per byte along K, the even feature in the low
nibble — the layout of the Triton kernel and of ORT's MatMulNBits blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from compress.quantization.numerics.primitives import clamp_scale

from compress.core.errors import UnsupportedModelError


@dataclass(frozen=True)
class Int4Weight:
    """Integer form of a 4-bit weight (see the module docstring for the layout)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor
    group_size: int
    symmetric: bool
    g_idx: torch.Tensor | None = None
    offset: int = 8

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.codes.shape
        return int(n), int(k)

    @property
    def num_groups(self) -> int:
        return int(self.scale.shape[1])

    def group_index(self) -> torch.Tensor:
        """int64 ``[K]``: the group of each input feature."""
        k = self.shape[1]
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(k, device=self.codes.device) // self.group_size


def g_idx_of(wq: Any) -> torch.Tensor | None:
    """The act_order group index of a weight quantizer, if it has one (``g_idx`` buffer)."""
    g = getattr(wq, "g_idx", None)
    return g if isinstance(g, torch.Tensor) and g.numel() > 0 else None


def is_int4_weight_only(mod: Any) -> bool:
    """Whether ``mod`` has integer weights of 4 bits or fewer (their codes fit a nibble) and unquantized inputs."""
    wq = getattr(mod, "weight_quantizer", None)
    if wq is None or not getattr(wq, "enabled", False) or wq.spec.bits > 4 or wq.spec.is_float:
        return False
    iq = getattr(mod, "input_quantizer", None)
    return iq is None or not iq.enabled


def activation_quantizers(model: Any) -> list[str]:
    """Names of the enabled input/output (activation) quantizers anywhere in ``model``.

    Weight-only exports refuse a model that has any, wherever they are placed (on layers, on
    tensor operations or in hooks' modules), rather than silently dropping them."""
    from compress.quantization.numerics.fake_quant import FakeQuantizer

    return [n for n, m in model.named_modules() if isinstance(m, FakeQuantizer) and m.role != "weight" and m.enabled]


def int4_weight(mod: Any, *, where: str = "layer") -> Int4Weight:
    """The integer form of ``mod``'s 4-bit weight, or UnsupportedModelError saying why it has none."""
    wq = getattr(mod, "weight_quantizer", None)
    if wq is None or not wq.enabled:
        raise UnsupportedModelError(f"{where}: its weights are not quantized")
    s = wq.spec
    if s.bits > 4:
        raise UnsupportedModelError(f"{where}: its weights are {s.bits}-bit, not 4-bit")
    if s.is_fp4:
        raise UnsupportedModelError(f"{where}: its weights are fp4 e2m1 ({'NVFP4' if s.scale_dtype == 'fp8_e4m3' else 'MXFP4' if s.scale_dtype == 'e8m0' else 'fp4'}); "
                                    "the int4 kernels (MatMulNBits, GGUF, the W4A16 GEMM) take integer codes: write a "
                                    "compressed-tensors checkpoint (save_compressed_tensors) for vLLM instead")
    if not wq.calibrated:
        raise UnsupportedModelError(f"{where}: its weight quantizer is not calibrated")
    if wq.pre_quant_scale is not None:
        raise UnsupportedModelError(f"{where}: its weight quantizer has a pre_quant_scale; fold it into the weight first")
    weight: torch.Tensor = mod.weight.detach()
    if weight.dim() != 2:
        raise UnsupportedModelError(f"{where}: int4 layers are Linear layers (got a {weight.dim()}-D weight)")
    n, k = weight.shape
    g_idx = g_idx_of(wq)
    scale = clamp_scale(wq.scale.detach().float())  # low-bit scales carry a sign
    zp = wq.zero_point.detach().to(torch.int32)
    if s.granularity == "group":
        gs = int(wq.group_size or s.group_size or k)
        scale, zp = scale.reshape(n, -1), zp.reshape(n, -1)
    elif s.granularity == "channel" and s.axis in (0, -2):
        gs = k
        scale, zp = scale.reshape(n, 1), zp.reshape(n, 1)
    elif s.granularity == "tensor":
        gs = k
        scale, zp = scale.reshape(1, 1).expand(n, 1), zp.reshape(1, 1).expand(n, 1)
    else:
        raise UnsupportedModelError(f"{where}: int4 weight scales per {s.granularity} (axis {s.axis}) are not supported")
    offset = -wq.qmin  # 8 for int4 (-8..7), 0 for uint4 (0..15)
    with torch.no_grad():
        if g_idx is not None:
            if g_idx.numel() != k:
                raise UnsupportedModelError(f"{where}: g_idx has {g_idx.numel()} entries for {k} input features")
            gi = g_idx.long().to(weight.device)
            q = torch.round(weight.float() * (1.0 / scale[:, gi])) + zp[:, gi].float()  # primitives.quantize_codes' arithmetic
            q = q.clamp(wq.qmin, wq.qmax).to(torch.int32)
        else:
            q = wq.int_repr(weight.float()).to(torch.int32)
    codes = (q + offset).to(torch.uint8)
    return Int4Weight(
        codes=codes.contiguous(),
        scale=scale.contiguous().clone(),
        zero_point=(zp + offset).to(torch.uint8).contiguous(),
        group_size=gs,
        symmetric=bool(s.symmetric),
        g_idx=None if g_idx is None else g_idx.to(torch.int32).contiguous(),
        offset=offset,
    )


def dequantize_int4(w: Int4Weight) -> torch.Tensor:
    """float32 ``[N, K]``: ``(codes - zero_point[g]) * scale[g]``, the fake-quant weight exactly."""
    gi = w.group_index().to(w.codes.device)
    return (w.codes.float() - w.zero_point[:, gi].float()) * w.scale[:, gi]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K]`` codes 0..15 -> uint8 ``[N, ceil(K/2)]``, feature 2i in the low nibble of byte i."""
    if codes.shape[-1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    c = codes.to(torch.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor, k: int) -> torch.Tensor:
    """The inverse of :func:`pack_nibbles`: uint8 ``[..., k]`` codes."""
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], -1)[..., :k].contiguous()
