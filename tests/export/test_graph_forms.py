"""A mean over an image's spatial dims leaves the export as GlobalAveragePool (export/graph_forms.py),
in the fp32 and the int8 file alike, and ORT runs the int8 one as QLinearGlobalAveragePool on the
codes its integer convs wrote (issue 32: before, DQ -> float ReduceMean -> Q behind a Transpose)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from compress.export.onnx import export_onnx
from compress.export.validation.runtimes import ort_optimized_graph
from compress.quantization import quantize
from torch import nn

SEVEN_BIT = {"preset": "w8a8", "weights": {"reduce_range": True}}

POOLS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "adaptive_avg_pool2d": lambda x: torch.flatten(F.adaptive_avg_pool2d(x, 1), 1),
    "mean_dims": lambda x: x.mean((2, 3)),
    "mean_negative_dims_keepdim": lambda x: torch.mean(x, dim=[-1, -2], keepdim=True).flatten(1),
}


class PoolNet(nn.Module):
    """conv -> pool -> (LayerNorm, ConvNeXt's head: a float reader) -> linear."""

    def __init__(self, pool: Callable[[torch.Tensor], torch.Tensor], norm: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.norm = nn.LayerNorm(16) if norm else nn.Identity()
        self.fc = nn.Linear(16, 5)
        self.pool = pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(self.pool(F.relu(self.conv(x)))))


class TokenNorm(nn.Module):
    """A mean over the last dim of (batch, tokens, hidden): a norm's statistic, not a pool."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)


def _ops(path: Path) -> list[str]:
    return _ops_of(onnx.load(str(path)))


def _run(path: Path, x: torch.Tensor) -> np.ndarray:
    import onnxruntime as ort

    s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return s.run(None, {s.get_inputs()[0].name: x.numpy()})[0]


def _sqnr(ref: np.ndarray, out: np.ndarray) -> float:
    return float(10 * np.log10((ref**2).mean() / ((ref - out) ** 2).mean()))


@pytest.mark.parametrize("norm", [False, True], ids=["linear_reads", "norm_reads"])
@pytest.mark.parametrize("name", sorted(POOLS))
def test_spatial_mean_is_a_global_pool_in_both_files(name: str, norm: bool, tmp_path: Path) -> None:
    """With a float reader (the norm) the pool's output is quantized all the same (placed as a pool)."""
    torch.manual_seed(0)
    m = PoolNet(POOLS[name], norm).eval()
    g = torch.Generator().manual_seed(3)
    calib = [torch.randn(4, 3, 10, 10, generator=g) for _ in range(3)]
    x = torch.randn(2, 3, 10, 10, generator=g)
    with torch.no_grad():
        ref = m(x).numpy()
    fp = export_onnx(copy.deepcopy(m), x, tmp_path / "fp32.onnx")
    q = quantize(m, SEVEN_BIT, calib)
    q8 = export_onnx(q, x, tmp_path / "int8.onnx")

    for path in (fp, q8):
        ops = _ops(path)
        assert "GlobalAveragePool" in ops and "ReduceMean" not in ops, ops
    with torch.no_grad():
        fake = q(x).numpy()
    np.testing.assert_allclose(_run(fp, x), ref, rtol=1e-5, atol=1e-5)
    # ORT fuses DQ -> GlobalAveragePool -> Q: the pool reads the codes, nothing of it runs in float
    optimized = [n.op_type for n in ort_optimized_graph(q8).graph.node]
    assert "QLinearGlobalAveragePool" in optimized, optimized
    assert not {"GlobalAveragePool", "ReduceMean"} & set(optimized), optimized
    assert _sqnr(fake, _run(q8, x)) > 30.0


def test_a_norm_statistic_stays_reduce_mean(tmp_path: Path) -> None:
    """Rank 3: ORT's norm fusions look for the ReduceMean, and nothing quantizes the statistic."""
    torch.manual_seed(0)
    m = TokenNorm().eval()
    x = torch.randn(2, 5, 8)
    path = export_onnx(copy.deepcopy(m), x, tmp_path / "fp32.onnx")
    ops = _ops(path)
    assert "ReduceMean" in ops and "GlobalAveragePool" not in ops, ops
    q = quantize(m, SEVEN_BIT, [torch.randn(4, 5, 8) for _ in range(2)])
    ops8 = _ops(export_onnx(q, x, tmp_path / "int8.onnx"))
    assert "ReduceMean" in ops8 and "GlobalAveragePool" not in ops8, ops8


@pytest.mark.parametrize(("out_scale", "pooled"), [(0.02, True), (1e-5, False)])
def test_scales_outside_the_integer_kernel_keep_the_reduce_mean(out_scale: float, pooled: bool) -> None:
    """MLAS's QLinearGlobalAveragePool raises unless in_scale / (out_scale x H x W) lies in
    [2^-32, 256): a QAT-learned output scale far below the input's keeps the float ReduceMean,
    which ORT runs, where the rewrite would have given a file that fails at run time."""
    import onnxruntime as ort
    from compress.export.graph_forms import spatial_means_to_pools
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(np.array(v, dtype=np.float32), n) for n, v in
             (("sx", 0.05), ("sy", out_scale))] + [
        numpy_helper.from_array(np.array(0, dtype=np.uint8), "z"),
        numpy_helper.from_array(np.array([2, 3], dtype=np.int64), "axes")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "sx", "z"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "sx", "z"], ["xd"]),
             helper.make_node("ReduceMean", ["xd", "axes"], ["m"], keepdims=1),
             helper.make_node("QuantizeLinear", ["m", "sy", "z"], ["mq"]),
             helper.make_node("DequantizeLinear", ["mq", "sy", "z"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 3, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    assert spatial_means_to_pools(model) == int(pooled)
    assert ("GlobalAveragePool" in _ops_of(model)) is pooled
    x = np.random.default_rng(0).random((2, 4, 3, 3), dtype=np.float32)
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert y.shape == (2, 4, 1, 1)


def _ops_of(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]
