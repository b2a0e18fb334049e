"""AWQ (Lin et al., 2024): activation-aware weight quantization, one decoder layer at a time.

Linears that read the same tensor (q/k/v after the input norm, gate/up after the post-attention
norm) form a group; a group whose input comes from a module that can absorb a per-channel factor
(a norm's weight and bias, or a preceding Linear's output rows, e.g. v_proj -> o_proj without GQA,
up_proj -> down_proj through SwiGLU's product) gets per-input-channel scales ``s``: the weights
are multiplied by ``s`` and the producer divided by it, which leaves the float layer unchanged and
lets the salient input channels (large mean ``|x|``) keep more precision after rounding.

``s = mean|x|^alpha / mean|w_normalized|^(1-alpha)`` (``duo_scaling``, the default here as in
AutoAWQ and llm-compressor; off: ``mean|x|^alpha``, the paper's form), normalized to a geometric
mean of 1. On the reference Llama the duo form closed more of RTN's perplexity gap than the
activation-only one in all four schemes on one calibration set (benchmarks/RESULTS.md, llm_quant:
w4 per-channel 56% against 42%, w3 g128 36% against 31%); searching both forms' candidates did no
better than duo alone over 5 draws. Alpha is picked on a grid by the group's output error over
calibration tokens: the output of the innermost module holding the
group (q/k/v: the attention block, through RoPE and the softmax; gate/up: the MLP; down: itself),
rerun with ``Q(W s) / s`` in place of ``W``, against its float output (AutoAWQ's
``module2inspect``), with ``s = 1`` (plain rounding) always a candidate, so the search never does
worse than round-to-nearest on its objective. Then each Linear's weights are clipped per group to
the range (shrunk by up to ``max_shrink``) that minimizes its own output error (AutoAWQ's clip
search), and a clip is kept only where it also lowers the error at the group's inspected module:
AutoAWQ never clips q/k, since their error is read through a softmax; here they are clipped when
the attention output agrees (on the reference Llama it does: w3 g128 perplexity 41.93 -> 41.79).

The pieces: the folds and their proofs in quantization/algorithms/awq_folds.py, the scale and clip
searches (and ``AWQParams``, their knobs) in quantization/algorithms/awq_search.py; here, the layer
driver (:func:`awq_layer`: record, search, fold, clip, guard the clips) and :func:`awq`.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Sequence
from typing import Any

import torch
from compress.quantization.algorithms.awq_folds import (
    FoldGroup,
    find_fold_groups,
    first_sequence,
    fold_scales,
    primary_output,
)
from compress.quantization.algorithms.awq_search import (
    AWQParams,
    GroupError,
    LinearOutputError,
    ModuleOutputError,
    all_sum,
    clip_weight,
    common_scope,
    round_to_nearest,
    sample_chunks,
    sample_rows,
    search_clip,
    search_scales,
)
from compress.quantization.algorithms.sequential import (
    DEFAULT_SCHEME,
    Call,
    LayerHook,
    log_summary,
    sequential_quantize,
)
from compress.quantization.numerics.calibration import float_mode
from compress.quantization.numerics.modules import QuantLinear
from compress.quantization.numerics.spec import QuantScheme, resolve_scheme
from compress.quantization.preparation import calibrate_weight, share_global_scales
from torch import nn

from compress.core.batching import CalibrationData, as_batches
from compress.core.params import refuse_renamed
from compress.core.progress import with_progress

log = logging.getLogger(__name__)


def scale_error_ratio(summary: dict[str, Any]) -> float | None:
    """Median over the searched groups of ``error / unscaled_error`` in a sequential AWQ summary
    (layer reports of :func:`awq_layer`): 1.0 means the scales bought nothing on their objective,
    as on a model with few activation outliers; None when no group had a fold to search."""
    ratios = [g["error"] / g["unscaled_error"] for r in summary["layers"] for g in r.get("groups", [])
              if g.get("unscaled_error") and g["unscaled_error"] > 0]
    return float(torch.tensor(ratios).median()) if ratios else None


def _rounded(w: torch.Tensor, lin: QuantLinear, s: torch.Tensor | None) -> torch.Tensor:
    """The rounded weight in the layer's pre-fold space (the recorded calls' inputs are unscaled)."""
    wq = lin.weight_quantizer
    out = w.float() if wq is None else round_to_nearest(w.float(), wq.spec)
    return out if s is None else out / s


def _guard_clips(
    layer: nn.Module, groups: Sequence[FoldGroup], linears: dict[str, QuantLinear], clipped: dict[str, torch.Tensor],
    errors: dict[str, GroupError], scale_of: dict[str, torch.Tensor],
) -> set[str]:
    """The Linears whose clip raises the error at their group's inspected module (rounded weights,
    the group's other clips as decided so far; ``errors``: each inspected module's objective, by
    its name; ``scale_of``: the scales folded into the Linears): each Linear's local clip search
    cannot see what its error does downstream (q/k through a softmax)."""
    rejected: set[str] = set()
    for g in groups:
        names = [c for c in g.consumers if c in clipped]
        error = errors.get(common_scope(g.consumers))
        if not names or error is None:
            continue
        current = {c: clipped.get(c, linears[c].weight.detach()) for c in g.consumers}
        best = _group_error(error, current, linears, scale_of)
        for c in names:
            trial = {**current, c: linears[c].weight.detach()}
            e = _group_error(error, trial, linears, scale_of)
            if e < best:
                best, current = e, trial
                rejected.add(c)
    return rejected


def _group_error(error: GroupError, weights: dict[str, torch.Tensor], linears: dict[str, QuantLinear],
                 scale_of: dict[str, torch.Tensor]) -> torch.Tensor:
    """``error`` with the group's Linears holding ``weights`` (by name, group order), rounded."""
    out = error([_rounded(w, linears[c], scale_of.get(c)) for c, w in weights.items()])
    all_sum(out)  # every rank keeps the same clips
    return out


