"""Default keep-float decisions from the shipped ORT CPU cost table (issue 32): nothing is timed at
quantize time, the same model gets the same placement, ``cost_table=False`` and ``speed_check`` override."""

from __future__ import annotations

from typing import Any

import compress.quantization.preparation as preparation
import pytest
import torch
from compress.quantization import QuantizeParams, quantize
from compress.quantization.placement import cost_table as ct
from compress.quantization.placement import speed_check
from compress.quantization.placement.mode import graph_of
from compress.quantization.placement.speed_check import SpeedCheck
from torch import nn

from compress.core.errors import CompressError


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.body = nn.Conv2d(16, 64, 3, padding=1)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.body(torch.relu(self.stem(x))))
        return self.head(y.mean((2, 3)))


def _data(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 3, 16, 16, generator=g) for _ in range(2)]


def _row(kind: str, feats: tuple[float, ...], float_us: float, int8_us: float) -> ct.Row:
    return ct.Row(ct.LayerShape(kind, feats), float_us, int8_us)


#: the stem's shape (3 -> 16, 3x3, 4 x 16 x 16 pixels) slower in int8, the rest faster
TABLE = ct.CostTable("onnxruntime", "test ISA", "test", (
    _row("conv", (3, 16, 9, 1024), 50.0, 90.0),
    _row("conv", (16, 64, 9, 1024), 400.0, 150.0),
    _row("linear", (4, 64, 10), 5.0, 4.0),
))


def _floats(q: nn.Module) -> dict[str, str]:
    g = graph_of(q)
    assert g is not None
    return g.placement.floats


def _no_timing(*a: Any, **k: Any) -> Any:
    raise AssertionError("a kernel was timed at quantize time")


def test_table_keeps_slow_layers_float_without_timing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(preparation, "table_for", lambda isa, cpu=None: TABLE)
    monkeypatch.setattr(speed_check, "_profile", _no_timing)
    torch.manual_seed(0)
    floats = [_floats(quantize(Net().eval(), "w8a8", _data())) for _ in range(2)]
    assert floats[0] == floats[1]  # reproducible: a table lookup, not a measurement
    assert list(floats[0]) == ["stem:conv#0"], floats[0]
    assert "cost table (onnxruntime, test ISA, test)" in floats[0]["stem:conv#0"] and "0.56x" in floats[0]["stem:conv#0"]
    torch.manual_seed(0)
    off = _floats(quantize(Net().eval(), "w8a8", _data(), params=QuantizeParams(cost_table=False)))
    assert "stem:conv#0" not in off, off


def test_speed_check_refines_instead_of_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """With speed_check, layers are decided by their timings: the table's row that keeps the stem float
    (test_table_keeps_slow_layers_float_without_timing) is not read for them (the table decides only
    attention's products there: test_model_cost.py)."""
    monkeypatch.setattr(preparation, "table_for", lambda isa, cpu=None: TABLE)
    timed: list[str] = []

    def fake_time(layers: Any, calls: Any, check: Any, *, example_batch: Any) -> list[speed_check.LayerTiming]:
        timed.extend(layers)
        return [speed_check.LayerTiming(n, list(calls[n].shape), "Conv", 10.0, "QLinearConv", 5.0) for n in layers]

    monkeypatch.setattr(preparation, "time_layers", fake_time)
    q = quantize(Net().eval(), "w8a8", _data(), params=QuantizeParams(speed_check=SpeedCheck()))
    assert timed and not _floats(q)


def test_nearest_row_and_layer_keys() -> None:
    conv = ct.layer_shape(nn.Conv2d(3, 16, 3, padding=1), [4, 3, 16, 16])
    assert conv == ct.LayerShape("conv", (3.0, 16.0, 9.0, 1024.0))
    dw = ct.layer_shape(nn.Conv2d(8, 8, 5, groups=8), [2, 8, 10, 10])
    assert dw is not None and dw.kind == "depthwise"
    lin = ct.layer_shape(nn.Linear(64, 10), [2, 3, 64])
    assert lin == ct.LayerShape("linear", (6.0, 64.0, 10.0))
    assert ct.layer_shape(nn.Conv2d(8, 16, 3, groups=2), [1, 8, 4, 4]) is None  # grouped: not in the table
    row = TABLE.nearest(ct.LayerShape("conv", (4.0, 16.0, 9.0, 900.0)))
    assert row is not None and row.shape.features[0] == 3.0
    assert TABLE.nearest(ct.LayerShape("depthwise", (8.0, 9.0, 100.0))) is None


