"""Resolve ``pkg.module:attr`` strings from recipes to Python objects, with recipe-grade errors."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from compress.core.errors import RecipeError, closest
from compress.core.trust import require_trust


def is_import_path(name: str) -> bool:
    """Whether ``name`` looks like ``pkg.module:attr`` rather than a registered name."""
    return ":" in name


def import_object(path: str, *, where: str, what: str = "factory") -> Any:
    """The object at ``pkg.module:attr`` (``attr`` may be dotted); RecipeError naming the path and why.

    ``what`` names the attribute in the message for a malformed path (``'pkg.module:factory'``).
    Nothing is imported unless the current scope trusts recipe-named code (compress.core.trust).
    """
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise RecipeError(f"{where}: '{path}' is not of the form 'pkg.module:{what}'")
    require_trust(path, where=where)
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


#: the name on the package index; the import package stays ``compress`` (PyPI's ``compress`` is
#: an unrelated project)
DISTRIBUTION = "compress-toolkit"


def install_hint(extra: str) -> str:
    """The pip command that adds the optional dependencies ``extra`` to *this* installation: the
    clone's path when ``compress`` runs from a source checkout (``pip install -e '.[hf]'``), the
    index name otherwise."""
    root = Path(__file__).resolve().parents[2]  # compress/core/imports.py -> the project root
    project = root / "pyproject.toml"
    try:
        from_clone = project.is_file() and f'name = "{DISTRIBUTION}"' in project.read_text(encoding="utf-8")
    except OSError:
        from_clone = False
    if from_clone:
        shown = "." if root == Path.cwd().resolve() else str(root)
        return f"pip install -e '{shown}[{extra}]'"
    return f"pip install '{DISTRIBUTION}[{extra}]'"
