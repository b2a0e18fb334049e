"""Bounded reads of the YAML and JSON files a user hands over (recipes, run markers, reports, model
configs): a size limit before parsing, and for YAML a limit on what aliases expand to.

PyYAML builds an alias as a shared reference, so a few hundred bytes of nested aliases ("billion
laughs") load at once but expand to billions of nodes as soon as anything walks or validates them.
The expanded size is counted on the composed node graph (each node's size once, memoized) before a
Python object is constructed, so such a file is refused in milliseconds.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

from compress.core.errors import RecipeError

#: a recipe is a page of settings: 1 MiB is thousands of times the largest shipped one
YAML_BYTES = 2**20
#: nodes a YAML document may expand to through its aliases (the largest shipped recipe has ~150)
YAML_NODES = 100_000
#: JSON files the project reads (configs, reports, markers) are far smaller than this
JSON_BYTES = 64 * 2**20


class InputTooLarge(RecipeError):
    """A file is larger, or expands to more, than the project reads."""


def read_bounded(path: str | Path, *, limit: int, what: str) -> str:
    """The text of ``path`` (UTF-8), refused past ``limit`` bytes without reading it whole."""
    p = Path(path)
    with p.open("rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise InputTooLarge(f"{p}: the {what} is larger than {limit // 2**10} KiB; refusing to read it")
    return data.decode("utf-8")


def expanded_nodes(root: yaml.Node | None) -> int:
    """How many nodes ``root`` stands for with every alias expanded (shared nodes counted per use)."""
    if root is None:
        return 0
    sizes: dict[int, int] = {}
    open_: set[int] = set()  # nodes whose children are being counted: meeting one again is a cycle
    # iterative post-order: a deep document must not hit Python's recursion limit
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, ready = stack.pop()
        if id(node) in sizes:
            continue
        kids: list[yaml.Node] = []
        if isinstance(node, yaml.SequenceNode):
            kids = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            kids = [n for pair in node.value for n in pair]
        if ready or not kids:
            sizes[id(node)] = 1 + sum(sizes[id(k)] for k in kids)
            open_.discard(id(node))
            continue
        if id(node) in open_:
            return sys.maxsize  # a recursive alias expands without end
        open_.add(id(node))
        stack.append((node, True))
        for k in kids:
            if id(k) in open_:
                return sys.maxsize
            if id(k) not in sizes:
                stack.append((k, False))
    return sizes[id(root)]


def compose_yaml(text: str, *, name: str, limit_nodes: int = YAML_NODES) -> yaml.Node | None:
    """The node graph of ``text`` (safe tags only), refused when its aliases expand past the bound."""
    root = yaml.compose(text, Loader=yaml.SafeLoader)
    n = expanded_nodes(root)
    if n == sys.maxsize:
        raise InputTooLarge(f"{name}: the YAML refers to itself through an alias; refusing to load it")
    if n > limit_nodes:
        raise InputTooLarge(
            f"{name}: the YAML expands to {n:,} nodes through its aliases (more than {limit_nodes:,}); refusing to load it"
        )
    return root


def load_yaml(text: str, *, name: str, limit_nodes: int = YAML_NODES) -> Any:
    """``yaml.safe_load(text)`` with the alias bound (:func:`compose_yaml`); YAMLError as PyYAML raises it."""
    if len(text) > YAML_BYTES:
        raise InputTooLarge(f"{name}: the YAML is larger than {YAML_BYTES // 2**10} KiB; refusing to load it")
    root = compose_yaml(text, name=name, limit_nodes=limit_nodes)
    if root is None:
        return None
    return yaml.SafeLoader("").construct_document(root)


def load_yaml_file(path: str | Path, *, what: str = "YAML file") -> Any:
    """A YAML file through :func:`read_bounded` and :func:`load_yaml`."""
    return load_yaml(read_bounded(path, limit=YAML_BYTES, what=what), name=str(path))


def load_json_file(path: str | Path, *, limit: int = JSON_BYTES, what: str = "JSON file") -> Any:
    """A JSON file, refused past ``limit`` bytes; a document nested too deep to parse is a ValueError."""
    text = read_bounded(path, limit=limit, what=what)
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"{path}: the {what} is nested too deeply") from None
