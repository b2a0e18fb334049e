"""Code-structure figures, for before/after comparisons of an architecture refactor.

    python -m benchmarks.architecture [--json PATH] [--no-results] [--no-route] [--before JSON]

Two kinds of figures, both found by walking the five packages (compress, quantization, pruning,
distillation, export), never from a list of module names, so the script runs unchanged on a tree
whose files have moved into subfolders:

1. the ``compress apply`` PTQ route, run once in a fresh subprocess under ``sys.setprofile`` (and
   ``threading.setprofile``) around ``load_recipe`` + ``apply``: a small recipe written by this script
   (ResNet width 16 on scikit-learn digits, the model as built (``train.epochs: 0``), one PTQ stage,
   fp32 + QDQ int8 ONNX export, ONNX Runtime validation, the run report). Every Python call whose
   code lies in a project file is recorded: the files the route executes code in, the package
   crossings (caller's and callee's frames in project files of different top-level packages), the
   returns to a file the route had left, and the project modules imported from ``import compress`` on;
2. the static import graph over every ``.py`` file of the packages (benchmarks/import_graph.py):
   cycles, function-local imports, imports pointing up a floor.

Plus README.md's line count and the number of pages under docs/ (when there is a docs/).

This module imports nothing from the project at import time: the route's subprocess imports it
first and counts project modules from zero.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from types import FrameType
from typing import Any

from benchmarks.import_graph import FLOORS, PACKAGES, ROOT, floor, static_imports, top_package

# the route's recipe: only fields that exist in the recipe schema as it stands (model, data, train,
# one ptq stage, export, validate); small enough to run in seconds on a laptop CPU
ROUTE_RECIPE = """\
version: 1
name: arch_route
description: benchmarks/architecture.py's PTQ route (structure figures, not accuracy)
model:
  name: resnet
  kwargs: {width: 16, depth: 1, num_classes: 10, in_channels: 1}
data:
  source: digits
  calibration_samples: 64
  eval_samples: 128
train:
  epochs: 0
  seed: 0
  device: cpu
stages:
  - name: ptq
    modifiers:
      - type: ptq
        scheme: {preset: w8a8, weights: {reduce_range: true}}
        observer: percentile
        num_batches: 2
export:
  dynamic_batch: true
  baseline: true
validate:
  runtimes: [onnxruntime]
  batch_sizes: [1]
  warmup: 1
  runs: 3
  thresholds:
    max_accuracy_drop: 0.05
