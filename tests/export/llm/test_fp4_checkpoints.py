"""NVFP4 and MXFP4 compressed-tensors checkpoints, weight-only and W4A4, from RTN, GPTQ and AWQ: read
back by transformers' compressed-tensors loader (its own decompressor and its own activation
quantization) on Llama-, Qwen2- and Gemma-style decoders built from configs.

compressed-tensors decompresses fp4 weights to bfloat16 (``unpack_fp4_from_uint8``'s default), so a
checkpoint reloads at bf16 weights: MXFP4's (an e2m1 value times a power of two) are exactly ours;
NVFP4's are ours rounded to bf16 (the e4m3 scale divided by the fp32 global scale is no bf16
number). The logits are compared with our model run at those same weights."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("compressed_tensors")
transformers = pytest.importorskip("transformers")

from compress.export.llm.compressed_tensors import save_compressed_tensors  # noqa: E402

import compress  # noqa: E402
from compress.core.errors import UnsupportedModelError  # noqa: E402

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 256}


def _model(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).eval()
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL)).eval()
    cfg = transformers.Gemma2Config(**SMALL, head_dim=16, attn_implementation="eager")
    return transformers.Gemma2ForCausalLM(cfg).eval()


def _ids(seed: int, n: int = 4, t: int = 12) -> torch.Tensor:
    return torch.randint(0, SMALL["vocab_size"], (n, t), generator=torch.Generator().manual_seed(seed))


def _reload(out: Path) -> nn.Module:
    """The checkpoint through transformers, then run in float32 (its weights stay the bf16 values;
    transformers refuses ``.float()`` on a quantized model, torch's own cast does it)."""
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        loaded(_ids(0, n=1, t=2))  # the first forward decompresses (compressed-tensors' hook), to bf16
    return nn.Module.float(loaded)


def _at_bf16_weights(fq: nn.Module) -> nn.Module:
    """Our model at the reloaded one's parameters: each quantized weight fixed at its fake-quant value
    rounded to bf16 (what the library's decompressor writes), the other parameters rounded to bf16 as
    the bf16 load rounds them; input quantizers kept."""
    ref = copy.deepcopy(fq)
    with torch.no_grad():
        fixed = {}
        for m in ref.modules():
            wq = getattr(m, "weight_quantizer", None)
            if wq is not None:
                fixed[m] = m.quantized_weight().to(torch.bfloat16).float()
                wq.enabled = False
        for p in ref.parameters():
            p.copy_(p.to(torch.bfloat16).float())
        for m, w in fixed.items():
            m.weight.copy_(w)
    return ref


@pytest.mark.parametrize(("kind", "scheme", "method"), [
    ("llama", "NVFP4A16", "rtn"), ("qwen2", "MXFP4A16", "rtn"), ("gemma2", "NVFP4A16", "gptq"),
    ("llama", "MXFP4A16", "gptq"), ("llama", "NVFP4", "rtn"), ("qwen2", "MXFP4", "gptq"), ("gemma2", "NVFP4", "gptq"),
])
def test_fp4_checkpoint_reloads_in_transformers_with_our_logits(kind: str, scheme: str, method: str, tmp_path: Path) -> None:
    model = _model(kind)
    calib = [_ids(s) for s in range(4)]
    if method == "rtn":
        fq = compress.quantize(model, scheme, calib, ignore=["lm_head"], progress=False)
    else:
        fq = compress.gptq(model, calib, scheme=scheme, ignore=["lm_head"], progress=False)
    out = save_compressed_tensors(fq, tmp_path / "ckpt")
    kindname = "nvfp4" if scheme.startswith("NV") else "mxfp4"
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == f"{kindname}-pack-quantized" and qc["ignore"] == ["lm_head"]
    group = qc["config_groups"]["group_0"]
    assert group["weights"]["type"] == "float" and group["weights"]["num_bits"] == 4
    assert ("input_activations" in group and group["input_activations"] is not None) == (not scheme.endswith("A16"))
    from safetensors.torch import load_file

    stored = load_file(str(out / "model.safetensors"))
    down = "model.layers.0.mlp.down_proj"
    assert stored[f"{down}.weight_packed"].dtype == torch.uint8
    assert stored[f"{down}.weight_packed"].shape == (64, 64)  # two nibbles a byte
    assert stored[f"{down}.weight_scale"].dtype == (torch.float8_e4m3fn if kindname == "nvfp4" else torch.uint8)
    loaded = _reload(out)
    quantized = {n: m for n, m in fq.named_modules() if getattr(m, "weight_quantizer", None) is not None}
    assert len(quantized) == 14
    with torch.no_grad():
        ids = _ids(99)
        logits = loaded(ids).logits
        for name, mod in quantized.items():
            ours = mod.quantized_weight().float()
            got = loaded.get_submodule(name).weight
            assert torch.equal(got, ours.to(torch.bfloat16).float())
            if kindname == "mxfp4":
                assert torch.equal(got, ours)  # e2m1 times a power of two: exact in bf16
        # the same weights and, for W4A4, the same dynamic group quantization of every Linear's input
        torch.testing.assert_close(logits, _at_bf16_weights(fq)(ids).logits, atol=1e-5, rtol=1e-5)
        if not scheme.endswith("A16"):  # the inputs are quantized there: without it the logits move far more
            ref = _at_bf16_weights(fq)
            for m in ref.modules():
                if getattr(m, "input_quantizer", None) is not None:
                    m.input_quantizer.enabled = False
            assert (ref(ids).logits - logits).abs().max() > 1e-3


def test_gptq_on_fp4_grids_lowers_the_layer_error_rtn_leaves() -> None:
    """The layer objective: GPTQ's rounded weights have a lower tr(dW H dW^T) than round-to-nearest's."""
    from compress.quantization.algorithms.gptq import gptq_quantize, layer_error
    from compress.quantization.numerics.primitives import fake_quantize_spec, spec_qparams, to_groups
    from compress.quantization.numerics.spec import QuantScheme

    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 128, generator=g) @ torch.randn(128, 128, generator=g)  # correlated inputs
    h = 2 * x.T @ x / x.shape[0]
    w = torch.randn(64, 128, generator=g) * 0.05
    for scheme in ("NVFP4A16", "MXFP4A16"):
        spec = QuantScheme.preset(scheme).weights
        assert spec is not None
        gs = spec.group_size or 0
        grp = to_groups(w, gs)
        scale, zp = spec_qparams(grp.amin(-1), grp.amax(-1), spec)
        rtn = fake_quantize_spec(w, scale, zp, spec)
        q, s_gptq, _ = gptq_quantize(w, h, spec)
        assert torch.equal(s_gptq, scale)  # block scales from the original weight, as the peer's
        assert torch.equal(fake_quantize_spec(q, s_gptq, zp, spec), q)  # on the grid
        assert layer_error(w, q, h) < 0.7 * layer_error(w, rtn, h)


