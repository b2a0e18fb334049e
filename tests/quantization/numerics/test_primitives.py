"""Level (a): primitives bit-exact against torch's fake_quantize_per_*_affine; STE and LSQ grads."""

from __future__ import annotations

import pytest
import torch
from compress.quantization.numerics.primitives import (
    SCALE_EPS,
    dequantize,
    dynamic_qparams,
    fake_quantize,
    fake_quantize_spec,
    qparams_from_range,
    quantize_codes,
)
from compress.quantization.numerics.spec import QuantScheme, QuantSpec


@pytest.mark.parametrize("qmin,qmax,symmetric", [(-128, 127, True), (0, 255, False), (0, 255, True), (-8, 7, True)])
def test_per_tensor_bit_exact_vs_torch(qmin: int, qmax: int, symmetric: bool) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 33, generator=g) * 3 + 0.5
    scale, zp = qparams_from_range(x.min(), x.max(), qmin=qmin, qmax=qmax, symmetric=symmetric)
    ours = fake_quantize(x, scale, zp, qmin, qmax)
    ref = torch.fake_quantize_per_tensor_affine(x, float(scale), int(zp), qmin, qmax)
    torch.testing.assert_close(ours, ref, atol=0, rtol=0)
    # quantize_codes/dequantize compose to the same values
    torch.testing.assert_close(dequantize(quantize_codes(x, scale, zp, qmin, qmax), scale, zp), ref, atol=0, rtol=0)


@pytest.mark.parametrize("axis", [0, 1])
def test_per_channel_bit_exact_vs_torch(axis: int) -> None:
    g = torch.Generator().manual_seed(2)
    w = torch.randn(16, 24, 3, generator=g) * torch.rand(16, 1, 1, generator=g)
    spec = QuantSpec(granularity="channel", axis=axis)
    rows = w.movedim(axis, 0).reshape(w.shape[axis], -1)
    scale, zp = qparams_from_range(rows.amin(1), rows.amax(1), qmin=-128, qmax=127, symmetric=True)
    ours = fake_quantize_spec(w, scale, zp, spec)
    ref = torch.fake_quantize_per_channel_affine(w, scale, zp, axis, -128, 127)
    torch.testing.assert_close(ours, ref, atol=0, rtol=0)


def test_per_group_equals_per_channel_on_regrouped_rows() -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(8, 256, generator=g)
    spec = QuantSpec(bits=4, granularity="group", group_size=64)
    rows = w.reshape(-1, 64)
    scale, zp = qparams_from_range(rows.amin(1), rows.amax(1), qmin=-8, qmax=7, symmetric=True)
    ours = fake_quantize_spec(w, scale.reshape(8, 4), zp.reshape(8, 4), spec)
    ref = torch.fake_quantize_per_channel_affine(rows, scale, zp, 0, -8, 7).reshape(8, 256)
    torch.testing.assert_close(ours, ref, atol=0, rtol=0)
    assert len(torch.unique(ours[0, :64])) <= 16


def test_dynamic_per_token_matches_rowwise_reference() -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 5, 32, generator=g) * torch.linspace(0.1, 10, 5).reshape(1, 5, 1)
    spec = QuantSpec(granularity="token", dynamic=True)
    scale, zp = dynamic_qparams(x, spec)
    assert scale.shape == (2, 5, 1)
    ours = fake_quantize_spec(x, scale, zp, spec)
    rows = x.reshape(-1, 32)
    amax = rows.abs().amax(1)
    ref = torch.fake_quantize_per_channel_affine(rows, amax / 127, torch.zeros(10, dtype=torch.int32), 0, -128, 127)
    torch.testing.assert_close(ours, ref.reshape(x.shape), atol=0, rtol=0)


def test_qparams_zero_exact_and_degenerate_ranges() -> None:
    # zero is representable even when the range excludes it
    scale, zp = qparams_from_range(torch.tensor(2.0), torch.tensor(5.0), qmin=0, qmax=255, symmetric=False)
    z = fake_quantize(torch.zeros(3), scale, zp, 0, 255)
    assert torch.equal(z, torch.zeros(3))
    # constant zero tensor: finite tiny scale, exact zeros out
    scale, zp = qparams_from_range(torch.tensor(0.0), torch.tensor(0.0), qmin=-128, qmax=127, symmetric=True)
    assert float(scale) == pytest.approx(SCALE_EPS) and torch.isfinite(scale)
    assert torch.equal(fake_quantize(torch.zeros(4), scale, zp, -128, 127), torch.zeros(4))
    # constant positive tensor: reproduced to within half a step
    c = torch.full((5,), 3.7)
    scale, zp = qparams_from_range(c.min(), c.max(), qmin=0, qmax=255, symmetric=False)
    assert torch.allclose(fake_quantize(c, scale, zp, 0, 255), c, atol=float(scale) / 2)


def test_ste_gradient_is_one_inside_zero_outside() -> None:
    x = torch.tensor([-3.0, -0.5, 0.2, 0.9, 4.0], requires_grad=True)
    scale, zp = torch.tensor(1.0 / 127), torch.tensor(0, dtype=torch.int32)
    fake_quantize(x, scale, zp, -128, 127).sum().backward()
    assert x.grad is not None
    assert x.grad.tolist() == [0.0, 1.0, 1.0, 1.0, 0.0]


def test_lsq_scale_gradient_matches_formula() -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(100, generator=g)
    s = torch.tensor(0.01, requires_grad=True)
    zp = torch.tensor(0, dtype=torch.int32)
    fake_quantize(x, s, zp, -128, 127).sum().backward()
    v = x / 0.01
    # d/ds of s*clamp(round(x/s)) : round(v) - v inside, qmin/qmax outside (LSQ, Esser et al.)
    inside = (torch.round(x * (1 / torch.tensor(0.01))) >= -128) & (torch.round(x * (1 / torch.tensor(0.01))) <= 127)
    expected = torch.where(inside, torch.round(v) - v, torch.where(v < 0, torch.tensor(-128.0), torch.tensor(127.0)))
    assert s.grad is not None
    assert float(s.grad) == pytest.approx(float(expected.sum()), rel=1e-3, abs=1e-3)


