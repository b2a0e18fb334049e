"""SmoothQuant keeps the float function and helps on outlier channels; bias correction removes the
mean output shift; both undo cleanly with strip."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from compress.quantization import QuantizeParams, input_quantizer, quantize, set_quantizers, strip
from compress.quantization.algorithms.bias_correction import bias_correction
from compress.quantization.algorithms.smoothquant import smooth_quant
from torch import nn

from compress.core.errors import RecipeError


def _outlier_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16)).eval()


def _inputs(seed: int, n: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    scale = torch.ones(64)
    scale[:3] = 40.0  # a few outlier features, as in transformer activations
    return [torch.randn(32, 64, generator=g) * scale for _ in range(n)]


def _iq(model: nn.Module, name: str) -> Any:
    q = input_quantizer(model, name)
    assert q is not None
    return q


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - out).pow(2).mean()))


def test_smoothquant_fixed_and_auto_preserve_float_and_improve_sqnr() -> None:
    m = _outlier_model()
    x = _inputs(9)[0]
    with torch.no_grad():
        ref = m(x)
        plain = quantize(copy.deepcopy(m), "w8a8", _inputs(1))
        smoothed = {
            alpha: quantize(copy.deepcopy(m), "w8a8", _inputs(1), params=QuantizeParams(smoothquant=alpha))
            for alpha in (0.5, "auto")
        }
        fixed, auto = smoothed[0.5], smoothed["auto"]
        assert _sqnr(ref, fixed(x)) > _sqnr(ref, plain(x)) + 3.0
        # the first layer has the outliers: auto smooths it, and lands no worse than either
        assert _iq(auto, "0").pre_quant_scale is not None
        assert _sqnr(ref, auto(x)) >= max(_sqnr(ref, fixed(x)), _sqnr(ref, plain(x))) - 0.5
        for q in smoothed.values():
            set_quantizers(q, enabled=False)
            torch.testing.assert_close(q(x), ref, atol=1e-4, rtol=1e-4)
        strip(fixed)
        assert type(fixed[0]) is nn.Linear
        torch.testing.assert_close(fixed(x), ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(fixed[0].weight, m[0].weight, atol=1e-5, rtol=1e-5)


def test_auto_alpha_is_no_worse_than_none_where_fixed_alpha_hurts() -> None:
    torch.manual_seed(3)
    m = nn.Sequential(nn.Linear(64, 32)).eval()
    with torch.no_grad():
        m[0].weight[:, :4] *= 50.0  # weight outliers, flat activations: alpha=0.9 piles onto them
    g = torch.Generator().manual_seed(4)
    data = [torch.randn(32, 64, generator=g) for _ in range(2)]
    x = torch.randn(64, 64, generator=g)
    with torch.no_grad():
        ref = m(x)
        plain = quantize(copy.deepcopy(m), "w8a8", data)
        heavy = quantize(copy.deepcopy(m), "w8a8", data, params=QuantizeParams(smoothquant=0.9))
        auto = quantize(copy.deepcopy(m), "w8a8", data, params=QuantizeParams(smoothquant="auto"))
        assert _sqnr(ref, heavy(x)) < _sqnr(ref, plain(x)) - 1.0
        assert _sqnr(ref, auto(x)) >= _sqnr(ref, plain(x)) - 0.5


class _TwoHeads(nn.Module):
    """Two Linears reading the same tensor, as BERT's query/key/value do."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 16), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) * self.b(x)


@pytest.mark.parametrize("alpha", [0.5, "auto"])
def test_layers_reading_one_tensor_share_one_smoothing(alpha: float | str) -> None:
    torch.manual_seed(5)
    m = _TwoHeads().eval()
    x = _inputs(9)[0]
    q = quantize(copy.deepcopy(m), "w8a8", _inputs(1), params=QuantizeParams(smoothquant=alpha))  # type: ignore[arg-type]
    sa, sb = _iq(q, "a").pre_quant_scale, _iq(q, "b").pre_quant_scale
    assert sa is not None and torch.equal(sa, sb)
    assert _iq(q, "a") is _iq(q, "b")  # one quantizer: one Mul and one QuantizeLinear when exported
    with torch.no_grad():
        set_quantizers(q, enabled=False)
        torch.testing.assert_close(q(x), m(x), atol=1e-3, rtol=1e-4)


