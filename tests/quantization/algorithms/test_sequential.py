"""Sequential calibration: decoder layers found in any HF causal LM, inputs captured at the first
layer, layers loaded on demand and offloaded to disk with results identical to an in-memory run."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from compress.quantization.algorithms.sequential import DiskOffload, capture_inputs, decoder_layers
from compress.quantization.numerics.spec import QuantScheme, QuantSpec
from compress.quantization.preparation import linearize_conv1d
from torch import nn

import compress
from compress.core.errors import UnsupportedModelError

W4 = QuantScheme(weights=QuantSpec(bits=4, granularity="group", group_size=32), inputs=None)


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=128)).eval()


def _calib() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 128, (2, 16), generator=g) for _ in range(3)]


def test_decoder_layers_and_conv1d_linearization() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    path, layers = decoder_layers(_llama())
    assert path == "model.layers" and len(layers) == 3
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=32,
                                      bos_token_id=0, eos_token_id=0)).eval()
    x = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        ref = gpt2(input_ids=x).logits
        names = linearize_conv1d(gpt2)
        assert len(names) == 8 and all(type(gpt2.get_submodule(n)) is nn.Linear for n in names)
        torch.testing.assert_close(gpt2(input_ids=x).logits, ref, rtol=1e-5, atol=1e-5)
    assert decoder_layers(gpt2)[0] == "transformer.h"
    with pytest.raises(UnsupportedModelError, match="no list of repeated layers"):
        decoder_layers(nn.Sequential(nn.Linear(4, 4)))


def test_capture_stops_at_the_first_layer() -> None:
    model = _llama()
    calls_of_last = []
    model.model.layers[2].register_forward_pre_hook(lambda m, a: calls_of_last.append(1))
    calls = capture_inputs(model, model.model.layers[0], _calib())
    assert len(calls) == 3 and not calls_of_last
    args, kwargs = calls[0]
    assert args[0].shape == (2, 16, 64) and kwargs.get("past_key_values") is None


def test_layers_loaded_on_demand_and_offloaded_to_disk_give_the_same_model(tmp_path: Path) -> None:
    fp = _llama()
    data = _calib()
    in_memory = compress.gptq(copy.deepcopy(fp), data, scheme=W4, ignore=["lm_head"])

    # the layers start on the meta device (never materialized together) and load from per-layer files
    state = {i: {k: v.clone() for k, v in layer.state_dict().items()} for i, layer in enumerate(fp.model.layers)}
    lazy = copy.deepcopy(fp)
    for layer in lazy.model.layers:
        layer.to("meta")
    loaded: list[int] = []

    def load(i: int, layer: nn.Module) -> None:
        assert all(p.device.type == "meta" for p in layer.parameters())
        layer.to_empty(device="cpu")
        layer.load_state_dict(state[i])
        loaded.append(i)

    offload = DiskOffload(tmp_path / "layers")
    resident: list[int] = []

    def release(i: int, layer: nn.Module) -> None:
        offload.release(i, layer)
        resident.append(sum(1 for m in lazy.model.layers if next(m.parameters()).device.type == "cpu"))

    compress.gptq(lazy, data, scheme=W4, load=load, release=release, ignore=["lm_head"])
    assert loaded == [0, 1, 2] and resident == [0, 0, 0]  # at most one layer in memory at a time
    assert all(p.device.type == "meta" for p in lazy.model.layers.parameters())
    offload.restore(lazy.model.layers)
    x = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(lazy(input_ids=x).logits, in_memory(input_ids=x).logits, atol=0, rtol=0)
