"""Kernel tests run on CUDA when present, else on CPU under the Triton interpreter: the ``device``
fixture of tests/conftest.py, which also sets TRITON_INTERPRET for the whole session (the
interpreter is chosen when Triton jit-decorates the kernels, i.e. on their first import).
Here: without triton installed, every test of this folder is skipped with the install line.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

HAS_TRITON = importlib.util.find_spec("triton") is not None
HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_TRITON:
        return
    skip = pytest.mark.skip(reason="triton is not installed (pip install 'compress-toolkit[triton]', or -e '.[triton]' in a clone)")
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(skip)
