"""Data sources and build_data."""

from __future__ import annotations

import re
import sys
import textwrap

import pytest
import torch
from torch.utils.data import DistributedSampler

from compress.core.errors import RecipeError
from compress.data import build_data, stratified_indices
from compress.data.digits import load_digits_tensors
from compress.data.text import corpus, docstring_sentences
from compress.models import build_zoo_model
from compress.recipe import DataSpec


def all_of(loader) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*loader)
    return torch.cat(xs), torch.cat(ys)


# ---- digits ---------------------------------------------------------------------------------


def test_digits_split_sizes_and_shapes() -> None:
    b = build_data(DataSpec(source="digits", calibration_samples=10_000), batch_size=32, seed=0)
    assert b.sizes["train"] + b.sizes["calibration"] + b.sizes["eval"] == 1797
    assert abs(b.sizes["train"] - 0.60 * 1797) < 10
    assert abs(b.sizes["calibration"] - 0.15 * 1797) < 10
    assert abs(b.sizes["eval"] - 0.25 * 1797) < 10
    assert b.num_classes == 10 and b.input_shape == (1, 8, 8) and b.task == "classification"
    assert b.example_inputs.shape == (2, 1, 8, 8)
    x, y = next(iter(b.train))
    assert x.shape == (32, 1, 8, 8) and y.dtype == torch.long


def test_digits_calibration_cap_and_eval_cap() -> None:
    b = build_data(DataSpec(calibration_samples=100, eval_samples=50), batch_size=32, seed=0)
    assert b.sizes["calibration"] == 100 and b.sizes["eval"] == 50
    assert len(all_of(b.calibration)[0]) == 100
    none = build_data(DataSpec(calibration_samples=0), batch_size=32, seed=0)
    assert none.calibration is None


def test_stratified_indices_disjoint_and_balanced() -> None:
    _, y = load_digits_tensors()
    parts = stratified_indices(y, (0.6, 0.15, 0.25), seed=3)
    flat = [i for p in parts for i in p]
    assert sorted(flat) == list(range(len(y)))  # a partition: disjoint and complete
    overall = torch.bincount(y, minlength=10).float() / len(y)
    for p in parts:
        frac = torch.bincount(y[p], minlength=10).float() / len(p)
        assert (frac - overall).abs().max() < 0.01


def test_digits_deterministic_by_seed_and_normalized() -> None:
    spec = DataSpec(source="digits", seed=1)
    a = build_data(spec, batch_size=64, seed=0)
    b = build_data(spec, batch_size=64, seed=0)
    c = build_data(DataSpec(source="digits", seed=2), batch_size=64, seed=0)
    ea, eb, ec = all_of(a.eval), all_of(b.eval), all_of(c.eval)
    torch.testing.assert_close(ea, eb, atol=0, rtol=0)
    assert not torch.equal(ea[1], ec[1])
    # the same train shuffle for the same seed, another one for another seed
    xa = next(iter(a.train))[1]
    assert torch.equal(xa, next(iter(b.train))[1])
    assert not torch.equal(xa, next(iter(build_data(spec, batch_size=64, seed=5).train))[1])
    tx = a.train.dataset.tensors[0]
    assert abs(float(tx.mean())) < 1e-4 and abs(float(tx.std()) - 1) < 1e-4


def test_digits_resize_and_channels() -> None:
    b = build_data(DataSpec(kwargs={"image_size": 16, "channels": 3}), batch_size=8, seed=0)
    assert b.input_shape == (3, 16, 16)
    x, _ = next(iter(b.eval))
    assert x.shape == (128, 3, 16, 16)
    torch.testing.assert_close(x[:, 0], x[:, 2], atol=0, rtol=0)
    with pytest.raises(RecipeError, match=r"data.kwargs.size: data source 'digits' has no kwarg 'size'"):
        build_data(DataSpec(kwargs={"size": 16}), batch_size=8, seed=0)
    with pytest.raises(RecipeError, match=r"rejected its kwargs: image_size"):
        build_data(DataSpec(kwargs={"image_size": 0}), batch_size=8, seed=0)


