"""export/cuda.py: validate_cuda on a small model (CPU under the Triton interpreter, or CUDA)."""

from __future__ import annotations

import copy
import importlib.util
import os

import pytest
import torch
from torch import nn

if not torch.cuda.is_available():  # before the kernels are first imported (jit decides then)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import compress
from compress.errors import ExportError
from export.cuda import cast_float_layers, validate_cuda
from quantization.int8 import Int8Linear
from quantization.modules import QuantLinear

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs compress[triton]")


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
    r = validate_cuda(q, eval_loader=data, reference=fp, batch_sizes=[1, 8], warmup=2, runs=5)
    _check(r, batches=[1, 8])
    assert r["float_dtype"] == "fp16" and all(row["cuda_graphs"] for row in r["latency"])


def test_cast_float_layers_keeps_int8_scales_fp32() -> None:
    _, q, _ = _setup()
    from quantization.convert import convert

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
