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

Which producer can absorb a group's scales is not looked up in a table of architectures: it is
found in the traced layer (the module whose output *is* the group's input tensor, or a Linear whose
width equals or divides the group's input width) and proved numerically, by folding random factors
and checking that the layer's output does not change. A narrower producer feeds several input
channels each (grouped-query attention: v_proj's rows reach o_proj once per query head sharing
the key/value head); which ones is measured by scaling its rows with distinct factors and reading
the ratios at the consumer's input, and the group's scales are then tied over those channels (the
geometric mean of their untied values), so GQA's o_proj is scaled too, where AutoAWQ leaves it.
A norm's weight is tried as a plain scale and then as an offset one (``x * (1 + weight)``, Gemma's
RMSNorm), each proved the same way. So Llama, Qwen2/3, Mistral, Gemma, OPT and GPT-2 blocks need
no per-model code, and a group no fold preserves (GPT-2's c_proj after GELU) is left unscaled.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from compress.core.batching import CalibrationData, as_batches
from compress.core.params import ApiParams
from compress.core.precision import float32_inputs, float32_weights
from quantization.algorithms.sequential import (
    DEFAULT_SCHEME,
    Call,
    LayerHook,
    log_summary,
    sequential_quantize,
)
from quantization.algorithms.smoothquant import divide_output_channels
from quantization.numerics.calibration import float_mode
from quantization.numerics.modules import QuantLinear
from quantization.numerics.primitives import (
    dynamic_qparams,
    fake_quantize,
    fake_quantize_spec,
    group_size_for,
    qparams_from_range,
    to_groups,
)
from quantization.numerics.spec import QuantScheme, QuantSpec, resolve_scheme
from quantization.preparation import calibrate_weight

log = logging.getLogger(__name__)



class AWQFields(BaseModel):
    """The AWQ knobs, declared once: AWQParams (API) and the ``awq`` recipe spec share them."""

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


class AWQParams(AWQFields, ApiParams):
    """AWQ's knobs: ``grid`` alphas in [0, 1) for the scale search, ``duo_scaling`` (weight term in
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

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass
class FoldGroup:
    """Linears that read one tensor and the module that produces it (None: no exact fold).
    ``index[c]``: the producer's output channel that the consumers' input channel ``c`` carries
    (None: channel ``c`` itself). ``offset``: the producer is a norm that multiplies by
    ``1 + weight`` (Gemma's RMSNorm), so a factor folds into ``1 + weight``."""

    consumers: list[str]
    producer: str | None
    index: torch.Tensor | None = None
    offset: bool = False


def _primary(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def _rtn(w: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    scale, zp = dynamic_qparams(w, spec)
    return fake_quantize_spec(w, scale, zp, spec)


def _fold(layer: nn.Module, producer: str, consumers: Sequence[str], s: torch.Tensor,
          index: torch.Tensor | None = None, *, offset: bool = False) -> None:
    """Multiply the consumers' input channels by ``s`` and divide the producer's output channels by
    it (``index``: the producer channel each input channel carries; ``s`` is tied over it;
    ``offset``: the producer scales by ``1 + weight``)."""
    p = layer.get_submodule(producer)
    cs = s
    if index is not None:
        w = p.weight
        assert isinstance(w, torch.Tensor)  # find_fold_groups only proposes producers with a weight
        s = torch.ones(w.shape[0], dtype=s.dtype).index_copy_(0, index, s)
    divide_output_channels(p, s, offset=offset)
    with torch.no_grad():
        for c in consumers:
            cw = layer.get_submodule(c).weight
            assert isinstance(cw, torch.Tensor)
            cw.mul_(cs.to(cw.dtype).unsqueeze(0))


def find_fold_groups(layer: nn.Module, linears: Sequence[str], call: Call, *, tol: float = 1e-3) -> list[FoldGroup]:
    """Group ``linears`` (names inside ``layer``) by the tensor they read and find, for each group,
    the producer whose per-channel scaling the layer absorbs exactly (checked on ``call``).
    A bf16/fp16 layer is checked widened to float32: its own rounding (~1e-2) would hide whether a
    fold is exact, and every fold would be refused."""
    with float32_weights(layer) as widened:
        return _find_fold_groups(layer, linears, float32_inputs(call) if widened else call, tol)


def _find_fold_groups(layer: nn.Module, linears: Sequence[str], call: Call, tol: float) -> list[FoldGroup]:
    produced: dict[int, tuple[str, torch.Tensor]] = {}
    reads: dict[str, torch.Tensor] = {}
    handles = []
    lin_set = set(linears)
    for name, mod in layer.named_modules():
        if not name:
            continue
        if name in lin_set:
            handles.append(mod.register_forward_pre_hook(lambda m, a, n=name: reads.setdefault(n, a[0])))
        if any(True for _ in mod.parameters(recurse=False)):

            def post(m: nn.Module, a: Any, out: Any, n: str = name) -> None:
                if isinstance(out, torch.Tensor):
                    produced.setdefault(id(out), (n, out))  # the tensor kept alive: ids stay unique

            handles.append(mod.register_forward_hook(post))
    try:
        with float_mode(layer), torch.no_grad():
            ref = _primary(layer(*call[0], **call[1])).clone()
    finally:
        for h in handles:
            h.remove()
    by_input: dict[int, list[str]] = {}
    for n in linears:
        if n in reads:
            by_input.setdefault(id(reads[n]), []).append(n)
    groups = []
    for key, consumers in by_input.items():
        width = reads[consumers[0]].shape[-1]
        cands: list[str] = []
        if key in produced and produced[key][0] not in consumers:
            cands.append(produced[key][0])
        else:
            # same width first: a narrower producer is only tried when no equal-width one folds
            outs = {n: getattr(layer.get_submodule(n), "out_features", 0) for n in linears if n not in consumers}
            cands += [n for n, f in outs.items() if f == width]
            cands += [n for n, f in outs.items() if 0 < f < width and width % f == 0]
        found = FoldGroup(consumers, None)
        for c in cands:
            mapped, index = _channel_map(layer, c, consumers[0], width, call)
            if not mapped:
                continue
            # a norm's weight is a plain scale, or (Gemma) an offset one: each form is proved, not assumed
            forms = [False, True] if index is None and not isinstance(layer.get_submodule(c), nn.Linear) else [False]
            offset = next((f for f in forms if _fold_is_exact(layer, c, consumers, width, call, ref, tol, index,
                                                              offset=f)), None)
            if offset is not None:
                found = FoldGroup(consumers, c, index, offset)
                break
        groups.append(found)
    return groups


def _channel_map(layer: nn.Module, producer: str, consumer: str, width: int, call: Call) -> tuple[bool, torch.Tensor | None]:
    """Which output channel of Linear ``producer`` each input channel of ``consumer`` carries:
    ``(True, index)``, index None when the widths match (channel c is c); ``(False, None)`` when no
    channel-to-channel map is seen.
    Measured by scaling the producer's rows by distinct factors and reading the ratio of the
    consumer's input to its unscaled value (exact for anything linear in between, e.g. attention
    applied to v_proj's output)."""
    p = layer.get_submodule(producer)
    if not isinstance(p, nn.Linear) or p.out_features == width:
        return True, None
    seen: list[torch.Tensor] = []
    h = layer.get_submodule(consumer).register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().float()))
    factors = torch.linspace(0.5, 2.0, p.out_features)[torch.randperm(p.out_features, generator=torch.Generator().manual_seed(0))]
    saved = [t.detach().clone() for t in (p.weight, p.bias) if t is not None]
    try:
        with float_mode(layer), torch.no_grad():
            layer(*call[0], **call[1])
            p.weight.mul_(factors.unsqueeze(1))
            if p.bias is not None:
                p.bias.mul_(factors)
            layer(*call[0], **call[1])
    finally:
        h.remove()
        with torch.no_grad():
            for t, v in zip([t for t in (p.weight, p.bias) if t is not None], saved, strict=True):
                t.copy_(v)
    if len(seen) != 2:
        return False, None
    before, after = seen[0].reshape(-1, width), seen[1].reshape(-1, width)
    live = before.abs() > 1e-6 * before.abs().amax().clamp_min(1e-30)
    ratio = torch.where(live, after / torch.where(live, before, torch.ones_like(before)), torch.nan).nanmedian(0).values
    if bool(torch.isnan(ratio).any()):
        return False, None
    dist_ = (ratio.unsqueeze(1) - factors.unsqueeze(0)).abs()
    index = dist_.argmin(1)
    step = 1.5 / max(p.out_features - 1, 1)  # the factors' spacing: a match must be far closer than it
    if bool((dist_.gather(1, index.unsqueeze(1)) > 0.1 * step).any()):
        return False, None
    return True, index


def _fold_is_exact(
    layer: nn.Module, producer: str, consumers: list[str], width: int, call: Call, ref: torch.Tensor, tol: float,
    index: torch.Tensor | None = None, *, offset: bool = False,
) -> bool:
    p = layer.get_submodule(producer)
    w = getattr(p, "weight", None)
    if not isinstance(w, torch.Tensor) or (not isinstance(p, nn.Linear) and tuple(w.shape) != (width,)):
        return False
    saved = {k: v.detach().clone() for k, v in layer.state_dict().items()}
    s = torch.empty(width if index is None else w.shape[0]).uniform_(0.5, 2.0, generator=torch.Generator().manual_seed(width))
    try:
        _fold(layer, producer, consumers, s if index is None else s[index], index, offset=offset)
        with float_mode(layer), torch.no_grad():
            out = _primary(layer(*call[0], **call[1]))
        err = float((out - ref).norm() / ref.norm().clamp_min(1e-12))
    finally:
        layer.load_state_dict(saved)
    return err < tol


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
    _all_sum(x_sum, x_rows)  # under DDP the candidates come from all ranks' tokens, so every rank has the same ones
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
    xs = (clip_rows if clip_rows is not None else _sample_rows(x, params.clip_tokens, 1)).float() if clip_now else x

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

    rounded = [_rtn(prepared(s), spec) / s for _, s in cands]
    judged = list(range(len(cands)))
    if isinstance(output_error, ModuleOutputError) and 0 < params.module_candidates < len(cands):
        # rerunning the module (attention, MLP) per candidate is most of AWQ's time: the candidates
        # are screened by the Linears' own output error on x (read from x^T x, one product), and
        # only s = 1 and the best of the screen are rerun
        h = x.t() @ x
        screen = torch.stack([(((q - w) @ h) * (q - w)).sum() for q in rounded])
        _all_sum(screen)  # every DDP rank reruns the same candidates
        judged = [0, *sorted((torch.argsort(screen[1:]) + 1).tolist()[: params.module_candidates - 1])]
    errs = torch.full((len(cands),), float("inf"))
    for i in judged:
        errs[i] = error(list(rounded[i].split(rows, dim=0))).float().reshape(())
    n = torch.tensor([n_out])
    _all_sum(errs, n)  # under DDP every rank picks the same scales, on all ranks' tokens
    k = int(torch.argmin(errs))
    return ScaleChoice(cands[k][1], cands[k][0], float(errs[k] / n), float(errs[0] / n))


def scale_error_ratio(summary: dict[str, Any]) -> float | None:
    """Median over the searched groups of ``error / unscaled_error`` in a sequential AWQ summary
    (layer reports of :func:`awq_layer`): 1.0 means the scales bought nothing on their objective,
    as on a model with few activation outliers; None when no group had a fold to search."""
    ratios = [g["error"] / g["unscaled_error"] for r in summary["layers"] for g in r.get("groups", [])
              if g.get("unscaled_error") and g["unscaled_error"] > 0]
    return float(torch.tensor(ratios).median()) if ratios else None


def _common_scope(names: Sequence[str]) -> str:
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
                    total += ((_primary(self.module(*a, **k)).float() - ref) ** 2).sum()
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


def _all_sum(*tensors: torch.Tensor) -> None:
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
    _all_sum(rows_ranks)
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
    bounds = []
    for o in range(0, w.shape[0], step):
        wg = to_groups(w[o : o + step], gs)  # [b, G, gs]
        ref = None if h is not None else torch.einsum("ngk,bgk->bng", xt, wg)
        amax = wg.abs().amax(dim=-1)  # [b, G]
        errs = []
        for f in shrink.tolist():
            mv = amax * f
            cw = torch.maximum(torch.minimum(wg, mv.unsqueeze(-1)), -mv.unsqueeze(-1))
            sc, zp = qparams_from_range(cw.amin(-1), cw.amax(-1), qmin=spec.qmin, qmax=spec.qmax, symmetric=spec.symmetric)
            qw = fake_quantize(cw, sc.unsqueeze(-1), zp.unsqueeze(-1), spec.qmin, spec.qmax)
            if ref is None:
                d = qw - wg
                errs.append((torch.einsum("bgk,gkl->bgl", d, h) * d).sum(dim=-1))
            else:
                errs.append(((torch.einsum("ngk,bgk->bng", xt, qw) - ref) ** 2).sum(dim=1))
        err = torch.stack(errs)  # [shrinks, b, G]
        _all_sum(err)
        bounds.append(amax * shrink[err.argmin(dim=0)])
    return torch.cat(bounds)


def clip_weight(w: torch.Tensor, bound: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """``w`` clipped to ``[-bound, bound]`` per (output channel, group), as :func:`search_clip` returns it."""
    wg = to_groups(w, _group_width(w, spec))
    out = torch.maximum(torch.minimum(wg, bound.unsqueeze(-1)), -bound.unsqueeze(-1))
    return out.reshape(w.shape[0], -1)[:, : w.shape[1]]


def _rounded(w: torch.Tensor, lin: QuantLinear, s: torch.Tensor | None) -> torch.Tensor:
    """The rounded weight in the layer's pre-fold space (the recorded calls' inputs are unscaled)."""
    wq = lin.weight_quantizer
    out = w.float() if wq is None else _rtn(w.float(), wq.spec)
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
        error = errors.get(_common_scope(g.consumers))
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
    _all_sum(out)  # every rank keeps the same clips
    return out


def _clips(name: str, lin: QuantLinear, params: AWQParams) -> bool:
    """Whether the clip search runs on this Linear."""
    return params.clip and lin.weight_quantizer is not None and not any(
        fnmatch.fnmatchcase(name, p) for p in params.clip_ignore)


def _first_row(call: Call) -> Call:
    """``call`` cut to its first sequence (every tensor of two or more dims whose leading dim is the
    batch's): the fold checks prove an identity, which one sequence shows as well as the batch,
    at a fraction of the cost of running the layer on it several times."""
    hidden = call[0][0] if call[0] else call[1].get("hidden_states")
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 2 or hidden.shape[0] < 2:
        return call
    b = hidden.shape[0]

    def cut(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v[:1] if v.dim() >= 2 and v.shape[0] == b else v
        if isinstance(v, (tuple, list)):
            return type(v)(cut(t) for t in v)
        return v

    return tuple(cut(a) for a in call[0]), {k: cut(v) for k, v in call[1].items()}


def _sample_chunks(chunks: Sequence[torch.Tensor], n: int, seed: int) -> torch.Tensor:
    """``_sample_rows(torch.cat(chunks).float(), n, seed)``, the same rows in the same order, gathered
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


def _sample_rows(x: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    if x.shape[0] <= n:
        return x
    idx = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed))[:n]
    return x[idx]


@torch.no_grad()
def awq_layer(
    layer: nn.Module, linears: dict[str, QuantLinear], calls: Sequence[Call], params: AWQParams, *, seed: int = 0
) -> dict[str, Any]:
    """AWQ on one decoder layer in place: scale search and fold per foldable group, then clipping.
    ``linears`` are the layer's weight-quantized Linears by name inside ``layer``; ``calls`` are the
    layer's calibration calls ``(args, kwargs)``. Weight quantizers are recalibrated at the end."""
    names = list(linears)
    groups = find_fold_groups(layer, names, _first_row(calls[0]))
    inputs: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    handles = [
        linears[n].register_forward_pre_hook(lambda m, a, n=n: inputs[n].append(a[0].detach().reshape(-1, a[0].shape[-1])))
        for n in names
    ]
    # the group's output is the output of the innermost module holding all its Linears (q/k/v:
    # the attention; gate/up: the MLP; down: itself), recorded on whole calls up to sample_tokens;
    # a lone Linear's (o_proj, down_proj) is read from its inputs' Gram matrix instead
    scopes = {_common_scope(g.consumers) for g in groups if g.producer is not None or params.clip} - set(names)
    recorded: dict[str, list[tuple[Any, Any, torch.Tensor]]] = {sc: [] for sc in scopes}
    tokens = dict.fromkeys(scopes, 0)

    def record(scope: str) -> Any:
        def hook(m: nn.Module, args: Any, kwargs: Any, out: Any) -> None:
            y = _primary(out)
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
                shared[key] = _sample_chunks(v, params.sample_tokens, seed)
            x_of[n] = shared[key]
    errors: dict[str, GroupError] = {
        sc: ModuleOutputError(layer.get_submodule(sc), [linears[c] for c in g.consumers], recorded[sc])
        for g in groups if (sc := _common_scope(g.consumers)) in scopes and recorded[sc]
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
        scope = _common_scope(g.consumers)
        error = errors.get(scope)
        pick = search_scales(x, [linears[c].weight for c in g.consumers], spec.spec, params,
                             output_error=error, index=g.index,
                             clip_rows=_sample_rows(x, params.clip_tokens, seed + 1),
                             clipped=[_clips(c, linears[c], params) for c in g.consumers])
        if pick.alpha >= 0:
            _fold(layer, g.producer, g.consumers, pick.scales, g.index, offset=g.offset)
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
            x = _sample_rows(x_of[n], params.clip_tokens, seed + 1)
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
    return report


def awq(
    model: nn.Module,
    data: CalibrationData,
    *,
    scheme: QuantScheme | str = DEFAULT_SCHEME,
    targets: Sequence[str] = ("*",),
    ignore: Sequence[str] = ("lm_head",),
    params: AWQParams | None = None,
    max_batches: int | None = None,
    load: LayerHook | None = None,
    release: LayerHook | None = None,
) -> nn.Module:
    """AWQ weight-only quantization of a decoder LLM (in place), one layer at a time; returns it.

    Scales are folded into the preceding norm or Linear wherever the layer proves the fold exact;
    weights are clipped per group; the weight quantizers then hold round-to-nearest qparams of the
    scaled, clipped weights (run :func:`gptq` afterwards for GPTQ rounding instead).
    """
    p = params or AWQParams()
    s = resolve_scheme(scheme)
    summary = sequential_quantize(
        model, as_batches(data, model, max_batches=max_batches), s,
        lambda i, layer, lin, calls: awq_layer(layer, lin, calls, p, seed=i),
        targets=targets, ignore=ignore, max_batches=max_batches, load=load, release=release, where="awq",
    )
    log_summary("awq", summary)
    ratio = scale_error_ratio(summary)
    if ratio is not None:
        log.info("awq: with the scales the groups' module-output error is %.3f of theirs with s = 1 (median)", ratio)
    return model
