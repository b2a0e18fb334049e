"""SmoothQuant in bounded memory: its statistics pass runs the calibration batches as micro-batches
(peak memory of a few samples, not of a batch) with the statistics and the smoothed model of whole
batches (maxima over tokens, and a reservoir of rows filled in the same order); one alpha-search
sample per group of layers reading one tensor; fold proofs without a KV cache, holding the inputs of
one layer per build."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import compress.quantization.algorithms.smoothquant as sq  # noqa: E402
from compress.quantization import QuantizeParams, quantize  # noqa: E402

from compress.core.batching import as_forward_loop, micro_batches, split_inputs  # noqa: E402
from compress.core.errors import CalibrationError  # noqa: E402
from compress.core.modifier import State  # noqa: E402

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "vocab_size": 256, "num_key_value_heads": 2}


def _llm(kind: str) -> Any:
    torch.manual_seed(0)
    if kind == "llama":
        m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))
    else:
        m = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL))
    with torch.no_grad():  # a few large channels in the norms' outputs, as trained LLMs have
        for layer in m.model.layers:
            layer.input_layernorm.weight[:3] = 60.0
            layer.post_attention_layernorm.weight[5:7] = 25.0
    return m.eval()


def _data() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, SMALL["vocab_size"], (4, 16), generator=g) for _ in range(3)]


def _params(micro: int | None) -> QuantizeParams:
    return QuantizeParams(quantize_ops=False, smoothquant="auto", smoothquant_micro_batch=micro)


@pytest.mark.parametrize("micro", [1, 3])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_the_statistics_pass_never_runs_more_than_the_micro_batch(kind: str, micro: int) -> None:
    m = _llm(kind)
    sizes: list[int] = []
    h = m.model.layers[0].register_forward_pre_hook(
        lambda mod, a, kw: sizes.append((a[0] if a else kw["hidden_states"]).shape[0]), with_kwargs=True)
    try:
        quantize(m, "W8A8", _data(), ignore=["lm_head"], params=_params(micro))
    finally:
        h.remove()
    assert sizes and max(sizes) == micro  # the batches hold 4 samples


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_micro_batches_give_the_model_of_whole_batches(kind: str) -> None:
    fp = _llm(kind)
    states = []
    for micro in (None, 1, 3):
        m = copy.deepcopy(fp)
        quantize(m, "W8A8", _data(), ignore=["lm_head"], params=_params(micro))
        states.append(m.state_dict())
    whole = states[0]
    for cut in states[1:]:
        assert cut.keys() == whole.keys()
        for k, v in whole.items():
            if isinstance(v, torch.Tensor):
                torch.testing.assert_close(cut[k], v, atol=0, rtol=0, msg=k)


def test_the_alpha_search_sample_is_the_same_row_for_row() -> None:
    # 40 rows of 192: the reservoir replaces rows at random, micro-batch by micro-batch
    fp = _llm("llama")
    scales = []
    for micro in (None, 1, 3):
        m = copy.deepcopy(fp)
        quantize(m, "W8A8", ignore=["lm_head"], params=QuantizeParams(quantize_ops=False))
        scales.append(sq.smooth_quant(m, _data(), alpha="auto", sample_rows=40, micro_batch=micro))
    for cut in scales[1:]:
        assert cut.keys() == scales[0].keys()
        for k, v in scales[0].items():
            torch.testing.assert_close(cut[k], v, atol=0, rtol=0, msg=k)
    assert any(not torch.all(s == 1) for s in scales[0].values())


def test_fold_proofs_run_without_a_kv_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _llm("llama")
    assert m.config.use_cache
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    real = sq.find_producers

    def spy(root: nn.Module, groups: list[list[str]], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        calls.append((args, kwargs))
        return real(root, groups, args, kwargs)

    monkeypatch.setattr(sq, "find_producers", spy)
    quantize(m, "W8A8", _data(), ignore=["lm_head"], params=_params(1))
    assert len(calls) == 1
    (ids,), kwargs = calls[0]
    assert kwargs["use_cache"] is False and ids.shape == (1, 16)
    # a call that brings its own cache keeps it (its layers read it)
    cache = transformers.DynamicCache(config=m.config)
    _, kw = sq._proof_call(m, (), {"input_ids": _data()[0], "cache": cache})
    assert "use_cache" not in kw and kw["cache"] is cache


def test_the_calibration_loops_run_micro_batches() -> None:
    lin = nn.Linear(8, 4)
    sizes: list[int] = []
    lin.register_forward_pre_hook(lambda mod, a: sizes.append(a[0].shape[0]))
    batches = [torch.randn(5, 8), (torch.randn(3, 8), torch.zeros(3))]
    state = State(model=lin, calibration_data=batches)
    with micro_batches(2):
        assert state.forward_loop(lin) == 8
        as_forward_loop(batches)(lin)
        as_forward_loop(lambda mod: mod(torch.randn(6, 8)))(lin)  # a forward function keeps its batches
    assert sizes == [2, 2, 1, 2, 1] * 2 + [6]
    sizes.clear()
    state.forward_loop(lin)  # outside the block: whole batches
    assert sizes == [5, 3]


def test_split_inputs_cuts_only_what_is_one_batch() -> None:
    ids, mask = torch.zeros(5, 7, dtype=torch.long), torch.ones(5, 7)
    pieces = split_inputs({"input_ids": ids, "attention_mask": mask, "flag": True}, 2)
    assert [p["input_ids"].shape[0] for p in pieces] == [2, 2, 1] and all(p["flag"] is True for p in pieces)
    assert torch.equal(torch.cat([p["attention_mask"] for p in pieces]), mask)
    odd = {"input_ids": ids, "bias": torch.zeros(1, 7)}  # which leading size is the batch is unknown
    assert split_inputs(odd, 2) == [odd]
    with pytest.raises(CalibrationError, match="micro-batch"), micro_batches(0):
        pass


def test_one_alpha_search_sample_per_group(monkeypatch: pytest.MonkeyPatch) -> None:
    filled: set[int] = set()
    real = sq._Reservoir.add

    def add(self: sq._Reservoir, x: torch.Tensor) -> None:
        filled.add(id(self))
        real(self, x)

    monkeypatch.setattr(sq._Reservoir, "add", add)
    quantize(_llm("llama"), "W8A8", _data(), ignore=["lm_head"], params=_params(1))
    # per layer: q/k/v, o, gate/up, down; 7 Linears
    assert len(filled) == 4 * SMALL["num_hidden_layers"]


def test_fold_proofs_copy_the_inputs_of_one_layer_per_build(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[Any] = []

    class Spy(sq._Scopes):
        def __init__(self, *a: Any) -> None:
            super().__init__(*a)
            made.append(self)

    monkeypatch.setattr(sq, "_Scopes", Spy)
    m = _llm("llama")
    groups = [[f"model.layers.{i}.self_attn.{p}_proj" for p in "qkv"] for i in range(2)] + [
        [f"model.layers.{i}.mlp.down_proj"] for i in range(2)]
    found = sq.find_producers(m, groups, (_data()[0][:1],), {"use_cache": False})
    assert found["model.layers.1.mlp.down_proj"] is not None and found["model.layers.1.mlp.down_proj"].name.endswith("up_proj")
    copied = {n for n, v in made[0].inputs.items() if v is not None}
    assert copied == {"model", "model.layers.0", "model.layers.0.self_attn", "model.layers.0.mlp"}
