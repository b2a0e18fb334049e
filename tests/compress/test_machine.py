"""The CPU's int8 instructions, read through PyTorch's cpuinfo, named as benchmarks and validate notes name them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from compress.core import machine


@pytest.mark.parametrize(("caps", "isa", "vnni"), [
    ({"architecture": "x86_64", "avx2": True, "avx512_vnni": True, "amx_int8": True}, "AMX-INT8", True),
    ({"architecture": "x86_64", "avx2": True, "avx512_vnni": True}, "AVX-512 VNNI", True),
    ({"architecture": "x86_64", "avx2": True, "avx_vnni": True}, "AVX-VNNI", True),
    ({"architecture": "x86_64", "avx2": True}, "AVX2 without VNNI", False),
    ({"architecture": "x86_64"}, "no AVX2", False),
    ({"architecture": "aarch64"}, None, None),
    ({}, None, None),
])
def test_int8_isa_from_capabilities(monkeypatch: pytest.MonkeyPatch, caps: dict[str, Any], isa: str | None,
                                    vnni: bool | None) -> None:
    monkeypatch.setattr(machine, "cpu_capabilities", lambda: caps)
    assert machine.int8_isa() == isa and machine.has_vnni() is vnni


def test_this_cpu_agrees_with_the_kernels_flags() -> None:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists() or machine.int8_isa() is None:
        pytest.skip("not an x86 Linux machine")
    flags = set(next(ln for ln in cpuinfo.read_text().splitlines() if ln.startswith("flags")).split(":", 1)[1].split())
    assert machine.has_vnni() == bool(flags & {"avx512_vnni", "avx_vnni", "amx_int8"})
