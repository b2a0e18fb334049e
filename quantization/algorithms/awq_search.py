"""AWQ's two searches and what they judge candidates by (quantization/algorithms/awq.py runs them per
layer): the per-input-channel scale search over ``alpha`` (:func:`search_scales`), the per-group
clip search (:func:`search_clip`), the objectives a group's candidates are scored on (its module
rerun on recorded calls, or a lone Linear's output error from its Gram matrix), the calibration
row sampling both searches read, and ``AWQParams``, the knobs of both."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from compress.quantization.algorithms.awq_folds import primary_output
from compress.quantization.numerics.calibration import float_mode
from compress.quantization.numerics.modules import QuantLinear
from compress.quantization.numerics.primitives import (
    dynamic_qparams,
    fake_quantize_grid,
    fake_quantize_spec,
    group_size_for,
    nvfp4_global_scale,
    spec_qparams,
    to_groups,
)
from compress.quantization.numerics.spec import QuantSpec
from pydantic import Field
from torch import nn

from compress.core.params import Selection


class AWQParams(Selection):
    """AWQ's settings, what ``compress.awq`` takes and the ``awq`` recipe modifier is made of: ``grid`` alphas in [0, 1) for the scale search, ``duo_scaling`` (weight term in
    the scales, as AutoAWQ; off: activations alone, as the paper), ``clip`` search with ``clip_grid`` steps down to ``1 - max_shrink`` of the range,
    skipping Linears matching ``clip_ignore`` (each clip is kept only where it lowers the error at
    its group's inspected module); ``sample_tokens`` / ``clip_tokens`` calibration rows
    sampled for the two searches (bounded cost and memory; fewer make both searches fit noise: at
    2048 / 512, AutoAWQ's clip sample, the reference Llama's w4 per-channel figure fell from 58% to
    45% of RTN's gap over 5 calibration draws); ``clip_in_search``: each scale candidate
    is judged with its weights clipped as the clip search will clip them, so the scales are chosen
    for the rounding they will get (off: judged on rounding alone, as AutoAWQ);
    ``module_candidates``: where a group is judged by rerunning its module (attention, MLP), the
    candidates are first ranked by their Linears' own output error and only s = 1 and the best
    ``module_candidates - 1`` are rerun (0: all ``grid`` of them)."""

    grid: int = Field(20, ge=1)
    duo_scaling: bool = True
    clip: bool = True
    clip_grid: int = Field(20, ge=1)
    max_shrink: float = Field(0.5, ge=0, lt=1)
    clip_ignore: list[str] = Field(default_factory=list)
    sample_tokens: int = Field(16384, ge=16)
    clip_tokens: int = Field(2048, ge=16)
    clip_in_search: bool = True
    module_candidates: int = Field(6, ge=0)


def round_to_nearest(w: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    scale, zp = dynamic_qparams(w, spec)
    return fake_quantize_spec(w, scale, zp, spec)


def _group_width(w: torch.Tensor, spec: QuantSpec) -> int:
    """Input features per scale of weight ``w``: the group size, or the whole row when not grouped."""
    return group_size_for(w, spec) if spec.granularity == "group" else w.shape[1]


def _weight_importance(w: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Mean over rows of |w| normalized by its group's max (AutoAWQ's ``w_mean``), per input channel."""
    g = to_groups(w.abs(), _group_width(w, spec))
    g = g / g.amax(dim=-1, keepdim=True).clamp_min(1e-12)
    return g.reshape(w.shape[0], -1)[:, : w.shape[1]].mean(0)



def _tie(s: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """``s`` made equal over the channels that carry one producer channel (their geometric mean)."""
    if index is None:
        return s
    n = int(index.max()) + 1
    logs = torch.zeros(n).index_add_(0, index, s.log()) / torch.zeros(n).index_add_(0, index, torch.ones_like(s))
    return logs.exp()[index]


class ScaleChoice(NamedTuple):
    """What :func:`search_scales` picked: ``scales``, ``alpha`` (-1: ``s = 1``, plain rounding, was
    best), ``error`` with them and ``unscaled_error`` with ``s = 1``, both per output element and
    judged alike (clipped when ``clip_in_search``): their ratio is what the scales bought."""

    scales: torch.Tensor
    alpha: float
    error: float
    unscaled_error: float


def search_scales(
    x: torch.Tensor, weights: Sequence[torch.Tensor], spec: QuantSpec, params: AWQParams,
    *, output_error: GroupError | None = None, index: torch.Tensor | None = None,
    clip_rows: torch.Tensor | None = None, clipped: Sequence[bool] | None = None,
) -> ScaleChoice:
    """Best per-input-channel scales for Linears with weights ``weights`` reading rows ``x``.
    ``output_error``: the objective, the group's module rerun on recorded calls or a lone Linear's
    output error from its Gram matrix (see :func:`awq_layer`); default: the Linears' own outputs on ``x``. The error is per output element.
    ``index``: the group's channel map (:class:`FoldGroup`); channels sharing a producer channel get one scale.
    With ``params.clip_in_search`` the weights flagged in ``clipped`` (default: all) are clip-searched
    on ``clip_rows`` (default: sampled from ``x``) for every candidate before rounding."""
    ws = [wi.detach().float() for wi in weights]
    w = torch.cat(ws, dim=0)
    x = x.float()
    rows = [wi.shape[0] for wi in ws]
    error: Callable[[Sequence[torch.Tensor]], torch.Tensor]
    if output_error is None:
        ref = x @ w.t()

        def error(cand: Sequence[torch.Tensor]) -> torch.Tensor:
            return ((x @ torch.cat(list(cand), dim=0).t() - ref) ** 2).sum()

        n_out = float(ref.numel())
    else:
        error, n_out = output_error, float(output_error.numel)
    x_sum, x_rows = x.abs().sum(0), torch.tensor([float(x.shape[0])])
    all_sum(x_sum, x_rows)  # under DDP the candidates come from all ranks' tokens, so every rank has the same ones
    x_mean = (x_sum / x_rows).clamp_min(1e-8)
    w_mean = _weight_importance(w, spec).clamp_min(1e-8)
    cands: list[tuple[float, torch.Tensor]] = [(-1.0, torch.ones_like(x_mean))]
    for i in range(0 if params.duo_scaling else 1, params.grid):  # mean|x|^0 is s = 1, already a candidate
        alpha = i / params.grid
        s = x_mean.pow(alpha) / w_mean.pow(1 - alpha) if params.duo_scaling else x_mean.pow(alpha)
        s = _tie(s.clamp_min(1e-4), index)
        cands.append((alpha, s / (s.max() * s.min()).sqrt()))
    flags = list(clipped) if clipped is not None else [True] * len(ws)
    clip_now = params.clip and params.clip_in_search and any(flags)
    xs = (clip_rows if clip_rows is not None else sample_rows(x, params.clip_tokens, 1)).float() if clip_now else x

    # the clip search's per-group Gram matrices of the rows, once: a candidate's rows are x / s,
    # whose Gram is this one divided by s_k s_l, not a new product over every row per candidate
    gs = _group_width(w, spec)
    gram0 = _clip_gram(xs, gs) if clip_now else None

    def prepared(s: torch.Tensor) -> torch.Tensor:
        """The scaled weights as the later clip phase will leave them (clipping changes which
        scales round best: judged without it, the winner is often not the best once clipped)."""
        gram = None
        if gram0 is not None:
            inv = to_groups((1.0 / s)[None], gs)[0]  # [G, gs]
            gram = gram0 * inv[:, :, None] * inv[:, None, :]
        parts = []
        for wi, flag in zip(ws, flags, strict=True):
            ws_ = wi * s
            parts.append(clip_weight(ws_, search_clip(xs / s, ws_, spec, params, gram=gram), spec)
                         if clip_now and flag else ws_)
        return torch.cat(parts, dim=0)

    rounded = [round_to_nearest(prepared(s), spec) / s for _, s in cands]
    judged = list(range(len(cands)))
    if isinstance(output_error, ModuleOutputError) and 0 < params.module_candidates < len(cands):
        # rerunning the module (attention, MLP) per candidate is most of AWQ's time: the candidates
        # are screened by the Linears' own output error on x (read from x^T x, one product), and
        # only s = 1 and the best of the screen are rerun
        h = x.t() @ x
        screen = torch.stack([(((q - w) @ h) * (q - w)).sum() for q in rounded])
        all_sum(screen)  # every DDP rank reruns the same candidates
        judged = [0, *sorted((torch.argsort(screen[1:]) + 1).tolist()[: params.module_candidates - 1])]
    errs = torch.full((len(cands),), float("inf"))
    for i in judged:
        errs[i] = error(list(rounded[i].split(rows, dim=0))).float().reshape(())
    n = torch.tensor([n_out])
    all_sum(errs, n)  # under DDP every rank picks the same scales, on all ranks' tokens
    k = int(torch.argmin(errs))
    return ScaleChoice(cands[k][1], cands[k][0], float(errs[k] / n), float(errs[0] / n))


def common_scope(names: Sequence[str]) -> str:
    """The innermost module containing every one of ``names`` ("" is the layer itself)."""
    parts = [n.split(".") for n in names]
    common: list[str] = []
    for level in zip(*parts, strict=False):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


class ModuleOutputError:
    """A group's objective on a module's recorded calls: reruns it (quantizers off) with the group's
    Linears holding candidate weights and sums the squared difference to its float outputs."""

    def __init__(self, module: nn.Module, linears: Sequence[QuantLinear], calls: list[tuple[Any, Any, torch.Tensor]]):
        self.module, self.linears, self.calls = module, linears, calls
        self.numel = sum(ref.numel() for _, _, ref in calls)

    def __call__(self, weights: Sequence[torch.Tensor]) -> torch.Tensor:
        saved = [lin.weight.data for lin in self.linears]
        total = torch.zeros(())
        try:
            for lin, w in zip(self.linears, weights, strict=True):
                lin.weight.data = w.to(saved[0].dtype)
            with float_mode(self.module):
                for a, k, ref in self.calls:
                    total += ((primary_output(self.module(*a, **k)).float() - ref) ** 2).sum()
        finally:
            for lin, w in zip(self.linears, saved, strict=True):
                lin.weight.data = w
        return total


class LinearOutputError:
    """A group's objective when its inspected module is one Linear (o_proj, down_proj): the summed
    squared change of its output over the calibration rows, ``tr(dW H dW^T)`` with ``dW`` the
    candidate minus the reference weight and ``H = X^T X`` of its input rows, one product. The
    same figure as :class:`ModuleOutputError` rerunning the Linear (the bias cancels), without a
    pass over the rows per candidate: ``out x in^2`` per candidate instead of ``rows x out x in``
    (down_proj of SmolLM2 on 16384 rows: about 10x less)."""

    def __init__(self, reference: torch.Tensor, gram: torch.Tensor, tokens: int):
        self.reference, self.gram = reference.detach().float(), gram
        self.numel = tokens * reference.shape[0]

    def __call__(self, weights: Sequence[torch.Tensor]) -> torch.Tensor:
        (w,) = weights
        d = w.float() - self.reference
        return ((d @ self.gram) * d).sum()


GroupError = ModuleOutputError | LinearOutputError


def all_sum(*tensors: torch.Tensor) -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        for t in tensors:
            dist.all_reduce(t)


def _clip_gram(x: torch.Tensor, gs: int) -> torch.Tensor | None:
    """Per-group Gram matrices ``[G, gs, gs]`` of rows ``x`` when :func:`search_clip` reads the error
    from them, else None. The Gram matrix pays when groups are narrower than the rows (a few
    calibration tokens and wide per-channel rows favour the products); decided on the ranks' mean
    rows so every DDP rank takes the same path."""
    xt = to_groups(x.float(), gs)  # [n, G, gs]
    rows_ranks = torch.tensor([float(xt.shape[0]), 1.0])
    all_sum(rows_ranks)
    if gs > float(rows_ranks[0] / rows_ranks[1]):
        return None
    return torch.einsum("ngk,ngl->gkl", xt, xt)


@torch.no_grad()
def search_clip(x: torch.Tensor, weight: torch.Tensor, spec: QuantSpec, params: AWQParams,
                *, gram: torch.Tensor | None = None) -> torch.Tensor:
    """Per (output channel, group) clipping bound of ``weight`` minimizing each group's output error on
    rows ``x``; returns the bound ``[out, G]`` (the unclipped max where clipping does not help).

    A group's error over the rows is ``d^T (X_g^T X_g) d`` for its weight change ``d``, so with
    groups narrower than the rows it is read from each group's Gram matrix, built once, instead of
    from every row's product for every shrink step: the same bounds for about n / group size less
    arithmetic (AWQ's scale search runs this once per scale candidate). ``gram``: those matrices
    already computed for ``x`` (:func:`_clip_gram`), as the scale search derives them per candidate."""
    w = weight.detach().float()
    gs = _group_width(w, spec)
    xt = to_groups(x.float(), gs)  # [n, G, gs]
    shrink = torch.tensor([1 - i / params.clip_grid for i in range(max(int(params.max_shrink * params.clip_grid), 1))])
    # the products' chunks are sized by clip_tokens (the rows callers sample up to), not this
    # rank's rows, so the DDP ranks all-reduce alike chunks
    h = gram if gram is not None else _clip_gram(x, gs)
    if h is not None:
        step = max(1, (64 * 1024 * 1024) // max(4 * 4 * xt.shape[1] * gs, 1))  # four [b, G, gs] temporaries
    else:
        rows = max(xt.shape[0], params.clip_tokens)
        step = max(1, (64 * 1024 * 1024) // max(4 * rows * xt.shape[1] * gs, 1))  # the [b, n, G] products
    # NVFP4: every candidate under the whole weight's global scale
    g_scale = nvfp4_global_scale(w.abs().amax()) if spec.is_fp4 and spec.scale_dtype == "fp8_e4m3" else None
    bounds = []
    for o in range(0, w.shape[0], step):
        wg = to_groups(w[o : o + step], gs)  # [b, G, gs]
        ref = None if h is not None else torch.einsum("ngk,bgk->bng", xt, wg)
        amax = wg.abs().amax(dim=-1)  # [b, G]
        errs = []
        for f in shrink.tolist():
            mv = amax * f
            cw = torch.maximum(torch.minimum(wg, mv.unsqueeze(-1)), -mv.unsqueeze(-1))
            sc, zp = spec_qparams(cw.amin(-1), cw.amax(-1), spec, global_scale=g_scale)
            qw = fake_quantize_grid(cw, sc.unsqueeze(-1), zp.unsqueeze(-1), spec)
            if ref is None:
                d = qw - wg
                errs.append((torch.einsum("bgk,gkl->bgl", d, h) * d).sum(dim=-1))
            else:
                errs.append(((torch.einsum("ngk,bgk->bng", xt, qw) - ref) ** 2).sum(dim=1))
        err = torch.stack(errs)  # [shrinks, b, G]
        all_sum(err)
        bounds.append(amax * shrink[err.argmin(dim=0)])
    return torch.cat(bounds)


def clip_weight(w: torch.Tensor, bound: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """``w`` clipped to ``[-bound, bound]`` per (output channel, group), as :func:`search_clip` returns it."""
    wg = to_groups(w, _group_width(w, spec))
    out = torch.maximum(torch.minimum(wg, bound.unsqueeze(-1)), -bound.unsqueeze(-1))
    return out.reshape(w.shape[0], -1)[:, : w.shape[1]]


def sample_chunks(chunks: Sequence[torch.Tensor], n: int, seed: int) -> torch.Tensor:
    """``sample_rows(torch.cat(chunks).float(), n, seed)``, the same rows in the same order, gathered
    from the chunks without the concatenated copy (down_proj's inputs on 64 x 512 tokens: 200 MB)."""
    total = sum(c.shape[0] for c in chunks)
    if total <= n:
        return torch.cat(list(chunks)).float()
    idx = torch.randperm(total, generator=torch.Generator().manual_seed(seed))[:n]
    out = torch.empty(n, chunks[0].shape[-1])
    lo = 0
    for c in chunks:
        hit = (idx >= lo) & (idx < lo + c.shape[0])
        out[hit] = c[idx[hit] - lo].float()
        lo += c.shape[0]
    return out


def sample_rows(x: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    if x.shape[0] <= n:
        return x
    idx = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed))[:n]
    return x[idx]
