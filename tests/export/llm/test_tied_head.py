"""A tied decoder whose head a weight-only pass quantized (``ignore`` left empty, the one default):
the compressed-tensors checkpoint holds both tables, untied, and reloads to the same logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import compress

pytest.importorskip("compressed_tensors")
transformers = pytest.importorskip("transformers")


def test_a_quantized_tied_head_is_written_untied(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(cfg).eval()
    data = [torch.randint(0, 128, (2, 16)) for _ in range(2)]
    q = compress.gptq(model, data, scheme="w4_weight_only", progress=False)
    assert type(q.lm_head).__name__ == "QuantLinear" and q.lm_head.weight is q.model.embed_tokens.weight
    x = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        ref = q(x).logits
    out = compress.save_compressed_tensors(q, tmp_path / "ckpt")
    written = json.loads((Path(out) / "config.json").read_text())
    assert written["tie_word_embeddings"] is False
    assert "lm_head" not in written["quantization_config"]["ignore"]  # written quantized, beside the float table
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x).logits, ref, atol=1e-5, rtol=0)
