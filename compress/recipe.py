"""The recipe schema (pydantic, ``extra="forbid"``) and its loader.

``load_recipe`` is the YAML boundary: every problem becomes one RecipeError line naming the file,
the YAML line, the field path, the valid choices and the closest name to a typo.
"""

from __future__ import annotations

import copy
import math
import re
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from compress.core.bounded import YAML_BYTES, load_yaml, read_bounded
from compress.core.errors import RecipeError, did_you_mean
from compress.core.modifier import ModifierSpec, check_order
from compress.core.reference import ModelSpec as ModelSpec
from compress.core.reference import StrictSpec
from compress.core.trust import CODE_REF, code_refs, refusal
from compress.distributed import DistributedSpec as DistributedSpec

# the export and validate sections are export/'s own settings, embedded here (export never imports the recipe)
from compress.export.specs import ExportSpec as ExportSpec
from compress.export.specs import Runtime as Runtime
from compress.export.specs import Thresholds as Thresholds
from compress.export.specs import ValidateSpec as ValidateSpec
from compress.modifiers import modifier_class, modifier_types


class DataSpec(StrictSpec):
    """The data: ``digits``, ``synthetic``, ``text``, ``text_lm`` or ``pkg.module:factory``, split into train,
    calibration and eval sets with a fixed seed."""

    source: str = Field("digits", json_schema_extra=CODE_REF)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    calibration_samples: int = Field(256, ge=0)
    calibration_batch_size: int = Field(32, ge=1)
    eval_batch_size: int = Field(128, ge=1)
    eval_samples: int | None = Field(None, ge=1)
    num_workers: int = Field(0, ge=0)
    seed: int = Field(0, ge=0, le=2**63 - 1)  # what torch.manual_seed and numpy take


class TrainSpec(StrictSpec):
    """How the baseline is trained and how stages fine-tune (``epochs: 0`` = use the model as is)."""

    epochs: float = Field(0, ge=0)
    batch_size: int = Field(64, ge=1)
    optimizer: Literal["sgd", "adamw"] = "sgd"
    lr: float = Field(0.05, gt=0)
    momentum: float = Field(0.9, ge=0, lt=1)
    weight_decay: float = Field(5e-4, ge=0)
    schedule: Literal["cosine", "step", "constant"] = "cosine"
    step_size: int = Field(10, ge=1)
    gamma: float = Field(0.1, gt=0, le=1)
    warmup_epochs: float = Field(0, ge=0)
    grad_clip: float | None = Field(None, gt=0)
    label_smoothing: float = Field(0.0, ge=0, lt=1)
    amp: bool = False
    seed: int = Field(0, ge=0, le=2**63 - 1)  # what torch.manual_seed and numpy take
    device: Literal["auto", "cpu", "cuda"] = "auto"
    metric: str = Field("accuracy", json_schema_extra=CODE_REF)
    #: intra-op CPU threads per process; None: torch's default alone, the cores shared among the
    #: ranks under torchrun (threads do not change results, so --resume ignores this field)
    threads: int | None = Field(None, ge=1)


class Stage(StrictSpec):
    """One step of the pipeline: its modifiers and how much training it gets (0 = one-shot)."""

    name: str = Field(min_length=1)
    epochs: float = Field(0, ge=0)
    steps: int | None = Field(None, ge=1)
    lr: float | None = Field(None, gt=0)
    modifiers: list[ModifierSpec] = Field(default_factory=list)

    @field_validator("modifiers", mode="before")
    @classmethod
    def _dispatch(cls, v: Any) -> Any:
        # programmatic construction: turn dicts into their typed spec (load_recipe does it first,
        # with field paths and YAML lines in its errors)
        if isinstance(v, list):
            return [_spec_for(item) if isinstance(item, Mapping) else item for item in v]
        return v

    @property
    def trains(self) -> bool:
        return self.epochs > 0 or self.steps is not None


