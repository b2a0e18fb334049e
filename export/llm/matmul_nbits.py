"""ONNX Runtime's ``com.microsoft.MatMulNBits`` (4-bit weights) for the LLM generation export
(export/llm/onnx.py): the tensor layout, a Linear that computes and exports as that op, and the
packing of Linears that read one input (q/k/v, gate/up) into one op, as ONNX Runtime GenAI's model
builder writes them: at one token per step each MatMulNBits call pays a fixed cost (measured on
SmolLM2-135M, 1 thread: k_proj's 576x192 took 16 us, q_proj's 576x576 27 us), so one call per input
instead of three (or two) saves that cost, and the outputs are the same columns.

``accuracy_level`` 4 lets ORT's CPU kernel quantize the activations to int8 per block of the weight
(scale ``max|a| / 127``, round half to even) and sum integer products exactly; the torch forward of
the op does the same, so the export's check compares like with like (measured on an AVX-512 VNNI
CPU: 130 dB between ORT and this forward, against about 40 dB between level 4 and float). 8-bit
weights (``bits=8``, one code per byte, default zero point 128) serve an lm_head quantized at
export time as llama.cpp quantizes a tied embedding whose width is not a multiple of 256 (Q8_0).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from compress.quantization.lowering.int4 import Int4Weight
from torch import nn

from compress.core.errors import UnsupportedModelError

# ---- MatMulNBits -------------------------------------------------------------------------------------


def matmul_nbits_tensors(w: Int4Weight, block_size: int, bits: int = 4) -> tuple[torch.Tensor, torch.Tensor,
                                                                                  torch.Tensor | None]:
    """``(B, scales, zero_points)`` as MatMulNBits stores them for ``w`` with ``block_size``.

    4 bits: B uint8 ``[N, k_blocks, block_size/2]`` (feature 2i of a block in the low nibble); scales
    float32 ``[N * k_blocks]``; zero points uint8 ``[N * ceil(k_blocks/2)]`` (two per byte, the
    even block low) or None when all are 8 (MatMulNBits' default for 4 bits). 8 bits: one code
    (B ``[N, k_blocks, block_size]``) and one zero point per byte, None when all are 128.
    """
    n, k = w.shape
    k_blocks = math.ceil(k / block_size)
    gi = torch.arange(k) // w.group_size
    codes = w.codes
    if k_blocks * block_size != k:  # pad with each row's last zero point: dequantizes to exactly 0
        pad = k_blocks * block_size - k
        codes = torch.cat([codes, w.zero_point[:, gi[-1:]].expand(n, pad)], dim=1)
    if bits == 8:
        b = codes.reshape(n, k_blocks, block_size).contiguous()
    else:
        b = (codes[:, 0::2] | (codes[:, 1::2] << 4)).reshape(n, k_blocks, block_size // 2).contiguous()
    if w.num_groups == k_blocks:
        scales, zps = w.scale, w.zero_point
    elif w.num_groups == 1:
        scales, zps = w.scale.expand(n, k_blocks), w.zero_point.expand(n, k_blocks)
    else:
        raise UnsupportedModelError(f"{w.num_groups} groups do not map to {k_blocks} blocks of {block_size}")
    zp_packed = None
    if bits == 8:
        return b, scales.float().reshape(-1).contiguous(), (
            None if bool((zps == 128).all()) else zps.to(torch.uint8).reshape(-1).contiguous())
    if not bool((zps == 8).all()):
        z = zps if k_blocks % 2 == 0 else torch.cat([zps, torch.full((n, 1), 8, dtype=torch.uint8)], dim=1)
        zp_packed = (z[:, 0::2] | (z[:, 1::2] << 4)).reshape(-1).contiguous()
    return b, scales.float().reshape(-1).contiguous(), zp_packed


def quantize_blocks_int8(x: torch.Tensor, k: int, block_size: int) -> torch.Tensor:
    """``x`` ``[..., K]`` as ORT's MatMulNBits kernel sees it at accuracy_level 4: per block of
    ``block_size`` features, ``round(x * 127 / max|x|) * max|x| / 127`` (round half to even, a zero
    block stays zero)."""
    blocks = math.ceil(k / block_size)
    xp = torch.nn.functional.pad(x, (0, blocks * block_size - k)).reshape(*x.shape[:-1], blocks, block_size)
    amax = xp.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(xp * inv) * (amax / 127.0)).reshape(*x.shape[:-1], -1)[..., :k]


class _MatMulNBitsFn(torch.autograd.Function):
    """``x @ W^T`` with W dequantized from MatMulNBits tensors (at accuracy_level 4 with ``x``
    quantized as the kernel quantizes it); exported as the ORT contrib op."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, b: torch.Tensor, scales: torch.Tensor, zp: torch.Tensor | None,
                k: int, n: int, block_size: int, accuracy_level: int, bits: int) -> torch.Tensor:
        k_blocks = b.shape[1]
        if bits == 8:
            codes = b.reshape(n, k_blocks * block_size).float()
        else:
            codes = torch.stack([b & 0xF, b >> 4], dim=-1).reshape(n, k_blocks * block_size).float()
        if zp is None:
            z = torch.full((n, k_blocks), float(1 << (bits - 1)))
        elif bits == 8:
            z = zp.reshape(n, k_blocks).float()
        else:
            z = torch.stack([zp & 0xF, zp >> 4], dim=-1).reshape(n, -1)[:, :k_blocks].float()
        w = (codes.reshape(n, k_blocks, block_size) - z[..., None]) * scales.reshape(n, k_blocks, 1)
        if accuracy_level == 4:
            x = quantize_blocks_int8(x, k, block_size)
        return x @ w.reshape(n, -1)[:, :k].T.to(x.dtype)

    @staticmethod
    def symbolic(g: Any, x: Any, b: Any, scales: Any, zp: Any, k: int, n: int, block_size: int,
                 accuracy_level: int, bits: int) -> Any:
        inputs = [x, b, scales] + ([zp] if zp is not None and not _is_none(zp) else [])
        out = g.op("com.microsoft::MatMulNBits", *inputs, K_i=k, N_i=n, bits_i=bits, block_size_i=block_size,
                   accuracy_level_i=accuracy_level)
        sizes = x.type().varyingSizes()
        if sizes is not None:  # the output type, which the exporter cannot infer for a contrib op
            out.setType(x.type().with_sizes([*sizes[:-1], n]))
        return out


