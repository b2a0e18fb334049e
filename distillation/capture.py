"""Feature capture by removable forward hooks.

A root-level forward pre-hook re-resolves the named layers at the start of every forward, so the
capture follows modules that another modifier swapped in the same stage (fake-quant module swap,
pruning surgery): the hooks always sit on the modules the model runs now.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from compress.core.errors import TargetMatchError, did_you_mean


def first_tensor(output: Any) -> torch.Tensor | None:
    """The tensor a layer produced: itself, or the first tensor of a tuple / dict / model output."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        for item in output:
            t = first_tensor(item)
            if t is not None:
                return t
    return None


def check_layers(model: nn.Module, names: Iterable[str], *, where: str, role: str) -> None:
    """Raise TargetMatchError for a layer name ``model`` does not have."""
    known = {n for n, _ in model.named_modules() if n}
    for name in names:
        if name not in known:
            raise TargetMatchError(
                f"{where}: {role} layer '{name}' not found in {type(model).__name__}; {_suggest(name, known)}"
            )


def _suggest(name: str, known: set[str]) -> str:
    hint = did_you_mean(name, known)
    # the full list of a large model is noise: keep the hint and a few examples
    if len(known) > 12:
        close = hint[hint.find("(did you mean") :] if "(did you mean" in hint else ""
        examples = ", ".join(sorted(known, key=lambda n: (n.count("."), n))[:6])
        return f"layers look like: {examples}, ... {close}".rstrip()
    return hint


class FeatureCapture:
    """Records the outputs of named layers of ``model`` on each forward, until :meth:`remove`.

    ``detach`` stores outputs without their graph (for the teacher). ``pop()`` returns and clears
    what the last forward recorded.
    """

    def __init__(self, model: nn.Module, names: Iterable[str], *, where: str, role: str, detach: bool = False) -> None:
        self.names = list(dict.fromkeys(names))
        self.where, self.role, self.detach = where, role, detach
        self.model = model
        self.features: dict[str, torch.Tensor] = {}
        self._hooked: dict[str, tuple[nn.Module, RemovableHandle]] = {}
        self._root: RemovableHandle | None = None
        if self.names:
            check_layers(model, self.names, where=where, role=role)
            self._root = model.register_forward_pre_hook(self._refresh)
            self._refresh(model, ())

    def _refresh(self, _module: nn.Module, _args: Any) -> None:
        for name in self.names:
            try:
                mod = self.model.get_submodule(name)
            except AttributeError:
                raise TargetMatchError(
                    f"{self.where}: {self.role} layer '{name}' disappeared from {type(self.model).__name__}"
                ) from None
            held = self._hooked.get(name)
            if held is not None and held[0] is mod:
                continue
            if held is not None:
                held[1].remove()
            self._hooked[name] = (mod, mod.register_forward_hook(self._recorder(name)))

    def _recorder(self, name: str) -> Any:
        def hook(_mod: nn.Module, _inp: Any, out: Any) -> None:
            t = first_tensor(out)
            if t is not None:
                self.features[name] = t.detach() if self.detach else t

        return hook

    def pop(self) -> dict[str, torch.Tensor]:
        out, self.features = self.features, {}
        return out

    def remove(self) -> None:
        """Remove every hook this capture placed; the model runs exactly as before."""
        for _, handle in self._hooked.values():
            handle.remove()
        self._hooked.clear()
        if self._root is not None:
            self._root.remove()
            self._root = None
        self.features = {}

    @property
    def active(self) -> bool:
        return self._root is not None
