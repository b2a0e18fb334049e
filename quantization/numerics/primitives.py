"""Quantization arithmetic: qparams from ranges, quantize / dequantize / fake-quantize, STE and LSQ.

``fake_quantize`` computes ``(clamp(round(x * (1/scale)) + zp, qmin, qmax) - zp) * scale`` in
float32, the exact arithmetic of torch's ``fake_quantize_per_{tensor,channel}_affine`` CPU kernels
(multiply by the reciprocal, round half to even), so results are bit-identical to them. Gradients
are the straight-through estimator: 1 inside [qmin, qmax] and 0 where the value was clamped; when
``scale`` requires grad, its gradient is LSQ's (Esser et al., 2020).

Layout helpers map any granularity to a 2-D ``[groups, elements]`` view so observers and
quantizers reduce one way: a row per scale.
"""

from __future__ import annotations

import math

import torch
from compress.quantization.numerics.spec import FP4_E2M1_MAX, FP8_E4M3_MAX, QuantSpec

# Smallest scale: keeps constant or all-zero tensors finite (they quantize to exact zeros).
SCALE_EPS = float(torch.finfo(torch.float32).eps)
#: the smallest scale a calibrated range gets: tensors with tiny values (1e-6 activations of a
#: freshly initialized network) keep their resolution; only an all-zero range hits it
MIN_RANGE_SCALE = 1e-30


def zero_point_of_symmetric(qmin: int, qmax: int) -> int:
    """0 for signed ranges, the midpoint (128 for uint8) for unsigned ones."""
    return 0 if qmin < 0 else (qmax + 1) // 2


#: signed symmetric grids with fewer levels than this (4 bits and below) put the larger end of the
#: range on qmin, with a signed scale (see qparams_from_range); at 8 bits the gain is 1/128 of a
#: step and int8 scales stay amax / 127, positive
LOW_BIT_LEVELS = 16


