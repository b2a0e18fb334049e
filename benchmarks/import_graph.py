"""The project's static import graph and its floors, read with ``ast`` (nothing is imported).

Every ``.py`` file of the five packages is a module; an edge is an import statement (function-local
and TYPE_CHECKING ones marked), an ``importlib.import_module("literal")`` call, or a module's dotted
name in a string (a module list imported by name later, a lazy re-export map). Import cycles are the
graph's strongly connected components of more than one module. The floors (core < algorithm
packages < export < compress's top) are defined here once: tests/test_layering.py checks them and
benchmarks/architecture.py reports them.
"""

from __future__ import annotations

import ast
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PACKAGES: tuple[str, ...] = ("compress", "quantization", "pruning", "distillation", "export")


# ---- module discovery ---------------------------------------------------------------------------


def namespaced(root: Path) -> bool:
    """Whether the tree at ``root`` installs its top folders under ``compress.`` (pyproject's
    package-dir maps ``compress.quantization`` to ``quantization/``); trees from before it did not."""
    project = root / "pyproject.toml"
    try:
        return '"compress.quantization" = "quantization"' in project.read_text(encoding="utf-8")
    except OSError:
        return False


def package_files(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file under the packages (``__init__.py`` names its
    package; in a namespaced tree ``quantization/x.py`` is ``compress.quantization.x``). Folders
    without ``__init__.py`` are walked too (namespace packages)."""
    out: dict[str, Path] = {}
    prefix = ["compress"] if namespaced(root) else []
    for pkg in packages:
        base = root / pkg
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(root)
            if any(part == "__pycache__" or part.startswith(".") for part in rel.parts):
                continue
            parts = list(rel.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if pkg != "compress":
                parts = [*prefix, *parts]
            out[".".join(parts)] = path
    return out


def top_package(module: str) -> str:
    """The owner's top folder a module lives in: ``compress.quantization.api`` -> ``quantization``
    (the folders install under ``compress.``), ``compress.runner`` -> ``compress``."""
    parts = module.split(".")
    if parts[0] == "compress" and len(parts) > 1 and parts[1] in PACKAGES[1:]:
        return parts[1]
    return parts[0]


# ---- floors ------------------------------------------------------------------------------------------

ALGORITHMS = ("quantization", "pruning", "distillation")
#: bottom to top: a module may import and call its own floor and those below it
FLOORS = ("core", "algorithms", "export", "top")


def floor(module: str, core: Iterable[str] = ()) -> str:
    """The floor of ``module``: compress/core/ (plus any module named in ``core``, for trees from before
    that folder existed), the algorithm packages, export/, or compress's top."""
    if module == "compress.core" or module.startswith("compress.core.") or module in set(core):
        return "core"
    top = top_package(module)
    return "algorithms" if top in ALGORITHMS else "export" if top == "export" else "top"


# ---- static import graph ------------------------------------------------------------------------


@dataclass
class ImportEdge:
    source: str
    target: str
    line: int
    kind: str  # "import" (a statement), "importlib" (import_module("literal")) or "named" (a module's name in a string)
    local: bool  # inside a function body
    type_checking: bool = False


@dataclass
class StaticFigures:
    modules: int
    files_per_package: dict[str, int]
    lines_of_code: int
    edges: list[ImportEdge] = field(default_factory=list)
    cycles: list[list[str]] = field(default_factory=list)
    module_level_cycles: list[list[str]] = field(default_factory=list)  # from module-level imports alone
    local_imports: int = 0  # import statements inside function bodies that import a project module
    local_imports_cross_package: int = 0  # ... whose target is in another top-level package
    local_imports_all: int = 0  # import statements inside function bodies, third-party ones included
    importlib_literal: int = 0  # importlib.import_module("literal") calls naming a project module
    importlib_dynamic: int = 0  # import_module(...) calls whose argument is not a literal
    type_checking_imports: int = 0  # project imports under ``if TYPE_CHECKING:`` (left out of the graph)
    named_modules: int = 0  # string constants that are a project module's name (lazy loads by name)

    def graph(self, *, local: bool = True) -> dict[str, set[str]]:
        """Module -> the modules it imports at run time (``local=False``: module-level imports alone)."""
        g: dict[str, set[str]] = {}
        for e in self.edges:
            if not e.type_checking and e.source != e.target and (local or not e.local):
                g.setdefault(e.source, set()).add(e.target)
        return g

    def summary(self) -> dict[str, Any]:
        g = self.graph()
        pkg_edges = Counter(
            f"{top_package(a)} -> {top_package(b)}" for a, targets in g.items() for b in targets if top_package(a) != top_package(b)
        )
        return {
            "modules": self.modules,
            "files_per_package": self.files_per_package,
            "lines_of_code": self.lines_of_code,
            "import_edges": sum(len(t) for t in g.values()),
            "import_edges_cross_package": sum(1 for a, t in g.items() for b in t if top_package(a) != top_package(b)),
            "package_edges": dict(sorted(pkg_edges.items())),
            "import_cycles": len(self.cycles),
            "modules_in_cycles": sum(len(c) for c in self.cycles),
            "largest_cycle": max((len(c) for c in self.cycles), default=0),
            "cycles": self.cycles,
            "import_cycles_module_level": len(self.module_level_cycles),
            "module_level_cycles": self.module_level_cycles,
            "function_local_imports": self.local_imports,
            "function_local_imports_cross_package": self.local_imports_cross_package,
            "function_local_imports_all": self.local_imports_all,
            "importlib_literal_calls": self.importlib_literal,
            "importlib_dynamic_calls": self.importlib_dynamic,
            "type_checking_imports": self.type_checking_imports,
            "named_module_strings": self.named_modules,
        }


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module ``name`` names, else its longest project prefix (``pkg.mod.attr`` -> ``pkg.mod``)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        cand = ".".join(parts[:i])
        if cand in modules:
            return cand
    return None


def _base_package(module: str, path: Path, level: int) -> str:
    """The package a relative import of ``level`` dots in ``module`` starts from."""
    pkg = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(level - 1):
        pkg = pkg.rpartition(".")[0]
    return pkg


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _is_import_module_call(node: ast.Call) -> bool:
    f = node.func
    return (isinstance(f, ast.Attribute) and f.attr == "import_module") or (
        isinstance(f, ast.Name) and f.id in ("import_module", "__import__")
    )


class _ImportVisitor(ast.NodeVisitor):
    def __init__(self, module: str, path: Path, modules: dict[str, Path], figures: StaticFigures) -> None:
        self.module, self.path, self.modules, self.fig = module, path, modules, figures
        self.depth = 0  # function nesting
        self.type_checking = 0
        self.import_args: set[int] = set()  # import_module("literal") arguments, counted as importlib edges

    # -- scopes
    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = _function
    visit_AsyncFunctionDef = _function
    visit_Lambda = _function

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            self.type_checking += 1
            for stmt in node.body:
                self.visit(stmt)
            self.type_checking -= 1
            for stmt in node.orelse:
                self.visit(stmt)
        else:
            self.generic_visit(node)

    # -- imports
    def _add(self, targets: list[str], line: int, kind: str) -> None:
        targets = sorted(set(targets))
        statement = kind == "import"
        if self.depth and statement:
            self.fig.local_imports_all += 1
        if not targets:
            return
        if self.type_checking:
            self.fig.type_checking_imports += 1
        elif self.depth and statement:
            self.fig.local_imports += 1
            if any(top_package(t) != top_package(self.module) for t in targets):
                self.fig.local_imports_cross_package += 1
        for t in targets:
            self.fig.edges.append(ImportEdge(self.module, t, line, kind, bool(self.depth), bool(self.type_checking)))

    def visit_Import(self, node: ast.Import) -> None:
        found = [_resolve(a.name, self.modules) for a in node.names]
        self._add([t for t in found if t], node.lineno, "import")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = _base_package(self.module, self.path, node.level)
            src = f"{base}.{node.module}" if node.module and base else (node.module or base)
        else:
            src = node.module or ""
        targets: list[str] = []
        for alias in node.names:
            sub = f"{src}.{alias.name}" if src else alias.name
            if alias.name != "*" and sub in self.modules:
                targets.append(sub)
            else:
                t = _resolve(src, self.modules)
                if t:
                    targets.append(t)
        self._add(targets, node.lineno, "import")

    def visit_Constant(self, node: ast.Constant) -> None:
        # a module named in a string (a list of modules imported by name later, a lazy re-export
        # map) is a dependency no import statement shows
        # (dotted names only: a bare "compress" or "export" is a word more often than a module)
        if isinstance(node.value, str) and "." in node.value and node.value in self.modules and node.value != self.module \
                and id(node) not in self.import_args:
            self.fig.named_modules += 1
            self._add([node.value], node.lineno, "named")

    def visit_Call(self, node: ast.Call) -> None:
        if _is_import_module_call(node) and node.args:
            self.import_args.add(id(node.args[0]))
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                name = arg.value
                if name.startswith("."):  # import_module(".x", "pkg") / import_module(".x", __package__)
                    pkg_arg = node.args[1] if len(node.args) > 1 else None
                    pkg = pkg_arg.value if isinstance(pkg_arg, ast.Constant) and isinstance(pkg_arg.value, str) else None
                    level = len(name) - len(name.lstrip("."))
                    base = pkg or _base_package(self.module, self.path, 1)
                    for _ in range(level - 1):
                        base = base.rpartition(".")[0]
                    name = f"{base}.{name.lstrip('.')}" if name.lstrip(".") else base
                t = _resolve(name, self.modules)
                if t:
                    self.fig.importlib_literal += 1
                    self._add([t], node.lineno, "importlib")
            else:
                self.fig.importlib_dynamic += 1
        self.generic_visit(node)


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), each sorted; only those of size > 1."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    nodes = sorted(set(graph) | {t for ts in graph.values() for t in ts})
    for start in nodes:
        if start in index:
            continue
        work: list[tuple[str, Iterable[str]]] = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    advanced = True
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return sorted(out, key=lambda c: (-len(c), c))


def static_imports(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> StaticFigures:
    """The import graph of every ``.py`` file under ``packages`` of ``root``, and its cycles."""
    packages = tuple(packages)
    modules = package_files(root, packages)
    per_pkg = Counter(top_package(m) for m in modules)
    fig = StaticFigures(modules=len(modules), files_per_package={p: per_pkg.get(p, 0) for p in packages},
                        lines_of_code=0)
    for module, path in sorted(modules.items()):
        text = path.read_text(encoding="utf-8")
        fig.lines_of_code += len(text.splitlines())
        tree = ast.parse(text, filename=str(path))
        _ImportVisitor(module, path, modules, fig).visit(tree)
    fig.cycles = strongly_connected(fig.graph())
    fig.module_level_cycles = strongly_connected(fig.graph(local=False))
    return fig
