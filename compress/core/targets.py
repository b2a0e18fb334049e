"""Module selection by name (glob or ``re:`` regex) and by type (``type:Conv2d``).

A pattern that matches nothing is an error naming it (like NNCF's ``IgnoredScope(validate=True)``):
a silent miss means a layer the user asked about was quietly left alone.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Sequence

from torch import nn

from compress.core.errors import TargetMatchError


def _type_names(module: nn.Module) -> set[str]:
    names: set[str] = set()
    for cls in type(module).__mro__:
        names.add(cls.__name__)
        names.add(f"{cls.__module__}.{cls.__qualname__}")
    return names


def pattern_matches(pattern: str, name: str, module: nn.Module) -> bool:
    """Whether ``pattern`` selects the module called ``name``."""
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], name) is not None
    if pattern.startswith("type:"):
        return pattern[5:] in _type_names(module)
    return fnmatch.fnmatchcase(name, pattern)


def _check_pattern(pattern: str, where: str) -> None:
    if pattern.startswith("re:"):
        try:
            re.compile(pattern[3:])
        except re.error as exc:
            raise TargetMatchError(f"{where}: invalid regex '{pattern}': {exc}") from None


def select_modules(
    model: nn.Module,
    targets: Sequence[str],
    *,
    ignore: Sequence[str] = (),
    types: tuple[type[nn.Module], ...] | None = None,
    where: str = "targets",
    require_match: bool = True,
) -> dict[str, nn.Module]:
    """Modules of ``model`` matched by ``targets`` and not by ``ignore``, in model order.

    ``types`` restricts the result to the module kinds a transform supports; a target pattern
    counts as matched when it selects any module, so that ``"*"`` with a type filter is fine.
    Every pattern, target and ignore, must match at least one module or TargetMatchError names it.
    """
    for p in (*targets, *ignore):
        _check_pattern(p, where)
    named = [(n, m) for n, m in model.named_modules() if n]
    hit_t = dict.fromkeys(targets, False)
    hit_i = dict.fromkeys(ignore, False)
    out: dict[str, nn.Module] = {}
    for name, mod in named:
        selected = False
        for p in targets:
            if pattern_matches(p, name, mod) and (types is None or isinstance(mod, types)):
                hit_t[p] = True
                selected = True
        ignored = False
        for p in ignore:
            if pattern_matches(p, name, mod):
                hit_i[p] = True
                ignored = True
        if selected and not ignored:
            out[name] = mod
    if require_match:
        missing_t = [p for p, hit in hit_t.items() if not hit]
        missing_i = [p for p, hit in hit_i.items() if not hit]
        if missing_t or missing_i:
            kinds = f" of type {'/'.join(t.__name__ for t in types)}" if types and missing_t else ""
            # name the list the pattern came from: callers pass where as "...: targets"
            at = where if missing_t else (where[: -len("targets")] + "ignore" if where.endswith("targets")
                                           else f"{where}: ignore")
            raise TargetMatchError(
                f"{at}: pattern '{(missing_t or missing_i)[0]}' matches no module{kinds} in {type(model).__name__}"
                f" (module names look like: {_examples(n for n, _ in named)})"
            )
    return out


def _examples(names: Iterable[str], k: int = 4) -> str:
    lst = list(names)
    return ", ".join(lst[:k]) + (", ..." if len(lst) > k else "") if lst else "<none>"
