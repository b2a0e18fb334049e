"""Kernel tests run on CUDA when present, else on CPU under the Triton interpreter.

The interpreter is chosen when Triton jit-decorates the kernels, i.e. on the kernels' first import,
so tests/conftest.py sets TRITON_INTERPRET for the whole session (never on a CUDA machine).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_TRITON:
        return
    skip = pytest.mark.skip(reason="triton is not installed (pip install 'compress-toolkit[triton]', or -e '.[triton]' in a clone)")
    for item in items:
        if "quantization/kernels" in str(item.fspath):
            item.add_marker(skip)


@pytest.fixture(
    params=[
        pytest.param("cpu", id="interpret"),
        pytest.param(
            "cuda",
            id="cuda",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
        ),
    ]
)
def device(request: pytest.FixtureRequest) -> str:
    """Where the kernels run: CPU tensors under the interpreter, or a CUDA device."""
    if request.param == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("CPU kernel runs need TRITON_INTERPRET=1 (this machine has CUDA: the cuda cases run instead)")
    return str(request.param)
