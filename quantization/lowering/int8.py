"""Real int8 modules for CUDA: Int8Linear and Int8Conv2d, built from calibrated fake-quant layers.

Weights are quantized once, stored as int8 with float32 per-output-channel scales and int32 filter
sums (for the activation zero point's correction); activations are quantized at run time by the
Triton kernels, statically (the calibrated scale) or dynamically (per token, or per tensor). The
integer codes are exactly the fake-quant model's, so the converted model differs from it only by
float accumulation order. Output quantizers (kept as the original FakeQuantizer) and SmoothQuant's
``pre_quant_scale`` are applied as in the fake-quant forward, so parity holds for those too.

The modules run on CUDA, or on CPU only under ``TRITON_INTERPRET=1`` (tests); elsewhere forward
raises a CompressError instead of silently falling back.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from compress.quantization.lowering.fused_norm import claim
from compress.quantization.lowering.kernels import ACTIVATIONS, load
from compress.quantization.lowering.kernels.ops import compiling, ops
from compress.quantization.lowering.kernels.ops import register as register_ops
from compress.quantization.lowering.shared_input import SharedCodes
from compress.quantization.numerics.fake_quant import FakeQuantizer
from compress.quantization.numerics.primitives import SCALE_EPS
from torch import nn

from compress.core.errors import CompressError, UnsupportedModelError

_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _weight_codes(mod: Any, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes and float32 ``[out]`` scales of a layer's weight, or UnsupportedModelError why not."""
    wq: FakeQuantizer | None = mod.weight_quantizer
    if wq is None or not wq.enabled:
        raise UnsupportedModelError("its weights are not quantized")
    s = wq.spec
    if s.bits != 8 or s.dtype != "int8":
        raise UnsupportedModelError(f"its weights are {s.bits}-bit {s.dtype}; the kernels take 8-bit int8 weights")
    if s.granularity not in ("tensor", "channel") or (s.granularity == "channel" and s.axis not in (0, -weight.dim())):
        raise UnsupportedModelError(
            f"its weight scales are per {s.granularity} (axis {s.axis}); the kernels take per-output-channel or per-tensor"
        )
    if not wq.calibrated:
        raise UnsupportedModelError("its weight quantizer is not calibrated")
    if bool((wq.zero_point != 0).any()):
        raise UnsupportedModelError("its weights are asymmetric (non-zero zero point); the kernels take symmetric weights")
    with torch.no_grad():
        codes = wq.int_repr(weight.detach().float())
        scale = wq.scale.detach().float().clamp(min=SCALE_EPS).reshape(-1)
    n = weight.shape[0]
    return codes.to(torch.int8), (scale.expand(n) if scale.numel() == 1 else scale).contiguous().clone()


