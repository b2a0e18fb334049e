"""The recipe schema and its loader: valid recipes, overrides, and one clear line per bad input."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

import compress
from compress.core.errors import RecipeError
from compress.recipe import (
    DataSpec,
    ExportSpec,
    Recipe,
    Stage,
    Thresholds,
    TrainSpec,
    ValidateSpec,
    apply_overrides,
    load_recipe,
)

# A valid recipe; the line numbers the error tests rely on are in the comments on the right.
GOOD = """\
version: 1
name: demo
model:
  name: tiny_mlp
  kwargs:
    hidden: 8
data:
  source: synthetic
  calibration_samples: 16
train:
  epochs: 1
  optimizer: adamw
  lr: 0.01
stages:
  - name: prune                 # line 15
    epochs: 2
    modifiers:
      - type: test_train        # line 18
        label: p
        end_epoch: 1.5
  - name: calibrate             # line 21
    modifiers:
      - type: test_calib        # line 23
        bits: 4
export:
  opset: 17
validate:
  runtimes: [onnxruntime]
  thresholds:
    max_accuracy_drop: 0.02     # line 30
"""


def write(tmp_path: Path, text: str, name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def edit(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, f"{old!r} must occur once"
    return text.replace(old, new)


def error_of(recipe: Any, overrides: list[str] | None = None) -> str:
    """The message of the RecipeError that loading raises; it must be one line."""
    with pytest.raises(RecipeError) as info:
        load_recipe(recipe, overrides=overrides or [])
    msg = str(info.value)
    assert "\n" not in msg, msg
    assert info.value.exit_code == 2
    return msg


# ---- valid recipes ------------------------------------------------------------------------------


def test_good_yaml_loads_with_typed_sections_and_defaults(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)
    r = compress.load_recipe(path)
    assert isinstance(r, Recipe)
    assert r.version == 1 and r.name == "demo"
    assert r.model.name == "tiny_mlp" and r.model.kwargs == {"hidden": 8} and r.model.hf_path is None
    assert isinstance(r.data, DataSpec) and r.data.source == "synthetic" and r.data.calibration_samples == 16
    assert r.data.calibration_batch_size == 32  # default
    assert isinstance(r.train, TrainSpec) and r.train.optimizer == "adamw" and r.train.lr == 0.01
    assert r.train.schedule == "cosine"  # default
    assert [s.name for s in r.stages] == ["prune", "calibrate"]
    assert [s.trains for s in r.stages] == [True, False]
    assert isinstance(r.export, ExportSpec) and r.export.opset == 17 and r.export.activation_dtype == "uint8"
    assert isinstance(r.validate_, ValidateSpec) and r.validate_.runtimes == ["onnxruntime"]
    assert isinstance(r.validate_.thresholds, Thresholds)
    assert r.validate_.thresholds.max_accuracy_drop == 0.02 and r.validate_.thresholds.min_speedup is None
    assert r.source is not None and r.source.name == str(path)


def test_modifiers_are_their_typed_specs(tmp_path: Path) -> None:
    r = load_recipe(write(tmp_path, GOOD))
    train_mod, calib_mod = r.stages[0].modifiers[0], r.stages[1].modifiers[0]
    assert type(train_mod).__name__ == "TrainingSpec" and train_mod.type == "test_train"
    assert train_mod.end_epoch == 1.5 and train_mod.kind == "prune" and train_mod.needs == {"training"}
    assert type(calib_mod).__name__ == "CalibSpec" and calib_mod.bits == 4  # type: ignore[attr-defined]
    assert calib_mod.kind == "quantize"


def test_minimal_recipe_gets_every_default() -> None:
    r = load_recipe({"version": 1, "model": {"name": "m"}})
    assert r.name == "recipe" and r.description == "" and r.stages == []
    assert (
        r.data == DataSpec()
        and r.train == TrainSpec()
        and r.export == ExportSpec()
        and r.validate_ == ValidateSpec()
    )
    assert r.data.calibration_samples == 256 and r.train.epochs == 0 and r.validate_.batch_sizes == [1, 32]


def test_path_string_and_mapping_load_the_same(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)
    a = load_recipe(path)
    b = load_recipe(str(path))
    c = load_recipe(yaml.safe_load(GOOD))
    assert a.to_dict() == b.to_dict() == c.to_dict()
    assert c.source is not None and c.source.name == "recipe"


def test_to_dict_keeps_every_modifier_field_and_round_trips(tmp_path: Path) -> None:
    r = load_recipe(write(tmp_path, GOOD))
    d = r.to_dict()
    assert d["stages"][1]["modifiers"][0]["bits"] == 4
    assert d["stages"][0]["modifiers"][0]["label"] == "p"
    assert "validate" in d and "validate_" not in d
    again = load_recipe(yaml.safe_load(r.to_yaml()))
    assert again.to_dict() == d
    assert again.stages[1].modifiers[0].bits == 4  # type: ignore[attr-defined]


def test_reloading_a_recipe_object_with_overrides_keeps_modifier_fields(tmp_path: Path) -> None:
    r = load_recipe(write(tmp_path, GOOD))
    r2 = load_recipe(r, overrides=["stages.0.epochs=3"])
    assert r2.stages[0].epochs == 3.0
    assert r2.stages[1].modifiers[0].bits == 4  # type: ignore[attr-defined]
    assert r2.stages[0].modifiers[0].end_epoch == 1.5
    assert r.stages[0].epochs == 2.0  # the original is untouched


def test_programmatic_stage_construction_dispatches_on_type() -> None:
    stage = Stage(name="s", epochs=1, modifiers=[{"type": "test_calib", "bits": 6}])  # type: ignore[list-item]
    assert type(stage.modifiers[0]).__name__ == "CalibSpec" and stage.modifiers[0].bits == 6  # type: ignore[attr-defined]


def test_where_names_file_line_and_path(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)
    r = load_recipe(path)
    assert r.where("stages.1.modifiers.0") == f"{path}:23: stages.1.modifiers.0"
    assert (
        r.where("validate.thresholds.max_accuracy_drop")
        == f"{path}:30: validate.thresholds.max_accuracy_drop"
    )
    # a path that is not in the YAML points at its deepest existing parent
    assert r.where("stages.0.steps") == f"{path}:15: stages.0.steps"
    assert load_recipe({"version": 1, "model": {"name": "m"}}).where("train.lr") == "recipe: train.lr"


# ---- overrides ------------------------------------------------------------------------------------


def test_overrides_parse_values_as_yaml(tmp_path: Path) -> None:
    r = load_recipe(
        write(tmp_path, GOOD),
        overrides=[
            "train.epochs=3",
            "train.lr=1e-3",
            "train.amp=true",
            "model.kwargs={hidden: 16, depth: 2}",
            "validate.batch_sizes=[1, 8, 64]",
            "export.opset=null",
            "name=renamed run",
            "description=",
        ],
    )
    assert r.train.epochs == 3.0 and r.train.lr == 0.001 and r.train.amp is True
    assert r.model.kwargs == {"hidden": 16, "depth": 2}
    assert r.validate_.batch_sizes == [1, 8, 64]
    assert r.export.opset is None
    assert r.name == "renamed run" and r.description == ""


def test_override_list_index_append_and_new_nested_keys(tmp_path: Path) -> None:
    r = load_recipe(
        write(tmp_path, GOOD),
        overrides=[
            "stages.0.epochs=1",
            "stages.1.modifiers.0.bits=6",
            "stages.2={name: polish, steps: 5}",  # index == len appends
            "stages.2.modifiers.0={type: test_noop, mode: exact}",
            "model.kwargs.extra.depth=3",  # missing mappings are created
            "validate.runtimes.1=openvino",
        ],
    )
    assert [s.name for s in r.stages] == ["prune", "calibrate", "polish"]
    assert r.stages[0].epochs == 1.0 and r.stages[1].modifiers[0].bits == 6  # type: ignore[attr-defined]
    assert r.stages[2].steps == 5 and r.stages[2].modifiers[0].mode == "exact"  # type: ignore[attr-defined]
    assert r.model.kwargs == {"hidden": 8, "extra": {"depth": 3}}
    assert r.validate_.runtimes == ["onnxruntime", "openvino"]


def test_overrides_do_not_mutate_the_input_mapping() -> None:
    data = {"version": 1, "model": {"name": "m"}, "stages": [{"name": "a"}]}
    load_recipe(data, overrides=["stages.0.epochs=2", "model.kwargs.x=1"])
    assert data == {"version": 1, "model": {"name": "m"}, "stages": [{"name": "a"}]}
    out = apply_overrides(data, ["stages.1={name: b}"])
    assert out["stages"] == [{"name": "a"}, {"name": "b"}] and data["stages"] == [{"name": "a"}]


def test_later_overrides_win() -> None:
    r = load_recipe({"version": 1, "model": {"name": "m"}}, overrides=["train.epochs=2", "train.epochs=5"])
    assert r.train.epochs == 5.0


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("train.epochs", "--set 'train.epochs': expected key=value, e.g. train.epochs=3"),
        ("=3", "--set '=3': empty key"),
        ("train.epochs=[1", "--set 'train.epochs=[1': value is not valid YAML ("),
        ("stages.5.epochs=1", "--set 'stages.5.epochs=1': 'stages.5' is not an index of a list of 2"),
        (
            "stages.first.epochs=1",
            "--set 'stages.first.epochs=1': 'stages.first' is not an index of a list of 2",
        ),
        ("stages.3={name: x}", "--set 'stages.3={name: x}': '3' is not an index of a list of 2"),
        ("model.name.x=1", "--set 'model.name.x=1': cannot set a key inside a str"),
        ("train.epochs.x.y=1", "--set 'train.epochs.x.y=1': 'train.epochs.x' is not a mapping or list"),
    ],
)
def test_bad_override_syntax_and_paths(tmp_path: Path, override: str, expected: str) -> None:
    path = write(tmp_path, GOOD)
    msg = error_of(path, [override])
    assert msg.startswith(f"{path}: {expected}"), msg


def test_override_to_an_unknown_field_names_the_override_and_suggests(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)
    msg = error_of(path, ["train.epocs=3"])
    assert msg.startswith(
        f"{path}: --set train.epocs=3: train.epocs: unknown field 'epocs'; valid: amp, batch_size,"
    )
    assert msg.endswith("(did you mean 'epochs'?)")


def test_override_with_a_bad_value_names_the_override(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)
    msg = error_of(path, ["stages.1.modifiers.0.bits=64"])
    assert msg == (
        f"{path}: --set stages.1.modifiers.0.bits=64: stages.1.modifiers.0.bits: "
        "Input should be less than or equal to 16 (got 64)"
    )
    msg = error_of(path, ["train.optimizer=adam"])
    assert (
        msg
        == f"{path}: --set train.optimizer=adam: train.optimizer: invalid value 'adam'; valid: adamw, sgd (did you mean 'adamw'?)"
    )


def test_override_with_an_unknown_modifier_type(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)
    msg = error_of(path, ["stages.1.modifiers.0.type=test_calibrate"])
    assert msg.startswith(
        f"{path}: --set stages.1.modifiers.0.type=test_calibrate: stages.1.modifiers.0.type: "
        "unknown modifier type 'test_calibrate'; valid: "
    )
    assert msg.endswith("(did you mean 'test_calib'?)")


def test_override_value_tags_are_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    msg = error_of(write(tmp_path, GOOD), [f"name=!!python/object/apply:pathlib.Path.touch [{marker}]"])
    assert "value is not valid YAML (could not determine a constructor for the tag" in msg
    assert not marker.exists()


# ---- bad input: one line naming file, line, field path, valid choices --------------------------


def test_file_not_found(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    assert error_of(missing) == f"{missing}: recipe file not found"
    assert error_of(str(tmp_path)) == f"{tmp_path}: is a folder, not a recipe file (give the .yaml file inside it)"


def test_malformed_yaml_names_the_line(tmp_path: Path) -> None:
    text = edit(GOOD, "  opset: 17\n", "  opset: [17\n")  # line 26: an unclosed flow sequence
    path = write(tmp_path, text)
    msg = error_of(path)
    assert msg.startswith(f"{path}:27: malformed YAML: ")  # the parser notices on the next line
    text = edit(GOOD, "    bits: 4\n", "\tbits: 4\n")  # line 24: a tab
    path = write(tmp_path, text)
    assert error_of(path) == f"{path}:24: malformed YAML: found character '\\t' that cannot start any token"


def test_bad_indentation_names_the_line(tmp_path: Path) -> None:
    text = edit(GOOD, "  optimizer: adamw\n", "   optimizer: adamw\n")  # line 12
    path = write(tmp_path, text)
    assert error_of(path).startswith(f"{path}:12: malformed YAML: ")


def test_python_tags_are_refused_as_malformed_not_executed(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    text = edit(GOOD, "name: demo\n", f"name: !!python/object/apply:pathlib.Path.touch [{marker}]\n")
    path = write(tmp_path, text)
    msg = error_of(path)
    assert msg == (
        f"{path}:2: malformed YAML: could not determine a constructor for the tag "
        "'tag:yaml.org,2002:python/object/apply:pathlib.Path.touch'"
    )
    assert not marker.exists()
    path = write(tmp_path, "version: 1\nmodel: !!python/object:collections.OrderedDict {}\n")
    assert error_of(path).startswith(f"{path}:2: malformed YAML: could not determine a constructor")


def test_undecodable_file(tmp_path: Path) -> None:
    path = tmp_path / "bin.yaml"
    path.write_bytes(b"\xff\xfe\x00\x01garbage")
    assert error_of(path).startswith(f"{path}: cannot read recipe: 'utf-8' codec can't decode byte 0xff")


@pytest.mark.parametrize(
    ("text", "where"),
    [("- version: 1\n- model: x\n", ":1"), ("just a string\n", ":1"), ("", ""), ("# only a comment\n", "")],
)
def test_top_level_must_be_a_mapping(tmp_path: Path, text: str, where: str) -> None:
    path = write(tmp_path, text)
    assert error_of(path) == f"{path}{where}: a recipe is a mapping with keys version, model, data, ..."


def test_non_mapping_argument() -> None:
    assert error_of(["version", 1]) == "load_recipe takes a path, a mapping or a Recipe, not list"
    assert error_of(3) == "load_recipe takes a path, a mapping or a Recipe, not int"


def test_unknown_top_level_key_suggests_the_closest(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD + "colour: blue\n")  # line 31
    msg = error_of(path)
    assert msg == (
        f"{path}:31: colour: unknown field 'colour'; "
        "valid: data, description, distributed, export, model, name, stages, train, validate, version"
    )
    path = write(tmp_path, edit(GOOD, "train:\n", "trian:\n"))  # line 10
    msg = error_of(path)
    assert msg == (
        f"{path}:10: trian: unknown field 'trian'; "
        "valid: data, description, distributed, export, model, name, stages, train, validate, version (did you mean 'train'?)"
    )


def test_unknown_nested_key_suggests_the_closest(tmp_path: Path) -> None:
    path = write(tmp_path, edit(GOOD, "  calibration_samples: 16\n", "  calibration_sample: 16\n"))  # line 9
    msg = error_of(path)
    assert msg.startswith(f"{path}:9: data.calibration_sample: unknown field 'calibration_sample'; valid: ")
    assert "calibration_batch_size, calibration_samples, eval_batch_size" in msg
    assert msg.endswith("(did you mean 'calibration_samples'?)")

    path = write(tmp_path, edit(GOOD, "    max_accuracy_drop: 0.02", "    max_acuracy_drop: 0.02"))  # line 30
    msg = error_of(path)
    assert msg.startswith(
        f"{path}:30: validate.thresholds.max_acuracy_drop: unknown field 'max_acuracy_drop'; "
    )
    assert msg.endswith("(did you mean 'max_accuracy_drop'?)")


def test_unknown_modifier_field_lists_that_modifiers_fields(tmp_path: Path) -> None:
    path = write(tmp_path, edit(GOOD, "        bits: 4\n", "        bitz: 4\n"))  # line 24
    assert error_of(path) == (
        f"{path}:24: stages.1.modifiers.0.bitz: unknown field 'bitz'; valid: bits, end_epoch, end_step, label, "
        "max_batches, start_epoch, start_step, type, update_every (did you mean 'bits'?)"
    )


def test_unknown_modifier_type_lists_valid_types_and_suggests(tmp_path: Path) -> None:
    path = write(tmp_path, edit(GOOD, "      - type: test_calib ", "      - type: test_clib "))  # line 23
    msg = error_of(path)
    prefix = f"{path}:23: stages.1.modifiers.0.type: unknown modifier type 'test_clib'; valid: "
    assert msg.startswith(prefix)
    valid = msg[len(prefix) :].split(" (did you mean")[0].split(", ")
    assert {"test_calib", "test_loss", "test_noop", "test_train"} <= set(valid)
    assert valid == sorted(valid)
    assert msg.endswith("(did you mean 'test_calib'?)")


def test_modifier_without_type_or_not_a_mapping(tmp_path: Path) -> None:
    path = write(
        tmp_path, edit(GOOD, "      - type: test_train        # line 18\n", "      - kind: test_train\n")
    )
    msg = error_of(path)
    assert msg.startswith(f"{path}:18: stages.0.modifiers.0: modifier has no 'type'; valid: ")
    assert "test_train" in msg
    path = write(
        tmp_path,
        edit(GOOD, "      - type: test_calib        # line 23\n        bits: 4\n", "      - test_calib\n"),
    )
    assert error_of(path) == f"{path}:23: stages.1.modifiers.0: a modifier is a mapping with a 'type' key"


def test_modifier_type_that_is_not_a_string(tmp_path: Path) -> None:
    path = write(tmp_path, edit(GOOD, "      - type: test_calib ", "      - type: [test_calib] "))
    msg = error_of(path)
    assert msg.startswith(
        f"{path}:23: stages.1.modifiers.0.type: unknown modifier type ['test_calib']; valid: "
    )


def test_wrong_type(tmp_path: Path) -> None:
    path = write(tmp_path, edit(GOOD, "  lr: 0.01\n", "  lr: fast\n"))  # line 13
    assert error_of(path) == (
        f"{path}:13: train.lr: Input should be a valid number, unable to parse string as a number (got 'fast')"
    )
    path = write(tmp_path, edit(GOOD, "  runtimes: [onnxruntime]\n", "  runtimes: onnxruntime\n"))  # line 28
    assert error_of(path) == f"{path}:28: validate.runtimes: Input should be a valid list (got 'onnxruntime')"
    path = write(tmp_path, edit(GOOD, "    hidden: 8\n", "    8: hidden\n"))
    assert error_of(path).startswith(f"{path}:6: model.kwargs.8: ")


def test_wrong_type_for_a_section(tmp_path: Path) -> None:
    path = write(tmp_path, edit(GOOD, "export:\n  opset: 17\n", "export: [17]\n"))  # line 25
    assert (
        error_of(path)
        == f"{path}:25: export: Input should be a valid dictionary or instance of ExportSpec (got [17])"
    )


def test_out_of_range_value(tmp_path: Path) -> None:
    path = write(tmp_path, edit(GOOD, "  calibration_samples: 16\n", "  calibration_samples: -1\n"))  # line 9
    assert (
        error_of(path)
        == f"{path}:9: data.calibration_samples: Input should be greater than or equal to 0 (got -1)"
    )
    path = write(tmp_path, edit(GOOD, "        bits: 4\n", "        bits: 1\n"))  # line 24
    assert (
        error_of(path)
        == f"{path}:24: stages.1.modifiers.0.bits: Input should be greater than or equal to 2 (got 1)"
    )
    path = write(tmp_path, edit(GOOD, "  opset: 17\n", "  opset: 11\n"))  # line 26
    assert error_of(path) == f"{path}:26: export.opset: Input should be greater than or equal to 13 (got 11)"
    path = write(tmp_path, edit(GOOD, "max_accuracy_drop: 0.02", "max_accuracy_drop: -0.5"))  # line 30
    assert error_of(path) == (
        f"{path}:30: validate.thresholds.max_accuracy_drop: Input should be greater than or equal to 0 (got -0.5)"
    )


def test_invalid_choice_lists_the_choices(tmp_path: Path) -> None:
    path = write(tmp_path, edit(GOOD, "  optimizer: adamw\n", "  optimizer: adam\n"))  # line 12
    assert (
        error_of(path)
        == f"{path}:12: train.optimizer: invalid value 'adam'; valid: adamw, sgd (did you mean 'adamw'?)"
    )
    path = write(tmp_path, edit(GOOD, "  runtimes: [onnxruntime]\n", "  runtimes: [onnxruntime, openvno]\n"))
    assert error_of(path) == (
        f"{path}:28: validate.runtimes.1: invalid value 'openvno'; valid: cuda, onnxruntime, openvino "
        "(did you mean 'openvino'?)"
    )


def test_wrong_version(tmp_path: Path) -> None:
    path = write(tmp_path, edit(GOOD, "version: 1\n", "version: 2\n"))
    assert error_of(path) == f"{path}:1: version: Input should be 1 (got 2)"


def test_missing_required_field(tmp_path: Path) -> None:
    path = write(tmp_path, edit(GOOD, "version: 1\n", ""))
    assert error_of(path) == f"{path}:1: version: required field is missing"
    path = write(
        tmp_path,
        edit(GOOD, "  - name: calibrate             # line 21\n    modifiers:\n", "  - modifiers:\n"),
    )
    assert error_of(path) == f"{path}:21: stages.1.name: required field is missing"
    assert error_of({"version": 1}) == "recipe: model: required field is missing"


def test_model_needs_exactly_one_source(tmp_path: Path) -> None:
    path = write(tmp_path, edit(GOOD, "  name: tiny_mlp\n", "  name: tiny_mlp\n  hf_path: /models/bert\n"))
    assert (
        error_of(path)
        == f"{path}:3: model: set exactly one of 'name' (zoo name or pkg.module:factory) or 'hf_path'"
    )


def test_modifier_schedule_must_be_ordered(tmp_path: Path) -> None:
    path = write(
        tmp_path, edit(GOOD, "        end_epoch: 1.5\n", "        start_epoch: 2\n        end_epoch: 1.5\n")
    )
    assert (
        error_of(path)
        == f"{path}:18: stages.0.modifiers.0: end_epoch (1.5) must be greater than start_epoch (2.0)"
    )
    msg = error_of(
        yaml.safe_load(GOOD), ["stages.1.modifiers.0.end_step=3", "stages.1.modifiers.0.start_step=3"]
    )
    assert msg.endswith("stages.1.modifiers.0: end_step (3) must be greater than start_step (3)")


def test_empty_stage_name_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, edit(GOOD, "  - name: calibrate ", "  - name: '' "))
    assert error_of(path) == f"{path}:21: stages.1.name: String should have at least 1 character (got '')"


def test_duplicate_stage_names_name_the_second_one(tmp_path: Path) -> None:
    path = write(tmp_path, edit(GOOD, "  - name: calibrate ", "  - name: prune "))
    msg = error_of(path)
    assert msg == f"{path}:21: stages.1.name: stage name 'prune' is used twice (first as stages.0.name)"
    data = yaml.safe_load(GOOD)
    msg = error_of(data, ["stages.2={name: calibrate}"])
    assert (
        msg
        == "recipe: --set stages.2={name: calibrate}: stages.2.name: stage name 'calibrate' is used twice (first as stages.1.name)"
    )


# ---- order rules and needs -------------------------------------------------------------------------


def test_prune_after_quantize_names_both_modifiers(tmp_path: Path) -> None:
    text = edit(GOOD, "stages:\n", "stages:\n  - name: quant\n    modifiers:\n      - type: test_calib\n")
    path = write(tmp_path, text)  # the quantize modifier is on line 17, the prune one moves to 21
    msg = error_of(path)
    assert msg.startswith(
        f"{path}:21: stages.1.modifiers.0: 'prune' after 'quantize' ({path}:17: stages.0.modifiers.0): "
        "pruning after quantization"
    )


def test_prune_before_quantize_and_in_the_same_stage_are_fine() -> None:
    ok = load_recipe(
        {
            "version": 1,
            "model": {"name": "m"},
            "stages": [
                {"name": "a", "epochs": 1, "modifiers": [{"type": "test_calib"}, {"type": "test_train"}]},
                {"name": "b", "epochs": 1, "modifiers": [{"type": "test_train"}]},
            ],
        },
        overrides=["stages.1.modifiers.0.type=test_noop"],
    )
    assert [m.type for s in ok.stages for m in s.modifiers] == ["test_calib", "test_train", "test_noop"]


def test_calibration_modifier_needs_calibration_samples(tmp_path: Path) -> None:
    path = write(tmp_path, edit(GOOD, "  calibration_samples: 16\n", "  calibration_samples: 0\n"))
    assert error_of(path) == (
        f"{path}:23: stages.1.modifiers.0: 'test_calib' needs calibration data but data.calibration_samples is 0"
    )
    msg = error_of(write(tmp_path, GOOD), ["data.calibration_samples=0"])
    assert "'test_calib' needs calibration data but data.calibration_samples is 0" in msg


def test_training_modifier_needs_epochs_or_steps(tmp_path: Path) -> None:
    path = write(tmp_path, edit(GOOD, "    epochs: 2\n", ""))
    assert (
        error_of(path)
        == f"{path}:17: stages.0.modifiers.0: 'test_train' needs training; give stage 'prune' epochs or steps"
    )
    r = load_recipe(path, overrides=["stages.0.steps=10"])
    assert r.stages[0].steps == 10 and r.stages[0].trains


def test_error_in_recipe_object_reload_is_still_a_recipe_error(tmp_path: Path) -> None:
    r = load_recipe(write(tmp_path, GOOD))
    msg = error_of(r, ["stages.0.epochs=-2"])
    assert (
        msg
        == f"{r.source.name}: --set stages.0.epochs=-2: stages.0.epochs: Input should be greater than or equal to 0 (got -2)"
    )  # type: ignore[union-attr]


def test_infinite_or_nan_numbers_are_refused(tmp_path: Path) -> None:
    path = write(tmp_path, edit(GOOD, "    epochs: 2\n", "    epochs: .inf\n"))  # line 16
    assert error_of(path) == f"{path}:16: stages.0.epochs: Input should be a finite number (got inf)"
    msg = error_of(path, ["stages.0.epochs=1", "train.lr=.nan"])
    assert msg == f"{path}: --set train.lr=.nan: train.lr: Input should be a finite number (got nan)"


def test_control_characters_from_user_input_stay_on_one_line(tmp_path: Path) -> None:
    # error_of asserts the one line; the names are shown escaped
    msg = error_of(yaml.safe_load(GOOD), ["0=\n"])
    assert msg.startswith("recipe: --set 0=\\n: 0: unknown field '0'; valid: ")
    path = write(tmp_path, GOOD + '"col\\nour": 1\n')  # a quoted key with an escaped newline
    assert error_of(path).startswith(f"{path}:31: col\\nour: unknown field 'col\\nour'; valid: ")
    path = write(tmp_path, edit(GOOD, "    epochs: 2\n", ""))
    msg = error_of(path, ['stages.0.name="a\\tb"'])  # YAML turns the escape into a tab
    assert msg.endswith("'test_train' needs training; give stage 'a\\tb' epochs or steps")
    assert error_of("version: 1\nmodel: {name: m}\n").endswith(": recipe file not found")


def test_a_key_given_twice_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD + "train:\n  epochs: 5\n")  # line 31; yaml.safe_load would keep this one
    assert error_of(path) == f"{path}:31: train: key 'train' is given twice in one mapping (first on line 10)"
    path = write(tmp_path, edit(GOOD, "        bits: 4\n", "        bits: 4\n        bits: 6\n"))
    assert error_of(path) == (
        f"{path}:25: stages.1.modifiers.0.bits: key 'bits' is given twice in one mapping (first on line 24)"
    )
    # an alias repeats a mapping, not a key
    path = write(tmp_path, edit(GOOD, "    hidden: 8\n", "    hidden: &h {a: 1, b: 2}\n    again: *h\n"))
    assert load_recipe(path).model.kwargs == {"hidden": {"a": 1, "b": 2}, "again": {"a": 1, "b": 2}}
    # the same digits as a string and as a number are two keys (and the number is not a valid name)
    path = write(tmp_path, edit(GOOD, "    hidden: 8\n", "    '1': 2\n    1: 3\n"))
    assert error_of(path).endswith(": model.kwargs.1: Input should be a valid string (got 1)")
