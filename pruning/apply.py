"""Physical surgery: slice parameters, buffers and optimizer state, then fix module attributes.

A pruning step is a mapping ``tensor name -> [(axis, kept indices), ...]`` (what a PruningPlan
stores); a key ``attr:<module>:<attribute>`` holding ``[(-1, [value])]`` sets an int width
attribute that the module's forward reshapes with (``self.hidden_dim``, ``self.n_heads``). :func:`apply_slices` is the one code path for pruning and for replaying a plan, so a
replay rebuilds exactly the architecture the pruning produced. Changes are logged so that a
model that fails its check after surgery is restored, never left half-pruned.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from compress.pruning.attention import PrunedMultiheadAttention, sync_attention_attrs
from compress.pruning.graph import ELEMENT, DependencyGraph
from torch import nn

from compress.core.errors import CompressError, UnsupportedModelError

log = logging.getLogger(__name__)

Slices = dict[str, list[tuple[int, list[int]]]]


def slices_from_keep(graph: DependencyGraph, keep: np.ndarray) -> Slices:
    """The tensor slices that remove every atom whose ``keep`` flag is False."""
    out: Slices = {}
    for c in graph.coords:
        kept_mask = keep[graph.coord_atoms(c)]
        if bool(kept_mask.all()):
            continue
        if c.axis is not None:
            _add(out, c.key, c.axis, np.nonzero(kept_mask)[0].tolist())
        elif ELEMENT in c.roles:
            mask = kept_mask.reshape(c.shape)
            axis = _element_axis(mask)
            if axis is None:
                raise UnsupportedModelError(
                    f"pruning would remove an irregular set of elements of parameter '{c.key}' {c.shape}"
                )
            others = tuple(d for d in range(mask.ndim) if d != axis)
            _add(out, c.key, axis, np.nonzero(mask.any(axis=others))[0].tolist())
    for mod, groups in graph.group_width_convs.items():
        out[f"{ATTR}{mod}:groups"] = [(-1, [groups])]  # the count stays; fix_module reads it
    for i, (candidates, labels) in enumerate(graph.width_attrs):
        choice = graph.width_choice.get(i, 0)
        if choice >= len(candidates):
            continue  # the cut found that no attribute holds this width
        mod, attr = candidates[choice]
        kept = _kept_width(graph, labels, keep)
        if kept is not None and kept != labels.shape[1]:
            out[f"{ATTR}{mod}:{attr}"] = [(-1, [kept])]
    return out


def _kept_width(graph: DependencyGraph, labels: torch.Tensor, keep: np.ndarray) -> int | None:
    """Kept indices of a reshaped dim (``labels``: other positions x that dim), when every index is
    one unit across all other positions (heads, channels); None when it is not a width dim (the
    code's head_dim: its indices fall with their head, not one by one)."""
    atoms = graph.label_atoms(labels)
    top = atoms.amax(0)
    low = torch.where(atoms >= 0, atoms, top.expand_as(atoms)).amin(0)
    if bool((top != low).any()) or bool((top < 0).any()):
        return None
    return int(keep[top.numpy()].sum())


#: key prefix of a width attribute in a pruning step
ATTR = "attr:"


def _element_axis(mask: np.ndarray) -> int | None:
    """The axis along which kept elements form whole hyperplanes, if any."""
    for axis in range(mask.ndim):
        others = tuple(d for d in range(mask.ndim) if d != axis)
        kept = mask.any(axis=others) if others else mask
        shape = [1] * mask.ndim
        shape[axis] = mask.shape[axis]
        if np.array_equal(np.broadcast_to(kept.reshape(shape), mask.shape), mask):
            return axis
    return None


def _add(out: Slices, key: str, axis: int, kept: list[int]) -> None:
    entries = out.setdefault(key, [])
    for i, (a, prev) in enumerate(entries):
        if a == axis:
            entries[i] = (a, sorted(set(prev) & set(kept)))
            return
    entries.append((axis, kept))


@dataclass
class UndoLog:
    """What surgery changed, to restore the model if the result fails its check."""

    actions: list[Callable[[], None]] = field(default_factory=list)

    def setattr(self, obj: Any, name: str, value: Any) -> None:
        old = getattr(obj, name)
        self.actions.append(lambda: _raw_setattr(obj, name, old))
        _raw_setattr(obj, name, value)

    def undo(self) -> None:
        for act in reversed(self.actions):
            act()
        self.actions.clear()


def _raw_setattr(obj: Any, name: str, value: Any) -> None:
    if isinstance(obj, nn.Module) and (name in obj._parameters or name in obj._buffers or name in obj._modules):
        if name in obj._parameters:
            obj._parameters[name] = value
        elif name in obj._buffers:
            obj._buffers[name] = value
        else:
            obj._modules[name] = value
        return
    setattr(obj, name, value)


def _owners(model: nn.Module) -> dict[int, list[tuple[nn.Module, str, str]]]:
    """Every (module, attribute, kind) holding each parameter/buffer object (tied ones included)."""
    owners: dict[int, list[tuple[nn.Module, str, str]]] = {}
    for mod in model.modules():
        for n, p in mod._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((mod, n, "param"))
        for n, b in mod._buffers.items():
            if b is not None:
                owners.setdefault(id(b), []).append((mod, n, "buffer"))
    return owners


def apply_slices(
    model: nn.Module,
    slices: Mapping[str, Sequence[tuple[int, Sequence[int]]]],
    *,
    optimizer: torch.optim.Optimizer | None = None,
    undo: UndoLog | None = None,
) -> UndoLog:
    """Slice the named tensors in place, fix module attributes and slice the optimizer's state."""
    undo = undo or UndoLog()
    tensors: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(dict(model.named_buffers(remove_duplicate=False)))
    owners = _owners(model)
    replaced: dict[int, tuple[torch.Tensor, torch.Tensor, list[tuple[int, torch.Tensor]]]] = {}
    touched: set[int] = set()
    modules = dict(model.named_modules())
    attrs = {k: v for k, v in slices.items() if k.startswith(ATTR)}
    for name, entries in slices.items():
        if name.startswith(ATTR):
            continue
        t = tensors.get(name)
        if t is None:
            raise CompressError(f"pruning plan names '{name}', which {type(model).__name__} does not have")
        if id(t) in replaced:
            continue  # a tied tensor already sliced through another name
        idx: list[tuple[int, torch.Tensor]] = []
        data = t.detach()
        for axis, kept in entries:
            if axis >= data.dim() or (kept and max(kept) >= data.shape[axis]):
                raise CompressError(
                    f"pruning plan does not fit '{name}' {tuple(t.shape)}: axis {axis} keeps index {max(kept, default=0)}"
                )
            index = torch.as_tensor(list(kept), dtype=torch.long, device=data.device)
            data = data.index_select(axis, index)
            idx.append((axis, index))
        new: torch.Tensor
        if isinstance(t, nn.Parameter):
            new = nn.Parameter(data.clone(), requires_grad=t.requires_grad)
        else:
            new = data.clone()
        for mod, attr, _ in owners.get(id(t), []):
            undo.setattr(mod, attr, new)
            touched.add(id(mod))
        replaced[id(t)] = (t, new, idx)
    for parent in list(model.modules()):
        for cname, child in list(parent._modules.items()):
            if child is not None and id(child) in touched:
                fixed = fix_module(child, undo)
                if fixed is not child:
                    undo.setattr(parent, cname, fixed)
    for name, entries in attrs.items():
        _set_width_attr(modules, name, entries, undo)
        mod = modules[name[len(ATTR) :].rpartition(":")[0]]
        if isinstance(mod, nn.modules.conv._ConvNd) and not mod.transposed:
            undo.setattr(mod, "in_channels", mod.weight.shape[1] * mod.groups)  # groups set after fix_module
    for mod in model.modules():
        before = _attrs_snapshot(mod)
        sync_attention_attrs(mod)
        for k, v in before.items():
            if getattr(mod, k) != v:
                undo.actions.append(_restorer(mod, k, v))
    if optimizer is not None:
        _slice_optimizer(optimizer, replaced, undo)
    return undo


def _set_width_attr(
    modules: Mapping[str, nn.Module], key: str, entries: Sequence[tuple[int, Sequence[int]]], undo: UndoLog
) -> None:
    mod_name, _, attr = key[len(ATTR) :].rpartition(":")
    mod = modules.get(mod_name)
    if mod is None or type(getattr(mod, attr, None)) is not int or len(entries) != 1 or len(entries[0][1]) != 1:
        raise CompressError(f"pruning plan sets width attribute '{key}', which the model does not have as an int")
    undo.setattr(mod, attr, int(entries[0][1][0]))


def _restorer(mod: nn.Module, name: str, value: Any) -> Callable[[], None]:
    return lambda: setattr(mod, name, value)


_ATTN_ATTRS = ("num_heads", "num_attention_heads", "all_head_size")


def _attrs_snapshot(mod: nn.Module) -> dict[str, Any]:
    return {k: getattr(mod, k) for k in _ATTN_ATTRS if isinstance(getattr(mod, k, None), int)}


def fix_module(m: nn.Module, undo: UndoLog) -> nn.Module:
    """Set a module's size attributes from its (sliced) tensors; may return a replacement module."""
    if isinstance(m, nn.modules.conv._ConvNd):
        w = m.weight
        if m.transposed:
            undo.setattr(m, "in_channels", w.shape[0])
            undo.setattr(m, "out_channels", w.shape[1] * m.groups)
        else:
            if m.groups > 1:
                per_group_out = m.out_channels // m.groups
                undo.setattr(m, "groups", w.shape[0] // per_group_out)
            undo.setattr(m, "in_channels", w.shape[1] * m.groups)
            undo.setattr(m, "out_channels", w.shape[0])
    elif isinstance(m, nn.Linear):
        undo.setattr(m, "out_features", m.weight.shape[0])
        undo.setattr(m, "in_features", m.weight.shape[1])
    elif isinstance(m, nn.modules.batchnorm._NormBase):
        ref = m.weight if m.weight is not None else m.running_mean
        if ref is not None:
            undo.setattr(m, "num_features", ref.shape[0])
    elif isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
        if m.weight is not None:
            undo.setattr(m, "normalized_shape", (m.weight.shape[0],))
    elif isinstance(m, nn.GroupNorm):
        per = m.num_channels // m.num_groups
        undo.setattr(m, "num_channels", m.weight.shape[0])
        undo.setattr(m, "num_groups", m.weight.shape[0] // per)
    elif isinstance(m, nn.Embedding):
        undo.setattr(m, "embedding_dim", m.weight.shape[1])
    elif isinstance(m, nn.PReLU):
        undo.setattr(m, "num_parameters", m.weight.numel())
    elif isinstance(m, nn.MultiheadAttention):
        return PrunedMultiheadAttention.from_module(m)
    elif isinstance(m, PrunedMultiheadAttention):
        m.sync()
    return m


def _slice_optimizer(
    opt: torch.optim.Optimizer,
    replaced: Mapping[int, tuple[torch.Tensor, torch.Tensor, list[tuple[int, torch.Tensor]]]],
    undo: UndoLog,
) -> None:
    """Point the optimizer at the new parameters and slice its per-parameter state to match."""
    for group in opt.param_groups:
        params = list(group["params"])
        changed = False
        for i, p in enumerate(params):
            hit = replaced.get(id(p))
            if hit is None:
                continue
            old, new, idx = hit
            params[i] = new
            changed = True
            state = opt.state.pop(old, None)
            if state is not None:
                opt.state[new] = {k: _slice_state(v, old, idx) for k, v in state.items()}

                def restore(o: Any = old, n: Any = new, s: Any = state) -> None:
                    opt.state.pop(n, None)
                    opt.state[o] = s

                undo.actions.append(restore)
        if changed:
            undo.setattr(_DictAttr(group), "params", params)


def _slice_state(v: Any, old: torch.Tensor, idx: list[tuple[int, torch.Tensor]]) -> Any:
    if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(old.shape):
        for axis, index in idx:
            v = v.index_select(axis, index.to(v.device))
        return v.clone()
    return v


class _DictAttr:
    """Attribute access to a dict key, so the undo log handles optimizer param groups too."""

    def __init__(self, d: dict[str, Any]) -> None:
        object.__setattr__(self, "_d", d)

    def __getattr__(self, name: str) -> Any:
        return self._d[name]

    def __setattr__(self, name: str, value: Any) -> None:
        self._d[name] = value
