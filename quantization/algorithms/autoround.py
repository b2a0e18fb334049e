"""AutoRound (Cheng et al., 2024, "Optimize Weight Rounding via Signed Gradient Descent"): each
weight's rounding offset and each group's clipping range learned on a decoder layer's output.

For every quantized Linear of a layer, ``V`` (one offset per weight, in [-0.5, 0.5]) and two
factors per scale group (``lo``, ``hi`` in [0.5, 1], multiplying the group's min and max) are
trained so that the layer with weights ``s * (clamp(round(W / s + V) + z) - z)`` (``s``, ``z`` from
the clipped range) reproduces the float layer's output. Gradients pass the roundings straight
through; the update is the gradient's sign times a learning rate decaying linearly to zero (signed
SGD: with ``lr = 1 / iters`` no offset can move by more than 0.5, whatever the gradients). The
parameters of the step with the lowest loss are kept. At ``V = 0``, ``lo = hi = 1`` this is exactly
round-to-nearest on the min-max grid, which is where the search starts.

The targets are the float model's layer outputs on float inputs; the inputs the layer is trained on
are those the already quantized layers before it produce (the sequential pipeline's, as the paper's
default), so each layer also learns to absorb the error that reaches it. Both streams are one
hidden-state tensor per calibration batch: memory stays about twice GPTQ's activations, never the model.

``init='gptq'``: the search starts from GPTQ's solution instead (GPTQ's error-compensated weights
before their rounding, on GPTQ's grid), so AutoRound refines what GPTQ found.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from compress.quantization.algorithms.gptq import GPTQParams, gptq_quantize, layer_hessians
from compress.quantization.algorithms.sequential import (
    DEFAULT_SCHEME,
    Call,
    LayerHook,
    hidden_of,
    log_summary,
    sequential_quantize,
    with_hidden,
)
from compress.quantization.numerics.calibration import float_mode
from compress.quantization.numerics.modules import QuantLinear
from compress.quantization.numerics.primitives import (
    LOW_BIT_LEVELS,
    SCALE_EPS,
    from_groups,
    group_size_for,
    to_groups,
    zero_point_of_symmetric,
)
from compress.quantization.numerics.spec import QuantScheme, QuantSpec, resolve_scheme
from pydantic import Field
from torch import nn
from torch.func import functional_call

from compress.core.batching import CalibrationData, as_batches
from compress.core.errors import CalibrationError
from compress.core.params import Selection
from compress.core.progress import with_progress
from compress.core.sparsity import mask_of

log = logging.getLogger(__name__)

#: the clipping factors' lower bound: a group's range shrinks to half at most
MIN_RANGE_FACTOR = 0.5


class AutoRoundParams(Selection):
    """AutoRound's settings: what ``compress.autoround`` takes and the ``autoround`` recipe modifier
    is made of. ``iters`` signed-gradient steps per decoder layer (the paper's 200; 0 is
    round-to-nearest), ``lr`` the rounding offsets' learning rate (default ``1 / iters``),
    ``range_lr`` the clipping factors' (default ``lr``; ``tune_range`` False keeps the min-max range),
    ``batch_size`` calibration samples per step (rows of the calibration batches), ``init``
    ``rtn`` or ``gptq`` (start from GPTQ's solution, with ``dampening``), ``seed`` the sample order;
    the selection and ``num_batches`` as :class:`~compress.core.params.Selection`."""

    iters: int = Field(200, ge=0)
    lr: float | None = Field(None, gt=0)
    range_lr: float | None = Field(None, gt=0)
    tune_range: bool = True
    batch_size: int = Field(8, ge=1)
    init: Literal["rtn", "gptq"] = "rtn"
    dampening: float = Field(0.01, gt=0, le=1)
    seed: int = Field(0, ge=0)


def _round_ste(x: torch.Tensor) -> torch.Tensor:
    return x + (torch.round(x) - x).detach()


def group_qparams(wmin: torch.Tensor, wmax: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, zero_point)`` as float tensors covering ``[wmin, wmax]``, differentiable in both
    (the zero point rounds straight through). The same arithmetic as
    :func:`~compress.quantization.numerics.primitives.qparams_from_range`, so that unclipped ranges
    give round-to-nearest's qparams bit for bit."""
    lo = torch.clamp(wmin, max=0.0)
    hi = torch.clamp(wmax, min=0.0)
    qmin, qmax = spec.qmin, spec.qmax
    if spec.symmetric:
        zp = zero_point_of_symmetric(qmin, qmax)
        if zp == 0 and qmax - qmin < LOW_BIT_LEVELS:
            neg_led = -lo >= hi
            scale = torch.where(neg_led, lo, hi) / float(qmin)
            scale = torch.where(neg_led, scale.clamp(min=SCALE_EPS), scale.clamp(max=-SCALE_EPS))
        else:
            scale = torch.clamp(torch.maximum(-lo, hi) / float(qmax - zp), min=SCALE_EPS)
        return scale, torch.full_like(scale, float(zp))
    scale = torch.clamp((hi - lo) / float(qmax - qmin), min=SCALE_EPS)
    zero = torch.clamp(qmin - _round_ste(lo / scale), qmin, qmax)
    return scale, zero


class _Rounding:
    """One Linear's learnable rounding: offsets ``v`` and range factors ``lo``/``hi`` per group."""

    def __init__(self, weight: torch.Tensor, spec: QuantSpec, *, range_weight: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None) -> None:
        self.spec = spec
        self.w = weight.detach().float()
        self.gs = group_size_for(self.w, spec) if spec.granularity == "group" else self.w.shape[1]
        # a padded last group's zeros change nothing: every range is widened to include 0
        src = to_groups(self.w if range_weight is None else range_weight.detach().float(), self.gs)
        self.wmin, self.wmax = src.amin(-1), src.amax(-1)  # [out, groups]
        self.v = torch.zeros_like(self.w, requires_grad=True)
        self.lo = torch.ones_like(self.wmin, requires_grad=True)
        self.hi = torch.ones_like(self.wmax, requires_grad=True)
        self.mask = None if mask is None else mask.to(self.w.device, torch.bool)

    def params(self, tune_range: bool) -> list[torch.Tensor]:
        return [self.v, self.lo, self.hi] if tune_range else [self.v]

    def qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        return group_qparams(self.wmin * self.lo, self.wmax * self.hi, self.spec)

    def dequantized(self) -> torch.Tensor:
        """The weight on the grid the current parameters give (differentiable in all three)."""
        scale, zero = self.qparams()
        s, z = scale.unsqueeze(-1), zero.unsqueeze(-1)
        wg = to_groups(self.w, self.gs)
        vg = to_groups(self.v, self.gs)
        q = torch.clamp(_round_ste(wg * (1.0 / s) + vg) + z,  # the reciprocal, as fake_quantize: ties alike
                        self.spec.qmin, self.spec.qmax)
        out = from_groups((q - z) * s, self.w)
        return out if self.mask is None else out * self.mask

    def clamp_(self) -> None:
        with torch.no_grad():
            self.v.clamp_(-0.5, 0.5)
            self.lo.clamp_(MIN_RANGE_FACTOR, 1.0)
            self.hi.clamp_(MIN_RANGE_FACTOR, 1.0)

    def state(self) -> tuple[torch.Tensor, ...]:
        return self.v.detach().clone(), self.lo.detach().clone(), self.hi.detach().clone()

    def load(self, state: tuple[torch.Tensor, ...]) -> None:
        with torch.no_grad():
            for p, s in zip((self.v, self.lo, self.hi), state):
                p.copy_(s)


def _all_reduce(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over the DDP ranks (every rank then takes the same step); ``t`` outside one."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t


def _out(y: Any) -> torch.Tensor:
    return y[0] if isinstance(y, (tuple, list)) else y


def _gptq_start(layer: nn.Module, linears: Mapping[str, QuantLinear], calls: Sequence[Call], dampening: float
                ) -> dict[str, torch.Tensor]:
    """GPTQ's error-compensated (not yet rounded) weights per Linear, on the layer's inputs."""
    out: dict[str, torch.Tensor] = {}
    gp = GPTQParams(dampening=dampening)
    for names, h in layer_hessians(layer, linears, calls):
        for n in names:
            m = linears[n]
            if m.weight_quantizer is None:
                continue
            out[n] = gptq_quantize(m.weight, h, m.weight_quantizer.spec, gp, mask=mask_of(m), continuous=True)[0]
    return out


def autoround_layer(layer: nn.Module, linears: Mapping[str, QuantLinear], calls: Sequence[Call],
                    targets: Sequence[torch.Tensor], params: AutoRoundParams, *, seed: int = 0) -> dict[str, Any]:
    """AutoRound on one decoder layer's quantized Linears, in place: the rounding that makes the layer
    on ``calls`` reproduce ``targets`` (one float output per call). Leaves each weight de-quantized
    on its grid with the qparams set. Returns the loss at round-to-nearest and the best loss."""
    p = params
    if len(targets) != len(calls):
        raise CalibrationError("autoround: one target per calibration batch is needed")
    quant = {n: m for n, m in linears.items() if m.weight_quantizer is not None}
    for n, m in quant.items():
        spec = m.weight_quantizer.spec  # type: ignore[union-attr]
        if spec.is_float or spec.granularity not in ("group", "channel") or (spec.granularity == "channel" and spec.axis != 0):
            raise CalibrationError(f"autoround: {n}: needs integer weights per output channel or group "
                                   f"(got {spec.dtype} per {spec.granularity})")
    start = _gptq_start(layer, quant, calls, p.dampening) if p.init == "gptq" and quant else {}
    rnd = {n: _Rounding(start.get(n, m.weight), m.weight_quantizer.spec,  # type: ignore[union-attr]
                        range_weight=m.weight if n in start else None, mask=mask_of(m)) for n, m in quant.items()}
    lr = p.lr if p.lr is not None else 1.0 / max(p.iters, 1)
    range_lr = p.range_lr if p.range_lr is not None else lr
    frozen = [(q, q.requires_grad) for q in layer.parameters()]
    for q, _ in frozen:
        q.requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    rows = [int(hidden_of(c).shape[0]) for c in calls]
    per_step = max(1, math.ceil(p.batch_size / max(rows)))  # calls per step (each a calibration batch)
    order: list[int] = []

    def loss_of(idx: Sequence[int], weights: dict[str, torch.Tensor]) -> torch.Tensor:
        total = torch.zeros(())
        count = 0
        for j in idx:
            args, kwargs = calls[j]
            y = _out(functional_call(layer, weights, args, kwargs))
            t = targets[j]
            total = total + torch.nn.functional.mse_loss(y.float(), t.float(), reduction="sum")
            count += t.numel()
        return total / max(count, 1)

    def current(grad: bool) -> dict[str, torch.Tensor]:
        with torch.set_grad_enabled(grad):
            # in the layer's own dtype (a bf16 checkpoint runs in bf16); the search itself is float32
            return {f"{n}.weight": r.dequantized().to(quant[n].weight.dtype) for n, r in rnd.items()}

    first = best = math.inf
    best_state = {n: r.state() for n, r in rnd.items()}
    try:
        with float_mode(layer):
            for step in range(p.iters):
                if len(order) < per_step:
                    order += torch.randperm(len(calls), generator=gen).tolist()
                idx, order = order[:per_step], order[per_step:]
                with torch.enable_grad():
                    loss = loss_of(idx, current(True))
                    loss.backward()
                value = float(_all_reduce(loss.detach().clone()))
                if step == 0:
                    first = value
                if value < best:
                    best, best_state = value, {n: r.state() for n, r in rnd.items()}
                decay = 1.0 - step / p.iters
                with torch.no_grad():
                    for r in rnd.values():
                        for t, rate in ((r.v, lr), (r.lo, range_lr), (r.hi, range_lr)):
                            if t.grad is not None:
                                if p.tune_range or t is r.v:
                                    t.sub_(rate * decay * torch.sign(_all_reduce(t.grad)))
                                t.grad = None
                        r.clamp_()
            for n, r in rnd.items():
                r.load(best_state[n])
            with torch.no_grad():
                final = current(False)
    finally:
        for q, flag in frozen:
            q.requires_grad_(flag)
    with torch.no_grad():
        for n, m in quant.items():
            wq = m.weight_quantizer
            assert wq is not None
            scale, zero = rnd[n].qparams()
            m.weight.data.copy_(final[f"{n}.weight"].to(m.weight.dtype))
            if wq.spec.granularity == "channel":
                scale, zero = scale[:, 0], zero[:, 0]
            wq.set_qparams(scale.detach(), torch.round(zero.detach()).to(torch.int32))
    return {"autoround_first_loss": first if p.iters else None, "autoround_best_loss": best if p.iters else None}


class AutoRoundLayers:
    """The per-layer process of the sequential pipeline: keeps the float stream (the float model's
    layer outputs on float inputs), whose next values are each layer's targets."""

    def __init__(self, params: AutoRoundParams) -> None:
        self.params = params
        self.stream: list[torch.Tensor] | None = None

    def __call__(self, i: int, layer: nn.Module, linears: dict[str, QuantLinear], calls: list[Call]) -> dict[str, Any]:
        if i == 0 or self.stream is None:
            self.stream = [hidden_of(c).detach().clone() for c in calls]
        targets = []
        with torch.no_grad(), float_mode(layer):
            for c, h in zip(calls, self.stream):
                args, kwargs = with_hidden(c, h)
                targets.append(_out(layer(*args, **kwargs)).detach())
        self.stream = targets
        return autoround_layer(layer, linears, calls, targets, self.params, seed=self.params.seed + i)


@with_progress
def autoround(
    model: nn.Module,
    data: CalibrationData,
    *,
    scheme: QuantScheme | str = DEFAULT_SCHEME,
    targets: Sequence[str] | None = None,
    ignore: Sequence[str] | None = None,
    params: AutoRoundParams | None = None,
    load: LayerHook | None = None,
    release: LayerHook | None = None,
    progress: bool = True,
) -> nn.Module:
    """AutoRound quantization of a decoder LLM's weights (in place), one layer at a time; returns it.

    ``data``: calibration batches as :func:`~compress.quantization.algorithms.gptq.gptq` takes them.
    ``scheme``: a weight-only integer scheme (any bits and group size, symmetric or not).
    ``params``: AutoRoundParams (iters, learning rates, samples per step, init); ``targets`` /
    ``ignore``: module patterns (``ignore=["lm_head"]`` keeps the head float). ``load``/``release``:
    per-layer offloading callbacks. ``progress``: a line per decoder layer; False: silent.
    """
    p = (params or AutoRoundParams()).given("autoround", targets=targets, ignore=ignore)
    s = resolve_scheme(scheme)
    if s.inputs is not None or s.outputs is not None:
        raise CalibrationError("autoround: needs a weight-only scheme (weights set, inputs and outputs null)")
    summary = sequential_quantize(model, as_batches(data, model, max_batches=p.num_batches), s, AutoRoundLayers(p), p,
                                  load=load, release=release, where="autoround")
    log_summary("autoround", summary)
    return model


__all__ = ["AutoRoundLayers", "AutoRoundParams", "autoround", "autoround_layer", "group_qparams"]
