"""Elementwise ops with an ORT integer kernel are quantized when their inputs already are (issue 32).

Per op: a conv, the op, a conv (so the op's input is a quantized conv output and its output feeds an
integer conv); after ORT's optimizer (which fuses DQ -> op -> Q into QLinear*) the op runs as its
integer kernel, the ONNX file matches the fake-quant model, and the fake-quant model stays close to float.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from compress.export.onnx import export_onnx
from compress.export.validation.runtimes import ort_coverage, ort_optimized_graph
from compress.quantization import QuantizeParams, quantize
from compress.quantization.placement.mode import graph_of
from compress.quantization.placement.records import Placement
from torch import nn

SEVEN_BIT = {"preset": "w8a8", "weights": {"reduce_range": True}}


class Between(nn.Module):
    def __init__(self, op: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 16, 3, padding=1)
        self.b = nn.Conv2d(16, 16, 1)
        self.op = op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.op(self.a(x)))


class HardSwishMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * F.hardsigmoid(x)


class Op(nn.Module):
    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def _placement(q: nn.Module) -> Placement:
    g = graph_of(q)
    assert g is not None
    return g.placement


def _images(n: int = 3, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 3, 12, 12, generator=g) for _ in range(n)]


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - out).pow(2).mean()))


def _ort(path: Path, x: torch.Tensor) -> torch.Tensor:
    import onnxruntime as ort

    s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return torch.from_numpy(s.run(None, {s.get_inputs()[0].name: x.numpy()})[0])


CASES: dict[str, tuple[Callable[[], nn.Module], str, str]] = {
    # name: (op module, the integer kernel it must run as, the float op it must not leave)
    "hardswish_as_mul": (HardSwishMul, "QLinearMul", "Mul"),
    "scalar_mul": (lambda: Op(lambda x: x * 0.5), "QLinearMul", "Mul"),
    "hardswish": (lambda: Op(F.hardswish), "QLinearMul", "Mul"),
    "leaky_relu": (lambda: Op(lambda x: F.leaky_relu(x, 0.1)), "QLinearLeakyRelu", "LeakyRelu"),
    "softmax": (lambda: Op(lambda x: F.softmax(x, dim=1)), "QLinearSoftmax", "Softmax"),
    "sigmoid": (lambda: Op(torch.sigmoid), "QLinearSigmoid", "Sigmoid"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_elementwise_op_between_integer_convs_runs_integer(name: str, tmp_path: Path) -> None:
    make, kernel, float_op = CASES[name]
    torch.manual_seed(0)
    m = Between(make()).eval()
    x = _images(1, seed=5)[0]
    with torch.no_grad():
        ref = m(x)
    q = quantize(m, SEVEN_BIT, _images())
    path = export_onnx(q, x, tmp_path / "m.int8.onnx")
    cov = ort_coverage(path)
    assert cov.integer_ops.get(kernel, 0) >= 1, cov.integer_ops
    kinds = [n.op_type for n in ort_optimized_graph(path).graph.node]
    assert float_op not in kinds, kinds
    with torch.no_grad():
        fake = q(x)
    assert _sqnr(ref, fake) > 20.0
    assert _sqnr(fake, _ort(path, x)) > 30.0


def test_a_number_and_a_vector_one_scale_holds_get_constant_quantizers() -> None:
    """A one-element constant is held exactly by its own 8-bit scale. A per-channel scale tensor (a
    layer scale) gets one where one 8-bit scale keeps it at CONSTANT_MIN_SQNR: four decades do (the
    channels that round to zero carry little of the product; the vector that does not is in
    test_placement_integer_attention.py)."""
    torch.manual_seed(0)
    decades = torch.logspace(-4, 0, 16).view(1, 16, 1, 1)
    number = _placement(quantize(Between(Op(lambda x: x * 0.5)).eval(), SEVEN_BIT, _images()))
    tensor = _placement(quantize(Between(Op(lambda x: x * decades)).eval(), SEVEN_BIT, _images()))
    assert [qid for qid in number.activations if qid.startswith("c")] == ["c0"], number.activations
    assert "c0" in number.entries["op:mul#0"].values(), number.entries
    assert "c0" in tensor.entries["op:mul#0"].values(), tensor.entries


def test_gate_quantized_for_onnxruntime_only() -> None:
    """``x * hardsigmoid(x)``: ORT's profile quantizes the gate's output (so the product is a
    QLinearMul); TensorRT's, which has no such rule, leaves the gate alone."""
    def gated(target: str) -> bool:
        torch.manual_seed(0)
        q = quantize(Between(HardSwishMul()).eval(), "w8a8", _images(), params=QuantizeParams(runtime=target))
        return any(t.startswith("op:act") for ts in _placement(q).activations.values() for t in ts)

    assert gated("onnxruntime") and not gated("tensorrt")
