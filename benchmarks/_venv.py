"""Virtualenvs for the peers and clients a benchmark compares against, when they cannot share the
project's environment (llm-compressor and Optimum pin other transformers releases)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch


def make_venv(venv: Path, *, probe: str, packages: list[str], log: Path) -> str | None:
    """Make a virtualenv at ``venv`` holding ``packages`` (torch pinned first to the project's release,
    so pip cannot pull another build) unless its Python already imports ``probe``. Returns None when it
    works, else the failing step and pip's last lines (``log`` keeps the whole output)."""
    py = venv / "bin" / "python"
    if py.exists() and subprocess.run([str(py), "-c", f"import {probe}"], capture_output=True).returncode == 0:
        return None
    torch_pin = torch.__version__.split("+")[0]
    steps = [[sys.executable, "-m", "venv", str(venv)],
             [str(py), "-m", "pip", "install", f"torch=={torch_pin}"],
             [str(py), "-m", "pip", "install", *packages]]
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        for cmd in steps:
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            f.write(r.stdout)
            if r.returncode:
                tail = "\n".join(r.stdout.strip().splitlines()[-12:])
                return f"`{' '.join(cmd[-3:])}` failed (exit {r.returncode}):\n\n```\n{tail}\n```"
    return None
