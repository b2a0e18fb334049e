"""convert(): fake-quant models to int8 modules, activation fusion, reasons for what stays float."""

from __future__ import annotations

import copy
import importlib.util
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

if not torch.cuda.is_available():  # before the kernels are first imported (jit decides then)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from compress.quantization import calibrate, prepare
from compress.quantization.lowering.convert import convert, convert_with_report
from compress.quantization.lowering.int8 import Int8Conv2d, Int8Linear
from compress.quantization.numerics.modules import QuantConv1d, QuantConv2d

import compress
from compress.core.errors import RecipeError, UnsupportedModelError
from compress.models.resnet import resnet

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs the triton extra")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _sqnr_db(ref: torch.Tensor, y: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - y).pow(2).mean().clamp(min=1e-30)))


def test_resnet_converts_fuses_relu_and_matches_fake_quant() -> None:
    torch.manual_seed(0)
    fp = resnet(width=8, depth=1, in_channels=3).eval()
    data = [torch.randn(4, 3, 12, 12) for _ in range(4)]
    q = compress.quantize(copy.deepcopy(fp), "w8a8", data).eval()
    c, report = convert_with_report(q, placed="fuse")  # the placed quantizers kept: the fake-quant arithmetic
    convs = [r for r in report if r.quant_type == "QuantConv2d"]
    assert convs and all(r.int8_type == "Int8Conv2d" for r in convs)
    assert [r.activation for r in report if r.name.endswith("conv1")] == ["relu"] * 3
    assert isinstance(c.fc, Int8Linear) and isinstance(c.layer1[0].conv1, Int8Conv2d)
    assert isinstance(c.layer1[0].relu1, nn.Identity) and isinstance(c.layer1[0].relu2, nn.ReLU)  # after an add: kept
    assert isinstance(q.layer1[0].conv1, QuantConv2d) and isinstance(q.layer1[0].relu1, nn.ReLU)  # input untouched
    x = torch.randn(2, 3, 12, 12)
    with torch.no_grad():
        ref, yq = fp(x), q(x)
        y = c.to(DEVICE)(x.to(DEVICE)).cpu()
    torch.testing.assert_close(y, yq, atol=1e-4, rtol=1e-4)
    assert _sqnr_db(ref, y) > 15


def test_mlp_dynamic_gelu_fused() -> None:
    torch.manual_seed(1)
    fp = nn.Sequential(nn.Linear(40, 64), nn.GELU(), nn.Linear(64, 24), nn.ReLU(), nn.Linear(24, 5)).eval()
    q = compress.quantize(fp, "w8a8_dynamic", [torch.randn(8, 40) for _ in range(2)]).eval()
    c, report = convert_with_report(q)
    assert [r.activation for r in report] == ["gelu", "relu", "none"]
    assert isinstance(c[1], nn.Identity) and isinstance(c[3], nn.Identity)
    x = torch.randn(2, 7, 40)
    with torch.no_grad():
        y = c.to(DEVICE)(x.to(DEVICE)).cpu()
        torch.testing.assert_close(y, q(x), atol=1e-4, rtol=1e-4)


class _Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dw = nn.Conv2d(4, 4, 3, padding=1, groups=4)
        self.pw = nn.Conv2d(4, 8, 1)
        self.c1 = nn.Conv1d(8, 8, 1)
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.pw(self.dw(x)).mean(dim=3)
        return self.fc(self.c1(y).mean(dim=2))


