"""Compression state saved as data, restored onto the float model (no pickled modules).

A run's ``checkpoints/final.pt`` holds ``{"model": state_dict, "epoch": 0, "compression": JSON}``:
tensors and a JSON string only, so ``torch.load(..., weights_only=True)`` reads it and a run folder
made by someone else cannot execute code. The JSON says how to rebuild the compressed structure:

``modifiers``, in stage order, each ``{"type", "state"}``: what that modifier's ``save_state`` wrote
(a prune modifier its pruning plan; a quantize modifier its spec, the layers it left quantized and
each quantizer's ``enabled`` flag). Restoring replays each one's ``restore_state`` on the fresh float
model (no calibration), then the state_dict brings the weights and qparams. Each modifier owns its
save and restore (modelopt's mode descriptors work the same way: config + state, onto the float
model); this module only iterates. :func:`restore_compressed` is what ``compress validate RUN_DIR
--backend cuda`` uses. Version 1 files (plans and one quantize spec, apart) still restore.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from compress.core.errors import CompressError, RecipeError
from compress.core.io import atomic_torch_save, safe_torch_load
from compress.core.modifier import Modifier
from compress.modifiers import modifier_class

log = logging.getLogger(__name__)

FORMAT = "compress.compression-state"
VERSION = 2
#: the pickled whole module older runs wrote; refused, never loaded
LEGACY_PICKLE = "final_model.pt"


def compression_state(model: nn.Module, modifiers: Sequence[Modifier[Any]]) -> dict[str, Any]:
    """What :func:`restore_compressed` needs besides the state_dict, as JSON-ready data: each
    modifier's own :meth:`~compress.core.modifier.Modifier.save_state`, in stage order."""
    saved = [{"type": m.spec.type, "state": data} for m in modifiers if (data := m.save_state(model)) is not None]
    kinds = {m.spec.type: m.spec.kind for m in modifiers}
    # one quantize modifier makes the structure; later ones may only re-round its layers (GPTQ after AWQ)
    if sum(1 for e in saved if kinds[e["type"]] == "quantize" and not e["state"].get("refines")) > 1:
        raise CompressError("compression state: more than one quantize modifier; cannot describe the model")
    return {"format": FORMAT, "version": VERSION, "modifiers": saved}


def save_compressed(path: Path, model: nn.Module, modifiers: Sequence[Any]) -> None:
    """Atomically write ``model``'s state_dict and its compression state to ``path``."""
    state = compression_state(model, modifiers)
    atomic_torch_save({"model": model.state_dict(), "epoch": 0, "compression": json.dumps(state)}, path)


def load_state_file(path: Path) -> dict[str, Any]:
    """A compress checkpoint (a dict with a ``model`` state_dict), loaded with :func:`safe_torch_load`."""
    data = safe_torch_load(path)
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        raise RecipeError(f"{path}: not a compress checkpoint (a dict with a 'model' state_dict)")
    return data


def restore_compressed(build_float: Callable[[], nn.Module], path: Path) -> nn.Module:
    """The compressed model a run saved at ``path``: ``build_float()`` (the recipe's float model),
    the pruning plans replayed, the quantizers prepared again, then the state_dict loaded strictly."""
    data = load_state_file(path)
    legacy = path.parent / LEGACY_PICKLE
    if "compression" not in data:
        hint = f" (the old pickled {legacy.name} beside it is not loaded: it could run code)" if legacy.exists() else ""
        raise RecipeError(f"{path}: has no compression state; rerun the recipe with this version{hint}")
    try:
        state = json.loads(data["compression"])
    except (TypeError, json.JSONDecodeError) as exc:
        raise RecipeError(f"{path}: compression state is not valid JSON ({exc})") from None
    if state.get("format") != FORMAT or state.get("version") not in (1, VERSION):
        raise RecipeError(f"{path}: unknown compression state {state.get('format')!r} v{state.get('version')!r}")
    saved = _saved_modifiers(state)
    model = build_float()
    for i, entry in enumerate(saved):
        where = f"{path}: modifiers.{i}"
        try:
            handler = modifier_class(entry["type"])
        except RecipeError as exc:
            raise RecipeError(f"{where}: {exc}") from None
        handler.restore_state(model, entry["state"], where=where)
    sd = data["model"]
    _shape_empty_buffers(model, sd)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise RecipeError(
            f"{path}: the state does not fit the rebuilt model (missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}); was the recipe's model changed after the run?"
        )
    _check_placement(model, path)
    return model.eval()


def _check_placement(model: nn.Module, path: Path) -> None:
    """Every module a restored quantizer placement names must exist: a placement saved against other
    module code (the zoo's former Add/MatMul modules) would otherwise silently quantize nothing there."""
    from compress.quantization.placement.mode import graph_of

    graph = graph_of(model)
    if graph is None or graph.pending:
        return
    names = {n for n, _ in model.named_modules()}
    stale = sorted({k.rpartition(":")[0] for k in graph.placement.entries} - names)
    if stale:
        raise RecipeError(
            f"{path}: its quantizer placement names modules the model does not have ({', '.join(stale[:5])}); "
            "it was saved with other model code: rerun the recipe"
        )


def _saved_modifiers(state: dict[str, Any]) -> list[dict[str, Any]]:
    """The saved modifiers in stage order; version 1 kept the pruning plans and one quantize
    modifier's spec apart (their prune stages always came first)."""
    if state["version"] != 1:
        return list(state["modifiers"])
    saved = [{"type": "prune", "state": {"plan": plan}} for plan in state["pruning_plans"]]
    q = state["quantization"]
    if q is not None:
        saved.append({"type": q["type"], "state": {k: q[k] for k in ("spec", "modules", "quantizers")}})
    return saved


def _shape_empty_buffers(model: nn.Module, sd: dict[str, torch.Tensor]) -> None:
    """Give the buffers a fresh module holds empty or as None (qparams before calibration, an
    optional pre-scale) the shape the saved state has, so that a strict load fills them."""
    for key, value in sd.items():
        owner_name, _, attr = key.rpartition(".")
        try:
            owner = model.get_submodule(owner_name) if owner_name else model
        except AttributeError:
            continue
        if attr in owner._buffers:
            cur = owner._buffers[attr]
            if cur is None or (cur.numel() == 0 and value.numel() > 0):
                owner._buffers[attr] = torch.empty_like(value)
        elif attr in owner._parameters:
            cur_p = owner._parameters[attr]
            if cur_p is not None and cur_p.numel() == 0 and value.numel() > 0:
                owner._parameters[attr] = nn.Parameter(torch.empty_like(value), requires_grad=cur_p.requires_grad)
