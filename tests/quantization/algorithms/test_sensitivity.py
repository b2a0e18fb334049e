"""Sensitivity and accuracy control over layers and the graph's activation quantizers: a residual
operand that one 8-bit scale cannot hold is ranked first, kept float with its measured reason, and
the export leaves exactly that tensor float; padded positions count in no figure."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from compress.export.onnx import export_onnx
from compress.export.validation.parity import Parity
from compress.quantization import QuantizeParams, quantize, set_quantizers
from compress.quantization.algorithms.sensitivity import (
    accuracy_control,
    activation_sites,
    layer_sensitivity,
    revert_to_float,
)
from compress.quantization.placement.mode import graph_of
from torch import nn


class Block(nn.Module):
    """A post-LN residual block whose skip input carries a few huge channels (as BERT's do)."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(F.relu(self.up(x)))
        return self.head(self.norm(h + x))


def _model_and_data() -> tuple[nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    data = [torch.randn(16, 32) for _ in range(4)]
    for x in data:
        x[:, :2] *= 60.0  # outlier channels on the residual stream: one scale for all 32 wastes most codes
    return Block().eval(), data


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - out).pow(2).mean()))


def test_activation_sites_are_ranked_and_kept_float_by_accuracy_control(tmp_path: Path) -> None:
    fp, data = _model_and_data()
    q = quantize(copy.deepcopy(fp), "w8a8", data)
    # x, with the outlier channels, has one quantizer shared by its readers (up and the add's skip
    # operand), named by its first op call
    sites = activation_sites(q)
    assert sorted(sites) == [":add#0[0]", "down:linear#0[0]", "head:linear#0[0]", "norm:layer_norm#0[0]",
                             "up:linear#0[0]"]
    rows = layer_sensitivity(q, data=data)
    kinds = {r["type"] for r in rows}
    assert {"QuantLinear", "activation"} <= kinds
    assert rows[0]["type"] == "activation" and rows[0]["layer"] == "up:linear#0[0]", rows[:3]
    # every unit alone still quantizes something: each row's SQNR is finite
    assert all(np.isfinite(r["sqnr_db"]) for r in rows)

    x = torch.cat(data)
    with torch.no_grad():
        ref = fp(x)
        before = _sqnr(ref, q(x))

    def fidelity(m: nn.Module) -> float:
        with torch.no_grad():
            return _sqnr(ref, m(x))

    path0 = export_onnx(q, data[0], tmp_path / "before.onnx")
    reverted, metric = accuracy_control(q, evaluate=fidelity, max_drop=-(before + 3.0),
                                        ranking=[r["layer"] for r in rows[:1]], float_metric=0.0,
                                        higher_is_better=True)
    assert reverted == [rows[0]["layer"]] and metric > before + 3.0
    graph = graph_of(q)
    assert graph is not None
    site = rows[0]["layer"]
    reason = graph.placement.floats[site]
    assert reason.startswith("kept float by accuracy control: metric ") and "->" in reason
    assert graph.placement.floats[":add#0[1]"] == reason  # every reader of that tensor reads it float
    assert site not in activation_sites(q)
    # the file drops exactly that tensor's Q/DQ pair
    path1 = export_onnx(q, data[0], tmp_path / "after.onnx")

    def count(p: Path) -> int:
        return sum(n.op_type == "QuantizeLinear" for n in onnx.load(str(p)).graph.node)

    assert count(path1) == count(path0) - 1


def test_reverting_a_smoothed_input_keeps_the_float_function() -> None:
    fp, data = _model_and_data()
    q = quantize(copy.deepcopy(fp), "w8a8", data, params=QuantizeParams(smoothquant=0.5))
    smoothed = [s for s, (_, fq) in activation_sites(q).items() if fq.pre_quant_scale is not None]
    assert smoothed, "SmoothQuant gave no layer input a factor"
    x = torch.cat(data)
    for site in smoothed:
        revert_to_float(q, site)
    set_quantizers(q, enabled=False)
    with torch.no_grad():
        torch.testing.assert_close(q(x), fp(x), atol=1e-4, rtol=1e-4)


def test_parity_leaves_padded_positions_out() -> None:
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(2, 6, 4))
    out = ref + 0.01 * rng.normal(size=ref.shape)
    mask = np.ones((2, 6), dtype=np.int64)
    mask[1, :4] = 0
    noisy = out.copy()
    noisy[1, :4] = 100.0  # what a model computes at padding: discarded downstream, large here
    clean, masked = Parity(classification=False), Parity(classification=False)
    clean.update(ref * mask[..., None], out * mask[..., None])
    masked.update(ref, noisy, mask=mask)
    a, b = clean.result(), masked.result()
    assert b["cosine"] == a["cosine"] and b["sqnr_db"] == a["sqnr_db"] and b["max_abs_diff"] == a["max_abs_diff"]
    assert b["mean_abs_diff"] > a["mean_abs_diff"]  # over the 16 real positions, not all 24
    unmasked = Parity(classification=False)
    unmasked.update(ref, noisy)
    assert unmasked.result()["cosine"] < 0.9


def test_a_disabled_smoothed_quantizer_exports_its_factor(tmp_path: Path) -> None:
    """A quantizer switched off by hand still scales its input by the SmoothQuant factor (the
    weights carry the inverse); the export writes that Mul instead of dropping it."""
    import onnxruntime as ort

    fp, data = _model_and_data()
    # 7-bit weight codes: ORT's u8s8 kernels sum them exactly on CPUs without VNNI
    q = quantize(copy.deepcopy(fp), {"preset": "w8a8", "weights": {"reduce_range": True}}, data,
                 params=QuantizeParams(smoothquant=0.5))
    _, fq = next(v for v in activation_sites(q).values() if v[1].pre_quant_scale is not None)
    fq.enabled = False
    path = export_onnx(q, data[0], tmp_path / "m.onnx")
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (got,) = sess.run(None, {sess.get_inputs()[0].name: data[1].numpy()})
    with torch.no_grad():
        want = q(data[1]).numpy()
    assert _sqnr(torch.from_numpy(want), torch.from_numpy(got)) > 30.0
