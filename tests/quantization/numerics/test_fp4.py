"""fp4 e2m1 grids (NVFP4, MXFP4): our rounding, scales and fake quantization against compressed-tensors'
own functions (the arithmetic its checkpoints and vLLM use), their gradients, and the recipe-level
rules (presets, validation, refusals of exports that have no fp4 kernel)."""

from __future__ import annotations

import pytest
import torch
from compress.quantization.numerics.primitives import (
    fake_quantize_fp4,
    fp4_codes,
    round_e2m1,
    spec_qparams,
    to_groups,
)
from compress.quantization.numerics.spec import QuantScheme, QuantSpec
from torch import nn

import compress
from compress.core.errors import CalibrationError, ExportError, RecipeError, UnsupportedModelError

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_round_e2m1_is_round_to_nearest_even_on_the_grid() -> None:
    # every midpoint goes to the even code (mantissa 0): 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, ...
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert round_e2m1(mids).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert round_e2m1(-mids).tolist() == [-0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0]
    x = torch.linspace(-8, 8, 4001)
    q = round_e2m1(x)
    grid = torch.tensor(E2M1)
    assert set(q.abs().unique().tolist()) <= set(E2M1)
    # nearest: no grid value is strictly closer than the one chosen (saturating at 6)
    best = (x.clamp(-6, 6).abs().unsqueeze(1) - grid).abs().amin(1)
    assert torch.all((q.abs() - x.clamp(-6, 6).abs()).abs() <= best + 1e-6)


def test_rounding_and_nibbles_match_compressed_tensors() -> None:
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8
    from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4

    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(20000, generator=g) * 4, torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 9.0, -9.0])])
    assert torch.equal(round_e2m1(x), cast_to_fp4(x.clone()))
    v = round_e2m1(x[:20000]).reshape(100, 200)
    nib = fp4_codes(v)
    packed = nib[:, 0::2] | (nib[:, 1::2] << 4)
    assert torch.equal(packed, pack_fp4_to_uint8(v))
    assert torch.equal(unpack_fp4_from_uint8(packed, 100, 200), v)


@pytest.mark.parametrize("preset", ["NVFP4A16", "MXFP4A16"])
def test_weight_scales_and_values_equal_compressed_tensors(preset: str) -> None:
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 256, generator=g) * torch.rand(96, 1, generator=g) * 0.1
    w[5, :32] = 0  # all-zero groups
    w[7, 3] = 1.5  # an outlier row
    args = preset_name_to_scheme(preset, ["Linear"]).weights
    spec = QuantScheme.preset(preset).weights
    assert spec is not None and spec.group_size == args.group_size
    groups = to_groups(w, spec.group_size or 0)
    gs = generate_gparam(w.amin(), w.amax()) if preset.startswith("NV") else None
    ct_scale, ct_zp = calculate_qparams(groups.amin(-1), groups.amax(-1), args, global_scale=gs)
    ours, _ = spec_qparams(groups.amin(-1), groups.amax(-1), spec)
    want = ct_scale.float() / gs if gs is not None else ct_scale.float()
    assert torch.equal(ours, want)
    ref = fake_quantize(w, ct_scale, ct_zp, args, global_scale=gs)
    assert torch.equal(fake_quantize_fp4(to_groups(w, spec.group_size or 0), ours.unsqueeze(-1)).reshape(w.shape), ref)
    if preset.startswith("MX"):  # powers of two, the largest element of each group in [4, 7) before saturation
        assert torch.equal(torch.exp2(torch.round(torch.log2(ours))), ours)


@pytest.mark.parametrize("preset", ["NVFP4", "MXFP4"])
def test_w4a4_inputs_equal_compressed_tensors_dynamic_groups(preset: str) -> None:
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp, generate_gparam

    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(64, 48))
    calib = torch.randn(6, 5, 64) * 3
    compress.quantize(layer, preset, data=[calib], progress=False)
    iq = layer[0].input_quantizer
    args = preset_name_to_scheme(preset, ["Linear"]).input_activations
    gs = generate_gparam(calib.amin(), calib.amax()) if preset == "NVFP4" else None
    if gs is not None:
        assert torch.equal(iq.global_scale, gs)  # calibrated as llm-compressor's static_minmax observer
    x = torch.randn(3, 7, 64) * 2
    sc, zp = compute_dynamic_scales_and_zp(value=x, args=args, module=nn.Module(), global_scale=gs)
    assert torch.equal(iq(x), fake_quantize(x=x, scale=sc, zero_point=zp, args=args, global_scale=gs))


