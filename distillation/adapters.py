"""Trained adapters that map a student feature's width onto its teacher's.

Built from the shapes the first batch shows and rebuilt when the student's width changes (a
pruning step in the same stage). Their parameters ride in the caller's optimizer; under DDP their
gradients are averaged across ranks, since they live outside the wrapped model.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from compress.core.errors import RecipeError

log = logging.getLogger(__name__)


def _shape(t: torch.Tensor) -> str:
    return "x".join(str(d) for d in t.shape)


def make_adapter(student: torch.Tensor, teacher: torch.Tensor, *, where: str) -> nn.Module:
    """A 1x1 Conv2d for NCHW maps, a Linear over the last dim otherwise (FitNets' regressor)."""
    if student.dim() == 4:
        if student.shape[2:] != teacher.shape[2:]:
            raise RecipeError(
                f"{where}: feature maps differ in spatial size (student {_shape(student)}, teacher {_shape(teacher)});"
                " map layers of the same resolution"
            )
        return nn.Conv2d(student.shape[1], teacher.shape[1], 1, bias=False)
    if student.shape[:-1] != teacher.shape[:-1]:
        raise RecipeError(
            f"{where}: features differ in more than their width (student {_shape(student)}, teacher {_shape(teacher)})"
        )
    return nn.Linear(student.shape[-1], teacher.shape[-1], bias=False)


def _fits(adapter: nn.Module, student: torch.Tensor, teacher: torch.Tensor) -> bool:
    if isinstance(adapter, nn.Conv2d):
        return student.dim() == 4 and adapter.in_channels == student.shape[1] and adapter.out_channels == teacher.shape[1]
    if isinstance(adapter, nn.Linear):
        return adapter.in_features == student.shape[-1] and adapter.out_features == teacher.shape[-1]
    return False


class AdapterSet:
    """Adapters by key (one per mapped feature), built on demand and kept in a bound optimizer."""

    def __init__(self) -> None:
        self.modules = nn.ModuleDict()
        self._optimizer: torch.optim.Optimizer | None = None
        self._in_optimizer: list[nn.Parameter] = []

    def adapt(
        self, key: str, student: torch.Tensor, teacher: torch.Tensor, *, mode: str, where: str
    ) -> torch.Tensor:
        """``student`` mapped to the teacher's shape (unchanged when the shapes already agree)."""
        mk = key.replace(".", "__")  # ModuleDict keys may not hold dots
        if student.shape == teacher.shape and mk not in self.modules:
            return student
        if mode == "none":
            raise RecipeError(
                f"{where}: student feature {_shape(student)} and teacher feature {_shape(teacher)} differ;"
                " set adapter: auto to learn a mapping"
            )
        adapter = self.modules[mk] if mk in self.modules else None  # noqa: SIM401 (no ModuleDict.get on older torch)
        if student.shape == teacher.shape and adapter is not None and not _fits(adapter, student, teacher):
            del self.modules[mk]  # widths agree again: the identity is the right map
            self.sync_optimizer()
            return student
        if adapter is None or not _fits(adapter, student, teacher):
            if adapter is not None:
                log.info("%s: student width of '%s' changed to %s; rebuilding its adapter", where, key, _shape(student))
            adapter = make_adapter(student, teacher, where=where).to(student.device)
            _broadcast(adapter)
            _sync_grads(list(adapter.parameters()))
            self.modules[mk] = adapter
            self.sync_optimizer()
        return adapter(student.float())

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.modules.parameters()

    def bind_optimizer(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Keep the adapters' parameters in ``optimizer`` from now on (None unbinds)."""
        if optimizer is not self._optimizer:
            self._drop_from_optimizer()
            self._optimizer = optimizer
        self.sync_optimizer()

    def sync_optimizer(self) -> None:
        """Make the bound optimizer train exactly the current adapters."""
        opt = self._optimizer
        current = list(self.modules.parameters())
        if opt is None or [id(p) for p in current] == [id(p) for p in self._in_optimizer]:
            return
        self._drop_from_optimizer()
        if not current:
            return
        # Joined to the last existing group, not a new one: LR schedulers zip their per-group
        # lists with the optimizer's groups strictly, and a group added mid-run breaks them.
        opt.param_groups[-1]["params"].extend(current)
        self._in_optimizer = current

    def _drop_from_optimizer(self) -> None:
        opt = self._optimizer
        if opt is None or not self._in_optimizer:
            self._in_optimizer = []
            return
        ids = {id(p) for p in self._in_optimizer}
        for group in opt.param_groups:
            group["params"] = [p for p in group["params"] if id(p) not in ids]
        for p in self._in_optimizer:
            opt.state.pop(p, None)
        self._in_optimizer = []

    def close(self) -> None:
        """Take the adapters out of the bound optimizer and forget it."""
        self._drop_from_optimizer()
        self._optimizer = None


def _ddp() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _broadcast(adapter: nn.Module) -> None:
    # every rank must start from the same adapter weights
    if _ddp():
        for p in adapter.parameters():
            dist.broadcast(p.data, src=0)


def _sync_grads(params: list[nn.Parameter]) -> None:
    if not _ddp():
        return
    world = dist.get_world_size()
    for p in params:
        if getattr(p, "_distill_grad_sync", False):
            continue

        def average(param: torch.Tensor) -> None:
            if param.grad is not None:
                dist.all_reduce(param.grad)
                param.grad /= world

        p.register_post_accumulate_grad_hook(average)
        p._distill_grad_sync = True  # type: ignore[attr-defined]
