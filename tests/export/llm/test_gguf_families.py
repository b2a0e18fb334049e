"""The family suite for GGUF: every decoder family of compress.models.families that llama.cpp has an
architecture for is written (F32, F16, Q4_0, Q4_1, Q8_0), read back by the ``gguf`` package (tensor
names and shapes as gguf's own map for the architecture says, metadata equal to the config), and,
where transformers' GGUF loader knows the architecture, reloaded with logits equal to the source
(float) or to llama.cpp's weights (quantized: our codes with f16 scales, :func:`gguf_reference`).

Tokenizers of both GGUF forms ride along: byte-level BPE (``gpt2``) and SentencePiece-style BPE
with byte fallback (``llama``), and transformers rebuilds each from the file encoding as ours does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from compress.export.llm.gguf_arch import ARCHS  # noqa: E402
from compress.export.llm.gguf_file import check_gguf, save_gguf  # noqa: E402
from compress.export.llm.gguf_weights import gguf_reference  # noqa: E402

import compress  # noqa: E402
from compress.core.errors import UnsupportedModelError  # noqa: E402
from compress.models.families import FAMILIES, tiny_decoder  # noqa: E402

#: what each family needs to be expressible in llama.cpp's GGUF (its shipped tiny config uses a
#: convention llama.cpp's loader fixes otherwise; test_families_llamacpp_cannot_state_are_refused
#: checks the shipped config is refused)
WRITABLE: dict[str, dict[str, Any]] = {
    "qwen2": dict(use_sliding_window=False),  # llama.cpp's qwen2 has no windows
    "mistral": dict(sliding_window=None),  # nor has its llama (which Mistral converts to)
    "gemma3_text": dict(num_hidden_layers=6, layer_types=["sliding_attention"] * 5 + ["full_attention"]),
    "smollm3": dict(num_hidden_layers=4, no_rope_layer_interval=4),  # NoPE on every 4th layer, fixed
}
#: config values transformers' GGUF loader does not read back from the file (its GGUF_CONFIG_MAPPING
#: has no entry), though the file states them (checked in the metadata): passed to from_pretrained
LOADER_GAPS: dict[str, tuple[str, ...]] = {
    "qwen3": ("head_dim",),  # attention.key_length not mapped for qwen3
    "phi3": ("rope_parameters",),  # rope.dimension_count (partial rotary) not mapped
    "stablelm": ("rope_parameters",),
    "gemma2": ("query_pre_attn_scalar",),  # llama.cpp fixes 1/sqrt(head_dim); transformers defaults 256
    "gemma3_text": ("query_pre_attn_scalar", "layer_types"),
}
#: families transformers 5.24's GGUF loader has no architecture for (written and read back only)
NO_LOADER = {"gemma", "olmo2", "granite", "cohere", "smollm3"}
SPM_FAMILIES = {"llama", "mistral", "phi3", "gemma", "gemma2", "gemma3_text"}  # as their real GGUFs

QTYPES = {
    "Q4_0": compress.QuantSpec(bits=4, granularity="group", group_size=32),
    "Q4_1": compress.QuantSpec(bits=4, symmetric=False, dtype="uint8", granularity="group", group_size=32),
    "Q8_0": compress.QuantSpec(bits=8, granularity="group", group_size=32),
}


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, Any]:
    """A byte-level BPE (GGUF gpt2) and a SentencePiece-style BPE with byte fallback (GGUF llama)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from compress.data.lm import iter_texts, split_files, train_tokenizer

    texts = list(iter_texts(split_files(0)["train"][:1]))
    bpe = train_tokenizer(texts, vocab_size=320)
    specials = ["<unk>", "<s>", "</s>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=specials + [f"<0x{i:02X}>" for i in range(256)],
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    # the encoder LlamaTokenizer rebuilds from a GGUF: one Metaspace over the text (merges never
    # span a word, so it encodes as the split one trained)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    spm = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                               eos_token="</s>")
    return {"gpt2": bpe, "llama": spm}


def _model(family: str, vocab: int) -> Any:
    return tiny_decoder(family, vocab_size=vocab, **WRITABLE.get(family, {}))


def _read(path: Path) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    reader = gguf.GGUFReader(str(path))
    fields = {k: f.contents() for k, f in reader.fields.items()}
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    return fields, shapes


def _check_read_back(model: Any, path: Path, vocab: int) -> None:
    """Names and shapes from gguf's own map for the architecture; metadata equal to the config."""
    cfg = model.config
    arch = ARCHS[type(model).__name__]
    name = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH[arch.name]]
    fields, shapes = _read(path)
    assert fields["general.architecture"] == name
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.name], cfg.num_hidden_layers)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    want = {}
    for key, value in model.state_dict().items():
        if "_quantizer." in key or (tied and key == "lm_head.weight"):
            continue
        want[names.get_name(key, try_suffixes=(".weight", ".bias"))] = tuple(value.shape)
    allowed = {gguf.TENSOR_NAMES[t].format(bid=i) for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH[arch.name]]
               for i in range(cfg.num_hidden_layers)}
    assert {n.rsplit(".", 1)[0] for n in shapes} <= allowed
    assert shapes == want  # logical shapes, quantized blocks included
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    partial = getattr(cfg, "partial_rotary_factor", None) or (cfg.rope_parameters or {}).get("partial_rotary_factor", 1.0)
    expect = {
        "context_length": cfg.max_position_embeddings, "embedding_length": cfg.hidden_size,
        "block_count": cfg.num_hidden_layers, "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": heads, "attention.head_count_kv": cfg.num_key_value_heads,
        "attention.key_length": head_dim, "attention.value_length": head_dim,
        "rope.dimension_count": int(head_dim * partial), "vocab_size": cfg.vocab_size,
    }
    eps = getattr(cfg, "rms_norm_eps", None)
    if arch.norm == "rms":
        expect["attention.layer_norm_rms_epsilon"] = eps
    else:
        expect["attention.layer_norm_epsilon"] = getattr(cfg, "layer_norm_eps", None)
    optional = {"attention.sliding_window": "sliding_window", "attn_logit_softcapping": "attn_logit_softcapping",
                "final_logit_softcapping": "final_logit_softcapping", "embedding_scale": "embedding_multiplier",
                "residual_scale": "residual_multiplier", "attention.scale": "attention_multiplier"}
    for key, attr in optional.items():
        value = getattr(cfg, attr, None)
        windowed = key != "attention.sliding_window" or any(t == "sliding_attention" for t in
                                                            getattr(cfg, "layer_types", None) or [])
        if value is not None and windowed:
            expect[key] = value
    logit = getattr(cfg, "logits_scaling", None) or getattr(cfg, "logit_scale", None)
    if logit is not None:
        expect["logit_scale"] = logit
    for key, value in expect.items():
        got = fields[f"{name}.{key}"]
        assert got == pytest.approx(value, rel=1e-6), (key, got, value)
    assert len(fields["tokenizer.ggml.tokens"]) == vocab


