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


def _bos_tokenizer_dirs(tmp_path) -> tuple[str, str]:
    """Two tokenizers trained on the same text: one that adds ``<s>`` first by default (as Llama's
    and Gemma's do) and one that adds nothing (GPT-2's convention, the reference LLM's)."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    texts = ["def f(x):\n    return x + 1\n" * 20, "class A:\n    pass\n" * 20]
    plain = train_tokenizer(texts, vocab_size=300)
    plain.save_pretrained(tmp_path / "plain")
    backend = plain.backend_tokenizer
    backend.add_special_tokens(["<s>"])
    bos = backend.token_to_id("<s>")
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    with_bos = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token=EOS, pad_token=EOS)
    with_bos.save_pretrained(tmp_path / "bos")
    return str(tmp_path / "plain"), str(tmp_path / "bos")


def test_text_lm_windows_start_with_bos_when_the_tokenizer_adds_one(tmp_path) -> None:
    from compress.data.lm import adds_bos, text_lm
    from compress.models import load_tokenizer

    plain_dir, bos_dir = _bos_tokenizer_dirs(tmp_path)
    plain, with_bos = load_tokenizer(plain_dir), load_tokenizer(bos_dir)
    bos = with_bos.convert_tokens_to_ids("<s>")
    assert adds_bos(plain) is None and adds_bos(with_bos) == bos
    files = split_files(0)
    for tok_dir, tok, first in ((plain_dir, plain, None), (bos_dir, with_bos, bos)):
        sp = text_lm(seed=0, tokenizer=tok_dir, seq_len=16, samples=3)
        assert sp.description == {"seq_len": 16, "bos": first is not None}
        body = 16 - (first is not None)
        for split, ds in (("calibration", sp.calibration), ("eval", sp.eval)):  # one convention for both
            stream = token_stream(files[split], tok, max_tokens=3 * body)
            for i in range(3):
                inputs, labels = ds[i]
                w = inputs["input_ids"]
                assert w.shape == (16,) and torch.equal(labels, w)
                if first is None:
                    assert torch.equal(w, stream[16 * i:16 * (i + 1)])
                else:  # BOS, then the next 15 text tokens: no text token is lost between windows
                    assert int(w[0]) == bos and torch.equal(w[1:], stream[15 * i:15 * (i + 1)])
    # the run's data description (report.json's "data") states it
    bundle = build_data({"source": "text_lm", "kwargs": {"tokenizer": bos_dir, "seq_len": 16, "samples": 3}},
                        batch_size=2)
    assert bundle.summary()["bos"] is True and bundle.summary()["seq_len"] == 16


def test_perplexity_never_scores_the_bos_position() -> None:
    # position 0 is predicted by nothing: a window of L tokens scores L - 1 targets, BOS never among them
    m = make_metric("perplexity")
    logits = torch.randn(2, 8, 11)
    labels = torch.randint(1, 11, (2, 8))
    labels[:, 0] = 0
    m.update(logits, labels)
    assert m.count == 2 * 7
    want = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1))
    assert m.compute() == pytest.approx(math.exp(float(want)), rel=1e-6)
