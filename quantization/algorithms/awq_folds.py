"""AWQ's folds: which module absorbs a group's per-channel scales, found in the traced decoder layer
and proved numerically, and the fold itself (quantization/algorithms/awq.py runs them per layer).

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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from compress.quantization.algorithms.sequential import Call
from compress.quantization.algorithms.smoothquant import divide_output_channels
from compress.quantization.numerics.calibration import float_mode
from torch import nn

from compress.core.precision import float32_inputs, float32_weights


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


def primary_output(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def fold_scales(layer: nn.Module, producer: str, consumers: Sequence[str], s: torch.Tensor,
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
            ref = primary_output(layer(*call[0], **call[1])).clone()
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
        fold_scales(layer, producer, consumers, s if index is None else s[index], index, offset=offset)
        with float_mode(layer), torch.no_grad():
            out = primary_output(layer(*call[0], **call[1]))
        err = float((out - ref).norm() / ref.norm().clamp_min(1e-12))
    finally:
        layer.load_state_dict(saved)
    return err < tol


def first_sequence(call: Call) -> Call:
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