def _is_none(v: Any) -> bool:
    return hasattr(v, "node") and v.node().mustBeNone()


class MatMulNBitsLinear(nn.Module):
    """A Linear computing with int4 weights held as MatMulNBits tensors (exports as that op)."""

    b: torch.Tensor
    scales: torch.Tensor
    zero_points: torch.Tensor | None
    bias: torch.Tensor | None

    def __init__(self, w: Int4Weight, bias: torch.Tensor | None, *, accuracy_level: int = 0, where: str = "layer",
                 bits: int = 4) -> None:
        super().__init__()
        self.bits = bits
        if w.g_idx is not None:
            raise UnsupportedModelError(f"{where}: a g_idx (act_order permutation) is not exported; use static groups")
        self.out_features, self.in_features = w.shape
        gs = w.group_size if w.num_groups > 1 else w.shape[1]
        self.block_size = max(16, 1 << (gs - 1).bit_length())  # MatMulNBits: a power of two >= 16
        if w.num_groups > 1 and self.block_size != w.group_size:
            raise UnsupportedModelError(f"{where}: group_size {w.group_size} is not a power of two >= 16 (MatMulNBits)")
        b, scales, zp = matmul_nbits_tensors(w, self.block_size, bits)
        self.register_buffer("b", b)
        self.register_buffer("scales", scales)
        self.register_buffer("zero_points", zp)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.accuracy_level = accuracy_level

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _MatMulNBitsFn.apply(x, self.b, self.scales, self.zero_points, self.in_features, self.out_features,
                                 self.block_size, self.accuracy_level, self.bits)
        return y + self.bias if self.bias is not None else y


def _cat(layers: list[MatMulNBitsLinear]) -> MatMulNBitsLinear:
    """One MatMulNBitsLinear computing ``layers``' outputs side by side (their rows stacked)."""
    first = layers[0]
    new = MatMulNBitsLinear.__new__(MatMulNBitsLinear)
    nn.Module.__init__(new)
    new.in_features, new.block_size, new.accuracy_level = first.in_features, first.block_size, first.accuracy_level
    new.bits = first.bits
    new.out_features = sum(m.out_features for m in layers)
    new.register_buffer("b", torch.cat([m.b for m in layers]))
    new.register_buffer("scales", torch.cat([m.scales for m in layers]))
    zps = None
    if any(m.zero_points is not None for m in layers):  # a symmetric part's zero points are all 8 (0x88 per byte)
        per_row = math.ceil(first.b.shape[1] / 2)
        zps = torch.cat([m.zero_points if m.zero_points is not None
                         else torch.full((m.out_features * per_row,), 0x88, dtype=torch.uint8) for m in layers])
    new.register_buffer("zero_points", zps)
    bias = None
    if any(m.bias is not None for m in layers):
        bias = torch.cat([m.bias if m.bias is not None else torch.zeros(m.out_features) for m in layers])
    new.register_buffer("bias", bias)
    return new


