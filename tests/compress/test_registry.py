"""The name registry, the modifier registry on top of it, and the error taxonomy's helpers."""

from __future__ import annotations

from typing import Any, Literal

import pytest

from compress.core.errors import (
    CalibrationError,
    CompressError,
    ExportError,
    RecipeError,
    TargetMatchError,
    UnsupportedModelError,
    ValidationFailed,
    closest,
    did_you_mean,
)
from compress.core.modifier import (
    MODIFIERS,
    Modifier,
    ModifierSpec,
    register_modifier,
)
from compress.core.registry import Registry
from compress.modifiers import modifier_class, modifier_types


def _fruit() -> Registry[int]:
    reg: Registry[int] = Registry("fruit")
    reg.add("apple", 1)
    reg.add("banana", 2)
    reg.add("cherry", 3)
    return reg


def test_add_get_and_listing() -> None:
    reg = _fruit()
    assert reg.get("banana") == 2
    assert reg.names() == ["apple", "banana", "cherry"]
    assert list(reg) == ["apple", "banana", "cherry"]
    assert "apple" in reg
    assert "durian" not in reg


def test_names_are_sorted_whatever_the_insertion_order() -> None:
    reg: Registry[str] = Registry("thing")
    for n in ["zeta", "alpha", "mu"]:
        reg.add(n, n.upper())
    assert reg.names() == ["alpha", "mu", "zeta"]


def test_register_decorator_returns_the_object_unchanged() -> None:
    reg: Registry[Any] = Registry("handler")

    @reg.register("double")
    def double(x: int) -> int:
        return 2 * x

    assert double(4) == 8
    assert reg.get("double") is double


def test_duplicate_is_refused_and_the_first_entry_kept() -> None:
    reg = _fruit()
    with pytest.raises(ValueError, match=r"^fruit 'apple' is already registered$"):
        reg.add("apple", 99)
    assert reg.get("apple") == 1

    with pytest.raises(ValueError, match="fruit 'banana' is already registered"):
        reg.register("banana")(42)
    assert reg.get("banana") == 2


def test_miss_lists_valid_names_and_suggests_the_closest() -> None:
    reg = _fruit()
    with pytest.raises(RecipeError) as info:
        reg.get("bananna")
    assert str(info.value) == "unknown fruit 'bananna'; valid: apple, banana, cherry (did you mean 'banana'?)"
    assert info.value.exit_code == 2


def test_miss_without_a_close_name_gives_no_suggestion() -> None:
    with pytest.raises(RecipeError) as info:
        _fruit().get("xylophone")
    assert str(info.value) == "unknown fruit 'xylophone'; valid: apple, banana, cherry"
    assert "did you mean" not in str(info.value)


def test_closest_and_did_you_mean() -> None:
    assert closest("epocs", ["epochs", "steps", "lr"]) == "epochs"
    assert closest("qqq", ["epochs", "steps"]) is None
    assert did_you_mean("stps", {"steps", "epochs"}) == "valid: epochs, steps (did you mean 'steps'?)"
    assert did_you_mean("zzz", ("b", "a")) == "valid: a, b"


def test_error_taxonomy_and_exit_codes() -> None:
    for cls in (
        RecipeError,
        TargetMatchError,
        UnsupportedModelError,
        CalibrationError,
        ExportError,
        ValidationFailed,
    ):
        assert issubclass(cls, CompressError)
    assert [c.exit_code for c in (CompressError, RecipeError, TargetMatchError, UnsupportedModelError)] == [
        1,
        2,
        2,
        2,
    ]
    # bad calibration data is the user's to fix (2); a failed export is ours (1)
    assert [c.exit_code for c in (CalibrationError, ExportError, ValidationFailed)] == [2, 1, 3]


# ---- the modifier registry --------------------------------------------------------------------


def test_test_modifiers_are_registered_by_their_type_literal() -> None:
    types = modifier_types()
    for name in ("test_noop", "test_calib", "test_train", "test_loss"):
        assert name in types
        assert modifier_class(name).spec_cls.model_fields["type"].default == name
    assert types == sorted(types)


def test_registering_a_modifier_type_twice_is_refused() -> None:
    class OtherNoopSpec(ModifierSpec):
        type: Literal["test_noop"] = "test_noop"

    class OtherNoop(Modifier[OtherNoopSpec]):
        spec_cls = OtherNoopSpec

    original = modifier_class("test_noop")
    with pytest.raises(ValueError, match="modifier type 'test_noop' is already registered"):
        register_modifier(OtherNoop)
    assert modifier_class("test_noop") is original


def test_a_spec_without_a_type_default_cannot_register() -> None:
    class NoDefaultSpec(ModifierSpec):
        type: str

    class NoDefault(Modifier[NoDefaultSpec]):
        spec_cls = NoDefaultSpec

    before = MODIFIERS.names()
    with pytest.raises(TypeError, match=r"NoDefaultSpec\.type needs a string default"):
        register_modifier(NoDefault)
    assert MODIFIERS.names() == before


def test_unknown_modifier_type_names_valid_types_and_the_closest() -> None:
    with pytest.raises(RecipeError) as info:
        modifier_class("test_calb")
    msg = str(info.value)
    assert msg.startswith("unknown modifier type 'test_calb'; valid: ")
    assert msg.endswith("(did you mean 'test_calib'?)")
    for name in ("test_noop", "test_calib", "test_train", "test_loss"):
        assert name in msg
    assert "\n" not in msg
