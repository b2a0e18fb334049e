"""The dry-run scope: inside it nothing is written anywhere (run folders, caches, conversions).

``compress apply --dry-run``, ``inspect`` and ``plan()`` open it; code that would write a cache
(the GGUF conversion) asks :func:`is_dry_run` and says what it would write instead.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager

_dry: contextvars.ContextVar[bool] = contextvars.ContextVar("compress_dry_run", default=False)


def is_dry_run() -> bool:
    """Whether the current scope promised to write nothing."""
    return _dry.get()


@contextmanager
def dry_run() -> Iterator[None]:
    """Nothing inside the block may write a file (caches included)."""
    token = _dry.set(True)
    try:
        yield
    finally:
        _dry.reset(token)
