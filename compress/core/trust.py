"""Which code a recipe may run: the trust rule, like transformers' ``trust_remote_code``.

What the project's own registries name (zoo models, data sources, metrics, modifiers, shipped
recipes) always runs. A ``pkg.module:attr`` string in a recipe field marked as a code reference
(:data:`CODE_REF`: the model and teacher factories, a data factory, a metric function) names code
that a recipe file, shared like a model repository, would otherwise run silently: it is imported
only inside an :func:`allow_code` scope, which the CLI's ``--trust-code`` and the API's
``trust_code=True`` open. ``--dry-run``, ``inspect`` and ``plan()`` never import such a module,
trusted or not: :func:`locate` finds its file without executing anything.
"""

from __future__ import annotations

import contextvars
import importlib.machinery
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from compress.core.errors import RecipeError

#: the switch, as the CLI spells it and as the Python API spells it
CLI_SWITCH = "--trust-code"
API_SWITCH = "trust_code=True"

#: ``Field(json_schema_extra=CODE_REF)`` marks a spec field whose ``pkg.module:attr`` value is code
CODE_REF: dict[str, Any] = {"code_ref": True}

_trusted: contextvars.ContextVar[bool] = contextvars.ContextVar("compress_trusted_code", default=False)


class UntrustedCodeError(RecipeError):
    """A recipe names code outside the project's registries and the user did not trust it."""


def code_trusted() -> bool:
    """Whether code named by the recipe being run may be imported here."""
    return _trusted.get()


@contextmanager
def allow_code(enabled: bool = True) -> Iterator[None]:
    """Let recipe-named code run inside the block when ``enabled`` (never revokes an outer grant)."""
    token = _trusted.set(True) if enabled else None
    try:
        yield
    finally:
        if token is not None:
            _trusted.reset(token)


@contextmanager
def no_code() -> Iterator[None]:
    """Refuse recipe-named code inside the block, whatever an outer scope granted (plans, inspect)."""
    token = _trusted.set(False)
    try:
        yield
    finally:
        _trusted.reset(token)


def refusal(path: str, where: str) -> UntrustedCodeError:
    """The one-line refusal for running ``path`` without trust; ``where`` is ``file:line: field``."""
    return UntrustedCodeError(
        f"{where}: '{path}' is code outside compress's registries, and a recipe runs such code only when "
        f"you trust it: pass {CLI_SWITCH} (Python: {API_SWITCH})"
    )


def require_trust(path: str, *, where: str) -> None:
    """Raise :func:`refusal` unless the current scope trusts recipe-named code."""
    if not code_trusted():
        raise refusal(path, where)


def locate(path: str) -> str:
    """Where the module of ``pkg.module:attr`` would be imported from, found without importing or
    executing anything (``importlib.util.find_spec`` would run the parent packages' ``__init__``)."""
    module_name = path.partition(":")[0]
    parts = module_name.split(".")
    search: Any = None
    spec: Any = None
    for i in range(len(parts)):
        name = ".".join(parts[: i + 1])
        loaded = sys.modules.get(name)
        if loaded is not None:
            spec = getattr(loaded, "__spec__", None)
            search = getattr(loaded, "__path__", None)
            if spec is None:
                return f"module '{name}' (already imported)"
            continue
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            try:
                spec = find(name, search)
            except (ImportError, ValueError, TypeError):
                spec = None
            if spec is not None:
                break
        if spec is None:
            return f"module '{module_name}' not found on sys.path"
        search = spec.submodule_search_locations
        if search is None and i < len(parts) - 1:
            return f"module '{module_name}' not found ('{name}' is not a package)"
    origin = getattr(spec, "origin", None)
    if origin in (None, "built-in", "frozen") or isinstance(spec.loader, importlib.machinery.BuiltinImporter):
        return f"module '{module_name}' (built into Python)"
    return f"module '{module_name}' at {Path(origin)}"


def code_refs(spec: BaseModel, prefix: str = "") -> list[tuple[str, str]]:
    """``(field path, 'pkg.module:attr')`` for every code reference set in ``spec`` and the specs it
    holds (lists and mappings of specs included), in field order. ``trust_remote_code: true`` in a
    spec's ``kwargs`` (transformers runs the model directory's own Python files) counts too."""
    out: list[tuple[str, str]] = []

    def walk(value: Any, path: str) -> None:
        if isinstance(value, BaseModel):
            kwargs = getattr(value, "kwargs", None)
            if isinstance(kwargs, dict) and kwargs.get("trust_remote_code"):
                source = getattr(value, "hf_path", None) or getattr(value, "name", None)
                out.append((f"{path}.kwargs.trust_remote_code" if path else "kwargs.trust_remote_code",
                            f"{source} (trust_remote_code)"))
            for name, field in type(value).model_fields.items():
                sub = getattr(value, name, None)
                key = f"{path}.{field.alias or name}" if path else (field.alias or name)
                extra = field.json_schema_extra
                if isinstance(extra, dict) and extra.get("code_ref") and isinstance(sub, str) and ":" in sub:
                    out.append((key, sub))
                else:
                    walk(sub, key)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{path}.{i}")
        elif isinstance(value, dict):
            for k, v in value.items():
                if isinstance(v, (BaseModel, list, tuple, dict)):
                    walk(v, f"{path}.{k}")

    walk(spec, prefix)
    return out
