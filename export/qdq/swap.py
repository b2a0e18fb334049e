"""QDQ export of fake-quant models: swap quantizers for ONNX Q/DQ ops, then tidy the graph for ORT.

Why a swap rather than exporting ``torch.fake_quantize_*``: torch.export has no fake-tensor kernel
for ``fake_quantize_*_cachemask``, and decomposed float math would hide the quantization from
runtimes. On a deep copy of the model each FakeQuantizer becomes a small module that calls one of
two custom ops, translated to ``QuantizeLinear``/``DequantizeLinear`` by the dynamo exporter:

- a weight quantizer becomes ``DequantizeLinear(int8 initializer)``: the codes are computed once,
  so the file stores int8 weights (about 4x smaller) and never a float copy;
- an activation quantizer becomes a ``QuantizeLinear -> DequantizeLinear`` pair, in uint8 by
  default (u8s8 is what ORT's x86 kernels want without VNNI; the zero-point shift is exact).

The graph passes (export/qdq/graph.py) then transpose weights into the layout their consumer reads, quantize biases to
int32 (ORT fuses a Conv/Gemm into an integer kernel only when every input comes from a
DequantizeLinear), merge duplicate pairs and drop pairs that re-quantize with identical params.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from compress.quantization.view import FakeQuantizer, functional_weights
from torch import nn

from compress.core.errors import ExportError

log = logging.getLogger(__name__)

__all__ = ["ActivationQDQ", "QDQSummary", "WeightDQ", "swap_quantizers"]

ActDtype = Literal["uint8", "int8"]


# ---- custom ops (traced by torch.export, translated to ONNX Q/DQ) ---------------------------------------
def _bounds(zero_point: torch.Tensor) -> tuple[int, int]:
    return (0, 255) if zero_point.dtype == torch.uint8 else (-128, 127)


def _shape_for(t: torch.Tensor, like: torch.Tensor, axis: int) -> torch.Tensor:
    if t.dim() == 0:
        return t
    shape = [1] * like.dim()
    shape[axis] = -1
    return t.reshape(shape)


@torch.library.custom_op("compress_export::qdq", mutates_args=())
def qdq_op(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int) -> torch.Tensor:
    """QuantizeLinear then DequantizeLinear, with ONNX's semantics (round half to even, saturate)."""
    lo, hi = _bounds(zero_point)
    s = _shape_for(scale, x, axis)
    z = _shape_for(zero_point, x, axis).float()
    return ((torch.clamp(torch.round(x / s) + z, lo, hi) - z) * s).to(x.dtype)


@qdq_op.register_fake
def _qdq_fake(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("compress_export::dq", mutates_args=())
def dq_op(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int, block_size: int) -> torch.Tensor:
    """DequantizeLinear of stored integer codes (blocked along ``axis`` when ``block_size`` > 0)."""
    if block_size:
        s = scale.repeat_interleave(block_size, dim=axis)
        z = zero_point.repeat_interleave(block_size, dim=axis).float()
        return ((q.float() - z) * s.float()).to(scale.dtype)
    s = _shape_for(scale, q, axis)
    z = _shape_for(zero_point, q, axis).float()
    return ((q.float() - z) * s.float()).to(scale.dtype)


@dq_op.register_fake
def _dq_fake(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int, block_size: int) -> torch.Tensor:
    return torch.empty(q.shape, dtype=scale.dtype, device=q.device)


def translation_table() -> dict[Any, Any]:
    """The dynamo exporter's ``custom_translation_table`` for the two ops."""
    from onnxscript import opset18 as op

    def qdq_onnx(x: Any, scale: Any, zero_point: Any, axis: int) -> Any:
        return op.DequantizeLinear(op.QuantizeLinear(x, scale, zero_point, axis=axis), scale, zero_point, axis=axis)

    def dq_onnx(q: Any, scale: Any, zero_point: Any, axis: int, block_size: int) -> Any:
        if block_size:
            from onnxscript import opset21

            return opset21.DequantizeLinear(q, scale, zero_point, axis=axis, block_size=block_size)
        return op.DequantizeLinear(q, scale, zero_point, axis=axis)

    return {torch.ops.compress_export.qdq.default: qdq_onnx, torch.ops.compress_export.dq.default: dq_onnx}


# ---- the swap -----------------------------------------------------------------------------------------
class WeightDQ(nn.Module):
    """Stands in for a weight quantizer: returns the dequantized stored codes (its input is the weight
    it was computed from, unused in the graph so the float weight never reaches the file)."""

    is_quantizer = True

    def __init__(
        self, codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int, block_size: int = 0
    ) -> None:
        super().__init__()
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)
        self.register_buffer("zero_point", zero_point)
        self.axis = axis
        self.block_size = block_size

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        dq = torch.ops.compress_export.dq(self.codes, self.scale, self.zero_point, self.axis, self.block_size)
        return dq.to(weight.dtype)


