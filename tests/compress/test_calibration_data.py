"""One calibration-data convention for every one-shot call (quantize, gptq, awq, prune): an iterable
of tensors, a DataLoader of (inputs, targets) tuples or of dicts (Hugging Face tokenized batches), or
a forward function ``fn(model)``; each form gives the same result."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import compress
from compress.core.batching import as_batches, as_forward_loop


class _Dicts(Dataset[dict[str, torch.Tensor]]):
    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i])}


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=96)).eval()


def _ids() -> torch.Tensor:
    return torch.randint(0, 96, (8, 16), generator=torch.Generator().manual_seed(1))


def _forms(ids: torch.Tensor) -> dict[str, Any]:
    def forward(model: nn.Module) -> None:
        for chunk in ids.split(4):
            model(input_ids=chunk, attention_mask=torch.ones_like(chunk))

    return {
        "tensors": list(ids.split(4)),
        "dataloader of dicts": DataLoader(_Dicts(ids), batch_size=4),
        "forward function": forward,
    }


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if k.endswith("weight")}


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_weight_only_methods_take_every_form_alike(method: str) -> None:
    fp, ids = _llama(), _ids()
    results = {}
    for name, data in _forms(ids).items():
        q = getattr(compress, method)(copy.deepcopy(fp), data, scheme="w4_weight_only_g128")
        results[name] = _weights(q)
    ref = results.pop("tensors")
    for name, got in results.items():
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], atol=0, rtol=0, msg=f"{method}, {name}: {k}")


def test_quantize_takes_every_form_alike() -> None:
    torch.manual_seed(0)
    fp = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    x, y = torch.randn(24, 12), torch.randint(0, 4, (24,))

    def forward(model: nn.Module) -> None:
        for chunk in x.split(8):
            model(chunk)

    forms = {"tensors": list(x.split(8)), "dataloader of tuples": DataLoader(TensorDataset(x, y), batch_size=8),
             "forward function": forward}
    probe = torch.randn(5, 12)
    outs = {n: compress.quantize(copy.deepcopy(fp), "w8a8", d)(probe) for n, d in forms.items()}
    for name, out in outs.items():
        torch.testing.assert_close(out, outs["tensors"], atol=0, rtol=0, msg=name)


def test_prune_activation_importance_takes_a_forward_function() -> None:
    torch.manual_seed(0)
    fp = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
    x = torch.randn(24, 12)

    def forward(model: nn.Module) -> None:
        for chunk in x.split(8):
            model(chunk)

    kept = []
    for data in (list(x.split(8)), forward):
        m = copy.deepcopy(fp)
        compress.prune(m, x[:2], ratio=0.5, importance="activation", data=data)
        kept.append(m[0].weight.clone())
    assert kept[0].shape == (16, 12)
    torch.testing.assert_close(kept[0], kept[1], atol=0, rtol=0)


def test_taylor_importance_refuses_a_forward_function() -> None:
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(compress.CalibrationError, match=r"taylor.*not a forward function"):
        compress.prune(m, torch.randn(2, 4), ratio=0.5, importance="taylor", data=lambda model: None)


def test_a_forward_function_is_recorded_as_bound_arguments() -> None:
    model = nn.Bilinear(3, 3, 2)
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    batches = list(as_batches(lambda m: (m(a, b), m(a, input2=b)), model))
    assert len(batches) == 2 and all(set(x) == {"input1", "input2"} for x in batches)
    assert all(torch.equal(x["input1"], a) and torch.equal(x["input2"], b) for x in batches)
    assert as_forward_loop(batches)(model) == 2  # the recorded batches replay through the loop
    assert list(as_batches(lambda m: [m(a, b) for _ in range(5)], model, max_batches=3)).__len__() == 3


class _Kw(nn.Module):
    """A forward with extra keywords, as every Hugging Face model has (``**kwargs``)."""

    def forward(self, x: torch.Tensor, *extra: Any, scale: float = 1.0, **kw: Any) -> torch.Tensor:
        return x * scale * (2 if kw.get("double") else 1)


def test_recorded_extra_keywords_replay_as_keywords() -> None:
    x = torch.randn(3)
    model = _Kw()
    (batch,) = as_batches(lambda m: m(x, scale=3.0, double=True), model)
    assert set(batch) == {"x", "scale", "double"}
    torch.testing.assert_close(model(**batch), x * 6)


def test_positional_extras_are_refused_and_recording_stops_at_max_batches() -> None:
    x = torch.randn(3)
    with pytest.raises(compress.CalibrationError, match="positional arguments past its named ones"):
        as_batches(lambda m: m(x, x), _Kw())
    calls: list[int] = []

    def forward(model: nn.Module) -> None:
        for i in range(10):
            calls.append(i)
            model(x)

    assert len(list(as_batches(forward, _Kw(), max_batches=3))) == 3
    assert calls == [0, 1, 2, 3]  # the fourth call is stopped in the model; the loop goes no further


def test_the_former_names_are_refused_naming_the_new_ones() -> None:
    """0.1.0's deprecated keywords and fields are gone: each old name is refused in one line naming
    the new one, in Python and in a recipe alike."""
    from compress.core.errors import RecipeError

    fp = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
    x = torch.randn(16, 12)
    with pytest.raises(TypeError, match="'forward_loop=' is now 'data'"):
        compress.quantize(copy.deepcopy(fp), "w8a8", forward_loop=list(x.split(8)))
    with pytest.raises(TypeError, match="'options=' is now 'params'"):
        compress.prune(copy.deepcopy(fp), x[:2], ratio=0.5, options=compress.PruneParams(max_ratio=0.25))
    with pytest.raises(TypeError, match="'target=' is now 'budget'"):
        compress.prune(copy.deepcopy(fp), x[:2], target={"macs": 0.5})
    with pytest.raises(RecipeError, match="QuantizeParams: 'max_batches' is now 'num_batches'"):
        compress.QuantizeParams(max_batches=2)
    with pytest.raises(RecipeError, match="'target' is now 'runtime'"):
        compress.QuantizeParams(target="openvino")
    with pytest.raises(RecipeError, match="'taylor_batches' is now 'num_batches'"):
        compress.PruneParams(taylor_batches=2)
    with pytest.raises(TypeError, match="'max_batches=' is now 'params=GPTQParams"):
        compress.gptq(fp, [x], max_batches=1, ignore=["lm_head"])
    assert not hasattr(compress.pruning.api, "PruneOptions")