def test_presets_validate_and_typos_are_named() -> None:
    from compress.core.errors import RecipeError

    assert QuantScheme.preset("w8a8").inputs is not None
    assert QuantScheme.preset("w8_weight_only").inputs is None
    w4 = QuantScheme.preset("w4_weight_only_g128").weights
    assert w4 is not None and (w4.bits, w4.group_size, w4.qmin, w4.qmax) == (4, 128, -8, 7)
    assert QuantScheme.preset("w8a8_dynamic").static_activations is False
    with pytest.raises(RecipeError, match="did you mean 'w8a8'"):
        QuantScheme.preset("w8a9")
    with pytest.raises(ValueError, match="group_size"):
        QuantSpec(granularity="group")
    with pytest.raises(ValueError, match="dynamic"):
        QuantSpec(granularity="token")
    with pytest.raises(ValueError, match="8 bits"):
        QuantScheme(inputs=QuantSpec(bits=4))


def test_reduce_range_spec_keeps_int8_codes_in_7_bits() -> None:
    from compress.quantization.numerics.spec import QuantSpec

    spec = QuantSpec(granularity="channel", reduce_range=True)
    assert (spec.qmin, spec.qmax) == (-64, 63)
    w = torch.randn(8, 16)
    scale, zp = qparams_from_range(w.amin(1), w.amax(1), qmin=spec.qmin, qmax=spec.qmax, symmetric=True)
    q = quantize_codes(w, scale.unsqueeze(1), zp.unsqueeze(1), spec.qmin, spec.qmax)
    assert q.dtype == torch.int8 and int(q.min()) >= -64 and int(q.max()) <= 63
    assert int(q.abs().amax(1).min()) >= 63  # each row's extreme still reaches the edge
    for bad in ({"dtype": "uint8"}, {"bits": 4}, {"narrow_range": True}):
        with pytest.raises(ValueError, match="reduce_range"):
            QuantSpec(reduce_range=True, **bad)  # type: ignore[arg-type]


def test_low_bit_symmetric_scale_puts_the_larger_end_on_the_extra_level() -> None:
    """A 4-bit signed grid is [-8, 7]: the range's larger end maps exactly to -8, with a negative
    scale when that end is the positive one (a step of amax / 8, not amax / 7); the smaller end is
    clipped only past 7/8 of the larger. 8-bit scales stay amax / 127, positive."""
    from compress.quantization.numerics.primitives import fake_quantize, qparams_from_range

    mn, mx = torch.tensor([-8.0, -3.0, -7.5, 0.0]), torch.tensor([3.0, 7.0, 7.0, 0.0])
    scale, zp = qparams_from_range(mn, mx, qmin=-8, qmax=7, symmetric=True)
    torch.testing.assert_close(scale[:3], torch.tensor([1.0, -0.875, 0.9375]))
    assert zp.tolist() == [0, 0, 0, 0] and float(scale[3]) > 0  # an all-zero range: a tiny positive scale
    ends = torch.stack([mn, mx], 1)[:3]
    fq = fake_quantize(ends, scale[:3, None], zp[:3, None], -8, 7)
    larger = torch.where(-mn[:3] >= mx[:3], mn[:3], mx[:3])
    torch.testing.assert_close(torch.where(-mn[:3] >= mx[:3], fq[:, 0], fq[:, 1]), larger)  # exact
    # the smaller end within 7/8 of the larger: rounded, not clipped
    assert torch.all((fq[:2] - ends[:2]).abs() <= scale[:2, None].abs() / 2 + 1e-6)
    torch.testing.assert_close(fq[2], torch.tensor([-7.5, 7 * 0.9375]))  # 7 > 7/8 * 7.5: clipped to 7 steps
    s8, _ = qparams_from_range(torch.tensor([-8.0]), torch.tensor([3.0]), qmin=-128, qmax=127, symmetric=True)
    torch.testing.assert_close(s8, torch.tensor([8.0 / 127]))


def test_lsq_moves_a_negative_low_bit_scale_as_the_mirror_of_a_positive_one() -> None:
    """A 4-bit channel led by its positive end has a negative scale. Its mirror image (the row
    negated) has the same scale positive, the same codes and the same loss, so LSQ must move the two
    scales as mirror images (a step signed by the scale would climb for one of them, a clamp to
    positive would zero it)."""
    from compress.quantization.numerics.fake_quant import FakeQuantizer

    g = torch.Generator().manual_seed(0)
    row = torch.randn(64, generator=g)
    row[0] = 4.0  # positive-led: the row's own scale is negative
    w = torch.stack([row, -row])
    q = FakeQuantizer(QuantSpec(bits=4, granularity="channel"), role="weight", name="w")
    q.observing = True
    q(w)
    q.finish_calibration()
    start = q.scale.detach().clone()
    assert float(start[0]) < 0 and float(start[0]) == -float(start[1])
    scale = q.enable_lsq()
    opt = torch.optim.SGD([scale], lr=0.5)
    for _ in range(10):
        loss = (q(w) - w).pow(2).sum(1)
        assert float(loss[0].detach()) == pytest.approx(float(loss[1].detach()), rel=1e-6)
        opt.zero_grad()
        loss.sum().backward()
        opt.step()
    now = scale.detach()
    assert float((now - start).abs().min()) > 1e-4  # both moved
    torch.testing.assert_close(now[0], -now[1])
