"""Quantizer placement on the traced graph: functional ops, runtime profiles, attention, functional
weights, data-flow first/last, BatchNorm pairing in users' own modules, restore as data."""

from __future__ import annotations

import copy
import io
from pathlib import Path

import onnx
import pytest
import torch
import torch.nn.functional as F
from compress.export.onnx import export_onnx
from compress.export.validation.runtimes import ort_coverage, ort_optimized_graph
from compress.quantization import PrepareParams, QuantizeParams, prepare, quantize, strip
from compress.quantization.placement.mode import decomposed_attention, graph_of
from compress.quantization.placement.trace import trace_ops
from torch import nn

from compress.core.errors import CompressError


class Residual(nn.Module):
    """The patterns that left convs float before: ``F.relu(x + f(x))``, ``out += identity``, a concat
    branch, a max-pool, the head reading a pooled, flattened tensor."""

    def __init__(self, c: int = 16) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)
        self.a = nn.Conv2d(c, c, 3, padding=1)
        self.b = nn.Conv2d(c, c // 2, 1)
        self.c = nn.Conv2d(c, c // 2, 1)
        self.d = nn.Conv2d(c, c, 3, padding=1)
        self.fc = nn.Linear(c, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn(self.stem(x)))
        y = F.relu(y + self.a(y))
        y = torch.cat([self.b(y), self.c(y)], dim=1)
        y = F.max_pool2d(y, 2)
        out = self.d(y)
        out += y
        return self.fc(F.adaptive_avg_pool2d(F.relu(out), 1).flatten(1))


#: 7-bit weight codes: ORT's u8s8 kernels on CPUs without VNNI saturate on full 8-bit ones (README)
SEVEN_BIT = {"preset": "w8a8", "weights": {"reduce_range": True}}


def _residual() -> Residual:
    torch.manual_seed(0)
    m = Residual()
    with torch.no_grad():
        m.bn.running_mean.uniform_(-0.3, 0.3)
        m.bn.running_var.uniform_(0.5, 2.0)
    return m.eval()


def _images(n: int = 3, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 3, 16, 16, generator=g) for _ in range(n)]


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - out).pow(2).mean()))


def _ort(path: Path, x: torch.Tensor) -> torch.Tensor:
    import onnxruntime as ort

    s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return torch.from_numpy(s.run(None, {s.get_inputs()[0].name: x.numpy()})[0])


def test_onnxruntime_profile_runs_every_conv_and_add_in_integers(tmp_path: Path) -> None:
    m = _residual()
    x = _images(1, seed=5)[0]
    ref = m(x)
    q = quantize(m, SEVEN_BIT, _images())
    assert isinstance(q.bn, nn.Identity)  # BatchNorm paired through the graph, not nn.Sequential
    path = export_onnx(q, x, tmp_path / "m.int8.onnx")
    cov = ort_coverage(path)
    assert cov.float_nodes == [], cov.float_nodes
    assert cov.integer_ops.get("QLinearConv") == 5 and cov.integer_ops.get("QLinearAdd") == 2, cov.integer_ops
    assert cov.integer_ops.get("QLinearConcat") == 1 and cov.integer_ops.get("QGemm") == 1, cov.integer_ops
    with torch.no_grad():
        fake = q(x)
    assert _sqnr(ref, fake) > 25.0
    assert _sqnr(fake, _ort(path, x)) > 35.0  # the runtime computes what the fake-quant model does


