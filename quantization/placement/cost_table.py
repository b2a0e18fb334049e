"""Keep-float decisions from a shipped cost table: which layers run slower in int8 than in float on
the target runtime and CPU, without timing anything on the user's machine.

``speed_check`` (quantization/placement/speed_check.py) times each layer on the machine that
quantizes, so two runs (or two machines) may decide differently. The table here holds the same
measurement made once per runtime and int8 instruction set by ``python -m benchmarks.cost_table``:
each row one layer shape (a Linear's rows x in x out, a conv's channels, kernel, groups and output
size), its float and int8 kernel times inside an int8 model (:func:`speed_check._island_cost`) and
their ratio. A layer's speedup is read off the row nearest to it (log-distance over the shape
features, within its kind); a layer below ``min_speedup`` stays float, the row named in the reason.
The answer depends only on the layer's traced shape, the table and the CPU the table is chosen for
(its int8 instruction set, then its vendor: two CPUs with the same instructions can differ twofold in
what entering and leaving int8 costs), so quantizing twice gives the same placement. ``speed_check``
refines it when asked.

That CPU is the deployment target's, declared (:data:`DeployCpu`, the ``deploy_cpu`` setting), not
the one that quantizes: :data:`PORTABLE_CPU` by default, so one recipe and one dataset give the same
file on every machine; ``this-machine`` reads the quantizing CPU's table instead.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from compress.quantization.placement.speed_check import LayerCall
from torch import nn

from compress.core import machine
from compress.core.errors import CompressError

log = logging.getLogger(__name__)

TABLE_FILE = Path(__file__).with_name("data") / "ort_cpu_costs.json"


def isa_key(isa: str | None) -> str | None:
    """The table's key for an int8 instruction set (compress.core.machine.int8_isa)."""
    if isa is None:
        return None
    if isa in ("AMX-INT8", "AVX-512 VNNI", "AVX-VNNI"):
        return "vnni" if isa != "AMX-INT8" else "amx"
    return "avx2" if isa == "AVX2 without VNNI" else None


def cpu_vendor(cpu: str | None) -> str | None:
    """``intel`` or ``amd`` from a CPU's model name (compress.core.machine.cpu_name), None otherwise."""
    low = (cpu or "").lower()
    return next((v for v in ("intel", "amd") if v in low), None)


def table_key(isa: str | None, cpu: str | None) -> str | None:
    """The key a table measured on this CPU is stored under: ``vnni:intel``, ``avx2:amd``, or the ISA
    key alone where the vendor is unknown."""
    key, vendor = isa_key(isa), cpu_vendor(cpu)
    return None if key is None else f"{key}:{vendor}" if vendor else key


@dataclass(frozen=True)
class LayerShape:
    """What the table is keyed by: ``kind`` (linear, conv, depthwise) and the sizes that set a
    kernel's cost."""

    kind: str
    features: tuple[float, ...]

    def distance(self, other: LayerShape) -> float:
        return sum(abs(math.log2(max(a, 1.0)) - math.log2(max(b, 1.0)))
                   for a, b in zip(self.features, other.features, strict=True))


def layer_shape(m: nn.Module, in_shape: tuple[int, ...] | list[int]) -> LayerShape | None:
    """The table key of a Linear or Conv2d at its traced input shape (None for other layers)."""
    if isinstance(m, nn.Linear):
        rows = math.prod(in_shape[:-1]) if len(in_shape) > 1 else 1
        return LayerShape("linear", (float(rows), float(m.in_features), float(m.out_features)))
    if isinstance(m, nn.Conv2d) and len(in_shape) == 4:
        k = float(m.kernel_size[0] * m.kernel_size[1])
        pixels = float(in_shape[0] * in_shape[2] * in_shape[3]) / float(m.stride[0] * m.stride[1])
        if m.groups == m.in_channels and m.groups > 1:
            return LayerShape("depthwise", (float(m.in_channels), k, pixels))
        if m.groups == 1:
            return LayerShape("conv", (float(m.in_channels), float(m.out_channels), k, pixels))
    return None


