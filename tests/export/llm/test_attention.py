"""The generation export's fused attention (RotaryEmbedding + GroupQueryAttention, export/llm/attention.py)
computes what the decomposed graph computes over the whole input space the file accepts: left-padded
batches, prefill, multi-token steps on a past, decode steps, sliding windows, partial rotary, q/k
norms, learned positions, explicit position_ids; one GroupQueryAttention per layer and no KV repeat."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch

transformers = pytest.importorskip("transformers")

from compress.export.llm import attention as llm_attention  # noqa: E402
from compress.export.llm.onnx import KVDecoder, decoder_steps, export_llm_onnx, generate_ort, positions  # noqa: E402

import compress  # noqa: E402
from compress.core.errors import ExportError  # noqa: E402

pytestmark = pytest.mark.skipif(not llm_attention.fused_attention_supported(),
                                reason="onnxruntime's GroupQueryAttention lacks attention_bias/query_seqlens")

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)


def _model(family: str) -> Any:
    torch.manual_seed(0)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON))
    elif family == "qwen2-window":  # a window of 4 slots on the second layer only
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON, sliding_window=4, use_sliding_window=True,
                                                                       max_window_layers=1))
    elif family == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**COMMON, head_dim=16))
    elif family == "phi3":
        model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**COMMON, partial_rotary_factor=0.5))
    else:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4,
                                                                     n_positions=64))
    with torch.no_grad():  # sharper logits: a wrong graph moves the greedy tokens
        model.lm_head.weight.mul_(30)
    return model.eval()


def _steps(dec: KVDecoder, run: Any) -> torch.Tensor:
    """Logits at the real positions of: a left-padded prefill (9 tokens, the second row 4 of them
    padding), a 3-token step on that past (batch 2), then two single-token steps."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 128, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    logits, past = run(ids, mask, dec.empty_past(2))
    rows = [logits[mask.bool()]]
    for new in (3, 1, 1):
        tok = torch.randint(1, 128, (2, new), generator=g)
        mask = torch.cat([mask, torch.ones_like(tok)], dim=1)
        logits, past = run(tok, mask, past)
        rows.append(logits.reshape(-1, logits.shape[-1]))
    return torch.cat(rows)


