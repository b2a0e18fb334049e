"""W8A8 Linears for the LLM generation export (export/llm/onnx.py, ``weights="w8a8"``).

Two forms, one per activation scheme, each a module that computes the fake-quant Linear in PyTorch
and exports (TorchScript, ``autograd.Function.symbolic``) as the ONNX ops that ORT runs in integer:

- static per-tensor activations (``w8a8``): ``[Mul(1/s)] -> QuantizeLinear -> DequantizeLinear``
  on the input, ``DequantizeLinear`` of the int8 weight stored transposed ``[K, N]`` (per-channel
  scales on axis 1), ``MatMul`` (+ bias); Linears reading one tensor (q/k/v, gate/up) share one
  Q/DQ pair. ORT's QDQ fusion turns every such MatMul into ``MatMulIntegerToFloat`` (u8s8, with
  the calibrated uint8 activations). On x86 CPUs without VNNI those kernels add pairs of products
  in int16, which full 8-bit weights overflow: quantize with 7-bit weight codes
  (``weights: {reduce_range: true}``) and the file computes the fake-quant model exactly (the
  export's ORT check raises otherwise, naming this). Writing the activations as int8 instead
  does not help: ORT converts them back to uint8 before fusing, and then leaves the MatMuls that
  share an input (q/k/v, gate/up) in float.
- per-token dynamic activations (``w8a8_dynamic``): the scale of each token row is computed in the
  graph as the fake quantizer does (``max|x| / 127``, at least float32 eps; ``x * (1/scale)``
  rounded half to even, clipped to [-128, 127]), the codes go through ``MatMulInteger`` against
  the int8 weight codes, and the int32 result is scaled by the row scale times the per-channel
  weight scale. With 7-bit weight codes (``reduce_range``) the activation codes enter as uint8
  (``q + 128``, zero point 128): ORT's fast u8s8 kernel, exact for such weights; with full 8-bit
  weights as int8 (s8s8: exact, but several times slower on CPUs without VNNI). ``DynamicQuantizeLinear`` is not used: it computes one
  uint8 scale per tensor, not per token.

Only Linear inputs may be quantized (``quantize_ops: false`` or a dynamic scheme): the generation
graph is a hand-written forward (:class:`export.llm.onnx.KVDecoder`), so quantizers placed on
residual adds, RoPE or the attention matmuls, and simulated int8 KV caches, are refused by
:func:`check_w8a8_exportable` with the place named.
"""

from __future__ import annotations

from typing import Any

import torch
from compress.quantization.view import input_quantizer, view
from torch import nn

from compress.core.errors import UnsupportedModelError

#: op kinds a linear-only placement has entries for: the Linears and the pass-through ops (an
#: attention output's transpose/reshape) that hand o_proj its quantized input
_LINEAR_KINDS = ("linear", "reshape")


