"""The shipped quantization recipes load and run end to end (small) through compress.apply."""

from __future__ import annotations

from pathlib import Path

import pytest

import compress
from compress.recipe import load_recipe

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


@pytest.mark.parametrize("name", ["ptq_w8a8", "qat_w8a8"])
def test_digits_recipes_run_and_stay_close_to_fp32(name: str, tmp_path: Path) -> None:
    recipe = load_recipe(
        RECIPES / f"{name}.yaml",
        overrides=["train.epochs=4", "export.enabled=false", "stages.0.epochs=1"]
        if name == "qat_w8a8"
        else ["train.epochs=4", "export.enabled=false"],
    )
    report = compress.apply(recipe, out_dir=tmp_path / name, quiet=True)
    base, final = report.baseline.accuracy, report.final.accuracy
    assert base is not None and final is not None and base > 0.8
    assert base - final <= 0.03, (base, final)
    stage = report.stages[0]
    assert stage.metrics["quantized_modules"] > 5
    if name == "ptq_w8a8":
        rows = stage.tables["quantization_sensitivity"]
        layers = [r for r in rows if r["type"] != "activation"]
        assert len(layers) == stage.metrics["quantized_modules"] and "sqnr_db" in rows[0]
        assert any(r["type"] == "activation" for r in rows)  # the placed activation quantizers too
        assert any(a.endswith(".png") for a in stage.artifacts)


@pytest.mark.slow  # 35 s in a full run: the real MiniLM recipe end to end
def test_minilm_recipe_keeps_embeddings_close(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    recipe = load_recipe(
        RECIPES / "minilm_ptq.yaml",
        overrides=[
            "data.kwargs.samples=120",
            "data.kwargs.max_length=32",
            "data.calibration_samples=16",
            "export.enabled=false",
        ],
    )
    report = compress.apply(recipe, out_dir=tmp_path / "minilm", quiet=True)
    stage = report.stages[0]
    assert stage.metrics["quantized_modules"] == 36  # 6 layers x (q, k, v, o, up, down)
    # accuracy control chose on the calibration sentences (budget 0.005); the eval sentences were not used
    assert stage.metrics["met_budget"] and stage.metrics["quantized_metric"] >= 0.995
    assert report.final.accuracy is not None and report.final.accuracy >= 0.99
    assert report.final.accuracy != stage.metrics["quantized_metric"]