class SamePadded(nn.Module):
    """TF-ported "same" padding (HF MobileNetV2/EfficientNet style): ``F.pad`` then an unpadded conv."""

    def __init__(self, c: int = 16) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, stride=2)
        self.dw = nn.Conv2d(c, c, 3, groups=c)
        self.pw = nn.Conv2d(c, c, 1)
        self.fc = nn.Linear(c, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu6(self.stem(F.pad(x, (0, 1, 0, 1))))
        y = F.relu6(self.dw(F.pad(y, (1, 1, 1, 1))))
        return self.fc(self.pw(y).mean((2, 3)))


def test_zero_pads_fold_into_the_integer_conv(tmp_path: Path) -> None:
    torch.manual_seed(0)
    m = SamePadded().eval()
    x = _images(1, seed=5)[0]
    q = quantize(m, SEVEN_BIT, _images())
    path = export_onnx(q, x, tmp_path / "m.int8.onnx")
    ops = [n.op_type for n in onnx.load(path).graph.node]
    assert "Pad" not in ops, ops  # a Pad between Q/DQ pairs runs in float and blocks QLinearConv
    cov = ort_coverage(path)
    assert cov.float_nodes == [] and cov.integer_ops.get("QLinearConv") == 3, (cov.integer_ops, cov.float_nodes)
    with torch.no_grad():
        fake = q(x)
    assert _sqnr(fake, _ort(path, x)) > 35.0


class SiluSE(nn.Module):
    """EfficientNet/MobileViT patterns: conv -> SiLU, a squeeze-excitation gate (mean -> conv -> ReLU
    -> conv -> sigmoid -> mul), then a conv."""

    def __init__(self, c: int = 16) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.act = nn.SiLU()
        self.se1 = nn.Conv2d(c, 4, 1)
        self.se2 = nn.Conv2d(4, c, 1)
        self.out = nn.Conv2d(c, c, 3, padding=1)
        self.fc = nn.Linear(c, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.stem(x))
        gate = torch.sigmoid(self.se2(F.relu(self.se1(y.mean((2, 3), keepdim=True)))))
        y = self.out(y * gate)
        return self.fc(F.silu(y).mean((2, 3)))


def test_silu_and_gates_between_integer_convs_stay_integer(tmp_path: Path) -> None:
    torch.manual_seed(0)
    m = SiluSE().eval()
    x = _images(1, seed=5)[0]
    ref = m(x)
    q = quantize(m, SEVEN_BIT, _images())
    path = export_onnx(q, x, tmp_path / "m.int8.onnx")
    cov = ort_coverage(path)
    assert cov.float_nodes == [], cov.float_nodes
    # both SiLUs (their inputs are conv outputs, quantized anyway) and the SE gate
    assert cov.integer_ops.get("QLinearSigmoid") == 3 and cov.integer_ops.get("QLinearMul") == 3, cov.integer_ops
    with torch.no_grad():
        fake = q(x)
    assert _sqnr(ref, fake) > 25.0
    assert _sqnr(fake, _ort(path, x)) > 35.0
    tq = quantize(SiluSE().eval(), "w8a8", _images(), params=QuantizeParams(runtime="tensorrt"))
    assert not any("g" in e for e in graph_of(tq).placement.entries.values())  # ORT-only rule


def test_linear_relu_before_a_float_layer_stays_integer(tmp_path: Path) -> None:
    """ORT fuses a 2-D Gemm and its Relu into a float FusedGemm unless a Q follows the Relu: the
    layer before a float last layer must still run as QGemm."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)).eval()
    data = [torch.randn(8, 16) for _ in range(3)]
    q = quantize(m, "w8a8", data, params=QuantizeParams(first_last="float"))
    assert set(q.quantizer_graph.placement.floats) == {"0:linear#0", "4:linear#0"}
    cov = ort_coverage(export_onnx(q, data[0], tmp_path / "m.int8.onnx"))
    assert cov.integer_ops == {"QGemm": 1} and len(cov.float_nodes) == 2, (cov.integer_ops, cov.float_nodes)


def test_one_quantizer_per_tensor_and_shared_concat_scale() -> None:
    q = quantize(_residual(), "w8a8", _images())
    pl = q.quantizer_graph.placement
    add = pl.entries[":add#0"]
    assert pl.entries["a:conv#0"]["0"] == add["0"]  # the relu output feeds conv a and the add: one quantizer
    cat = pl.entries[":cat#0"]
    assert len(cat) == 2 and len(set(cat.values())) == 2  # QLinearConcat requantizes: each branch its own
    # max-pool passes its input's scale through: the tensors before and after share one quantizer
    pooled = next(qid for qid, ts in pl.activations.items() if ":max_pool#0/0" in ts)
    assert ":cat#0/0" in pl.activations[pooled]
    # OpenVINO wants one scale over a concat's inputs
    ov = quantize(_residual(), "w8a8", _images(), params=QuantizeParams(runtime="openvino")).quantizer_graph.placement
    assert len(set(ov.entries[":cat#0"].values())) == 1


def test_tensorrt_profile_follows_explicit_quantization_rules(tmp_path: Path) -> None:
    x = _images(1)[0]
    q = quantize(_residual(), "w8a8", _images(), params=QuantizeParams(runtime="tensorrt"))
    path = export_onnx(q, x, tmp_path / "trt.onnx")
    g = onnx.load(str(path)).graph
    prod = {o: n for n in g.node for o in n.output}
    cons: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for i in n.input:
            cons.setdefault(i, []).append(n)
    weighted = ("Conv", "Gemm", "MatMul")
    for n in g.node:
        if n.op_type in weighted:  # DQ on the data and the weight inputs
            assert prod[n.input[0]].op_type == "DequantizeLinear" and prod[n.input[1]].op_type == "DequantizeLinear"
        if n.op_type == "QuantizeLinear" and n.input[0] in prod and prod[n.input[0]].op_type in weighted:
            # a Q right after a weighted op only where the next weighted op reads it: no output quantizers
            dq = cons[n.output[0]]
            assert all(c.op_type in weighted for d in dq for c in cons.get(d.output[0], [])), n.name
    adds = [n for n in g.node if n.op_type == "Add" and all(i in prod for i in n.input)]
    residual = [n for n in adds if {prod[i].op_type for i in n.input} >= {"Conv"}]
    assert residual
    for n in residual:  # the conv output goes in as it is; the skip input is quantized
        assert sorted(prod[i].op_type for i in n.input) == ["Conv", "DequantizeLinear"], n.name
    assert not any(n.op_type == "Concat" and any(prod.get(i) and prod[i].op_type == "DequantizeLinear"
                                                  for i in n.input) for n in g.node)


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.head = nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.sigmoid(self.conv(x)))


def test_profiles_differ_where_the_runtimes_do() -> None:
    data = [torch.randn(2, 3, 8, 8) for _ in range(2)]
    torch.manual_seed(0)
    ort_q = quantize(Gate().eval(), "w8a8", data)
    torch.manual_seed(0)
    ov_q = quantize(Gate().eval(), "w8a8", data, params=QuantizeParams(runtime="openvino"))
    ort_t = {t for ts in ort_q.quantizer_graph.placement.activations.values() for t in ts}
    ov_t = {t for ts in ov_q.quantizer_graph.placement.activations.values() for t in ts}
    # ORT fuses a conv only when a Q follows it; OpenVINO quantizes the next op's input instead
    assert "conv:conv#0/0" in ort_t and "conv:conv#0/0" not in ov_t
    assert ov_q.quantizer_graph.placement.target == "openvino" and ":sigmoid#0/0" in ov_t
    with pytest.raises(CompressError, match="runtime: Input should be 'onnxruntime', 'tensorrt' or 'openvino'"):
        prepare(Gate(), "w8a8", PrepareParams(runtime="tensorrtt"))  # type: ignore[arg-type]


class FunctionalWeight(nn.Module):
    """A weight read functionally inside a helper: the swapped layer's forward never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(32, 96)
        self.proj = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = F.linear(x, self.qkv.weight, self.qkv.bias).chunk(3, dim=-1)
        a = F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None], is_causal=True)[:, 0]
        return self.proj(a) + x


