"""benchmarks/architecture.py's static part: module discovery, import resolution, cycles, local imports."""

from __future__ import annotations

from pathlib import Path

from benchmarks.architecture import markdown
from benchmarks.import_graph import PACKAGES, ROOT, package_files, static_imports, strongly_connected


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_repo_static_figures_have_their_structure() -> None:
    fig = static_imports(ROOT, PACKAGES)
    s = fig.summary()
    assert s["modules"] >= 50
    assert set(s["files_per_package"]) == set(PACKAGES)
    assert all(n > 0 for n in s["files_per_package"].values())
    assert s["lines_of_code"] > 1000
    assert s["import_edges"] > 0 and 0 < s["import_edges_cross_package"] <= s["import_edges"]
    assert s["import_cycles"] == len(s["cycles"]) and all(len(c) > 1 for c in s["cycles"])
    assert s["import_cycles_module_level"] <= s["import_cycles"]
    assert 0 <= s["function_local_imports_cross_package"] <= s["function_local_imports"] <= s["function_local_imports_all"]
    # every edge joins two discovered modules
    modules = package_files(ROOT, PACKAGES)
    assert all(e.source in modules and e.target in modules for e in fig.edges)
    md = markdown({"static": s, "docs": {"readme_lines": 1, "docs_pages": None}, "route": None})
    assert md.startswith("| figure | value |") and "import cycles" in md


def test_cycle_found_in_a_cyclic_package(tmp_path: Path) -> None:
    _write(tmp_path, {
        "compress/__init__.py": "",
        "compress/core/__init__.py": "",
        "compress/core/a.py": "from compress.core import b\n",
        "compress/core/b.py": "def f():\n    from .c import g\n    return g\n",
        "compress/core/c.py": "from ..core.a import x\nx = 1\n",
        "compress/d.py": "import compress.core.a\n",
        "export/__init__.py": "",
        "export/e.py": "from compress import d\nfrom . import f\n",
        "export/f.py": "import importlib\nimportlib.import_module('export.e')\n",
    })
    fig = static_imports(tmp_path, ("compress", "export"))
    s = fig.summary()
    assert s["modules"] == 9
    assert s["cycles"] == [["compress.core.a", "compress.core.b", "compress.core.c"], ["export.e", "export.f"]]
    # the first cycle closes through a function-local import: not a cycle of module-level imports alone
    assert s["module_level_cycles"] == [["export.e", "export.f"]]
    assert s["importlib_literal_calls"] == 1
    edges = {(e.source, e.target) for e in fig.edges}
    assert ("compress.core.c", "compress.core.a") in edges  # ..core.a resolved from compress.core.c
    assert ("export.e", "compress.d") in edges  # `from compress import d` -> the submodule


def test_no_cycle_in_an_acyclic_package(tmp_path: Path) -> None:
    _write(tmp_path, {
        "compress/__init__.py": "from compress.a import A\n",
        "compress/a.py": "import os\nfrom compress import b\nA = b.B\n",
        "compress/b.py": "B = 1\n",
        "quantization/__init__.py": "",
        "quantization/q.py": "from compress.a import A\nfrom compress import b\n",
    })
    s = static_imports(tmp_path, ("compress", "quantization")).summary()
    assert s["import_cycles"] == 0 and s["cycles"] == []
    assert s["import_edges"] == 4 and s["import_edges_cross_package"] == 2
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert strongly_connected({"a": {"b"}, "b": {"a"}, "c": {"c"}}) == [["a", "b"]]


def test_function_local_imports_counted(tmp_path: Path) -> None:
    _write(tmp_path, {
        "compress/__init__.py": "",
        "compress/x.py": (
            "import json\n"
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n"
            "    from pruning.p import P\n"
            "def f():\n"
            "    import torch\n"  # local, third-party
            "    from compress import y\n"  # local, same package
            "    from pruning import p\n"  # local, crosses packages
            "    return y, p, torch\n"
            "class C:\n"
            "    def m(self):\n"
            "        from pruning.p import P\n"  # local (method), crosses packages
            "        return P\n"
        ),
        "compress/y.py": "",
        "pruning/__init__.py": "",
        "pruning/p.py": "P = 1\n",
    })
    s = static_imports(tmp_path, ("compress", "pruning")).summary()
    assert s["function_local_imports_all"] == 4
    assert s["function_local_imports"] == 3
    assert s["function_local_imports_cross_package"] == 2
    assert s["type_checking_imports"] == 1
    assert s["package_edges"] == {"compress -> pruning": 1}
