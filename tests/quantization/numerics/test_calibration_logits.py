"""Calibration forwards of a causal LM skip the full-vocabulary logits no quantizer reads
(transformers' ``logits_to_keep=1``): the same qparams, a fraction of the memory."""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import compress.quantization.api as qapi  # noqa: E402
from compress.quantization.placement.mode import input_quantizer  # noqa: E402

import compress  # noqa: E402


def _llama() -> Any:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256)
    return transformers.LlamaForCausalLM(cfg).eval()


def _data() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (2, 16), generator=g) for _ in range(3)]


def _head_rows(model: Any, fn: Any) -> list[int]:
    rows: list[int] = []
    h = model.lm_head.register_forward_pre_hook(lambda m, a: rows.append(a[0].shape[1]))
    try:
        fn()
    finally:
        h.remove()
    return rows


@pytest.mark.parametrize("smoothquant", [None, "auto"])
def test_calibration_skips_unread_logits_with_the_same_qparams(smoothquant: str | None,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    fp = _llama()
    params = compress.QuantizeParams(quantize_ops=False, smoothquant=smoothquant)
    lean = copy.deepcopy(fp)
    rows = _head_rows(lean, lambda: compress.quantize(lean, "w8a8", _data(), ignore=["lm_head"], params=params))
    # the placement's trace and the first call (every position), then every calibration forward
    # asks for the last position only
    assert rows[:2] == [16, 16] and rows[2:] == [1] * (len(rows) - 2) and len(rows) >= 2 + len(_data())
    monkeypatch.setattr(qapi, "last_logits_only", lambda model, ops_placed: contextlib.nullcontext())
    full = copy.deepcopy(fp)
    rows = _head_rows(full, lambda: compress.quantize(full, "w8a8", _data(), ignore=["lm_head"], params=params))
    assert set(rows) == {16}
    a, b = lean.state_dict(), full.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):  # the placement's extra state is data, compared whole below
            torch.testing.assert_close(a[k], b[k], atol=0, rtol=0, msg=k)
    assert [v for v in a.values() if not isinstance(v, torch.Tensor)] == [v for v in b.values() if not isinstance(v, torch.Tensor)]
    x = _data()[0]
    with torch.no_grad():  # outside calibration the model computes every position again
        assert lean(x).logits.shape == (2, 16, 256)


def test_a_quantized_output_layer_still_sees_every_position() -> None:
    model = _llama()
    rows = _head_rows(model, lambda: compress.quantize(model, "w8a8", _data(),
                                                       params=compress.QuantizeParams(quantize_ops=False)))
    assert set(rows) == {16}
    q = input_quantizer(model, "lm_head")
    assert q is not None and q.calibrated
