"""The recipe's ``export: {generation: true}``: the KV-cache ONNX of a decoder LLM (int4 MatMulNBits,
W8A8 or fp32 weights, chosen from the model) and its validation as greedy generation in ORT."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs the hf extra")


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # logits far apart, as a trained model's are: a random one's near-ties flip
        model.lm_head.weight.mul_(30)  # greedy tokens on rounding differences of 1e-6
    return model


def test_int4_generation_files_are_validated_against_pytorch_and_the_fp32_file(tmp_path: Path) -> None:
    from compress.export.llm.generation import export_generation, generation_weights, validate_generation
    from compress.export.specs import ExportSpec, ValidateSpec

    import compress

    fp = _llama()
    q = compress.quantize(copy.deepcopy(fp), "w4_weight_only_g128", ignore=["lm_head"])
    assert (generation_weights(q), generation_weights(fp)) == ("int4", "fp32")
    recs = export_generation(q, ExportSpec(generation=True), tmp_path, name="m", baseline=fp,
                             metadata={"recipe": "r1"})
    assert [(r.role, r.path.name, r.format, r.precision) for r in recs] == [
        ("final", "m.int4.onnx", "onnx-generation-int4", "int4"),
        ("baseline", "m.fp32.onnx", "onnx-generation-fp32", "fp32"),
    ]
    import onnx

    for r in recs:  # the files say what they are, as the single-pass exports do; no temp files are left
        props = {p.key: p.value for p in onnx.load(str(r.path), load_external_data=False).metadata_props}
        assert {k: props.get(k) for k in ("compress.role", "compress.precision", "compress.kind", "recipe")} == {
            "compress.role": r.role, "compress.precision": r.precision, "compress.kind": "generation", "recipe": "r1"}
        assert "compress.version" in props
    # beside them the final file's runtime files: ORT GenAI's config names it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "genai_config.json", "generation_config.json",
                                                          "m.fp32.onnx", "m.int4.onnx"]
    import json

    assert json.loads((tmp_path / "genai_config.json").read_text())["model"]["decoder"]["filename"] == "m.int4.onnx"
    # 2 layers x qkv/o/gate_up/down (packed), and the float lm_head written 8-bit (ExportSpec.lm_head);
    # no float MatMul left: the attention matmuls are inside each layer's GroupQueryAttention
    assert recs[0].integer_ops == {"MatMulNBits": 9}
    assert sum("MatMul" in n.split(":")[0] for n in recs[0].float_nodes) == 0
    prompts = torch.randint(0, 128, (3, 12), generator=torch.Generator().manual_seed(1)).numpy()
    vals = validate_generation(recs, ValidateSpec(runs=2, warmup=1, generate_tokens=6), prompts, reference=q,
                               baseline_reference=fp)
    final, base = vals
    assert final.role == "final" and base.role == "baseline"
    # accuracy_level 4 (int8 activations per block) and the 8-bit lm_head: ORT's greedy tokens still the
    # fake-quant model's on this model
    assert final.parity == {"top1_agreement": 1.0, "prompts_identical": 1.0}
    assert base.parity == {"top1_agreement": 1.0, "prompts_identical": 1.0}
    assert final.size_ratio is not None and final.size_ratio < 0.8  # int4 decoder weights, float embeddings
    g = final.generation
    assert g is not None and g["new_tokens"] == 6 and g["prompt_tokens"] == 12
    assert g["decode_ms_per_token"] > 0 and g["prefill_ms"] > 0
    assert final.speedup == {1: pytest.approx(g["decode_speedup"])}
    assert base.generation is not None and base.generation["decode_speedup"] == 1.0
    # a phase timed slower than the fp32 file is named in a note (a toy model's prefill usually is)
    slow = [k for k in ("prefill", "decode") if g[f"{k}_speedup"] < 1]
    notes = [n for n in final.notes if "measured slower than fp32" in n]
    assert len(notes) == (1 if slow else 0) and all(f"({k}:" in notes[0] or f", {k}:" in notes[0] for k in slow)
    assert not any("measured slower" in n for n in base.notes)


@pytest.mark.parametrize("preset,op", [("w8a8", "MatMulIntegerToFloat"), ("w8a8_dynamic", "MatMulInteger")])
def test_w8a8_generation_file_runs_integer_kernels(preset: str, op: str, tmp_path: Path) -> None:
    from compress.export.llm.generation import export_generation, generation_weights
    from compress.export.specs import ExportSpec

    import compress

    fp = _llama()
    calib = [torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    q = compress.quantize(copy.deepcopy(fp), {"preset": preset, "weights": {"reduce_range": True}}, calib,
                          ignore=["lm_head"], params=compress.QuantizeParams(quantize_ops=False))
    assert generation_weights(q) == "w8a8"
    (rec,) = export_generation(q, ExportSpec(generation=True), tmp_path, name="m")  # no baseline given
    assert rec.format == "onnx-generation-w8a8" and rec.precision == "int8"
    assert rec.integer_ops == {op: 14} and rec.integer_nodes == 14  # static: ORT's fusion; dynamic: as written


def test_recipe_logits_field_reaches_the_file(tmp_path: Path) -> None:
    """``export.logits: last`` writes the generation file with the last position's logits only; an
    unknown value is refused with the field named."""
    import onnx
    from compress.export.llm.generation import export_generation
    from compress.export.specs import ExportSpec

    import compress

    q = compress.quantize(_llama(), compress.QuantScheme(weights=compress.QuantSpec(bits=4, granularity="group",
                                                                                     group_size=32), inputs=None),
                          ignore=["lm_head"])
    (rec,) = export_generation(q, ExportSpec(generation=True, logits="last"), tmp_path, name="m")
    meta = {p.key: p.value for p in onnx.load(str(tmp_path / "m.int4.onnx")).metadata_props}
    assert meta["compress.logits"] == "last" and rec.precision == "int4"
    with pytest.raises(ValidationError, match="logits"):
        ExportSpec(generation=True, logits="first")  # type: ignore[arg-type]


def test_generation_refuses_formats_it_does_not_write() -> None:
    from compress.export.specs import ExportSpec

    with pytest.raises(ValidationError, match="fp16 and triton_repository do not apply"):
        ExportSpec(generation=True, fp16=True)


def test_the_summary_gives_generation_figures_for_generation_files() -> None:
    from compress.export.records import ValidationRecord

    from compress.cli import summary
    from compress.report import ModelFigures, Report

    r = Report(recipe={"name": "x"}, metric="perplexity", baseline=ModelFigures(accuracy=40.1),
               final=ModelFigures(accuracy=40.4))
    r.validation.append(ValidationRecord(
        runtime="onnxruntime", device="cpu", precision="int4", format="onnx-generation-int4",
        model_path=Path("m.int4.onnx"), role="final", parity={"top1_agreement": 0.96875, "prompts_identical": 0.75},
        latency_ms={1: 1.1}, speedup={1: 1.3}, size_bytes=1, threads=1,
        generation={"prompt_tokens": 96, "new_tokens": 32, "prefill_ms": 16.8, "decode_ms_per_token": 1.1,
                    "tokens_per_s": 909.1, "prefill_speedup": 1.25, "decode_speedup": 1.3}))
    line = summary(r, out=Path("run")).splitlines()[1]
    assert line == ("  onnxruntime final int4: prefill 16.8 ms (1.25x); decode 1.1 ms/token, 909 tokens/s (1.3x); "
                    "greedy tokens = PyTorch 0.9688")


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_sliding_window_layers_generate_as_transformers_does(family: str, tmp_path: Path) -> None:
    """A window of 4 slots on 12-token prompts: Mistral's on every layer, Qwen2's on the layers its
    ``max_window_layers`` marks; the file's greedy tokens are the PyTorch model's (full attention
    would differ), prefill and cached steps alike."""
    import transformers
    from compress.export.llm.generation import export_generation, torch_greedy, validate_generation
    from compress.export.llm.onnx import KVDecoder, sliding_windows
    from compress.export.specs import ExportSpec, ValidateSpec

    import compress

    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, sliding_window=4)
    if family == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**common)).eval()
    else:
        cfg = transformers.Qwen2Config(**common, use_sliding_window=True, max_window_layers=1)
        model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    assert sliding_windows(model.config) == ([4, 4] if family == "mistral" else [None, 4])
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(2))
    dec = KVDecoder(model).eval()
    with torch.no_grad():
        ours = dec(ids, torch.ones_like(ids), *dec.empty_past(2))[0]
        ref = model(input_ids=ids).logits
    assert torch.allclose(ours, ref, atol=1e-4)
    full = copy.deepcopy(model)
    full.config.sliding_window = None
    with torch.no_grad():
        assert not torch.allclose(KVDecoder(full)(ids, torch.ones_like(ids), *dec.empty_past(2))[0], ref, atol=1e-2)
    q = compress.quantize(copy.deepcopy(model), "w4_weight_only_g128", ignore=["lm_head"])
    recs = export_generation(q, ExportSpec(generation=True, baseline=False), tmp_path, name="m")
    (val,) = validate_generation(recs, ValidateSpec(runs=1, warmup=0, generate_tokens=8), ids.numpy(), reference=q,
                                 baseline_reference=None)
    assert val.parity == {"top1_agreement": 1.0, "prompts_identical": 1.0}
    assert torch_greedy(q, ids.numpy(), 8).shape == (2, 8)


@pytest.mark.parametrize("family", ["qwen3", "phi3"])
def test_qwen3_norms_and_phi3_fused_projections_generate_as_transformers_does(family: str, tmp_path: Path) -> None:
    """Qwen3's per-head q/k RMSNorms; Phi-3's fused qkv_proj and gate_up_proj with RoPE on half of
    each head (partial_rotary_factor 0.5): logits equal transformers', int4 greedy tokens the fake-quant model's."""
    import transformers
    from compress.export.llm.generation import export_generation, validate_generation
    from compress.export.llm.onnx import KVDecoder
    from compress.export.specs import ExportSpec, ValidateSpec

    import compress

    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, eos_token_id=2, pad_token_id=0)
    if family == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=16)).eval()
    else:
        model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**common, partial_rotary_factor=0.5)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(2))
    dec = KVDecoder(model).eval()
    with torch.no_grad():
        assert torch.allclose(dec(ids, torch.ones_like(ids), *dec.empty_past(2))[0], model(input_ids=ids).logits,
                              atol=1e-4)
    q = compress.quantize(copy.deepcopy(model), "w4_weight_only_g128", ignore=["lm_head"])
    # float compute and the lm_head as the model holds it: the graph's parts, not int8 activations, on trial
    # (the defaults' int8 activations flip this random-weight Qwen3's near-tied tokens)
    recs = export_generation(q, ExportSpec(generation=True, baseline=False, accuracy_level=0, lm_head="float"),
                             tmp_path, name="m")
    assert recs[0].integer_ops == {"MatMulNBits": 8}  # qkv, o, gate_up, down: Phi-3's own, Qwen3's packed
    (val,) = validate_generation(recs, ValidateSpec(runs=1, warmup=0, generate_tokens=8), ids.numpy(), reference=q,
                                 baseline_reference=None)
    assert val.parity == {"top1_agreement": 1.0, "prompts_identical": 1.0}


def test_gpt2_learned_positions_and_fused_c_attn_generate_as_transformers_does(tmp_path: Path) -> None:
    """GPT-2: absolute position table (indexed past the left padding, as generate does), LayerNorm,
    fused ``c_attn``, attention scaled by the inverse layer index. The decoder's logits equal
    transformers'; int4 and static W8A8 files generate the fake-quant model's tokens in integer ops."""
    import transformers
    from compress.export.llm.generation import export_generation, validate_generation
    from compress.export.llm.onnx import KVDecoder
    from compress.export.specs import ExportSpec, ValidateSpec
    from compress.quantization.api import QuantizeParams

    import compress

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                  scale_attn_by_inverse_layer_idx=True, bos_token_id=1, eos_token_id=2)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    dec = KVDecoder(model).eval()
    with torch.no_grad():
        ours = dec(ids, mask, *dec.empty_past(2))[0]
        ref = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    assert torch.allclose(ours[mask.bool()], ref[mask.bool()], atol=1e-4)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # tied to wte: embeddings and logits scale together
    calib = [torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    w8 = {"preset": "w8a8", "weights": {"reduce_range": True}}
    # int4: and the float lm_head 8-bit (ExportSpec.lm_head); W8A8 leaves it as the model holds it
    for scheme, want in (("w4_weight_only_g128", {"MatMulNBits": 9}), (w8, {"MatMulIntegerToFloat": 8})):
        q = compress.quantize(copy.deepcopy(model), scheme, calib, ignore=["lm_head"],  # type: ignore[arg-type]
                              params=QuantizeParams(quantize_ops=False))
        recs = export_generation(q, ExportSpec(generation=True, baseline=False), tmp_path / str(want), name="m")
        assert recs[0].integer_ops == want
        (val,) = validate_generation(recs, ValidateSpec(runs=1, warmup=0, generate_tokens=8), ids.numpy(),
                                     reference=q, baseline_reference=None)
        assert val.parity == {"top1_agreement": 1.0, "prompts_identical": 1.0}, scheme


def test_a_bf16_model_is_validated_against_what_its_file_computes(tmp_path: Path) -> None:
    """A bf16 checkpoint (transformers loads it as bf16) exports float32 generation files; the greedy
    tokens are compared with the model widened to float32, which the files compute, not with bf16
    arithmetic (static W8A8 here: bf16 rounding moves activation codes, and 5% of the tokens with
    them); the model stays bf16."""
    from compress.export.llm.generation import export_generation, validate_generation
    from compress.export.specs import ExportSpec, ValidateSpec

    import compress

    fp = _llama().to(torch.bfloat16)
    calib = [{"input_ids": torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(i))} for i in range(2)]
    q = compress.quantize(copy.deepcopy(fp), {"preset": "w8a8", "weights": {"reduce_range": True}}, calib,
                          ignore=["lm_head"], params=compress.QuantizeParams(quantize_ops=False))
    recs = export_generation(q, ExportSpec(generation=True), tmp_path, name="m", baseline=fp)
    prompts = torch.randint(0, 128, (8, 12), generator=torch.Generator().manual_seed(1)).numpy()
    final, base = validate_generation(recs, ValidateSpec(runs=1, warmup=0, generate_tokens=12), prompts, reference=q,
                                      baseline_reference=fp)
    assert final.parity["top1_agreement"] == 1.0 and base.parity["top1_agreement"] == 1.0
    assert q.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16 and fp.lm_head.weight.dtype == torch.bfloat16
