"""GGUF files for llama.cpp, read back by a client nobody here wrote (transformers' GGUF loader,
which de-quantizes with gguf and undoes llama.cpp's q/k row order): every weight is ours (block
codes bit for bit, f16 scales), the logits follow, and the tokenizer inside encodes as ours does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from compress.export.llm.gguf_file import save_gguf  # noqa: E402
from compress.export.llm.gguf_weights import gguf_reference  # noqa: E402

import compress  # noqa: E402
from compress.core.errors import ExportError, UnsupportedModelError  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from compress.data.lm import iter_texts, split_files, train_tokenizer

    return train_tokenizer(iter_texts(split_files(0)["train"][:1]), vocab_size=384)


def _model(kind: str, vocab: int, spec: Any) -> Any:
    torch.manual_seed(0)
    cls, cfg = ((transformers.LlamaForCausalLM, transformers.LlamaConfig) if kind == "llama"
                else (transformers.Qwen2ForCausalLM, transformers.Qwen2Config))
    model = cls(cfg(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)).eval()
    return compress.quantize(model, compress.QuantScheme(weights=spec, inputs=None), ignore=["lm_head"])


@pytest.mark.parametrize(("kind", "spec"), [
    ("llama", compress.QuantSpec(bits=4, granularity="group", group_size=32)),
    ("qwen2", compress.QuantSpec(bits=4, symmetric=False, dtype="uint8", granularity="group", group_size=32)),
    ("llama", compress.QuantScheme.preset("MXFP4A16").weights),
])
def test_transformers_reads_our_gguf(kind: str, spec: Any, tokenizer: Any, tmp_path: Path) -> None:
    q = _model(kind, len(tokenizer), spec)
    save_gguf(q, tmp_path / "m.gguf", tokenizer=tokenizer)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
    # llama.cpp's weights, as GGUF stores them: our codes with f16 scales, in transformers' row order again
    ref = transformers.AutoModelForCausalLM.from_config(q.config).eval()
    state = {k: v for k, v in q.state_dict().items() if "_quantizer" not in k}
    ref.load_state_dict(state, strict=False)
    for name, mod in q.named_modules():
        if getattr(mod, "weight_quantizer", None) is not None:
            want = gguf_reference(mod, where=name)
            assert torch.equal(loaded.get_submodule(name).weight, want), name
            ref.get_submodule(name).weight = nn.Parameter(want)
    ids = torch.randint(0, len(tokenizer), (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, ref(ids).logits, atol=1e-5, rtol=1e-5)
    back = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    text = "def f(x):\n    return x + 1"
    assert back(text)["input_ids"] == tokenizer(text)["input_ids"]


def test_refusals(tokenizer: Any, tmp_path: Path) -> None:
    g64 = _model("llama", len(tokenizer), compress.QuantSpec(bits=4, granularity="group", group_size=64))
    with pytest.raises(UnsupportedModelError, match=r"groups of 64 has no llama\.cpp block format"):
        save_gguf(g64, tmp_path / "a.gguf", tokenizer=tokenizer)
    g32 = _model("llama", len(tokenizer), compress.QuantSpec(bits=4, granularity="group", group_size=32))
    with pytest.raises(ExportError, match="pass a fast transformers tokenizer"):
        save_gguf(g32, tmp_path / "b.gguf", tokenizer=None)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(UnsupportedModelError, match=r"GPT2LMHeadModel: no llama\.cpp GGUF architecture"):
        save_gguf(gpt2, tmp_path / "c.gguf", tokenizer=tokenizer)
