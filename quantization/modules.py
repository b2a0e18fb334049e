"""Quantized modules: subclasses of the float layers that own their quantizers.

``QuantLinear``, ``QuantConv1d`` and ``QuantConv2d`` keep the float layer's ``weight``/``bias``
Parameters (same tensors, same state_dict keys) and add ``weight_quantizer``, ``input_quantizer``
(None for weight-only schemes) and ``output_quantizer`` (None unless the scheme has outputs).
A QuantConv may also hold the BatchNorm that followed it (``bn``, QAT only): while training it
quantizes the BN-folded weight and keeps BN statistics exact (torch.ao's ConvBn scheme); once
``bn_frozen`` is set it uses running statistics, and :meth:`fold_bn` merges it for good.

``QuantAdd`` and ``QuantMatMul`` own ``input_quantizers`` (one per operand) and an
``output_quantizer``; ``QuantConcat`` owns one ``input_quantizer`` shared by all operands so that
the concatenation needs no requantization.

``from_float``/``to_float`` swap between float and quantized modules without copying parameters.
"""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from compress.models.ops import Add, Concat, MatMul
from quantization.bn import fold_bn_into_conv
from quantization.fake_quant import FakeQuantizer
from quantization.spec import QuantScheme, QuantSpec


def _q(spec: QuantSpec | None, role: str, name: str) -> FakeQuantizer | None:
    return FakeQuantizer(spec, role=role, name=f"{name}.{role}_quantizer") if spec is not None else None


def _apply(q: FakeQuantizer | None, x: torch.Tensor) -> torch.Tensor:
    return q(x) if q is not None else x


class QuantLayerMixin:
    """Shared quantizer wiring of QuantLinear / QuantConv*."""

    float_cls: ClassVar[type[nn.Module]]
    weight: torch.Tensor
    weight_quantizer: FakeQuantizer | None
    input_quantizer: FakeQuantizer | None
    output_quantizer: FakeQuantizer | None

    def _init_quantizers(self, scheme: QuantScheme, name: str, *, weights: QuantSpec | None) -> None:
        self.weight_quantizer = _q(weights, "weight", name)
        self.input_quantizer = _q(scheme.inputs, "input", name)
        self.output_quantizer = _q(scheme.outputs, "output", name)

    def quantized_weight(self) -> torch.Tensor:
        """The weight as the forward pass uses it (fake-quantized when enabled)."""
        return _apply(self.weight_quantizer, self.weight)


