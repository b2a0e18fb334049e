"""What this CPU can do for int8, from PyTorch's own CPU detection (``torch.cpu.get_capabilities``,
the cpuinfo library: cpuid on x86, not a parse of /proc/cpuinfo).

ONNX Runtime's u8s8 kernels sum pairs of int8 products in int16 without VNNI, which full 8-bit
weights can saturate; with VNNI (or AMX) int8 GEMMs run several times fp32. Every benchmark's
machine line and ``compress validate``'s notes name which one a run had.
"""

from __future__ import annotations

import functools
import platform
from collections.abc import Mapping
from typing import Any


@functools.cache
def cpu_capabilities() -> Mapping[str, Any]:
    """The CPU's name and instruction-set flags (empty where this torch cannot tell)."""
    import torch

    get = getattr(torch.cpu, "get_capabilities", None)
    try:
        return dict(get()) if get is not None else {}
    except RuntimeError:  # cpuinfo could not read this CPU
        return {}


def cpu_name() -> str:
    """The CPU's model name."""
    return str(cpu_capabilities().get("cpu_name") or platform.processor() or platform.machine())


def int8_isa() -> str | None:
    """The CPU's int8 dot-product instructions (None where unknown)."""
    caps = cpu_capabilities()
    if caps.get("architecture") != "x86_64":
        return None
    if caps.get("amx_int8"):
        return "AMX-INT8"
    if caps.get("avx512_vnni"):
        return "AVX-512 VNNI"
    if caps.get("avx_vnni"):
        return "AVX-VNNI"
    return "AVX2 without VNNI" if caps.get("avx2") else "no AVX2"


def has_vnni() -> bool | None:
    """Whether this x86 CPU has int8 dot products without int16 saturation; None if unknown."""
    isa = int8_isa()
    return None if isa is None else isa in ("AMX-INT8", "AVX-512 VNNI", "AVX-VNNI")


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity; all cores where that is unknown)."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def set_threads(threads: int | None, *, local_ranks: int = 1) -> int:
    """Set torch's intra-op threads for this process and return them: ``threads`` when given; else,
    with several ranks on this node, the cores this process may use shared among them (so ranks do
    not oversubscribe the CPU); else torch's default."""
    import os

    import torch

    if threads is None and local_ranks > 1 and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, usable_cores() // local_ranks)
    if threads is not None:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def peak_rss_mb() -> float | None:
    """This process's peak resident memory so far in MB (2**20 bytes), from
    ``getrusage(RUSAGE_SELF).ru_maxrss``; None where the platform has no ``resource`` module."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux and the BSDs report KiB, macOS bytes
    return round(peak / (2**20 if platform.system() == "Darwin" else 2**10), 1)
