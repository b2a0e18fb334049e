"""Operands that are not activations of the output's shape (parameters, Python numbers, broadcast
tensors) and embedding tables: quantized where the runtime fuses them, with parity to the export,
fidelity guards that keep a lossy table float, tied embeddings and the opt-out."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from compress.export.onnx import export_onnx
from compress.export.validation.runtimes import ort_coverage
from compress.quantization import QuantizeParams, quantize
from compress.quantization.placement.integer_chains import IntegerChains
from onnx import numpy_helper
from torch import nn

#: 7-bit weight codes: ORT's u8s8 kernels on CPUs without VNNI saturate on full 8-bit ones (README)
SEVEN_BIT = {"preset": "w8a8", "weights": {"reduce_range": True}}


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - out).pow(2).mean()))


def _ort(path: Path, x: torch.Tensor) -> torch.Tensor:
    import onnxruntime as ort

    s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return torch.from_numpy(s.run(None, {s.get_inputs()[0].name: x.numpy()})[0])


class ConstantOperands(nn.Module):
    """Adds whose second operand is not an activation of the same shape: a position-embedding
    parameter, RMSNorm's ``var + eps``, GELU's ``1.0 + tanh``, a bias broadcast from a buffer."""

    def __init__(self, d: int = 32, t: int = 8) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(1, t, d) * 0.5)
        self.norm_w = nn.Parameter(torch.ones(d))
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)
        self.register_buffer("bias_t", torch.randn(t, 1) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.pos
        var = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(var + 1e-6) * self.norm_w
        u = self.fc1(h)
        u = 0.5 * u * (1.0 + torch.tanh(0.79788456 * (u + 0.044715 * u.pow(3))))
        return self.fc2(u + self.bias_t * 2.0)


def test_constant_and_broadcast_operands_are_quantized_for_onnxruntime(tmp_path: Path) -> None:
    torch.manual_seed(0)
    m = ConstantOperands().eval()
    data = [torch.randn(4, 8, 32) for _ in range(3)]
    x = torch.randn(4, 8, 32)
    ref = m(x)
    q = quantize(copy.deepcopy(m), SEVEN_BIT, data)
    pl = q.quantizer_graph.placement
    consts = {qid: ts[0] for qid, ts in pl.activations.items() if qid.startswith("c")}
    assert any(t == "param pos" for t in consts.values()), consts
    scalars = [t for t in consts.values() if "(scalar)" in t]
    assert ":add#3 operand 1 (scalar)" in scalars, consts  # GELU's 1.0
    # and the products by a number whose other operand is quantized run as QLinearMul (issue 32)
    assert all(t == ":add#3 operand 1 (scalar)" or t.startswith(":mul#") for t in scalars), consts
    # var + eps stays float, for its measured reason: eps is 1e-6, the variance about 1
    assert list(pl.floats) == [":add#1"] and "in magnitude" in pl.floats[":add#1"], pl.floats
    path = export_onnx(q, x, tmp_path / "c.onnx")
    cov = ort_coverage(path)
    assert len(cov.float_nodes) == 1, cov.float_nodes  # every other add a QLinearAdd, constants included
    assert cov.integer_ops.get("QLinearAdd", 0) >= 4, cov.integer_ops
    proto = onnx.load(str(path))
    assert not any(n.op_type == "QuantizeLinear" and n.input[0] in {i.name for i in proto.graph.initializer}
                   for n in proto.graph.node)  # constants stored as codes, not quantized at run time
    with torch.no_grad():
        fake = q(x)
    assert _sqnr(ref, fake) > 25.0
    assert _sqnr(fake, _ort(path, x)) > 35.0  # the export computes what the fake-quant model does
    # the other runtimes keep their own rules: TensorRT quantizes no constant operand of an add
    trt = quantize(copy.deepcopy(m), "w8a8", data, params=QuantizeParams(runtime="tensorrt")).quantizer_graph.placement
    assert not any(k.startswith("c") for k in trt.activations)
    assert any("constant or broadcast" in r for r in trt.floats.values())


class TiedLM(nn.Module):
    """Token and position embeddings, a Linear, and an lm_head tied to the token table (GPT-2)."""

    def __init__(self, vocab: int = 512, d: int = 32, t: int = 16) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(t, d)
        self.fc = nn.Linear(d, d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        h = self.wte(ids) + self.wpe(pos)
        return self.lm_head(torch.relu(self.fc(h)))


def _ids(n: int, seed: int, vocab: int = 512) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (4, 16), generator=g) for _ in range(n)]


def test_embedding_tables_are_int8_by_default_and_tied_tables_share_codes(tmp_path: Path) -> None:
    torch.manual_seed(0)
    m = TiedLM().eval()
    ids = _ids(1, 9)[0]
    ref = m(ids)
    q = quantize(copy.deepcopy(m), SEVEN_BIT, _ids(3, 1))
    uses = {u.param: u for u in q.quantizer_graph.placement.weights.values() if u.table}
    assert set(uses) == {"wte.weight", "wpe.weight"}, q.quantizer_graph.placement.weights
    assert uses["wte.weight"].module == "lm_head" and uses["wpe.weight"].module is None  # tied: lm_head's quantizer
    seen: list[torch.Tensor] = []
    h = q.wte.register_forward_hook(lambda mod, a, out: seen.append(out))
    with torch.no_grad():
        fake = q(ids)
        # the token table the embedding reads is exactly the lm_head's quantized weight
        wq = q.lm_head.weight_quantizer(q.lm_head.weight)
        # the looked-up rows are an activation the add reads: quantized where the lookup makes them
        qg = q.quantizer_graph
        made = qg.quantizers[qg.placement.produced["wte:embedding#0/0"][0]]
        expected = made(torch.nn.functional.embedding(ids, wq))
    h.remove()
    torch.testing.assert_close(seen[0], expected, atol=0, rtol=0)
    assert not torch.equal(wq, q.lm_head.weight)
    assert 0 < _sqnr(ref, fake) < 60.0
    path = export_onnx(q, ids, tmp_path / "lm.onnx")
    plain = export_onnx(copy.deepcopy(m), ids, tmp_path / "fp32.onnx")
    inits = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(path)).graph.initializer}
    assert not any(v.dtype == np.float32 and v.shape in ((512, 32), (32, 512), (16, 32)) for v in inits.values())
    assert sum(v.dtype == np.int8 and v.shape in ((512, 32), (32, 512)) for v in inits.values()) == 2  # Gather + MatMul
    # the tied table is stored twice in int8 (row-major for Gather, transposed for the lm_head's
    # MatMul): half the fp32 file's one float table, plus scales
    assert path.stat().st_size < 0.65 * plain.stat().st_size
    assert _sqnr(fake, _ort(path, ids)) > 35.0  # ORT runs what the fake-quant model computes
    assert ort_coverage(path).float_nodes == []


class Tagger(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 512) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.fc = nn.Linear(d, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(ids))


def test_lossy_table_stays_float_with_its_measured_reason(tmp_path: Path) -> None:
    torch.manual_seed(0)
    m = Tagger().eval()
    with torch.no_grad():  # one spike per row: its int8 step (spike / 127) rounds the other 511 values to zero
        m.emb.weight.mul_(0.01)
        m.emb.weight[torch.arange(256), torch.randint(0, 512, (256,))] = 5.0
    ids = _ids(3, 1, vocab=256)
    q = quantize(copy.deepcopy(m), SEVEN_BIT, ids)
    pl = q.quantizer_graph.placement
    assert not any(u.table for u in pl.weights.values())
    reason = pl.floats["emb:embedding#0"]
    assert reason.startswith("embedding table kept float: int8 per-row SQNR") and "< 30 dB" in reason, reason
    path = export_onnx(q, ids[0], tmp_path / "lossy.onnx")
    inits = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(path)).graph.initializer}
    assert any(v.dtype == np.float32 and v.shape == (256, 512) for v in inits.values())  # the table, in float
    # the same architecture with a Gaussian table passes the guard: its int8 rows are stored
    torch.manual_seed(0)
    ok = quantize(Tagger().eval(), SEVEN_BIT, ids).quantizer_graph.placement
    assert [u.param for u in ok.weights.values() if u.table] == ["emb.weight"] and "emb:embedding#0" not in ok.floats


@pytest.mark.parametrize("target", ["onnxruntime", "openvino"])
def test_embeddings_opt_out(target: str) -> None:
    torch.manual_seed(0)
    q = quantize(TiedLM().eval(), "w8a8", _ids(2, 1), params=QuantizeParams(quantize_embeddings=False, runtime=target))
    pl = q.quantizer_graph.placement
    assert not any(u.table for u in pl.weights.values())
    assert pl.floats["wte:embedding#0"] == "embedding table kept float (quantize_embeddings: false)"
    # the layers-only mode (quantize_ops: false, what the W8A8 LLM export runs) keeps tables float too
    torch.manual_seed(0)
    lo = quantize(TiedLM().eval(), "w8a8", _ids(2, 1), params=QuantizeParams(quantize_ops=False, runtime=target))
    assert not any(u.table for u in lo.quantizer_graph.placement.weights.values())
    assert "quantize_ops: false" in lo.quantizer_graph.placement.floats["wte:embedding#0"]


class SinkNorm(nn.Module):
    """RMSNorm over tokens of which one carries a massive activation (an attention sink, as in
    trained LLMs): its variance is about 1e4x the others'."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return self.fc(x * torch.rsqrt(var + 1e-6))


