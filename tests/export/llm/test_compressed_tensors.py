"""compressed-tensors checkpoints: read back by the compressed-tensors library itself (through
transformers' loader, and through its pack-quantized decompressor) to exactly our weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("compressed_tensors")
transformers = pytest.importorskip("transformers")

from compress.export.llm.compressed_tensors import pack_int32, save_compressed_tensors  # noqa: E402
from compress.quantization.lowering.int4 import dequantize_int4, int4_weight  # noqa: E402
from compress.quantization.numerics.spec import QuantScheme, QuantSpec  # noqa: E402

import compress  # noqa: E402
from compress.core.errors import UnsupportedModelError  # noqa: E402

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 256}


def _w4(group: int | None, *, symmetric: bool) -> QuantScheme:
    gran = {"granularity": "group", "group_size": group} if group else {"granularity": "channel"}
    dtype = "int8" if symmetric else "uint8"
    return QuantScheme(weights=QuantSpec(bits=4, symmetric=symmetric, dtype=dtype, **gran), inputs=None)  # type: ignore[arg-type]


def _model(kind: str, scheme: QuantScheme, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL))
    return compress.quantize(model.eval(), scheme, ignore=["lm_head"])


def _quantized(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if getattr(m, "weight_quantizer", None) is not None}


def test_packed_codes_unpack_to_ours_with_the_library() -> None:
    from compressed_tensors.compressors import unpack_from_int32

    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (5, 43), generator=g, dtype=torch.uint8)  # ragged: 43 = 5 words + 3 nibbles
    # the layout vLLM reads: 8 codes a word, the first in the lowest nibble
    words = pack_int32(torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]], dtype=torch.uint8))
    assert words.tolist() == [[0x76543210], [0xFEDCBA98 - 2**32]]
    back = unpack_from_int32(pack_int32(codes), 4, codes.shape)
    assert torch.equal(back.to(torch.int16) + 8, codes.to(torch.int16))  # the library holds q - 8, signed
    # packed along dim 0 (zero points): the same words as packing the transpose along dim 1
    assert torch.equal(pack_int32(codes, packed_dim=0), pack_int32(codes.T.contiguous()).T)


@pytest.mark.parametrize(("kind", "group"), [("llama", 32), ("qwen2", None)], ids=["llama-gqa-g32", "qwen2-per-channel"])
def test_transformers_loads_and_decompresses_exactly(kind: str, group: int | None, tmp_path: Path) -> None:
    fq = _model(kind, _w4(group, symmetric=True))
    out = save_compressed_tensors(fq, tmp_path / "ckpt")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert qc["ignore"] == ["lm_head"] and qc["quantization_status"] == "compressed"
    assert qc["config_groups"]["group_0"]["format"] == "pack-quantized"
    weights = qc["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["strategy"], weights["group_size"]) == (4, "group" if group else "channel", group)

    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, SMALL["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = loaded(ids).logits  # the first forward decompresses (compressed-tensors' hook)
        ref = fq(ids).logits
    layers = _quantized(fq)
    assert len(layers) == 14
    for name, mod in layers.items():
        got = loaded.get_submodule(name).weight
        torch.testing.assert_close(got, dequantize_int4(int4_weight(mod)), atol=0, rtol=0)
        torch.testing.assert_close(got, mod.quantized_weight(), atol=0, rtol=0)
        if mod.bias is not None:  # Qwen2's q/k/v biases travel as float
            torch.testing.assert_close(loaded.get_submodule(name).bias, mod.bias, atol=0, rtol=0)
    torch.testing.assert_close(logits, ref, atol=0, rtol=0)


def test_asymmetric_groups_decompress_with_the_library(tmp_path: Path) -> None:
    # compressed-tensors 0.20 builds the *unpacked* zero-point shape when transformers prepares a model
    # for loading, while its compressor writes zero points packed (what vLLM reads): we write the
    # latter and check it with the compressor's own decompress (known upstream: vllm-project/llm-compressor#1618)
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    fq = _model("qwen2", _w4(32, symmetric=False), seed=3)
    out = save_compressed_tensors(fq, tmp_path / "ckpt")
    qc = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
    scheme = qc.config_groups["group_0"]
    assert scheme.weights.symmetric is False and scheme.weights.group_size == 32
    tensors = load_file(str(out / "model.safetensors"))
    layers = _quantized(fq)
    for name, mod in layers.items():
        local = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".weight_")}
        assert set(local) == {"weight_packed", "weight_scale", "weight_zero_point", "weight_shape"}
        dec = PackedQuantizationCompressor.decompress(local, scheme)
        ours = dequantize_int4(int4_weight(mod))
        assert bool((int4_weight(mod).zero_point != 8).any())  # really asymmetric
        torch.testing.assert_close(dec["weight"], ours, atol=0, rtol=0)
        torch.testing.assert_close(dec["weight"], mod.quantized_weight(), atol=0, rtol=0)
    assert torch.equal(tensors["model.embed_tokens.weight"], fq.model.embed_tokens.weight)


def test_non_int4_layers_are_refused(tmp_path: Path) -> None:
    fq = _model("llama", QuantScheme.preset("w3_weight_only_g128"))
    with pytest.raises(UnsupportedModelError, match="only 4-bit integer layers are written"):
        save_compressed_tensors(fq, tmp_path / "x")


def test_quantized_activations_without_a_checkpoint_form_are_refused_not_dropped(tmp_path: Path) -> None:
    per_tensor = QuantScheme(weights=QuantSpec(bits=4, granularity="group", group_size=32),
                             inputs=QuantSpec(granularity="tensor", dynamic=True))
    with pytest.raises(UnsupportedModelError, match="only dynamic per-token symmetric int8 inputs are written"):
        save_compressed_tensors(_model("llama", per_tensor), tmp_path / "x")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_w4a8_is_written_pack_quantized_with_token_inputs(kind: str, tmp_path: Path) -> None:
    """llm-compressor's W4A8 (int4 groups, dynamic per-token int8 inputs): transformers' loader keeps
    exactly our int4 weights and quantizes the inputs per token at its step of amax/127.5 (ours and
    vLLM's: amax/127), so its logits are our weights at that step, exactly."""
    import copy

    torch.manual_seed(0)
    w4a8 = QuantScheme(weights=QuantSpec(bits=4, granularity="group", group_size=32),
                       inputs=QuantSpec(granularity="token", dynamic=True))
    ids = torch.randint(0, SMALL["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(1))
    cls, cfg = ((transformers.LlamaForCausalLM, transformers.LlamaConfig) if kind == "llama"
                else (transformers.Qwen2ForCausalLM, transformers.Qwen2Config))
    fq = compress.gptq(cls(cfg(**SMALL)).eval(), [ids], scheme=w4a8, ignore=["lm_head"]).eval()
    out = save_compressed_tensors(fq, tmp_path / "ckpt")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "pack-quantized"
    group = qc["config_groups"]["group_0"]
    assert (group["weights"]["num_bits"], group["weights"]["group_size"]) == (4, 32)
    assert (group["input_activations"]["strategy"], group["input_activations"]["dynamic"]) == ("token", True)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        loaded(ids)  # the first forward decompresses
    for name, mod in _quantized(fq).items():
        torch.testing.assert_close(loaded.get_submodule(name).weight.float(), mod.quantized_weight().float(),
                                   atol=0, rtol=0)

    def emulated(step: float) -> torch.Tensor:
        m = copy.deepcopy(fq)
        for lin in _quantized(m).values():
            lin.input_quantizer.enabled = False
        _per_token_int8(m, step)
        with torch.no_grad():
            return m(ids).logits

    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, emulated(127.5), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(fq(ids).logits, emulated(127.0), atol=1e-5, rtol=1e-5)


def test_groups_not_dividing_the_width_are_written_as_llm_compressor_does(tmp_path: Path) -> None:
    # g48 on a 64-wide model: q/k/v/o and gate/up (64 inputs) have a shorter last group, down_proj
    # (144 inputs) whole groups; compressed-tensors refuses ragged groups, so those layers go to
    # ``ignore`` in float with our fake-quant values, and the reloaded model computes ours exactly
    from compress.data.lm import iter_texts, split_files, train_tokenizer

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{**SMALL, "intermediate_size": 144})
    fq = compress.quantize(transformers.LlamaForCausalLM(cfg).eval(), _w4(48, symmetric=True), ignore=["lm_head"])
    tok = train_tokenizer(iter_texts(split_files(0)["train"][:1]), vocab_size=256)
    out = save_compressed_tensors(fq, tmp_path / "ckpt", tokenizer=tok)
    assert {"generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "model.layers.0.self_attn.q_proj" in qc["ignore"] and "model.layers.0.mlp.down_proj" not in qc["ignore"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, SMALL["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, fq(ids).logits, atol=0, rtol=0)
    assert transformers.AutoTokenizer.from_pretrained(out)("def f")["input_ids"] == tok("def f")["input_ids"]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_fp8_dynamic_is_written_float_quantized_and_transformers_runs_it_as_ours(kind: str, tmp_path: Path) -> None:
    """FP8_DYNAMIC (what vLLM serves on Hopper): fp8 weight codes with per-channel scales and dynamic
    per-token fp8 inputs; transformers' compressed-tensors loader decompresses the same weights and
    quantizes the inputs the same way, so its logits are ours."""
    torch.manual_seed(0)
    cls, cfg = ((transformers.LlamaForCausalLM, transformers.LlamaConfig) if kind == "llama"
                else (transformers.Qwen2ForCausalLM, transformers.Qwen2Config))
    ids = torch.randint(0, SMALL["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(1))
    fq = compress.quantize(cls(cfg(**SMALL)).eval(), "FP8_DYNAMIC", [ids], ignore=["lm_head"]).eval()
    out = save_compressed_tensors(fq, tmp_path / "ckpt")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "float-quantized" and qc["ignore"] == ["lm_head"]
    group = qc["config_groups"]["group_0"]
    assert (group["weights"]["type"], group["weights"]["strategy"]) == ("float", "channel")
    assert (group["input_activations"]["strategy"], group["input_activations"]["dynamic"]) == ("token", True)
    from safetensors.torch import load_file

    stored = load_file(str(out / "model.safetensors"))
    assert stored["model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits, ref = loaded(ids).logits, fq(ids).logits
    for name, mod in _quantized(fq).items():
        got = loaded.get_submodule(name).weight
        torch.testing.assert_close(got.float(), mod.quantized_weight().float(), atol=0, rtol=0)
    # the inputs are quantized there too: without them the logits move by ~2e-2 here, far above this
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-4)


def _per_token_int8(model: nn.Module, step: float) -> list[Any]:
    """Hooks quantizing every quantized Linear's input per token, symmetric int8, scale amax / step."""
    def pre(_: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        x = args[0]
        s = x.abs().amax(-1, keepdim=True) / step
        return ((x / s).round().clamp(-128, 127) * s,)

    return [m.register_forward_pre_hook(pre) for m in _quantized(model).values()]


@pytest.mark.parametrize(("kind", "scheme"), [("llama", "W8A8"), ("qwen2", "W8A8"), ("llama", "w8_weight_only")])
def test_int8_is_written_int_quantized_and_transformers_runs_our_weights(kind: str, scheme: str, tmp_path: Path) -> None:
    """llm-compressor's W8A8 (what vLLM serves with int8 kernels: int8 weight codes with per-channel
    scales, dynamic per-token int8 inputs; here rounded by GPTQ) and W8A16. transformers' loader keeps
    exactly our weights; for the inputs, compressed-tensors' own fake quantization steps amax/127.5
    per token where ours (and vLLM's int8 kernel) step amax/127: its logits are our weights with that
    step, exactly."""
    import copy

    torch.manual_seed(0)
    cls, cfg = ((transformers.LlamaForCausalLM, transformers.LlamaConfig) if kind == "llama"
                else (transformers.Qwen2ForCausalLM, transformers.Qwen2Config))
    fp = cls(cfg(**SMALL)).eval()
    ids = torch.randint(0, SMALL["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(1))
    fq = compress.gptq(copy.deepcopy(fp), [ids], scheme=scheme, ignore=["lm_head"]).eval()
    out = save_compressed_tensors(fq, tmp_path / "ckpt")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "int-quantized" and qc["ignore"] == ["lm_head"]
    group = qc["config_groups"]["group_0"]
    assert (group["weights"]["type"], group["weights"]["strategy"]) == ("int", "channel")
    acts = group["input_activations"]
    assert (acts is None) == (scheme == "w8_weight_only")
    assert acts is None or (acts["strategy"], acts["dynamic"]) == ("token", True)
    from safetensors.torch import load_file

    assert load_file(str(out / "model.safetensors"))["model.layers.0.mlp.down_proj.weight"].dtype == torch.int8
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    for name, mod in _quantized(fq).items():
        got = loaded.get_submodule(name)
        torch.testing.assert_close(got.weight.float() * got.weight_scale.float(), mod.quantized_weight().float(),
                                   atol=0, rtol=0)
    def emulated(step: float | None) -> torch.Tensor:
        """Our weights, our input quantizers off, the inputs quantized per token with ``step``."""
        m = copy.deepcopy(fq)
        for lin in _quantized(m).values():
            if lin.input_quantizer is not None:
                lin.input_quantizer.enabled = False
        if step is not None:
            _per_token_int8(m, step)
        with torch.no_grad():
            return m(ids).logits

    step = None if acts is None else 127.5
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, emulated(step), atol=1e-5, rtol=1e-5)
        if acts is not None:  # and ours is the same arithmetic with the step of 127
            torch.testing.assert_close(fq(ids).logits, emulated(127.0), atol=1e-5, rtol=1e-5)


def test_a_smoothquant_factor_left_before_a_layer_is_refused_unless_only_folds_are_smoothed(tmp_path: Path) -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 9))
    fq = compress.quantize(transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).eval(), "W8A8", [ids],
                           ignore=["lm_head"], params=compress.QuantizeParams(quantize_ops=False, smoothquant=0.5))
    with pytest.raises(UnsupportedModelError, match=r"o_proj: SmoothQuant left a per-channel factor") as err:
        save_compressed_tensors(fq, tmp_path / "ckpt")  # GQA: o_proj's factor has no exact fold
    assert "\n" not in str(err.value) and "smoothquant_unfolded='skip'" in str(err.value)
    # smoothing only where the factor folds (llm-compressor's mappings): the norms and up_proj take it,
    # o_proj is left as it is, and the checkpoint is written
    torch.manual_seed(0)
    fp = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).eval()
    norm = fp.model.layers[0].input_layernorm.weight.detach().clone()
    sq = compress.quantize(fp, "W8A8", [ids], ignore=["lm_head"],
                           params=compress.QuantizeParams(quantize_ops=False, smoothquant=0.5, smoothquant_unfolded="skip"))
    assert not torch.equal(sq.model.layers[0].input_layernorm.weight, norm)
    assert all(m.input_quantizer.pre_quant_scale is None for m in _quantized(sq).values())
    assert (save_compressed_tensors(sq, tmp_path / "skip") / "model.safetensors").is_file()


def test_static_fp8_inputs_are_refused_in_one_line(tmp_path: Path) -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 9))
    fq = compress.quantize(transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).eval(), "FP8", [ids],
                           ignore=["lm_head"])
    with pytest.raises(UnsupportedModelError, match=r"dynamic per-token|a static activation quantizer is not written") as err:
        save_compressed_tensors(fq, tmp_path / "ckpt")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("how", ["rtn", "gptq", "fp8"])
