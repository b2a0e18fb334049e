"""compress.core.lm_loss: chunked causal-LM NLL equal to the full computation, in bounded memory."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from compress.core.lm_loss import _UNMATCHED, CHUNK_BYTES, chunk_positions, logits_nll, model_nll

pytest.importorskip("transformers")


def _full_nll(logits: torch.Tensor, labels: torch.Tensor) -> float:
    v = logits.shape[-1]
    return float(F.cross_entropy(logits[:, :-1].reshape(-1, v).double(), labels[:, 1:].reshape(-1),
                                 ignore_index=-100, reduction="sum"))


# soft-capped (gemma2), scaled down (granite), scaled up (cohere), per-layer windows (gemma3), plain
@pytest.mark.parametrize("family", ["llama", "gemma2", "granite", "cohere", "gemma3_text", "phi3"])
def test_chunked_nll_equals_the_full_computation(family: str) -> None:
    from compress.models.families import tiny_decoder

    model = tiny_decoder(family)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 256, (3, 40), generator=g)
    labels = ids.clone()
    labels[1, 5:9] = -100  # padding is not scored
    with torch.no_grad():
        full = model(ids).logits
        want = _full_nll(full, labels)
        chunk = 4 * 256 * 7  # 7 positions a chunk: windows cut mid-row and across rows
        got, n = model_nll(model, ids, labels, chunk_bytes=chunk)
        got_logits, n2 = logits_nll(full, labels, chunk_bytes=chunk)
        got_dict, _ = model_nll(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, labels)
    assert model not in _UNMATCHED  # scored through its head, its final soft-capping or scaling included
    assert n == n2 == 3 * 39 - 4
    for value in (got, got_logits, got_dict):
        assert float(value) == pytest.approx(want, rel=1e-5)


def test_a_head_path_that_differs_falls_back_to_the_models_own_logits() -> None:
    from compress.models.families import tiny_decoder

    model = tiny_decoder("llama")
    model.config.logit_scale = 3.0  # a config that says what this forward does not do
    ids = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = _full_nll(model(ids).logits, ids)
        got, _ = model_nll(model, ids, ids, chunk_bytes=4 * 256 * 5)
    assert model in _UNMATCHED
    assert float(got) == pytest.approx(want, rel=1e-5)


def test_non_hf_models_and_training_gradients() -> None:
    torch.manual_seed(0)
    emb, head = torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50)
    model = torch.nn.Sequential(emb, head)
    ids = torch.randint(0, 50, (2, 12))
    with torch.no_grad():
        got, n = model_nll(model, ids, ids, chunk_bytes=4 * 50 * 3)
        assert float(got) == pytest.approx(_full_nll(model(ids), ids), rel=1e-6) and n == 22
    # the training loss keeps the graph: gradients equal the plain mean cross-entropy's
    from compress.training import task_loss

    logits = model(ids)
    task_loss(logits, ids).backward()
    mine = head.weight.grad.clone()
    head.weight.grad = None
    F.cross_entropy(model(ids)[:, :-1].reshape(-1, 50), ids[:, 1:].reshape(-1)).backward()
    torch.testing.assert_close(mine, head.weight.grad, rtol=1e-5, atol=1e-7)


def test_memory_is_bounded_by_the_chunk_not_the_vocabulary() -> None:
    from torch.profiler import ProfilerActivity, profile

    from compress.models.families import tiny_decoder

    vocab, b, s = 50_000, 2, 256
    # the chunk the helper uses for a vocabulary holds at most CHUNK_BYTES of float32 logits
    for v in (256, vocab, 262_144):
        assert chunk_positions(v) * 4 * v <= CHUNK_BYTES and chunk_positions(v) >= 1
    assert chunk_positions(262_144) < 512  # a 512-token window of a 262k vocabulary is cut
    model = tiny_decoder("llama", vocab_size=vocab)
    ids = torch.randint(3, vocab, (b, s), generator=torch.Generator().manual_seed(0))
    full_bytes = b * s * vocab * 4
    chunk = 8 * 2**20

    def largest_allocation(fn) -> int:
        with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        return max(e.cpu_memory_usage for e in prof.events())

    plain = largest_allocation(lambda: F.cross_entropy(model(ids).logits[:, :-1].reshape(-1, vocab),
                                                       ids[:, 1:].reshape(-1)))
    chunked = largest_allocation(lambda: model_nll(model, ids, ids, chunk_bytes=chunk))
    assert plain >= full_bytes  # the check sees the full logits when they are allocated
    assert chunked <= chunk < full_bytes / 10  # no operation allocated more than one chunk


def test_per_row_sums_add_up_to_the_total() -> None:
    from compress.models.families import tiny_decoder

    model = tiny_decoder("qwen2")
    ids = torch.randint(3, 256, (3, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        rows, n = model_nll(model, ids, ids, chunk_bytes=4 * 256 * 6, per_row=True)
        total, _ = model_nll(model, ids, ids)
        one = [float(model_nll(model, ids[j:j + 1], ids[j:j + 1])[0]) for j in range(3)]
        logit_rows, _ = logits_nll(model(ids).logits, ids, per_row=True)
    assert rows.shape == (3,) and n == 3 * 19
    assert float(rows.sum()) == pytest.approx(float(total), rel=1e-6)  # other chunks: float32 sums
    assert rows.tolist() == pytest.approx(one, rel=1e-5)
    assert logit_rows.tolist() == pytest.approx(one, rel=1e-5)
