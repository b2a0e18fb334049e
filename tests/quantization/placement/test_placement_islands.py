"""Elementwise integer ops with no integer kernel on either side (issue 32): a chain of adds,
products and softmaxes whose inputs are made by float ops and whose outputs are read only by float
ops returns to float (placement pass ``float_islands``), named with its reason; on codes it would
only add a QuantizeLinear before it and a DequantizeLinear after it. The same chain between integer
kernels stays on codes."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from compress.export.onnx import export_onnx
from compress.export.validation.runtimes import ort_coverage, ort_optimized_graph
from compress.quantization import QuantizeParams, quantize
from compress.quantization.placement import cost_table as ct
from compress.quantization.view import view
from torch import nn

from tests.quantization.placement.test_model_cost import SLOW_MATMUL, _bound, _use

REASON = "elementwise op between float ops"
PRICED = "elementwise chain of"

#: SLOW_MATMUL's attention rows, with adds and products whose integer kernels gain 3x per element
#: over a fixed cost and quantizes and dequantizes of nearly fixed cost: priced by elements, an
#: elementwise chain beside integer kernels pays on codes only at large tensors
CHEAP_ELEMENTWISE = ct.CostTable("onnxruntime", "test ISA", "test", SLOW_MATMUL.rows, (
    _bound("enter:linear", 16, 4.0), _bound("enter:linear", 1e6, 5.0),
    _bound("leave:linear", 16, 4.0), _bound("leave:linear", 1e6, 5.0),
    _bound("add", 64, 3.0, 4.0), _bound("add", 1e6, 200.0, 600.0),  # (elements, int8 us, float us)
    _bound("mul", 64, 3.0, 4.0), _bound("mul", 1e6, 200.0, 600.0),
))


def _params(name: str) -> QuantizeParams:
    """``on codes``: the table off, every product on int8 codes; else the cost table's (``slow``: its
    ``matmul`` rows keep attention's products float)."""
    return QuantizeParams(model_check="warn") if name != "on codes" else QuantizeParams(cost_table=False)


class _BiasedAttention(nn.Module):
    """LeViT's attention: ``q @ k^T * scale`` plus a learned bias per head and position pair,
    softmax, ``@ v``, written out."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(32, 32) for _ in range(4))
        self.bias = nn.Parameter(torch.randn(2, 16, 16) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, 2, 16).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = torch.softmax(q @ k.transpose(-2, -1) * 0.25 + self.bias, dim=-1) @ v
        return self.o(a.transpose(1, 2).reshape(b, t, 32))


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - out).pow(2).mean()))


def test_bias_add_and_softmax_between_float_products_stay_float(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    """With both products kept float by the cost table, the bias add and the softmax between them
    stay float, named with the reason: no QLinearAdd or QLinearSoftmax in ORT's graph, and no
    DequantizeLinear. With the products on codes, the weighted sum reads the softmax's codes, and the
    softmax stays an integer kernel."""
    torch.manual_seed(0)
    m = _BiasedAttention().eval()
    data = [torch.randn(2, 16, 32) for _ in range(3)]
    x = torch.randn(2, 16, 32)
    with torch.no_grad():
        ref = m(x)
    ops: dict[str, dict[str, int]] = {}
    for name in ("slow", "on codes"):
        _use(monkeypatch, SLOW_MATMUL)
        q = quantize(copy.deepcopy(m), "w8a8", data, params=_params(name))
        floats = view(q).kept_float
        islands = {k for k, v in floats.items() if v.startswith(REASON)}
        if name == "slow":
            assert {k.split(":")[-1] for k in islands} == {"add#0", "softmax#0"}, floats
            pl = q.quantizer_graph.placement
            assert not any(k in pl.entries for k in islands), pl.entries  # no quantizer reads or writes them
            assert not any(qid.startswith("c") for qid in pl.activations), pl.activations  # the bias's is gone
        else:
            assert not islands, floats
        path = export_onnx(q, x, tmp_path / f"{name}.onnx")
        ops[name] = dict(ort_coverage(path).integer_ops)
        kinds = [n.op_type for n in ort_optimized_graph(path).graph.node]
        if name == "slow":
            # quantized where the model enters int8 and where the float weighted sum enters o: nothing
            # is dequantized
            assert "Softmax" in kinds and kinds.count("QuantizeLinear") == 2 and "DequantizeLinear" not in kinds, kinds
        with torch.no_grad():
            assert _sqnr(ref, q(x)) > 25.0
    assert "QLinearSoftmax" not in ops["slow"] and "QLinearAdd" not in ops["slow"], ops
    assert ops["slow"].get("QGemm") == 4, ops
    assert ops["on codes"].get("QLinearSoftmax") == 1, ops


class _Between(nn.Module):
    """The same add and softmax between two integer convs: both sides on codes."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.bias = nn.Parameter(torch.randn(1, 8, 1, 1) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.softmax(self.a(x) + self.bias, dim=1))


