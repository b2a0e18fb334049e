"""Module swap: quantized modules against functional references, strip reversibility, BN folding,
targets/ignore and first/last policy, calibration errors."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from compress.quantization import (
    PrepareParams,
    QuantConv2d,
    QuantLinear,
    calibrate,
    prepare,
    quantize,
    quantizers,
    strip,
)
from compress.quantization.numerics.primitives import fake_quantize, qparams_from_range, quantize_codes
from compress.quantization.placement.mode import graph_of
from torch import nn

from compress.core.errors import CalibrationError, CompressError, TargetMatchError


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, groups=2)
        self.fc = nn.Linear(16 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # tensor ops written as users write them: functional, operators, no wrapper modules
        h = torch.relu(self.bn1(self.conv1(x)))
        h = h + self.conv2(h)
        h = torch.cat([h, h * 0.5], dim=1)  # [N, 16, 8, 8]
        h = F.adaptive_avg_pool2d(h, 2).flatten(2)  # [N, 16, 4]
        h = h @ h.transpose(1, 2)  # [N, 16, 16]
        return self.fc(h[:, :, :4].reshape(h.shape[0], -1))


def _model() -> Block:
    torch.manual_seed(0)
    m = Block()
    with torch.no_grad():  # non-trivial BN statistics
        m.bn1.running_mean.uniform_(-0.5, 0.5)
        m.bn1.running_var.uniform_(0.5, 2.0)
        m.bn1.weight.uniform_(0.5, 1.5)
        m.bn1.bias.uniform_(-0.2, 0.2)
    return m.eval()


def _data(n: int = 4, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 3, 8, 8, generator=g) for _ in range(n)]


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.detach(), out.detach()
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - out).pow(2).mean()))


def test_quant_linear_matches_functional_reference_bit_exact() -> None:
    torch.manual_seed(3)
    lin = nn.Linear(16, 8)
    q = copy.deepcopy(lin)
    root = nn.Sequential(q)
    prepare(root, "w8a8")
    x = torch.randn(32, 16)
    calibrate(root, [x])
    ql = root[0]
    assert isinstance(ql, QuantLinear)
    w = lin.weight.detach()
    ws = w.abs().amax(1) / 127
    wq = torch.fake_quantize_per_channel_affine(w, ws, torch.zeros(8, dtype=torch.int32), 0, -128, 127)
    lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    s = (hi - lo) / 255
    zp = int(min(max(0 - round(lo / s), 0), 255))
    xq = torch.fake_quantize_per_tensor_affine(x, s, zp, 0, 255)
    ref = F.linear(xq, wq, lin.bias)
    torch.testing.assert_close(root(x), ref, atol=0, rtol=0)
    assert ql.weight is lin.weight or torch.equal(ql.weight, lin.weight)


def test_functional_ops_are_quantized_where_the_graph_says() -> None:
    m = _model()
    prepare(m, "w8a8")
    calibrate(m, _data())
    pl = m.quantizer_graph.placement
    add, cat, mm = pl.entries[":add#0"], pl.entries[":cat#0"], pl.entries[":matmul#0"]
    assert set(add) == {"0", "1"} and add["0"] != add["1"]  # the residual and the conv output
    assert len(cat) == 2  # both concat inputs quantized (ORT's QLinearConcat requantizes each)
    assert set(mm) == {"0", "1"}
    q = m.quantizer_graph.quantizers
    a = torch.randn(2, 8, 8, 8)

    def fq(qid: str, t: torch.Tensor) -> torch.Tensor:
        z = q[qid]
        return fake_quantize(t, z.scale, z.zero_point, z.qmin, z.qmax)

    # the relu output feeds conv2 and the add through one quantizer: one Q/DQ pair when exported
    assert pl.entries["conv2:conv#0"]["0"] == add["0"]
    assert fq(add["0"], fq(add["0"], a)).equal(fq(add["0"], a))


def test_prepare_then_strip_is_reversible() -> None:
    m = _model()
    x = torch.randn(4, 3, 8, 8)
    ref = m(x)
    keys = set(m.state_dict())
    q = copy.deepcopy(m)
    prepare(q, "w8a8", bn="keep")
    calibrate(q, _data())
    assert not torch.equal(q(x), ref)
    strip(q)
    assert set(q.state_dict()) == keys
    assert all(torch.equal(a, b) for a, b in zip(q.state_dict().values(), m.state_dict().values()))
    torch.testing.assert_close(q(x), ref, atol=0, rtol=0)
    assert not any(isinstance(mod, (QuantLinear, QuantConv2d)) for mod in q.modules()) and graph_of(q) is None
    assert not q._forward_pre_hooks and not q._forward_hooks


def test_bn_fold_for_ptq_preserves_float_function() -> None:
    m = _model()
    x = torch.randn(4, 3, 8, 8)
    ref = m(x)
    q = copy.deepcopy(m)
    prepare(q, "w8a8", bn="fold", example_inputs=x)
    assert isinstance(q.bn1, nn.Identity) and q.conv1.bias is not None
    for _, fq in quantizers(q):
        fq.enabled = False
    torch.testing.assert_close(q(x), ref, atol=1e-5, rtol=1e-5)
    strip(q)
    torch.testing.assert_close(q(x), ref, atol=1e-5, rtol=1e-5)


def test_qat_bn_conv_trains_stats_then_freezes_and_folds_exactly() -> None:
    m = _model()
    q = copy.deepcopy(m)
    prepare(q, "w8a8", bn="qat")
    conv = q.conv1
    assert isinstance(conv, QuantConv2d) and conv.bn is not None and isinstance(q.bn1, nn.Identity)
    calibrate(q, _data())
    q.train()
    before = conv.bn.running_mean.clone()
    q(torch.randn(8, 3, 8, 8) + 1.0)
    assert not torch.equal(before, conv.bn.running_mean)  # batch statistics update while training
    conv.bn_frozen = True
    frozen = conv.bn.running_mean.clone()
    q(torch.randn(8, 3, 8, 8))
    assert torch.equal(frozen, conv.bn.running_mean)
    q.eval()
    x = torch.randn(4, 3, 8, 8)
    y_bn = q(x)
    conv.fold_bn()
    # after folding, the weight quantizer sees the same folded weight: same result up to fp rounding
    torch.testing.assert_close(q(x), y_bn, atol=1e-4, rtol=1e-4)


def test_targets_ignore_first_last() -> None:
    m = _model()
    prepare(m, "w8a8", PrepareParams(targets=["type:Conv2d", "fc"], ignore=["conv2"], quantize_ops=False))
    assert isinstance(m.conv1, QuantConv2d) and type(m.conv2) is nn.Conv2d and isinstance(m.fc, QuantLinear)
    calibrate(m, _data())
    entries = m.quantizer_graph.placement.entries
    # no tensor-op quantizers: the add reads conv2's (float) output unquantized, the matmul nothing;
    # conv1's output is still quantized (after its ReLU) since ORT fuses conv1 only then
    assert "1" not in entries.get(":add#0", {}) and ":matmul#0" not in entries
    assert type(m.conv2) is nn.Conv2d
    m = _model()
    prepare(m, "w8a8", PrepareParams(first_last="float"), example_inputs=_data(1)[0])
    assert type(m.conv1) is nn.Conv2d and type(m.fc) is nn.Linear and isinstance(m.conv2, QuantConv2d)
    assert {"conv1:conv#0", "fc:linear#0"} <= set(m.quantizer_graph.placement.floats)
    m = _model()
    prepare(m, "w4_weight_only_g128", PrepareParams(first_last="w8"))
    assert m.conv1.weight_quantizer.spec.bits == 8 and m.conv2.weight_quantizer.spec.bits == 4
    with pytest.raises(TargetMatchError, match="'nope'"):
        prepare(_model(), "w8a8", PrepareParams(targets=["nope"]))
    with pytest.raises(CompressError, match="already quantized"):
        prepare(m, "w8a8")


def test_calibration_errors_are_clear() -> None:
    m = _model()
    prepare(m, "w8a8")
    with pytest.raises(CalibrationError, match="fed no data"):
        calibrate(m, [])
    bad = torch.randn(2, 3, 8, 8)
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(CalibrationError, match=r"calibration batch 1 holds 1 NaN/inf values"):
        calibrate(m, [bad])
    with pytest.raises(CalibrationError, match="used before calibration"):
        m(torch.randn(2, 3, 8, 8))
    with pytest.raises(CalibrationError, match="need calibration data; pass data"):
        quantize(_model(), "w8a8")


def test_features_not_divisible_by_group_size_get_a_shorter_last_group() -> None:
    torch.manual_seed(0)
    lin = nn.Sequential(nn.Linear(200, 4))  # 200 = 128 + 72
    prepare(lin, "w4_weight_only_g128")
    wq = lin[0].weight_quantizer
    assert wq.scale.shape == (4, 2) and wq.group_size == 128
    w = lin[0].weight.detach()
    for g, cols in enumerate((slice(0, 128), slice(128, 200))):  # each group quantized on its own range
        part = w[:, cols]
        scale, zp = qparams_from_range(part.amin(1), part.amax(1), qmin=-8, qmax=7, symmetric=True)
        torch.testing.assert_close(wq.scale[:, g], scale, atol=0, rtol=0)
        expect = fake_quantize(part, scale[:, None], zp[:, None], -8, 7)
        torch.testing.assert_close(lin[0].quantized_weight()[:, cols], expect, atol=0, rtol=0)
        codes = quantize_codes(part, scale[:, None], zp[:, None], -8, 7)
        torch.testing.assert_close(wq.int_repr(w)[:, cols], codes, atol=0, rtol=0)
    small = nn.Sequential(nn.Linear(64, 4))  # shorter rows: one group per row
    prepare(small, "w4_weight_only_g128")
    assert small[0].weight_quantizer.scale.shape == (4, 1)


def test_state_dict_round_trip_into_fresh_prepared_model() -> None:
    m = _model()
    prepare(m, "w8a8")
    calibrate(m, _data())
    x = torch.randn(2, 3, 8, 8)
    fresh = _model()
    prepare(fresh, "w8a8")
    fresh.load_state_dict(m.state_dict())
    torch.testing.assert_close(fresh(x), m(x), atol=0, rtol=0)


@pytest.mark.parametrize(
    "scheme,floor",
    [("w8a8", 33.0), ("w8a8_dynamic", 33.0), ("w8_weight_only", 44.0), ("w4_weight_only_g128", 16.0)],
)
def test_end_to_end_sqnr_floor(scheme: str, floor: float) -> None:
    m = _model()
    x = torch.randn(16, 3, 8, 8)
    ref = m(x)
    q = quantize(copy.deepcopy(m), scheme, _data())
    assert _sqnr(ref, q(x)) > floor


class LinearBN(nn.Module):
    """LeViT's MLPLayerWithBN: Linear, flatten tokens, BatchNorm1d over the features, reshape back;
    and a BatchNorm1d over dim 1 of a (N, L, C) Linear output, which normalizes L, not features."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 24, bias=False)
        self.bn = nn.BatchNorm1d(24)
        self.other = nn.Linear(16, 5)
        self.bn_l = nn.BatchNorm1d(5)  # L == 5 == out_features: only the shape says it is not foldable

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        y = self.bn(y.flatten(0, 1)).reshape_as(y)
        return y.sum(-1, keepdim=True) + self.bn_l(self.other(x)).mean(-1, keepdim=True)


