"""SparseGPT (Frantar & Alistarh, 2023): prune a Linear's weights and compensate each pruned weight
in the columns not yet visited, through the inverse Hessian of the layer's input, as GPTQ does for
rounding (compress.quantization.algorithms.gptq: the Hessian ``H = 2 X^T X / n``, its accumulation,
sharing and dampening are GPTQ's, imported).

The sweep is the paper's: columns in blocks of ``block_size``; at a block's start the mask of its
columns is chosen by the OBS score ``w^2 / [U]_jj^2`` (``U``: the upper Cholesky factor of
``H^-1``, whose squared diagonal is each column's conditional inverse-Hessian entry): unstructured,
the lowest ``sparsity`` of the block's scores (all its rows together, as the paper's code); N:M, at
every M-th column, the M - N lowest of each row's next M columns, scored on the weight as updated so
far. Inside the block each column is masked (and, given a weight spec, quantized: sparse then
quantized in one sweep, as the paper does), its error scaled by ``U`` subtracted from the rest of the
block; the block's error then updates all later columns at once.

With a diagonal Hessian ``U`` is diagonal: nothing is updated, and with ``H = c I`` the mask is
magnitude pruning's.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from compress.pruning.sparse.params import SparsityParams, sparse_targets
from compress.quantization.algorithms.gptq import inverse_cholesky, layer_error, layer_hessians
from compress.quantization.algorithms.sequential import Call, LayerHook, sequential_quantize
from compress.quantization.numerics.primitives import fake_quantize, qparams_from_range
from compress.quantization.numerics.spec import QuantScheme, QuantSpec, resolve_scheme
from compress.quantization.preparation import linearize
from pydantic import Field, model_validator
from torch import nn

from compress.core.batching import CalibrationData, as_batches
from compress.core.errors import CalibrationError
from compress.core.progress import with_progress
from compress.core.sparsity import set_mask

log = logging.getLogger(__name__)


class SparseGPTParams(SparsityParams):
    """SparseGPT's settings: what ``compress.sparsegpt`` takes and the ``sparsegpt`` recipe modifier
    is made of. ``sparsity`` and ``pattern`` as :class:`~compress.pruning.sparse.params.SparsityParams`;
    ``block_size`` columns per block (the unstructured mask is chosen per block; a multiple of M for
    N:M), ``dampening`` (fraction of the mean Hessian diagonal added to it, as GPTQ's)."""

    block_size: int = Field(128, ge=1)
    dampening: float = Field(0.01, gt=0, le=1)

    @model_validator(mode="after")
    def _blocks_hold_groups(self) -> SparseGPTParams:
        nm = self.nm
        if nm is not None and self.block_size % nm[1]:
            raise ValueError(f"block_size {self.block_size} must be a multiple of the pattern's M ({nm[1]})")
        return self


def _static_qparams(w: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per-channel or per-group qparams of ``w`` ([rows, groups] each) and the group width."""
    if spec.granularity not in ("channel", "group") or (spec.granularity == "channel" and spec.axis != 0):
        raise CalibrationError(f"sparsegpt: weights need per-channel (axis 0) or group scales, not {spec.granularity}")
    rows, cols = w.shape
    gs = min(spec.group_size or cols, cols) if spec.granularity == "group" else cols
    n_groups = math.ceil(cols / gs)
    scale = torch.empty(rows, n_groups)
    zp = torch.empty(rows, n_groups, dtype=torch.int32)
    for g in range(n_groups):
        span = w[:, g * gs : (g + 1) * gs]
        s, z = qparams_from_range(span.amin(dim=1), span.amax(dim=1), qmin=spec.qmin, qmax=spec.qmax,
                                  symmetric=spec.symmetric)
        scale[:, g], zp[:, g] = s, z
    return scale, zp, gs


def sparsegpt_prune(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    params: SparseGPTParams | None = None,
    *,
    spec: QuantSpec | None = None,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """SparseGPT on ``weight`` ([out, in]) with input Hessian ``hessian``.

    Returns ``(new weight, keep mask, qparams)``: the pruned (and compensated) weight, exactly zero
    where ``keep`` is False; with ``spec`` (a weight quantizer's), the kept weights are quantized in
    the same sweep, and ``qparams`` is ``(scale, zero_point)`` laid out as the weight quantizer
    stores them (``[out]`` per channel, ``[out, groups]`` per group), from the dense weight."""
    p = params or SparseGPTParams()
    w = weight.detach().to(torch.float32).clone()
    rows, cols = w.shape
    nm = p.nm
    if nm is not None and cols % nm[1]:
        raise CalibrationError(f"sparsegpt: pattern {p.pattern} needs an input width divisible by {nm[1]}, not {cols}")
    h = hessian.detach().to(torch.float32, copy=True)
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    qp = _static_qparams(w, spec) if spec is not None else None
    hinv = inverse_cholesky(h, p.dampening)
    del h
    out = torch.zeros_like(w)
    keep = torch.ones(rows, cols, dtype=torch.bool)
    for i1 in range(0, cols, p.block_size):
        i2 = min(i1 + p.block_size, cols)
        w1 = w[:, i1:i2].clone()
        q1 = torch.zeros_like(w1)
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        d = torch.diag(hinv1)
        pruned = torch.zeros_like(w1, dtype=torch.bool)
        if nm is None:
            score = w1.pow(2) / d.pow(2).unsqueeze(0)
            k = int(score.numel() * p.sparsity)
            if k:
                pruned.view(-1)[torch.topk(score.flatten(), k, largest=False).indices] = True
        for i in range(i2 - i1):
            if nm is not None and i % nm[1] == 0:
                score = w1[:, i : i + nm[1]].pow(2) / d[i : i + nm[1]].pow(2).unsqueeze(0)
                idx = torch.topk(score, nm[1] - nm[0], dim=1, largest=False).indices
                pruned[:, i : i + nm[1]] = torch.zeros_like(score, dtype=torch.bool).scatter_(1, idx, True)
            wc = w1[:, i]
            qc = wc.masked_fill(pruned[:, i], 0)
            if qp is not None and spec is not None:
                g = (i1 + i) // qp[2]
                qc = fake_quantize(qc, qp[0][:, g], qp[1][:, g], spec.qmin, spec.qmax).masked_fill(pruned[:, i], 0)
            q1[:, i] = qc
            e = (wc - qc) / d[i]
            w1[:, i:] -= e.unsqueeze(1) @ hinv1[i, i:].unsqueeze(0)
            err1[:, i] = e
        out[:, i1:i2] = q1
        keep[:, i1:i2] = ~pruned
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    qparams = None
    if qp is not None and spec is not None:
        qparams = (qp[0][:, 0].contiguous(), qp[1][:, 0].contiguous()) if spec.granularity == "channel" else (qp[0], qp[1])
    return out.to(weight.dtype), keep, qparams


@torch.no_grad()
def sparsegpt_layer(layer: nn.Module, linears: Mapping[str, nn.Linear], calls: Sequence[Call],
                    params: SparseGPTParams) -> dict[str, Any]:
    """SparseGPT on one decoder layer's Linears in place (each left with its mask), from the
    Hessians of their inputs over ``calls``; a Linear with a weight quantizer (a scheme was given) is
    quantized in the same sweep. Returns the summed ``tr(dW H dW^T)/2`` of the changes."""
    err = 0.0
    for names, h in layer_hessians(layer, linears, calls):
        for n in names:
            m = linears[n]
            wq = getattr(m, "weight_quantizer", None)
            new, keep, qparams = sparsegpt_prune(m.weight, h, params, spec=wq.spec if wq is not None else None)
            err += layer_error(m.weight, new, h)
            m.weight.data.copy_(new)
            set_mask(m, keep)
            if wq is not None and qparams is not None:
                wq.set_qparams(*qparams)
    return {"sparse_error": err}


@with_progress
def sparsegpt(
    model: nn.Module,
    data: CalibrationData,
    *,
    sparsity: float | None = None,
    pattern: str | None = None,
    targets: Sequence[str] | None = None,
    ignore: Sequence[str] | None = None,
    scheme: QuantScheme | str | None = None,
    params: SparseGPTParams | None = None,
    load: LayerHook | None = None,
    release: LayerHook | None = None,
    progress: bool = True,
) -> nn.Module:
    """SparseGPT pruning of a decoder LLM's Linears (in place), one decoder layer at a time; returns it.

    ``data``: calibration batches or a forward function, as :func:`compress.gptq` takes them.
    ``sparsity`` (fraction of each Linear's weights zeroed) and ``pattern`` (``unstructured``,
    ``2:4``, ``4:8``, ...), ``targets``/``ignore`` (among the decoder layers' Linears): settings of
    ``params`` (:class:`SparseGPTParams`: block size, dampening, ``num_batches``). ``scheme``: a
    weight-only scheme quantizes the kept weights in the same sweep (as the paper's joint mode;
    Linears it targets outside the decoder layers get round-to-nearest, as in ``compress.gptq``).
    Every pruned Linear keeps a mask (compress.core.sparsity) that later GPTQ and fine-tuning keep.
    ``load``/``release``: per-layer offloading callbacks; ``progress``: a line per decoder layer.
    """
    p = (params or SparseGPTParams()).given("sparsegpt", sparsity=sparsity, pattern=pattern, targets=targets,
                                            ignore=ignore)
    linearize(model)
    names = sparse_targets(model, p, where="sparsegpt", quantizing=scheme is not None)
    batches = as_batches(data, model, max_batches=p.num_batches)
    if scheme is None:
        summary = sequential_quantize(model, batches, None, lambda i, layer, lin, calls: sparsegpt_layer(layer, lin, calls, p),
                                      p, load=load, release=release, where="sparsegpt", plain_linears=names)
    else:  # the scheme's plan swaps the same decoder Linears for QuantLinear; each is pruned and quantized
        summary = sequential_quantize(model, batches, resolve_scheme(scheme),
                                      lambda i, layer, lin, calls: sparsegpt_layer(layer, lin, calls, p), p,
                                      load=load, release=release, where="sparsegpt")
    log.info("sparsegpt: %d Linears pruned to %s in %.1f s", summary["quantized_linears"],
             p.pattern if p.nm else f"{p.sparsity:.0%}", summary["seconds"])
    return model
