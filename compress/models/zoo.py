"""The model zoo: real architectures sized for CPU tests, built by name with checked kwargs."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from compress.core.errors import RecipeError, did_you_mean
from compress.core.registry import Registry
from compress.models.mlp import mlp
from compress.models.mobilenetv2 import MobileNetV2
from compress.models.resnet import resnet
from compress.models.vit import ViT

ZOO: Registry[Callable[..., nn.Module]] = Registry("zoo model")
# an entry is any callable taking keyword arguments: ViT and MobileNetV2 are their own factories
ZOO.add("resnet", resnet)
ZOO.add("mobilenetv2", MobileNetV2)
ZOO.add("vit", ViT)
ZOO.add("mlp", mlp)


def zoo_kwargs(name: str) -> dict[str, Any]:
    """The kwargs a zoo model takes, with their defaults."""
    sig = inspect.signature(ZOO.get(name))
    return {p.name: p.default for p in sig.parameters.values()}


def build_zoo_model(name: str, kwargs: Mapping[str, Any] | None = None, /, **model_kwargs: Any) -> nn.Module:
    """Build zoo model ``name`` from ``kwargs`` (a mapping, as in a recipe) and/or keyword arguments.

    Every kwarg is checked against the model's signature: an unknown one, or a value the model
    rejects, raises RecipeError naming the model and its valid kwargs.
    """
    return _build(name, {**(kwargs or {}), **model_kwargs}, where="")


def _build(name: str, kwargs: Mapping[str, Any], *, where: str, kwarg_where: Callable[[str], str] | None = None) -> nn.Module:
    """``where`` prefixes errors about the name; ``kwarg_where(key)`` those about one kwarg (its own
    YAML line), else ``where``."""
    prefix = f"{where}: " if where else ""
    if name not in ZOO:
        raise RecipeError(f"{prefix}unknown zoo model '{name}'; {did_you_mean(name, ZOO.names())}")
    factory = ZOO.get(name)
    valid = zoo_kwargs(name)
    for key in kwargs:
        if key not in valid:
            at = f"{kwarg_where(key)}: " if kwarg_where is not None else prefix
            raise RecipeError(f"{at}zoo model '{name}' has no kwarg '{key}'; {did_you_mean(key, list(valid))}")
    try:
        return factory(**kwargs)
    except (TypeError, ValueError) as exc:
        shown = ", ".join(f"{k}={v!r}" for k, v in valid.items())
        raise RecipeError(
            f"{prefix}zoo model '{name}' rejected its kwargs: {exc} (kwargs and defaults: {shown})"
        ) from None