def qparams_from_range(
    min_val: torch.Tensor, max_val: torch.Tensor, *, qmin: int, qmax: int, symmetric: bool,
    min_scale: float = SCALE_EPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, zero_point)`` (float32, int32) that cover ``[min_val, max_val]`` elementwise.

    The range is widened to include 0 so that zero is exactly representable (padding, ReLU);
    a degenerate range gets ``min_scale`` rather than a zero or NaN scale (calibrated static
    ranges pass ``MIN_RANGE_SCALE``; run-time per-token ranges keep ``SCALE_EPS``, as the kernels do).
    """
    min_val = torch.clamp(min_val.float(), max=0.0)
    max_val = torch.clamp(max_val.float(), min=0.0)
    if symmetric:
        zp = zero_point_of_symmetric(qmin, qmax)
        if zp == 0 and qmax - qmin < LOW_BIT_LEVELS:
            # a signed grid of <= 16 levels puts the range's larger end on its extra level, qmin:
            # a range led by its positive end gets a negative scale, so its step is max / 8 at 4
            # bits, not max / 7 (the smaller end is clipped past 7/8 of the larger; ONNX Runtime's
            # blockwise int4 quantizer does the same). Every dequantizer multiplies by the scale.
            neg_led = -min_val >= max_val
            scale = torch.where(neg_led, min_val, max_val) / float(qmin)
            scale = torch.where(neg_led, scale.clamp(min=min_scale), scale.clamp(max=-min_scale))
        else:
            scale = torch.clamp(torch.maximum(-min_val, max_val) / float(qmax - zp), min=min_scale)
        zero_point = torch.full_like(scale, zp, dtype=torch.int32)
    else:
        scale = torch.clamp((max_val - min_val) / float(qmax - qmin), min=min_scale)
        zero_point = torch.clamp(qmin - torch.round(min_val / scale), qmin, qmax).to(torch.int32)
    return scale, zero_point


def clamp_scale(scale: torch.Tensor, min_scale: float = SCALE_EPS) -> torch.Tensor:
    """``scale`` with its magnitude at least ``min_scale``, sign kept (low-bit signed grids store
    negative scales, see :func:`qparams_from_range`)."""
    return torch.where(scale < 0, scale.clamp(max=-min_scale), scale.clamp(min=min_scale))


def _round_ste(x: torch.Tensor) -> torch.Tensor:
    return x + (torch.round(x) - x).detach()


def grad_scale(x: torch.Tensor, factor: float | torch.Tensor) -> torch.Tensor:
    """``x`` in the forward pass, gradient multiplied by ``factor`` (LSQ's step-size gradient scale)."""
    y = x * factor
    return (x - y).detach() + y


def lsq_grad_factor(numel_per_scale: int, qmax: int) -> float:
    """LSQ's gradient scale ``1 / sqrt(N * Qp)`` for a scale that covers ``N`` elements."""
    return 1.0 / math.sqrt(max(numel_per_scale, 1) * max(qmax, 1))


def fake_quantize(
    x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qmin: int, qmax: int
) -> torch.Tensor:
    """Quantize and dequantize ``x`` with broadcastable ``scale``/``zero_point``; STE gradients."""
    dtype = x.dtype
    xf = x.float()
    zp = zero_point.to(torch.float32)
    inv = 1.0 / scale.float()
    if not torch.is_grad_enabled() or not (x.requires_grad or scale.requires_grad):
        # no gradient to carry: plain rounding, in place (the searches of GPTQ, AWQ and the
        # observers call this thousands of times); the same values as the STE path
        q = xf * inv
        q.round_().add_(zp).clamp_(qmin, qmax).sub_(zp)
        return q.mul_(scale.float()).to(dtype)
    q = torch.clamp(_round_ste(xf * inv) + zp, qmin, qmax)
    return ((q - zp) * scale.float()).to(dtype)


def fake_quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Fake-quantize ``x`` to float8 e4m3 with broadcastable ``scale``: ``e4m3(clamp(x / scale)) *
    scale`` in float32, rounding to the nearest e4m3 value (ties to even, torch's cast, which the
    CUDA kernels share); straight-through gradients inside [-448, 448]."""
    dtype = x.dtype
    lim = float(FP8_E4M3_MAX)
    xs = x.float() * (1.0 / scale.float())
    if not torch.is_grad_enabled() or not (x.requires_grad or scale.requires_grad):
        q = xs.clamp_(-lim, lim).to(torch.float8_e4m3fn).float()
        return q.mul_(scale.float()).to(dtype)
    xc = torch.clamp(xs, -lim, lim)
    q = xc + (xc.to(torch.float8_e4m3fn).float() - xc).detach()
    return (q * scale.float()).to(dtype)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float8 e4m3 codes of ``x`` (``torch.float8_e4m3fn``) with broadcastable ``scale``; no gradient."""
    lim = float(FP8_E4M3_MAX)
    return torch.clamp(x.float() * (1.0 / scale.float()), -lim, lim).to(torch.float8_e4m3fn)


# ---- fp4 e2m1 (NVFP4, MXFP4) --------------------------------------------------------------------


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to the nearest fp4 e2m1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6, signed), ties to the
    even code, saturating at 6: the e2m1 grid is three uniform pieces (steps 0.5 below 2, 1 below 4,
    2 above), each rounded half-to-even by ``torch.round``. Ties land where compressed-tensors' cast
    puts them (0.25 -> 0, 0.75 -> 1, 2.5 -> 2, 5 -> 4)."""
    a = x.abs()
    q = torch.where(a < 2, torch.round(a * 2) * 0.5, torch.where(a < 4, torch.round(a), torch.round(a * 0.5) * 2))
    return torch.copysign(q.clamp_(max=float(FP4_E2M1_MAX)), x)


def fake_quantize_fp4(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Fake-quantize ``x`` to fp4 e2m1 with broadcastable (effective) ``scale``: ``e2m1(x / scale) *
    scale`` in float32, dividing as compressed-tensors does, so a checkpoint it dequantizes holds these
    values; straight-through gradients inside [-6, 6] (0 where saturated)."""
    dtype = x.dtype
    xs = x.float() / scale.float()
    if not torch.is_grad_enabled() or not (x.requires_grad or scale.requires_grad):
        return (round_e2m1(xs) * scale.float()).to(dtype)
    lim = float(FP4_E2M1_MAX)
    xc = torch.clamp(xs, -lim, lim)
    q = xc + (round_e2m1(xc) - xc).detach()
    return (q * scale.float()).to(dtype)


#: the smallest e4m3 scale compressed-tensors gives an all-zero NVFP4 group (its e4m3 "eps")
_NVFP4_ZERO_GROUP_SCALE = 0.125


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """NVFP4's per-tensor global scale ``448 * 6 / amax`` (float32, shape [1]; 1.0 where ``amax`` is
    0 or not finite), which puts the largest group scale at e4m3's largest value."""
    a = amax.float().reshape(-1).abs().amax().clamp(min=torch.finfo(torch.float32).tiny)
    g = torch.nan_to_num(FP8_E4M3_MAX * FP4_E2M1_MAX / a, nan=1.0, posinf=1.0, neginf=1.0)
    return g.reshape(1)


