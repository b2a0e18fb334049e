"""Every number a recipe can hold is bounded where it is read: a value that cannot work fails as
the recipe loads (one line naming the file, the line and the field), not minutes into the run.

The walk starts at ``compress.recipe.Recipe`` and every modifier spec registered under a recipe
``type`` (plus the distillation loss terms and the observers' typed params, which a recipe reaches
through discriminated unions and ``observer_params``) and visits every pydantic model a field can
hold. Each int or float in a field, a list item, a dict key or a dict value must carry a bound
(``ge``/``gt``/``le``/``lt``), or be listed below with the reason any value is valid or with the
validator that bounds it (and a value it refuses, which the test feeds it).
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import annotated_types as at
import pytest
import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

import compress
from compress.core.errors import RecipeError
from compress.modifiers import modifier_class, modifier_types
from compress.recipe import Recipe
from tests.compress.cases import TINY_YAML

# ---- the allow-lists ---------------------------------------------------------------------------------

#: fields where every value of the type is valid: nothing to bound
ANY_VALUE: dict[str, str] = {}

#: fields bounded by a validator of their own (its message is worded for the field), with a
#: mapping the spec refuses because of that bound: ``(spec fields, the value of the field)``
VALIDATED: dict[str, tuple[dict[str, Any], Any]] = {
    # pruning.api.check_ratio: ratio in [0, 1)
    "PruneSpec.ratio": ({"type": "prune"}, 1.0),
    # pruning.api.check_ratio: target {params|macs: fraction in (0, 1]}
    "PruneSpec.budget": ({"type": "prune"}, {"macs": 1.5}),
    # PruneParams._ratios: every override ratio in [0, 1)
    "PruneSpec.overrides": ({"type": "prune", "ratio": 0.5}, {"head": 1.0}),
}

_BOUNDS = (at.Ge, at.Gt, at.Le, at.Lt, at.Interval)


# ---- the walk ----------------------------------------------------------------------------------------


def _root_classes() -> list[type[BaseModel]]:
    from compress.distillation.spec import LOSS_CLASSES
    from compress.quantization.numerics.observers import OBSERVERS

    # the test suite's own modifiers (tests/compress/conftest.py registers a few) are no recipe schema
    specs = [modifier_class(t).spec_cls for t in modifier_types()]
    return [
        Recipe,
        *(s for s in specs if not s.__module__.startswith("tests.")),
        *LOSS_CLASSES.values(),
        *(OBSERVERS.get(name).Params for name in OBSERVERS.names()),  # what observer_params validate into
    ]


def _metadata(extra: Sequence[Any]) -> list[Any]:
    out: list[Any] = []
    for e in extra:
        out.extend(e.metadata if isinstance(e, FieldInfo) else [e])
    return out


def _models_in(ann: Any) -> Iterator[type[BaseModel]]:
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        yield ann
        return
    for a in typing.get_args(ann):
        yield from _models_in(a)


def _numeric_leaves(ann: Any, meta: list[Any], where: str = "") -> Iterator[tuple[str, list[Any]]]:
    """``(where, constraints)`` of each int/float the annotation holds: ``where`` is "" for the field
    itself, "[item]", "[key]" or "[value]" inside containers; a field's own constraints reach its
    scalar branches only (pydantic applies them there), a container's items carry their own."""
    origin = typing.get_origin(ann)
    if origin is Annotated:
        base, *extra = typing.get_args(ann)
        yield from _numeric_leaves(base, [*meta, *_metadata(extra)], where)
    elif ann is bool or origin is Literal:  # a bool is no number here; a Literal is its own bound
        return
    elif ann in (int, float):
        yield where, meta
    elif origin in (Union, types.UnionType):
        for a in typing.get_args(ann):
            yield from _numeric_leaves(a, meta, where)
    elif origin in (list, tuple, set, frozenset, Sequence):
        for a in typing.get_args(ann):
            if a is not Ellipsis:
                yield from _numeric_leaves(a, [], f"{where}[item]")
    elif origin in (dict, Mapping):
        key, value = typing.get_args(ann)
        yield from _numeric_leaves(key, [], f"{where}[key]")
        yield from _numeric_leaves(value, [], f"{where}[value]")


def _walk() -> dict[type[BaseModel], dict[str, list[tuple[str, list[Any]]]]]:
    """Every schema class reachable from the roots -> its numeric fields -> their leaves."""
    found: dict[type[BaseModel], dict[str, list[tuple[str, list[Any]]]]] = {}
    stack = _root_classes()
    while stack:
        cls = stack.pop()
        if cls in found:
            continue
        found[cls] = {}
        for name, field in cls.model_fields.items():
            stack.extend(_models_in(field.annotation))
            leaves = list(_numeric_leaves(field.annotation, list(field.metadata)))
            if leaves:
                found[cls][name] = leaves
    return found


def _unbounded(leaves: list[tuple[str, list[Any]]]) -> list[str]:
    return [where or "(the value)" for where, meta in leaves if not any(isinstance(m, _BOUNDS) for m in meta)]


# ---- the tests ---------------------------------------------------------------------------------------


