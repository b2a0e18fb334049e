"""The built-in modifiers, looked up by their recipe ``type``.

The algorithm packages register their modifiers in compress.core.modifier's registry when imported;
this top-floor module imports them by name on the first lookup, so that the core never imports the
packages above it and a recipe that names no modifier of a package never imports that package.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from compress.core.modifier import MODIFIERS, Modifier

log = logging.getLogger(__name__)

# Modules whose import registers the built-in modifiers. Imported on first registry lookup.
BUILTIN_MODIFIER_MODULES: tuple[str, ...] = (
    "compress.quantization.modifiers",
    "compress.quantization.weight_modifiers",
    "compress.quantization.transform_modifiers",
    "compress.pruning.modifiers",
    "compress.pruning.sparse.modifiers",
    "compress.distillation.modifiers",
)

_builtins_loaded = False


def load_builtin_modifiers() -> None:
    """Import the packages that register built-in modifiers (idempotent)."""
    global _builtins_loaded
    if _builtins_loaded:
        return
    _builtins_loaded = True
    for mod in BUILTIN_MODIFIER_MODULES:
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as exc:
            # an optional package left out of an install must not break the others
            if exc.name is not None and mod.startswith(exc.name):
                log.debug("modifier module %s not available: %s", mod, exc)
                continue
            raise


def modifier_types() -> list[str]:
    """The registered modifier ``type`` names, built-ins included."""
    load_builtin_modifiers()
    return MODIFIERS.names()


def modifier_class(type_name: str) -> type[Modifier[Any]]:
    """The Modifier class registered for ``type_name`` (RecipeError listing the valid names on a miss)."""
    load_builtin_modifiers()
    return MODIFIERS.get(type_name)