class Recipe(StrictSpec):
    """A whole pipeline: model, data, training, ordered stages, export and validation."""

    version: Literal[1]
    name: str = "recipe"
    description: str = ""
    model: ModelSpec
    data: DataSpec = Field(default_factory=DataSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    distributed: DistributedSpec = Field(default_factory=DistributedSpec)
    stages: list[Stage] = Field(default_factory=list)
    export: ExportSpec = Field(default_factory=ExportSpec)
    validate_: ValidateSpec = Field(default_factory=ValidateSpec, alias="validate")

    _source: RecipeSource | None = PrivateAttr(default=None)
    _trust_code: bool = PrivateAttr(default=False)

    model_config = ConfigDict(extra="forbid", populate_by_name=True, protected_namespaces=(), allow_inf_nan=False)

    @model_validator(mode="after")
    def _unique_stage_names(self) -> Recipe:
        seen: set[str] = set()
        for s in self.stages:
            if s.name in seen:
                raise ValueError(f"stage name '{s.name}' is used twice")
            seen.add(s.name)
        return self

    @property
    def source(self) -> RecipeSource | None:
        return self._source

    @property
    def trusts_code(self) -> bool:
        """Whether this recipe was loaded with ``trust_code=True`` (its named code may run)."""
        return self._trust_code

    def code(self) -> list[tuple[str, str]]:
        """``(field path, 'pkg.module:attr')`` for each piece of code outside the registries it names."""
        return code_refs(self)

    def require_trust(self) -> None:
        """Refuse, naming the first callable and its YAML line, a recipe that names code it was not
        trusted to run."""
        refs = [] if self._trust_code else self.code()
        if refs:
            path, ref = refs[0]
            raise refusal(ref, self.where(path))

    def where(self, path: str) -> str:
        """``file:line: path`` for messages about a field of this recipe."""
        return self._source.where(path) if self._source else path

    def to_dict(self) -> dict[str, Any]:
        """The resolved recipe as plain data (defaults filled in), as written to the run folder."""
        # serialize_as_any: modifiers are ModifierSpec subclasses; without it pydantic dumps only
        # the base class's fields and drops every modifier's own settings
        return self.model_dump(mode="json", by_alias=True, serialize_as_any=True)

    def to_yaml(self) -> str:
        """The resolved recipe as YAML; whole-number floats (``epochs: 3``) written as integers."""
        return yaml.safe_dump(_whole_numbers(self.to_dict()), sort_keys=False)


def _whole_numbers(data: Any) -> Any:
    """``data`` with floats that are whole numbers as ints: float fields (epochs) read as written."""
    if isinstance(data, dict):
        return {k: _whole_numbers(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_whole_numbers(v) for v in data]
    if isinstance(data, float) and data.is_integer() and abs(data) < 2**53:
        return int(data)
    return data


# ---- modifiers --------------------------------------------------------------------------------


def _spec_for(item: Mapping[str, Any]) -> ModifierSpec:
    t = item.get("type")
    if not isinstance(t, str):
        raise ValueError(f"modifier needs a 'type'; valid: {', '.join(modifier_types())}")
    return modifier_class(t).spec_cls.model_validate(item)


# ---- YAML source and line numbers --------------------------------------------------------------


class RecipeSource:
    """The YAML text of a recipe, to map field paths back to line numbers."""

    def __init__(self, name: str, text: str | None, overrides: Sequence[str] = ()) -> None:
        self.name = name
        self.overrides = list(overrides)
        self._root: yaml.Node | None = None
        if text is not None:
            try:
                self._root = yaml.compose(text, Loader=yaml.SafeLoader)
            except yaml.YAMLError:
                self._root = None

    def line(self, path: Sequence[str | int]) -> int | None:
        """1-based line of the deepest node along ``path`` that exists in the YAML."""
        node = self._root
        line = node.start_mark.line + 1 if node is not None else None
        for part in path:
            if isinstance(node, yaml.MappingNode):
                nxt = None
                for k, v in node.value:
                    if str(k.value) == str(part):
                        nxt, line = v, k.start_mark.line + 1
                        break
                node = nxt
            elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
                node = node.value[part]
                line = node.start_mark.line + 1
            else:
                break
            if node is None:
                break
        return line

    def where(self, path: str | Sequence[str | int]) -> str:
        parts = _split_path(path) if isinstance(path, str) else list(path)
        dotted = ".".join(str(p) for p in parts)
        for ov in self.overrides:
            key = ov.split("=", 1)[0]
            if dotted == key or dotted.startswith(key + ".") or (bool(dotted) and key.startswith(dotted + ".")):
                return f"{self.name}: --set {_printable(ov)}: {_printable(dotted)}"
        line = self.line(parts)
        loc = f"{self.name}:{line}" if line is not None else self.name
        return f"{loc}: {_printable(dotted)}" if dotted else loc


def _check_duplicate_keys(source: RecipeSource) -> None:
    """A key given twice in one mapping is an error (yaml.safe_load silently keeps the last one)."""
    seen_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, list[str | int]]] = [(source._root, [])] if source._root is not None else []
    while stack:
        node, path = stack.pop()
        if id(node) in seen_nodes:  # an alias: its node was checked already
            continue
        seen_nodes.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend((v, [*path, i]) for i, v in reversed(list(enumerate(node.value))))
        elif isinstance(node, yaml.MappingNode):
            first: dict[tuple[str, str], int] = {}
            for k, _ in node.value:
                if not isinstance(k, yaml.ScalarNode) or k.tag == "tag:yaml.org,2002:merge":
                    continue
                line = k.start_mark.line + 1
                if (k.tag, k.value) in first:
                    dotted = _printable(".".join(str(p) for p in [*path, k.value]))
                    raise RecipeError(
                        f"{source.name}:{line}: {dotted}: key {k.value!r} is given twice in one mapping"
                        f" (first on line {first[k.tag, k.value]})"
                    )
                first[k.tag, k.value] = line
            stack.extend((v, [*path, k.value]) for k, v in reversed(node.value))


