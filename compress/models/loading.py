"""``load_model``: a recipe's ModelSpec to an ``nn.Module`` (zoo, factory or Hugging Face, then an
optional pruning plan replay and checkpoint)."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from compress.core.errors import CompressError, RecipeError
from compress.core.imports import import_object, is_import_path
from compress.core.io import safe_torch_load
from compress.core.reference import ModelSpec, Where
from compress.core.trust import allow_code
from compress.models.hf import load_hf_model
from compress.models.zoo import _build

log = logging.getLogger(__name__)


def _at(where: Where, field: str) -> str:
    # a callable (e.g. ``recipe.where``) gets the field path and can point at its YAML line
    return where(f"model.{field}") if callable(where) else where


def load_model(spec: ModelSpec | Mapping[str, Any], *, where: Where = "model", trust_code: bool = False) -> nn.Module:
    """Build the model a ModelSpec describes.

    ``name``: a zoo name (``resnet``, ``mobilenetv2``, ``vit``, ``mlp``) or ``pkg.module:factory``,
    called with ``kwargs``. ``hf_path``: a local Hugging Face directory or ``package:DIST``, loaded
    offline with ``AutoModel`` (``kwargs`` go to ``from_pretrained``). Then ``pruning_plan`` is
    replayed (so that a pruned checkpoint fits) and ``checkpoint`` is loaded strictly.

    ``where`` prefixes error messages: a string, or a callable such as ``recipe.where`` that gets
    the field path (``model.checkpoint``) and returns ``file:line: path``. A factory runs only with
    ``trust_code=True`` (or inside a run of a trusted recipe): see compress.core.trust.
    """
    if not isinstance(spec, ModelSpec):
        spec = ModelSpec.model_validate(dict(spec))
    if spec.name is not None:
        with allow_code(trust_code):
            model = _from_name(spec.name, spec.kwargs, where=_at(where, "name"),
                               kwarg_where=lambda key: _at(where, f"kwargs.{key}"))
    else:
        assert spec.hf_path is not None  # ModelSpec guarantees exactly one source
        model = load_hf_model(spec.hf_path, spec.kwargs, where=_at(where, "hf_path"))
    if spec.pruning_plan is not None:
        apply_pruning_plan(model, spec.pruning_plan, where=_at(where, "pruning_plan"))
    if spec.checkpoint is not None:
        load_checkpoint(model, spec.checkpoint, where=_at(where, "checkpoint"))
    return model


def _from_name(name: str, kwargs: Mapping[str, Any], *, where: str, kwarg_where: Callable[[str], str]) -> nn.Module:
    if not is_import_path(name):
        return _build(name, kwargs, where=where, kwarg_where=kwarg_where)
    factory = import_object(name, where=where)
    if not callable(factory):
        raise RecipeError(f"{where}: '{name}' is a {type(factory).__name__}, not a callable model factory")
    try:
        model = factory(**kwargs)
    except TypeError as exc:
        raise RecipeError(f"{where}: factory '{name}' rejected kwargs {sorted(kwargs)} ({exc})") from None
    except Exception as exc:  # the user's factory failed: name it and the recipe line, not our code
        why = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        raise RecipeError(f"{where}: model factory '{name}' raised {why}") from None
    if not isinstance(model, nn.Module):
        raise RecipeError(
            f"{where}: factory '{name}' returned a {type(model).__name__}, not a torch nn.Module"
        )
    return model


def apply_pruning_plan(model: nn.Module, path: str, *, where: str = "pruning_plan") -> None:
    """Replay a saved pruning plan (``pruning.plan.PruningPlan``) on ``model``, in place."""
    if not Path(path).is_file():
        raise RecipeError(f"{where}: pruning plan '{path}' not found")
    try:
        plan_mod = importlib.import_module("compress.pruning.plan")
        plan_cls = plan_mod.PruningPlan
    except (ImportError, AttributeError) as exc:
        raise CompressError(
            f"{where}: replaying a pruning plan needs pruning.plan.PruningPlan ({exc})"
        ) from None
    try:
        plan_cls.load(path).apply(model)
    except CompressError as exc:
        # the plan names its own file; prefix where the recipe asked for it (same error class)
        raise type(exc)(f"{where}: {exc}") from None
    log.info("replayed pruning plan %s", path)


def load_checkpoint(model: nn.Module, path: str, *, where: str = "checkpoint") -> None:
    """Load a state_dict (bare, or under ``model``/``state_dict``) saved with ``torch.save``, strictly,
    with ``weights_only=True``; RecipeError naming the first missing, unexpected or misshaped key."""
    p = Path(path)
    if not p.is_file():
        raise RecipeError(f"{where}: checkpoint '{path}' not found")
    obj = safe_torch_load(p, where=where)
    if isinstance(obj, Mapping):
        for key in ("model", "state_dict"):
            if isinstance(obj.get(key), Mapping):
                obj = obj[key]
                break
    if not isinstance(obj, Mapping) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise RecipeError(f"{where}: checkpoint '{path}' holds no state_dict (a mapping of names to tensors)")
    check_state_dict(model, obj, where=f"{where}: checkpoint '{path}'")
    model.load_state_dict(obj, strict=True)
    log.info("loaded checkpoint %s", path)


def check_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor], *, where: str) -> None:
    """RecipeError naming the first key of ``state`` that does not fit ``model`` (missing, unexpected, shape)."""
    own = model.state_dict()
    for key, value in state.items():
        if key not in own:
            raise RecipeError(f"{where}: unexpected key '{key}' (not in the model)")
        if tuple(own[key].shape) != tuple(value.shape):
            raise RecipeError(
                f"{where}: shape mismatch at '{key}': checkpoint {tuple(value.shape)}, model {tuple(own[key].shape)}"
                " (a pruned checkpoint needs model.pruning_plan)"
            )
    for key in own:
        if key not in state:
            raise RecipeError(f"{where}: missing key '{key}'")