def test_unconvertible_layers_stay_float_with_logged_reason(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(2)
    q = compress.quantize(_Mixed().eval(), "w8a8", [torch.randn(2, 4, 6, 6) for _ in range(2)]).eval()
    with caplog.at_level(logging.INFO, logger="compress.quantization.lowering.convert"):
        c, report = convert_with_report(q, placed="fuse")
    by = {r.name: r for r in report}
    assert not by["dw"].converted and "groups=4" in by["dw"].reason
    assert not by["c1"].converted and "QuantConv1d" in by["c1"].reason
    assert by["pw"].converted and by["fc"].converted
    assert isinstance(c.dw, QuantConv2d) and isinstance(c.c1, QuantConv1d)
    assert "dw (QuantConv2d) stays float" in caplog.text
    x = torch.randn(2, 4, 6, 6)
    with torch.no_grad():
        torch.testing.assert_close(c.to(DEVICE)(x.to(DEVICE)).cpu(), q(x), atol=1e-4, rtol=1e-4)


def test_qat_batchnorm_is_folded_on_the_copy() -> None:
    torch.manual_seed(3)
    fp = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
    fp[1].running_mean.uniform_(-0.5, 0.5)
    fp[1].running_var.uniform_(0.5, 2.0)
    fp.eval()
    prepare(fp, "w8a8", bn="qat")
    calibrate(fp, [torch.randn(2, 3, 8, 8) for _ in range(2)])
    fp.eval()
    assert fp[0].bn is not None
    c = convert(fp, placed="fuse")
    assert isinstance(c[0], Int8Conv2d) and fp[0].bn is not None
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(c.to(DEVICE)(x.to(DEVICE)).cpu(), fp(x), atol=2e-3, rtol=1e-3)


def test_bad_requests_raise() -> None:
    with pytest.raises(RecipeError, match="did you mean 'cuda'"):
        convert(nn.Linear(2, 2), backend="cudaa")
    with pytest.raises(UnsupportedModelError, match="no quantized modules"):
        convert(nn.Linear(2, 2))


def test_cpu_without_interpreter_raises_clear_error() -> None:
    code = """
        import torch
        if torch.cuda.is_available():
            raise SystemExit(0)
        from torch import nn
        import compress
        from compress.core.errors import CompressError
        from compress.quantization.lowering.convert import convert
        q = compress.quantize(nn.Sequential(nn.Linear(8, 4)), "w8a8", [torch.randn(2, 8)])
        c = convert(q)
        try:
            c(torch.randn(2, 8))
        except CompressError as e:
            print("ERR", e)
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    if not torch.cuda.is_available():
        assert "ERR quantize_static run on CUDA devices (got a cpu tensor)" in r.stdout, r.stdout + r.stderr[-2000:]


def test_speed_check_keeps_slower_layers_float_with_both_times_and_converts_the_rest() -> None:
    """The decision, with the timing replaced: a layer whose kernel is slower than its float form at
    the shape the model gives it stays a plain float layer, named with both times and the shape."""
    from compress.quantization.lowering.convert import convert_with_report
    from compress.quantization.lowering.int8 import Int8Linear

    import compress

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)).eval()
    x = torch.randn(8, 32)
    fq = compress.quantize(model, "w8a8", [x])
    seen: list[tuple[int, ...]] = []

    def timer(q: nn.Module, f: nn.Module, shape: tuple[int, ...], dtype: torch.dtype, dev: torch.device) -> tuple[float, float]:
        seen.append(shape)
        assert isinstance(q, Int8Linear) and type(f) is nn.Linear and f.weight.dtype == dtype
        return (2.0, 1.0) if shape[-1] == 64 else (1.0, 2.0)  # the second layer's kernel "is slower"

    conv, report = convert_with_report(fq, speed_check=x, speed_dtype=torch.float16, speed_timer=timer)
    assert sorted(seen) == [(8, 32), (8, 64)]
    by_name = {r.name: r for r in report}
    assert by_name["0"].converted and isinstance(conv[0], Int8Linear)
    assert not by_name["2"].converted and type(conv[2]) is nn.Linear
    assert "2.0000 ms" in by_name["2"].reason and "[8, 64]" in by_name["2"].reason and "fp16" in by_name["2"].reason
    assert conv[2].weight.dtype == torch.float32  # the timing cast a copy, not the model's weight
    assert torch.equal(conv[2].weight, fq[2].weight)
