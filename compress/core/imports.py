"""Resolve ``pkg.module:attr`` strings from recipes to Python objects, with recipe-grade errors."""

from __future__ import annotations

import importlib
from typing import Any

from compress.core.errors import RecipeError, closest


def is_import_path(name: str) -> bool:
    """Whether ``name`` looks like ``pkg.module:attr`` rather than a registered name."""
    return ":" in name


def import_object(path: str, *, where: str, what: str = "factory") -> Any:
    """The object at ``pkg.module:attr`` (``attr`` may be dotted); RecipeError naming the path and why.

    ``what`` names the attribute in the message for a malformed path (``'pkg.module:factory'``).
    """
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise RecipeError(f"{where}: '{path}' is not of the form 'pkg.module:{what}'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any failure while importing user code is a bad recipe path
        why = " ".join(f"{type(exc).__name__}: {exc}".split())
        raise RecipeError(f"{where}: cannot import module '{module_name}' for '{path}' ({why})") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("_")]
            hint = closest(part, names)
            tip = f" (did you mean '{hint}'?)" if hint else ""
            raise RecipeError(f"{where}: module '{module_name}' has no attribute '{attr}'{tip}")
        obj = getattr(obj, part)
    return obj
