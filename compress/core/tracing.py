"""The base of every torch-function tracer in the project: a mode that sees each call, the name a call
arrives under, and the tensors in a call's arguments or results.

Three users: quantization's graph tracer (quantization/placement/trace.py: where quantizers go),
pruning's channel tracer (pruning/trace.py: which channels are coupled) and the MAC counter
(compress/core/size.py). Each keeps its own table of what an op *is* (quantization's kinds key
placement and saved op keys; pruning's rules key on folded names; the counter on the names it
counts): those tables differ in meaning, so they stay with their users.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree


def getter_name(func: Callable[..., Any]) -> str | None:
    """The Tensor property a call reads (``T`` for ``x.T``), None for any other call.

    torch passes a property read to ``__torch_function__`` as the getset descriptor's ``__get__``:
    its name is ``__get__`` whatever the property, and its ``__self__`` (the descriptor) holds the
    property's name."""
    if getattr(func, "__name__", None) != "__get__":
        return None
    return str(getattr(getattr(func, "__self__", None), "__name__", "?"))


def op_name(func: Callable[..., Any]) -> str:
    """The name a torch call arrives under, as written (``add``, ``__add__``, ``__iadd__``, ``add_``,
    ``linear``); ``get:<property>`` for a Tensor property read (see :func:`getter_name`);
    ``str(func)`` for a callable without a name."""
    prop = getter_name(func)
    if prop is not None:
        return "get:" + prop
    return getattr(func, "__name__", None) or str(func)


def tensor_leaves(tree: Any) -> list[tuple[int, torch.Tensor]]:
    """``(flat position, tensor)`` of every tensor among the pytree leaves of ``tree`` (tuples, lists,
    dicts, named tuples, torch's return types, Hugging Face ModelOutputs); positions count every
    leaf, tensor or not, as ``torch.utils._pytree.tree_flatten`` numbers them."""
    return [(i, t) for i, t in enumerate(pytree.tree_leaves(tree)) if isinstance(t, torch.Tensor)]


def iter_tensors(tree: Any) -> Iterator[torch.Tensor]:
    """The tensors of :func:`tensor_leaves`, in the same order, without their positions."""
    for leaf in pytree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            yield leaf


class ObserverMode(TorchFunctionMode):
    """Runs each torch function as called and passes the call and its result to :meth:`observe`.

    The call runs with this mode off, so the calls a function makes inside itself are not seen (a
    ``F.linear`` is one call, not its decomposition). A subclass that must replace a call instead of
    watching it overrides ``__torch_function__`` and hands the calls it keeps to this one."""

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
        """Look at one call after it ran (``out`` is its result); the result is not changed."""
        raise NotImplementedError