class _Int8Base(nn.Module):
    """Activation-side state shared by the int8 layers: how inputs are quantized, what follows."""

    weight_q: torch.Tensor
    weight_scale: torch.Tensor
    weight_colsum: torch.Tensor
    bias: torch.Tensor | None
    input_scale: torch.Tensor
    pre_quant_scale: torch.Tensor | None
    output_quantizer: FakeQuantizer | None

    def _init_input(self, iq: FakeQuantizer | None, *, allow_token: bool) -> None:
        """Read the input quantizer (raises UnsupportedModelError with the reason it cannot be used)."""
        if iq is None or not iq.enabled:
            raise UnsupportedModelError("its inputs are not quantized (weight-only); there is no W8A8 kernel for it")
        s = iq.spec
        if s.bits != 8 or s.is_float:
            raise UnsupportedModelError(f"its inputs are {s.bits}-bit {s.dtype}; the int8 kernels take 8-bit integers")
        shift = 128 if s.dtype == "uint8" else 0  # uint8 codes run as int8 codes minus 128
        self.qmin, self.qmax = iq.qmin - shift, iq.qmax - shift
        self.input_zero_point = 0
        if s.dynamic:
            if not s.symmetric:
                raise UnsupportedModelError("its inputs are dynamic and asymmetric; the kernels take symmetric dynamic")
            if s.granularity == "token" and not allow_token:
                raise UnsupportedModelError("per-token input scales do not apply to convolutions")
            if s.granularity not in ("token", "tensor"):
                raise UnsupportedModelError(f"dynamic per-{s.granularity} inputs are not supported")
            self.input_mode = "token" if s.granularity == "token" else "dynamic_tensor"
            self.register_buffer("input_scale", torch.ones(1))
            self._qmax_sym = float(iq.qmax - (128 if s.dtype == "uint8" else 0))
        else:
            if s.granularity != "tensor":
                raise UnsupportedModelError(f"its static input scales are per {s.granularity}; the kernels take one scale")
            if not iq.calibrated:
                raise UnsupportedModelError("its input quantizer is not calibrated")
            self.input_mode = "static"
            self.input_zero_point = int(iq.zero_point.reshape(-1)[0]) - shift
            scale = iq.scale.detach().float().clamp(min=SCALE_EPS).reshape(1).clone()
            self.register_buffer("input_scale", scale)
        pqs = iq.pre_quant_scale
        self.register_buffer("pre_quant_scale", None if pqs is None else pqs.detach().float().clone())

    shared_codes: SharedCodes | None = None
    reader_tracker: Any = None  # quantization/lowering/horizontal.py: which layers read one tensor
    horizontal: Any = None  # the HorizontalGemm this layer's weight is a slice of

    def input_signature(self) -> tuple[Any, ...]:
        """What determines this layer's input codes: layers with equal signatures reading the same
        tensor can share one quantization (quantization/lowering/shared_input.py)."""
        pqs = self.pre_quant_scale
        return (type(self).__name__, self.input_mode, self.qmin, self.qmax, self.input_zero_point,
                tuple(self.input_scale.reshape(-1).tolist()) if self.input_mode == "static" else None,
                None if pqs is None else tuple(pqs.reshape(-1).tolist()))

    def _codes(self, x: torch.Tensor, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes of ``flat`` (a view of ``x``), shared with the layers of the same signature
        (under torch.compile the compiler's common-subexpression pass does the sharing)."""
        if compiling():
            return self._quantize_input(flat)
        if self.input_mode == "token":  # a FusedRMSNorm's output: it may quantize for this layer's group
            claim(x, self, qmin=self.qmin, qmax=self.qmax, fp8=False)
        if self.shared_codes is None:
            return self._quantize_input(flat)
        return self.shared_codes.get(x, lambda: self._quantize_input(flat))

    def _quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """int8 codes and scale(s) of ``x`` as the fake-quant input quantizer would produce them."""
        pqs = self.pre_quant_scale
        if compiling():
            return self._quantize_input_op(x)
        quant = load("quant")
        if self.input_mode == "token":
            return quant.quantize_per_token(x, qmin=self.qmin, qmax=self.qmax, pre_scale=pqs)
        if self.input_mode == "dynamic_tensor":
            if pqs is not None:  # the absmax needs the scaled tensor anyway
                x, pqs = x * pqs.to(x.dtype), None
            # symmetric: scale = max(absmax / qmax, eps), computed on device (no host sync: graph-safe)
            scale = torch.clamp(x.detach().abs().amax().float().reshape(1) / self._qmax_sym, min=SCALE_EPS)
        else:
            scale = self.input_scale
        q = quant.quantize_static(
            x, scale=scale, zero_point=self.input_zero_point, qmin=self.qmin, qmax=self.qmax, pre_scale=pqs
        )
        return q, scale

    def _quantize_input_op(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_quantize_input` through the ``torch.ops.compress`` operators (torch.compile)."""
        pqs = self.pre_quant_scale
        if self.input_mode == "token":
            q, s = ops().quantize_per_token(x, self.qmin, self.qmax, False, pqs)
            return q, s
        if self.input_mode == "dynamic_tensor":
            if pqs is not None:
                x, pqs = x * pqs.to(x.dtype), None
            scale = torch.clamp(x.detach().abs().amax().float().reshape(1) / self._qmax_sym, min=SCALE_EPS)
        else:
            scale = self.input_scale
        return ops().quantize_static(x, scale, self.input_zero_point, self.qmin, self.qmax, False, pqs), scale

    def _set_activation(self, activation: str) -> None:
        if activation not in ACTIVATIONS:
            raise CompressError(f"unknown fused activation '{activation}'; valid: {', '.join(ACTIVATIONS)}")
        self.activation = activation

    def _out_dtype(self, x: torch.Tensor) -> torch.dtype:
        if x.dtype not in _OUT_DTYPES:
            raise CompressError(f"{type(self).__name__}: inputs must be float16, bfloat16 or float32 (got {x.dtype})")
        return x.dtype

    def _finish(self, y: torch.Tensor) -> torch.Tensor:
        oq = self.output_quantizer
        return oq(y) if oq is not None else y

    def _input_repr(self) -> str:
        zp = f", zp={self.input_zero_point}" if self.input_zero_point else ""
        return f"input={self.input_mode}{zp}, act={self.activation}"


class Int8Linear(_Int8Base):
    """W8A8 Linear: int8 weight ``[out, in]``, per-channel scales, int8 activations, fused epilogue."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        register_ops()  # torch.ops.compress.*, called under torch.compile
        self.in_features, self.out_features = in_features, out_features
        self.activation = "none"
        self.output_quantizer: FakeQuantizer | None = None

    @classmethod
    def from_quant(cls, mod: Any, *, activation: str = "none", input_quantizer: FakeQuantizer | None = None) -> Int8Linear:
        """An Int8Linear computing what the fake-quant ``QuantLinear`` ``mod`` computes
        (``input_quantizer``: the one placed on its input, when the layer does not own one)."""
        weight: torch.Tensor = mod.weight
        new = cls(weight.shape[1], weight.shape[0])
        new._init_input(input_quantizer or mod.input_quantizer, allow_token=True)
        codes, scale = _weight_codes(mod, weight)
        new.register_buffer("weight_q", codes.contiguous())
        new.register_buffer("weight_scale", scale)
        new.register_buffer("weight_colsum", codes.to(torch.int32).sum(1))
        b = mod.bias
        new.register_buffer("bias", None if b is None else b.detach().float().clone())
        # a copy: moving the int8 layer (.to) must not move the fake-quant model's quantizer with it
        new.output_quantizer = copy.deepcopy(mod.output_quantizer)
        new._set_activation(activation)
        return new.to(weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out_dtype = self._out_dtype(x)
        if not compiling():
            if self.reader_tracker is not None:
                self.reader_tracker.observe(self, x)
            if self.horizontal is not None:
                y_slice = self.horizontal.output(self, x)
                if y_slice is not None:
                    return self._finish(y_slice)
        lead = x.shape[:-1]
        xq, sa = self._codes(x, x.reshape(-1, self.in_features))
        if compiling():
            y = ops().int8_gemm(xq.reshape(-1, self.in_features), self.weight_q, sa, self.weight_scale, self.bias,
                                self.input_zero_point, self.weight_colsum, ACTIVATIONS.index(self.activation), out_dtype)
            return self._finish(y.reshape(*lead, self.out_features))
        y = load("gemm").int8_gemm(
            xq.reshape(-1, self.in_features), self.weight_q, a_scale=sa, b_scale=self.weight_scale, bias=self.bias,
            a_zero_point=self.input_zero_point, b_colsum=self.weight_colsum, activation=self.activation,
            out_dtype=out_dtype,
        )
        return self._finish(y.reshape(*lead, self.out_features))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self._input_repr()}"


class Int8Conv2d(_Int8Base):
    """W8A8 Conv2d (groups=1): int8 weight ``[out, kh, kw, in]``, channels-last activations."""

    def __init__(self, in_channels: int, out_channels: int, *, kernel_size: tuple[int, int],
                 stride: tuple[int, int], padding: tuple[int, int], dilation: tuple[int, int]) -> None:
        super().__init__()
        register_ops()  # torch.ops.compress.*, called under torch.compile
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.stride, self.padding, self.dilation = kernel_size, stride, padding, dilation
        self.activation = "none"
        self.output_quantizer: FakeQuantizer | None = None

    @classmethod
    def from_quant(cls, mod: Any, *, activation: str = "none", input_quantizer: FakeQuantizer | None = None) -> Int8Conv2d:
        """An Int8Conv2d computing what the fake-quant ``QuantConv2d`` ``mod`` computes (BN folded;
        ``input_quantizer``: the one placed on its input, when the layer does not own one)."""
        conv: Any = mod
        if conv.groups != 1:
            raise UnsupportedModelError(f"it is a grouped convolution (groups={conv.groups}); only groups=1 has an int8 kernel")
        if conv.padding_mode != "zeros":
            raise UnsupportedModelError(f"its padding_mode is '{conv.padding_mode}'; only 'zeros' is supported")
        if isinstance(conv.padding, str):
            raise UnsupportedModelError(f"its padding is '{conv.padding}'; numeric padding is required")
        if getattr(conv, "bn", None) is not None:
            raise UnsupportedModelError("it still holds a BatchNorm; fold it first (the converter folds a copy)")
        new = cls(conv.in_channels, conv.out_channels, kernel_size=tuple(conv.kernel_size), stride=tuple(conv.stride),
                  padding=tuple(conv.padding), dilation=tuple(conv.dilation))
        new._init_input(input_quantizer or conv.input_quantizer, allow_token=False)
        if new.pre_quant_scale is not None:
            raise UnsupportedModelError("its input has a pre_quant_scale (SmoothQuant), which convolutions do not take")
        codes, scale = _weight_codes(conv, conv.weight)
        new.register_buffer("weight_q", codes.permute(0, 2, 3, 1).contiguous())  # [O, KH, KW, C]
        new.register_buffer("weight_scale", scale)
        new.register_buffer("weight_colsum", codes.to(torch.int32).sum((1, 2, 3)))
        b = conv.bias
        new.register_buffer("bias", None if b is None else b.detach().float().clone())
        new.output_quantizer = copy.deepcopy(conv.output_quantizer)
        new._set_activation(activation)
        return new.to(conv.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out_dtype = self._out_dtype(x)
        if x.dim() != 4:
            raise CompressError(f"Int8Conv2d: expects NCHW input (got {x.dim()}-D)")
        # channels-last codes: a no-op when the previous int8 layer already produced channels-last
        xq, sa = self._codes(x, x.contiguous(memory_format=torch.channels_last))
        if compiling():
            return self._finish(ops().int8_conv2d(
                xq, self.weight_q, sa, self.weight_scale, self.bias, self.input_zero_point, self.weight_colsum,
                list(self.stride), list(self.padding), list(self.dilation), ACTIVATIONS.index(self.activation),
                out_dtype))
        y = load("conv").int8_conv2d(
            xq, self.weight_q, a_scale=sa, w_scale=self.weight_scale, bias=self.bias,
            a_zero_point=self.input_zero_point, w_colsum=self.weight_colsum, stride=self.stride,
            padding=self.padding, dilation=self.dilation, activation=self.activation, out_dtype=out_dtype,
        )
        return self._finish(y)

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
            f"padding={self.padding}, dilation={self.dilation}, {self._input_repr()}"
        )


class StaticQDQ(nn.Module):
    """A calibrated per-tensor activation fake quantizer as one kernel pass (CUDA; CPU under the
    interpreter): what a converted model keeps where a float consumer reads a quantized tensor (a
    residual add after an int8 convolution), instead of the quantizer's chain of eager ops."""

    scale: torch.Tensor

    def __init__(self, scale: torch.Tensor, zero_point: int, qmin: int, qmax: int) -> None:
        super().__init__()
        register_ops()  # torch.ops.compress.*, called under torch.compile
        self.register_buffer("scale", scale.detach().float().reshape(1).clone())
        self.zero_point, self.qmin, self.qmax = zero_point, qmin, qmax

    @classmethod
    def from_quantizer(cls, q: FakeQuantizer) -> StaticQDQ:
        """The one-pass form of ``q``, or UnsupportedModelError why it has none."""
        s = q.spec
        if s.dynamic or s.granularity != "tensor" or s.is_float or s.bits != 8:
            raise UnsupportedModelError(f"only static per-tensor 8-bit integer quantizers fuse (got {s.granularity})")
        if not q.calibrated or q.learnable or q.pre_quant_scale is not None or q.observing:
            raise UnsupportedModelError("the quantizer is uncalibrated, learning, observing or pre-scaled")
        scale = q.scale.detach().float().clamp(min=SCALE_EPS)
        return cls(scale, int(q.zero_point.reshape(-1)[0]), q.qmin, q.qmax).to(scale.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if compiling():
            return ops().fake_quantize_static(x, self.scale, self.zero_point, self.qmin, self.qmax)
        return load("quant").fake_quantize_static(x, scale=self.scale, zero_point=self.zero_point, qmin=self.qmin,
                                                 qmax=self.qmax)

    def extra_repr(self) -> str:
        return f"scale={float(self.scale):.4g}, zero_point={self.zero_point}, range=[{self.qmin}, {self.qmax}]"