def test_functionally_used_weight_and_sdpa_are_quantized(tmp_path: Path) -> None:
    torch.manual_seed(0)
    m = FunctionalWeight().eval()
    data = [torch.randn(4, 16, 32) for _ in range(3)]
    ref = m(data[0])
    q = quantize(m, SEVEN_BIT, data)
    pl = q.quantizer_graph.placement
    use = next(iter(pl.weights.values()))
    assert use.param == "qkv.weight" and use.module == "qkv"  # the swapped layer's own weight quantizer
    assert {"q", "k", "v", "p"} <= set(pl.entries[":sdpa#0"])
    with torch.no_grad():
        out = q(data[0])
    assert 20.0 < _sqnr(ref, out) < 80.0  # quantized (not float), and close
    path = export_onnx(q, data[0], tmp_path / "f.onnx")
    cov = ort_coverage(path)
    assert cov.integer >= 4, cov  # qkv, both attention matmuls, proj
    assert _sqnr(out, _ort(path, data[0])) > 30.0


@pytest.mark.parametrize("gqa", [False, True])
def test_decomposed_attention_matches_sdpa(gqa: bool) -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 7, 8, generator=g)
    kv_heads = 2 if gqa else 4
    k, v = torch.randn(2, kv_heads, 7, 8, generator=g), torch.randn(2, kv_heads, 7, 8, generator=g)
    mask = torch.randn(2, 1, 7, 7, generator=g)
    padded = mask > 0
    padded[0, :, 2] = False  # a query row that sees no key (padding): SDPA gives zeros, not NaN
    neg_inf = torch.zeros(2, 1, 7, 7).masked_fill(~padded, float("-inf"))
    for kw in ({"is_causal": True}, {"attn_mask": mask}, {"attn_mask": padded}, {"attn_mask": neg_inf},
               {"scale": 0.3}):
        ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, **kw)  # type: ignore[arg-type]
        out = decomposed_attention(q, k, v, enable_gqa=gqa, quant=lambda _, t: t, **kw)  # type: ignore[arg-type]
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # on codes the biased scores are finite: -inf lands on the grid's lowest code, and a row of it
    # alone weighs its keys evenly, as a row of finfo.min does in float (no guard, no NaN)
    on_codes = lambda role, t: t.clamp(min=-1e4) if role == "biased" else t  # noqa: E731
    out = decomposed_attention(q, k, v, neg_inf, enable_gqa=gqa, quant=on_codes)
    evenly = F.scaled_dot_product_attention(q, k, v, neg_inf.clamp(min=torch.finfo(q.dtype).min), enable_gqa=gqa)
    assert evenly[0, :, 2].abs().sum() > 0
    torch.testing.assert_close(out, evenly, atol=1e-5, rtol=1e-5)