def _split_path(path: str) -> list[str | int]:
    return [int(p) if p.isdigit() else p for p in path.split(".") if p]


# ---- errors -------------------------------------------------------------------------------------


def _field_names(model: type[BaseModel]) -> list[str]:
    return [f.alias or n for n, f in model.model_fields.items()]


def _model_at(path: Sequence[str | int], data: Any) -> type[BaseModel] | None:
    """The pydantic model class that validates the mapping at ``path`` of the raw data."""
    model: type[BaseModel] | None = Recipe
    node = data
    ann: Any = None
    for part in path:
        if isinstance(part, int):
            node = node[part] if isinstance(node, list) and part < len(node) else None
            ann = _unwrap_list(ann)
        else:
            if model is None:
                return None
            fields = {f.alias or n: f for n, f in model.model_fields.items()}
            if part not in fields:
                return None
            ann = fields[part].annotation
            node = node.get(part) if isinstance(node, Mapping) else None
        model = _as_model(ann)
        if model is ModifierSpec and isinstance(node, Mapping) and isinstance(node.get("type"), str):
            try:
                model = modifier_class(node["type"]).spec_cls
            except RecipeError:
                return None
    return model


def _unwrap_list(ann: Any) -> Any:
    if typing.get_origin(ann) in (list, tuple, Sequence):
        args = typing.get_args(ann)
        return args[0] if args else None
    return ann


def _as_model(ann: Any) -> type[BaseModel] | None:
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        for a in typing.get_args(ann):
            m = _as_model(a)
            if m is not None:
                return m
    return None


_QUOTED = re.compile(r"'([^']*)'")


