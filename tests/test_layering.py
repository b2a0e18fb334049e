"""The floors, checked on the source of every package: function-local imports, imports under
TYPE_CHECKING and modules named in strings (loaded by name later: the built-in modifier list, the
lazy re-export maps) all count.

- core (compress/core/) imports nothing above it;
- quantization/, pruning/, distillation/ import the core, themselves, and what BETWEEN declares;
- export/ imports the core and the algorithm packages' public read views (EXPORT_READS), never their
  internals;
- compress's top (recipe, runner, session, CLI, report, models, data, training) may import anything,
  and nothing below it imports it;
- no import cycle between files anywhere.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.import_graph import (
    ROOT,
    StaticFigures,
    floor,
    static_imports,
    strongly_connected,
    top_package,
)

#: what export/ may read of the algorithm packages: one read view, and the lowering room (integer
#: modules and kernels, which exports of real int8 / int4 compute are built from)
EXPORT_READS = ("compress.quantization.view", "compress.quantization.lowering")
#: imports declared between algorithm packages, as (importer, imported) packages: weight sparsity
#: (pruning/sparse: SparseGPT, Wanda) runs on quantization's layer-by-layer pipeline and GPTQ's Hessians
BETWEEN: frozenset[tuple[str, str]] = frozenset({("pruning", "quantization")})


def _reads(module: str, views: tuple[str, ...]) -> bool:
    return any(module == v or module.startswith(v + ".") for v in views)


def allowed(source: str, target: str) -> bool:
    """Whether ``source`` may import ``target`` under the floor rules."""
    src, dst = floor(source), floor(target)
    if src == "top" or dst == "core":
        return True
    if src == "algorithms":
        a, b = top_package(source), top_package(target)
        return dst == "algorithms" and (a == b or (a, b) in BETWEEN)
    if src == "export":
        return dst == "export" or _reads(target, EXPORT_READS)
    return False  # the core imports nothing above it


def violations(fig: StaticFigures) -> list[str]:
    """One line per import that breaks a floor rule: ``source:line -> target (how)``."""
    return sorted({f"{e.source}:{e.line} -> {e.target} ({e.kind}{', local' if e.local else ''})"
                   for e in fig.edges if not allowed(e.source, e.target)})


@pytest.fixture(scope="module")
def repo() -> StaticFigures:
    return static_imports(ROOT)


def test_every_import_respects_the_floors(repo: StaticFigures) -> None:
    bad = violations(repo)
    assert not bad, "imports that break the floors:\n" + "\n".join(bad)


def test_no_import_cycle_between_files(repo: StaticFigures) -> None:
    cycles = strongly_connected(repo.graph())
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_every_floor_imports_the_core(repo: StaticFigures) -> None:
    # the check has material: the packages exist and the core is imported from every floor
    assert {floor(e.source) for e in repo.edges if floor(e.target) == "core"} == {"core", "algorithms", "export", "top"}


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    for pkg in ("compress", "compress/core", "quantization", "quantization/placement", "pruning", "export"):
        (root / pkg).mkdir(parents=True, exist_ok=True)
        (root / pkg / "__init__.py").touch()
    # laid out as the project is: the top folders install as compress.<name>
    (root / "pyproject.toml").write_text('[tool.setuptools.package-dir]\n"compress.quantization" = "quantization"\n')
    return root


def test_violations_are_found_wherever_the_import_hides(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "compress/core/errors.py": "def f():\n    from compress.runner import run\n",  # function-local
        "compress/runner.py": "import compress.quantization.placement.mode\n",  # the top: fine
        "compress/modifiers.py": "MODS = ('compress.quantization.modifiers',)\n",  # named in a string: fine from the top
        "quantization/modifiers.py": "from compress.core.errors import f\n",  # fine
        "quantization/placement/mode.py": "NAME = 'compress.runner'\n",  # named in a string, upward
        "export/onnx.py": "from compress.quantization.placement import mode\nimport compress.quantization.view\n",
        "quantization/view.py": "",
        "pruning/api.py": "",
        "quantization/api.py": "from compress.pruning.api import prune\n",  # between algorithm packages, undeclared
    })
    fig = static_imports(root, ("compress", "quantization", "pruning", "export"))
    bad = violations(fig)
    assert [b.split(" (")[0] for b in bad] == [
        "compress.core.errors:2 -> compress.runner",
        "compress.export.onnx:1 -> compress.quantization.placement.mode",
        "compress.quantization.api:1 -> compress.pruning.api",
        "compress.quantization.placement.mode:1 -> compress.runner",
    ]
    assert "local)" in bad[0] and "(named)" in bad[3]


def test_a_cycle_through_a_function_local_import_is_found(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "export/describe.py": "def g():\n    from compress.export.validate import run\n",
        "export/validate.py": "from compress.export.describe import g\n",
    })
    assert strongly_connected(static_imports(root, ("export",)).graph()) == [["compress.export.describe", "compress.export.validate"]]