def _reload(path: Path, model: Any) -> Any:
    family = model.config.model_type
    extra = {k: getattr(model.config, k) for k in LOADER_GAPS.get(family, ())}
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                             **extra).eval()


def _logits_diff(a: Any, b: Any, vocab: int) -> float:
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return float((a(ids).logits - b(ids).logits).abs().max())


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("kind", ["f32", "f16", *QTYPES])
def test_family_writes_reads_back_and_reloads(family: str, kind: str, tokenizers: dict[str, Any],
                                              tmp_path: Path) -> None:
    tok = tokenizers["llama" if family in SPM_FAMILIES else "gpt2"]
    vocab = len(tok)
    model = _model(family, vocab)
    ref = _model(family, vocab)  # the weights llama.cpp computes with, built beside the file
    if kind in QTYPES:
        model = compress.quantize(model, compress.QuantScheme(weights=QTYPES[kind], inputs=None), ignore=["lm_head"])
        for name, mod in model.named_modules():
            if getattr(mod, "weight_quantizer", None) is not None:
                ref.get_submodule(name).weight = nn.Parameter(gguf_reference(mod, where=name))
    elif kind == "f16":
        with torch.no_grad():
            for p in ref.parameters():
                if p.ndim == 2:
                    p.copy_(p.half().float())
    assert check_gguf(model) is model.config
    path = save_gguf(model, tmp_path / f"{family}.gguf", tokenizer=tok, float_type="f16" if kind == "f16" else "f32")
    _check_read_back(model, path, vocab)
    fields, _ = _read(path)
    assert fields["tokenizer.ggml.model"] == ("llama" if family in SPM_FAMILIES else "gpt2")
    if family in NO_LOADER:
        return
    if family == "mistral":  # its loader renames a llama file named *mistral* to a gguf arch that does not exist
        with pytest.raises(NotImplementedError, match="Unknown gguf model_type: mistral"):
            _reload(path, model)
        return
    loaded = _reload(path, model)
    assert type(loaded).__name__ == type(model).__name__
    for name, mod in model.named_modules():
        if getattr(mod, "weight_quantizer", None) is not None:
            assert torch.equal(loaded.get_submodule(name).weight, ref.get_submodule(name).weight), name
    assert _logits_diff(loaded, ref, vocab) <= 1e-4


