"""The causal-LM data path (text_lm), the BPE tokenizer, the perplexity metric and causal-LM loading."""

from __future__ import annotations

import math

import pytest
import torch

from compress.core.errors import RecipeError
from compress.core.metrics import make_metric
from compress.data import build_data
from compress.data.lm import EOS, TokenWindows, split_files, token_stream, train_tokenizer
from compress.models import load_model
from compress.training import evaluate, task_loss


def test_file_split_is_disjoint_and_fixed_by_seed() -> None:
    a, b = split_files(0), split_files(0)
    assert a == b
    sets = [set(a[k]) for k in ("train", "calibration", "eval")]
    assert all(sets) and not (sets[0] & sets[1] or sets[0] & sets[2] or sets[1] & sets[2])
    assert split_files(1)["eval"] != a["eval"]


def test_tokenizer_round_trips_source_and_ends_files_with_eos() -> None:
    text = "def f(x):\n    return x + 1  # comment\n"
    tok = train_tokenizer([text * 20, "class A:\n    pass\n" * 20], vocab_size=300)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    eos = tok.convert_tokens_to_ids(EOS)
    files = split_files(0)["train"][:2]
    stream = token_stream(files, tok)
    assert int((stream == eos).sum()) == 2 and int(stream[-1]) == eos
    w = TokenWindows(stream, 16)
    assert len(w) == len(stream) // 16
    inputs, labels = w[1]
    assert torch.equal(inputs["input_ids"], stream[16:32]) and torch.equal(labels, stream[16:32])


def test_text_lm_bundle_and_perplexity_match_hf_loss(tiny_llm_dir: str) -> None:
    spec = {"source": "text_lm", "kwargs": {"tokenizer": tiny_llm_dir, "seq_len": 32, "samples": 6},
            "calibration_samples": 4, "eval_batch_size": 3}
    bundle = build_data(spec, batch_size=2)
    assert bundle.task == "causal_lm" and bundle.sizes == {"train": 6, "calibration": 4, "eval": 6}
    model = load_model({"hf_path": tiny_llm_dir})
    assert type(model).__name__ == "LlamaForCausalLM"  # the LM head is loaded, not bare hidden states
    ppl = evaluate(model, bundle.eval, metric="perplexity")
    # HF's own mean next-token loss over the same windows (equal window lengths: the mean of means)
    x = torch.cat([b[0]["input_ids"] for b in bundle.eval])
    with torch.no_grad():
        hf = model(input_ids=x, labels=x).loss
    assert ppl == pytest.approx(math.exp(float(hf)), rel=1e-4)
    assert 0.5 * len(model.get_input_embeddings().weight) < ppl < 3 * len(model.get_input_embeddings().weight)
    inputs, labels = next(iter(bundle.train))
    out = model(**inputs)
    torch.testing.assert_close(task_loss(out, labels), model(**inputs, labels=labels).loss, rtol=1e-5, atol=1e-5)


def test_perplexity_rejects_non_lm_outputs() -> None:
    m = make_metric("perplexity")
    with pytest.raises(RecipeError, match="causal-LM logits"):
        m.update(torch.randn(4, 10), torch.randint(0, 10, (4,)))
    assert m.higher_is_better is False and make_metric("accuracy").higher_is_better