@dataclass(frozen=True)
class Row:
    """A measured shape: ``float_us`` the float layer between int8 neighbours (its DQ, reorders and Q
    included), ``int8_us`` its integer kernel there, ``float_kernel_us`` the float kernel alone, what
    it costs in the fp32 model (None in rows measured before it was: ``float_us`` stands in)."""

    shape: LayerShape
    float_us: float
    int8_us: float
    float_kernel_us: float | None = None

    @property
    def speedup(self) -> float:
        return self.float_us / max(self.int8_us, 1e-9)

    @property
    def float_kernel(self) -> float:
        return self.float_us if self.float_kernel_us is None else self.float_kernel_us


@dataclass(frozen=True)
class CostTable:
    """One runtime's and ISA's measured rows (see the module docstring).

    ``boundary``: the model-level costs no layer row holds (quantization/placement/model_cost.py),
    keyed by element count: ``enter:conv`` / ``enter:linear`` (a float tensor quantized for an int8
    layer, with the NCHW -> NHWC transpose QLinearConv's layout adds), ``leave:conv`` /
    ``leave:linear`` (back to float) as int8-only costs (``float_us`` 0), and ``add`` (ORT's float Add
    against its QLinearAdd). Empty in tables measured before they were: the model-level check is then
    skipped.
    """

    runtime: str
    isa: str
    machine: str
    rows: tuple[Row, ...]
    boundary: tuple[Row, ...] = ()
    #: what ORT's profiler adds to each node's measured time (its per-node median on a chain of trivial
    #: nodes less their unprofiled time per node): the model-level sum takes it off every node it adds
    profile_overhead_us: float = 0.0
    #: its key in the shipped file (``vnni:intel``); empty for a table built elsewhere
    key: str = ""

    @property
    def source(self) -> str:
        """Runtime, ISA and CPU model (``onnxruntime, AVX-512 VNNI, Intel Xeon``)."""
        cpu = self.machine.split(" (", 1)[0].split(",", 1)[0].strip()
        return f"{self.runtime}, {self.isa}" + (f", {cpu}" if cpu else "")

    @property
    def name(self) -> str:
        """``onnxruntime vnni:intel``: the runtime and key, what the report records as the deciding table."""
        return f"{self.runtime} {self.key}" if self.key else self.source

    @property
    def named(self) -> str:
        """The table as reasons name it: ``the onnxruntime vnni:intel cost table (AVX-512 VNNI, Intel
        Xeon)`` (``the cost table (onnxruntime, ISA, machine)`` for a table without a key)."""
        if not self.key:
            return f"the cost table ({self.source})"
        return f"the {self.runtime} {self.key} cost table ({self.source.removeprefix(f'{self.runtime}, ')})"

    def nearest(self, shape: LayerShape) -> Row | None:
        same = [r for r in self.rows if r.shape.kind == shape.kind]
        return min(same, key=lambda r: (r.shape.distance(shape), r.shape.features)) if same else None

    @functools.cached_property
    def prices_attention(self) -> bool:
        """Whether the table has ``matmul`` rows (products of two activations), so the model-level
        check can price attention (tables measured before they were cannot)."""
        return any(r.shape.kind == "matmul" for r in self.rows)

    def matmul_us(self, bh: float, m: float, k: float, n: float) -> tuple[float, float] | None:
        """``(float_us, int8_us)`` of ``bh`` products of ``m x k`` by ``k x n`` activations: the nearest
        ``matmul`` row scaled by the multiply-adds; None without such rows."""
        shape = LayerShape("matmul", (bh, m, k, n))
        row = self.nearest(shape)
        if row is None:
            return None
        work = math.prod(shape.features) / max(math.prod(row.shape.features), 1.0)
        return row.float_kernel * work, row.int8_us * work

    def boundary_us(self, kind: str, elements: float) -> tuple[float, float] | None:
        """``(float_us, int8_us)`` of a boundary kind at ``elements``: linear in the element count
        between the measured sizes around it and past the largest (the last two sizes' slope: large
        tensors cost per element), the smallest size's cost below them; None without rows of that kind."""
        rs = sorted((r for r in self.boundary if r.shape.kind == kind), key=lambda r: r.shape.features[0])
        if not rs:
            return None
        sizes = [r.shape.features[0] for r in rs]
        if elements <= sizes[0] or len(rs) == 1:
            return rs[0].float_us, rs[0].int8_us
        i = next((i for i, s in enumerate(sizes) if s >= elements), len(sizes) - 1)
        a, b = rs[i - 1], rs[i]
        t = (elements - sizes[i - 1]) / max(sizes[i] - sizes[i - 1], 1e-9)
        return (max(a.float_us + t * (b.float_us - a.float_us), 0.0),
                max(a.int8_us + t * (b.int8_us - a.int8_us), 0.0))


