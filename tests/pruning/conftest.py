"""Shared setup for the pruning tests: a fixed seed and the ``pruning_blocks`` helper module (one
torch thread comes from tests/conftest.py).

With ``--import-mode=importlib`` a test file cannot import a sibling module, so the helpers in
``blocks.py`` are registered here as ``pruning_blocks`` before the test files are collected.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

if "pruning_blocks" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("pruning_blocks", Path(__file__).with_name("blocks.py"))
    assert _spec is not None and _spec.loader is not None
    _mod = importlib.util.module_from_spec(_spec)
    sys.modules["pruning_blocks"] = _mod
    _spec.loader.exec_module(_mod)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
