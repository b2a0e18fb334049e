"""The cost table's model-level check (issue 32): a whole int8 model predicted against fp32 at the
batches it is served at, entering and leaving int8 and integer adds included; where int8 is not
predicted faster at every one, a warning by default, and with ``model_check="float"`` the whole model
stays float and says why, in the placement, the export record and the run's validation report."""

from __future__ import annotations

import copy
from typing import Any

import compress.quantization.preparation as preparation
import pytest
import torch
from compress.quantization import QuantizeParams, quantize
from compress.quantization.placement import cost_table as ct
from compress.quantization.placement.model_cost import model_cost, unpriced_ops
from compress.quantization.placement.records import Placement
from compress.quantization.placement.speed_check import layer_calls
from compress.quantization.placement.trace import trace_ops
from compress.quantization.view import is_quantized, view
from torch import nn

from compress.models import build_zoo_model


def _row(kind: str, feats: tuple[float, ...], float_us: float, int8_us: float,
         kernel_us: float | None = None) -> ct.Row:
    return ct.Row(ct.LayerShape(kind, feats), float_us, int8_us, kernel_us)


def _bound(kind: str, elements: float, us: float, float_us: float = 0.0) -> ct.Row:
    return _row(kind, (elements,), float_us, us)


#: int8 kernels level with float at a few pixels, 3x faster at many; entering/leaving int8 5-8 us,
#: an integer add 4 us where a float one costs 3 (the shape of the measured rows, rounded)
TABLE = ct.CostTable("onnxruntime", "test ISA", "test", (
    _row("conv", (3, 16, 49, 64), 20.0, 22.0, 19.0),
    _row("conv", (3, 16, 49, 2048), 300.0, 200.0, 290.0),
    _row("conv", (3, 64, 49, 4096), 1500.0, 700.0, 1450.0),
    _row("conv", (16, 16, 9, 4), 5.0, 4.0, 3.0),
    _row("conv", (16, 16, 1, 4), 4.0, 3.0, 2.0),
    _row("conv", (16, 16, 9, 128), 30.0, 14.0, 28.0),
    _row("conv", (16, 16, 1, 128), 12.0, 6.0, 11.0),
    _row("conv", (64, 64, 9, 1024), 800.0, 250.0, 780.0),
    _row("conv", (64, 64, 1, 256), 40.0, 15.0, 38.0),
    _row("conv", (16, 16, 9, 64), 9.0, 6.0, 6.0),
    _row("conv", (16, 16, 9, 2048), 80.0, 30.0, 75.0),
    _row("conv", (64, 64, 9, 65536), 3000.0, 1000.0, 2900.0),
    _row("conv", (16, 16, 1, 64), 6.0, 4.0, 4.0),
    _row("conv", (16, 16, 1, 2048), 30.0, 12.0, 28.0),
    _row("conv", (64, 64, 1, 65536), 1000.0, 350.0, 950.0),
    _row("linear", (1, 64, 10), 4.0, 3.0, 3.0),
    _row("linear", (32, 512, 10), 8.0, 4.0, 7.0),
), (
    _bound("enter:conv", 64, 5.0), _bound("enter:conv", 1e6, 80.0),
    _bound("leave:conv", 64, 5.0), _bound("leave:conv", 1e6, 80.0),
    _bound("enter:linear", 16, 4.0), _bound("enter:linear", 1e5, 20.0),
    _bound("leave:linear", 16, 4.0), _bound("leave:linear", 1e5, 20.0),
    _bound("add", 64, 4.0, 3.0), _bound("add", 1e6, 200.0, 150.0),
))


def _hf_resnet(hidden: list[int]) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.ResNetConfig(num_channels=3, embedding_size=hidden[0], hidden_sizes=hidden,
                                    depths=[1] * len(hidden), layer_type="basic", num_labels=10)
    return transformers.ResNetForImageClassification(cfg).eval()


def _images(batch: int, size: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, 3, size, size, generator=g) for _ in range(2)]


def _use(monkeypatch: pytest.MonkeyPatch, table: ct.CostTable) -> None:
    monkeypatch.setattr(preparation, "table_for", lambda isa, cpu=None: table)