def test_variance_plus_eps_stays_float_where_quantizing_it_breaks_normal_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    from compress.quantization.placement import fidelity_guards

    def batches(n: int, seed: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        xs = [torch.randn(4, 8, 32, generator=g) for _ in range(n)]
        for x in xs:
            x[:, 0] *= 100.0  # the sink token
        return xs

    torch.manual_seed(0)
    m = SinkNorm().eval()
    x = batches(1, 9)[0]
    ref = m(x)
    guarded = quantize(copy.deepcopy(m), SEVEN_BIT, batches(3, 1))
    assert "in magnitude" in guarded.quantizer_graph.placement.floats[":add#0"]
    monkeypatch.setattr(fidelity_guards, "MAX_OPERAND_RATIO", float("inf"))  # the rule off: var + eps quantized
    # and the pass that returns an add between two float ops (mean, rsqrt) to float off too: the guard
    # is what keeps such an add float where it sits between integer kernels
    monkeypatch.setattr(IntegerChains, "float_islands", lambda self: None)
    forced = quantize(copy.deepcopy(m), SEVEN_BIT, batches(3, 1))
    assert ":add#0" in forced.quantizer_graph.placement.entries
    with torch.no_grad():
        good, bad = guarded(x), forced(x)
    assert _sqnr(ref, good) > 25.0
    # the normal tokens' variance rounds to zero on the sink's scale: rsqrt(0 + ~0) blows them up
    assert not torch.isfinite(bad).all() or _sqnr(ref, bad) < 0.0


class TwoMasks(nn.Module):
    """GPT-Neo's attention: scores filled with finfo.min outside the causal window, then a padding
    mask (finfo.min where padded) added on top: both operands of that add are mask fills, and
    where they meet the sum overflows to -inf."""

    def __init__(self, d: int = 16, t: int = 8) -> None:
        super().__init__()
        self.qk = nn.Linear(d, 2 * d)
        self.out = nn.Linear(d, d)
        self.register_buffer("causal", torch.ones(t, t, dtype=torch.bool).tril())

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        q, k = self.qk(x).chunk(2, dim=-1)
        low = torch.finfo(x.dtype).min
        scores = torch.where(self.causal, q @ k.transpose(-1, -2), torch.tensor(low))
        scores = scores + pad[:, None, :] * low
        return self.out(torch.softmax(scores, dim=-1) @ x)


def test_an_add_of_two_mask_fills_stays_float_and_calibrates() -> None:
    torch.manual_seed(0)
    m = TwoMasks().eval()
    pad = torch.zeros(2, 8)
    pad[:, :2] = 1.0  # the first two keys padded: for query 0 both fills meet
    data = [(torch.randn(2, 8, 16), pad) for _ in range(3)]
    ref = m(*data[0])
    assert torch.isfinite(ref).all()
    q = quantize(copy.deepcopy(m), "w8a8", [{"x": x, "pad": p} for x, p in data])  # raised CalibrationError (inf)
    floats = q.quantizer_graph.placement.floats
    assert any("mask fill" in r for r in floats.values()), floats
    assert _sqnr(ref, q(*data[0])) > 20
