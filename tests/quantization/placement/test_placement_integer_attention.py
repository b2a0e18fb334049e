"""Attention scores in integer on ONNX Runtime, and constant vectors in products (issue 32).

With a profile's ``integer_scores`` (off in the shipped ORT profile: measured slower than float
scores), the decomposed SDPA quantizes ``q @ k^T`` (QLinearMatMul), multiplies it by the scale as a
quantized constant (QLinearMul), fills a boolean or causal mask on the scores' grid (QLinearWhere)
and reads 8-bit codes into the softmax (QLinearSoftmax). A masked key must still weigh nothing: its
fill sits MASK_GAP below the lowest calibrated score. A product with a constant vector (a layer
scale) runs as QLinearMul only where one 8-bit scale holds the vector.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from compress.export.onnx import export_onnx
from compress.export.validation.runtimes import ort_coverage, ort_optimized_graph
from compress.quantization import QuantizeParams, quantize
from compress.quantization.placement import fidelity_guards, runtimes
from compress.quantization.placement.integer_chains import IntegerChains
from compress.quantization.placement.mode import graph_of
from compress.quantization.placement.records import Placement
from torch import nn

SEVEN_BIT = {"preset": "w8a8", "weights": {"reduce_range": True}}
T, E, H = 12, 32, 4


class Attention(nn.Module):
    """Self-attention through F.scaled_dot_product_attention with no mask, a boolean key-padding
    mask, or is_causal."""

    def __init__(self, mask: str) -> None:
        super().__init__()
        self.mask = mask
        self.qkv = nn.Linear(E, 3 * E)
        self.out = nn.Linear(E, E)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        q, k, v = self.qkv(x).view(b, T, 3, H, E // H).permute(2, 0, 3, 1, 4)
        if self.mask == "bool":
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=self.mask == "causal")
        return self.out(o.transpose(1, 2).reshape(b, T, E))


def _inputs(seed: int, gain: float = 2.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations and a key-padding mask (two rows padded)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, T, E, generator=g) * gain
    keep = torch.ones(4, T, dtype=torch.bool)
    keep[1, 8:] = False  # padded keys
    keep[3, 5:] = False
    return x, keep


def _ort(path: Path, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    import onnxruntime as ort

    s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {i.name: a.numpy() for i, a in zip(s.get_inputs(), (x, keep), strict=False)}
    return torch.from_numpy(s.run(None, feeds)[0])


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - out).pow(2).mean()))


@pytest.fixture
def integer_scores(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ORT profile with its attention scores in integer."""
    ort = runtimes.PROFILES["onnxruntime"]
    monkeypatch.setitem(runtimes.PROFILES, "onnxruntime", dataclasses.replace(ort, integer_scores=True))


def _placement(q: nn.Module) -> Placement:
    g = graph_of(q)
    assert g is not None
    return g.placement