def test_distributed_train_sharding() -> None:
    spec = DataSpec(source="digits")
    r0 = build_data(spec, batch_size=16, seed=0, rank=0, world_size=2)
    r1 = build_data(spec, batch_size=16, seed=0, rank=1, world_size=2)
    assert isinstance(r0.train_sampler, DistributedSampler)
    i0, i1 = set(r0.train_sampler), set(r1.train_sampler)
    assert not i0 & i1 and len(i0 | i1) == r0.sizes["train"]
    assert len(all_of(r0.eval)[0]) == r0.sizes["eval"]  # eval is not sharded
    with pytest.raises(RecipeError, match="rank"):
        build_data(spec, batch_size=16, seed=0, rank=2, world_size=2)


def test_resnet_learns_digits() -> None:
    torch.manual_seed(0)
    b = build_data(DataSpec(), batch_size=64, seed=0)
    model = build_zoo_model("resnet", width=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    for _ in range(4):
        model.train()
        for x, y in b.train:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        x, y = all_of(b.eval)
        acc = (model(x).argmax(1) == y).float().mean().item()
    assert acc >= 0.9


# ---- synthetic --------------------------------------------------------------------------------


def test_synthetic_deterministic_and_learnable() -> None:
    kw = {"shape": [2, 8, 8], "num_classes": 4, "samples": 800}
    a = build_data(DataSpec(source="synthetic", kwargs=kw, seed=7), batch_size=32, seed=0)
    b = build_data(DataSpec(source="synthetic", kwargs=kw, seed=7), batch_size=32, seed=0)
    c = build_data(DataSpec(source="synthetic", kwargs=kw, seed=8), batch_size=32, seed=0)
    torch.testing.assert_close(all_of(a.eval), all_of(b.eval), atol=0, rtol=0)
    assert not torch.equal(all_of(a.eval)[0], all_of(c.eval)[0])
    assert a.input_shape == (2, 8, 8) and a.num_classes == 4
    assert a.sizes["train"] + a.sizes["eval"] + 120 == 800  # calibration 15% of 800
    # learnable: a linear classifier beats chance (0.25) by far
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(128, 4))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(5):
        for x, y in a.train:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    x, y = all_of(a.eval)
    assert (model(x).argmax(1) == y).float().mean() > 0.7


def test_synthetic_flat_shape() -> None:
    b = build_data(
        DataSpec(source="synthetic", kwargs={"shape": [20], "samples": 200}), batch_size=16, seed=0
    )
    assert b.input_shape == (20,) and b.example_inputs.shape == (2, 20)


# ---- text -------------------------------------------------------------------------------------


def test_docstring_sentences_keep_prose_only() -> None:
    doc = "Return the sum of the two numbers given here.\n\n    >>> add(1, 2)\n    3\n\n:param a: first value of it"
    assert docstring_sentences(doc) == ["Return the sum of the two numbers given here."]


@pytest.mark.slow  # 61 s in a full run: three corpora read from the stdlib's docstrings
def test_corpus_real_sentences_deterministic() -> None:
    a = corpus(200, seed=0)
    assert a == corpus(200, seed=0)
    assert a != corpus(200, seed=1)
    assert len(a) == 200 and len(set(a)) == 200
    assert all(s[0].isupper() and s.endswith(".") and len(s.split()) >= 6 for s in a)


def test_text_source_tokenizes() -> None:
    pytest.importorskip("transformers")
    b = build_data(DataSpec(source="text", kwargs={"samples": 120, "max_length": 32}), batch_size=8, seed=0)
    assert b.task == "embedding" and b.num_classes is None and b.input_shape == (32,)
    inputs, targets = next(iter(b.train))
    assert targets is None
    assert {"input_ids", "attention_mask"} <= set(inputs) and inputs["input_ids"].shape == (8, 32)
    assert inputs["input_ids"].dtype == torch.long
    assert b.sizes == {"train": 72, "calibration": 18, "eval": 30}
    # the tokens are the sentence: an untruncated one decodes back to its letters
    ds = b.train.dataset
    from compress.models import load_tokenizer

    tok = load_tokenizer()
    i = next(i for i in range(len(ds)) if int(ds[i]["attention_mask"].sum()) < 32)
    decoded = tok.decode(ds[i]["input_ids"], skip_special_tokens=True)
    assert re.sub("[^a-z]", "", decoded) == re.sub("[^a-z]", "", ds.sentences[i].lower())
    assert int(ds[i]["attention_mask"].sum()) == int((ds[i]["input_ids"] != tok.pad_token_id).sum())