def _packable(layers: list[Any]) -> bool:
    first = layers[0]
    return all(isinstance(m, MatMulNBitsLinear) and m.in_features == first.in_features
               and m.block_size == first.block_size and m.accuracy_level == first.accuracy_level
               and m.bits == first.bits for m in layers)


class PackedGateUpMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate and up as one MatMulNBits (``[gate | up]`` outputs)."""

    def __init__(self, gate_up: MatMulNBitsLinear, down: nn.Module, act: nn.Module, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj, self.act_fn, self.intermediate = gate_up, down, act, intermediate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split([self.intermediate, self.intermediate], dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


def _gated(mlp: Any, packed: PackedGateUpMLP) -> bool:
    """Whether ``mlp`` computes ``down(act(gate(x)) * up(x))``: its gate/up/down/act parts, nothing
    else, and the packed form's output equal to its own on a random input (checked, not assumed from
    the class: a family that wires the same parts otherwise keeps its layers separate)."""
    if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        return False
    if {n for n, _ in mlp.named_children()} - {"gate_proj", "up_proj", "down_proj", "act_fn"}:
        return False
    x = torch.randn(2, 3, mlp.gate_proj.in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = mlp(x), packed(x)
    return bool(want.shape == got.shape and torch.allclose(want, got, rtol=1e-4, atol=1e-5))


def pack_projections(layers: Any, *, attn: str) -> int:
    """Pack each decoder layer's q/k/v MatMulNBitsLinears into the attention's ``qkv_proj`` (read by
    :class:`export.llm.onnx.KVDecoder` as ``[q | k | v]``, as for Phi-3), and a gated MLP's gate/up
    into :class:`PackedGateUpMLP` (where the MLP is checked to compute ``down(act(gate) * up)``);
    in place. Returns how many packs were made."""
    packed = 0
    for layer in layers:
        a = getattr(layer, attn)
        parts: list[Any] = [getattr(a, n, None) for n in ("q_proj", "k_proj", "v_proj")]
        if None not in parts and _packable(parts):
            a.qkv_proj = _cat(parts)
            for n in ("q_proj", "k_proj", "v_proj"):
                delattr(a, n)
            packed += 1
        mlp: Any = getattr(layer, "mlp", None)
        gate, up = getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)
        if gate is not None and up is not None and _packable([gate, up]):
            candidate = PackedGateUpMLP(_cat([gate, up]), mlp.down_proj, mlp.act_fn, gate.out_features)
            if _gated(mlp, candidate):
                layer.mlp = candidate
                packed += 1
    return packed


#: llama.cpp's type for an output / tied token embedding whose width is not a multiple of 256 (its
#: k-quants' super-block), SmolLM2's 576 among them: Q8_0, symmetric 8-bit blocks of 32
HEAD_BITS, HEAD_BLOCK = 8, 32


def int8_head(linear: nn.Linear, *, accuracy_level: int, where: str = "lm_head") -> MatMulNBitsLinear:
    """``linear`` (a float lm_head) as an 8-bit MatMulNBits: round to nearest, symmetric, one scale
    per block of 32 input features (``max|w| / 127``; a shorter last block where K is not a multiple
    of 32), what llama.cpp's Q8_0 stores."""
    w = linear.weight.detach().float()
    n, k = w.shape
    blocks = math.ceil(k / HEAD_BLOCK)
    wp = torch.nn.functional.pad(w, (0, blocks * HEAD_BLOCK - k)).reshape(n, blocks, HEAD_BLOCK)
    scale = (wp.abs().amax(-1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
    codes = (torch.round(wp / scale[..., None]).clamp(-127, 127) + 128).reshape(n, -1)[:, :k].to(torch.uint8)
    q = Int4Weight(codes=codes.contiguous(), scale=scale.contiguous(), zero_point=torch.full((n, blocks), 128, dtype=torch.uint8),
                   group_size=HEAD_BLOCK, symmetric=True, offset=128)
    bias = linear.bias.detach() if linear.bias is not None else None
    return MatMulNBitsLinear(q, bias, accuracy_level=accuracy_level, where=where, bits=HEAD_BITS)
