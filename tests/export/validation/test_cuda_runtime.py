"""export/validation/cuda.py: validate_cuda on a small model (CPU under the Triton interpreter, or CUDA)."""

from __future__ import annotations

import copy
import importlib.util
import os
from pathlib import Path

import pytest
import torch
from torch import nn

if not torch.cuda.is_available():  # before the kernels are first imported (jit decides then)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from compress.export.validation.cuda import cast_float_layers, validate_cuda
from compress.quantization.lowering.int8 import Int8Linear
from compress.quantization.numerics.modules import QuantLinear

import compress
from compress.core.errors import ExportError

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs the triton extra")


def _setup() -> tuple[nn.Module, nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    fp = nn.Sequential(nn.Linear(20, 48), nn.GELU(), nn.Linear(48, 32), nn.ReLU(), nn.Linear(32, 6)).eval()
    x = torch.randn(24, 20)
    y = fp(x).argmax(1)  # labels the fp32 model gets right: accuracy is meaningful
    data = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 24, 8)]
    q = compress.quantize(copy.deepcopy(fp), "w8a8", [d[0] for d in data]).eval()
    return fp, q, data


def _check(r: dict, *, batches: list[int]) -> None:
    assert r["accuracy"]["fp32"] == 1.0
    assert r["accuracy"]["int8"] >= 0.8 and r["accuracy_drop"] <= 0.2
    assert r["parity"]["sqnr_db"] > 60 and r["parity"]["top1_agreement"] == 1.0
    assert 10 < r["fidelity"]["int8"]["sqnr_db"] < r["parity"]["sqnr_db"]
    assert [row["batch"] for row in r["latency"]] == batches
    assert all(row["float_ms"] > 0 and row["int8_ms"] > 0 for row in r["latency"])
    assert r["conversion"]["int8_layers"] == 3
    assert r["conversion"]["fused_activations"] == {"0": "gelu", "2": "relu"}
    assert r["size"]["ratio"] < 0.5


def test_validate_cuda_on_cpu_interpreter() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the GPU test covers this")
    fp, q, data = _setup()
    r = validate_cuda(q, eval_loader=data, reference=fp, batch_sizes=[1, 5], warmup=0, runs=1,
                      dtype=torch.float32, device="cpu")
    _check(r, batches=[1, 5])
    assert isinstance(q[0], QuantLinear) and q[0].weight.dtype == torch.float32  # inputs untouched


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_validate_cuda_on_gpu_fp16() -> None:
    fp, q, data = _setup()
    # the kernels themselves: no layer kept float by timing (at these toy widths fp16 wins)
    r = validate_cuda(q, eval_loader=data, reference=fp, batch_sizes=[1, 8], warmup=2, runs=5, speed_check=False)
    _check(r, batches=[1, 8])
    assert r["float_dtype"] == "fp16" and all(row["cuda_graphs"] for row in r["latency"])
    # the default deployment times each layer: every layer it keeps float says why, with both times
    r = validate_cuda(q, eval_loader=data, reference=fp, batch_sizes=[8], warmup=2, runs=5)
    kept = r["conversion"]["float_layers"]
    assert r["conversion"]["int8_layers"] + len(kept) == 3
    assert all(k["reason"].startswith("speed check: its kernel took") for k in kept)


def test_cast_float_layers_keeps_int8_scales_fp32() -> None:
    _, q, _ = _setup()
    from compress.quantization.lowering.convert import convert

    c = cast_float_layers(convert(q), torch.float16)
    assert isinstance(c[0], Int8Linear)
    assert c[0].weight_scale.dtype == torch.float32 and c[0].input_scale.dtype == torch.float32
    assert c[0].weight_q.dtype == torch.int8


def test_needs_a_cuda_device() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    fp, q, data = _setup()
    with pytest.raises(ExportError, match="needs a CUDA device"):
        validate_cuda(q, eval_loader=data, reference=fp)


def test_validate_a_run_folder_with_backend_cuda(tmp_path: Path) -> None:
    """`compress validate RUN --backend cuda`: the quantized model of a finished run, restored from its
    saved state (data, weights_only), is converted and validated against the run's baseline, without
    rerunning any stage."""
    from compress.validation import validate_run_cuda

    recipe = {
        "version": 1, "name": "tiny_q",
        "model": {"name": "mlp", "kwargs": {"hidden": 64, "depth": 1, "num_classes": 10, "in_features": 64}},
        "data": {"source": "digits", "calibration_samples": 64, "eval_samples": 64},
        "train": {"epochs": 2, "batch_size": 32, "lr": 0.1, "seed": 0},
        "stages": [{"name": "ptq", "modifiers": [{"type": "ptq", "scheme": "w8a8"}]}],
        "export": {"enabled": False},
    }
    out = tmp_path / "run"
    compress.apply(recipe, out_dir=out, quiet=True)
    assert not (out / "checkpoints" / "final_model.pt").exists()  # no pickled module any more
    if torch.cuda.is_available():
        rows = validate_run_cuda(out, batch_sizes=[1, 8], runs=3)
    else:
        rows = validate_run_cuda(out, batch_sizes=[1, 8], runs=1, device="cpu", dtype=torch.float32)
    assert [r["batch"] for r in rows] == [1, 8]
    r = rows[0]
    assert r["fp32"] is not None and r["int8"] is not None and r["fp32"] - r["int8"] <= 0.05
    assert r["parity_sqnr_db"] > 30 and r["parity_top1"] >= 0.98
    assert all(x["int8_ms"] > 0 and x["float_ms"] > 0 for x in rows)
    from compress.cli import cuda_table

    table = cuda_table(rows).splitlines()  # what the CLI prints
    assert table[0].split()[:2] == ["batch", "float"] and len(table) == 1 + len(rows) + 1 + len(r["kept_float"])
    assert table[1 + len(rows)] == f"{r['int8_layers']} layers converted, {len(r['kept_float'])} kept float"


def test_backend_cuda_needs_a_run_folder(tmp_path: Path) -> None:
    from compress.core.errors import RecipeError
    from compress.validation import validate_run_cuda

    f = tmp_path / "m.onnx"
    f.write_bytes(b"x")
    with pytest.raises(RecipeError, match="run folder"):
        validate_run_cuda(f)
    (tmp_path / "recipe.yaml").write_text("version: 1\n")
    with pytest.raises(RecipeError, match=r"final\.pt not found"):
        validate_run_cuda(tmp_path)