def test_shipped_table_loads_for_known_isas(tmp_path: Any) -> None:
    tables = ct.shipped_tables()
    assert tables, "quantization/placement/data/ort_cpu_costs.json holds no table"
    for key, t in tables.items():
        isa, _, vendor = key.partition(":")
        assert isa in ("avx2", "vnni", "amx") and vendor in ("", "intel", "amd") and t.runtime == "onnxruntime"
        assert vendor == (ct.cpu_vendor(t.machine) or "")  # stored under the CPU it was measured on
        # matmul: attention's products of two activations, in tables measured since they were
        assert {"linear", "conv", "depthwise"} <= {r.shape.kind for r in t.rows} <= {"linear", "conv", "depthwise", "matmul"}
        assert all(r.float_us > 0 and r.int8_us > 0 for r in t.rows)
    assert ct.isa_key("AVX2 without VNNI") == "avx2" and ct.isa_key("AVX-512 VNNI") == "vnni"
    assert ct.isa_key(None) is None and ct.table_for("no AVX2") is None
    with pytest.MonkeyPatch.context() as mp:  # the suite runs with the switch off (tests/conftest.py)
        mp.setenv(ct.ENV_SWITCH, "on")
        assert ct.table_for(next(t.isa for t in tables.values())) is not None
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(CompressError, match=r"bad\.json"):
        ct.shipped_tables(bad)


def test_an_isa_without_rows_reads_the_nearest_x86_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """AVX2 without VNNI (no rows can be measured on this project's machines) reads the VNNI rows,
    named in every reason; a non-x86 or unknown ISA reads none."""
    vnni = ct.CostTable("onnxruntime", "AVX-512 VNNI", "test", TABLE.rows)
    monkeypatch.setenv(ct.ENV_SWITCH, "on")
    monkeypatch.setattr(ct, "shipped_tables", lambda: {"vnni": vnni})
    assert ct.table_for("AVX2 without VNNI") is vnni and ct.table_for("AMX-INT8") is vnni
    assert ct.table_for(None) is None and ct.table_for("no AVX2") is None
    avx2 = ct.CostTable("onnxruntime", "AVX2 without VNNI", "test", TABLE.rows)
    monkeypatch.setattr(ct, "shipped_tables", lambda: {"vnni": vnni, "avx2": avx2})
    assert ct.table_for("AVX2 without VNNI") is avx2  # its own rows, once measured, win


def test_tables_are_chosen_by_cpu_vendor_within_an_isa(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two CPUs with the same int8 instructions can differ twofold in per-node costs (AMD EPYC and
    Intel Xeon, both AVX-512 VNNI: benchmarks/RESULTS.md, ``cost_table``): each reads the table
    measured on its vendor's CPU, then a table of unknown vendor, then another vendor's (warned)."""
    amd = ct.CostTable("onnxruntime", "AVX-512 VNNI", "AMD EPYC (AVX-512 VNNI), 2 cores", TABLE.rows)
    intel = ct.CostTable("onnxruntime", "AVX-512 VNNI", "Intel Xeon (AVX-512 VNNI), 2 cores", TABLE.rows)
    monkeypatch.setenv(ct.ENV_SWITCH, "on")
    assert ct.cpu_vendor("Intel(R) Xeon(R) Platinum 8480+") == "intel" and ct.cpu_vendor("AMD EPYC 9654") == "amd"
    assert ct.cpu_vendor("Apple M2") is None and ct.cpu_vendor(None) is None
    assert ct.table_key("AVX-512 VNNI", "AMD EPYC 9654") == "vnni:amd" and ct.table_key("AVX-512 VNNI", "?") == "vnni"
    assert ct.table_key("no AVX2", "Intel Xeon") is None
    monkeypatch.setattr(ct, "shipped_tables", lambda: {"vnni:amd": amd, "vnni:intel": intel})
    assert ct.table_for("AVX-512 VNNI", "Intel Xeon") is intel and ct.table_for("AVX-512 VNNI", "AMD EPYC") is amd
    assert ct.table_for("AVX-512 VNNI", "Some Other CPU") is amd  # another vendor's: the first by key
    assert ct.table_for("AVX2 without VNNI", "Intel Core i7") is intel  # the ISA's fallback, this vendor first
    plain = ct.CostTable("onnxruntime", "AVX-512 VNNI", "", TABLE.rows)
    monkeypatch.setattr(ct, "shipped_tables", lambda: {"vnni:amd": amd, "vnni": plain})
    assert ct.table_for("AVX-512 VNNI", "Intel Xeon") is plain  # unknown vendor before another vendor's
    assert amd.source == "onnxruntime, AVX-512 VNNI, AMD EPYC" and plain.source == "onnxruntime, AVX-512 VNNI"


def test_the_benchmark_times_attention_products_as_integer_kernels(tmp_path: Any) -> None:
    """The cost-table benchmark's ``matmul`` row: ORT fuses the QDQ product of two activations into
    QLinearMatMul (what the int8 model runs) and keeps the float one a MatMul."""
    from benchmarks.cost_table import matmul_grid, measure_matmul

    row = measure_matmul((2, 8, 4, 8), 3, tmp_path)
    assert (row["kind"], row["features"]) == ("matmul", [2.0, 8.0, 4.0, 8.0])
    assert (row["float_op"], row["int8_op"]) == ("MatMul", "QLinearMatMul")
    assert row["float_us"] > 0 and row["int8_us"] > 0
    assert (8, 16, 16, 16) in matmul_grid(quick=True) and (8, 16, 16, 16) in matmul_grid()  # scores q @ k^T
