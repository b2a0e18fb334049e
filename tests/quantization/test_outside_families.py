"""Families outside the real-model suite (transformers definitions, random weights), each picked for
a structure the suite lacks: GPT-Neo adds its padding mask to scores already filled with
finfo.min, Falcon runs attention and MLP in parallel off one fused QKV, SegFormer reduces keys and
values with a strided conv, DeiT carries a distillation token, DistilBERT fills masked scores with
``masked_fill``, MPNet adds a relative position bias in place (``+=``) and builds its mask only when
exported, BEiT adds a mask to its position bias only when exported (ahead of its residual add),
PoolFormer's GroupNorm is exported as InstanceNormalization, Mul and Add, DeiT with its teacher
head averages two heads' logits that it also returns. Each must quantize,
export, run in ONNX Runtime as the fake-quant model computes, run every weighted op in integers,
and name the reason for every add that stays float."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from compress.export.validation.describe import describe_onnx
from compress.export.validation.runtimes import ort_coverage
from compress.quantization.view import view

import compress

SCHEME = {"preset": "w8a8", "weights": {"reduce_range": True}}  # exact u8s8 sums without VNNI (README)
TEXT = dict(vocab_size=256)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gpt_neo": ("GPTNeoForCausalLM", "GPTNeoConfig", dict(
        TEXT, hidden_size=64, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]], window_size=8)),
    "falcon": ("FalconForCausalLM", "FalconConfig", dict(TEXT, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)),
    "distilbert": ("DistilBertModel", "DistilBertConfig", dict(TEXT, dim=64, hidden_dim=128, n_layers=2, n_heads=4)),
    "segformer": ("SegformerForImageClassification", "SegformerConfig", dict(
        hidden_sizes=[16, 32], depths=[1, 1], num_attention_heads=[1, 2], num_encoder_blocks=2, sr_ratios=[4, 2],
        decoder_hidden_size=32, num_labels=10)),
    "mpnet": ("MPNetModel", "MPNetConfig", dict(
        TEXT, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)),
    "beit": ("BeitForImageClassification", "BeitConfig", dict(
        image_size=32, patch_size=8, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        use_relative_position_bias=True, num_labels=10)),
    "poolformer": ("PoolFormerForImageClassification", "PoolFormerConfig", dict(
        hidden_sizes=[16, 32], depths=[1, 1], num_encoder_blocks=2, patch_sizes=[7, 3], strides=[4, 2], padding=[2, 1],
        num_labels=10)),
    "deit": ("DeiTForImageClassification", "DeiTConfig", dict(
        image_size=32, patch_size=8, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_labels=10)),
    "deit_teacher": ("DeiTForImageClassificationWithTeacher", "DeiTConfig", dict(
        image_size=32, patch_size=8, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_labels=10)),
}

#: SQNR of the fake-quant model to fp32: a random-init ViT's logits are tiny and mostly quantization
#: noise (the suite's ViT measures 7-8 dB, ORT's own quantize_static the same), so DeiT's floor is low
FIDELITY_FLOOR_DB = {"deit": 3.0, "deit_teacher": 3.0, "beit": 3.0}


def _build(family: str) -> tuple[torch.nn.Module, list[Any]]:
    cls, cfg, kw = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, cfg)(**kw)
    if hasattr(config, "use_cache"):
        config.use_cache = False
    model = getattr(transformers, cls)(config).eval()
    g = torch.Generator().manual_seed(1)
    if "vocab_size" in kw:
        return model, [{"input_ids": torch.randint(0, 256, (2, 16), generator=g)} for _ in range(3)]
    size = 32 if family in ("deit", "deit_teacher", "beit") else 64
    return model, [torch.randn(2, 3, size, size, generator=g) for _ in range(3)]


def _out(model: torch.nn.Module, x: Any) -> torch.Tensor:
    with torch.no_grad():
        o = model(**x) if isinstance(x, dict) else model(x)
    return o.logits if getattr(o, "logits", None) is not None else o.last_hidden_state  # type: ignore[no-any-return]


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - out).pow(2).mean()))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_outside_the_suite_quantizes_and_runs_in_integers(family: str, tmp_path: Path) -> None:
    import onnxruntime as ort

    model, data = _build(family)
    ref = _out(model, data[0])
    q = compress.quantize(model, SCHEME, data[1:])
    fake = _out(q, data[0])
    assert _sqnr(ref, fake) > FIDELITY_FLOOR_DB.get(family, 15.0), _sqnr(ref, fake)
    path = compress.export_onnx(q, data[0], tmp_path / "q.onnx")
    s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = data[0]
    feeds = {i.name: (x[i.name] if isinstance(x, dict) else x).numpy() for i in s.get_inputs()}
    out = torch.from_numpy(s.run(None, feeds)[0])
    assert _sqnr(fake, out) > 25, _sqnr(fake, out)  # the real-model suite's parity floor
    cov = ort_coverage(path)
    assert [n for n in cov.float_nodes if not n.startswith("Add:")] == [], cov.float_nodes
    # every add ORT runs in float is named with its reason (placement, export-only call, exporter's op)
    kept = {**describe_onnx(path).kept_float, **view(q).kept_float}
    named = [k for k in kept if ":add" in k or k.startswith("ONNX Add:")]
    assert len(cov.float_nodes) <= len(named), (cov.float_nodes, kept)
    assert cov.integer > 0
