"""The settings objects' bases: every algorithm's one settings class (QuantizeParams, GPTQParams,
AWQParams, PruneParams, ...) derives from :class:`Selection`, and its recipe modifier spec derives
from that same class, so a setting is declared once for YAML and Python alike."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from typing_extensions import Self

from compress.core.errors import RecipeError, validation_message


class ApiParams(BaseModel):
    """A pydantic model whose constructor reports a bad value as a one-line RecipeError naming the
    class and the field (``QuantizeParams: target: ...``), not pydantic's multi-line error with a
    URL. Validation inside a recipe (``model_validate``) is unchanged: it names the recipe line.

    ``renamed`` maps a former field name to the current one: the old name is refused, naming the new."""

    model_config = ConfigDict(extra="forbid")

    renamed: ClassVar[dict[str, str]] = {}

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise RecipeError(f"{type(self).__name__}: {validation_message(exc)}") from None

    # Only a direct construction goes through __init__: a recipe spec made of these settings
    # validates (model_validate) without it, so its errors keep pydantic's field paths and lines.
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    def given(self, where: str, **values: Any) -> Self:
        """This object with the settings an entry point took as keywords (``ignore=``, ``ratio=``;
        None: as set here), validated; one given both ways, differently, is refused."""
        upd: dict[str, Any] = {}
        for name, value in values.items():
            if value is None:
                continue
            if isinstance(value, (tuple, list)) and not isinstance(getattr(self, name), tuple):
                value = list(value)
            if name in self.model_fields_set and value != getattr(self, name):
                raise RecipeError(f"{where}: {name} is given twice, as a keyword and in params, differently; give it once")
            upd[name] = value
        if not upd:
            return self
        try:
            return self.model_validate({**self.model_dump(exclude_unset=True), **upd})
        except ValidationError as exc:
            raise RecipeError(f"{where}: {validation_message(exc)}") from None

    @model_validator(mode="before")
    @classmethod
    def _renamed_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for old, new in cls.renamed.items():
                if old in data:
                    raise ValueError(f"'{old}' is now '{new}'")
        return data


class Selection(ApiParams):
    """What every algorithm shares: the modules it applies to and the calibration batches it reads.

    ``targets``: module-name patterns it applies to (``*``: every supported layer); ``ignore``:
    patterns it leaves alone (a decoder's ``lm_head`` is named explicitly, as llm-compressor's
    recipes do); each pattern must match a module. ``num_batches``: how many calibration batches it
    reads (None: every batch it is given)."""

    targets: list[str] = Field(default_factory=lambda: ["*"])
    ignore: list[str] = Field(default_factory=list)
    num_batches: int | None = Field(None, ge=1)

    renamed: ClassVar[dict[str, str]] = {"max_batches": "num_batches"}


_F = TypeVar("_F", bound=Callable[..., Any])


def refuse_renamed(**renamed: str) -> Callable[[_F], _F]:
    """Decorator: a call passing a keyword by its former name (``forward_loop=``) is refused with a
    TypeError that names the current one, where Python's own error would name only the old."""

    def wrap(fn: _F) -> _F:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            for old, new in renamed.items():
                if old in kwargs:
                    raise TypeError(f"{fn.__name__}(): '{old}=' is now '{new}'")
            return fn(*args, **kwargs)

        return cast(_F, inner)

    return wrap
