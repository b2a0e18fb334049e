"""Quantized modules: subclasses of the float layers that own their quantizers.

``QuantLinear``, ``QuantConv1d`` and ``QuantConv2d`` keep the float layer's ``weight``/``bias``
Parameters (same tensors, same state_dict keys) and add ``weight_quantizer``, ``input_quantizer``
(None for weight-only schemes) and ``output_quantizer`` (None unless the scheme has outputs).
A QuantConv may also hold the BatchNorm that followed it (``bn``, QAT only): while training it
quantizes the BN-folded weight and keeps BN statistics exact (torch.ao's ConvBn scheme); once
``bn_frozen`` is set it uses running statistics, and :meth:`fold_bn` merges it for good.

Under static activation schemes ``prepare`` leaves ``input_quantizer``/``output_quantizer`` None:
activation quantizers are placed on the traced graph (quantization/placement/place.py), shared by all
consumers of a tensor. Modules built directly from a scheme (and dynamic schemes) own them.

``from_float``/``to_float`` swap between float and quantized modules without copying parameters.
"""

from __future__ import annotations

from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F
from compress.quantization.algorithms.bn_fold import fold_bn_into_conv
from compress.quantization.numerics.fake_quant import FakeQuantizer
from compress.quantization.numerics.spec import QuantScheme, QuantSpec
from torch import nn

from compress.core.sparsity import carry_mask


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
        carry_mask(mod, new)  # a sparsity mask (SparseGPT, Wanda) goes with the weight
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
        carry_mask(self, new)
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


QUANT_LAYERS: dict[type[nn.Module], Any] = {
    nn.Linear: QuantLinear,
    nn.Conv1d: QuantConv1d,
    nn.Conv2d: QuantConv2d,
}
QUANT_TYPES: tuple[type[nn.Module], ...] = (QuantLinear, QuantConv1d, QuantConv2d)