def fp4_scales(amax: torch.Tensor, spec: QuantSpec, global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The effective fp4 group scales (float32, shape of ``amax``) for groups whose largest magnitude
    is ``amax``: NVFP4 ``e4m3(amax / 6 * g) / g`` with the global scale ``g``; MX ``2^(e - 2)`` with
    ``e`` the exponent of ``amax`` rounded to a power of two at e2m1's one mantissa bit (OCP MX: the
    largest element lands in [4, 7), saturating at 6); plain float32 ``amax / 6``."""
    a = amax.float()
    if spec.scale_dtype == "fp8_e4m3":
        if global_scale is None:
            raise ValueError("NVFP4 group scales need the tensor's global scale")
        g = global_scale.float()
        s = (a / FP4_E2M1_MAX * g).clamp(max=float(FP8_E4M3_MAX)).to(torch.float8_e4m3fn).float()
        s = torch.where(s == 0, torch.full_like(s, _NVFP4_ZERO_GROUP_SCALE), s)
        return s / g
    if spec.scale_dtype == "e8m0":
        # round to a power of two: add half of e2m1's mantissa step (2^21 of float32's 2^23) to the
        # bits and keep sign and exponent, as compressed-tensors' generate_mx_scales
        bits = (a.contiguous().view(torch.int32) + (1 << 21)) & 0x7F800000
        exp = (bits >> 23) - 127 - 2  # FP4's largest power of two is 2^2
        exp = torch.where(a > 0, exp, torch.full_like(exp, -127)).clamp(-127, 127)
        return torch.exp2(exp.float())
    return (a / FP4_E2M1_MAX).clamp(min=SCALE_EPS)


def e8m0_codes(scale: torch.Tensor) -> torch.Tensor:
    """MX scales (powers of two) as e8m0 codes: the biased exponent ``log2(scale) + 127`` (uint8)."""
    return (torch.round(torch.log2(scale.float())) + 127).clamp(0, 254).to(torch.uint8)


def fp4_codes(x: torch.Tensor) -> torch.Tensor:
    """Packed-format nibbles of e2m1 values ``x`` (already on the grid): bit 3 the sign, bits 0-2 the
    index of ``|x|`` in (0, 0.5, 1, 1.5, 2, 3, 4, 6); uint8, shape of ``x``."""
    a = x.float().abs()
    idx = torch.where(a < 2, a * 2, torch.where(a < 4, a + 2, a * 0.5 + 4)).round().to(torch.uint8)
    return idx | (torch.signbit(x).to(torch.uint8) << 3)


def fake_quantize_grid(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Fake-quantize ``x`` on ``spec``'s grid (integer, fp8 or fp4) with qparams that already
    broadcast against it (the column sweeps and searches of GPTQ and AWQ)."""
    if spec.is_fp4:
        return fake_quantize_fp4(x, scale)
    if spec.is_fp8:
        return fake_quantize_fp8(x, scale)
    return fake_quantize(x, scale, zero_point, spec.qmin, spec.qmax)


