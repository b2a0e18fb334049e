"""GPTQ (Frantar et al., 2023): weight rounding that compensates each column's error in the columns
not yet rounded, through the inverse Hessian of the layer's input (``H = 2 X^T X / n``).

The algorithm is the reference one: columns in blocks of ``block_size``; inside a block each column
is rounded and its error, scaled by the Cholesky factor of ``H^-1``, is subtracted from the rest of
the block; the block's accumulated error then updates all later columns at once (one GEMM). ``H`` is
dampened by ``dampening * mean(diag(H))`` (raised tenfold up to three times if Cholesky still fails).

Scales and zero points: per output channel, computed from the original weight; per group, by
default (``act_order``: columns rounded in decreasing ``diag(H)`` order, llm-compressor's static
activation order) computed beforehand from the original weight for the contiguous groups ("static
groups"), so the stored format has no column permutation and no g_idx. With ``act_order=False`` the
columns go in order and a group's qparams come from the weight as updated when the sweep reaches its
first column (the reference behaviour), or from the original weight with ``static_groups``. Rounding is the project's fake-quant arithmetic
(``primitives.fake_quantize``), so the result lies exactly on the weight quantizer's grid.

The Hessian is accumulated from forward pre-hooks as a running sum ``X^T X`` (in_features^2
floats per layer, whatever the number of calibration tokens) and summed across ranks under DDP.

All of GPTQ is here: the column sweep (:func:`gptq_quantize`), one decoder layer's Linears
(:func:`gptq_layer`) and the one-shot ``compress.gptq`` (:func:`gptq`), which runs it layer by layer
(quantization/algorithms/sequential.py); the ``gptq`` recipe modifier calls the same layer function.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from compress.quantization.algorithms.sequential import (
    DEFAULT_SCHEME,
    Call,
    LayerHook,
    log_summary,
    sequential_quantize,
)
from compress.quantization.numerics.calibration import float_mode
from compress.quantization.numerics.modules import QuantLinear
from compress.quantization.numerics.primitives import (
    fake_quantize_grid,
    nvfp4_global_scale,
    spec_qparams,
    to_groups,
)
from compress.quantization.numerics.spec import QuantScheme, QuantSpec, resolve_scheme
from compress.quantization.preparation import share_global_scales
from pydantic import Field
from torch import nn

from compress.core.batching import CalibrationData, as_batches
from compress.core.errors import CalibrationError
from compress.core.params import Selection, refuse_renamed
from compress.core.progress import with_progress
from compress.core.sparsity import mask_of

log = logging.getLogger(__name__)


class GPTQParams(Selection):
    """GPTQ's settings: what ``compress.gptq`` takes and the ``gptq`` recipe modifier is made of.
    ``block_size`` columns per lazy-batch block, ``dampening`` (fraction of the mean Hessian
    diagonal added to it), ``act_order`` (round columns in decreasing Hessian-diagonal order, with
    static groups; the default), ``static_groups`` (without act_order: every group's scale from the
    original weight, not from the weight as updated when the sweep reaches it); the selection and
    ``num_batches`` as :class:`~compress.core.params.Selection`."""

    block_size: int = Field(128, ge=1)
    dampening: float = Field(0.01, gt=0, le=1)
    # on by default, as llm-compressor's static activation order: on SmolLM2-135M w4 g64 (64 windows)
    # GPTQ closed 61% of RTN's perplexity gap on held-out code against 38% with it off, and 38%
    # against 7% on prose (benchmarks/RESULTS.md `llm_quant_real`, `llm_gptq_variants`)
    act_order: bool = True
    static_groups: bool = False


class HessianAccumulator:
    """Running ``X^T X`` and token count of one Linear's inputs, fed by a forward pre-hook."""

    def __init__(self, in_features: int, device: torch.device | str = "cpu") -> None:
        self.xtx = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self.count = 0

    def add(self, x: torch.Tensor) -> None:
        rows = x.detach().reshape(-1, x.shape[-1]).to(self.xtx.device, torch.float32)
        self.xtx.addmm_(rows.t(), rows)
        self.count += rows.shape[0]

    def hook(self, _: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        self.add(args[0])

    def all_reduce(self) -> None:
        """Sum ``X^T X`` and the count over the DDP ranks (no-op outside a process group)."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(self.xtx)
            n = torch.tensor([self.count], dtype=torch.float64, device=self.xtx.device)
            dist.all_reduce(n)
            self.count = int(n.item())

    def hessian(self, *, inplace: bool = False) -> torch.Tensor:
        """``2 X^T X / n`` (the Hessian of the layer's squared output error); ``inplace`` scales the
        running sum itself (no copy: the accumulator is spent)."""
        if self.count == 0:
            raise CalibrationError("gptq: a layer saw no calibration inputs (was it called in the forward loop?)")
        return self.xtx.mul_(2.0 / self.count) if inplace else self.xtx * (2.0 / self.count)


def _qparams(w: torch.Tensor, spec: QuantSpec, global_scale: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row min-max qparams of ``w`` ([C, n] -> scale, zero_point of shape [C]); NVFP4 rows
    under the whole weight's ``global_scale``."""
    return spec_qparams(w.amin(dim=1), w.amax(dim=1), spec, global_scale=global_scale)


def inverse_cholesky(h: torch.Tensor, dampening: float) -> torch.Tensor:
    """Upper Cholesky factor of ``(H + damp I)^-1``, dampening raised on failure. ``h`` is
    dampened in place (at most three K x K matrices live at once: ``h``, the factor, the inverse)."""
    mean_diag = float(torch.mean(torch.diag(h)))
    added = 0.0
    damp = dampening
    for _ in range(4):
        h.diagonal().add_(damp * mean_diag - added)
        added = damp * mean_diag
        try:
            inv = torch.cholesky_inverse(torch.linalg.cholesky(h))
            return torch.linalg.cholesky(inv, upper=True)
        except torch.linalg.LinAlgError:
            log.warning("gptq: Hessian not positive definite at dampening %.3g; raising it", damp)
            damp *= 10
    raise CalibrationError("gptq: the Hessian is not positive definite even with strong dampening")


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    spec: QuantSpec,
    params: GPTQParams | None = None,
    *,
    mask: torch.Tensor | None = None,
    continuous: bool = False,
    global_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ-round ``weight`` ([out, in]) for ``spec`` (granularity channel or group, axis 0).

    ``mask`` (bool, True: kept; a sparse weight's): the pruned weights stay exactly zero: no rounding
    error is propagated into them (the update is masked, as llm-compressor's ``preserve_zeros``) and
    they round to zero, so every N:M group keeps its zeros.

    ``continuous``: return the error-compensated weight as each column was when the sweep rounded it
    (its round-to-nearest on the returned qparams is the GPTQ result; AutoRound starts there)
    instead of the de-quantized weight.

    ``global_scale``: NVFP4's per-tensor global scale (default: the weight's own, ``448 * 6 / amax``;
    a group of Linears reading one tensor shares one).

    Returns ``(dequantized weight, scale, zero_point)`` with scale/zero_point laid out as the
    weight quantizer stores them: ``[out]`` per channel, ``[out, ceil(in / group_size)]`` per group.
    """
    p = params or GPTQParams()
    if spec.granularity not in ("channel", "group") or (spec.granularity == "channel" and spec.axis != 0):
        raise CalibrationError(f"gptq: weights need per-channel (axis 0) or group scales, not {spec.granularity}")
    w = weight.detach().to(torch.float32).clone()
    rows, cols = w.shape
    h = hessian.detach().to(torch.float32, copy=True)
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    keep = None if mask is None else mask.to(w.device, torch.bool)
    if keep is not None:
        w.masked_fill_(~keep, 0)
    gs = min(spec.group_size or cols, cols) if spec.granularity == "group" else cols
    n_groups = math.ceil(cols / gs)
    scale = torch.empty(rows, n_groups)
    zp = torch.empty(rows, n_groups, dtype=torch.int32)
    # fp4 block scales always come from the original weight (NVFP4's global scale too), as llm-compressor's
    static = spec.granularity == "channel" or p.act_order or p.static_groups or spec.is_fp4
    g_scale = None
    if spec.is_fp4 and spec.scale_dtype == "fp8_e4m3":
        g_scale = global_scale.float().reshape(1) if global_scale is not None else nvfp4_global_scale(w.abs().amax())
    if static:
        # static: every group's qparams from the original weight, before any update
        s0, z0 = (_qparams(to_groups(w, gs).reshape(-1, gs), spec, g_scale) if spec.granularity == "group"
                  else _qparams(w, spec))
        scale[:], zp[:] = s0.reshape(rows, -1), z0.reshape(rows, -1)
        if spec.granularity == "group" and cols % gs:  # a zero-padded last group: recompute on its real columns
            s1, z1 = _qparams(w[:, (n_groups - 1) * gs :], spec, g_scale)
            scale[:, -1], zp[:, -1] = s1, z1
    perm = torch.argsort(torch.diag(h), descending=True) if p.act_order else torch.arange(cols)
    if p.act_order:
        w, h = w[:, perm], h[perm][:, perm]
    kf = None if keep is None else keep[:, perm].to(w.dtype)  # 1 kept, 0 pruned, in sweep order
    hinv = inverse_cholesky(h, p.dampening)
    del h
    q = torch.zeros_like(w)
    cont = torch.zeros_like(w) if continuous else None
    dynamic_groups = not static
    for i1 in range(0, cols, p.block_size):
        i2 = min(i1 + p.block_size, cols)
        w1 = w[:, i1:i2].clone()
        q1 = torch.zeros_like(w1)
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = int(perm[i1 + i])
            g = col // gs
            if dynamic_groups and col % gs == 0:
                # the group's qparams from the weight as updated so far (this block's columns from w1)
                span = torch.cat([w1[:, i:], w[:, i2:]], dim=1)[:, : min(gs, cols - col)]
                scale[:, g], zp[:, g] = _qparams(span, spec)
            wc = w1[:, i]
            if cont is not None:
                cont[:, i1 + i] = wc
            qc = fake_quantize_grid(wc, scale[:, g], zp[:, g], spec)
            if kf is not None:
                qc = qc * kf[:, i1 + i]
            q1[:, i] = qc
            e = (wc - qc) / hinv1[i, i]
            upd = e.unsqueeze(1) @ hinv1[i, i:].unsqueeze(0)
            w1[:, i:] -= upd if kf is None else upd * kf[:, i1 + i : i2]
            err1[:, i] = e
        q[:, i1:i2] = q1
        upd = err1 @ hinv[i1:i2, i2:]
        w[:, i2:] -= upd if kf is None else upd * kf[:, i2:]
    if cont is not None:
        q = cont
    if p.act_order:
        q = q[:, torch.argsort(perm)]
    if spec.granularity == "channel":
        return q.to(weight.dtype), scale[:, 0].contiguous(), zp[:, 0].contiguous()
    return q.to(weight.dtype), scale, zp


def layer_error(weight: torch.Tensor, quantized: torch.Tensor, hessian: torch.Tensor) -> float:
    """The GPTQ objective ``tr((W - Q) H (W - Q)^T) / 2``: the summed squared output error per token."""
    d = (weight - quantized).float()
    return float(torch.einsum("ij,jk,ik->", d, hessian.float(), d)) / 2


def layer_hessians(layer: nn.Module, linears: Mapping[str, nn.Linear], calls: Sequence[Call]
                   ) -> Iterator[tuple[list[str], torch.Tensor]]:
    """``(names, H)`` for the Linears of ``layer`` over its recorded ``calls`` (float, summed across
    DDP ranks): Linears that read one tensor (q/k/v, gate/up) share one ``H = 2 X^T X / n``, one
    K x K sum and one GEMM. Each ``H`` is freed once the caller moves to the next (a generator)."""
    accs: list[HessianAccumulator] = []
    owner: dict[str, int] = {}
    fed: dict[int, tuple[torch.Tensor, int]] = {}  # id(input) -> (input kept alive, accumulator) per call

    def hook(name: str, m: nn.Linear) -> Any:
        iq = getattr(m, "input_quantizer", None)

        def fn(_: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            x = args[0]
            seen = fed.get(id(x))
            if name not in owner:
                if seen is None:
                    accs.append(HessianAccumulator(m.in_features, device=m.weight.device))
                owner[name] = seen[1] if seen is not None else len(accs) - 1
            k = owner[name]
            if seen is None or seen[1] != k:
                fed[id(x)] = (x, k)
                # SmoothQuant left 1/s before this Linear (its weight holds s): the weight sees x / s
                pre = iq.pre_quant_scale if iq is not None else None
                accs[k].add(x if pre is None else x * pre.to(x.dtype))

        return fn

    handles = [m.register_forward_pre_hook(hook(n, m)) for n, m in linears.items()]
    try:
        with torch.no_grad(), float_mode(layer):
            for args, kwargs in calls:
                layer(*args, **kwargs)
                fed.clear()
    finally:
        for handle in handles:
            handle.remove()
    for k, a in enumerate(accs):
        a.all_reduce()
        yield [n for n, o in owner.items() if o == k], a.hessian(inplace=True)
        accs[k] = HessianAccumulator(0)  # free the K x K sum now, not at the end of the layer


@torch.no_grad()
def gptq_layer(layer: nn.Module, linears: dict[str, QuantLinear], calls: Sequence[Call], params: GPTQParams) -> dict[str, Any]:
    """GPTQ on one layer's Linears in place, from Hessians of their float inputs over ``calls``
    (summed across DDP ranks). Returns the summed GPTQ objective before (RTN) and after. A Linear
    with a sparsity mask (SparseGPT, Wanda before) keeps its zeros."""
    rtn_err = gptq_err = 0.0
    for names, h in layer_hessians(layer, linears, calls):
        # NVFP4: the Linears reading one tensor share one global scale, from their original weights
        share_global_scales([linears[n] for n in names])
        for n in names:
            m = linears[n]
            wq = m.weight_quantizer
            if wq is None:
                continue
            rtn_err += layer_error(m.weight, wq(m.weight), h)
            q, scale, zp = gptq_quantize(m.weight, h, wq.spec, params, mask=mask_of(m), global_scale=wq.global_scale)
            gptq_err += layer_error(m.weight, q, h)
            m.weight.data.copy_(q)
            wq.set_qparams(scale, zp)
    return {"rtn_error": rtn_err, "gptq_error": gptq_err}


@with_progress
@refuse_renamed(max_batches="params=GPTQParams(num_batches=...)")
def gptq(
    model: nn.Module,
    data: CalibrationData,
    *,
    scheme: QuantScheme | str = DEFAULT_SCHEME,
    targets: Sequence[str] | None = None,
    ignore: Sequence[str] | None = None,
    params: GPTQParams | None = None,
    load: LayerHook | None = None,
    release: LayerHook | None = None,
    progress: bool = True,
) -> nn.Module:
    """GPTQ quantization of a decoder LLM's weights (in place), one layer at a time; returns it.

    ``data``: calibration batches (input_ids tensors, or dicts / ``(inputs, labels)`` as the data
    sources yield; a DataLoader of them) or a forward function ``fn(model)``, run once to record the
    model's inputs (the whole model runs then: pass batches when it only fits layer by layer). ``scheme``: a weight-only QuantScheme or preset (``w4_weight_only_g128``,
    ``w4_weight_only``, ``w3_weight_only_g128``, ``w8_weight_only``), or one with int8 activations:
    dynamic (``w8a8_dynamic``, ``W8A8``: each layer runs with them to feed the next), or static on a
    model that :func:`quantize` prepared and calibrated (SmoothQuant then GPTQ, as llm-compressor's W8A8). ``params``: GPTQParams
    (block size, dampening, act_order, ``num_batches``); ``targets`` / ``ignore``: module patterns
    (``ignore=["lm_head"]`` keeps a decoder's head float, as llm-compressor's recipes write it). ``load``/``release``: per-layer offloading callbacks.
    ``progress``: a line per decoder layer (and a bar on a terminal); False: silent.
    """
    p = (params or GPTQParams()).given("gptq", targets=targets, ignore=ignore)
    s = resolve_scheme(scheme)
    summary = sequential_quantize(
        model, as_batches(data, model, max_batches=p.num_batches), s,
        lambda i, layer, lin, calls: gptq_layer(layer, lin, calls, p), p,
        load=load, release=release, where="gptq", activations=True,
    )
    log_summary("gptq", summary)
    return model
