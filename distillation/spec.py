"""Typed specs of distillation: loss terms (discriminated by ``type``), their weight schedule, and
the teacher. Shared by the ``distill`` recipe modifier and :class:`distillation.api.Distiller`."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from compress.core.errors import did_you_mean
from compress.core.reference import ModelSpec


class LossTerm(BaseModel):
    """Fields every loss term has: an optional ``name`` and a weight with a schedule.

    The weight goes from ``weight`` to ``weight_end`` over the modifier's active window (or the
    Distiller's ``total_steps``), linearly or along a half cosine; ``constant`` keeps ``weight``.
    """

    model_config = ConfigDict(extra="forbid")

    type: str
    name: str | None = None
    weight: float = Field(1.0, ge=0)
    weight_end: float | None = Field(None, ge=0)
    weight_schedule: Literal["constant", "linear", "cosine"] = "constant"

    @model_validator(mode="after")
    def _schedule_has_end(self) -> LossTerm:
        if self.weight_schedule != "constant" and self.weight_end is None:
            raise ValueError(f"weight_schedule '{self.weight_schedule}' needs weight_end")
        if self.weight_schedule == "constant" and self.weight_end is not None:
            raise ValueError("weight_end needs weight_schedule 'linear' or 'cosine'")
        return self

    @property
    def scheduled(self) -> bool:
        return self.weight_schedule != "constant"

    def weight_at(self, progress: float) -> float:
        """The weight at ``progress`` in [0, 1] of the schedule."""
        if self.weight_end is None or self.weight_schedule == "constant":
            return self.weight
        p = min(max(progress, 0.0), 1.0)
        if self.weight_schedule == "cosine":
            p = 0.5 * (1.0 - math.cos(math.pi * p))
        return self.weight + (self.weight_end - self.weight) * p


class KDLoss(LossTerm):
    """Logit distillation: ``T^2 * KL(teacher || student)`` at temperature ``temperature``."""

    type: Literal["kd"] = "kd"
    temperature: float = Field(4.0, gt=0)


#: a student or teacher layer index in a ``layers`` mapping (0-based; the model's count bounds it above
#: when the models are known)
LayerIndex = Annotated[int, Field(ge=0)]


class SoftTargetLoss(LossTerm):
    """Cross entropy against the teacher's softened class distribution (scaled by ``T^2``)."""

    type: Literal["soft_ce"] = "soft_ce"
    temperature: float = Field(1.0, gt=0)


class FeatureLoss(LossTerm):
    """Hint distillation of intermediate features: ``layers`` maps student module names to teacher
    module names. With ``adapter: auto`` a trained 1x1 conv (conv maps) or Linear (token/vector
    features) maps the student's width to the teacher's when they differ (after pruning, or a
    narrower student); ``none`` makes a mismatch an error."""

    type: Literal["feature"] = "feature"
    layers: dict[str, str] = Field(min_length=1)
    adapter: Literal["auto", "none"] = "auto"
    normalize: bool = False


class HiddenStateLoss(LossTerm):
    """Transformer hidden-state distillation (MSE over non-padding tokens). ``layers`` maps student
    hidden-state indices (0 = embeddings) to teacher indices; None maps the student's layers
    uniformly onto the teacher's (TinyBERT's mapping). Adapters as for ``feature``."""

    type: Literal["hidden_states"] = "hidden_states"
    layers: dict[LayerIndex, LayerIndex] | None = None
    adapter: Literal["auto", "none"] = "auto"
    normalize: bool = False


class AttentionLoss(LossTerm):
    """Transformer attention distillation: KL between teacher and student attention maps (MiniLM).
    ``layers`` maps student layer indices (0-based) to teacher layers; None maps uniformly.
    Head counts must match. The models run eager attention while this is active."""

    type: Literal["attention"] = "attention"
    layers: dict[LayerIndex, LayerIndex] | None = None


class CosineLoss(LossTerm):
    """Sentence-embedding distillation: ``1 - cos`` between pooled student and teacher embeddings.
    ``pooling``: ``mean`` over non-padding tokens, ``cls`` (first token) or ``pooler`` (the model's
    pooler output); outputs that already are [B, D] embeddings are used as they are."""

    type: Literal["cosine"] = "cosine"
    pooling: Literal["mean", "cls", "pooler"] = "mean"
    adapter: Literal["auto", "none"] = "auto"


LossSpec = Annotated[
    KDLoss | SoftTargetLoss | FeatureLoss | HiddenStateLoss | AttentionLoss | CosineLoss,
    Field(discriminator="type"),
]

LOSS_CLASSES: dict[str, type[LossTerm]] = {
    "kd": KDLoss, "soft_ce": SoftTargetLoss, "feature": FeatureLoss,
    "hidden_states": HiddenStateLoss, "attention": AttentionLoss, "cosine": CosineLoss,
}


def _value_error(loc: tuple[Any, ...], message: str, value: Any) -> ValidationError:
    return ValidationError.from_exception_data(
        "LossTerm", [{"type": "value_error", "loc": loc, "input": value, "ctx": {"error": ValueError(message)}}]
    )


def coerce_losses(value: Any) -> Any:
    """Mappings in a loss list to their typed terms, dispatched on ``type``.

    Errors carry the item's index and the field (``1.temperatur``) and name the valid types or
    fields of *that* term, where a plain discriminated union would put the union's tag in the path.
    """
    if not isinstance(value, list):
        return value
    out: list[Any] = []
    for i, item in enumerate(value):
        if not isinstance(item, Mapping):
            out.append(item)
            continue
        t = item.get("type")
        if t not in LOSS_CLASSES:
            if t is None:
                raise _value_error((i, "type"), f"a loss term needs a 'type'; valid: {', '.join(LOSS_CLASSES)}", t)
            raise _value_error((i, "type"), f"unknown loss type {t!r}; {did_you_mean(str(t), list(LOSS_CLASSES))}", t)
        cls = LOSS_CLASSES[str(t)]
        try:
            out.append(cls.model_validate(item))
        except ValidationError as exc:
            errors = exc.errors()
            # a misspelt field explains the "missing" error that comes with it: report the typo
            err = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
            loc = (i, *err["loc"])
            if err["type"] == "extra_forbidden":
                bad = str(err["loc"][-1])
                raise _value_error(loc, f"unknown field '{bad}'; {did_you_mean(bad, list(cls.model_fields))}", err["input"]) from None
            line = {"type": err["type"], "loc": loc, "input": err["input"]}
            if "ctx" in err:
                line["ctx"] = err["ctx"]
            raise ValidationError.from_exception_data(exc.title, [line]) from None  # type: ignore[list-item]
    return out

TeacherDtype = Literal["float32", "float16", "bfloat16"]


class TeacherSpec(ModelSpec):
    """A teacher loaded like the recipe's model (zoo name, ``pkg.module:factory``, checkpoint or
    Hugging Face path). A zoo or factory teacher without a checkpoint must set ``train_epochs``:
    it is then trained on the run's training data first (``train_lr`` overrides the recipe's lr)."""

    train_epochs: float = Field(0, ge=0)
    train_lr: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _has_weights(self) -> TeacherSpec:
        if self.name is not None and self.checkpoint is None and self.train_epochs == 0:
            raise ValueError(
                f"teacher '{self.name}' has no weights: set teacher.checkpoint, or teacher.train_epochs to train it first"
            )
        return self
