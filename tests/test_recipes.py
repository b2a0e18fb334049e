"""Every shipped recipe loads, and runs end to end when shrunk to test size."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml

import compress
from compress.cli import shipped_recipes

RECIPES = shipped_recipes()
#: transformer layers kept of a shipped real Hugging Face model (MiniLM has 6)
MINILM_TEST_LAYERS = 2


def shrink(data: dict[str, Any]) -> dict[str, Any]:
    """The same pipeline at test size: fewer epochs, steps, samples and timed runs."""
    d = json.loads(json.dumps(data))
    model = d.setdefault("model", {})
    if str(model.get("hf_path", "")).startswith("package:"):
        # a shipped real model (all-MiniLM-L6-v2): its first layers, with their real weights.
        # SmoothQuant, calibration, head pruning and the export work on every layer alike, and
        # all 6 made these the slowest recipe tests (the two exports trace every layer)
        # SmolLM2 (30 layers) likewise keeps its first 2
        model.setdefault("kwargs", {}).setdefault("num_hidden_layers", MINILM_TEST_LAYERS)
        # with 2 of SmolLM2's 30 layers its float embedding table is most of the file: the size
        # threshold is set for the whole model
        d.get("validate", {}).get("thresholds", {}).pop("max_size_ratio", None)
    train = d.setdefault("train", {})
    train["epochs"] = min(train.get("epochs", 0), 2)
    data_spec = d.setdefault("data", {})
    data_spec["calibration_samples"] = min(data_spec.get("calibration_samples", 256), 64)
    data_spec["eval_samples"] = min(data_spec.get("eval_samples") or 10**9, 128)
    if data_spec.get("source") == "text":
        kw = data_spec.setdefault("kwargs", {})
        kw["samples"] = min(kw.get("samples", 10**9), 96)
    if data_spec.get("source") == "text_lm":
        kw = data_spec.setdefault("kwargs", {})
        kw["samples"], kw["seq_len"] = min(kw.get("samples", 512), 8), min(kw.get("seq_len", 128), 32)
        data_spec["calibration_samples"] = min(data_spec["calibration_samples"], 8)
    for stage in d.get("stages", []):
        if stage.get("epochs"):
            stage["epochs"] = min(math.ceil(stage["epochs"]), 2)
        if stage.get("steps"):
            stage["steps"] = min(stage["steps"], 4)
        for mod in stage.get("modifiers", []):
            if mod.get("type") == "autoround":  # its steps: the same code runs at any count
                mod["iters"] = min(mod.get("iters", 200), 4)
            if mod.get("type") == "awq":  # the searches' grids: the same code runs at any size
                mod["grid"], mod["clip_grid"] = min(mod.get("grid", 20), 4), min(mod.get("clip_grid", 20), 4)
            teacher = mod.get("teacher")
            if isinstance(teacher, dict) and teacher.get("train_epochs"):
                teacher["train_epochs"] = min(teacher["train_epochs"], 2)
    val = d.setdefault("validate", {})
    val.update({"runs": 2, "warmup": 1, "batch_sizes": [1, 4]})
    if "generate_tokens" in val:  # prompts are what the 32-token windows leave
        val["generate_tokens"] = min(val["generate_tokens"], 8)
    return d


def test_shipped_recipes_exist() -> None:
    assert "quickstart" in RECIPES
    assert len(RECIPES) >= 1


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_loads(name: str) -> None:
    recipe = compress.load_recipe(RECIPES[name])
    assert recipe.name
    assert recipe.description.strip(), f"{name}: recipes describe themselves (compress recipes shows it)"


#: the trained reference LLM the llm_* recipes load; tests use a tiny random one instead
REFERENCE_LLM = "runs/reference_llm"


#: the int4 LLM recipes (GPTQ, AWQ) on the tiny Llama: 25 s each in a full run; SparseGPT 2:4 on
#: SmolLM2's first two layers, 20-40 s (tests/pruning/test_sparse_recipes.py runs a tiny one fast)
SLOW_RECIPES = {"llm_autoround_w4", "llm_awq_w4", "llm_gptq_w4", "llm_nvfp4", "llm_rotate_w4a8", "llm_sparsegpt_2of4"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_RECIPES else n
                                  for n in sorted(RECIPES)])
def test_recipe_runs_small(name: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    raw = yaml.safe_load(RECIPES[name].read_text())
    if raw["model"].get("hf_path") == REFERENCE_LLM:
        tiny = request.getfixturevalue("tiny_llm_dir")
        raw["model"]["hf_path"] = tiny
        raw["data"]["kwargs"]["tokenizer"] = tiny
    recipe = compress.load_recipe(shrink(raw))
    report = compress.apply(recipe, out_dir=tmp_path / name, quiet=True)
    assert (tmp_path / name / "report.json").is_file()
    assert [s.name for s in report.stages] == [s.name for s in recipe.stages]
    assert report.baseline.params and report.final.params
    if recipe.export.enabled:
        assert report.exports, f"{name}: export enabled but nothing exported"
        for e in report.exports:
            if e.role == "checkpoint":  # a Hugging Face folder: the config and the weights
                assert (tmp_path / name / e.path / "config.json").is_file()
                assert (tmp_path / name / e.path / "model.safetensors").is_file()
            else:
                assert (tmp_path / name / e.path).is_file()
        assert recipe.export.compressed_tensors == any(e.role == "checkpoint" for e in report.exports)
    if recipe.export.enabled and recipe.export.onnx and recipe.validate_.enabled:
        assert report.validation, f"{name}: validation enabled but no runtime results"
    if recipe.export.generation:  # the LLM recipes: KV-cache files, validated by generating
        assert {e.format for e in report.exports} <= {"onnx-generation-int4", "onnx-generation-w8a8",
                                                     "onnx-generation-fp32"}
        assert all(v.generation and v.parity["top1_agreement"] is not None for v in report.validation)