class Reversed(nn.Module):
    """Layers registered in the opposite order of the data flow."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(16, 4)
        self.body = nn.Linear(16, 16)
        self.first = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.body(F.relu(self.first(x)))))


def test_first_last_follow_data_flow_not_registration() -> None:
    torch.manual_seed(0)
    q = quantize(Reversed().eval(), "w8a8", [torch.randn(4, 8)], params=QuantizeParams(first_last="float"))
    assert type(q.first) is nn.Linear and type(q.head) is nn.Linear and type(q.body) is not nn.Linear
    assert {"first:linear#0", "head:linear#0"} <= set(q.quantizer_graph.placement.floats)


def test_state_restores_as_data_with_weights_only(tmp_path: Path) -> None:
    q = quantize(_residual(), "w8a8", _images())
    buf = io.BytesIO()
    torch.save(q.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    fresh = _residual()
    prepare(fresh, "w8a8")  # float model, quantizers not placed yet: the state brings the placement
    fresh.load_state_dict(state)
    assert not graph_of(fresh).pending  # type: ignore[union-attr]
    x = _images(1, seed=9)[0]
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), q(x), atol=0, rtol=0)


def test_strip_restores_the_float_model_and_removes_hooks() -> None:
    m = _residual()
    x = _images(1, seed=3)[0]
    keys = set(m.state_dict())
    q = quantize(copy.deepcopy(m), "w8a8", _images(), params=QuantizeParams(bn="keep"))
    strip(q)
    assert set(q.state_dict()) == keys and graph_of(q) is None
    assert not q._forward_pre_hooks and not q._forward_hooks
    torch.testing.assert_close(q(x), m(x), atol=0, rtol=0)


def test_trace_keys_are_stable_and_scoped() -> None:
    m = _residual()
    g1 = trace_ops(m, (_images(1)[0],), {})
    g2 = trace_ops(m, (_images(1, seed=4)[0],), {})
    assert list(g1.nodes) == list(g2.nodes)
    assert "stem:conv#0" in g1.nodes and ":add#0" in g1.nodes and ":iadd" not in "".join(g1.nodes)
    assert g1.nodes[":add#1"].func in ("__iadd__", "add_")  # `out += y` is an add like any other


class OutlierResidual(nn.Module):
    """A residual add then a norm (post-LN transformer block)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.layer_norm(x + self.fc(x), (32,)))


@pytest.mark.parametrize("spike", [0.0, 1000.0])
def test_residual_add_with_outlier_activations_stays_float(spike: float) -> None:
    """One huge activation among 2048 (BERT-style outlier): a single 8-bit scale for the add would
    flatten the rest, so the add stays float with the measured reason; ordinary data is quantized."""
    torch.manual_seed(0)
    m = OutlierResidual().eval()
    data = [torch.randn(64, 32) for _ in range(3)]
    data[0][5, 3] = spike or data[0][5, 3]
    q = quantize(m, "w8a8", data)
    floats = graph_of(q).placement.floats
    if spike:
        assert list(floats) == [":add#0"] and "its RMS" in floats[":add#0"], floats
        quantized = [t for ts in graph_of(q).placement.activations.values() for t in ts]
        assert ":add#0/0" not in quantized and "fc:linear#0/0" not in quantized, quantized
    else:
        assert not floats, floats


class TanhGelu(nn.Module):
    """GPT-2's gelu_new, written in elementwise ops (as transformers writes it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(0.7978845608 * (x + 0.044715 * torch.pow(x, 3.0))))


def test_activation_written_in_elementwise_ops_stays_one_float_piece(tmp_path: Path) -> None:
    """Quantizing each step of a written-out GELU costs an op per step and stops ORT fusing it: the
    module stays float as a whole (named, with the reason), its neighbours stay integer."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 64), TanhGelu(), nn.Linear(64, 32)).eval()
    data = [torch.randn(16, 32) for _ in range(3)]
    q = quantize(copy.deepcopy(m), SEVEN_BIT, data)
    pl = q.quantizer_graph.placement
    assert list(pl.floats) == ["1:activation"], pl.floats
    assert not any(k.startswith("1:") for k in pl.entries), pl.entries  # no quantizer inside it
    path = export_onnx(q, data[0], tmp_path / "m.int8.onnx")
    cov = ort_coverage(path)
    assert cov.float_nodes == [] and cov.integer == 2, (cov.integer_ops, cov.float_nodes)
    kinds = [n.op_type for n in ort_optimized_graph(path).graph.node]
    assert "FastGelu" in kinds or "Gelu" in kinds, kinds  # fused into one float kernel
    with torch.no_grad():
        assert _sqnr(m(data[0]), q(data[0])) > 30.0
    assert _sqnr(q(data[0]).detach(), _ort(path, data[0])) > 35.0
