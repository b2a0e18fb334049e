"""The CLI in the environments a new user has: a folder named ``compress`` shadowing the package."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]

# what an editable install does (setuptools' __editable__ finder, last on sys.meta_path): top-level
# packages map to the source tree, submodules are found under the mapped folder
_EDITABLE = """
import importlib.abc, importlib.machinery, sys
ROOT = {root!r}
PKGS = ("compress", "quantization", "pruning", "distillation", "export", "recipes")
class Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in PKGS:
            return importlib.machinery.PathFinder.find_spec(name, [ROOT])
        parent = name.rpartition(".")[0]
        if parent.split(".")[0] in PKGS:
            return importlib.machinery.PathFinder.find_spec(name, [ROOT + "/" + parent.replace(".", "/")])
        return None
sys.path = [p for p in sys.path if p not in ("", {root!r})]
sys.path.insert(0, {cwd!r})
# right after PathFinder: before the venv's own editable finder, which maps to another checkout
sys.meta_path.insert(sys.meta_path.index(importlib.machinery.PathFinder) + 1, Finder())
from compress.cli import main
sys.exit(main({argv!r}))
"""


def test_a_compress_folder_on_the_path_fails_at_once_with_a_clear_line(tmp_path: Path) -> None:
    (tmp_path / "compress").mkdir()  # e.g. the clone itself, its parent on PYTHONPATH
    recipe = {
        "version": 1, "name": "shadow",
        "model": {"name": "mlp", "kwargs": {"hidden": 16, "depth": 1, "num_classes": 10, "in_features": 64}},
        "data": {"source": "digits", "calibration_samples": 32},
        "train": {"epochs": 1, "batch_size": 64, "seed": 0},
        "stages": [{"name": "ptq", "modifiers": [{"type": "ptq", "scheme": "w8a8"}]}],
        "validate": {"enabled": False},
    }
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    argv = ["apply", str(tmp_path / "r.yaml"), "--out", str(tmp_path / "run"), "--quiet"]
    script = _EDITABLE.format(root=str(ROOT), cwd=str(tmp_path), argv=argv)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(tmp_path / "compress") in lines[0] and "shadows" in lines[0], proc.stderr
    assert not (tmp_path / "run").exists()  # nothing trained, nothing written


def test_debug_is_accepted_after_the_command(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    from compress.cli import main

    assert main(["recipes", "--debug"]) == 0
    assert "quickstart" in capsys.readouterr().out


def test_an_internal_error_leaves_a_failed_report_and_the_traceback_in_run_log(
    tmp_path: Path, monkeypatch, capsys  # type: ignore[no-untyped-def]
) -> None:
    import json

    import compress.runner
    from compress.cli import main

    def boom(*a: object, **k: object) -> None:
        raise RuntimeError("export exploded")

    monkeypatch.setattr(compress.runner, "_export_and_validate", boom)
    recipe = {"version": 1, "name": "boom",
              "model": {"name": "mlp", "kwargs": {"hidden": 16, "depth": 1, "num_classes": 10, "in_features": 64}},
              "train": {"epochs": 0}}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["apply", str(tmp_path / "r.yaml"), "--out", str(tmp_path / "run"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "export exploded" in err and "compress --debug apply" in err
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["error"] == "RuntimeError: export exploded" and report["baseline"]["accuracy"] is not None
    assert "FAILED" in (tmp_path / "run" / "report.md").read_text()
    log = (tmp_path / "run" / "run.log").read_text()
    assert "Traceback" in log and "export exploded" in log
