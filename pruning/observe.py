"""``ObserverMode``: a ``__torch_function__`` mode that runs every op unchanged, then shows it to a hook."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.overrides import TorchFunctionMode


class ObserverMode(TorchFunctionMode):
    """Runs each torch function as called and passes the call and its result to :meth:`observe`."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.observe(func, args, kwargs, out)
        return out

    def observe(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Look at one op after it ran (``out`` is its result); the op's result is not changed."""
        raise NotImplementedError