def test_linear_then_batchnorm_over_features_folds_exactly() -> None:
    torch.manual_seed(0)
    m = LinearBN()
    with torch.no_grad():
        for bn in (m.bn, m.bn_l):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.uniform_(0.5, 1.5)
    m.eval()
    x = torch.randn(4, 5, 16)
    ref = m(x)
    q = copy.deepcopy(m)
    prepare(q, "w8a8", bn="fold", example_inputs=x)
    assert isinstance(q.bn, nn.Identity) and q.lin.bias is not None
    assert isinstance(q.bn_l, nn.BatchNorm1d)  # over L: folding it into `other` would be wrong
    for _, fq in quantizers(q):
        fq.enabled = False
    torch.testing.assert_close(q(x), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scheme,calibrated", [("w4_weight_only_g128", False), ("w8a8_dynamic", True),
                                               ("w8a8", True)])
def test_gpt2_conv1d_layers_become_quantized_linears_under_every_scheme(scheme: str, calibrated: bool) -> None:
    """GPT-2's Conv1D becomes an equal Linear and is quantized like one, with or without the traced
    graph (weight-only and dynamic schemes used to leave it float with 'prepared 0 modules')."""
    transformers = pytest.importorskip("transformers")
    from compress.quantization.numerics.calibration import float_mode

    import compress

    torch.manual_seed(0)
    fp = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4,
                                                              n_positions=64)).eval()
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = fp(x).logits
    q = compress.quantize(copy.deepcopy(fp), scheme, [x] if calibrated else None, ignore=["lm_head"])
    quantized = sorted(n for n, m in q.named_modules() if isinstance(m, QuantLinear))
    assert len(quantized) == 8 and all(n.split(".")[-1] in ("c_attn", "c_proj", "c_fc") for n in quantized)
    with torch.no_grad(), float_mode(q):  # quantizers off: the Linears compute what the Conv1Ds did
        assert torch.allclose(q(x).logits, ref, atol=1e-5)
    with torch.no_grad():
        assert not torch.allclose(q(x).logits, ref, atol=1e-4)