def test_the_walk_reaches_every_section() -> None:
    """A walk that visits nothing would pass everything: it must reach the sections named here."""
    names = {cls.__name__ for cls in _walk()}
    for expected in ("Recipe", "TrainSpec", "DataSpec", "Stage", "ExportSpec", "ValidateSpec", "Thresholds",
                     "DistributedSpec", "PTQSpec", "QATSpec", "QuantScheme", "QuantSpec", "SpeedCheck",
                     "PruneSpec", "SparsitySpec", "DistillSpec", "TeacherSpec", "KDLoss", "HiddenStateLoss",
                     "AttentionLoss", "EmaParams", "PercentileParams", "MseParams", "GPTQSpec", "AWQSpec"):
        assert expected in names, f"the schema walk no longer reaches {expected}"
    fields = sum(len(f) for f in _walk().values())
    assert fields > 80, f"only {fields} numeric fields found: the walk lost part of the schema"


def test_every_numeric_field_has_a_bound() -> None:
    missing = []
    for cls, fields in _walk().items():
        for name, leaves in fields.items():
            key = f"{cls.__name__}.{name}"
            if key in ANY_VALUE or key in VALIDATED:
                continue
            missing += [f"{cls.__module__}.{key} {where}" for where in _unbounded(leaves)]
    assert not missing, (
        "numeric recipe fields without a bound (give them Field(ge=/gt=/le=/lt=), or an item type "
        "Annotated[int, Field(ge=1)], or list them in ANY_VALUE / VALIDATED with the reason):\n  "
        + "\n  ".join(sorted(missing))
    )


def test_the_allow_lists_are_not_stale() -> None:
    """An entry whose field is gone or has since got a bound must leave the list."""
    seen = {f"{cls.__name__}.{name}": leaves for cls, fields in _walk().items() for name, leaves in fields.items()}
    for key in [*ANY_VALUE, *VALIDATED]:
        assert key in seen, f"{key}: no such numeric field in the schema any more; drop it from the allow-list"
        assert _unbounded(seen[key]), f"{key} has a bound now; drop it from the allow-list"


@pytest.mark.parametrize("key", sorted(VALIDATED))
def test_validated_fields_refuse_out_of_range_values(key: str) -> None:
    cls_name, field = key.split(".")
    cls = next(c for c in _walk() if c.__name__ == cls_name)
    base, bad = VALIDATED[key]
    with pytest.raises((ValidationError, RecipeError)):
        cls.model_validate({**base, field: bad})


# ---- values that used to fail late now fail as the recipe loads ----------------------------------------

def _tiny(tmp_path: Path, **changes: Any) -> Path:
    data = yaml.safe_load(TINY_YAML)
    for dotted, value in changes.items():
        node = data
        *parents, last = dotted.split("__")
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False, default_flow_style=None))
    return path


def _line_of(path: Path, needle: str) -> int:
    return next(i for i, ln in enumerate(path.read_text().splitlines(), 1) if needle in ln)


def test_tiny_recipe_loads(tmp_path: Path) -> None:
    assert compress.load_recipe(_tiny(tmp_path)).validate_.batch_sizes == [1]


def test_batch_size_zero_fails_at_load_naming_file_line_and_field(tmp_path: Path) -> None:
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY_YAML.replace("batch_sizes: [1]", "batch_sizes: [0]"))
    with pytest.raises(RecipeError) as err:
        compress.load_recipe(path)
    msg = str(err.value)
    line = _line_of(path, "batch_sizes")
    assert f"{path}:{line}: validate.batch_sizes" in msg and "greater than or equal to 1" in msg, msg
    assert "\n" not in msg


@pytest.mark.parametrize(("field", "value", "expected"), [
    ("validate__batch_sizes", [1, -4], r"validate\.batch_sizes\.1: .*greater than or equal to 1"),
    ("validate__runs", 0, r"validate\.runs: .*greater than or equal to 1"),
    ("validate__warmup", -1, r"validate\.warmup: .*greater than or equal to 0"),
    ("export", {"opset": 999}, r"export\.opset: opset 999 is newer than the installed onnx"),
    ("stages__0__modifiers__0__observer", "minmx", r"modifiers\.0\.observer: unknown observer 'minmx'.*'minmax'"),
    ("stages__0__modifiers__0__weight_observer", "percentile",
     r"modifiers\.0: weight_observer: observer 'percentile' supports granularity 'tensor' only"),
    ("stages__0__modifiers__0", {"type": "ptq", "observer": "ema", "observer_params": {"momentum": 1.5}},
     r"modifiers\.0\.observer_params: observer 'ema' param 'momentum'"),
    ("stages__0__modifiers__0", {"type": "ptq", "observer_params": {"momentum": 0.5}},
     r"modifiers\.0\.observer_params: observer_params apply to the activation observer override"),
    ("stages__0__modifiers__0__scheme", {"preset": "w8a8", "weights": {"axis": 12}},
     r"modifiers\.0: scheme: weights\.axis: .*less than or equal to 7"),
])
def test_late_failures_now_fail_at_load(tmp_path: Path, field: str, value: Any, expected: str) -> None:
    path = _tiny(tmp_path, **{field: value})
    with pytest.raises(RecipeError, match=expected) as err:
        compress.load_recipe(path)
    assert str(err.value).startswith(f"{path}:"), err.value


def test_distillation_layer_indices_are_not_negative(tmp_path: Path) -> None:
    from compress.distillation.spec import HiddenStateLoss

    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        HiddenStateLoss.model_validate({"layers": {-1: 2}})
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        HiddenStateLoss.model_validate({"layers": {1: -2}})
    assert HiddenStateLoss.model_validate({"layers": {0: 0, 3: 6}}).layers == {0: 0, 3: 6}