def test_save_pretrained_of_a_quantized_model_writes_the_compressed_checkpoint(how: str, tmp_path: Path) -> None:
    """The save users reach for: ``model.save_pretrained(dir)`` after quantize/gptq writes the
    compressed-tensors checkpoint (not float weights plus quantizer tensors), which transformers reloads."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).eval()
    ids = torch.randint(0, SMALL["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(1))
    if how == "gptq":
        q = compress.gptq(model, [ids], scheme=_w4(32, symmetric=True), ignore=["lm_head"])
    else:
        q = compress.quantize(model, "FP8_DYNAMIC" if how == "fp8" else _w4(32, symmetric=True), [ids],
                              ignore=["lm_head"])
    q.save_pretrained(tmp_path / "ckpt")
    qc = json.loads((tmp_path / "ckpt" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    assert qc["format"] == ("float-quantized" if how == "fp8" else "pack-quantized")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", torch_dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, q(ids).logits, atol=1e-5, rtol=1e-4)
    import copy

    clone = copy.deepcopy(q)  # the save is bound to each copy, not to the model it was made from
    assert clone.save_pretrained.model is clone


def test_save_pretrained_of_a_scheme_without_checkpoint_form_says_what_to_use_and_strip_restores_it(
        tmp_path: Path) -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 9))
    q = compress.quantize(transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).eval(), "w8a8", [ids])
    with pytest.raises(UnsupportedModelError, match=r"save_pretrained: .* export this one with compress.export_onnx") as err:
        q.save_pretrained(tmp_path / "w8a8")
    assert "\n" not in str(err.value) and not (tmp_path / "w8a8" / "config.json").exists()
    from compress.quantization import strip

    strip(q)
    assert "save_pretrained" not in q.__dict__
