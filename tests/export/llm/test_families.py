"""The generation export on every decoder family of compress.models.families (13 transformers
architectures built from their configs, random weights): nothing in the export names a family, so
each one is the model's own forward traced over an explicit past, or the fused block where a probe
shows it computes the model. Per family: the float file in ONNX Runtime against the model's own
logits (left-padded prefill, then cached steps), and its folder in ONNX Runtime GenAI generating
the model's greedy tokens; the int4 file (slow set) generating the fake-quant model's tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from compress.export.llm.decoder import KVDecoder, fused_mismatch  # noqa: E402
from compress.export.llm.genai import genai_greedy, write_runtime_files  # noqa: E402
from compress.export.llm.onnx import export_llm_onnx  # noqa: E402
from compress.export.validation.runtimes import inference_session  # noqa: E402

import compress  # noqa: E402
from compress.models.families import FAMILIES, tiny_decoder  # noqa: E402

MIN_SQNR_DB = 40.0


def _sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    noise = (got - ref).pow(2).mean().clamp(min=1e-30)
    return float(10 * torch.log10(ref.pow(2).mean() / noise))


def _ort_steps(path: Path, ids: torch.Tensor, mask: torch.Tensor, cuts: list[int], dec: KVDecoder) -> torch.Tensor:
    """Logits of ``ids`` run through the file as a prefill up to ``cuts[0]``, then a step per cut."""
    sess = inference_session(path)
    names = [i.name for i in sess.get_inputs()]
    past: list[Any] = [t.numpy() for t in dec.empty_past(ids.shape[0])]
    out, start = [], 0
    for end in [*cuts, ids.shape[1]]:
        feed = [ids[:, start:end].numpy(), mask[:, :end].numpy(), *past]
        res = sess.run(None, dict(zip(names, feed)))
        out.append(torch.from_numpy(res[0]))
        past, start = res[1:], end
    return torch.cat(out, dim=1)


def _greedy(model: Any, ids: torch.Tensor, new: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)
    return [int(t) for t in out[0]]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_float_file_computes_the_models_logits_and_genai_generates_its_tokens(family: str, tmp_path: Path) -> None:
    model = tiny_decoder(family)
    path = export_llm_onnx(model, tmp_path / "model.onnx", weights="fp32", check=False)
    # a left-padded batch of two (the second row 5 slots of padding), prefill of 9, steps of 3, 1 and 1:
    # longer than every family's window (4 or 8 slots) so windowed layers are checked too
    ids = torch.randint(3, 256, (2, 14), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
    got = _ort_steps(path, ids, mask, [9, 12, 13], KVDecoder(model))
    real = mask.bool()
    assert _sqnr_db(ref[real], got[real]) >= MIN_SQNR_DB
    assert torch.equal(ref[real].argmax(-1), got[real].argmax(-1))
    pytest.importorskip("onnxruntime_genai", reason="the llm extra: pip install -e '.[llm]'")
    write_runtime_files(path, model)
    prompt = ids[:1, :6]
    want = _greedy(model, prompt, 8)
    got_ids = genai_greedy(tmp_path, prompt.numpy(), max_length=len(want))
    _same_greedy(got_ids, want, model.config.eos_token_id)


def _same_greedy(got: list[int], want: list[int], eos: Any) -> None:
    """GenAI's sequence is transformers' token by token; where transformers stopped at an EOS,
    GenAI may leave that EOS out of its sequence."""
    assert got == want or (want[-1] == eos and got == want[:-1]), (got, want)


def test_the_fused_block_is_used_only_where_it_computes_the_model() -> None:
    """The probe, not a family list, decides: Llama-style blocks pass; Gemma2's extra norms and
    soft-capping, Granite's multipliers and SmolLM3's position-free layers do not; OLMo2 (post-norms
    only) and Cohere (one norm, parallel blocks) lack the parts the fused block reads."""
    fused = {f for f in FAMILIES if fused_mismatch(tiny_decoder(f)) is None}
    assert {"llama", "qwen2", "qwen3", "mistral", "phi3"} <= fused
    assert not fused & {"gemma2", "granite", "smollm3", "olmo2", "cohere"}


def test_a_changed_block_fails_the_probe() -> None:
    """The same Llama with one layer's output projection doubled outside the module tree's view
    (a forward hook) is no longer what the fused block computes from the tree."""
    model = tiny_decoder("llama")
    assert fused_mismatch(model) is None
    model.model.layers[1].mlp.register_forward_hook(lambda mod, args, out: out * 2)
    assert fused_mismatch(model) is None  # the fused block calls layer.mlp too: the hook runs in both
    model.model.layers[1].register_forward_hook(lambda mod, args, out: out * 1.5)
    why = fused_mismatch(model)
    assert why is not None and "LlamaForCausalLM's computation" in why


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_int4_file_generates_the_fake_quant_models_tokens(family: str, tmp_path: Path) -> None:
    scheme = compress.QuantScheme(weights=compress.QuantSpec(bits=4, granularity="group", group_size=32), inputs=None)
    q = compress.quantize(tiny_decoder(family), scheme, ignore=["lm_head"])
    # accuracy_level 0: MatMulNBits in float, so the file computes the fake-quant model's numbers
    path = export_llm_onnx(q, tmp_path / "model.onnx", accuracy_level=0, logits="last")
    write_runtime_files(path, q)
    prompt = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(2))
    want = _greedy(q, prompt, 8)
    pytest.importorskip("onnxruntime_genai", reason="the llm extra: pip install -e '.[llm]'")
    _same_greedy(genai_greedy(tmp_path, prompt.numpy(), max_length=len(want)), want, q.config.eos_token_id)