def test_small_model_predicted_slower_at_batch_1_stays_float_with_the_reason(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """A transformers ResNet at a few pixels: its kernels gain little and entering/leaving int8 and
    the integer adds cost more; at batch 1 (the default batch) with ``model_check="float"`` the whole
    model stays float, each layer and add named with the reason, nothing placed, nothing quantized in
    the export."""
    _use(monkeypatch, TABLE)
    model = _hf_resnet([16, 16])
    q = quantize(copy.deepcopy(model), "w8a8", _images(4, 16), params=QuantizeParams(model_check="float"))
    v = view(q)
    assert v.model_float is not None and v.model_float.startswith("int8 predicted slower than fp32 at batch 1: "), v
    assert "entering/leaving int8" in v.model_float and "test ISA, test)" in v.model_float
    assert not is_quantized(q)
    convs = [k for k in v.kept_float if ":conv#" in k]
    assert convs and all(v.kept_float[k] == v.model_float for k in convs)
    assert any(":add#" in k for k in v.kept_float)
    import onnx
    from compress.export.onnx import export_onnx

    path = export_onnx(q, _images(1, 16)[0], tmp_path / "m.onnx")
    assert not [n for n in onnx.load(str(path)).graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    # served at batch 32 only, the same model is predicted faster in int8 and quantized
    q32 = quantize(copy.deepcopy(model), "w8a8", _images(4, 16), params=QuantizeParams(batch_sizes=(32,), model_check="float"))
    assert view(q32).model_float is None and is_quantized(q32)
    # asked for both, the slowest batch decides
    both = quantize(copy.deepcopy(model), "w8a8", _images(4, 16), params=QuantizeParams(batch_sizes=(1, 32), model_check="float"))
    got = view(both).model_float
    assert got is not None and "at batch 1" in got and "batch 32: " in got


def test_by_default_the_prediction_is_logged_and_int8_kept(monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """The table's batch-1 rows lean to float on small models (RESULTS export_int8_quickstart), so the
    whole-model prediction only warns unless ``model_check="float"`` is asked for."""
    _use(monkeypatch, TABLE)
    with caplog.at_level("WARNING"):
        q = quantize(_hf_resnet([16, 16]), "w8a8", _images(4, 16))
    assert view(q).model_float is None and is_quantized(q)
    assert any("int8 predicted slower than fp32 at batch 1" in r.getMessage() and "int8 kept" in r.getMessage()
               for r in caplog.records)


def test_by_default_a_model_predicted_slower_at_batch_16_or_more_stays_float(monkeypatch: pytest.MonkeyPatch) -> None:
    """``model_check="auto"`` (the default) acts on the prediction where it has held (batch >= 16:
    model_cost.TRUSTED_BATCH) and only warns below; ``warn`` never acts."""
    from compress.quantization.placement.model_cost import TRUSTED_BATCH

    # a row near the classifier at batch 32, and boundaries so costly that any judged batch loses
    costly = ct.CostTable("onnxruntime", "test ISA", "test", (*TABLE.rows, _row("linear", (32, 16, 10), 5.0, 4.0, 4.0)),
                          tuple(ct.Row(r.shape, r.float_us, r.int8_us * 1e4) for r in TABLE.boundary))
    _use(monkeypatch, costly)
    model = _hf_resnet([16, 16])
    served = quantize(copy.deepcopy(model), "w8a8", _images(4, 16), params=QuantizeParams(batch_sizes=(1, 32)))
    got = view(served).model_float
    assert got is not None and not is_quantized(served)
    assert f"model_check: auto, predicted slower at batch 32 >= {TRUSTED_BATCH}" in got
    small = quantize(copy.deepcopy(model), "w8a8", _images(4, 16), params=QuantizeParams(batch_sizes=(1, 8)))
    assert view(small).model_float is None and is_quantized(small)  # below the trusted batch: a warning
    warned = quantize(copy.deepcopy(model), "w8a8", _images(4, 16),
                      params=QuantizeParams(batch_sizes=(32,), model_check="warn"))
    assert view(warned).model_float is None and is_quantized(warned)


def test_a_larger_model_stays_int8_at_batch_1(monkeypatch: pytest.MonkeyPatch) -> None:
    """Wider channels on larger images: the kernels' gain outweighs the boundaries at batch 1."""
    _use(monkeypatch, TABLE)
    q = quantize(_hf_resnet([64, 64]), "w8a8", _images(2, 128), params=QuantizeParams(model_check="float"))
    assert view(q).model_float is None and is_quantized(q)


def test_cost_table_off_and_tables_without_boundary_rows_quantize(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _hf_resnet([16, 16])
    _use(monkeypatch, TABLE)
    off = quantize(copy.deepcopy(model), "w8a8", _images(4, 16), params=QuantizeParams(cost_table=False, model_check="float"))
    assert view(off).model_float is None and is_quantized(off)
    _use(monkeypatch, ct.CostTable("onnxruntime", "old", "test", TABLE.rows))  # a table measured before boundary rows
    old = quantize(copy.deepcopy(model), "w8a8", _images(4, 16), params=QuantizeParams(model_check="float"))
    assert view(old).model_float is None and is_quantized(old)


def test_a_batch_far_from_every_measured_shape_is_not_judged(monkeypatch: pytest.MonkeyPatch) -> None:
    """Boundaries so costly that any predicted batch keeps the model float: at batch 1 it does; at
    batch 4096 the layers are far from every row (MAX_DISTANCE), nothing is predicted, int8 stays."""
    costly = ct.CostTable("onnxruntime", "test ISA", "test", TABLE.rows,
                          tuple(ct.Row(r.shape, r.float_us, r.int8_us * 1e4) for r in TABLE.boundary))
    _use(monkeypatch, costly)
    model = _hf_resnet([16, 16])
    b1 = quantize(copy.deepcopy(model), "w8a8", _images(4, 16), params=QuantizeParams(batch_sizes=(1,), model_check="float"))
    assert view(b1).model_float is not None
    far = quantize(copy.deepcopy(model), "w8a8", _images(4, 16), params=QuantizeParams(batch_sizes=(4096,), model_check="float"))
    assert view(far).model_float is None and is_quantized(far)
    both = quantize(copy.deepcopy(model), "w8a8", _images(4, 16), params=QuantizeParams(batch_sizes=(1, 4096), model_check="float"))
    got = view(both).model_float
    assert got is not None and "batch 4096: not predicted" in got


def test_models_with_unpriced_integer_ops_keep_the_layer_rows_placement(monkeypatch: pytest.MonkeyPatch) -> None:
    """A transformers ViT: attention's activation products run as integer kernels the table has no
    rows for (measured faster in int8 on the suite), so the model-level check does not judge it."""
    transformers = pytest.importorskip("transformers")
    _use(monkeypatch, TABLE)
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(image_size=16, patch_size=8, hidden_size=16, num_hidden_layers=1,
                                 num_attention_heads=2, intermediate_size=32, num_labels=10)
    q = quantize(transformers.ViTForImageClassification(cfg).eval(), "w8a8", _images(2, 16),
                 params=QuantizeParams(model_check="float"))
    assert view(q).model_float is None and is_quantized(q)
    g = trace_ops(transformers.ViTForImageClassification(cfg).eval(), (_images(1, 16)[0],), {})
    assert unpriced_ops(g), "the ViT's attention should count as unpriced"


def test_model_cost_counts_entries_exits_and_adds() -> None:
    """The quickstart's ResNet all int8: the input and the classifier's input enter int8, the last
    block's output (read by the float mean) and the logits leave it, and the three residual adds are
    integer ones that fp32 ORT fuses into the conv before them (free on the float side)."""
    torch.manual_seed(0)
    m = build_zoo_model("resnet", {"width": 16, "depth": 1, "num_classes": 10, "in_channels": 1}).eval()
    x = torch.randn(8, 1, 8, 8)
    graph = trace_ops(m, (x,), {})
    layers = {n: mod for n, mod in m.named_modules() if isinstance(mod, (nn.Conv2d, nn.Linear))}
    c = model_cost(graph, layers, set(layers), TABLE, batch=1, example_batch=8)
    assert (c.entries, c.exits, c.adds) == (2, 2, 3)
    def us(kind: str, n: float) -> float:
        return (TABLE.boundary_us(kind, n) or (0.0, 0.0))[1]

    # batch 1: the adds at 16x8x8, 32x4x4, 64x2x2; in 1x8x8, out of the last block 64x2x2, the
    # classifier's input 64 and its logits 10
    assert c.adds_float_us == 0.0 and c.adds_int8_us == pytest.approx(us("add", 1024) + us("add", 512) + us("add", 256))
    assert c.boundary_us == pytest.approx(us("enter:conv", 64) + us("leave:conv", 256) + us("enter:linear", 64)
                                          + us("leave:linear", 10))
    # the stem float: the first block's conv enters int8 instead, and its residual add (the stem's
    # float output plus int8) stays float
    c2 = model_cost(graph, layers, set(layers) - {"stem.0"}, TABLE, batch=1, example_batch=8)
    assert (c2.entries, c2.adds) == (3, 2) and c2.other_float_us > 0
    assert c2.float_us == pytest.approx(c.float_us)  # the fp32 model is the same either way
    assert c.float_us < c.int8_us  # at batch 1 the boundaries cost more than the kernels save
    assert model_cost(graph, layers, set(layers), TABLE, batch=512, example_batch=8).speedup > 1.0
    # the profiler's cost per node comes off every node counted: two per conv boundary, one per add
    lean = ct.CostTable("onnxruntime", "test ISA", "test", TABLE.rows, TABLE.boundary, profile_overhead_us=1.0)
    c3 = model_cost(graph, layers, set(layers), lean, batch=1, example_batch=8)
    assert c3.boundary_us == pytest.approx(c.boundary_us - (2 + 2 + 1 + 1))
    assert c3.adds_int8_us == pytest.approx(c.adds_int8_us - 3)
    assert set(layer_calls(graph, layers)) == set(layers)
    assert not unpriced_ops(graph)  # a conv net: every op whose int8 form differs in cost is priced


class _Gated(nn.Module):
    """A product of two int8 activations (a gate; hardswish's x * hardsigmoid(x) has the same form)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 16, 3, padding=1)
        self.b = nn.Conv2d(16, 16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.a(x)
        return a * self.b(torch.relu(a))


def test_products_of_activations_are_priced_by_tables_with_mul_rows() -> None:
    """A table with ``mul`` rows (QLinearMul against float Mul, by element count) prices a product of
    two int8 activations like an add; a table without them leaves the model unjudged."""
    torch.manual_seed(0)
    m = _Gated().eval()
    graph = trace_ops(m, (torch.randn(2, 3, 8, 8),), {})
    layers = {"a": m.a, "b": m.b}
    assert unpriced_ops(graph, TABLE) == {"mul": 1}
    with_mul = ct.CostTable("onnxruntime", "test ISA", "test", TABLE.rows,
                            (*TABLE.boundary, _bound("mul", 64, 6.0, 2.0), _bound("mul", 1e6, 300.0, 100.0)))
    assert unpriced_ops(graph, with_mul) == {}
    c = model_cost(graph, layers, set(layers), with_mul, batch=1, example_batch=2)
    assert c.adds == 1  # the product, 16x8x8 = 1024 elements, both operands int8
    f, i = with_mul.boundary_us("mul", 1024) or (0.0, 0.0)
    assert (c.adds_float_us, c.adds_int8_us) == (pytest.approx(f), pytest.approx(i))
    assert model_cost(graph, layers, set(layers), TABLE, batch=1, example_batch=2).adds == 0  # not priced there


class _Attention(nn.Module):
    """One attention block: q/k/v projections, attention (the fused call, or written out with a
    softmax as LeViT and MobileViT write it) and the output projection."""

    def __init__(self, written_out: bool) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(32, 32) for _ in range(4))
        self.written_out = written_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, 2, 16).transpose(1, 2) for p in (self.q, self.k, self.v))
        if self.written_out:
            a = torch.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1) @ v
        else:
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.o(a.transpose(1, 2).reshape(b, t, 32))


#: TABLE with attention's products measured: QLinearMatMul level with float MatMul at a small
#: size, 20% faster at a large one
WITH_MATMUL = ct.CostTable("onnxruntime", "test ISA", "test", (
    *TABLE.rows, _row("matmul", (4, 16, 16, 16), 10.0, 10.0, 10.0), _row("matmul", (64, 256, 64, 256), 5000.0, 4000.0, 5000.0),
), TABLE.boundary)


@pytest.mark.parametrize("written_out", [False, True])
def test_attention_products_are_priced_by_tables_with_matmul_rows(written_out: bool) -> None:
    """A table with ``matmul`` rows prices attention on int8 codes (scores ``q @ k^T``, then the
    softmax output, quantized, by ``v``) against float MatMul; a table without them leaves the model
    unjudged, and a model whose q/k/v are float pays no product at all."""
    torch.manual_seed(0)
    m = _Attention(written_out).eval()
    graph = trace_ops(m, (torch.randn(2, 16, 32),), {})
    layers = {n: getattr(m, n) for n in "qkvo"}
    assert unpriced_ops(graph, TABLE) and not unpriced_ops(graph, WITH_MATMUL)
    c = model_cost(graph, layers, set(layers), WITH_MATMUL, batch=1, example_batch=2)
    assert c.matmuls == 2
    # batch 1: 2 heads of 16 tokens by 16 dims, both products 2x16x16x16 = half the small row's work
    assert (c.matmul_float_us, c.matmul_int8_us) == (pytest.approx(10.0), pytest.approx(10.0))
    # entering int8: the input (16x32) and the softmax output (2x16x16); leaving: o's output
    enter = (WITH_MATMUL.boundary_us("enter:linear", 512) or (0.0, 0.0))[1]
    leave = (WITH_MATMUL.boundary_us("leave:linear", 512) or (0.0, 0.0))[1]
    assert (c.entries, c.exits) == (2, 1) and c.boundary_us == pytest.approx(2 * enter + leave)
    assert "2 attention products" in c.describe()
    # a larger product reads the large row, scaled by the multiply-adds (twice its work here)
    assert WITH_MATMUL.matmul_us(128, 256, 64, 256) == (pytest.approx(10000.0), pytest.approx(8000.0))
    # q, k, v float: placement still runs attention on codes, so q, k, v and the softmax output enter int8
    c2 = model_cost(graph, layers, {"o"}, WITH_MATMUL, batch=1, example_batch=2)
    assert (c2.matmuls, c2.entries, c2.exits) == (2, 4, 1)
    # attention kept float (slower_attention's keys): nothing priced for it, and o enters int8 after it
    att = [n.key for n in graph.nodes.values() if n.kind in ("matmul", "sdpa")]
    c3 = model_cost(graph, layers, {"o"}, WITH_MATMUL, batch=1, example_batch=2, float_ops=att)
    assert (c3.matmuls, c3.matmul_float_us, c3.matmul_int8_us, c3.float_attention) == (0, 0.0, 0.0, len(att))
    assert (c3.entries, c3.exits) == (1, 1)


def test_auto_warns_but_does_not_act_on_attention(monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """An attention model predicted slower at batch 32: the default (``auto``) keeps int8 and warns,
    since such predictions fell on the wrong side of 1 for ViT, Swin and windowed attention on the
    suite (model_cost.trusted_slower); ``model_check="float"`` acts on it."""
    # a row at the projections' shape at batch 32 (16 tokens each), and boundaries so costly that int8 loses
    costly = ct.CostTable("onnxruntime", "test ISA", "test", (*WITH_MATMUL.rows, _row("linear", (512, 32, 32), 20.0, 10.0, 18.0)),
                          tuple(ct.Row(r.shape, r.float_us, r.int8_us * 1e4) for r in WITH_MATMUL.boundary))
    _use(monkeypatch, costly)
    torch.manual_seed(0)
    data = [torch.randn(2, 16, 32) for _ in range(2)]
    with caplog.at_level("WARNING"):
        q = quantize(_Attention(False).eval(), "w8a8", data, params=QuantizeParams(batch_sizes=(32,)))
    assert view(q).model_float is None and is_quantized(q)
    assert any("int8 predicted slower than fp32 at batch 32" in r.getMessage() and "not for attention" in r.getMessage()
               for r in caplog.records)
    f = quantize(_Attention(False).eval(), "w8a8", data, params=QuantizeParams(batch_sizes=(32,), model_check="float"))
    assert view(f).model_float is not None and not is_quantized(f)


def test_boundary_lookup_interpolates_and_scales() -> None:
    assert TABLE.boundary_us("enter:conv", 10) == (0.0, 5.0)  # below the smallest size: its cost
    f, i = TABLE.boundary_us("enter:conv", 64 + (1e6 - 64) / 2) or (None, None)
    assert f == 0.0 and i == pytest.approx(42.5)
    f, i = TABLE.boundary_us("add", 2e6 - 64) or (None, None)  # above the largest: the last slope
    assert f == pytest.approx(297.0) and i == pytest.approx(396.0)
    assert TABLE.boundary_us("enter:depthwise", 64) is None
    data = {"runtime": "onnxruntime", "isa": "x", "rows": [
        {"kind": "conv", "features": [1, 2, 9, 4], "float_us": 3, "int8_us": 2, "float_kernel_us": 1}],
        "boundary": [{"kind": "enter:conv", "features": [64], "us": 5},
                     {"kind": "add", "features": [64], "float_us": 2, "int8_us": 3}]}
    t = ct.table_from_data(data)
    assert t.rows[0].float_kernel == 1.0 and t.boundary_us("enter:conv", 64) == (0.0, 5.0)
    assert t.boundary_us("add", 64) == (2.0, 3.0)
    old = ct.table_from_data({**data, "rows": [{k: v for k, v in data["rows"][0].items() if k != "float_kernel_us"}],
                              "boundary": []})
    assert old.rows[0].float_kernel == 3.0 and old.boundary == () and old.profile_overhead_us == 0.0
    assert ct.table_from_data({**data, "profile_overhead_us": 1.5}).profile_overhead_us == 1.5


def test_shipped_table_has_boundary_rows_for_its_isas() -> None:
    for t in ct.shipped_tables().values():
        kinds = {r.shape.kind for r in t.boundary}
        assert {"enter:conv", "leave:conv", "enter:linear", "leave:linear", "add"} <= kinds, kinds
        assert any(r.shape.kind == "conv" and r.shape.features[3] <= 64 for r in t.rows)  # batch-1 small images


def test_placement_keeps_its_model_float_reason_as_data() -> None:
    p = Placement(target="onnxruntime", model_float="int8 predicted slower than fp32 at batch 1: ...")
    assert Placement.from_data(p.to_data()).model_float == p.model_float
    older = {k: v for k, v in p.to_data().items() if k != "model_float"}
    assert Placement.from_data(older).model_float is None


def test_quickstart_report_carries_the_reason(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """The quickstart recipe with a shipped AVX-512 VNNI table (whatever this CPU is) and
    ``model_check: float``, its ResNet narrowed to width 16 (what the quickstart shipped before: at
    width 64 int8 is predicted faster): at batch 1, one of the recipe's validation batch sizes, it
    stays float, and the run's validation report and console warnings say why."""
    import compress

    vnni = [t for k, t in sorted(ct.shipped_tables().items()) if k.partition(":")[0] == "vnni"]
    if not vnni:
        pytest.skip("no AVX-512 VNNI table shipped")
    _use(monkeypatch, vnni[0])
    recipe = compress.load_recipe("quickstart", overrides=["train.epochs=1", "validate.runs=2", "validate.warmup=1",
                                                           "model.kwargs.width=16", "stages.0.modifiers.0.model_check=float"])
    report = compress.apply(recipe, out_dir=tmp_path / "run")
    final = next(r for r in report.validation if r.role == "final")
    notes = " ".join(final.notes)
    assert "kept float at quantization: int8 predicted slower than fp32 at batch 1" in notes, final.notes
    assert "batch 32: " in notes
    assert "int8 predicted slower than fp32 at batch 1" in (tmp_path / "run" / "report.md").read_text()
    rec = next(e for e in report.exports if e.role == "final")
    assert rec.model_float is not None and rec.precision == "fp32"
    # the console's warning is one short line; the figures stay in report.md
    from compress.cli import summary

    warned = [ln for ln in summary(report, out=tmp_path / "run").splitlines() if ln.lstrip().startswith("warning:")]
    assert warned == ["  warning: onnxruntime final fp32: kept float at quantization: int8 predicted slower than fp32 "
                      "at batch 1 (report.md says why)"], warned


#: WITH_MATMUL with QLinearMatMul twice as slow as MatMul at every size: past the rows' repeatability
SLOW_MATMUL = ct.CostTable("onnxruntime", "test ISA", "test", (
    *TABLE.rows, _row("matmul", (4, 16, 16, 16), 10.0, 20.0, 10.0), _row("matmul", (64, 256, 64, 256), 5000.0, 10000.0, 5000.0),
), TABLE.boundary)

#: WITH_MATMUL with QLinearMatMul 4x faster than MatMul at every size: attention on codes pays
FAST_MATMUL = ct.CostTable("onnxruntime", "test ISA", "test", (
    *TABLE.rows, _row("matmul", (4, 16, 16, 16), 40.0, 10.0, 40.0), _row("matmul", (64, 256, 64, 256), 20000.0, 5000.0, 20000.0),
), TABLE.boundary)


@pytest.mark.parametrize("written_out", [False, True])
def test_attention_the_matmul_rows_price_slower_stays_float(written_out: bool, monkeypatch: pytest.MonkeyPatch,
                                                            tmp_path: Any) -> None:
    """The cost table's per-op rule for attention: where its ``matmul`` rows price the products on
    int8 codes (and quantizing the softmax output) slower than float MatMul past their repeatability
    (model_cost.ATTENTION_MARGIN), the SDPA call or the
    written-out products stay float, named with the reason; the projections stay int8 and the
    exported graph has no QLinearMatMul between activations. Where int8 products win, attention runs
    on codes as before."""
    from compress.export.onnx import export_onnx
    from compress.export.validation.runtimes import ort_coverage
    from compress.quantization.placement.model_cost import slower_attention

    torch.manual_seed(0)
    m = _Attention(written_out).eval()
    data = [torch.randn(2, 16, 32) for _ in range(2)]
    graph = trace_ops(m, (data[0],), {})
    calls = [n.key for n in graph.nodes.values() if n.kind in ("matmul", "sdpa")]
    slow = slower_attention(graph, SLOW_MATMUL, batches=[1], example_batch=2)
    assert sorted(slow) == sorted(calls) and all("QLinearMatMul vs MatMul rows" in r for r in slow.values())
    # level products (WITH_MATMUL): within the rows' repeatability, attention stays on codes, unless the
    # quantization of the softmax output the weighted sum reads tips it past the margin
    level = slower_attention(graph, WITH_MATMUL, batches=[1], example_batch=2)
    assert (calls[0] in level) == (not written_out) and calls[-1] in level
    assert slower_attention(graph, FAST_MATMUL, batches=[1], example_batch=2) == {}
    assert slower_attention(graph, TABLE, batches=[1], example_batch=2) == {}  # no matmul rows: no rule
    ops = {}
    for name, table in (("slow", SLOW_MATMUL), ("fast", FAST_MATMUL)):
        _use(monkeypatch, table)
        q = quantize(copy.deepcopy(m), "w8a8", data, params=QuantizeParams(model_check="warn"))
        floats = view(q).kept_float
        assert all((k in floats) == (name == "slow") for k in calls), floats
        export_onnx(q, data[0], tmp_path / f"{name}.onnx")
        ops[name] = ort_coverage(tmp_path / f"{name}.onnx").integer_ops
    products = {k: v.get("QLinearMatMul", 0) + v.get("MatMulIntegerToFloat", 0) for k, v in ops.items()}
    assert products == {"slow": 0, "fast": 2} and ops["slow"].get("QGemm") == 4, ops  # q, k, v, o int8 in both


def test_speed_check_leaves_attention_to_the_table_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """The speed check times layers; attention's products are no layer, so the cost table's rule
    keeps them float at the batch timed, as on the default path, and ``cost_table=False`` turns it off."""
    from compress.quantization.placement.speed_check import SpeedCheck

    torch.manual_seed(0)
    m = _Attention(written_out=True).eval()
    data = [torch.randn(2, 16, 32) for _ in range(2)]
    calls = [n.key for n in trace_ops(m, (data[0],), {}).nodes.values() if n.kind == "matmul"]
    _use(monkeypatch, SLOW_MATMUL)
    check = SpeedCheck(batch=4, runs=4, min_speedup=1e-6)  # every layer passes its timing
    for table_on in (True, False):
        q = quantize(copy.deepcopy(m), "w8a8", data, params=QuantizeParams(speed_check=check, cost_table=table_on))
        floats = view(q).kept_float
        kept = {k for k in calls if "QLinearMatMul vs MatMul rows" in floats.get(k, "")}
        assert kept == (set(calls) if table_on else set()), floats
        assert not any(k.split(":")[0] in "qkvo" and ":linear" in k for k in floats), floats


class _ShiftedWindow(nn.Module):
    """Swin's shifted-window attention in small: a finite mask of -100 added to the scores between
    positions of different windows."""

    def __init__(self, fill: float, written_out: bool) -> None:
        super().__init__()
        self.qkv, self.o = nn.Linear(32, 96), nn.Linear(32, 32)
        self.written_out = written_out
        group = torch.arange(16) // 8
        self.register_buffer("mask", torch.where(group[:, None] == group[None, :], 0.0, fill))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, 16).permute(2, 0, 3, 1, 4)
        if self.written_out:
            a = torch.softmax(q @ k.transpose(-2, -1) * 0.25 + self.mask, dim=-1) @ v
        else:
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)
        return self.o(a.transpose(1, 2).reshape(b, t, 32))


@pytest.mark.parametrize("written_out", [False, True])
def test_attention_with_subnormal_probabilities_stays_on_codes(written_out: bool) -> None:
    """A finite -100 mask leaves a share of the float softmax's outputs subnormal, which x86 runs many
    times slower (Swin's shifted windows): such a call stays int8 whatever the ``matmul`` rows say.
    A mask of -inf or a small bias leaves no subnormals, and the rows decide."""
    from compress.quantization.placement.model_cost import SUBNORMAL_SHARE, slower_attention
    from compress.quantization.placement.trace import subnormal_share

    assert subnormal_share(torch.tensor([[0.0, -95.0]])) == 0.5
    assert subnormal_share(torch.tensor([[0.0, -float("inf"), -50.0, -120.0]])) == 0.0
    torch.manual_seed(0)
    x = torch.randn(2, 16, 32)
    for fill, kept_int8 in ((-100.0, True), (-float("inf"), False), (-1.0, False)):
        m = _ShiftedWindow(fill, written_out).eval()
        graph = trace_ops(m, (x,), {})
        (probs,) = [n for n in graph.nodes.values() if n.kind in ("sdpa", "softmax")]
        assert (probs.attrs.get("subnormal", 0.0) >= SUBNORMAL_SHARE) == kept_int8, (fill, probs.attrs)
        slow = slower_attention(graph, SLOW_MATMUL, batches=[1], example_batch=2)
        # written out: the weighted sum reads the subnormal probabilities; the scores product does not
        last = [n.key for n in graph.nodes.values() if n.kind in ("sdpa", "matmul")][-1]
        assert (last not in slow) == kept_int8, (fill, slow)


@pytest.mark.parametrize("name", ["bert", "llama", "swin"])
def test_attention_rule_on_transformers_architectures(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On transformers' own BERT, Llama and Swin (from configs, random weights): with rows that price
    attention on codes twice as slow, every SDPA call stays float, named with the cost table's
    reason (none here has a subnormal-heavy softmax: the small Swin has no shifted-window block);
    with rows that price it faster, none does."""
    pytest.importorskip("transformers")
    from benchmarks.hf_suite import suite

    sm = suite(layers=2)[name](0)
    graph = trace_ops(copy.deepcopy(sm.model).eval(), *(((), dict(sm.calibration[0])) if isinstance(
        sm.calibration[0], dict) else ((sm.calibration[0],), {})))
    calls = {n.key: n.attrs.get("subnormal", 0.0) for n in graph.nodes.values() if n.kind == "sdpa"}
    assert len(calls) >= 2, calls
    assert all(v < 0.01 for v in calls.values()), calls
    for table, slow in ((SLOW_MATMUL, True), (FAST_MATMUL, False)):
        _use(monkeypatch, table)
        q = quantize(copy.deepcopy(sm.model), "w8a8", sm.calibration[:2], params=QuantizeParams(model_check="warn"))
        floats = view(q).kept_float
        kept = {k for k in calls if "QLinearMatMul vs MatMul rows" in floats.get(k, "")}
        assert kept == (set(calls) if slow else set()), (kept, calls)
