"""Without a GPU and without the interpreter the kernels refuse to run, clearly; no Triton at import."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env={**clean, **env}, timeout=120
    )


def test_cpu_tensors_without_interpreter_raise_clear_error() -> None:
    r = _run(
        """
        import torch
        if torch.cuda.is_available():
            print("CUDA"); raise SystemExit(0)
        from compress.errors import CompressError
        from quantization.kernels import int8_gemm
        a = torch.ones(4, 8, dtype=torch.int8)
        try:
            int8_gemm(a, a, a_scale=torch.ones(1), b_scale=torch.ones(4))
        except CompressError as e:
            print("ERR", e)
        """
    )
    assert r.returncode == 0, r.stderr
    if "CUDA" not in r.stdout:
        assert "ERR int8_gemm run on CUDA devices (got a cpu tensor)" in r.stdout


def test_importing_quantization_does_not_import_triton() -> None:
    r = _run("import sys, quantization, quantization.kernels; print('triton' in sys.modules)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