# ---- factories and errors ---------------------------------------------------------------------


@pytest.fixture
def data_module(tmp_path, monkeypatch):
    (tmp_path / "my_data.py").write_text(
        textwrap.dedent(
            """
            import torch
            from torch.utils.data import DataLoader, TensorDataset

            def _ds(n, seed):
                g = torch.Generator().manual_seed(seed)
                return TensorDataset(torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g))

            def dataset(n=100):
                return _ds(n, 0)

            def splits():
                return {"train": _ds(60, 1), "eval": DataLoader(_ds(20, 2), batch_size=4)}

            def unlabelled():
                return [torch.randn(4) for _ in range(40)]

            class Bare(torch.utils.data.Dataset):
                def __len__(self):
                    return 30
                def __getitem__(self, i):
                    return torch.full((4,), float(i))

            def bare():
                return Bare()

            def bad_keys():
                return {"training": _ds(10, 0)}

            def bad_type():
                return 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_data"
    sys.modules.pop("my_data", None)


def test_factory_dataset_is_split(data_module: str) -> None:
    b = build_data(DataSpec(source=f"{data_module}:dataset", kwargs={"n": 200}), batch_size=16, seed=0, trust_code=True)
    assert b.sizes == {"train": 120, "calibration": 30, "eval": 50}
    assert b.num_classes == 3 and b.input_shape == (5,) and b.task == "classification"


def test_factory_dict_of_splits(data_module: str) -> None:
    b = build_data(DataSpec(source=f"{data_module}:splits", calibration_samples=16), batch_size=16, seed=0, trust_code=True)
    assert b.sizes == {"train": 60, "calibration": 16, "eval": 20}
    x, y = next(iter(b.eval))
    assert x.shape == (20, 5) and y.shape == (20,)


def test_factory_unlabelled(data_module: str) -> None:
    b = build_data(DataSpec(source=f"{data_module}:bare"), batch_size=8, seed=0, trust_code=True)
    assert b.task == "embedding" and b.num_classes is None
    inputs, targets = next(iter(b.train))
    assert inputs.shape == (8, 4) and targets is None


def test_factory_errors(data_module: str) -> None:
    with pytest.raises(RecipeError, match=r"^data.source: cannot import module 'nope_pkg_xyz'"):
        build_data(DataSpec(source="nope_pkg_xyz:make"), batch_size=8, seed=0, trust_code=True)
    with pytest.raises(RecipeError, match=r"returned keys \['training'\]; valid keys"):
        build_data(DataSpec(source=f"{data_module}:bad_keys"), batch_size=8, seed=0, trust_code=True)
    with pytest.raises(RecipeError, match=r"gave dataset as a int; expected a map-style torch Dataset"):
        build_data(DataSpec(source=f"{data_module}:bad_type"), batch_size=8, seed=0, trust_code=True)
    with pytest.raises(RecipeError, match=r"gave dataset as a list"):
        build_data(DataSpec(source=f"{data_module}:unlabelled"), batch_size=8, seed=0, trust_code=True)


def test_unknown_source_lists_valid() -> None:
    with pytest.raises(
        RecipeError,
        match=r"unknown data source 'digit'; valid: digits, synthetic, text, text_lm \(did you mean 'digits'\?\)",
    ):
        build_data(DataSpec(source="digit"), batch_size=8, seed=0)


def test_errors_point_at_the_recipe_line(tmp_path) -> None:
    from compress.recipe import load_recipe

    path = tmp_path / "r.yaml"
    path.write_text(
        "version: 1\nmodel:\n  name: resnet\ndata:\n  source: digits\n  kwargs:\n    image_sise: 16\n"
    )
    recipe = load_recipe(path)
    with pytest.raises(RecipeError, match=rf"^{path}:7: data.kwargs.image_sise: .*did you mean 'image_size'"):
        build_data(recipe.data, batch_size=8, seed=0, where=recipe.where)
