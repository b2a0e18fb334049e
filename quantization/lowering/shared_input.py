"""Quantize an activation once for all the layers that read it.

A decoder layer feeds one normalized tensor to q_proj, k_proj and v_proj, and another to gate_proj
and up_proj; each converted layer would quantize it again (a full pass over the activation and a
kernel launch per layer; at decode the launches dominate). Layers whose input quantization is the
same (mode, range, zero point, scale, SmoothQuant factor) share one :class:`SharedCodes`: the first
reads ``x`` and quantizes it, the next ones, given the *same tensor object* unchanged since (its
version counter), reuse the codes. Identity is checked through a weak reference, so a new tensor
that happens to reuse freed memory is never mistaken for the old one. Under CUDA-graph capture the
decision is made once, at capture, and the replay runs one quantization kernel for the group.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import torch
from torch import nn


class SharedCodes:
    """The last quantized input of a group of layers, and the tensor it came from."""

    def __init__(self) -> None:
        self._src: weakref.ref[torch.Tensor] | None = None
        self._version = -1
        self._value: Any = None

    def __getstate__(self) -> dict[str, Any]:
        # torch.save of a converted model: the cached codes and their tensor's weak reference are not state
        return {**self.__dict__, "_src": None, "_version": -1, "_value": None}

    def get(self, x: torch.Tensor, quantize: Callable[[], Any]) -> Any:
        """The codes of ``x``: reused when ``x`` is the tensor quantized last and unchanged, else ``quantize()``."""
        if x.is_inference():
            # torch.inference_mode's tensors have no version counter: an in-place change could not
            # be seen, so nothing is reused (torch.no_grad shares)
            return quantize()
        src = self._src() if self._src is not None else None
        if src is x and x._version == self._version and not torch.is_grad_enabled():
            return self._value
        value = quantize()
        self._src, self._version, self._value = weakref.ref(x), x._version, value
        return value

    def put(self, x: torch.Tensor, value: Any) -> None:
        """Record ``value`` as the codes of ``x`` (computed elsewhere: a FusedRMSNorm's kernel writes
        them with ``x``), so that the group's layers reading ``x`` unchanged reuse them (not for
        inference-mode tensors, see :meth:`get`)."""
        if x.is_inference():
            return
        self._src, self._version, self._value = weakref.ref(x), x._version, value

    def clear(self) -> None:
        """Forget the cached codes (frees their memory)."""
        self._src, self._version, self._value = None, -1, None


def share_input_codes(layers: Iterable[nn.Module], signature: Callable[[nn.Module], Hashable | None]) -> int:
    """Give the layers whose ``signature`` (their input quantization) is equal one SharedCodes each
    group; a None signature opts a layer out. Returns how many layers joined a group of two or more."""
    groups: dict[Hashable, list[nn.Module]] = {}
    for layer in layers:
        sig = signature(layer)
        if sig is not None:
            groups.setdefault(sig, []).append(layer)
    shared = 0
    for members in groups.values():
        if len(members) < 2:
            continue
        cache = SharedCodes()
        for m in members:
            object.__setattr__(m, "shared_codes", cache)  # a plain attribute, not a submodule or buffer
        shared += len(members)
    return shared
