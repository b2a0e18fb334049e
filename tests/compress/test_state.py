"""Compression state saved as data: a run's final.pt restores the pruned + quantized model onto the
float one with weights_only=True, and a run folder holding a pickle that runs code is refused."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import yaml

import compress
from compress.core.errors import RecipeError
from compress.models import load_model
from compress.recipe import load_recipe
from compress.state import restore_compressed
from compress.training import evaluate

RECIPE = {
    "version": 1, "name": "state",
    "model": {"name": "resnet", "kwargs": {"width": 8, "depth": 1, "num_classes": 10, "in_channels": 1}},
    "data": {"source": "digits", "calibration_samples": 64, "eval_samples": 128},
    "train": {"epochs": 1, "batch_size": 64, "lr": 0.05, "seed": 0},
    "stages": [
        {"name": "prune", "modifiers": [{"type": "prune", "ratio": 0.5, "importance": "l2"}]},
        {"name": "ptq", "modifiers": [{"type": "ptq", "scheme": "w8a8", "first_last": "float"}]},
    ],
    "export": {"enabled": False},
}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("state") / "run"
    compress.apply(RECIPE, out_dir=out, quiet=True)
    return out


def test_final_state_restores_the_pruned_quantized_model(run_dir: Path) -> None:
    import json

    from compress.quantization import quantizers

    recipe = load_recipe(run_dir / "recipe.yaml")
    model = restore_compressed(lambda: load_model(recipe.model), run_dir / "checkpoints" / "final.pt")
    report = json.loads((run_dir / "report.json").read_text())
    assert sum(p.numel() for p in model.parameters()) == report["final"]["params"]
    assert next(quantizers(model), None) is not None
    data = compress.build_data(recipe.data, batch_size=64, seed=recipe.data.seed)
    acc = evaluate(model, data.eval, metric="accuracy", device=torch.device("cpu"))
    assert acc == pytest.approx(report["final"]["accuracy"], abs=1e-9)
    assert not (run_dir / "checkpoints" / "final_model.pt").exists()


def test_each_modifier_saves_its_own_state_in_stage_order(run_dir: Path) -> None:
    import json

    data = torch.load(run_dir / "checkpoints" / "final.pt", weights_only=True)
    state = json.loads(data["compression"])
    assert state["version"] == 2
    assert [m["type"] for m in state["modifiers"]] == ["prune", "ptq"]
    assert state["modifiers"][0]["state"]["plan"]["steps"]
    assert state["modifiers"][1]["state"]["spec"]["first_last"] == "float"


def test_a_version_1_state_still_restores(run_dir: Path, tmp_path: Path) -> None:
    """Runs saved before each modifier owned its state kept the plans and the quantize spec apart."""
    import json

    from compress.quantization import quantizers

    recipe = load_recipe(run_dir / "recipe.yaml")
    data = torch.load(run_dir / "checkpoints" / "final.pt", weights_only=True)
    mods = json.loads(data["compression"])["modifiers"]
    q = mods[1]["state"]
    data["compression"] = json.dumps({
        "format": "compress.compression-state", "version": 1, "pruning_plans": [mods[0]["state"]["plan"]],
        "quantization": {"type": "ptq", "spec": q["spec"], "modules": q["modules"], "quantizers": q["quantizers"]},
    })
    torch.save(data, tmp_path / "v1.pt")
    old = restore_compressed(lambda: load_model(recipe.model), tmp_path / "v1.pt")
    new = restore_compressed(lambda: load_model(recipe.model), run_dir / "checkpoints" / "final.pt")
    x = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(3))
    assert len(list(quantizers(old))) == len(list(quantizers(new))) > 0
    assert torch.equal(old(x), new(x))


def test_a_placement_naming_missing_modules_is_refused(run_dir: Path, tmp_path: Path) -> None:
    """A final.pt saved when the zoo's residual add was a module (``layer1.0.add``): its placement
    keys would silently match nothing, so restoring it is an error that says so."""
    recipe = load_recipe(run_dir / "recipe.yaml")
    data = torch.load(run_dir / "checkpoints" / "final.pt", weights_only=True)
    extra = data["model"]["quantizer_graph._extra_state"]
    entries = extra["placement"]["entries"]
    key = next(k for k in entries if k.startswith("layer1.0:add#"))
    entries["layer1.0.add:add#0"] = entries.pop(key)
    torch.save(data, tmp_path / "old.pt")
    with pytest.raises(RecipeError, match=r"placement names modules the model does not have \(layer1.0.add\)"):
        restore_compressed(lambda: load_model(recipe.model), tmp_path / "old.pt")


class _Payload:
    """Unpickling this runs code: it creates a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.makedirs, (str(self.marker),))


def test_a_run_folder_with_a_code_running_pickle_is_refused(tmp_path: Path) -> None:
    from compress.validation import validate_run_cuda

    marker = tmp_path / "PWNED"
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "recipe.yaml").write_text(yaml.safe_dump(RECIPE))
    with open(run / "checkpoints" / "final.pt", "wb") as f:
        pickle.dump({"model": _Payload(marker)}, f)
    with pytest.raises(RecipeError, match="pickled Python objects"):
        validate_run_cuda(run, device="cpu")
    assert not marker.exists()


def test_a_legacy_pickled_module_is_refused_with_a_clear_message(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    model = load_model(RECIPE["model"])
    torch.save(model, run / "checkpoints" / "final_model.pt")  # what older runs wrote
    torch.save({"model": model.state_dict(), "epoch": 0}, run / "checkpoints" / "final.pt")
    with pytest.raises(RecipeError, match=r"no compression state.*final_model\.pt.*not loaded"):
        restore_compressed(lambda: load_model(RECIPE["model"]), run / "checkpoints" / "final.pt")


def test_report_sizes_are_deployed_sizes_and_the_plot_fits_them(run_dir: Path) -> None:
    import json

    from compress.report import _fit

    r = json.loads((run_dir / "report.json").read_text())
    base, (pruned, quant) = r["baseline"]["size_bytes"], [s["model"]["size_bytes"] for s in r["stages"]]
    assert pruned < 0.8 * base  # half the channels gone
    assert quant < 0.35 * pruned  # int8 weights: a quarter of fp32, plus scales and the float first/last layer
    assert r["final"]["size_bytes"] == quant
    lo, hi = _fit([0.95, 0.97, 0.99])
    assert 0.93 < lo < 0.95 and 0.99 < hi < 1.0
    lo, hi = _fit([305.3, 306.4], floor=0.0)
    assert hi - lo < 2.0
