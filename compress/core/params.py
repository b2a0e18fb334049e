"""The base of the public ``*Params`` models (QuantizeParams, GPTQParams, AWQParams, PruneParams)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from compress.core.errors import RecipeError, validation_message


class ApiParams(BaseModel):
    """A pydantic model whose constructor reports a bad value as a one-line RecipeError naming the
    class and the field (``QuantizeParams: target: ...``), not pydantic's multi-line error with a
    URL. Validation inside a recipe (``model_validate``) is unchanged: it names the recipe line."""

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise RecipeError(f"{type(self).__name__}: {validation_message(exc)}") from None