class _QDQFn(torch.autograd.Function):
    """QuantizeLinear -> DequantizeLinear (per tensor) with ONNX semantics: ``x / scale``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
        z = zero_point.float()
        lo, hi = (0, 255) if zero_point.dtype == torch.uint8 else (-128, 127)
        return (torch.clamp(torch.round(x / scale) + z, lo, hi) - z) * scale

    @staticmethod
    def symbolic(g: Any, x: Any, scale: Any, zero_point: Any) -> Any:
        return g.op("DequantizeLinear", g.op("QuantizeLinear", x, scale, zero_point), scale, zero_point)


class _WeightDQFn(torch.autograd.Function):
    """DequantizeLinear of int8 codes ``[K, N]`` with per-channel scales on axis 1."""

    @staticmethod
    def forward(ctx: Any, codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
        return (codes.float() - zero_point.float()) * scale

    @staticmethod
    def symbolic(g: Any, codes: Any, scale: Any, zero_point: Any) -> Any:
        return g.op("DequantizeLinear", codes, scale, zero_point, axis_i=1)


class _DynamicMatMulFn(torch.autograd.Function):
    """Per-token int8 quantization of ``x`` and an integer matmul, scaled back to float.

    ``unsigned``: the codes enter MatMulInteger as uint8 (``q + 128``, zero point 128), ORT's fast
    u8s8 path; exact only when the weight codes are 7-bit (its int16 pair sums), so it is used for
    reduce_range weights, and the s8s8 path (exact, slower on CPUs without VNNI) otherwise."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, codes: torch.Tensor, w_scale: torch.Tensor, unsigned: bool) -> torch.Tensor:
        scale = torch.clamp(x.abs().amax(dim=-1, keepdim=True) / 127.0, min=torch.finfo(torch.float32).eps)
        q = torch.clamp(torch.round(x * (1.0 / scale)), -128, 127)
        # integer products summed exactly in float64 (|sum| < 2^31), as MatMulInteger's int32 does
        acc = (q.double() @ codes.double()).float()
        return acc * scale * w_scale

    @staticmethod
    def symbolic(g: Any, x: Any, codes: Any, w_scale: Any, unsigned: bool) -> Any:
        amax = g.op("ReduceMax", g.op("Abs", x), axes_i=[-1], keepdims_i=1)
        c127 = g.op("Constant", value_t=torch.tensor(127.0))
        eps = g.op("Constant", value_t=torch.tensor(torch.finfo(torch.float32).eps))
        scale = g.op("Max", g.op("Div", amax, c127), eps)
        lo = g.op("Constant", value_t=torch.tensor(-128.0))
        hi = g.op("Constant", value_t=torch.tensor(127.0))
        q = g.op("Clip", g.op("Round", g.op("Mul", x, g.op("Reciprocal", scale))), lo, hi)
        if unsigned:
            shifted = g.op("Add", q, g.op("Constant", value_t=torch.tensor(128.0)))
            zp = g.op("Constant", value_t=torch.tensor(128, dtype=torch.uint8))
            acc = g.op("MatMulInteger", g.op("Cast", shifted, to_i=2), codes, zp)  # 2 = UINT8
        else:
            acc = g.op("MatMulInteger", g.op("Cast", q, to_i=3), codes)  # 3 = INT8
        return g.op("Mul", g.op("Mul", g.op("Cast", acc, to_i=1), scale), w_scale)  # 1 = FLOAT