def test_smoothquant_rejects_bad_alpha() -> None:
    with pytest.raises(ValueError, match="alpha"):
        smooth_quant(_outlier_model(), _inputs(1), alpha=1.5)
    with pytest.raises(RecipeError, match=r"^QuantizeParams: smoothquant: .*'always'"):  # one line, not pydantic's
        QuantizeParams(smoothquant="always")  # type: ignore[arg-type]


def test_bias_correction_removes_mean_shift() -> None:
    torch.manual_seed(1)
    m = nn.Sequential(nn.Linear(32, 16)).eval()
    g = torch.Generator().manual_seed(2)
    data = [torch.randn(64, 32, generator=g) + 2.0 for _ in range(4)]  # non-zero input mean
    # coarse 4-bit per-tensor weights: rounding error has a visible mean effect
    scheme = {"weights": {"bits": 4, "granularity": "tensor"}, "inputs": None}
    q = quantize(copy.deepcopy(m), scheme)
    x = torch.cat(data)
    with torch.no_grad():
        before = (q(x) - m(x)).mean(0).abs().mean()
        deltas = bias_correction(q, data)
        after = (q(x) - m(x)).mean(0).abs().mean()
    assert set(deltas) == {"0"}
    assert float(after) < 0.1 * float(before)


class _PostLN(nn.Module):
    """BERT's FFN shape: the input feeds a Linear and, as the residual, an add."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.down(torch.relu(self.up(x))))


def test_smoothing_drops_a_quantizer_only_float_ops_still_read() -> None:
    """With the adds outside the targets, the tensor's placed quantizer served `up` (now smoothed, with
    its own) and the float add; the add gains nothing from it, so it goes, and the add reads x as is."""
    from compress.quantization.placement.mode import graph_of

    torch.manual_seed(0)
    data = [torch.randn(8, 16) * torch.linspace(0.1, 20, 16) for _ in range(2)]
    plain = quantize(_PostLN().eval(), "w8a8", data, targets=["type:Linear"])
    smoothed = quantize(_PostLN().eval(), "w8a8", data, targets=["type:Linear"], params=QuantizeParams(smoothquant=0.5))
    g0, g1 = graph_of(plain), graph_of(smoothed)
    assert g0 is not None and g1 is not None
    assert g0.placement.floats[":add#0"] == g1.placement.floats[":add#0"] == "excluded by targets/ignore"
    assert g0.placement.entries[":add#0"] == {"0": g0.placement.entries["up:linear#0"]["0"]}  # shared with up
    assert ":add#0" not in g1.placement.entries  # up has its own, smoothed quantizer; the add reads x float
    iq = input_quantizer(smoothed, "up")
    assert iq is not None and iq.pre_quant_scale is not None


class _PreLN(nn.Module):
    """A norm's output feeds a Linear and, as the residual, an add."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return h + self.down(torch.relu(self.up(h)))


def test_a_smoothed_tensor_is_not_quantized_where_it_is_made() -> None:
    """The norm's output is quantized where the norm makes it only while every reader reads it through
    that quantizer: once `up` reads it through its own smoothed one, quantizing it first with the
    unsmoothed range would put back the rounding smoothing removes."""
    from compress.quantization.placement.mode import graph_of

    torch.manual_seed(0)
    data = [torch.randn(8, 16) * torch.linspace(0.1, 20, 16) for _ in range(2)]
    plain = quantize(_PreLN().eval(), "w8a8", data)
    smoothed = quantize(_PreLN().eval(), "w8a8", data, params=QuantizeParams(smoothquant=0.5))
    g0, g1 = graph_of(plain), graph_of(smoothed)
    assert g0 is not None and g1 is not None
    assert "norm:layer_norm#0" in g0.produced() and "norm:layer_norm#0" not in g1.produced()
    seen: list[torch.Tensor] = []
    h = smoothed.up.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    with torch.no_grad():
        smoothed(data[0])
        ref = smoothed.norm.forward(data[0])
    h.remove()
    torch.testing.assert_close(seen[0], ref, atol=0, rtol=0)  # up's own quantizer does the rounding