"""


def _file_module(rel: str) -> str:
    return rel.removesuffix(".py").replace("/", ".").removesuffix(".__init__")


def floor_crossings(crossings: list[dict[str, Any]], core: Iterable[str] = ()) -> dict[str, Any]:
    """The route's calls between files sorted by floor: downward, upward (a lower floor calling a
    higher one: what the floors forbid for imports; callbacks handed down arrive this way too),
    and the file pairs of the upward ones."""
    core = set(core)
    rank = {f: i for i, f in enumerate(FLOORS)}
    out: dict[str, Any] = {"down_calls": 0, "up_calls": 0, "same_floor_calls": 0, "up_pairs": []}
    for c in crossings:
        a, b = (rank[floor(_file_module(c[k]), core)] for k in ("caller", "callee"))
        key = "down_calls" if a > b else "up_calls" if a < b else "same_floor_calls"
        out[key] += c["calls"]
        if a < b:
            out["up_pairs"].append(f"{c['caller']} -> {c['callee']} ({c['calls']})")
    return out



# ---- the route under the profiler (runs in a fresh subprocess) ---------------------------------


class _RouteProfiler:
    def __init__(self, root: Path, packages: Iterable[str]) -> None:
        self.root = str(root.resolve())
        self.packages = set(packages)
        self._files: dict[str, tuple[str, str] | None] = {}  # co_filename -> (relpath, package) | None
        self.calls = 0
        self.files: Counter[str] = Counter()
        self.files_beyond_import: set[str] = set()  # files where a function (not only module code) ran
        self.crossings: Counter[tuple[str, str]] = Counter()  # (caller file, callee file), immediate caller
        self.via_library: Counter[tuple[str, str]] = Counter()  # nearest project frame through library frames
        self.reentries = 0
        self.transitions: set[tuple[str, str]] = set()  # distinct (file left, file entered) steps of the sequence
        self.sequence_length = 0
        self._last: dict[int, str] = {}
        self._visited: dict[int, set[str]] = {}

    def _classify(self, filename: str) -> tuple[str, str] | None:
        try:
            return self._files[filename]
        except KeyError:
            pass
        info: tuple[str, str] | None = None
        if filename.endswith(".py"):
            real = os.path.realpath(filename)
            if real.startswith(self.root + os.sep):
                rel = os.path.relpath(real, self.root).replace(os.sep, "/")
                pkg = rel.split("/", 1)[0]
                if pkg in self.packages and "/" in rel:
                    info = (rel, pkg)
        self._files[filename] = info
        return info

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        info = self._classify(code.co_filename)
        if info is None:
            return
        rel, pkg = info
        self.calls += 1
        self.files[rel] += 1
        if code.co_name != "<module>":
            self.files_beyond_import.add(rel)
        back = frame.f_back
        if back is not None:
            binfo = self._classify(back.f_code.co_filename)
            if binfo is not None:
                if binfo[1] != pkg:
                    self.crossings[binfo[0], rel] += 1
            else:
                up: FrameType | None = back.f_back
                for _ in range(64):
                    if up is None:
                        break
                    uinfo = self._classify(up.f_code.co_filename)
                    if uinfo is not None:
                        if uinfo[1] != pkg:
                            self.via_library[uinfo[0], rel] += 1
                        break
                    up = up.f_back
        tid = threading.get_ident()
        last = self._last.get(tid)
        if last != rel:
            if last is not None:
                self.transitions.add((last, rel))
            self._last[tid] = rel
            self.sequence_length += 1
            visited = self._visited.setdefault(tid, set())
            if rel in visited:
                self.reentries += 1
            visited.add(rel)

    def figures(self) -> dict[str, Any]:
        def pkg_edges(pairs: Counter[tuple[str, str]]) -> dict[str, int]:
            c: Counter[str] = Counter()
            for (a, b), n in pairs.items():
                c[f"{a.split('/', 1)[0]} -> {b.split('/', 1)[0]}"] += n
            return dict(sorted(c.items()))

        per_pkg = Counter(f.split("/", 1)[0] for f in self.files)
        return {
            "project_calls": self.calls,
            "files_executed": len(self.files),
            "files_executed_beyond_import": len(self.files_beyond_import),
            "files_per_package": {p: per_pkg.get(p, 0) for p in sorted(self.packages)},
            "crossing_calls": sum(self.crossings.values()),
            "crossing_pairs": len(self.crossings),
            "package_edges": pkg_edges(self.crossings),
            "crossing_calls_via_library": sum(self.via_library.values()),
            "crossing_pairs_via_library": len(self.via_library),
            "package_edges_via_library": pkg_edges(self.via_library),
            "file_sequence_length": self.sequence_length,
            "returns_to_left_file": self.reentries,
            "file_transitions": len(self.transitions),
            "files": sorted(self.files),
            "crossings": [{"caller": a, "callee": b, "calls": n} for (a, b), n in sorted(self.crossings.items())],
        }


def _route_child(recipe_path: str, out_json: str, run_dir: str) -> None:
    """Body of the route's subprocess: import compress, then profile load_recipe + apply."""
    before = set(sys.modules)
    t0 = time.perf_counter()
    import compress

    import_s = time.perf_counter() - t0
    prof = _RouteProfiler(ROOT, PACKAGES)
    t0 = time.perf_counter()
    threading.setprofile(prof)
    sys.setprofile(prof)
    try:
        recipe = compress.load_recipe(recipe_path, overrides=[])
        report = compress.apply(recipe, out_dir=run_dir, quiet=True)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    route_s = time.perf_counter() - t0
    imported = sorted(m for m in set(sys.modules) - before if top_package(m) in PACKAGES)
    figures = prof.figures()
    figures.update({
        "modules_imported": len(imported),
        "modules_imported_list": imported,
        "import_compress_seconds": round(import_s, 3),
        "route_seconds_profiled": round(route_s, 3),
        "exports": [str(e.path) for e in report.exports],
        "validations": len(report.validation),
        "report_written": (Path(run_dir) / "report.json").is_file(),
    })
    Path(out_json).write_text(json.dumps(figures, indent=1))