def test_the_same_chain_between_integer_kernels_stays_on_codes(tmp_path: Path) -> None:
    torch.manual_seed(0)
    data = [torch.randn(4, 3, 12, 12) for _ in range(3)]
    q = quantize(_Between().eval(), {"preset": "w8a8", "weights": {"reduce_range": True}}, data,
                 params=QuantizeParams(cost_table=False))
    assert not any(v.startswith(REASON) for v in view(q).kept_float.values())
    ints = ort_coverage(export_onnx(q, data[0], tmp_path / "m.onnx")).integer_ops
    assert ints.get("QLinearSoftmax") == 1 and ints.get("QLinearAdd") == 1, ints


def test_levit_attention_bias_and_softmax_stay_float_where_its_products_do(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path) -> None:
    """transformers' LeViT (from a config, random weights): with the weighted sums kept float, each
    attention's bias add and softmax stay float and ORT's graph runs no QLinearSoftmax; with every
    product on codes, every softmax runs as QLinearSoftmax."""
    pytest.importorskip("transformers")
    from benchmarks.hf_suite import suite

    sm = suite(layers=1)["levit"](0)
    softmaxes = {}
    for name in ("slow", "on codes"):
        _use(monkeypatch, SLOW_MATMUL)
        q = quantize(copy.deepcopy(sm.model), "w8a8", sm.calibration[:2], params=_params(name))
        floats = view(q).kept_float
        islands = {k.split(":")[-1].split("#")[0] for k, v in floats.items() if v.startswith(REASON)}
        assert islands == ({"add", "softmax"} if name == "slow" else set()), floats
        path = export_onnx(q, sm.example, tmp_path / f"{name}.onnx")
        softmaxes[name] = ort_coverage(path).integer_ops.get("QLinearSoftmax", 0)
    assert softmaxes["slow"] == 0 and softmaxes["on codes"] >= 2, softmaxes


@pytest.mark.slow  # 32 s in a full run: a 2-layer Llama quantized four times
def test_llama_rotary_stays_float_between_its_projections_and_float_attention(monkeypatch: pytest.MonkeyPatch,
                                                                            tmp_path: Path) -> None:
    """transformers' Llama (from a config, random weights): with attention kept float, the rotary
    products, adds and ``rotate_half`` concats of every layer stay float, decided together (they all
    read the same cos and sin): q_proj and k_proj, still int8, write float at no cost, and on codes
    the chain would pay a quantize of cos and sin and a dequantize before attention. With attention
    on codes they run as QLinearMul and QLinearConcat. Without a cost table, so they do served at
    batch 32 (FLOAT_WRITER_BATCH), where the projections write codes for them."""
    pytest.importorskip("transformers")
    from benchmarks.hf_suite import suite

    sm = suite(layers=2)["llama"](0)
    concats = {}
    for name in ("slow", "on codes", "cheap elementwise at batch 1", "cheap elementwise at batch 32"):
        _use(monkeypatch, CHEAP_ELEMENTWISE if name.startswith("cheap") else SLOW_MATMUL)
        params = _params(name)
        if name.endswith("32"):
            params = params.model_copy(update={"batch_sizes": (32,)})
        q = quantize(copy.deepcopy(sm.model), "w8a8", sm.calibration[:2], params=params)
        floats = view(q).kept_float
        rotary = {k: v for k, v in floats.items() if ".self_attn:" in k and v.startswith((REASON, PRICED))}
        if name in ("slow", "cheap elementwise at batch 1"):
            assert {k.rsplit(":", 1)[1].split("#")[0] for k in rotary} == {"mul", "add", "cat"}, floats
            assert len({k.split(".self_attn:")[0] for k in rotary}) == 2, rotary  # both layers
            assert not any("_proj:" in k for k in floats), floats  # the projections stay int8
            # the projections are integer kernels beside the chain: the table prices it, batch and all
            assert all(v.startswith(PRICED) and "at batch 1:" in v for v in rotary.values()), rotary
        else:
            assert not rotary, floats
        if name.startswith("cheap"):  # attention float there too: only the batch changed
            assert any(k.endswith(":sdpa#0") for k in floats), floats
        path = export_onnx(q, sm.example, tmp_path / f"{name}.onnx")
        concats[name] = ort_coverage(path).integer_ops.get("QLinearConcat", 0)
    assert concats["slow"] == 0 and concats["on codes"] >= 4, concats
    assert concats["cheap elementwise at batch 1"] == 0 and concats["cheap elementwise at batch 32"] >= 4, concats


