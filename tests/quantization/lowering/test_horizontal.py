"""Horizontal fusion: the int8 Linears reading one tensor run one GEMM over their concatenated weights
(quantization/lowering/horizontal.py), bit-identical to running each alone."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
pytest.importorskip("triton")


def _decoder(family: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    import transformers

    torch.manual_seed(0)
    common = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "vocab_size": 96, "max_position_embeddings": 64}
    if family == "llama":  # GQA: k/v narrower than q
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, num_key_value_heads=2))
    elif family == "qwen2":  # q/k/v with biases
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, num_key_value_heads=2))
    else:
        cfg = transformers.BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, vocab_size=96, max_position_embeddings=64)
        model = transformers.BertModel(cfg, add_pooling_layer=False)
    return model.eval(), {"input_ids": torch.randint(0, 96, (2, 8))}


def _converted(family: str, horizontal: bool) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    from compress.quantization.lowering.convert import convert_with_report

    import compress

    model, batch = _decoder(family)
    fq = compress.quantize(copy.deepcopy(model), "W8A8", [batch]).eval()
    conv, _ = convert_with_report(fq, horizontal=horizontal)
    return conv, batch


def _out(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    out: Any = model(**batch)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("family", ["llama", "qwen2", "bert"])
def test_readers_of_one_tensor_run_one_gemm_with_the_same_bits(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from compress.quantization.lowering.int8 import Int8Linear
    from compress.quantization.lowering.kernels import load

    fused, batch = _converted(family, horizontal=True)
    plain, _ = _converted(family, horizontal=False)
    gemm = load("gemm")
    widths: list[int] = []
    real = gemm.int8_gemm
    monkeypatch.setattr(gemm, "int8_gemm", lambda a, b, **k: widths.append(b.shape[0]) or real(a, b, **k))
    with torch.no_grad():
        ref = _out(plain, batch)
        unfused_calls = len(widths)
        first = _out(fused, batch)  # the first call runs the layers one by one and learns who reads what
        assert len(widths) == 2 * unfused_calls
        widths.clear()
        second = _out(fused, batch)
    assert torch.equal(first, ref) and torch.equal(second, ref)
    # per layer: q/k/v one GEMM, o, the MLP's up (and gate) one GEMM, down (BERT: qkv, o, up, down)
    per_layer = 4
    lm_head = 1 if family != "bert" else 0
    assert len(widths) == 2 * per_layer + lm_head, widths
    layers: list[Any] = [m for m in fused.modules() if isinstance(m, Int8Linear)]
    groups = {id(m.horizontal): m.horizontal for m in layers if m.horizontal is not None}
    assert len(groups) == (4 if family != "bert" else 2)  # BERT's FFN has one Linear per input
    for g in groups.values():  # the members' weights are views of the concatenated one, which only they hold
        full = g.tensors()
        assert full is not None
        for m in g.members:
            a, _ = g.span(m)
            assert m.weight_q._base is full["weight_q"] and m.weight_q.data_ptr() == full["weight_q"][a:].data_ptr()
        assert g._out is None  # every member took its slice: the group keeps no product


def test_a_member_given_another_tensor_computes_alone() -> None:
    fused, batch = _converted("llama", horizontal=True)
    with torch.no_grad():
        _out(fused, batch)
        attn = fused.model.layers[0].self_attn  # type: ignore[attr-defined]
        assert attn.q_proj.horizontal is attn.k_proj.horizontal is not None
        x = torch.randn(3, 64)
        q_then_k = attn.q_proj(x), attn.k_proj(x)
        k_alone = attn.k_proj(x.clone())  # not the tensor q_proj computed for: its own slice of the weight
        x.mul_(2)  # in place: the group's product is stale, the layer recomputes
        k_changed = attn.k_proj(x)
    assert torch.equal(q_then_k[1], k_alone)
    assert not torch.equal(k_changed, k_alone)
    with torch.inference_mode():  # no version counters: every layer computes alone
        y = attn.k_proj(torch.randn(3, 64))
    assert y.shape == (3, 32) and y.is_contiguous()
    twin = copy.deepcopy(fused)  # its groups, members and weight views are its own
    t_attn = twin.model.layers[0].self_attn  # type: ignore[attr-defined]
    g = t_attn.k_proj.horizontal
    assert g is not attn.k_proj.horizontal and g.members[1] is t_attn.k_proj
    with torch.no_grad():
        assert torch.equal(_out(twin, batch), _out(fused, batch))
        full = g.tensors()
        assert full is not None and t_attn.k_proj.weight_q._base is full["weight_q"]
        # moved or cast after the merge (.to gives every float buffer a new tensor): re-concatenated
        ref = _out(twin, batch)
        twin.to(torch.float64).to(torch.float32)  # int8 weights stay, float scales are new tensors
        assert g.tensors() is None
        assert torch.equal(_out(twin, batch), ref)
        assert g.tensors() is not None
        # one member's weight replaced (not the first): the group sees it, the product follows it
        t_attn.k_proj.weight_q = torch.zeros_like(t_attn.k_proj.weight_q)
        assert g.tensors() is None
        x = torch.randn(3, 64)
        q_out, k_out = t_attn.q_proj(x), t_attn.k_proj(x)
        assert torch.equal(k_out, torch.zeros_like(k_out)) and not torch.equal(q_out, torch.zeros_like(q_out))


def test_one_eager_call_forms_the_groups_and_graph_capture_freezes_them(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from compress.quantization.lowering import horizontal

    fused, batch = _converted("llama", horizontal=True)
    with torch.no_grad():
        ref = _out(fused, batch)  # the readers join their group as they read: one call is enough
    attn = fused.model.layers[0].self_attn  # type: ignore[attr-defined]
    assert attn.q_proj.horizontal is attn.v_proj.horizontal is not None
    # a model first called under CUDA-graph capture: its trackers merge nothing after (a captured graph
    # keeps reading the tensors it captured, which a merge would free)
    frozen, _ = _converted("llama", horizontal=True)
    monkeypatch.setattr(horizontal, "_capturing", lambda: True)
    with torch.no_grad():
        _out(frozen, batch)
    monkeypatch.setattr(horizontal, "_capturing", lambda: False)
    with torch.no_grad():
        _out(frozen, batch)
        assert torch.equal(_out(frozen, batch), ref)
    assert all(getattr(m, "horizontal", None) is None for m in frozen.modules())
    # torch.save after calls: caches and weak references are not saved, the groups are
    buf = io.BytesIO()
    torch.save(fused, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    with torch.no_grad():
        assert torch.equal(_out(loaded, batch), ref)