def _explain(err: Mapping[str, Any], data: Any) -> str:
    loc = [p for p in err["loc"] if not (isinstance(p, str) and "[" in p)]
    etype = err["type"]
    if etype == "extra_forbidden":
        parent = _model_at(loc[:-1], data)
        choices = _field_names(parent) if parent else []
        bad = str(loc[-1])
        return f"unknown field '{bad}'; {did_you_mean(bad, choices)}" if choices else f"unknown field '{bad}'"
    if etype == "missing":
        return "required field is missing"
    if etype in ("literal_error", "enum"):
        expected = _QUOTED.findall(str(err.get("ctx", {}).get("expected", "")))
        got = err.get("input")
        if expected:
            return f"invalid value {got!r}; {did_you_mean(str(got), expected)}"
    msg = str(err["msg"]).removeprefix("Value error, ")
    return f"{msg} (got {err.get('input')!r})" if etype not in ("value_error", "assertion_error") else msg


def _raise_validation(exc: ValidationError, source: RecipeSource, data: Any, prefix: Sequence[str | int] = ()) -> None:
    err = exc.errors()[0]
    loc = [*prefix, *(p for p in err["loc"] if not (isinstance(p, str) and "[" in p))]
    raise RecipeError(f"{source.where(loc)}: {_printable(_explain({**err, 'loc': loc}, data))}") from None


# ---- overrides ----------------------------------------------------------------------------------