def measure_route(root: Path = ROOT, timeout: float = 900) -> dict[str, Any]:
    """Run the PTQ route in a fresh interpreter and return its figures."""
    with tempfile.TemporaryDirectory(prefix="arch_route_") as tmp:
        recipe = Path(tmp) / "arch_route.yaml"
        recipe.write_text(ROUTE_RECIPE)
        out = Path(tmp) / "route.json"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        cmd = [sys.executable, "-m", "benchmarks.architecture", "--route-child", str(recipe), str(out), str(Path(tmp) / "run")]
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not out.is_file():
            raise RuntimeError(f"route subprocess failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        data: dict[str, Any] = json.loads(out.read_text())
        return data


# ---- docs ---------------------------------------------------------------------------------------


def docs_figures(root: Path = ROOT) -> dict[str, Any]:
    readme = root / "README.md"
    docs = root / "docs"
    pages = sorted(p for p in docs.rglob("*") if p.is_file() and p.suffix in (".md", ".rst", ".txt")) if docs.is_dir() else []
    return {
        "readme_lines": len(readme.read_text(encoding="utf-8").splitlines()) if readme.is_file() else 0,
        "docs_pages": len(pages) if docs.is_dir() else None,
    }


def git_commit(root: Path = ROOT) -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", *PACKAGES], cwd=root, capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("-dirty" if dirty else "")


# ---- output ---------------------------------------------------------------------------------------


def _rows(data: dict[str, Any]) -> list[tuple[str, Any]]:
    s, d = data["static"], data["docs"]
    rows: list[tuple[str, Any]] = []
    r = data.get("route")
    if r is not None:
        rows += [
            ("route: project files executed", r["files_executed"]),
            ("route: ... in which a function ran (not only import)", r["files_executed_beyond_import"]),
            ("route: project calls (call events)", r["project_calls"]),
            ("route: package crossings (call events)", r["crossing_calls"]),
            ("route: package crossings (distinct caller->callee file pairs)", r["crossing_pairs"]),
            ("route: package edges (distinct pkg -> pkg)", len(r["package_edges"])),
            ("route: calls down / up between floors (core < algorithms < export < top)",
             f"{r['floors']['down_calls']} / {r['floors']['up_calls']}" if "floors" in r else "-"),
            ("route: crossings via library frames (events / file pairs)",
             f"{r['crossing_calls_via_library']} / {r['crossing_pairs_via_library']}"),
            ("route: returns to a file it had left", r["returns_to_left_file"]),
            ("route: file sequence length (consecutive repeats collapsed)", r["file_sequence_length"]),
            ("route: distinct file -> file steps in that sequence", r["file_transitions"]),
            ("route: project modules imported (from `import compress` on)", r["modules_imported"]),
        ]
    rows += [
        ("static: modules (.py files)", s["modules"]),
        ("static: lines of code", s["lines_of_code"]),
        ("static: import edges (file level, all runtime imports)", s["import_edges"]),
        ("static: import edges crossing top-level packages", s["import_edges_cross_package"]),
        ("static: package edges (distinct pkg -> pkg)", len(s["package_edges"])),
        ("static: import edges pointing up a floor", len(s.get("upward_import_edges", []))),
        ("static: import cycles (SCCs > 1 module)", s["import_cycles"]),
        ("static: ... from module-level imports alone", s["import_cycles_module_level"]),
        ("static: modules in cycles / largest cycle", f"{s['modules_in_cycles']} / {s['largest_cycle']}"),
        ("static: function-local project imports", s["function_local_imports"]),
        ("static: function-local imports crossing top-level packages", s["function_local_imports_cross_package"]),
        ("static: importlib.import_module(\"literal\") edges / non-literal calls",
         f"{s['importlib_literal_calls']} / {s['importlib_dynamic_calls']}"),
        ("static: TYPE_CHECKING-only project imports (not in graph)", s["type_checking_imports"]),
        ("static: modules named in strings (loaded by name; edges in the graph)", s.get("named_module_strings", 0)),
        ("README.md lines", d["readme_lines"]),
        ("docs/ pages", d["docs_pages"] if d["docs_pages"] is not None else "no docs/"),
    ]
    return rows


def markdown(data: dict[str, Any], before: dict[str, Any] | None = None) -> str:
    """The figures as a table; with ``before`` (an earlier run's JSON) a column for each."""
    if before is None:
        lines = ["| figure | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in _rows(data)]
    else:
        old = dict(_rows(before))
        lines = [f"| figure | before (`{before['commit']}`) | now (`{data['commit']}`) |", "|---|---|---|"]
        lines += [f"| {k} | {old.get(k, '-')} | {v} |" for k, v in _rows(data)]
    out = ""
    for label, d in ([("before", before)] if before is not None else []) + [("now", data)]:
        s, r = d["static"], d.get("route")
        if s["cycles"]:
            out += f"\nImport cycles ({label}):\n\n" + "\n".join(f"- {' <-> '.join(c)}" for c in s["cycles"]) + "\n"
        if r is not None and r["package_edges"]:
            out += (f"\nRoute package edges, call events ({label}): "
                    + ", ".join(f"{k}: {v}" for k, v in r["package_edges"].items()) + "\n")
        if r is not None and r.get("floors", {}).get("up_pairs"):
            out += f"\nRoute calls up a floor ({label}): " + ", ".join(r["floors"]["up_pairs"]) + "\n"
    return "\n".join(lines) + "\n" + out


def measure(route: bool = True, root: Path = ROOT, core: Iterable[str] = ()) -> dict[str, Any]:
    data: dict[str, Any] = {"commit": git_commit(root)}
    fig = static_imports(root)
    data["static"] = fig.summary()
    rank = {f: i for i, f in enumerate(FLOORS)}
    data["static"]["upward_import_edges"] = sorted(
        {f"{a} -> {b}" for a, ts in fig.graph().items() for b in ts if rank[floor(a, core)] < rank[floor(b, core)]})
    data["docs"] = docs_figures(root)
    data["route"] = measure_route(root) if route else None
    if data["route"] is not None:
        data["route"]["floors"] = floor_crossings(data["route"]["crossings"], core)
    return data


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--json", type=Path, help="also write the figures as JSON here")
    ap.add_argument("--no-results", action="store_true", help="do not write benchmarks/RESULTS.md")
    ap.add_argument("--no-route", action="store_true", help="static figures only (no PTQ run)")
    ap.add_argument("--core-modules", default="",
                    help="comma-separated modules that count as the core floor (a tree from before compress/core/)")
    ap.add_argument("--root", type=Path, default=ROOT, help="the tree to measure (default: this one)")
    ap.add_argument("--before", type=Path, help="an earlier run's JSON (--json) to show beside this one")
    ap.add_argument("--route-child", nargs=3, metavar=("RECIPE", "OUT_JSON", "RUN_DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.route_child:
        _route_child(*args.route_child)
        return
    core = [m for m in args.core_modules.split(",") if m]
    data = measure(route=not args.no_route, root=args.root.resolve(), core=core)
    data["core_modules"] = core
    before = json.loads(args.before.read_text()) if args.before else None
    md = markdown(data, before)
    print(f"commit {data['commit']}\n")
    print(md)
    if args.json:
        args.json.write_text(json.dumps(data, indent=1))
    if not args.no_results:
        from benchmarks._results import write_section

        section = (
            "## Code structure (`python -m benchmarks.architecture`)\n\n"
            f"Measured at commit `{data['commit']}`. "
            + ("Route: `compress.load_recipe` + `compress.apply` on the script's own recipe (ResNet width 16 on "
               "digits, untrained, one PTQ stage, fp32 + int8 ONNX export, ONNX Runtime validation, report), run "
               "in a fresh interpreter under `sys.setprofile`; " if data["route"] is not None else "Route not run; ")
            + "static figures from `ast` over every .py file of the five packages. Floors: compress/core/ < "
            "quantization, pruning, distillation < export < compress's top"
            + (f"; the before column is the same script run on `{before['commit']}`, whose core floor is the "
               f"modules its own layering test named core ({', '.join(before.get('core_modules', []))})"
               if before is not None else "")
            + ". Torch dispatching an op to a TorchFunctionMode counts as a call into the file that defines "
            "the mode's `__torch_function__`, so every traced op counts a crossing when that mode's base class "
            "lives in another package, and a base class calling its subclass's override counts a call up a floor."
            + "\n\n" + md
        )
        write_section("architecture", section, data)


if __name__ == "__main__":
    main()