def _clips(name: str, lin: QuantLinear, params: AWQParams) -> bool:
    """Whether the clip search runs on this Linear."""
    return params.clip and lin.weight_quantizer is not None and not any(
        fnmatch.fnmatchcase(name, p) for p in params.clip_ignore)


@torch.no_grad()
def awq_layer(
    layer: nn.Module, linears: dict[str, QuantLinear], calls: Sequence[Call], params: AWQParams, *, seed: int = 0
) -> dict[str, Any]:
    """AWQ on one decoder layer in place: scale search and fold per foldable group, then clipping.
    ``linears`` are the layer's weight-quantized Linears by name inside ``layer``; ``calls`` are the
    layer's calibration calls ``(args, kwargs)``. Weight quantizers are recalibrated at the end."""
    names = list(linears)
    groups = find_fold_groups(layer, names, first_sequence(calls[0]))
    inputs: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    handles = [
        linears[n].register_forward_pre_hook(lambda m, a, n=n: inputs[n].append(a[0].detach().reshape(-1, a[0].shape[-1])))
        for n in names
    ]
    # the group's output is the output of the innermost module holding all its Linears (q/k/v:
    # the attention; gate/up: the MLP; down: itself), recorded on whole calls up to sample_tokens;
    # a lone Linear's (o_proj, down_proj) is read from its inputs' Gram matrix instead
    scopes = {common_scope(g.consumers) for g in groups if g.producer is not None or params.clip} - set(names)
    recorded: dict[str, list[tuple[Any, Any, torch.Tensor]]] = {sc: [] for sc in scopes}
    tokens = dict.fromkeys(scopes, 0)

    def record(scope: str) -> Any:
        def hook(m: nn.Module, args: Any, kwargs: Any, out: Any) -> None:
            y = primary_output(out)
            if tokens[scope] < params.sample_tokens and isinstance(y, torch.Tensor):
                recorded[scope].append((args, kwargs, y.detach().float()))
                tokens[scope] += y.numel() // max(y.shape[-1], 1)

        return hook

    handles += [layer.get_submodule(sc).register_forward_hook(record(sc), with_kwargs=True) for sc in scopes]
    try:
        with float_mode(layer):
            for args, kwargs in calls:
                layer(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    x_of: dict[str, torch.Tensor] = {}
    shared: dict[tuple[Any, ...], torch.Tensor] = {}  # q/k/v (gate/up) read one tensor: one sampled copy
    for n, v in inputs.items():
        if v:
            key = tuple((t.data_ptr(), t.dtype, tuple(t.shape), t.stride()) for t in v)
            if key not in shared:
                shared[key] = sample_chunks(v, params.sample_tokens, seed)
            x_of[n] = shared[key]
    errors: dict[str, GroupError] = {
        sc: ModuleOutputError(layer.get_submodule(sc), [linears[c] for c in g.consumers], recorded[sc])
        for g in groups if (sc := common_scope(g.consumers)) in scopes and recorded[sc]
    }
    for g in groups:
        n = g.consumers[0]
        if len(g.consumers) == 1 and n in x_of and (g.producer is not None or params.clip):
            x = x_of[n]  # the sampled rows: the product over every token cost as much as the search
            errors[n] = LinearOutputError(linears[n].weight, x.t() @ x, x.shape[0])
    report: dict[str, Any] = {"groups": [], "clipped": 0}
    scale_of: dict[str, torch.Tensor] = {}
    for g in groups:
        spec = linears[g.consumers[0]].weight_quantizer
        if g.producer is None or spec is None or g.consumers[0] not in x_of:
            report["groups"].append({"consumers": g.consumers, "producer": None, "alpha": None})
            continue
        x = x_of[g.consumers[0]]
        scope = common_scope(g.consumers)
        error = errors.get(scope)
        pick = search_scales(x, [linears[c].weight for c in g.consumers], spec.spec, params,
                             output_error=error, index=g.index,
                             clip_rows=sample_rows(x, params.clip_tokens, seed + 1),
                             clipped=[_clips(c, linears[c], params) for c in g.consumers])
        if pick.alpha >= 0:
            fold_scales(layer, g.producer, g.consumers, pick.scales, g.index, offset=g.offset)
            for c in g.consumers:
                scale_of[c] = pick.scales
        report["groups"].append({"consumers": g.consumers, "producer": g.producer, "alpha": pick.alpha,
                                 "error": pick.error, "unscaled_error": pick.unscaled_error,
                                 "inspected": scope or "<layer>"})
    if params.clip:
        clipped: dict[str, torch.Tensor] = {}
        for n, lin in linears.items():
            wq = lin.weight_quantizer
            if wq is None or n not in x_of or not _clips(n, lin, params):
                continue
            x = sample_rows(x_of[n], params.clip_tokens, seed + 1)
            if n in scale_of:
                x = x / scale_of[n]
            clipped[n] = clip_weight(lin.weight.detach(), search_clip(x, lin.weight, wq.spec, params), wq.spec)
        rejected = _guard_clips(layer, groups, linears, clipped, errors, scale_of)
        for n, w in clipped.items():
            if n not in rejected:
                linears[n].weight.data.copy_(w)
        report["clipped"] = len(clipped) - len(rejected)
        report["clip_rejected"] = sorted(rejected)
    for lin in linears.values():
        calibrate_weight(lin)
    for g in groups:  # NVFP4: Linears that read one tensor share one global scale (vLLM's fused GEMMs)
        share_global_scales([linears[c] for c in g.consumers])
    return report


@with_progress
@refuse_renamed(max_batches="params=AWQParams(num_batches=...)")
def awq(
    model: nn.Module,
    data: CalibrationData,
    *,
    scheme: QuantScheme | str = DEFAULT_SCHEME,
    targets: Sequence[str] | None = None,
    ignore: Sequence[str] | None = None,
    params: AWQParams | None = None,
    load: LayerHook | None = None,
    release: LayerHook | None = None,
    progress: bool = True,
) -> nn.Module:
    """AWQ weight-only quantization of a decoder LLM (in place), one layer at a time; returns it.

    Scales are folded into the preceding norm or Linear wherever the layer proves the fold exact;
    weights are clipped per group; the weight quantizers then hold round-to-nearest qparams of the
    scaled, clipped weights (run :func:`gptq` afterwards for GPTQ rounding instead). ``params``:
    AWQParams; ``targets`` / ``ignore`` as for :func:`gptq` (``ignore=["lm_head"]`` keeps the head float).
    ``progress``: a line per decoder layer (and a bar on a terminal); False: silent.
    """
    p = (params or AWQParams()).given("awq", targets=targets, ignore=ignore)
    s = resolve_scheme(scheme)
    summary = sequential_quantize(
        model, as_batches(data, model, max_batches=p.num_batches), s,
        lambda i, layer, lin, calls: awq_layer(layer, lin, calls, p, seed=i), p,
        load=load, release=release, where="awq",
    )
    log_summary("awq", summary)
    ratio = scale_error_ratio(summary)
    if ratio is not None:
        log.info("awq: with the scales the groups' module-output error is %.3f of theirs with s = 1 (median)", ratio)
    return model
