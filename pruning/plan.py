"""PruningPlan: the record of what pruning removed, replayable on a fresh model instance.

A plan is a list of steps (one per pruning step of an iterative schedule); each step maps tensor
names to ``[axis, kept indices]`` pairs. Replaying it slices a freshly built model to the exact
pruned architecture, so a pruned checkpoint loads with ``strict=True``::

    model = build_model()
    PruningPlan.load("plan.json").apply(model)
    model.load_state_dict(torch.load("pruned.pt", weights_only=True))
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compress.pruning.apply import Slices, apply_slices
from torch import nn

from compress.core.bounded import load_json_file
from compress.core.errors import CompressError, RecipeError

FORMAT = "compress.pruning_plan"
VERSION = 1


@dataclass
class PruningPlan:
    """Ordered pruning steps plus a summary (params/MACs before and after, for readers)."""

    steps: list[Slices] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)

    def add_step(self, slices: Slices) -> None:
        if slices:
            self.steps.append({k: [(int(a), [int(i) for i in kept]) for a, kept in v] for k, v in slices.items()})

    def apply(self, model: nn.Module) -> nn.Module:
        """Slice ``model`` (a fresh instance of the unpruned architecture) in place; returns it.
        Packed MoE experts are unpacked first, as :func:`pruning.api.prune` did before cutting."""
        from compress.core.moe import unpack_experts

        unpack_experts(model)
        for step in self.steps:
            apply_slices(model, step)
        return model

    @property
    def removed(self) -> int:
        """Number of tensor slices the plan makes (0 for an empty plan)."""
        return sum(len(v) for s in self.steps for v in s.values())

    # ---- serialization ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "summary": self.summary,
            "steps": [{k: [[a, list(kept)] for a, kept in v] for k, v in step.items()} for step in self.steps],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "pruning plan") -> PruningPlan:
        if data.get("format") != FORMAT:
            raise RecipeError(f"{where}: not a pruning plan (format is {data.get('format')!r}, expected '{FORMAT}')")
        if data.get("version") != VERSION:
            raise RecipeError(f"{where}: unsupported pruning plan version {data.get('version')!r}; this build reads {VERSION}")
        steps_raw = data.get("steps")
        if not isinstance(steps_raw, list):
            raise RecipeError(f"{where}: 'steps' must be a list")
        plan = cls(summary=dict(data.get("summary") or {}))
        for i, step in enumerate(steps_raw):
            if not isinstance(step, Mapping):
                raise RecipeError(f"{where}: steps.{i} must be a mapping of tensor name to [axis, kept]")
            plan.steps.append({str(k): [_entry(e, f"{where}: steps.{i}.{k}") for e in v] for k, v in step.items()})
        return plan

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_dict(), separators=(",", ":")))
        return p

    @classmethod
    def load(cls, path: str | Path) -> PruningPlan:
        p = Path(path)
        if not p.is_file():
            raise RecipeError(f"{p}: pruning plan not found")
        try:
            data = load_json_file(p, what="pruning plan")
        except (OSError, ValueError) as exc:
            raise RecipeError(f"{p}: cannot read pruning plan: {exc}") from None
        if not isinstance(data, Mapping):
            raise RecipeError(f"{p}: a pruning plan is a JSON object")
        return cls.from_dict(data, where=str(p))


def _entry(e: Any, where: str) -> tuple[int, list[int]]:
    if not (isinstance(e, Sequence) and len(e) == 2 and isinstance(e[0], int) and isinstance(e[1], Sequence)):
        raise RecipeError(f"{where}: each entry is [axis, [kept indices]]")
    kept = list(e[1])
    if not all(isinstance(i, int) and i >= 0 for i in kept):
        raise CompressError(f"{where}: kept indices must be non-negative integers")
    return int(e[0]), kept