class QuantLinear(QuantLayerMixin, nn.Linear):
    """``nn.Linear`` with weight, input and output quantizers."""

    float_cls = nn.Linear

    @classmethod
    def from_float(cls, mod: nn.Linear, scheme: QuantScheme, *, name: str, weights: QuantSpec | None) -> QuantLinear:
        new = cls(mod.in_features, mod.out_features, bias=mod.bias is not None, device="meta")
        new.weight = mod.weight
        if mod.bias is not None:
            new.bias = mod.bias
        new._init_quantizers(scheme, name, weights=weights)
        new.train(mod.training)
        return new

    def to_float(self) -> nn.Linear:
        iq = self.input_quantizer
        if iq is not None and iq.pre_quant_scale is not None:
            # SmoothQuant scaled the weight by 1/pre_quant_scale per input feature; undo it
            with torch.no_grad():
                self.weight.mul_(iq.pre_quant_scale)
            iq.pre_quant_scale = None
        new = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        new.weight = self.weight
        if self.bias is not None:
            new.bias = self.bias
        new.train(self.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _apply(self.input_quantizer, x)
        return _apply(self.output_quantizer, F.linear(x, self.quantized_weight(), self.bias))


class _QuantConvNd(QuantLayerMixin):
    """Conv wiring shared by 1-D and 2-D; ``bn`` is the QAT-folded BatchNorm, if any."""

    bn: nn.modules.batchnorm._BatchNorm | None
    bn_frozen: bool
    bias: torch.Tensor | None
    _conv_forward: Any

    @classmethod
    def _conv_args(cls, mod: nn.modules.conv._ConvNd) -> dict[str, Any]:
        return {
            "in_channels": mod.in_channels,
            "out_channels": mod.out_channels,
            "kernel_size": mod.kernel_size,
            "stride": mod.stride,
            "padding": mod.padding,
            "dilation": mod.dilation,
            "groups": mod.groups,
            "bias": mod.bias is not None,
            "padding_mode": mod.padding_mode,
        }

    @classmethod
    def from_float(
        cls, mod: nn.modules.conv._ConvNd, scheme: QuantScheme, *, name: str, weights: QuantSpec | None
    ) -> Any:
        new: Any = cast(Any, cls)(**cls._conv_args(mod), device="meta")
        new.weight = mod.weight
        if mod.bias is not None:
            new.bias = mod.bias
        new._init_quantizers(scheme, name, weights=weights)
        new.bn, new.bn_frozen = None, False
        new.train(mod.training)
        return new

    def to_float(self) -> nn.Module:
        """The float conv (BatchNorm folded in), sharing this module's Parameters."""
        self.fold_bn()
        me: Any = self
        new: Any = cast(Any, self.float_cls)(**self._conv_args(me), device="meta")
        new.weight = self.weight
        if self.bias is not None:
            new.bias = self.bias
        new.train(me.training)
        return new

    def _forward_conv(self, x: torch.Tensor) -> torch.Tensor:
        x = _apply(self.input_quantizer, x)
        bn = self.bn
        if bn is None:
            y = self._conv_forward(x, self.quantized_weight(), self.bias)
        else:
            y = self._forward_bn(x, bn)
        return _apply(self.output_quantizer, y)

    def _bn_factor(self, bn: nn.modules.batchnorm._BatchNorm) -> torch.Tensor:
        assert bn.running_var is not None
        gamma = bn.weight if bn.weight is not None else torch.ones_like(bn.running_var)
        return gamma / torch.sqrt(bn.running_var + bn.eps)

    def _forward_bn(self, x: torch.Tensor, bn: nn.modules.batchnorm._BatchNorm) -> torch.Tensor:
        factor = self._bn_factor(bn)
        shape = [-1] + [1] * (self.weight.dim() - 1)
        w = _apply(self.weight_quantizer, self.weight * factor.reshape(shape))
        y = self._conv_forward(x, w, None)
        bshape = [1, -1] + [1] * (y.dim() - 2)
        # undo the folding scale so that BN sees (and, while training, updates on) unscaled outputs
        y = y / factor.reshape(bshape)
        if self.bias is not None:
            y = y + self.bias.reshape(bshape)
        training = bn.training and not self.bn_frozen
        return F.batch_norm(
            y, bn.running_mean, bn.running_var, bn.weight, bn.bias, training, bn.momentum or 0.1, bn.eps
        )

    def attach_bn(self, bn: nn.modules.batchnorm._BatchNorm) -> None:
        """Take over the BatchNorm that follows this conv (QAT); the caller replaces it by Identity."""
        self.bn = bn
        self.bn_frozen = False

    def fold_bn(self) -> None:
        """Merge ``bn`` into weight and bias (exact in eval) and drop it."""
        if self.bn is not None:
            fold_bn_into_conv(self, self.bn)  # type: ignore[arg-type]
            self.bn = None


class QuantConv1d(_QuantConvNd, nn.Conv1d):
    """``nn.Conv1d`` with weight, input and output quantizers."""

    float_cls = nn.Conv1d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward_conv(x)


class QuantConv2d(_QuantConvNd, nn.Conv2d):
    """``nn.Conv2d`` with weight, input and output quantizers."""

    float_cls = nn.Conv2d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward_conv(x)


# ---- tensor ops -------------------------------------------------------------------------------------


def _op_specs(scheme: QuantScheme) -> tuple[QuantSpec, QuantSpec]:
    """Per-tensor static input and output specs for the ops (integer kernels need static scales)."""
    assert scheme.inputs is not None and not scheme.inputs.dynamic
    inp = scheme.inputs.with_(granularity="tensor", axis=0)
    out = scheme.outputs if scheme.outputs is not None else inp
    return inp, out.with_(granularity="tensor", axis=0)


_OpT = TypeVar("_OpT", bound="_QuantOperandsMixin")


class _QuantOperandsMixin(nn.Module):
    """Shared wiring of QuantAdd / QuantMatMul: a quantizer per operand and one on the result."""

    float_cls: ClassVar[type[nn.Module]]

    def __init__(self, scheme: QuantScheme, *, name: str) -> None:
        super().__init__()
        inp, out = _op_specs(scheme)
        self.input_quantizers = nn.ModuleList(
            [FakeQuantizer(inp, role="input", name=f"{name}.input_quantizers.{i}") for i in range(2)]
        )
        self.output_quantizer = FakeQuantizer(out, role="output", name=f"{name}.output_quantizer")

    @classmethod
    def from_float(cls: type[_OpT], mod: nn.Module, scheme: QuantScheme, *, name: str) -> _OpT:
        new = cls(scheme, name=name)
        new.train(mod.training)
        return new

    def to_float(self) -> nn.Module:
        return self.float_cls().train(self.training)


class QuantAdd(_QuantOperandsMixin, Add):
    """Residual add with a quantizer per operand and one on the sum."""

    float_cls = Add

    def __init__(self, scheme: QuantScheme, *, name: str = "add") -> None:
        super().__init__(scheme, name=name)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.output_quantizer(self.input_quantizers[0](a) + self.input_quantizers[1](b))


class QuantMatMul(_QuantOperandsMixin, MatMul):
    """Matmul (attention scores / weighted values) with a quantizer per operand and on the product."""

    float_cls = MatMul

    def __init__(self, scheme: QuantScheme, *, name: str = "matmul") -> None:
        super().__init__(scheme, name=name)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        y = torch.matmul(self.input_quantizers[0](a), self.input_quantizers[1](b))
        return self.output_quantizer(y)


class QuantConcat(Concat):
    """Concatenation whose operands share one input quantizer (the output needs no requantization)."""

    def __init__(self, scheme: QuantScheme, *, dim: int = 1, name: str = "concat") -> None:
        super().__init__(dim)
        inp, _ = _op_specs(scheme)
        self.input_quantizer = FakeQuantizer(inp, role="input", name=f"{name}.input_quantizer")
        self.output_quantizer: FakeQuantizer | None = None

    @classmethod
    def from_float(cls, mod: Concat, scheme: QuantScheme, *, name: str) -> QuantConcat:
        new = cls(scheme, dim=mod.dim, name=name)
        new.train(mod.training)
        return new

    def to_float(self) -> Concat:
        return Concat(self.dim).train(self.training)

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_quantizer(t) for t in tensors], dim=self.dim)


QUANT_LAYERS: dict[type[nn.Module], Any] = {
    nn.Linear: QuantLinear,
    nn.Conv1d: QuantConv1d,
    nn.Conv2d: QuantConv2d,
}
QUANT_OPS: dict[type[nn.Module], Any] = {Add: QuantAdd, MatMul: QuantMatMul, Concat: QuantConcat}
QUANT_TYPES: tuple[type[nn.Module], ...] = (
    QuantLinear,
    QuantConv1d,
    QuantConv2d,
    QuantAdd,
    QuantMatMul,
    QuantConcat,
)