def _weight_codes(mod: nn.Module, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes ``[K, N]`` and per-output-channel scales ``[N]`` of an 8-bit symmetric weight."""
    wq: Any = getattr(mod, "weight_quantizer", None)
    if wq is None or not wq.enabled or not wq.calibrated:
        raise UnsupportedModelError(f"{where}: W8A8 export needs calibrated int8 weights")
    s = wq.spec
    if s.bits != 8 or not s.symmetric or s.dtype != "int8" or s.granularity not in ("channel", "tensor") or (
        s.granularity == "channel" and s.axis != 0
    ):
        raise UnsupportedModelError(
            f"{where}: W8A8 export takes 8-bit symmetric int8 weights per output channel or per tensor "
            f"(got {s.bits}-bit {s.dtype} {'sym' if s.symmetric else 'asym'} {s.granularity})"
        )
    weight: Any = mod.weight
    codes = wq.int_repr(weight.detach()).to(torch.int8)
    scale = wq.scale.detach().float().reshape(-1).expand(codes.shape[0]).contiguous()
    return codes.t().contiguous(), scale


class InputQDQ(nn.Module):
    """The static input quantizer of the Linears that read one tensor (q/k/v, gate/up): one
    ``[Mul] -> QuantizeLinear -> DequantizeLinear`` for all of them, as the placement shares one
    quantizer. ORT fuses each consumer MatMul only when the Linears share the pair: with one pair
    per Linear on the same tensor its QDQ selectors left q/k/v and gate/up in float."""

    x_scale: torch.Tensor
    x_zero: torch.Tensor
    pre_scale: torch.Tensor | None

    def __init__(self, input_quantizer: Any, *, where: str) -> None:
        super().__init__()
        iq = input_quantizer
        if iq.spec.dynamic or iq.spec.granularity != "tensor" or not iq.calibrated:
            raise UnsupportedModelError(f"{where}: static W8A8 export needs a calibrated per-tensor input quantizer")
        if (iq.qmin, iq.qmax) not in ((0, 255), (-128, 127)):
            raise UnsupportedModelError(f"{where}: input codes [{iq.qmin}, {iq.qmax}] are not full uint8 or int8")
        self.register_buffer("x_scale", iq.scale.detach().float().reshape(()).clone())
        dtype = torch.uint8 if iq.qmin >= 0 else torch.int8
        self.register_buffer("x_zero", torch.tensor(int(iq.zero_point.reshape(-1)[0]), dtype=dtype))
        pre = iq.pre_quant_scale
        self.register_buffer("pre_scale", None if pre is None else pre.detach().float().clone())
        self._last: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._last is not None and self._last[0] == id(x) and self._last[1] is x:
            return self._last[2]
        y = x * self.pre_scale if self.pre_scale is not None else x
        y = _QDQFn.apply(y, self.x_scale, self.x_zero)
        self._last = (id(x), x, y)
        return y


class W8A8StaticLinear(nn.Module):
    """A Linear with a static per-tensor int8 input and int8 weights (exports as QDQ + MatMul)."""

    codes: torch.Tensor
    w_scale: torch.Tensor
    w_zero: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, mod: nn.Module, qdq: InputQDQ, *, where: str) -> None:
        super().__init__()
        codes, w_scale = _weight_codes(mod, where)
        self.register_buffer("codes", codes)
        self.register_buffer("w_scale", w_scale)
        self.register_buffer("w_zero", torch.zeros_like(w_scale, dtype=torch.int8))
        b = getattr(mod, "bias", None)
        self.register_buffer("bias", None if b is None else b.detach().float().clone())
        self.qdq = [qdq]  # shared with the other readers of the tensor; a list keeps it out of the submodules

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq = self.qdq[0](x)
        y = torch.matmul(xq, _WeightDQFn.apply(self.codes, self.w_scale, self.w_zero))
        return y + self.bias if self.bias is not None else y


class W8A8DynamicLinear(nn.Module):
    """A Linear with per-token dynamic int8 inputs and int8 weights (exports as MatMulInteger)."""

    codes: torch.Tensor
    w_scale: torch.Tensor
    pre_scale: torch.Tensor | None
    bias: torch.Tensor | None

    def __init__(self, mod: nn.Module, input_quantizer: Any, *, where: str) -> None:
        super().__init__()
        s = input_quantizer.spec
        if not (s.dynamic and s.granularity == "token" and s.symmetric and s.dtype == "int8" and s.bits == 8
                and not s.narrow_range):
            raise UnsupportedModelError(f"{where}: dynamic W8A8 export needs symmetric int8 per-token inputs")
        codes, w_scale = _weight_codes(mod, where)
        self.register_buffer("codes", codes)
        self.register_buffer("w_scale", w_scale)
        self.unsigned = bool(codes.min() >= -64 and codes.max() <= 63)  # 7-bit codes: u8s8 cannot overflow
        pre = input_quantizer.pre_quant_scale
        self.register_buffer("pre_scale", None if pre is None else pre.detach().float().clone())
        b = getattr(mod, "bias", None)
        self.register_buffer("bias", None if b is None else b.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_scale is not None:
            x = x * self.pre_scale
        y = _DynamicMatMulFn.apply(x, self.codes, self.w_scale, self.unsigned)
        return y + self.bias if self.bias is not None else y


def check_w8a8_exportable(model: nn.Module) -> None:
    """Raise UnsupportedModelError naming the first activation quantizer the generation graph
    cannot carry: one placed on an op other than a Linear's input, or a simulated KV cache."""
    placed = view(model)
    if placed.kv_cache:
        raise UnsupportedModelError(
            f"{placed.kv_cache[0]}: the int8 KV cache is simulated in PyTorch only; export without kv_cache"
        )
    for key in placed.op_entries:
        kind = key.rpartition(":")[2].split("#")[0]
        if kind not in _LINEAR_KINDS:
            raise UnsupportedModelError(
                f"{key}: W8A8 generation export quantizes Linear inputs only; this placement also quantizes "
                "tensor ops (quantize with quantize_ops: false, or a dynamic scheme)"
            )
    for key, param in placed.placed_weights.items():
        raise UnsupportedModelError(f"{param}: a functionally used weight ({key}) is not exported for generation")


def w8a8_linear(root: nn.Module, name: str, mod: nn.Module, shared: dict[int, InputQDQ]) -> nn.Module | None:
    """The export module for the W8A8 layer ``name`` of ``root``, or None when its input is not
    quantized (weight-only layers are handled by the caller). ``shared`` maps the static input
    quantizers seen so far to their export module (filled in here)."""
    iq: Any = input_quantizer(root, name)
    if iq is None or not iq.enabled:
        return None
    if getattr(mod, "output_quantizer", None) is not None:
        raise UnsupportedModelError(f"{name}: output quantizers are not exported for generation")
    if iq.spec.dynamic:
        return W8A8DynamicLinear(mod, iq, where=name)
    if id(iq) not in shared:
        shared[id(iq)] = InputQDQ(iq, where=name)
    return W8A8StaticLinear(mod, shared[id(iq)], where=name)