def quantize_codes(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    """Integer codes of ``x`` (int8 for signed ranges, uint8 for unsigned); no gradient."""
    q = torch.clamp(torch.round(x.float() * (1.0 / scale.float())) + zero_point.float(), qmin, qmax)
    return q.to(torch.int8 if qmin < 0 else torch.uint8)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    """Float32 values of integer codes ``q``."""
    return (q.float() - zero_point.float()) * scale.float()


# ---- layouts: one row per scale ------------------------------------------------------------------


def to_rows(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """``x`` as ``[groups, elements]``, one row per scale of ``spec``'s granularity."""
    g = spec.granularity
    if g == "tensor":
        return x.reshape(1, -1)
    if g == "channel":
        return x.movedim(spec.axis, 0).reshape(x.shape[spec.axis], -1)
    if g == "token":
        return x.reshape(-1, x.shape[-1])
    return to_groups(x, group_size_for(x, spec)).reshape(-1, group_size_for(x, spec))


def to_groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """``x`` as ``[C, G, group_size]`` (C = ``x.shape[0]``): consecutive features of each row in
    groups. A row whose length is not a multiple of ``group_size`` gets a shorter last group,
    zero-padded here (zero is exact under every scale and inside every widened range)."""
    rows = x.reshape(x.shape[0], -1)
    pad = -rows.shape[1] % group_size
    if pad:
        rows = torch.nn.functional.pad(rows, (0, pad))
    return rows.reshape(rows.shape[0], -1, group_size)


def from_groups(g: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`to_groups`: drop the padding and take ``like``'s shape."""
    n = like[0].numel() if like.dim() > 0 and like.shape[0] > 0 else 0
    return g.reshape(g.shape[0], -1)[:, :n].reshape(like.shape)


def group_size_for(x: torch.Tensor, spec: QuantSpec) -> int:
    """The effective group size: ``spec.group_size``, or the whole row when a row is shorter."""
    row = int(x[0].numel()) if x.dim() > 0 and x.shape[0] > 0 else 0
    gs = spec.group_size or row
    return row if row <= gs else gs


def stat_shape(x: torch.Tensor, spec: QuantSpec) -> tuple[int, ...]:
    """Shape of the stored scale for ``x``: () per tensor, (C,) per channel, (C, G) per group."""
    g = spec.granularity
    if g == "tensor":
        return ()
    if g == "channel":
        return (x.shape[spec.axis],)
    if g == "group":
        return (x.shape[0], -(-x[0].numel() // group_size_for(x, spec)))
    return (*x.shape[:-1], 1)


def broadcast_param(p: torch.Tensor, x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """A stored scale/zero_point reshaped to broadcast against ``x`` (or ``x``'s group view)."""
    g = spec.granularity
    if g == "tensor" or g == "token":
        return p
    if g == "channel":
        shape = [1] * x.dim()
        shape[spec.axis] = -1
        return p.reshape(shape)
    return p.reshape(*p.shape, 1)  # group: against x.reshape(C, G, group_size)


def fake_quantize_spec(
    x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, spec: QuantSpec
) -> torch.Tensor:
    """Fake-quantize ``x`` with stored qparams laid out for ``spec``'s granularity."""
    if spec.granularity == "group":
        if spec.is_fp4 and spec.dynamic:  # activations: groups along the last dim
            rows = x.reshape(-1, x.shape[-1])
            return from_groups(fake_quantize_fp4(to_groups(rows, group_size_for(rows, spec)), scale.unsqueeze(-1)),
                               rows).reshape(x.shape)
        xg = to_groups(x, group_size_for(x, spec))
        if spec.is_fp4:
            return from_groups(fake_quantize_fp4(xg, scale.unsqueeze(-1)), x)
        out = fake_quantize(xg, scale.unsqueeze(-1), zero_point.unsqueeze(-1), spec.qmin, spec.qmax)
        return from_groups(out, x)
    s = broadcast_param(scale, x, spec)
    if spec.is_float:
        return fake_quantize_fp8(x, s)
    z = broadcast_param(zero_point, x, spec)
    return fake_quantize(x, s, z, spec.qmin, spec.qmax)


def quantize_spec(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Codes of ``x`` (integers; float8 for fp8 specs) with stored qparams laid out for ``spec``'s
    granularity; shape of ``x``. fp4 codes are the e2m1 values themselves (float32)."""
    if spec.granularity == "group":
        xg = to_groups(x, group_size_for(x, spec))
        if spec.is_fp4:
            return from_groups(round_e2m1(xg.float() / scale[..., None].float()), x)
        return from_groups(quantize_codes(xg, scale[..., None], zero_point[..., None], spec.qmin, spec.qmax), x)
    s = broadcast_param(scale, x, spec)
    if spec.is_float:
        return quantize_fp8(x, s)
    z = broadcast_param(zero_point, x, spec)
    return quantize_codes(x, s, z, spec.qmin, spec.qmax)


def spec_qparams(min_val: torch.Tensor, max_val: torch.Tensor, spec: QuantSpec, *,
                 global_scale: torch.Tensor | None = None, min_scale: float = SCALE_EPS,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, zero_point)`` covering ``[min_val, max_val]`` on ``spec``'s grid: integer and fp8
    grids as :func:`qparams_from_range`; fp4 groups as :func:`fp4_scales` (NVFP4's ``global_scale``
    defaults to the one these ranges imply: one tensor's groups), zero points 0."""
    if not spec.is_fp4:
        return qparams_from_range(min_val, max_val, qmin=spec.qmin, qmax=spec.qmax, symmetric=spec.symmetric,
                                  min_scale=min_scale)
    amax = torch.maximum(-min_val.float(), max_val.float()).clamp(min=0)
    if spec.scale_dtype == "fp8_e4m3" and global_scale is None:
        global_scale = nvfp4_global_scale(amax)
    scale = fp4_scales(amax, spec, global_scale)
    return scale, torch.zeros_like(scale, dtype=torch.int32)


def dynamic_qparams(x: torch.Tensor, spec: QuantSpec, global_scale: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Qparams computed from ``x`` itself (dynamic quantization), shaped like :func:`stat_shape`;
    fp4 activations get one scale per group of the last dim (NVFP4: under the calibrated ``global_scale``)."""
    if spec.is_fp4:
        rows = x.detach().reshape(-1, x.shape[-1])
        g = to_groups(rows, group_size_for(rows, spec))
        return spec_qparams(g.amin(-1), g.amax(-1), spec, global_scale=global_scale)
    rows = to_rows(x.detach(), spec)
    scale, zp = qparams_from_range(
        rows.amin(dim=1), rows.amax(dim=1), qmin=spec.qmin, qmax=spec.qmax, symmetric=spec.symmetric
    )
    shape = stat_shape(x, spec)
    return scale.reshape(shape), zp.reshape(shape)
