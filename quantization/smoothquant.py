"""SmoothQuant (Xiao et al., 2023): move activation outliers into the weights of Linear layers.

Per input feature j, ``s_j = max|X_j|^alpha / max|W_:,j|^(1-alpha)``; the weight is scaled by
``s`` and the input by ``1/s``, which leaves the float product unchanged but evens out the
per-channel activation ranges that one per-tensor activation scale must cover. The ``1/s`` lives
in the input quantizer as ``pre_quant_scale`` (a Mul before QuantizeLinear when exported), so it
works for post-LN transformers such as BERT, where the LayerNorm output also feeds the residual
and cannot absorb the factor.

No single alpha suits every layer (and on a model without strong outliers any fixed alpha can
hurt), so ``alpha="auto"`` picks it per layer: each candidate, and no smoothing at all, is scored
by the squared error of the layer's quantized output against its float output on a bounded
reservoir sample of the layer's calibration inputs (ranges fitted on one half, error measured on
the other), and the best one is kept.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

import torch
from pydantic import Field
from torch import nn

from compress.errors import CalibrationError
from quantization.calibration import ForwardLoop, as_forward_loop, float_mode
from quantization.fake_quant import FakeQuantizer
from quantization.graph_prepare import ensure_placed
from quantization.hooks import input_quantizer, set_smoothing
from quantization.modules import QuantLinear
from quantization.preparation import calibrate_weight, quant_modules, unwrap
from quantization.primitives import dynamic_qparams, fake_quantize_spec, qparams_from_range

log = logging.getLogger(__name__)

#: candidates of ``alpha="auto"``; ``None`` (no smoothing) is always tried as well
ALPHA_GRID: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
Alpha = float | Literal["auto"]
#: the recipe / QuantizeParams field: an alpha in [0, 1], "auto", or None (off)
SmoothQuantField = Annotated[float, Field(ge=0, le=1)] | Literal["auto"] | None


class _Reservoir:
    """A uniform sample of at most ``size`` input rows over the whole forward loop (memory stays
    ``size x features`` however many batches are seen)."""

    def __init__(self, size: int, seed: int = 0) -> None:
        self.size = size
        self.rows: torch.Tensor | None = None
        self.seen = 0
        self.gen = torch.Generator().manual_seed(seed)

    def add(self, x: torch.Tensor) -> None:
        rows = x.reshape(-1, x.shape[-1]).float().cpu()
        if self.rows is None:
            self.rows = rows.new_empty(0, rows.shape[1])
        free = self.size - len(self.rows)
        if free > 0:
            self.rows = torch.cat([self.rows, rows[:free]])
            self.seen += min(free, len(rows))
            rows = rows[free:]
        if len(rows) == 0:
            return
        pos = self.seen + torch.arange(len(rows), dtype=torch.float64)
        slot = (torch.rand(len(rows), generator=self.gen, dtype=torch.float64) * (pos + 1)).long()
        keep = slot < self.size
        self.rows[slot[keep]] = rows[keep]
        self.seen += len(rows)


def smooth_quant(
    model: nn.Module,
    forward_loop: ForwardLoop | Any,
    *,
    alpha: Alpha = 0.5,
    min_scale: float = 1e-2,
    sample_rows: int = 512,
) -> dict[str, torch.Tensor]:
    """Smooth every QuantLinear that quantizes its input; returns the factors ``s`` by layer name
    (all ones where ``alpha="auto"`` chose no smoothing).

    Runs ``forward_loop`` once in float to record per-feature activation maxima (O(features)
    memory; with ``"auto"`` also ``sample_rows`` input rows per group), then rescales weights in
    place and recalibrates the weight quantizers. Layers that read the same tensor (BERT's query,
    key and value) get one ``s``, from the maxima of all their weights, so the exported graph
    quantizes that tensor once. ``s`` is clamped to ``[min_scale, 1/min_scale]`` so that dead
    features do not blow up the weight.
    """
    auto = alpha == "auto"
    if not auto and not (isinstance(alpha, (int, float)) and 0.0 <= float(alpha) <= 1.0):
        raise ValueError(f"smoothquant alpha must be in [0, 1] or 'auto' (got {alpha!r})")
    loop = as_forward_loop(forward_loop)
    root = unwrap(model)
    ensure_placed(root, loop)
    layers = {n: m for n, m in quant_modules(root) if isinstance(m, QuantLinear) and input_quantizer(root, n) is not None}
    if not layers:
        return {}
    amax: dict[str, torch.Tensor] = {}
    first_input: dict[str, tuple[Any, ...]] = {}
    samples = {n: _Reservoir(sample_rows, seed=i) for i, n in enumerate(layers)} if auto else {}

    def hook(name: str) -> Any:
        def fn(_: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0].detach()
            a = x.abs().reshape(-1, x.shape[-1]).amax(0).float()
            amax[name] = torch.maximum(amax[name], a) if name in amax else a
            if name not in first_input:  # a fingerprint of the first input: equal for layers that share it
                flat = x.reshape(-1)
                first_input[name] = (tuple(x.shape), float(flat.double().sum()), tuple(flat[:16].tolist()))
            if auto:
                samples[name].add(x)

        return fn

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in layers.items()]
    try:
        with float_mode(root), torch.no_grad():
            loop(model)
    finally:
        for h in handles:
            h.remove()
    for name in layers:
        if name not in amax:
            raise CalibrationError(f"smoothquant: layer '{name}' saw no data during the forward loop")
    groups: dict[tuple[Any, ...], list[str]] = {}
    for name in layers:
        groups.setdefault(first_input[name], []).append(name)
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    scales: dict[str, torch.Tensor] = {}
    chosen: list[float | None] = []
    for names in groups.values():
        mods = [layers[n] for n in names]
        with torch.no_grad():
            raw = []
            for name, mod in zip(names, mods):
                iq = input_quantizer(root, name)
                assert iq is not None
                if iq.pre_quant_scale is not None:  # smoothed before: start again from the raw weight
                    mod.weight.mul_(iq.pre_quant_scale.to(mod.weight.dtype))
                    iq.pre_quant_scale = None
                raw.append(mod.weight.detach().clone())
            a = torch.stack([amax[n] for n in names]).amax(0)  # the hooks saw the raw input
            if distributed:  # ranks may calibrate on different shards: every rank must smooth alike
                torch.distributed.all_reduce(a, op=torch.distributed.ReduceOp.MAX)
            w = torch.stack([r.abs().amax(0).float() for r in raw]).amax(0)
            if auto:
                rows = samples[names[0]].rows
                assert rows is not None
                best = _pick_alpha(mods, raw, rows, a, w, min_scale, input_quantizer(root, names[0]))
                if distributed:  # rank 0's choice, so the weights stay identical across ranks
                    pick = torch.tensor([-1 if best is None else ALPHA_GRID.index(best)], device=a.device)
                    torch.distributed.broadcast(pick, src=0)
                    best = None if int(pick) < 0 else ALPHA_GRID[int(pick)]
                chosen.append(best)
                s = _factors(a, w, best, min_scale) if best is not None else torch.ones_like(a)
            else:
                s = _factors(a, w, float(alpha), min_scale)
            for mod, r in zip(mods, raw):
                mod.weight.copy_(r * s.to(r.dtype))
        set_smoothing(root, names, None if torch.all(s == 1) else (1.0 / s).to(mods[0].weight.device))
        for name, mod in zip(names, mods):
            calibrate_weight(mod)
            scales[name] = s
    if auto:
        picked = [v for v in chosen if v is not None]
        log.info(
            "smoothquant: auto alpha on %d Linear layers in %d input groups; %d groups smoothed (alphas %s), "
            "%d left as they were", len(scales), len(groups), len(picked), sorted(set(picked)), len(chosen) - len(picked),
        )
    else:
        log.info("smoothquant: alpha=%.2f on %d Linear layers in %d input groups", float(alpha), len(scales), len(groups))
    return scales


def _factors(amax_x: torch.Tensor, amax_w: torch.Tensor, alpha: float, min_scale: float) -> torch.Tensor:
    s = (amax_x.clamp(min=1e-8).pow(alpha) / amax_w.clamp(min=1e-8).pow(1 - alpha)).clamp(min_scale, 1 / min_scale)
    return torch.where((amax_x > 0) & (amax_w > 0), s, torch.ones_like(s))


def _pick_alpha(
    mods: list[QuantLinear], raw: list[torch.Tensor], rows: torch.Tensor, amax_x: torch.Tensor,
    amax_w: torch.Tensor, min_scale: float, iq: FakeQuantizer | None,
) -> float | None:
    """The candidate (``None`` = no smoothing) with the least summed output error of the group's
    layers on held-out rows.

    The activation range comes from one half of the sample and the error from the other: smoothing
    can concentrate the range in a few columns whose extremes a sample estimates poorly, and only
    out-of-sample rows show the clipping that follows.
    """
    assert iq is not None
    x = rows.to(raw[0].device, raw[0].dtype)
    fit, held = (x[0::2], x[1::2]) if len(x) >= 2 else (x, x)
    refs = [held @ r.t() for r in raw]
    best: float | None = None
    best_err = float("inf")
    for al in (None, *ALPHA_GRID):
        s = torch.ones_like(amax_x) if al is None else _factors(amax_x, amax_w, al, min_scale)
        s = s.to(x.dtype)
        xs = held / s
        if iq.spec.dynamic:
            sc, zp = dynamic_qparams(xs, iq.spec)
        else:
            xf = fit / s
            sc, zp = qparams_from_range(
                xf.min(), xf.max(), qmin=iq.spec.qmin, qmax=iq.spec.qmax, symmetric=iq.spec.symmetric
            )
        xq = fake_quantize_spec(xs, sc, zp, iq.spec) if iq.spec.granularity in ("tensor", "token") else xs
        err = 0.0
        for mod, r, ref in zip(mods, raw, refs):
            ws = r * s.to(r.dtype)
            wq = mod.weight_quantizer
            if wq is not None:
                wsc, wzp = dynamic_qparams(ws, wq.spec)
                ws = fake_quantize_spec(ws, wsc, wzp, wq.spec)
            err += float((xq @ ws.t() - ref).pow(2).sum())
        if err < best_err:
            best, best_err = al, err
    return best
