"""Quantized Linear weights as llama.cpp's GGUF block formats, our codes kept as they are.

llama.cpp stores weights in blocks of 32 input features with float16 scales:

- ``Q4_0``: ``d`` (f16) + 16 bytes, ``w = (q - 8) * d``: our symmetric 4-bit groups of 32
  (codes ``q + 8`` with zero point 8) exactly;
- ``Q4_1``: ``d``, ``m`` (f16) + 16 bytes, ``w = q * d + m``: our asymmetric 4-bit groups of 32
  (uint4 codes, ``m = -zero_point * d``);
- ``Q8_0``: ``d`` (f16) + 32 int8, ``w = q * d``: our symmetric 8-bit groups of 32;
- ``MXFP4`` (gpt-oss's type): an e8m0 exponent byte ``e`` + 16 bytes of e2m1 nibbles (bit 3 the sign),
  ``w = e2m1 * 2^(e - 127)``: our MXFP4 groups exactly (the scale is a power of two already, so
  nothing is rounded).

Inside a block, byte ``j`` holds feature ``j`` in its low nibble and feature ``j + 16`` in its high
one. The codes GPTQ/AWQ/RTN chose are written unchanged, so their rounding survives; what changes
is the scale's precision (f16 instead of f32: a relative 2^-11 at most, and for Q4_1 the f16
rounding of ``m``). A grid that does not match a block format (another group size, 3 bits, per
channel, a g_idx permutation) is refused rather than re-quantized by llama.cpp's own rounding.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from compress.quantization.lowering.int4 import int4_weight, is_int4_weight_only

from compress.core.errors import ExportError, UnsupportedModelError
from compress.core.imports import install_hint

BLOCK = 32


def _require_gguf() -> Any:
    try:
        import gguf
    except ImportError as e:
        raise ExportError(f"GGUF export needs the gguf package: {install_hint('llm')}") from e
    return gguf


_NEED = "symmetric 4-bit (Q4_0), asymmetric 4-bit (Q4_1), symmetric 8-bit (Q8_0) or MXFP4 groups of 32"


def check_grid(mod: Any, *, where: str = "layer") -> str:
    """``"Q4_0"``, ``"Q4_1"``, ``"Q8_0"`` or ``"MXFP4"``: the block format of the layer's quantizer spec, from the
    spec and shapes alone (no weights read, so it runs on meta-device models); UnsupportedModelError
    naming the layer and the grid it would need otherwise."""
    wq = getattr(mod, "weight_quantizer", None)
    if wq is None or not wq.enabled:
        raise UnsupportedModelError(f"{where}: not a quantized layer; float layers are written as F16/F32")
    s = wq.spec
    k = int(mod.in_features)
    if s.granularity != "group" or s.group_size != BLOCK:
        size = f"groups of {s.group_size}" if s.granularity == "group" else f"per {s.granularity}"
        raise UnsupportedModelError(f"{where}: {s.bits}-bit {size} has no llama.cpp block format; quantize with {_NEED}")
    if k % BLOCK:
        raise UnsupportedModelError(f"{where}: {k} input features are not whole blocks of {BLOCK} (llama.cpp rows)")
    if getattr(mod, "input_quantizer", None) is not None:
        raise UnsupportedModelError(f"{where}: quantized inputs are not written to GGUF (llama.cpp quantizes its own)")
    if s.is_fp4:
        if s.scale_dtype != "e8m0":
            raise UnsupportedModelError(f"{where}: fp4 with {s.scale_dtype} scales has no llama.cpp block format "
                                        f"(its MXFP4 takes e8m0 scales); quantize with {_NEED}")
        return "MXFP4"
    if s.bits == 4 and is_int4_weight_only(mod):
        return "Q4_0" if s.symmetric else "Q4_1"
    if s.bits == 8 and s.symmetric and s.dtype == "int8" and not s.reduce_range:
        return "Q8_0"
    raise UnsupportedModelError(f"{where}: {s.bits}-bit {'sym' if s.symmetric else 'asym'} weights; quantize with {_NEED}")


def gguf_type(mod: Any, *, where: str = "layer") -> Any:
    """The ``gguf.GGMLQuantizationType`` whose grid is the layer's own: Q4_0, Q4_1 or Q8_0.
    UnsupportedModelError naming the layer and the grid it would need otherwise."""
    gguf = _require_gguf()
    name = check_grid(mod, where=where)
    if name not in ("Q8_0", "MXFP4"):
        w = int4_weight(mod, where=where)
        if w.g_idx is not None:
            raise UnsupportedModelError(f"{where}: a g_idx (act_order permutation) has no GGUF form; use static groups")
        name = "Q4_0" if w.symmetric else "Q4_1"
    return getattr(gguf.GGMLQuantizationType, name)


def _nibbles(codes: torch.Tensor) -> np.ndarray:
    """uint8 codes ``[N, B, 32]`` -> ``[N, B, 16]``: feature j low nibble, j + 16 high."""
    c = codes.to(torch.uint8)
    return (c[..., :16] | (c[..., 16:] << 4)).numpy()


def _f16_bytes(x: torch.Tensor) -> np.ndarray:
    """float ``[N, B]`` -> uint8 ``[N, B, 2]`` (little-endian float16, as GGUF stores it)."""
    return x.float().numpy().astype(np.float16)[..., None].view(np.uint8)


def gguf_blocks(mod: Any, *, where: str = "layer") -> tuple[np.ndarray, Any]:
    """``(data, qtype)``: the layer's weight as GGUF blocks, uint8 ``[N, K/32 * bytes_per_block]``
    (the row layout ``gguf.GGUFWriter.add_tensor(..., raw_dtype=qtype)`` takes), and its type."""
    gguf = _require_gguf()
    qtype = gguf_type(mod, where=where)
    n, k = int(mod.out_features), int(mod.in_features)
    blocks = k // BLOCK
    if qtype == gguf.GGMLQuantizationType.Q8_0:
        wq: Any = mod.weight_quantizer
        weight: Any = mod.weight
        codes = wq.int_repr(weight.detach()).to(torch.int8).reshape(n, blocks, BLOCK)
        scale = wq.scale.detach().reshape(n, blocks)
        parts = [_f16_bytes(scale), codes.numpy().view(np.uint8)]
    elif qtype == gguf.GGMLQuantizationType.MXFP4:
        from compress.quantization.lowering.fp4 import fp4_weight

        f4 = fp4_weight(mod, where=where)
        assert f4.e8m0 is not None
        parts = [f4.e8m0.reshape(n, blocks).numpy()[..., None], _nibbles(f4.nibbles.reshape(n, blocks, BLOCK))]
    else:
        w = int4_weight(mod, where=where)
        codes = w.codes.reshape(n, blocks, BLOCK)
        if qtype == gguf.GGMLQuantizationType.Q4_0:
            # our symmetric codes are q + 8 with zero point 8: Q4_0's (nibble - 8) * d exactly
            if not bool((w.zero_point == 8).all()):
                raise UnsupportedModelError(f"{where}: symmetric codes without zero point 8 do not map to Q4_0")
            parts = [_f16_bytes(w.scale), _nibbles(codes)]
        else:
            d16 = w.scale.half().float()  # m from the scale llama.cpp will read, so q * d + m = (q - zp) * d
            parts = [_f16_bytes(d16), _f16_bytes(-w.zero_point.float() * d16), _nibbles(codes)]
    data = np.concatenate(parts, axis=-1).reshape(n, -1)
    return np.ascontiguousarray(data), qtype


def gguf_reference(mod: Any, *, where: str = "layer") -> torch.Tensor:
    """float32 ``[N, K]``: what llama.cpp computes from :func:`gguf_blocks` — our codes with the
    scales (and Q4_1 offsets) rounded to float16 as GGUF stores them."""
    gguf = _require_gguf()
    qtype = gguf_type(mod, where=where)
    n = int(mod.out_features)
    if qtype == gguf.GGMLQuantizationType.MXFP4:
        return mod.quantized_weight().detach().float()  # powers of two and e2m1 values: nothing rounded
    if qtype == gguf.GGMLQuantizationType.Q8_0:
        wq: Any = mod.weight_quantizer
        weight: Any = mod.weight
        codes = wq.int_repr(weight.detach()).float()
        return codes * wq.scale.detach().reshape(n, -1).half().float().repeat_interleave(BLOCK, dim=1)
    w = int4_weight(mod, where=where)
    d = w.scale.half().float()
    if qtype == gguf.GGMLQuantizationType.Q4_0:
        return (w.codes.float() - 8) * d.repeat_interleave(BLOCK, dim=1)
    m = (-w.zero_point.float() * d).half().float()
    return w.codes.float() * d.repeat_interleave(BLOCK, dim=1) + m.repeat_interleave(BLOCK, dim=1)