def _ort(path: Path, dec: KVDecoder) -> Any:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]

    def run(ids: torch.Tensor, mask: torch.Tensor, past: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        out = sess.run(None, dict(zip(names, [t.numpy() for t in dec.feed(ids, mask, past)])))
        return torch.from_numpy(out[0]), [torch.from_numpy(o) for o in out[1:]]
    return run


@pytest.mark.parametrize(("family", "position_ids"), [("llama", False), ("qwen2-window", True), ("qwen3", False),
                                                      ("phi3", False), ("gpt2", False)])
def test_fused_file_computes_the_decomposed_one(family: str, position_ids: bool, tmp_path: Path) -> None:
    model = _model(family)
    files = {form: export_llm_onnx(model, tmp_path / f"{form}.onnx", weights="fp32", position_ids=position_ids,
                                   attention=form) for form in ("fused", "decomposed")}
    ops = collections.Counter(n.op_type for n in onnx.load(str(files["fused"])).graph.node)
    assert ops["GroupQueryAttention"] == 2 and ops["Softmax"] == 0
    # RoPE inside GroupQueryAttention (do_rotary) unless positions are fed (position_ids) or the rotary
    # covers part of each head (Phi-3's partial_rotary_factor): then RotaryEmbedding on q and k
    in_op = family in ("llama", "qwen3")
    assert ops["RotaryEmbedding"] == (0 if family == "gpt2" or in_op else 4)
    gqa = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
           for n in onnx.load(str(files["fused"])).graph.node if n.op_type == "GroupQueryAttention"]
    assert [a["do_rotary"] for a in gqa] == [int(in_op)] * 2
    ref = KVDecoder(model).eval()  # the decomposed module, transformers' own numerics checked in test_generation
    ref.explicit_positions = position_ids
    want = _steps(ref, decoder_steps(ref))
    fused = _steps(ref, _ort(files["fused"], ref))
    decomposed = _steps(ref, _ort(files["decomposed"], ref))
    torch.testing.assert_close(decomposed, want, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(fused, want, atol=2e-4, rtol=1e-4)
    # the module traced for the fused file (its ops' torch references) is the decomposed module
    traced = KVDecoder(model, attention="fused").eval()
    traced.explicit_positions = position_ids
    torch.testing.assert_close(_steps(traced, decoder_steps(traced)), want, atol=1e-5, rtol=1e-5)
    ids = torch.randint(1, 128, (2, 7), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    assert torch.equal(generate_ort(files["fused"], ids, attention_mask=mask, max_new_tokens=8),
                       generate_ort(files["decomposed"], ids, attention_mask=mask, max_new_tokens=8))


def test_int4_llama_ops_one_attention_per_layer_no_kv_repeat(tmp_path: Path) -> None:
    model = compress.quantize(_model("llama"), "w4_weight_only_g128", ignore=["lm_head"])
    # auto: fused with this onnxruntime; float compute and a float lm_head: transformers' tokens
    path = export_llm_onnx(model, tmp_path / "m.onnx", accuracy_level=0, lm_head="float")
    proto = onnx.load(str(path))
    ops = collections.Counter(n.op_type for n in proto.graph.node)
    # q/k/v packed into one MatMulNBits whose output is the op's packed query (key/value absent), RoPE in
    # the op: no RotaryEmbedding, and the only Splits are the gate/up ones
    assert ops["GroupQueryAttention"] == 2 and ops["RotaryEmbedding"] == 0 and ops["MatMulNBits"] == 8
    assert ops["Split"] == 2
    producer = {o: n.op_type for n in proto.graph.node for o in n.output}
    for node in (n for n in proto.graph.node if n.op_type == "GroupQueryAttention"):
        assert producer[node.input[0]] == "MatMulNBits" and list(node.input[1:3]) == ["", ""]
    # the only Expand is the padding bias, built once per step; no Tile, no per-layer mask or KV repeat
    assert ops["Expand"] == 1 and ops["Tile"] == 0 and ops["Softmax"] == 0 and ops["Concat"] <= 2
    # every residual add with the RMSNorm after it (layer 1's two, layer 2's two with the final norm's)
    assert ops["SkipSimplifiedLayerNormalization"] == 4 and ops["Add"] == 1  # the first RMSNorm's + eps
    gqa = next(n for n in proto.graph.node if n.op_type == "GroupQueryAttention")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in gqa.attribute}
    assert attrs["num_heads"] == 4 and attrs["kv_num_heads"] == 2 and attrs["local_window_size"] == -1
    assert attrs["scale"] == pytest.approx(16 ** -0.5)
    assert {p.key: p.value for p in proto.metadata_props}["compress.attention"] == "fused"
    ids = torch.randint(1, 128, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(generate_ort(path, ids, max_new_tokens=10), want)


def test_w8a8_fused_file_generates_the_decomposed_files_tokens(tmp_path: Path) -> None:
    # W8A8 (static per-tensor activations, integer MatMuls) with the attention fused: the integer ops are
    # the same, the float attention between them the same computation, so are the greedy tokens
    model = _model("qwen2-window")
    calib = [torch.randint(1, 128, (4, 16), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    q = compress.quantize(model, {"preset": "w8a8", "weights": {"reduce_range": True}}, calib, ignore=["lm_head"],
                          params=compress.QuantizeParams(quantize_ops=False))
    files = [export_llm_onnx(q, tmp_path / f"{form}.onnx", weights="w8a8", attention=form)
             for form in ("fused", "decomposed")]
    assert sum(n.op_type == "GroupQueryAttention" for n in onnx.load(str(files[0])).graph.node) == 2
    ids = torch.randint(1, 128, (2, 9), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    got, want = (generate_ort(f, ids, attention_mask=mask, max_new_tokens=8) for f in files)
    assert torch.equal(got, want)


def test_window_attribute_is_the_layers_sliding_window(tmp_path: Path) -> None:
    path = export_llm_onnx(_model("qwen2-window"), tmp_path / "m.onnx", weights="fp32", check=False)
    windows = [onnx.helper.get_attribute_value(a) for n in onnx.load(str(path)).graph.node
               if n.op_type == "GroupQueryAttention" for a in n.attribute if a.name == "local_window_size"]
    assert windows == [-1, 4]


def test_decomposed_where_onnxruntime_lacks_the_fused_inputs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("compress.export.llm.onnx.fused_attention_supported", lambda: False)
    model = _model("llama")
    path = export_llm_onnx(model, tmp_path / "m.onnx", weights="fp32", check=False)
    proto = onnx.load(str(path))
    assert not any(n.op_type == "GroupQueryAttention" for n in proto.graph.node)
    assert {p.key: p.value for p in proto.metadata_props}["compress.attention"] == "decomposed"
    with pytest.raises(ExportError, match=r"attention='fused'.*use 'decomposed'"):
        export_llm_onnx(model, tmp_path / "f.onnx", weights="fp32", attention="fused")
    with pytest.raises(ExportError, match="attention must be"):
        export_llm_onnx(model, tmp_path / "g.onnx", weights="fp32", attention="flash")  # type: ignore[arg-type]


@pytest.mark.parametrize("family", ["llama", "qwen2-window"])
def test_int4_packed_qkv_with_rotary_in_the_op_computes_the_model(family: str, tmp_path: Path) -> None:
    # the packed query and the op's own RoPE at KV slots (a left-padded row's positions shifted by its
    # padding) against the fake-quant model's decomposed forward at cumsum positions: left padding,
    # a multi-token step on a past, decode steps, a sliding-window layer
    model = compress.quantize(_model(family), "w4_weight_only_g128", ignore=["lm_head"])
    path = export_llm_onnx(model, tmp_path / "m.onnx", accuracy_level=0, lm_head="float")  # float compute
    assert sum(n.op_type == "RotaryEmbedding" for n in onnx.load(str(path)).graph.node) == 0
    ref = KVDecoder(model).eval()
    torch.testing.assert_close(_steps(ref, _ort(path, ref)), _steps(ref, decoder_steps(ref)), atol=2e-4, rtol=1e-4)


def test_rotary_cache_covers_the_models_positions() -> None:
    # positions up to max_position_embeddings - 1 read the same cos/sin the decomposed form computes
    dec = KVDecoder(_model("llama"), attention="fused")
    assert dec.cos_cache.shape == (64, 8)
    pos = torch.arange(64)[None]
    freqs = pos[..., None].float() * dec.inv_freq
    assert torch.equal(dec.cos_cache[pos], freqs.cos() * dec.rope_scaling)
    assert torch.equal(positions(torch.ones(1, 64, dtype=torch.long), 1), torch.tensor([[63]]))
    np.testing.assert_array_equal(dec.sin_cache[pos].numpy(), (freqs.sin() * dec.rope_scaling).numpy())


@pytest.mark.slow  # three exports of the 135M model, about three minutes on an idle 2-core CPU
def test_real_smollm2_int4_fused_file_generates_the_decomposed_files_tokens(smollm2: Any, tmp_path: Path) -> None:
    # SmolLM2-135M (30 layers, GQA 9/3, head_dim 64, tied embedding) at int4 g32: the fused file holds one
    # GroupQueryAttention per layer and 4 MatMulNBits per layer, and generates what the decomposed file
    # does on held-out-style prompts, a left-padded batch included
    import os

    model_dir, tok = smollm2
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    q = compress.quantize(model, compress.QuantScheme(
        weights=compress.QuantSpec(bits=4, granularity="group", group_size=32), inputs=None), ignore=["lm_head"])
    # the defaults (accuracy_level 4, lm_head 8-bit) pass the export's check on the real model; q/k/v
    # packed into the op's query, RoPE in the op: no RotaryEmbedding, Splits only for gate/up
    default = export_llm_onnx(q, tmp_path / "default.onnx")
    ops = collections.Counter(n.op_type for n in onnx.load(str(default)).graph.node)
    assert (ops["GroupQueryAttention"], ops["RotaryEmbedding"], ops["MatMulNBits"], ops["Split"]) == (30, 0, 121, 30)
    # float compute: the fused form's tokens are the decomposed form's
    fused = export_llm_onnx(q, tmp_path / "fused.onnx", attention="fused", accuracy_level=0, check=False)
    decomposed = export_llm_onnx(q, tmp_path / "decomposed.onnx", attention="decomposed", accuracy_level=0,
                                 check=False)
    text = Path(os.__file__).read_text()
    ids = torch.tensor([tok(text[1000:1400])["input_ids"][:24], tok(text[5000:5400])["input_ids"][:24]])
    mask = torch.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0
    got = generate_ort(fused, ids, attention_mask=mask, max_new_tokens=16)
    assert torch.equal(got, generate_ort(decomposed, ids, attention_mask=mask, max_new_tokens=16))


def test_recipe_export_field_chooses_the_attention(tmp_path: Path) -> None:
    import pydantic
    from compress.export.llm.generation import export_generation
    from compress.export.specs import ExportSpec

    q = compress.quantize(_model("llama"), "w4_weight_only_g128", ignore=["lm_head"])
    recs = export_generation(q, ExportSpec(generation=True, baseline=False, attention="decomposed"), tmp_path, name="m")
    proto = onnx.load(str(recs[0].path))
    assert {p.key: p.value for p in proto.metadata_props}["compress.attention"] == "decomposed"
    assert not any(n.op_type == "GroupQueryAttention" for n in proto.graph.node)
    with pytest.raises(pydantic.ValidationError, match="attention"):
        ExportSpec(generation=True, attention="flash")  # type: ignore[arg-type]