@pytest.mark.parametrize(("family", "form"), [("llama", "llama"), ("qwen3", "gpt2")])
def test_tokenizer_forms_round_trip(family: str, form: str, tokenizers: dict[str, Any], tmp_path: Path) -> None:
    tok = tokenizers[form]
    model = _model(family, len(tok))
    path = save_gguf(model, tmp_path / "m.gguf", tokenizer=tok)
    assert _read(path)[0]["tokenizer.ggml.model"] == form
    back = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    for text in ("def f(x):\n    return x + 1", "  leading spaces, caf\u00e9 \u2603"):
        assert back(text, add_special_tokens=False)["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]


def test_gemma_norms_are_stored_as_one_plus_weight(tokenizers: dict[str, Any], tmp_path: Path) -> None:
    """llama.cpp's Gemma multiplies by the stored norm weight; transformers' by (1 + weight)."""
    tok = tokenizers["llama"]
    model = _model("gemma", len(tok))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_()
    path = save_gguf(model, tmp_path / "g.gguf", tokenizer=tok)
    stored = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(path)).tensors}
    want = model.model.layers[1].post_attention_layernorm.weight.detach().numpy() + 1
    np.testing.assert_array_equal(stored["blk.1.ffn_norm.weight"], want)


@pytest.mark.parametrize(("family", "match"), [
    ("qwen2", r"^sliding_window=4: llama\.cpp's qwen2 has no sliding-window attention$"),
    ("mistral", r"^sliding_window=8: llama\.cpp's llama has no sliding-window attention$"),
    ("gemma3_text", r"^layer_types: llama\.cpp's gemma3 windows layers i % 6 < 5"),
    ("smollm3", r"^no_rope_layers=\[1, 0\]: llama\.cpp's smollm3 fixes every 4th layer without rope$"),
])
def test_families_llamacpp_cannot_state_are_refused(family: str, match: str) -> None:
    """The shipped tiny configs use conventions llama.cpp's loader fixes otherwise: refused in one
    line from the structure alone, meta-device models included."""
    with torch.device("meta"):
        model = tiny_decoder(family)
    with pytest.raises(UnsupportedModelError, match=match) as err:
        check_gguf(model)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("overrides", "match"), [
    (dict(hidden_act="gelu"), r"^hidden_act='gelu': llama\.cpp's llama computes silu$"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
     r"^rope_parameters\['full_attention'\]: rope_type 'linear' is not written to GGUF"),
])
def test_settings_without_a_gguf_form_are_refused(overrides: dict[str, Any], match: str) -> None:
    with torch.device("meta"):
        model = tiny_decoder("llama", **overrides)
    with pytest.raises(UnsupportedModelError, match=match):
        check_gguf(model)


def test_a_tensor_without_a_gguf_name_is_refused_not_dropped(tokenizers: dict[str, Any], tmp_path: Path) -> None:
    model = _model("llama", len(tokenizers["gpt2"]))
    model.model.layers[0].register_buffer("extra_scale", torch.ones(4))
    with pytest.raises(UnsupportedModelError, match=r"^model\.layers\.0\.extra_scale: no GGUF tensor name"):
        save_gguf(model, tmp_path / "x.gguf", tokenizer=tokenizers["gpt2"])
    assert not list(tmp_path.iterdir())


def test_a_class_without_a_llamacpp_architecture_is_refused() -> None:
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(UnsupportedModelError, match=r"^GPT2LMHeadModel: no llama\.cpp GGUF architecture"):
        check_gguf(gpt2)
