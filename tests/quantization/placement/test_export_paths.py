"""A forward that takes another path under ``torch.export`` than in eager (transformers builds
attention masks only when exporting, and then repeats GQA's keys before attention): op calls are
resolved by call site, so the export still quantizes the calls the placement saw, with the
quantizers it placed, and a quantized output stays right after the op that makes it."""

from __future__ import annotations

from pathlib import Path

import onnx
import torch
from compress.export.onnx import export_onnx
from compress.export.validation.runtimes import ort_coverage, ort_optimized_graph
from compress.quantization.placement.mode import UNSEEN_REASON
from compress.quantization.view import view
from torch import nn

import compress


class ExportBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 32)
        self.fc2 = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_exporting():
            # an add only the export runs, ahead of the residual add in the same scope: with plain
            # per-scope indices it took the residual add's key and quantizers
            x = x + torch.zeros(32)
        h = self.fc1(x).relu() + x
        if torch.compiler.is_exporting():
            h = h.unsqueeze(1).squeeze(1)  # ops between the residual add and its reader (like repeat_kv)
        return self.fc2(h)


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - out).pow(2).mean()))


def test_export_only_calls_do_not_shift_the_placed_quantizers(tmp_path: Path) -> None:
    import onnxruntime as ort

    torch.manual_seed(0)
    data = [torch.randn(8, 32) for _ in range(4)]
    q = compress.quantize(ExportBranch().eval(), {"preset": "w8a8", "weights": {"reduce_range": True}}, data[1:])
    sites = q.quantizer_graph.placement.sites
    assert sites[":add#0"].startswith("ExportBranch.forward+"), sites
    with torch.no_grad():
        fake = q(data[0])
    path = export_onnx(q, data[0], tmp_path / "q.onnx")
    out = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"input": data[0].numpy()})[0]
    assert _sqnr(fake, torch.from_numpy(out)) > 35.0  # ORT computes what the fake-quant model does
    ops = [n.op_type for n in ort_optimized_graph(path).graph.node]
    assert ops.count("QLinearAdd") == 1, ops  # the residual add, its output quantized right after it
    # the export-only add stays float, and the export names it with the reason
    unseen = list(q.quantizer_graph.unseen)
    assert len(unseen) == 1 and unseen[0].startswith(":add@ExportBranch.forward+"), unseen
    assert view(q).kept_float[unseen[0]] == UNSEEN_REASON
    assert len(ort_coverage(path).float_nodes) == 1


def test_a_quantized_output_is_applied_where_the_op_makes_it(tmp_path: Path) -> None:
    torch.manual_seed(0)
    data = [torch.randn(8, 32) for _ in range(3)]
    q = compress.quantize(ExportBranch().eval(), "w8a8", data[1:])
    produced = q.quantizer_graph.placement.produced
    assert ":add#0/0" in produced  # the residual add's output
    path = export_onnx(q, data[0], tmp_path / "q.onnx")
    g = onnx.load(str(path)).graph
    readers = {i: n for n in g.node for i in n.input}
    adds = [n for n in g.node if n.op_type == "Add" and readers.get(n.output[0]) is not None]
    assert any(readers[n.output[0]].op_type == "QuantizeLinear" for n in adds), [
        (n.name, readers[n.output[0]].op_type) for n in adds]
