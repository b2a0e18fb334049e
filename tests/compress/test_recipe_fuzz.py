"""Random damage to valid recipes: load_recipe either succeeds or raises one RecipeError line.

Mutations act on the data (delete keys, insert unknown keys, replace values with values of random
types, rename keys with typos, change modifier types, duplicate stages), on overrides (random
``key=value`` strings) and on the YAML text itself (delete, insert or replace characters and lines).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from compress.core.errors import RecipeError
from compress.recipe import Recipe, load_recipe
from compress.session import Session

MODEL = nn.Sequential(nn.Linear(2, 2))

BASE: dict[str, Any] = {
    "version": 1,
    "name": "fuzz",
    "description": "a recipe to break",
    "model": {"name": "tiny_mlp", "kwargs": {"hidden": 8, "depth": 2}, "checkpoint": "w.pt"},
    "data": {"source": "synthetic", "calibration_samples": 16, "kwargs": {"n": 64}, "seed": 1},
    "train": {"epochs": 1, "optimizer": "adamw", "lr": 0.01, "schedule": "step", "grad_clip": 1.0},
    "stages": [
        {
            "name": "prune",
            "epochs": 2,
            "lr": 0.001,
            "modifiers": [
                {"type": "test_train", "label": "p", "targets": ["0"], "end_epoch": 1.5},
                {"type": "test_noop", "mode": "exact", "options": {"a": 1}, "update_every": 2},
            ],
        },
        {"name": "calibrate", "modifiers": [{"type": "test_calib", "bits": 4, "max_batches": 2}]},
        {
            "name": "distill",
            "steps": 5,
            "modifiers": [{"type": "test_loss", "scale": 0.5, "start_step": 1, "end_step": 4}],
        },
    ],
    "export": {"opset": 17, "dynamic_batch": False, "activation_dtype": "int8"},
    "validate": {
        "runtimes": ["onnxruntime", "openvino"],
        "batch_sizes": [1, 8],
        "runs": 3,
        "thresholds": {"max_accuracy_drop": 0.02, "min_cosine": 0.99, "min_speedup": 1.1},
    },
}

TEST_TYPES = ["test_noop", "test_calib", "test_train", "test_loss"]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**40), max_value=2**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(
        ["", "0", "-1", "1e-3", "yes", "null", "[", "{a: 1}", "adamw", "test_calib", "type:Linear"]
    ),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.one_of(st.text(max_size=6), st.integers()), inner, max_size=3),
    ),
    max_leaves=6,
)
keys = st.one_of(
    st.text(min_size=1, max_size=10), st.sampled_from(["type", "name", "epochs", "steps", "modifiers"])
)


def containers(data: Any, path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], Any]]:
    """Every dict and list inside ``data`` with its path, the root first."""
    out = [(path, data)]
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else []
    for k, v in items:
        if isinstance(v, (dict, list)):
            out.extend(containers(v, (*path, k)))
    return out


def typo(word: str, draw: Any) -> str:
    if not word:
        return "x"
    i = draw(st.integers(0, len(word) - 1))
    op = draw(st.sampled_from(["drop", "double", "swap", "case", "replace"]))
    if op == "drop":
        return word[:i] + word[i + 1 :] or "y"
    if op == "double":
        return word[:i] + word[i] + word[i:]
    if op == "swap" and i + 1 < len(word):
        return word[:i] + word[i + 1] + word[i] + word[i + 2 :]
    if op == "case":
        return word[:i] + word[i].swapcase() + word[i + 1 :]
    return word[:i] + draw(st.characters(codec="utf-8")) + word[i + 1 :]


@st.composite
def damaged(draw: Any) -> dict[str, Any]:
    """BASE with one to four random mutations applied."""
    data = copy.deepcopy(BASE)
    for _ in range(draw(st.integers(1, 4))):
        spots = containers(data)
        _, node = spots[draw(st.integers(0, len(spots) - 1))]
        op = draw(st.sampled_from(["delete", "insert", "replace", "rename", "modtype", "dupstage", "dupmod"]))
        if op == "modtype":
            mods = [
                m
                for s in data.get("stages", [])
                if isinstance(s, dict)
                for m in (s.get("modifiers") or [])
                if isinstance(m, dict)
            ]
            if mods:
                mod = mods[draw(st.integers(0, len(mods) - 1))]
                mod["type"] = draw(
                    st.one_of(
                        st.sampled_from(TEST_TYPES),
                        st.sampled_from(TEST_TYPES).map(lambda w: typo(w, draw)),
                        values,
                    )
                )
            continue
        if op in ("dupstage", "dupmod"):
            stages = data.get("stages")
            if isinstance(stages, list) and stages:
                target = stages
                if (
                    op == "dupmod"
                    and isinstance(stages[0], dict)
                    and isinstance(stages[0].get("modifiers"), list)
                ):
                    target = stages[0]["modifiers"]
                if target:
                    target.append(copy.deepcopy(target[draw(st.integers(0, len(target) - 1))]))
            continue
        if isinstance(node, dict):
            if op == "insert" or not node:
                node[draw(keys)] = draw(values)
                continue
            key = draw(st.sampled_from(sorted(node, key=str)))
            if op == "delete":
                del node[key]
            elif op == "replace":
                node[key] = draw(values)
            else:  # rename with a typo
                node[typo(str(key), draw)] = node.pop(key)
        elif isinstance(node, list):
            if op == "insert" or not node:
                node.insert(draw(st.integers(0, len(node))), draw(values))
                continue
            i = draw(st.integers(0, len(node) - 1))
            if op == "delete":
                del node[i]
            else:
                node[i] = draw(values)
    return data


def paths_of(data: Any, prefix: str = "") -> list[str]:
    out = []
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else []
    for k, v in items:
        p = f"{prefix}{k}"
        out.append(p)
        out.extend(paths_of(v, p + "."))
    return out


PATHS = sorted(paths_of(BASE))

SMALL = [
    "0",
    "1",
    "2",
    "-3",
    "0.5",
    ".inf",
    "[1",
    "{}",
    "[]",
    "null",
    "true",
    "adamw",
    "test_noop",
    "{type: test_calib}",
]
overrides = st.lists(
    st.one_of(
        st.builds(
            lambda p, v: f"{p}={v}",
            st.sampled_from(PATHS),
            st.one_of(st.sampled_from(SMALL), st.text(max_size=8)),
        ),
        st.builds(lambda p, v: f"{p}={v}", st.sampled_from(PATHS), st.sampled_from(SMALL)),
        st.builds(
            lambda p, v: f"{p}={yaml.safe_dump(v, default_flow_style=True).strip()}",
            st.sampled_from(PATHS),
            values,
        ),
        st.builds(
            lambda p, k, v: f"{p}.{k}={v}",
            st.sampled_from(PATHS),
            st.sampled_from(["0", "1", "9", "x", "", "-1", "type"]),
            st.sampled_from(SMALL),
        ),
        st.builds(lambda k, v: f"{k}={v}", st.text(max_size=8), st.text(max_size=6)),
        st.sampled_from(["train.epochs", "=1", ".=1", "stages..name=x", "stages.0.=x", " train.lr = 0.1 "]),
    ),
    max_size=3,
)


def check(recipe: Any, ovs: list[str] | None = None) -> None:
    try:
        result = load_recipe(recipe, overrides=ovs or [])
    except RecipeError as exc:
        msg = str(exc)
        assert msg.strip(), "empty RecipeError message"
        assert "\n" not in msg and "\r" not in msg, f"multi-line RecipeError: {msg!r}"
        return
    assert isinstance(result, Recipe)
    # a recipe that loads also survives its own round trip (what the run folder stores) and
    # drives a Session
    resolved = result.to_dict()
    assert load_recipe(resolved).to_dict() == resolved
    session = Session(result, MODEL)
    assert session.total_epochs >= 0
    assert len(session.modifiers) == len(result.stages)


FUZZ = settings(
    max_examples=200, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck)
)


def test_base_recipe_is_valid() -> None:
    r = load_recipe(BASE)
    assert [s.name for s in r.stages] == ["prune", "calibrate", "distill"]
    assert [m.type for s in r.stages for m in s.modifiers] == [
        "test_train",
        "test_noop",
        "test_calib",
        "test_loss",
    ]


@FUZZ
@given(data=damaged())
def test_damaged_mappings_raise_only_recipe_errors(data: dict[str, Any]) -> None:
    check(data)


@FUZZ
@given(ovs=overrides, data=st.one_of(st.just(BASE), damaged()))
def test_random_overrides_raise_only_recipe_errors(ovs: list[str], data: dict[str, Any]) -> None:
    check(data, ovs)


TEXT = yaml.safe_dump(BASE, sort_keys=False)
LINES = TEXT.splitlines(keepends=True)
NASTY = [
    ":",
    "- ",
    "  ",
    "\t",
    "{",
    "[",
    "]",
    "&a ",
    "*a",
    "!!python/object:os.system ",
    "!!int ",
    "? ",
    "|",
    ">",
    "'",
    '"',
    "#",
    "%",
    "@",
    "---\n",
    "...\n",
    "\\",
    "\x00",
    "é",
]


@st.composite
def damaged_text(draw: Any) -> str:
    text = TEXT
    for _ in range(draw(st.integers(1, 3))):
        op = draw(
            st.sampled_from(["del_char", "ins", "replace_char", "del_line", "dup_line", "indent", "dedent"])
        )
        lines = text.splitlines(keepends=True) or [""]
        li = draw(st.integers(0, len(lines) - 1))
        line = lines[li]
        ci = draw(st.integers(0, max(len(line) - 1, 0)))
        ins = draw(st.one_of(st.sampled_from(NASTY), st.text(max_size=4)))
        if op == "del_char":
            line = line[:ci] + line[ci + 1 :]
        elif op == "ins":
            line = line[:ci] + ins + line[ci:]
        elif op == "replace_char":
            line = line[:ci] + ins + line[ci + 1 :]
        elif op == "del_line":
            line = ""
        elif op == "dup_line":
            line = line + line
        elif op == "indent":
            line = "  " + line
        else:
            line = line[2:] if line.startswith("  ") else line
        lines[li] = line
        text = "".join(lines)
    return text


@FUZZ
@given(text=damaged_text())
def test_damaged_yaml_text_raises_only_recipe_errors(tmp_path_factory: Any, text: str) -> None:
    path: Path = tmp_path_factory.mktemp("fuzz") / "recipe.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    check(path)


def test_each_kind_of_text_damage_is_a_recipe_error(tmp_path: Path) -> None:
    """Fixed examples of what the text fuzzer produces, each with the error it must give."""
    samples = {
        "version: [1\n": "malformed YAML",
        "  lr: fast\n": "train.lr: Input should be a valid number",
        "  lrr: 0.01\n": "unknown field 'lrr'",
        "name: !!python/object:os.system fuzz\n": "malformed YAML: could not determine a constructor",
    }
    originals = ["version: 1\n", "  lr: 0.01\n", "  lr: 0.01\n", "name: fuzz\n"]
    for (new, expected), old in zip(samples.items(), originals):
        assert TEXT.count(old) == 1, old
        path = tmp_path / "r.yaml"
        path.write_text(TEXT.replace(old, new), encoding="utf-8")
        try:
            load_recipe(path)
        except RecipeError as exc:
            assert expected in str(exc), (expected, str(exc))
        else:
            raise AssertionError(f"{new!r} loaded")
