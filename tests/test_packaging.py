"""The wheel installs one namespace: the owner's top folders become compress.quantization,
compress.export, ...; nothing generic (``export``, ``recipes``) lands at the top of a user's
environment, where a user's own ``export.py`` would shadow it."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_holds_compress_alone_at_its_top(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    names = zipfile.ZipFile(next(tmp_path.glob("*.whl"))).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"compress"}, tops
    for pkg in ("quantization/placement/trace.py", "pruning/api.py", "distillation/api.py", "export/onnx.py"):
        assert f"compress/{pkg}" in names, pkg
    # package data travels under the new names
    assert "compress/recipes/quickstart.yaml" in names
    assert "compress/quantization/placement/data/ort_cpu_costs.json" in names


def test_the_folders_import_only_under_compress() -> None:
    code = ("import importlib.util, sys\n"
            "import compress.quantization.api, compress.export.onnx, compress.pruning.api, compress.distillation.api\n"
            "bare = [m for m in sys.modules if m.split('.')[0] in ('quantization', 'pruning', 'distillation', 'export', 'recipes')]\n"
            "assert not bare, bare\n"
            "assert importlib.util.find_spec('quantization') is None and importlib.util.find_spec('export') is None\n")
    # run from outside the checkout: inside it the folders sit on sys.path as they are
    proc = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