def apply_overrides(data: dict[str, Any], overrides: Iterable[str], name: str = "recipe") -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides (values parsed as YAML) to a copy of ``data``."""
    out = copy.deepcopy(data)
    for ov in overrides:
        if "=" not in ov:
            raise RecipeError(f"{name}: --set {ov!r}: expected key=value, e.g. train.epochs=3")
        path, raw = ov.split("=", 1)
        parts = _split_path(path.strip())
        if not parts:
            raise RecipeError(f"{name}: --set {ov!r}: empty key")
        try:
            value = load_yaml(raw, name=f"{name}: --set {ov!r}") if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise RecipeError(f"{name}: --set {ov!r}: value is not valid YAML ({_one_line(exc)})") from None
        node: Any = out
        for i, part in enumerate(parts[:-1]):
            sub = _printable(".".join(str(p) for p in parts[: i + 1]))
            if isinstance(node, list):
                if not isinstance(part, int) or part >= len(node):
                    raise RecipeError(f"{name}: --set {ov!r}: '{sub}' is not an index of a list of {len(node)}")
                node = node[part]
            elif isinstance(node, dict):
                k = part if part in node else str(part)
                if k not in node or node[k] is None:
                    # a missing container is a list when the next part is an index, so that
                    # stages.0.modifiers.0={...} appends to a stage that has no modifiers yet
                    node[k] = [] if isinstance(parts[i + 1], int) else {}
                node = node[k]
            else:
                raise RecipeError(f"{name}: --set {ov!r}: '{sub}' is not a mapping or list")
        last = parts[-1]
        if isinstance(node, list):
            if not isinstance(last, int) or last > len(node):
                raise RecipeError(f"{name}: --set {ov!r}: '{_printable(str(last))}' is not an index of a list of {len(node)}")
            if last == len(node):
                node.append(value)
            else:
                node[last] = value
        elif isinstance(node, dict):
            node[str(last)] = value
        else:
            raise RecipeError(f"{name}: --set {ov!r}: cannot set a key inside a {type(node).__name__}")
    return out


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _printable(text: str) -> str:
    """``text`` with control characters escaped, so that names taken from user input (YAML keys,
    override strings, paths) cannot break an error message over several lines."""
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


# ---- the loader ---------------------------------------------------------------------------------


def shipped_recipes() -> dict[str, Path]:
    """Name -> path of the recipes shipped with the package (``compress recipes`` lists them)."""
    from importlib.resources import files

    folder = Path(str(files("compress.recipes")))  # found, not imported: it is a folder of YAML files
    return {p.stem: p for p in sorted(folder.glob("*.yaml"))}


def resolve_recipe_path(recipe: str | Path) -> Path:
    """The one rule the CLI and ``load_recipe`` share: an existing file wins; else a shipped recipe
    named ``NAME``, ``NAME.yaml`` or ``recipes/NAME.yaml`` (the README's paths, from any folder);
    else a RecipeError naming the closest shipped recipe."""
    path = Path(recipe)
    if path.is_file():
        return path
    if path.is_dir():
        raise RecipeError(f"{_printable(str(recipe))}: is a folder, not a recipe file (give the .yaml file inside it)")
    shipped = shipped_recipes()
    parts = path.parts
    stem = path.stem if path.suffix in (".yaml", ".yml") else path.name
    bare = (len(parts) == 1 or (len(parts) == 2 and parts[0] == "recipes")) and re.fullmatch(r"[\w.-]+", stem) is not None
    if bare and stem in shipped:
        return shipped[stem]
    name = _printable(str(recipe))
    if not bare:
        raise RecipeError(f"{name}: recipe file not found")
    raise RecipeError(f"{name}: recipe file not found (nor a shipped recipe; {did_you_mean(stem, list(shipped))})")



def load_recipe(recipe: str | Path | Mapping[str, Any] | Recipe, *, overrides: Sequence[str] = (),
                trust_code: bool = False) -> Recipe:
    """Load and validate a recipe from a YAML path, a mapping, or a Recipe (re-validated with overrides).

    ``trust_code=True`` lets the recipe's own code (``pkg.module:factory`` for the model, the data, a
    teacher or a metric) run when the recipe is applied; without it such a recipe is refused when it
    would run, and loads, plans and inspects without importing anything (a Recipe given here keeps
    the trust it was loaded with).
    Raises RecipeError with ``file:line: field.path: what is wrong; valid: ...`` on any problem.
    """
    text: str | None = None
    if isinstance(recipe, Recipe):
        name = recipe.source.name if recipe.source else "recipe"
        data: Any = recipe.to_dict()
    elif isinstance(recipe, Mapping):
        name, data = "recipe", copy.deepcopy(dict(recipe))
    elif isinstance(recipe, (str, Path)):
        name = _printable(str(recipe))
        path = resolve_recipe_path(recipe)
        try:
            text = read_bounded(path, limit=YAML_BYTES, what="recipe")
        except (OSError, UnicodeDecodeError) as exc:
            raise RecipeError(f"{name}: cannot read recipe: {_one_line(exc)}") from None
        try:
            data = load_yaml(text, name=name)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            line = f":{mark.line + 1}" if mark is not None else ""
            problem = getattr(exc, "problem", None) or _one_line(exc)
            raise RecipeError(f"{name}{line}: malformed YAML: {problem}") from None
    else:
        raise RecipeError(f"load_recipe takes a path, a mapping or a Recipe, not {type(recipe).__name__}")
    source = RecipeSource(name, text, overrides)
    if not isinstance(data, dict):
        raise RecipeError(f"{source.where([])}: a recipe is a mapping with keys version, model, data, ...")
    _check_duplicate_keys(source)
    data = apply_overrides(data, overrides, name)
    _check_finite(data, source)
    data = _validate_modifiers(data, source)
    _check_unique_stage_names(data, source)
    try:
        result = Recipe.model_validate(data)
    except ValidationError as exc:
        _raise_validation(exc, source, data)
        raise  # unreachable: _raise_validation always raises
    result._source = source
    result._trust_code = trust_code or (isinstance(recipe, Recipe) and recipe.trusts_code)
    _check_needs_and_order(result, source)
    return result


def _validate_modifiers(data: dict[str, Any], source: RecipeSource) -> dict[str, Any]:
    stages = data.get("stages")
    if not isinstance(stages, list):
        return data
    for i, stage in enumerate(stages):
        mods = stage.get("modifiers") if isinstance(stage, dict) else None
        if not isinstance(mods, list):
            continue
        for j, item in enumerate(mods):
            path: list[str | int] = ["stages", i, "modifiers", j]
            if not isinstance(item, Mapping):
                raise RecipeError(f"{source.where(path)}: a modifier is a mapping with a 'type' key")
            t = item.get("type")
            valid = modifier_types()
            if t is None:
                raise RecipeError(f"{source.where(path)}: modifier has no 'type'; valid: {', '.join(valid)}")
            if t not in valid:
                raise RecipeError(
                    f"{source.where([*path, 'type'])}: unknown modifier type {t!r}; {did_you_mean(str(t), valid)}"
                )
            try:
                mods[j] = modifier_class(str(t)).spec_cls.model_validate(item)
            except ValidationError as exc:
                _raise_validation(exc, source, data, prefix=path)
            except RecipeError as exc:
                # a spec's own resolver (e.g. a scheme preset name) raises without a location: point
                # at the field whose value it names, else at the modifier
                field = _field_naming(item, str(exc))
                raise RecipeError(f"{source.where([*path, *field])}: {exc}") from None
    return data


def _check_finite(node: Any, source: RecipeSource, path: tuple[str | int, ...] = ()) -> None:
    """No number in a recipe means anything as inf or nan: refuse them everywhere, nested modifier
    settings (loss temperatures, observer parameters, ...) included, not only where a schema says so."""
    if isinstance(node, float) and not math.isfinite(node):
        raise RecipeError(f"{source.where(list(path))}: Input should be a finite number (got {node})")
    if isinstance(node, Mapping):
        for k, v in node.items():
            _check_finite(v, source, (*path, str(k)))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            _check_finite(v, source, (*path, i))


def _field_naming(item: Any, message: str) -> list[str | int]:
    """Path inside ``item`` to the first scalar value quoted in ``message`` (``'w8a9'``)."""
    quoted = set(re.findall(r"'([^']*)'", message))

    def walk(node: Any, path: list[str | int]) -> list[str | int] | None:
        if isinstance(node, Mapping):
            for k, v in node.items():
                found = walk(v, [*path, str(k)])
                if found is not None:
                    return found
        elif isinstance(node, list):
            for i, v in enumerate(node):
                found = walk(v, [*path, i])
                if found is not None:
                    return found
        elif isinstance(node, (str, int, float)) and str(node) in quoted:
            return path
        return None

    return walk(item, []) or []


def _check_unique_stage_names(data: dict[str, Any], source: RecipeSource) -> None:
    # Recipe's own validator has no field path or line to give; point at the second name here
    stages = data.get("stages")
    if not isinstance(stages, list):
        return
    first: dict[str, int] = {}
    for i, stage in enumerate(stages):
        name = stage.get("name") if isinstance(stage, dict) else None
        if not isinstance(name, str):
            continue
        if name in first:
            raise RecipeError(
                f"{source.where(['stages', i, 'name'])}: stage name {name!r} is used twice"
                f" (first as stages.{first[name]}.name)"
            )
        first[name] = i


def _check_needs_and_order(recipe: Recipe, source: RecipeSource) -> None:
    kinds: list[list[tuple[str, str]]] = []
    for i, stage in enumerate(recipe.stages):
        per: list[tuple[str, str]] = []
        for j, spec in enumerate(stage.modifiers):
            where = source.where(["stages", i, "modifiers", j])
            if "training" in spec.needs and not stage.trains:
                raise RecipeError(f"{where}: '{spec.type}' needs training; give stage {stage.name!r} epochs or steps")
            if "calibration" in spec.needs and recipe.data.calibration_samples == 0:
                raise RecipeError(
                    f"{where}: '{spec.type}' needs calibration data but data.calibration_samples is 0"
                )
            per.append((spec.kind, where))
        kinds.append(per)
    check_order(kinds)