@pytest.mark.parametrize("mask", ["none", "bool", "causal"])
@pytest.mark.usefixtures("integer_scores")
def test_attention_scores_run_in_integer_up_to_the_softmax(mask: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    m = Attention(mask).eval()
    x, keep = _inputs(5)
    with torch.no_grad():
        ref = m(x, keep)
    q = quantize(m, SEVEN_BIT, [dict(zip(("x", "keep"), _inputs(s), strict=True)) for s in range(3)])
    entry = _placement(q).entries[":sdpa#0"]
    assert {"q", "k", "v", "p", "qk", "scale", "scores"} <= set(entry), entry
    path = export_onnx(q, {"x": x, "keep": keep}, tmp_path / "m.int8.onnx")
    ints = ort_coverage(path).integer_ops
    kinds = [n.op_type for n in ort_optimized_graph(path).graph.node]
    assert ints.get("QLinearSoftmax") == 1 and ints.get("QLinearMul") == 1, ints
    assert ints.get("QLinearMatMul", 0) >= 1, ints  # q @ k^T with its output quantized
    assert ints.get("QLinearMatMul", 0) + ints.get("MatMulIntegerToFloat", 0) >= 2, ints  # and p @ v
    assert "Softmax" not in kinds and "Mul" not in kinds, kinds
    if mask != "none":
        # a bool mask's other Where zeroes the output rows of queries that see no key (float, on [.., T, E])
        assert ints.get("QLinearWhere") == 1 and kinds.count("Where") == (mask == "bool"), (ints, kinds)
    with torch.no_grad():
        fake = q(x, keep)
    got = _ort(path, x, keep)
    assert _sqnr(ref, fake) > 25.0
    # ORT's QLinearSoftmax is a fixed-point approximation of the softmax of the same codes: its output
    # stays as close to float as the fake-quant model's, not bit-equal to it
    assert _sqnr(ref, got) > _sqnr(ref, fake) - 1.0


@pytest.mark.parametrize("mask", ["bool", "causal"])
@pytest.mark.usefixtures("integer_scores")
def test_masked_keys_weigh_nothing_in_the_int8_model(mask: str, tmp_path: Path) -> None:
    """A masked key's fill lands on the lowest code of the scores' grid, which reaches MASK_GAP below
    the lowest score: changing what the masked keys hold leaves the int8 output as it was. Small
    inputs keep the scores within about +-1, where a grid ending at the lowest score (no gap) would
    still give a masked key about e^-1 of an unmasked one's weight."""
    torch.manual_seed(0)
    m = Attention(mask).eval()
    q = quantize(m, SEVEN_BIT, [dict(zip(("x", "keep"), _inputs(s, 0.2), strict=True)) for s in range(3)])
    x, keep = _inputs(5, 0.2)
    path = export_onnx(q, {"x": x, "keep": keep}, tmp_path / "m.int8.onnx")
    base = _ort(path, x, keep)
    x2 = x.clone()
    if mask == "bool":  # padded key positions hold something else
        x2[~keep] = torch.randn(int((~keep).sum()), E) * 0.2
        rows = keep  # the outputs of padded positions are not read
    else:  # the last token changes: earlier rows must not see it
        x2[:, -1] = torch.randn(4, E) * 0.2
        rows = torch.ones(4, T, dtype=torch.bool)
        rows[:, -1] = False
    moved = _ort(path, x2, keep)
    assert torch.equal(base[rows], moved[rows]) or _sqnr(base[rows], moved[rows]) > 40.0


def test_shipped_ort_profile_keeps_the_scores_float() -> None:
    """By default (the shipped profile) only the two matmuls' inputs and the probabilities are
    quantized: ORT's integer scores measured slower than float ones on the transformers suite."""
    torch.manual_seed(0)
    q = quantize(Attention("causal").eval(), SEVEN_BIT, [dict(zip(("x", "keep"), _inputs(s), strict=True)) for s in range(2)])
    assert set(_placement(q).entries[":sdpa#0"]) == {"q", "k", "v", "p"}


class WindowAttention(nn.Module):
    """Swin's attention: SDPA with a float mask, a learned bias per head and position pair plus a
    shift mask (0 or -8 here) given per window."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)
        self.out = nn.Linear(E, E)
        self.bias = nn.Parameter(torch.randn(H, T, T))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        q, k, v = self.qkv(x).view(b, T, 3, H, E // H).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias + mask[:, None])
        return self.out(o.transpose(1, 2).reshape(b, T, E))


def _window_inputs(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(4, T, T)
    mask[1:, :6, 6:] = mask[1:, 6:, :6] = -8.0  # windows whose halves must not see each other
    return {"x": torch.randn(4, T, E, generator=g), "mask": mask}


def test_float_mask_on_codes_keeps_the_softmax_integer(tmp_path: Path) -> None:
    """On codes a float mask lands on its grid, -inf on the lowest code: the softmax reads finite
    codes, so no guard for rows that see no key stands between QLinearSoftmax and the probabilities'
    quantizer (no Where, no reduction over the mask), and a row of -inf at serving weighs its keys
    evenly in the int8 file as in the fake-quant model."""
    torch.manual_seed(0)
    m = WindowAttention().eval()
    q = quantize(m, SEVEN_BIT, [_window_inputs(s) for s in range(3)], params=QuantizeParams(cost_table=False))
    assert {"biased", "mask", "p", "v"} <= set(_placement(q).entries[":sdpa#0"])
    x = _window_inputs(5)
    x["mask"][2, 3] = float("-inf")  # query 3 of window 2 sees no key
    path = export_onnx(q, x, tmp_path / "m.int8.onnx")
    kinds = [n.op_type for n in ort_optimized_graph(path).graph.node]
    assert ort_coverage(path).integer_ops.get("QLinearSoftmax") == 1
    assert not {"Where", "ReduceMax", "Softmax"} & set(kinds), kinds
    with torch.no_grad():
        fake = q(**x)
    assert fake.isfinite().all()
    assert _sqnr(fake, _ort(path, x["x"], x["mask"])) > 25.0


class Permute(nn.Module):
    def __init__(self, dims: list[int]) -> None:
        super().__init__()
        self.dims = dims

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.permute(x, self.dims)


class CNBlock(nn.Module):
    """ConvNeXt's block as torchvision writes it: depthwise 7x7, channels-last LayerNorm and MLP, and
    the branch multiplied by a per-channel ``layer_scale`` Parameter of shape (C, 1, 1)."""

    def __init__(self, dim: int, layer_scale: torch.Tensor) -> None:
        super().__init__()
        self.block = nn.Sequential(
            nn.Conv2d(dim, dim, kernel_size=7, padding=3, groups=dim), Permute([0, 2, 3, 1]), nn.LayerNorm(dim, eps=1e-6),
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), Permute([0, 3, 1, 2]))
        self.layer_scale = nn.Parameter(layer_scale.view(dim, 1, 1).clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer_scale * self.block(x) + x


class ConvNeXtish(nn.Module):
    def __init__(self, layer_scale: torch.Tensor) -> None:
        super().__init__()
        c = layer_scale.numel()
        self.stem = nn.Conv2d(3, c, 2, stride=2)
        self.stage = CNBlock(c, layer_scale)
        self.head = nn.Conv2d(c, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stage(self.stem(x)))


def _images(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, 16, 16, generator=g) for _ in range(n)]


def _spike() -> torch.Tensor:
    """256 channels at 0.3 and one at 10: a peak 33x the RMS, so one 8-bit scale is coarse for the rest."""
    g = torch.full((256,), 0.3)
    g[0] = 10.0
    return g


#: layer scales: torchvision's init (one value, 1e-6); four decades (its small channels round to zero
#: under one 8-bit scale, but carry little of the branch); a spike one 8-bit scale cannot serve
SCALES = {"init": lambda: torch.full((16,), 1e-6), "four_decades": lambda: torch.logspace(-4, 0, 16), "spike": _spike}


def _gamma_quantized(q: nn.Module) -> bool:
    pl = _placement(q)
    return any(qid.startswith("c") for k, e in pl.entries.items() if k.startswith("stage:mul#") for qid in e.values())


@pytest.mark.parametrize("name", sorted(SCALES))
def test_layer_scale_product_is_integer_where_one_scale_holds_it(name: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    m = ConvNeXtish(SCALES[name]()).eval()
    q = quantize(m, SEVEN_BIT, _images(3, 1))
    quantized = _gamma_quantized(q)
    assert quantized == (name != "spike")
    path = export_onnx(q, _images(1, 9)[0], tmp_path / "m.int8.onnx")
    ints = ort_coverage(path).integer_ops
    assert (ints.get("QLinearMul", 0) >= 1) == quantized, ints


def _branch_sqnr(gamma: torch.Tensor) -> float:
    """SQNR of the int8 block's scaled branch (``layer_scale * block(x)``) against float's."""
    torch.manual_seed(0)
    m = ConvNeXtish(gamma).eval()
    x = _images(1, 9)[0]
    with torch.no_grad():
        ref = m.stage.layer_scale * m.stage.block(m.stem(x))
    q = quantize(m, SEVEN_BIT, _images(3, 1))
    out: list[torch.Tensor] = []
    h = q.stage.register_forward_hook(lambda mod, a, o: out.append(o - a[0]))
    with torch.no_grad():
        q(x)
    h.remove()
    return _sqnr(ref, out[0])


@pytest.mark.parametrize("name", ["four_decades", "spike"])
def test_layer_scale_guard_follows_what_one_8bit_scale_costs(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The measurement behind CONSTANT_MIN_SQNR, with the product float (guard at +inf) and int8
    (guard at -inf): a layer scale spanning four decades loses little (its small channels carry little
    of the branch), a spike loses several dB, and the default guard keeps only the spike float. The
    float-islands pass is off: here the residual add is float (the spike is an outlier) and the
    Linear before the product writes float at no cost, so that pass alone keeps the product float."""
    monkeypatch.setattr(IntegerChains, "float_islands", lambda self: None)
    monkeypatch.setattr(fidelity_guards, "CONSTANT_MIN_SQNR", float("inf"))
    kept = _branch_sqnr(SCALES[name]())
    monkeypatch.setattr(fidelity_guards, "CONSTANT_MIN_SQNR", float("-inf"))
    forced = _branch_sqnr(SCALES[name]())
    print(f"layer scale {name}: scaled-branch SQNR {kept:.1f} dB with it float, {forced:.1f} dB int8 per tensor")
    if name == "spike":
        assert forced < kept - 2.0, (forced, kept)
    else:
        assert forced > kept - 1.0, (forced, kept)
