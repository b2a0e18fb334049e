"""The real-model suite: architectures nobody on this project wrote (transformers, random weights from
small configs) quantized w8a8 static, exported to QDQ and run in ONNX Runtime. Each must export,
match its fake-quant model in ORT, and run its Conv/MatMul/Gemm layers as integer kernels; what stays
float must be an op the placement names with a reason."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs the hf extra")

from torch import nn  # noqa: E402

from benchmarks.hf_suite import SUITE, SuiteModel, _bn_stats, _vision, suite  # noqa: E402


def _trimmed(name: str, trim: Callable[[nn.Module], None]) -> Callable[[int], SuiteModel]:
    """SUITE[name] with repeated blocks taken out of its module lists (where the Hugging Face config
    has no depth setting) and BatchNorm statistics measured again on the model that remains."""

    def build(seed: int = 0) -> SuiteModel:
        sm = SUITE[name](seed)
        trim(sm.model)
        for m in sm.model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.reset_running_stats()
        _bn_stats(sm.model, sm.calibration)
        return sm

    return build


def _one_transformer_layer_per_block(model: nn.Module) -> None:
    # MobileViT's blocks hold 2, 4 and 3 transformer layers, fixed in the model code
    for block in model.mobilevit.encoder.layer[2:]:  # type: ignore[union-attr,index]
        del block.transformer.layer[1:]


def _one_residual_block(model: nn.Module) -> None:
    # MobileNetV2's block table is fixed in the model code: of the 16 blocks after the stem, every one
    # that changes width or stride stays (so the head sees the same channels), and the first of the
    # 10 residual ones
    layers = model.mobilenet_v2.layer  # type: ignore[union-attr]
    residual = [b for b in layers if b.use_residual]
    model.mobilenet_v2.layer = nn.ModuleList(b for b in layers if not b.use_residual or b is residual[0])  # type: ignore[union-attr]


#: The test's configs: the benchmark's SUITE (benchmarks/real_models.py measures those) at test depth.
#: Every module and op type of each architecture stays (attention, MLP, norms, embeddings, patch
#: merging and downsampling, residual adds); what goes is repeats of them, which only made each
#: export (dynamo tracing and the graph passes cost in proportion to the nodes) take longer:
#: one transformer layer for the text models and ViT, two LeViT stages (one attention
#: subsample), MobileViT and MobileNetV2 trimmed as above.
TEST_SUITE: dict[str, Callable[[int], SuiteModel]] = {
    **suite(layers=1),
    "mobilevit": _trimmed("mobilevit", _one_transformer_layer_per_block),
    "mobilenetv2": _trimmed("mobilenetv2", _one_residual_block),
    "levit": _vision("LevitForImageClassification", "LevitConfig", 64, image_size=64, hidden_sizes=[32, 48],
                     num_attention_heads=[2, 3], depths=[1, 1], key_dim=[8, 8],
                     down_ops=[["Subsample", 8, 32 // 8, 4, 2, 2]], num_labels=10),
}

#: ORT output vs the fake-quant model; the gap that remains is rounding ties and ORT's requantization
#: of fused outputs. The random-init MobileNetV2 is all quantization noise (its SQNR to fp32 is about
#: 4 dB, with ORT's own quantize_static too), so the same small differences weigh more there.
PARITY_FLOOR_DB = {"mobilenetv2": 10.0}
DEFAULT_FLOOR_DB = 25.0
#: vision models whose head pools an image's spatial dims (AdaptiveAvgPool2d or ``mean((-2, -1))``,
#: ConvNeXt's read by a float LayerNorm); Swin pools tokens (rank 3) and stays out
POOLED = ("convnext", "mobilenetv2", "mobilevit", "regnet", "resnet")
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


@pytest.mark.parametrize("name", sorted(TEST_SUITE))
def test_real_model_exports_int8_that_ort_runs_in_integers(name: str, tmp_path: Path) -> None:
    from compress.export.onnx import export_onnx
    from compress.export.validation.runtimes import ort_coverage, ort_optimized_ops

    import compress

    sm = TEST_SUITE[name](0)
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
    # (RMSNorm's var + eps in Llama and Qwen2: an operand 1e2-1e8x the other; a residual add between a
    # Linear that writes float at no cost and float readers, Swin's first: integer_chains.float_islands)
    pl = q.quantizer_graph.placement
    kept_adds = {k: r for k, r in pl.floats.items() if ":add#" in k}
    assert len(cov.float_nodes) <= len(kept_adds), (cov.float_nodes, kept_adds)
    assert all("in magnitude" in r or r.startswith("elementwise op between float ops") for r in kept_adds.values()), kept_adds
    if not kept_adds:
        assert cov.float_nodes == [] and cov.integer > 0, cov.float_nodes
    if sm.kind == "text":  # token (and position) embedding tables are int8 rows
        assert any(u.table for u in pl.weights.values()), pl.weights
    if name in POOLED:  # the head's spatial mean runs on the codes (export/graph_forms.py)
        ops = ort_optimized_ops(path)
        assert ops["QLinearGlobalAveragePool"] >= 1 and not ops["GlobalAveragePool"], ops


@pytest.mark.parametrize("name", ["resnet", "bert"])
def test_qat_trains_real_models_with_placed_quantizers(name: str, tmp_path: Path) -> None:
    from compress.export.onnx import export_onnx
    from compress.quantization import calibrate, prepare, quantizers

    sm = TEST_SUITE[name](0)
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
