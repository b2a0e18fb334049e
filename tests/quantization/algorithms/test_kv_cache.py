"""Int8 KV cache (simulated): the keys and values entering SDPA are fake-quantized per (head, token)
or per head, exactly as the quantizers define; off, stripped or deep-copied it behaves."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from compress.quantization import QuantizeParams, quantize, set_quantizers, strip  # noqa: E402
from compress.quantization.algorithms.kv_cache import attach_kv_quantization, kv_quantizers  # noqa: E402
from compress.quantization.numerics.primitives import dynamic_qparams, fake_quantize_spec  # noqa: E402

from compress.core.errors import UnsupportedModelError  # noqa: E402

CFG = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "vocab_size": 256}


def _llama(attn: str = "sdpa") -> Any:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG, attn_implementation=attn)).eval()


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(seed))


def _capture(model: Any) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    """(input, output) of every key/value quantizer call."""
    seen: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for name, kvq in kv_quantizers(model).items():
        for role in ("key", "value"):
            q = getattr(kvq, role)
            q.register_forward_hook(lambda m, a, o, k=f"{name}.{role}": seen.setdefault(k, []).append((a[0], o)))
    return seen


def test_per_token_quantizes_each_head_and_token_row_of_k_and_v() -> None:
    m = _llama()
    q = quantize(copy.deepcopy(m), "w8_weight_only", ignore=["lm_head"], params=QuantizeParams(kv_cache="per_token"))
    seen = _capture(q)
    x = _ids(1)
    with torch.no_grad():
        out = q(input_ids=x).logits
    assert len(seen) == 4  # key and value of both layers
    spec = next(iter(kv_quantizers(q).values())).key.spec
    for name, calls in seen.items():
        (inp, got), = calls
        assert inp.shape == (2, CFG["num_key_value_heads"], 12, 16), name  # the cache's layout, GQA heads
        scale, zp = dynamic_qparams(inp, spec)
        assert scale.shape == (2, 2, 12, 1)  # one scale per (batch, head, token)
        torch.testing.assert_close(got, fake_quantize_spec(inp, scale, zp, spec), atol=0, rtol=0)
        assert not torch.equal(got, inp)
    # the keys really entering attention: quantizers off gives the weight-only model's logits
    ref = quantize(copy.deepcopy(m), "w8_weight_only", ignore=["lm_head"])
    with torch.no_grad():
        set_quantizers(q, enabled=False, roles=("input",))
        torch.testing.assert_close(q(input_ids=x).logits, ref(input_ids=x).logits, atol=0, rtol=0)
        assert not torch.equal(out, ref(input_ids=x).logits)


def test_per_head_scales_are_calibrated_per_kv_head_and_survive_deepcopy_and_strip() -> None:
    m = _llama()
    data = [_ids(s) for s in range(2)]
    q = quantize(copy.deepcopy(m), "w8a8_dynamic", data, ignore=["lm_head"], params=QuantizeParams(kv_cache="per_head"))
    kvq = next(iter(kv_quantizers(q).values()))
    assert kvq.key.scale.shape == (CFG["num_key_value_heads"],) and bool((kvq.key.scale > 0).all())
    c = copy.deepcopy(q)  # the copied hooks must find the copy's own quantizers, not q's
    seen, seen_q = _capture(c), _capture(q)
    x = _ids(7)
    with torch.no_grad():
        out_c = c(input_ids=x).logits
        assert len(seen) == 4 and not seen_q
        torch.testing.assert_close(out_c, q(input_ids=x).logits, atol=0, rtol=0)
    strip(q)
    assert not kv_quantizers(q)
    with torch.no_grad():
        torch.testing.assert_close(q(input_ids=x).logits, m(input_ids=x).logits, atol=1e-5, rtol=1e-5)


def test_kv_cache_refuses_models_it_would_not_quantize() -> None:
    eager = _llama("eager")  # attention by matmuls: the quantizers would never run
    with pytest.raises(UnsupportedModelError, match="scaled_dot_product_attention"):
        quantize(eager, "w8a8_dynamic", [_ids(0)], ignore=["lm_head"], params=QuantizeParams(kv_cache="per_token"))
    with pytest.raises(UnsupportedModelError, match="no attention module"):
        attach_kv_quantization(torch.nn.Sequential(torch.nn.Linear(4, 4)), "per_token")