def test_awq_on_nvfp4_runs_and_writes_a_reloadable_checkpoint(tmp_path: Path) -> None:
    model = _model("qwen2")
    calib = [_ids(s) for s in range(4)]
    fq = compress.awq(model, calib, scheme="NVFP4A16", ignore=["lm_head"], progress=False)
    out = save_compressed_tensors(fq, tmp_path / "ckpt")
    with torch.no_grad():
        ids = _ids(7)
        torch.testing.assert_close(_reload(out)(ids).logits, _at_bf16_weights(fq)(ids).logits, atol=1e-5, rtol=1e-5)


def test_mixed_fp4_formats_and_ragged_widths_are_refused_in_one_line(tmp_path: Path) -> None:
    from compress.quantization.numerics.fake_quant import FakeQuantizer
    from compress.quantization.numerics.spec import QuantScheme
    from compress.quantization.preparation import calibrate_weight

    model = compress.quantize(_model("llama"), "NVFP4A16", ignore=["lm_head"], progress=False)
    layer = model.get_submodule("model.layers.1.mlp.down_proj")
    mx = QuantScheme.preset("MXFP4A16").weights
    assert mx is not None
    layer.weight_quantizer = FakeQuantizer(mx, role="weight")
    calibrate_weight(layer)
    with pytest.raises(UnsupportedModelError, match="MXFP4 and NVFP4"):
        save_compressed_tensors(model, tmp_path / "mixed")
    assert not (tmp_path / "mixed").exists()

    torch.manual_seed(0)
    narrow = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**SMALL, "hidden_size": 48})).eval()
    ids = _ids(3)
    compress.quantize(narrow, "MXFP4", [ids], ignore=["lm_head"], progress=False)
    with pytest.raises(UnsupportedModelError, match="48 input features are not a multiple of MXFP4's group of 32"):
        save_compressed_tensors(narrow, tmp_path / "ragged")
    assert not (tmp_path / "ragged").exists()


def test_ragged_weight_only_layers_are_written_in_float_as_llm_compressor_does(tmp_path: Path) -> None:
    torch.manual_seed(0)
    narrow = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**SMALL, "hidden_size": 48})).eval()
    fq = compress.quantize(narrow, "MXFP4A16", ignore=["lm_head"], progress=False)
    out = save_compressed_tensors(fq, tmp_path / "ckpt")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "model.layers.0.self_attn.q_proj" in qc["ignore"] and "model.layers.0.mlp.down_proj" not in qc["ignore"]
    with torch.no_grad():
        ids = _ids(5)
        torch.testing.assert_close(_reload(out)(ids).logits, _at_bf16_weights(fq)(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", ["rtn", "rtn-no-data", "gptq", "awq"])
def test_nvfp4_layers_reading_one_tensor_share_one_global_scale(method: str, tmp_path: Path) -> None:
    """q/k/v and gate/up: one global scale each, 448 * 6 / the largest amax of the group, as serving
    stacks fuse them into one GEMM (vLLM's qkv_proj) and llm-compressor writes them; o_proj and
    down_proj keep their own."""
    model = _model("qwen2")
    calib = [_ids(s) for s in range(4)]
    float_amax = {n: float(m.weight.detach().abs().amax()) for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    if method.startswith("rtn"):
        fq = compress.quantize(model, "NVFP4A16", None if method == "rtn-no-data" else calib, ignore=["lm_head"],
                               progress=False)
    else:
        fq = getattr(compress, method)(model, calib, scheme="NVFP4A16", ignore=["lm_head"], progress=False)
    out = save_compressed_tensors(fq, tmp_path / "ckpt")
    from safetensors.torch import load_file

    stored = load_file(str(out / "model.safetensors"))
    for i in range(2):
        pre = f"model.layers.{i}."
        g = {n: float(stored[f"{pre}{n}.weight_global_scale"]) for n in
             ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
              "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
        assert g["self_attn.q_proj"] == g["self_attn.k_proj"] == g["self_attn.v_proj"]
        assert g["mlp.gate_proj"] == g["mlp.up_proj"]
        assert g["self_attn.o_proj"] != g["self_attn.q_proj"]
        if method.startswith("rtn") or method == "gptq":  # the original weights' amax (AWQ scales them first)
            amax = max(float_amax[pre + n] for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"))
            assert g["self_attn.q_proj"] == pytest.approx(448 * 6 / amax, rel=1e-6)
    with torch.no_grad():
        ids = _ids(11)
        torch.testing.assert_close(_reload(out)(ids).logits, _at_bf16_weights(fq)(ids).logits, atol=1e-5, rtol=1e-5)