def test_the_chains_are_decided_at_the_largest_batch_the_model_is_served_at() -> None:
    """``batch_sizes`` (a recipe's ``validate.batch_sizes``), else the batch ``speed_check`` times at."""
    from compress.quantization.placement.speed_check import SpeedCheck
    from compress.quantization.preparation import _serving_batch

    assert _serving_batch((1, 32), None) == 32 and _serving_batch((4,), SpeedCheck(batch=64)) == 4
    assert _serving_batch(None, SpeedCheck(batch=32)) == 32 and _serving_batch(None, SpeedCheck()) == 1
    assert _serving_batch(None, None) == 1


@pytest.mark.slow  # 33 s in a full run: a 2-layer Llama quantized three times
def test_shipped_intel_table_prices_a_decoders_chains_by_batch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The shipped Intel table (AVX-512 VNNI), whatever CPU runs the test, on transformers' Llama from a
    config: at 16 sequences of 32 tokens its RMSNorm and rotary chains price faster in float (small
    tensors: QLinearMul loses to Mul there and each edge adds a quantize or dequantize), each named with
    both prices, while SwiGLU's ``silu(gate) * up`` stays a QLinearMul (down_proj reads its codes, so
    in float it would pay that quantize besides); the projections stay int8, ORT runs fewer QLinearMul
    than with the table off, and the logits stay as close to float. Scaled to tensors 64x larger (1024 sequences) the same
    chains price on codes and none is named."""
    pytest.importorskip("transformers")
    from benchmarks.hf_suite import suite

    _use(monkeypatch, ct.shipped_tables()["vnni:intel"])
    sm = suite(layers=2)["llama"](0)
    x = sm.calibration[-1]
    with torch.no_grad():
        ref = sm.model(**x).logits
    out: dict[str, tuple[int, float]] = {}
    for name, params in (("batch 16", QuantizeParams(batch_sizes=(16,), model_check="warn")),
                         ("batch 1024", QuantizeParams(batch_sizes=(1024,), model_check="warn")),
                         ("table off", QuantizeParams(cost_table=False))):
        q = quantize(copy.deepcopy(sm.model), "w8a8", sm.calibration, params=params)
        floats = view(q).kept_float
        priced = {k: v for k, v in floats.items() if v.startswith(PRICED)}
        if name == "batch 16":
            scopes = {k.split(":")[0].rsplit(".", 1)[-1] for k in priced}
            assert {"input_layernorm", "post_attention_layernorm", "self_attn"} <= scopes, sorted(priced)
            assert not any(".mlp:" in k for k in floats), floats
            assert all("at batch 16:" in v and "us in float" in v and "us on codes" in v for v in priced.values())
            assert not any("_proj:" in k for k in floats), floats
        else:
            assert not priced, priced
        with torch.no_grad():
            sq = _sqnr(ref, q(**x).logits)
        path = export_onnx(q, sm.example, tmp_path / f"{name}.onnx")
        out[name] = (ort_coverage(path).integer_ops.get("QLinearMul", 0), sq)
    assert out["batch 16"][0] < out["table off"][0] and out["batch 1024"][0] >= out["table off"][0] - 2, out
    assert out["batch 16"][1] >= out["table off"][1] - 1.0, out
