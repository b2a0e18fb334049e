"""The folder of an LLM generation export loads in ONNX Runtime GenAI as it is: ``og.Model(dir)``
with the genai_config.json and tokenizer files written beside the ONNX generates the same greedy
tokens as the file in ONNX Runtime (itself checked against PyTorch), on Llama and Qwen2."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from compress.export.llm.genai import genai_config, genai_greedy, write_runtime_files  # noqa: E402
from compress.export.llm.onnx import export_llm_onnx, generate_ort  # noqa: E402

import compress  # noqa: E402
from compress.core.errors import ExportError  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from compress.data.lm import iter_texts, split_files, train_tokenizer

    return train_tokenizer(iter_texts(split_files(0)["train"][:2]), vocab_size=384)


def _model(kind: str, vocab: int) -> Any:
    torch.manual_seed(0)
    common = {"vocab_size": vocab, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
              "bos_token_id": 1, "eos_token_id": 2}
    cls, cfg = ((transformers.LlamaForCausalLM, transformers.LlamaConfig) if kind == "llama"
                else (transformers.Qwen2ForCausalLM, transformers.Qwen2Config))
    scheme = compress.QuantScheme(weights=compress.QuantSpec(bits=4, granularity="group", group_size=32), inputs=None)
    return compress.quantize(cls(cfg(**common)).eval(), scheme, ignore=["lm_head"])


@pytest.mark.parametrize(("kind", "position_ids", "logits"), [("llama", False, "all"), ("qwen2", True, "all"),
                                                             ("llama", False, "last")])
def test_genai_loads_the_folder_and_generates_our_tokens(kind: str, position_ids: bool, logits: Any, tokenizer: Any,
                                                         tmp_path: Path) -> None:
    og = pytest.importorskip("onnxruntime_genai", reason="the llm extra: pip install -e '.[llm]'")
    model = _model(kind, len(tokenizer))
    path = export_llm_onnx(model, tmp_path / "model.int4.onnx", position_ids=position_ids, logits=logits)
    written = {p.name for p in write_runtime_files(path, model, tokenizer=tokenizer)}
    assert {"genai_config.json", "config.json", "tokenizer.json", "tokenizer_config.json"} <= written
    ids = torch.randint(3, len(tokenizer), (1, 6), generator=torch.Generator().manual_seed(1))
    want = generate_ort(path, ids, max_new_tokens=10)[0].tolist()
    got = genai_greedy(tmp_path, ids.numpy(), max_length=len(want))
    # GenAI stops at an EOS token (2); up to there the sequences are the same token by token
    assert got == want[: len(got)] and (len(got) == len(want) or got[-1] == 2), (got, want)
    text = "def f(x):\n    return x"
    assert list(og.Tokenizer(og.Model(str(tmp_path))).encode(text)) == tokenizer(text)["input_ids"]


def test_genai_config_names_the_graph_and_refuses_other_files(tokenizer: Any, tmp_path: Path) -> None:
    model = _model("llama", len(tokenizer))
    path = export_llm_onnx(model, tmp_path / "m.onnx")
    cfg = genai_config(path, model.config)
    dec = cfg["model"]["decoder"]
    assert dec["filename"] == "m.onnx" and dec["num_key_value_heads"] == 2 and dec["head_size"] == 16
    # fused attention appends to the past in place (the default here); the decomposed graph concatenates
    assert cfg["search"]["past_present_share_buffer"] is True
    decomposed = export_llm_onnx(model, tmp_path / "d.onnx", attention="decomposed")
    assert genai_config(decomposed, model.config)["search"]["past_present_share_buffer"] is False
    json.dumps(cfg)
    other = transformers.LlamaConfig(num_hidden_layers=3, hidden_size=64, num_attention_heads=4)
    with pytest.raises(ExportError, match="not an export_llm_onnx graph of a 3-layer model"):
        genai_config(path, other)
