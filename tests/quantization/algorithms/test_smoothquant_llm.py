"""SmoothQuant on decoder LLMs: 1/s folded into input_layernorm (q/k/v), post_attention_layernorm
(gate/up) and up_proj (down_proj), found and proved in the running model; calibration with a KV
cache; a smoothed o_proj quantized once."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from compress.quantization import QuantizeParams, input_quantizer, quantize, set_quantizers, strip  # noqa: E402
from compress.quantization.algorithms.smoothquant import find_producers  # noqa: E402
from compress.quantization.placement.mode import graph_of  # noqa: E402

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "vocab_size": 256}


def _llm(kind: str = "llama", kv_heads: int = 2, outliers: bool = True) -> Any:
    torch.manual_seed(0)
    if kind == "llama":
        m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, num_key_value_heads=kv_heads))
    else:
        m = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL, num_key_value_heads=kv_heads))
    if outliers:  # a few large channels in the norms' outputs, as trained LLMs have
        with torch.no_grad():
            for layer in m.model.layers:
                layer.input_layernorm.weight[:3] = 60.0
                layer.post_attention_layernorm.weight[5:7] = 25.0
    return m.eval()


def _data(n: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, SMALL["vocab_size"], (2, 16), generator=g) for _ in range(n)]


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - out).pow(2).mean()))


def _output_of(model: nn.Module, name: str, x: torch.Tensor) -> torch.Tensor:
    out: list[torch.Tensor] = []
    h = model.get_submodule(name).register_forward_hook(lambda m, a, o: out.append(o))
    try:
        model(input_ids=x)
    finally:
        h.remove()
    return out[0]


@pytest.mark.parametrize(("kind", "kv_heads", "o_proj", "dtype"), [
    ("llama", 2, None, torch.float32), ("llama", 4, "self_attn.v_proj", torch.float32), ("qwen2", 2, None, torch.float32),
    ("llama", 4, "self_attn.v_proj", torch.bfloat16),  # proved with power-of-two factors: exact in bf16 too
], ids=["llama-gqa", "llama-mha", "qwen2", "llama-mha-bf16"])
def test_fold_targets_are_found_in_the_running_model(kind: str, kv_heads: int, o_proj: str | None,
                                                     dtype: torch.dtype) -> None:
    m = _llm(kind, kv_heads).to(dtype)
    groups = [[f"model.layers.0.self_attn.{p}_proj" for p in "qkv"], ["model.layers.0.self_attn.o_proj"],
              ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"], ["model.layers.0.mlp.down_proj"]]
    found = find_producers(m, groups, (), {"input_ids": _data(1)[0]})
    got = {g[0].removeprefix("model.layers.0."): (p.name.removeprefix("model.layers.0.") if p else None)
           for g in groups for p in [found[g[0]]]}
    # v_proj -> o_proj only without GQA (with it, o_proj's channels are not v's)
    assert got == {"self_attn.q_proj": "input_layernorm", "self_attn.o_proj": o_proj,
                   "mlp.gate_proj": "post_attention_layernorm", "mlp.down_proj": "mlp.up_proj"}


def test_fold_trials_rerun_one_layer_not_the_model() -> None:
    """Each candidate is proved on the decoder layer holding it, rerun on the inputs (and KV cache)
    it had: the whole model runs once, where a trial per candidate made SmoothQuant on a 30-layer
    model run it 150 times. A layer the model calls twice (shared weights) is proved on the module around it."""
    m = _llm("llama", 4)
    groups = [[f"model.layers.{i}.self_attn.{p}_proj" for p in "qkv"] for i in range(2)] + [
        [f"model.layers.{i}.mlp.down_proj"] for i in range(2)]
    calls: list[int] = []
    h = m.register_forward_pre_hook(lambda mod, a: calls.append(1))
    found = find_producers(m, groups, (), {"input_ids": _data(1)[0]})
    h.remove()
    assert len(calls) == 1
    assert [found[g[0]].name if found[g[0]] else None for g in groups] == [  # type: ignore[union-attr]
        "model.layers.0.input_layernorm", "model.layers.1.input_layernorm",
        "model.layers.0.mlp.up_proj", "model.layers.1.mlp.up_proj"]

    shared = _llm("llama", 4)
    shared.model.layers[1] = shared.model.layers[0]  # one layer applied twice: its second call sees other inputs
    calls.clear()
    h = shared.model.register_forward_pre_hook(lambda mod, a: calls.append(1))
    found = find_producers(shared, groups[:1] + groups[2:3], (), {"input_ids": _data(1)[0]})
    h.remove()
    # the reference, the decoder stack's own rerun as its reference, then a trial per candidate
    # (input_layernorm; gate_proj refused, up_proj) on the whole stack
    assert len(calls) == 1 + 1 + 3
    assert found["model.layers.0.self_attn.q_proj"].name == "model.layers.0.input_layernorm"  # type: ignore[union-attr]


def test_one_fold_trial_per_layer_structure(monkeypatch: pytest.MonkeyPatch) -> None:
    """Layers of one structure share their trial's outcome (3 layers, 4 groups each: 4 trials, not
    12), with the producers a trial per layer finds; a layer of another structure is tried anew."""
    import compress.quantization.algorithms.smoothquant as sq

    def run(m: nn.Module, layers: int) -> tuple[dict[str, Any], int]:
        groups = [g for i in range(layers) for g in (
            [f"model.layers.{i}.self_attn.{p}_proj" for p in "qkv"], [f"model.layers.{i}.self_attn.o_proj"],
            [f"model.layers.{i}.mlp.gate_proj", f"model.layers.{i}.mlp.up_proj"], [f"model.layers.{i}.mlp.down_proj"])]
        trials: list[str] = []
        inner = sq._fold_is_exact
        monkeypatch.setattr(sq, "_fold_is_exact", lambda root, c, *a, **kw: trials.append(c) or inner(root, c, *a, **kw))
        found = find_producers(m, groups, (), {"input_ids": _data(1)[0]})
        monkeypatch.setattr(sq, "_fold_is_exact", inner)
        return {g[0]: (found[g[0]].name if found[g[0]] else None) for g in groups}, len(trials)

    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**SMALL, "num_hidden_layers": 3}, num_key_value_heads=4)).eval()
    shared, n_shared = run(m, 3)
    monkeypatch.setattr(sq, "_structure", lambda names, mods, off: (tuple(names), off))  # a trial per layer
    each, n_each = run(m, 3)
    assert shared == each and n_shared * 3 == n_each
    assert shared["model.layers.2.self_attn.o_proj"] == "model.layers.2.self_attn.v_proj"
    monkeypatch.undo()
    # layer 1's MLP another class: its groups are tried again, the other layers' are not
    m.model.layers[1].mlp = transformers.models.qwen2.modeling_qwen2.Qwen2MLP(m.config)
    _, n_mixed = run(m, 3)
    assert n_mixed == n_shared + 3  # the norm into gate/up, then gate and up (refused, found) into down


def test_gemma_norms_take_the_factor_as_one_plus_weight() -> None:
    """Gemma's RMSNorm multiplies by 1 + weight: the fold into it is proved in that form, and the
    smoothed model keeps its float function with no Mul left before q/k/v or gate/up."""
    torch.manual_seed(0)
    m = transformers.GemmaForCausalLM(transformers.GemmaConfig(**SMALL, num_key_value_heads=2, head_dim=16)).eval()
    groups = [[f"model.layers.0.self_attn.{p}_proj" for p in "qkv"], ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]]
    found = find_producers(m, groups, (), {"input_ids": _data(1)[0]})
    assert [(p.name, p.offset) for g in groups if (p := found[g[0]]) is not None] == [
        ("model.layers.0.input_layernorm", True), ("model.layers.0.post_attention_layernorm", True)]
    x = _data(1)[0]
    with torch.no_grad():
        ref = m(input_ids=x).logits
    q = quantize(copy.deepcopy(m), "w8a8", _data(), params=QuantizeParams(smoothquant=0.5, quantize_ops=False),
                 ignore=["lm_head"])
    assert input_quantizer(q, "model.layers.0.self_attn.q_proj").pre_quant_scale is None  # folded, not a Mul
    set_quantizers(q, enabled=False)
    with torch.no_grad():
        assert _sqnr(ref, q(input_ids=x).logits) > 60


def test_smoothquant_folds_into_the_decoder_and_keeps_its_float_function() -> None:
    m = _llm()
    x = (_data(1)[0] + 3) % SMALL["vocab_size"]
    with torch.no_grad():
        ref = m(input_ids=x).logits
        plain = quantize(copy.deepcopy(m), "w8a8", _data(), ignore=["lm_head"], params=QuantizeParams(quantize_ops=False))
        sq = quantize(copy.deepcopy(m), "w8a8", _data(), ignore=["lm_head"],
                      params=QuantizeParams(quantize_ops=False, smoothquant=0.5))
        # q_proj of the first layer reads the outlier channels (and no upstream quantization error)
        q_ref, q_plain, q_sq = (_output_of(mod, "model.layers.0.self_attn.q_proj", x) for mod in (m, plain, sq))
        assert _sqnr(q_ref, q_sq) > _sqnr(q_ref, q_plain) + 2.0
        layer = sq.model.layers[0]
        # folded: the norms and up_proj carry 1/s, the quantizers of q/k/v, gate/up and down no Mul
        assert not torch.equal(layer.input_layernorm.weight, m.model.layers[0].input_layernorm.weight)
        assert not torch.equal(layer.mlp.up_proj.weight, m.model.layers[0].mlp.up_proj.weight)
        for name in ("self_attn.q_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.down_proj"):
            iq = input_quantizer(sq, f"model.layers.0.{name}")
            assert iq is not None and iq.pre_quant_scale is None, name
        # up_proj's rows were divided after its weight scales were fitted: they are fitted again
        up = layer.mlp.up_proj
        fresh = copy.deepcopy(up.weight_quantizer)
        fresh.observe(up.weight)
        fresh.compute_qparams()
        torch.testing.assert_close(up.weight_quantizer.scale, fresh.scale)
        o = input_quantizer(sq, "model.layers.0.self_attn.o_proj")  # GQA: no exact fold, a Mul
        assert o is not None and o.pre_quant_scale is not None
        # o_proj's input is quantized once: its reshapes no longer quantize the unsmoothed tensor first
        entries = graph_of(sq).placement.entries  # type: ignore[union-attr]
        assert not [k for k in entries if ":reshape#" in k]
        set_quantizers(sq, enabled=False)
        torch.testing.assert_close(sq(input_ids=x).logits, ref, atol=1e-4, rtol=1e-4)
        strip(sq)
        torch.testing.assert_close(sq(input_ids=x).logits, ref, atol=1e-4, rtol=1e-4)


def test_static_w8a8_calibrates_with_the_kv_cache_on() -> None:
    # transformers concatenates an empty past on the first step: no quantizer may sit on it
    m = _llm(outliers=False)
    assert m.config.use_cache
    q = quantize(copy.deepcopy(m), "w8a8", _data(), ignore=["lm_head"], params=QuantizeParams(smoothquant="auto"))
    x = _data(1)[0]
    with torch.no_grad():
        assert _sqnr(m(input_ids=x).logits, q(input_ids=x).logits) > 15.0