def test_nvfp4_inputs_need_calibration_data() -> None:
    with pytest.raises(CalibrationError, match="calibration data"):
        compress.quantize(nn.Sequential(nn.Linear(32, 32)), "NVFP4")
    compress.quantize(nn.Sequential(nn.Linear(32, 32)), "MXFP4")  # fully dynamic: no data needed


def test_straight_through_gradients_inside_the_range_zero_when_saturated() -> None:
    scale = torch.tensor([[0.5]])
    x = torch.tensor([[0.1, 0.8, 2.9, 3.1, 5.0]], requires_grad=True)  # 3.1 / 0.5 = 6.2 saturates
    y = fake_quantize_fp4(x, scale)
    y.sum().backward()
    assert x.grad is not None and x.grad.tolist() == [[1.0, 1.0, 1.0, 0.0, 0.0]]
    assert y.detach().tolist() == [[0.0, 0.75, 3.0, 3.0, 3.0]]


def test_fp4_qat_trains_through_the_quantizers() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    x, y = torch.randn(256, 32), torch.randn(256, 8)
    compress.quantize(model, "MXFP4A16")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = last = 0.0
    for step in range(60):
        for q in (model[0].weight_quantizer, model[2].weight_quantizer):  # QAT: scales follow the weights
            q.observing = True
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = float(loss.detach()) if step == 0 else first
        last = float(loss.detach())
    assert last < 0.8 * first


def test_spec_rules_name_the_field() -> None:
    with pytest.raises(ValueError, match="NVFP4: group_size 16"):
        QuantSpec(bits=4, dtype="fp4_e2m1", granularity="group", group_size=32, scale_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match="symmetric and per group"):
        QuantSpec(bits=4, dtype="fp4_e2m1", granularity="channel")
    with pytest.raises(ValueError, match="scale_dtype 'e8m0' is for fp4_e2m1"):
        QuantSpec(bits=4, granularity="group", group_size=32, scale_dtype="e8m0")
    fp4 = QuantSpec(bits=4, dtype="fp4_e2m1", granularity="group", group_size=16, scale_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match="dynamic: true"):
        QuantScheme(weights=fp4, inputs=fp4)
    with pytest.raises(RecipeError, match="unknown quantization scheme 'NVFP5'"):
        QuantScheme.preset("NVFP5")
    for name in ("NVFP4A16", "NVFP4", "MXFP4A16", "MXFP4", "nvfp4a16"):
        assert QuantScheme.preset(name).weights.is_fp4  # type: ignore[union-attr]
    assert QuantScheme.preset("NVFP4").needs_data and not QuantScheme.preset("MXFP4").needs_data


def test_lsq_is_refused_on_fp4_scales() -> None:
    model = compress.quantize(nn.Sequential(nn.Linear(32, 32)), "NVFP4A16")
    with pytest.raises(CalibrationError, match="fixed by the format"):
        model[0].weight_quantizer.enable_lsq()


def test_exports_without_fp4_kernels_refuse_in_one_line(tmp_path: pytest.TempPathFactory) -> None:
    from compress.quantization.lowering.int4 import int4_weight, is_int4_weight_only

    model = compress.quantize(nn.Sequential(nn.Linear(32, 32)), "NVFP4A16")
    assert not is_int4_weight_only(model[0])  # not taken for an int4 layer by MatMulNBits, GGUF or the W4A16 GEMM
    with pytest.raises(UnsupportedModelError, match="fp4 e2m1 \\(NVFP4\\)"):
        int4_weight(model[0], where="0")
    with pytest.raises(ExportError, match="fp4 e2m1"):
        compress.export_onnx(model, torch.randn(1, 32), tmp_path / "m.onnx")  # type: ignore[operator]