class ActivationQDQ(nn.Module):
    """Stands in for an activation quantizer: an optional SmoothQuant Mul, then a Q/DQ pair."""

    is_quantizer = True
    pre_scale: torch.Tensor | None

    def __init__(self, scale: torch.Tensor, zero_point: torch.Tensor, axis: int, pre_scale: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("scale", scale)
        self.register_buffer("zero_point", zero_point)
        self.register_buffer("pre_scale", pre_scale)
        self.axis = axis

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_scale is not None:
            x = x * self.pre_scale.to(x.dtype)
        return torch.ops.compress_export.qdq(x, self.scale, self.zero_point, self.axis)


class PreScale(nn.Module):
    """Stands in for a disabled activation quantizer that carries a SmoothQuant factor: the Mul only."""

    is_quantizer = True
    pre_scale: torch.Tensor

    def __init__(self, pre_scale: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("pre_scale", pre_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.pre_scale.to(x.dtype)


@dataclass
class QDQSummary:
    """What the swap did, for logs and the export record."""

    weights: int = 0
    activations: int = 0
    per_channel_weights: int = 0
    blocked_weights: int = 0
    disabled: int = 0
    weight_bits: set[int] = field(default_factory=set)
    activation_dtype: str = "uint8"
    reduce_range: bool = False


def _shift_dtype(scale: torch.Tensor, zp: torch.Tensor, qmin: int, target: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-express integer codes in ``target`` (int8 or uint8): an exact shift of the zero point by 128."""
    signed = qmin < 0
    z = zp.to(torch.int32)
    if target == "uint8" and signed:
        z = z + 128
    elif target == "int8" and not signed:
        z = z - 128
    dtype = torch.uint8 if target == "uint8" else torch.int8
    return scale.detach().float().clone(), z.to(dtype)


def _positive_scales(codes: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor, axis: int, qmin: int, qmax: int,
                     where: str) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Codes and scales with every scale positive: a low-bit symmetric weight's negative scale
    (quantization.numerics.primitives.qparams_from_range) is moved into its codes, ``q * s = (-q) * (-s)``,
    which int8 storage holds (4 bits: [-7, 8]). The integer-kernel paths (QLinearConv, QGemm, the
    bias's int32 codes) then see the positive weight scales ORT's own quantizer writes."""
    if bool((zp != 0).any()) or -qmin > 127:
        raise ExportError(f"{where}: a negative weight scale on a grid that cannot be negated ([{qmin}, {qmax}])")
    neg = _shape_for(scale, codes, axis) < 0
    return torch.where(neg, -codes, codes), scale.abs(), min(qmin, -qmax), max(qmax, -qmin)


def _reduce_range(codes: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor, axis: int, qmin: int, qmax: int) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor
]:
    """Re-quantize int8 weight codes to 7 bits ([-64, 63]) over the same real range (ORT's
    reduce_range: keeps u8s8 products from saturating int16 on CPUs without VNNI). Codes that fit
    7 bits already (QuantSpec.reduce_range, or 4- and 3-bit weights) are returned as they are."""
    if qmin >= -64 and qmax <= 63:
        return codes.to(torch.int8), scale.clone(), zp.to(torch.int8)
    s = _shape_for(scale, codes, axis) if scale.dim() else scale
    z = (_shape_for(zp, codes, axis) if zp.dim() else zp).float()
    real = (codes.float() - z) * s
    s2 = scale * (qmax - qmin) / 127.0
    z2 = torch.clamp(torch.round(-64 - (qmin - zp.float()) * scale / s2), -64, 63)
    s2b = _shape_for(s2, codes, axis) if s2.dim() else s2
    z2b = _shape_for(z2, codes, axis) if z2.dim() else z2
    q2 = torch.clamp(torch.round(real / s2b) + z2b, -64, 63)
    return q2.to(torch.int8), s2.float(), z2.to(torch.int8)


def _weight_of(parent: nn.Module, qname: str) -> torch.Tensor:
    for attr in ("weight", qname.removesuffix("_quantizer")):
        w = getattr(parent, attr, None)
        if isinstance(w, torch.Tensor):
            return w.detach()
    raise ExportError(f"weight quantizer '{qname}' sits in {type(parent).__name__}, which has no weight to quantize")


def _blocked(q: Any, weight: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor, where: str) -> WeightDQ:
    """Per-group weights as a blocked DequantizeLinear (opset 21): blocks of ``group_size`` along the
    input features of a 2-D weight, stored as int4 when they fit (ORT fuses them into MatMulNBits)."""
    gs = int(q.group_size or 0)
    if weight.dim() != 2 or gs <= 0 or weight.shape[1] % gs or tuple(scale.shape) != (weight.shape[0], weight.shape[1] // gs):
        raise ExportError(
            f"{where}: per-group quantization exports for 2-D (Linear) weights with groups along the input "
            f"features; got weight {tuple(weight.shape)}, scales {tuple(scale.shape)}"
        )
    return WeightDQ(codes.to(torch.int8), scale.clone(), zp.to(torch.int8), 1, gs)


def _check_static(q: Any, where: str) -> None:
    spec = q.spec
    if spec.is_fp4:
        raise ExportError(
            f"{where}: fp4 e2m1 (NVFP4/MXFP4) quantization has no ONNX Runtime CPU kernels; write a "
            "compressed-tensors checkpoint (save_compressed_tensors) for vLLM, or use an int8 scheme for ONNX export"
        )
    if spec.is_float:
        raise ExportError(
            f"{where}: float8 (fp8_e4m3) quantization has no ONNX Runtime CPU kernels; run it on CUDA "
            "(quantization.convert(model, backend='cuda')), or use an int8 scheme for ONNX export"
        )
    if spec.dynamic:
        raise ExportError(
            f"{where}: dynamic ({spec.granularity}) activation quantization has no static QDQ form; "
            "use a static activation scheme (e.g. w8a8) or weight-only for ONNX export"
        )
    if not q.calibrated:
        raise ExportError(f"{where}: quantizer is not calibrated; run calibration before export")


def swap_quantizers(model: nn.Module, *, activation_dtype: ActDtype = "uint8", reduce_range: bool = False) -> tuple[
    nn.Module, QDQSummary
]:
    """A deep copy of ``model`` whose fake-quantizers are replaced by QDQ export modules."""
    out = copy.deepcopy(model).eval()
    summary = QDQSummary(activation_dtype=activation_dtype, reduce_range=reduce_range)
    functional = functional_weights(out)
    for pname, parent in list(out.named_modules()):
        for cname, child in list(parent.named_children()):
            if not isinstance(child, FakeQuantizer):
                continue
            where = f"{pname}.{cname}" if pname else cname
            q: Any = child
            if not q.enabled:
                # a disabled quantizer still applies its SmoothQuant factor (the weights carry the inverse)
                pre = q.pre_quant_scale
                setattr(parent, cname, nn.Identity() if pre is None else PreScale(pre.detach().float().clone()))
                summary.disabled += 1
                continue
            _check_static(q, where)
            axis = int(q.axis) if q.axis is not None else 0
            if q.role == "weight":
                if getattr(parent, "bn", None) is not None and hasattr(parent, "fold_bn"):
                    parent.fold_bn()  # QAT conv+BN: the exported conv uses the folded weight
                weight = functional[id(child)] if id(child) in functional else _weight_of(parent, cname)
                codes = q.int_repr(weight).to(torch.int32)
                scale, zp = q.scale.detach().float(), q.zero_point.to(torch.int32)
                qmin, qmax = int(q.qmin), int(q.qmax)
                if qmin >= 0:  # uint8 weights -> int8 (s8 weights are what ORT's kernels take)
                    codes, zp, qmin, qmax = codes - 128, zp - 128, qmin - 128, qmax - 128
                if axis < 0:
                    axis += weight.dim()
                if q.spec.granularity == "group":
                    setattr(parent, cname, _blocked(q, weight, codes, scale, zp, where))
                    summary.weights += 1
                    summary.blocked_weights += 1
                    summary.weight_bits.add(int(q.spec.bits))
                    continue
                if bool((scale < 0).any()):
                    codes, scale, qmin, qmax = _positive_scales(codes, scale, zp, axis, qmin, qmax, where)
                if reduce_range:
                    c8, s8, z8 = _reduce_range(codes, scale, zp, axis, qmin, qmax)
                else:
                    c8, s8, z8 = codes.to(torch.int8), scale.clone(), zp.to(torch.int8)
                setattr(parent, cname, WeightDQ(c8, s8, z8, axis))
                summary.weights += 1
                summary.weight_bits.add(int(q.spec.bits))
                summary.per_channel_weights += int(scale.dim() > 0)
            else:
                scale, zp = _shift_dtype(q.scale, q.zero_point, int(q.qmin), activation_dtype)
                pre = q.pre_quant_scale.detach().float().clone() if q.pre_quant_scale is not None else None
                setattr(parent, cname, ActivationQDQ(scale, zp, axis, pre))
                summary.activations += 1
    return out, summary
