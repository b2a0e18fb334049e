"""nn.MultiheadAttention under graph placement: the tracer and the quantizing mode run it decomposed
(quantization/placement/attention.py), so its packed ``in_proj_weight``, its ``out_proj`` and its attention
matmuls are quantized and ONNX Runtime runs them as integer kernels. Tested on torch's own
Transformer layers and on the zoo ViT with ``attn="mha"``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from compress.export.onnx import export_onnx
from compress.export.validation.runtimes import ort_coverage
from compress.quantization import quantize
from compress.quantization.placement import attention
from compress.quantization.placement.trace import GraphTracer
from torch import nn

from compress.models.vit import ViT

#: 7-bit weight codes: ORT's u8s8 kernels on CPUs without VNNI saturate on full 8-bit ones (README)
SCHEME = {"preset": "w8a8", "weights": {"reduce_range": True}}
E, H = 16, 4


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - out).pow(2).mean()))


def _traced(m: nn.Module, *args: object, **kwargs: object) -> tuple[object, GraphTracer]:
    """``m(*args, **kwargs)`` run under the graph tracer (which runs MHA decomposed)."""
    tracer = GraphTracer(m)
    with torch.no_grad(), tracer.scopes.active(), tracer:
        out = m(*args, **kwargs)
    return out, tracer


def _close(out: object, ref: object) -> None:
    assert isinstance(out, tuple) and isinstance(ref, tuple)
    for o, r in zip(out, ref, strict=True):
        if r is None:
            assert o is None
        else:
            torch.testing.assert_close(o, r, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("flags", [{}, {"bias": False}, {"add_bias_kv": True, "add_zero_attn": True},
                                   {"kdim": 10, "vdim": 12}])
def test_decomposed_mha_equals_torch(batch_first: bool, flags: dict[str, object]) -> None:
    torch.manual_seed(0)
    m = nn.MultiheadAttention(E, H, batch_first=batch_first, **flags).eval()  # type: ignore[arg-type]
    L, S = 5, 7

    def seq(n: int, d: int = E) -> torch.Tensor:
        return torch.randn(2, n, d) if batch_first else torch.randn(n, 2, d)

    x, mem = seq(L), seq(S, int(flags.get("kdim", E)))  # type: ignore[call-overload]
    val = mem if "vdim" not in flags else seq(S, int(flags["vdim"]))  # type: ignore[call-overload]
    kpm = torch.rand(2, S) > 0.6
    kpm[:, 0] = False  # no fully masked rows (torch's SDPA kernel returns 0 there, softmax NaN)
    kpm_float = torch.zeros(2, S).masked_fill(kpm, float("-inf"))
    bool_mask = torch.rand(L, S) > 0.6
    bool_mask[:, 0] = False
    calls: list[tuple[tuple[torch.Tensor, ...], dict[str, object]]] = [
        ((x, mem, val), {}),
        ((x, mem, val), {"need_weights": False, "key_padding_mask": kpm}),
        ((x, mem, val), {"average_attn_weights": False, "attn_mask": torch.randn(L, S)}),
        ((x, mem, val), {"need_weights": False, "attn_mask": bool_mask, "key_padding_mask": kpm}),
        ((x, mem, val), {"attn_mask": torch.randn(2 * H, L, S), "key_padding_mask": kpm_float}),
    ]
    if "kdim" not in flags:
        calls += [((x, x, x), {"need_weights": False}), ((x, x, x), {}), ((x, mem, mem), {"need_weights": False})]
        causal = nn.Transformer.generate_square_subsequent_mask(L)
        calls += [((x, x, x), {"attn_mask": causal, "is_causal": True, "need_weights": nw}) for nw in (False, True)]
        unbatched = torch.randn(L, E)
        calls += [((unbatched, unbatched, unbatched), {}), ((unbatched, unbatched, unbatched), {"need_weights": False})]
    for args, kwargs in calls:
        with torch.no_grad():
            ref = m(*args, **kwargs)
        out, tracer = _traced(m, *args, **kwargs)
        kinds = {n.kind for n in tracer.graph.nodes.values()}
        assert "mha" not in kinds and "linear" in kinds, kinds  # it really ran decomposed
        _close(out, ref)


class Seq2Seq(nn.Module):
    """torch's Transformer decoder layer (self-attention and cross-attention, whose packed weight is
    split into q and kv parts) reading an encoded memory."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(E, E)
        self.dec = nn.TransformerDecoderLayer(E, H, 32, dropout=0.1, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dec(x[:, :5], self.embed(x))


class SeparateWeights(nn.Module):
    """kdim/vdim: separate q/k/v projection weights; ``need_weights`` (the default) with the averaged
    attention weights used downstream."""

    def __init__(self) -> None:
        super().__init__()
        self.k = nn.Linear(E, 10)
        self.v = nn.Linear(E, 12)
        self.mha = nn.MultiheadAttention(E, H, kdim=10, vdim=12, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, w = self.mha(x, self.k(x), self.v(x))
        return out + w.mean(-1, keepdim=True)


def _encoder() -> nn.Module:
    return nn.TransformerEncoderLayer(E, H, 32, dropout=0.1, batch_first=True)


def _vit() -> nn.Module:
    return ViT(attn="mha", dim=E, heads=H, depth=2)


MODELS = {
    "encoder_layer": (_encoder, (2, 6, E)),
    "decoder_layer": (Seq2Seq, (2, 7, E)),
    "separate_weights": (SeparateWeights, (2, 6, E)),
    "vit_mha": (_vit, (2, 1, 8, 8)),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_mha_models_run_in_integer_kernels(name: str, tmp_path: Path) -> None:
    import onnxruntime as ort

    build, shape = MODELS[name]
    torch.manual_seed(0)
    m = build().eval()
    x = torch.randn(*shape)
    with torch.no_grad():
        ref = m(x)
    q = quantize(m, SCHEME, [torch.randn(*shape) for _ in range(3)])
    pl = q.quantizer_graph.placement
    mha = {n for n, mod in q.named_modules() if isinstance(mod, nn.MultiheadAttention)}
    quantized = {w.param for w in pl.weights.values()}
    for n in mha:  # every projection weight of every attention module
        assert f"{n}.out_proj.weight" in quantized, quantized
        assert f"{n}.in_proj_weight" in quantized or {f"{n}.{p}_proj_weight" for p in "qkv"} <= quantized, quantized
    assert not any("mha" in k or "attention" in r for k, r in pl.floats.items()), pl.floats
    with torch.no_grad():
        fake = q(x)
    assert 10.0 < _sqnr(ref, fake) < 80.0  # quantized (not float), and close (random-init ViT: ~14 dB)
    path = export_onnx(q, x, tmp_path / f"{name}.int8.onnx")
    s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = torch.from_numpy(s.run(None, {s.get_inputs()[0].name: x.numpy()})[0])
    cov = ort_coverage(path)
    if cov.integer_ops.get("QLinearSoftmax"):
        # ORT's QLinearSoftmax is a fixed-point approximation of the softmax of the same codes, not
        # bit-equal to it: the int8 file is held to the fake-quant model's closeness to float
        assert _sqnr(ref, got) > _sqnr(ref, fake) - 1.0
    else:  # the gap is rounding ties flipping a code or two, which softmax and the out-projection spread
        assert _sqnr(fake, got) > 30.0
    weighted_float = [n for n in cov.float_nodes if not n.startswith("Add:")]
    assert weighted_float == [], weighted_float  # no float MatMul/Gemm: projections and attention
    assert cov.integer_ops.get("QLinearMatMul", 0) + cov.integer_ops.get("MatMulIntegerToFloat", 0) >= 2 * len(mha)


def test_mha_left_whole_stays_float_with_its_reason(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A call the decomposition does not take stays one float op, named with the reason: the model
    still quantizes, calibrates and exports."""
    monkeypatch.setattr(attention, "mha_unsupported", lambda *a: "not decomposed in this test")
    torch.manual_seed(0)
    shape = (2, 6, E)
    q = quantize(_encoder().eval(), SCHEME, [torch.randn(*shape) for _ in range(2)])
    pl = q.quantizer_graph.placement
    assert pl.floats["self_attn:mha#0"] == "not decomposed in this test"
    assert {w.param for w in pl.weights.values()}.isdisjoint({"self_attn.in_proj_weight", "self_attn.out_proj.weight"})
    path = export_onnx(q, torch.randn(*shape), tmp_path / "whole.onnx")
    assert ort_coverage(path).integer >= 2  # the feed-forward Linears still run in integers


def test_quantized_mha_trains() -> None:
    """QAT: the decomposed attention takes the same calls in train mode (dropout on), and gradients
    reach the packed projection through its placed weight quantizer."""
    torch.manual_seed(0)
    shape = (2, 6, E)
    q = quantize(_encoder().eval(), SCHEME, [torch.randn(*shape) for _ in range(2)])
    q.train()
    q(torch.randn(*shape)).pow(2).mean().backward()
    grad = q.self_attn.in_proj_weight.grad
    assert grad is not None and grad.abs().sum() > 0