def _boundary_row(r: Mapping[str, Any]) -> Row:
    shape = LayerShape(str(r["kind"]), tuple(float(f) for f in r["features"]))
    if "us" in r:  # enter/leave: paid by the int8 model only
        return Row(shape, 0.0, float(r["us"]))
    return Row(shape, float(r["float_us"]), float(r["int8_us"]))


def table_from_data(data: Mapping[str, Any], key: str = "") -> CostTable:
    rows = tuple(Row(LayerShape(r["kind"], tuple(float(f) for f in r["features"])), float(r["float_us"]),
                     float(r["int8_us"]), float(r["float_kernel_us"]) if "float_kernel_us" in r else None)
                 for r in data["rows"])
    boundary = tuple(_boundary_row(r) for r in data.get("boundary", ()))
    return CostTable(str(data["runtime"]), str(data["isa"]), str(data.get("machine", "")), rows, boundary,
                     float(data.get("profile_overhead_us", 0.0)), key)


@functools.cache
def shipped_tables(path: Path = TABLE_FILE) -> dict[str, CostTable]:
    """The shipped tables by ISA key (empty where the file is absent)."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CompressError(f"cost table {path}: unreadable ({exc})") from None
    return {k: table_from_data(v, k) for k, v in data.get("onnxruntime", {}).items()}


#: set to ``off`` to use no shipped table (every layer int8 unless ``speed_check`` says otherwise)
ENV_SWITCH = "COMPRESS_COST_TABLE"

#: the CPU the model is deployed on, as ``isa:vendor`` (the keys :func:`table_for` looks up; an ISA
#: without a table of its own reads its :data:`FALLBACK`'s, with a warning), or ``this-machine``: the
#: CPU that quantizes (its int8 instructions and vendor, compress.core.machine), so that two machines
#: may place one model differently
DeployCpu = Literal["vnni:intel", "vnni:amd", "amx:intel", "avx2:intel", "avx2:amd", "this-machine"]
#: the default deployment CPU: the Intel Xeon AVX-512 VNNI table is the shipped one measured on a quiet
#: machine (load 0.1 against 2.7), with the most rows (317 layer shapes against 208, 130 boundary rows
#: against 79) and the only one with ``matmul`` and ``mul`` rows, so it alone prices attention and
#: products of two activations; it also finds int8 slower at more of its shapes (14 against 8), so it
#: keeps float more of what may lose in int8 (benchmarks/RESULTS.md, ``cost_table``; docs/own-model.md)
PORTABLE_CPU: DeployCpu = "vnni:intel"
THIS_MACHINE = "this-machine"
_ISA_NAMES = {"vnni": "AVX-512 VNNI", "amx": "AMX-INT8", "avx2": "AVX2 without VNNI"}
_VENDOR_NAMES = {"intel": "Intel", "amd": "AMD"}


def deployment_cpu(cpu: str = PORTABLE_CPU) -> tuple[str | None, str | None]:
    """``(int8 ISA, CPU name)`` that :func:`table_for` is asked for a deployment CPU (:data:`DeployCpu`):
    the declared one's, or with ``this-machine`` the quantizing CPU's."""
    if cpu == THIS_MACHINE:
        return machine.int8_isa(), machine.cpu_name()
    isa, _, vendor = cpu.partition(":")
    if isa not in _ISA_NAMES or vendor not in _VENDOR_NAMES:
        raise CompressError(f"deploy_cpu: unknown CPU '{cpu}'; valid: isa:vendor ({', '.join(sorted(_ISA_NAMES))}; "
                            f"{', '.join(_VENDOR_NAMES)}) or {THIS_MACHINE}")
    return _ISA_NAMES[isa], _VENDOR_NAMES[vendor]


def deployment_table(cpu: str = PORTABLE_CPU) -> CostTable | None:
    """The shipped table that decides for deployment CPU ``cpu`` (None if none)."""
    return table_for(*deployment_cpu(cpu))


def table_for(isa: str | None, cpu: str | None = None) -> CostTable | None:
    """The shipped ORT CPU table for ``isa`` (compress.core.machine.int8_isa's names) on ``cpu`` (its
    model name, for the vendor), None if none (or if the ``COMPRESS_COST_TABLE`` environment variable
    is ``off``). Looked up in this order: the ISA's table measured on this vendor's CPU, the ISA's
    table of unknown vendor, the ISA's table of another vendor, then the same for the nearest other
    ISAs (:data:`FALLBACK`)."""
    if os.environ.get(ENV_SWITCH, "").strip().lower() in ("off", "0", "false", "none"):
        return None
    key = isa_key(isa)
    if key is None:
        return None
    tables = shipped_tables()
    vendor = cpu_vendor(cpu)
    for i, k in enumerate((key, *FALLBACK.get(key, ()))):
        mine = [f"{k}:{vendor}"] if vendor else []
        others = sorted(t for t in tables if t.startswith(f"{k}:") and t not in mine)
        for cand in (*mine, k, *others):
            if cand in tables:
                if i or cand in others:
                    _warn_fallback(f"{isa or key} on {cpu or 'this CPU'}", tables[cand].machine or cand)
                return tables[cand]
    return None


#: the table an ISA without rows of its own reads instead, nearest first
FALLBACK: dict[str, tuple[str, ...]] = {"avx2": ("vnni",), "amx": ("vnni",)}


@functools.cache
def _warn_fallback(isa: str, used: str) -> None:
    log.warning("cost table: no rows measured on %s; using the %s rows (`python -m benchmarks.cost_table` on "
                "such a CPU measures its own; speed_check times the layers where it runs)", isa, used)


def slower_by_table(layers: Mapping[str, nn.Module], calls: Mapping[str, LayerCall], table: CostTable, *,
                    min_speedup: float = 1.0) -> dict[str, str]:
    """``{layer: reason}`` for the layers whose nearest table row says int8 is not ``min_speedup``
    times faster than float; a layer a max-pool follows stays int8 (see speed_check.slower_in_int8)."""
    slow: dict[str, str] = {}
    for name, mod in layers.items():
        call = calls.get(name)
        shape = layer_shape(mod, call.shape) if call is not None else None
        row = table.nearest(shape) if shape is not None else None
        if call is None or row is None or call.pooled or call.model_output or row.speedup >= min_speedup:
            continue
        feats = "x".join(f"{f:g}" for f in row.shape.features)
        slow[name] = (f"kept float by {table.named}: the nearest measured "
                      f"{row.shape.kind} ({feats}) ran int8 {row.int8_us:.0f} us vs float {row.float_us:.0f} us "
                      f"({row.speedup:.2f}x)")
    log.info("%s: %d of %d layers keep float", table.named, len(slow), len(layers))
    return slow
