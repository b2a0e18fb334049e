"""The real-model suite: architectures nobody on this project wrote (transformers, random weights from
small configs) quantized w8a8 static, exported to QDQ and run in ONNX Runtime. Each must export,
match its fake-quant model in ORT, and run its Conv/MatMul/Gemm layers as integer kernels; what stays
float must be an op the placement names with a reason."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs compress[hf]")

from benchmarks.hf_suite import SUITE  # noqa: E402

#: ORT output vs the fake-quant model; the gap that remains is rounding ties and ORT's requantization
#: of fused outputs. The random-init MobileNetV2 is all quantization noise (its SQNR to fp32 is about
#: 4 dB, with ORT's own quantize_static too), so the same small differences weigh more there.
PARITY_FLOOR_DB = {"mobilenetv2": 10.0}
DEFAULT_FLOOR_DB = 25.0
#: 7-bit weight codes (calibrated so): ORT's u8s8 kernels on CPUs without VNNI saturate on 8-bit ones
SCHEME = {"preset": "w8a8", "weights": {"reduce_range": True}}


def _run(model: torch.nn.Module, x: object) -> torch.Tensor:
    out = model(**x) if isinstance(x, dict) else model(x)  # type: ignore[arg-type]
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _ort(path: Path, x: object) -> torch.Tensor:
    import onnxruntime as ort

    s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in s.get_inputs()]
    feeds = {n: x[n].numpy() for n in names} if isinstance(x, dict) else {names[0]: x.numpy()}  # type: ignore[union-attr]
    return torch.from_numpy(s.run(None, feeds)[0])


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - out).pow(2).mean()))


@pytest.mark.parametrize("name", sorted(SUITE))
def test_real_model_exports_int8_that_ort_runs_in_integers(name: str, tmp_path: Path) -> None:
    import compress
    from export.onnx import export_onnx
    from export.runtimes import ort_coverage

    sm = SUITE[name](0)
    q = compress.quantize(sm.model, SCHEME, sm.calibration[:2])
    path = export_onnx(q, sm.example, tmp_path / f"{name}.int8.onnx")
    with torch.no_grad():
        fake = _run(q, sm.example)
    assert _sqnr(fake, _ort(path, sm.example)) > PARITY_FLOOR_DB.get(name, DEFAULT_FLOOR_DB)
    cov = ort_coverage(path)
    weighted_float = [n for n in cov.float_nodes if not n.startswith("Add:")]
    assert weighted_float == [], weighted_float  # every Conv/MatMul/Gemm runs in integers
    # adds with a constant or broadcast operand (position embeddings, attention biases, GELU's 1 + tanh)
    # run as QLinearAdd too; what stays float is an add the placement names, for its measured reason
    # (RMSNorm's var + eps in Llama and Qwen2: an operand 1e2-1e8x the other)
    pl = q.quantizer_graph.placement
    kept_adds = {k: r for k, r in pl.floats.items() if ":add#" in k}
    assert len(cov.float_nodes) <= len(kept_adds), (cov.float_nodes, kept_adds)
    assert all("in magnitude" in r for r in kept_adds.values()), kept_adds
    if name not in ("llama", "qwen2"):
        assert cov.float_nodes == [] and cov.integer > 0, cov.float_nodes
    if sm.kind == "text":  # token (and position) embedding tables are int8 rows
        assert any(u.table for u in pl.weights.values()), pl.weights


@pytest.mark.parametrize("name", ["resnet", "bert"])
def test_qat_trains_real_models_with_placed_quantizers(name: str, tmp_path: Path) -> None:
    from export.onnx import export_onnx
    from quantization import calibrate, prepare, quantizers

    sm = SUITE[name](0)
    model = sm.model
    prepare(model, SCHEME, bn="qat", example_inputs=sm.example)
    calibrate(model, sm.calibration[:2])
    scales = [q for _, q in quantizers(model) if q.role != "weight"]
    assert len(scales) > 5
    params = [q.enable_lsq() for q in scales]
    opt = torch.optim.Adam([*model.parameters(), *params], lr=1e-3)  # steps independent of the loss scale
    before = {id(p): p.detach().clone() for p in params}
    model.train()
    losses = []
    for x in sm.calibration[:3]:
        out = _run(model, x)
        loss = out.float().pow(2).mean()  # any differentiable objective: gradients reach weights and scales
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert all(torch.isfinite(torch.tensor(losses)))
    assert any(not torch.equal(before[id(p)], p.detach()) for p in params)  # LSQ scales learned
    model.eval()
    for q in scales:
        q.disable_lsq()
    path = export_onnx(model, sm.example, tmp_path / f"{name}.qat.onnx")
    with torch.no_grad():
        fake = _run(model, sm.example)
    assert _sqnr(fake, _ort(path, sm.example)) > DEFAULT_FLOOR_DB
