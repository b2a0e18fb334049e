"""The runner (compress.apply) and the CLI: run folder, report, resume, exit codes, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from compress.export.records import ValidationRecord

import compress
from compress.cli import main
from compress.core.errors import RecipeError
from compress.recipe import load_recipe
from compress.report import ModelFigures, Report
from compress.runner import check_thresholds

TINY = {
    "version": 1,
    "name": "tiny",
    "description": "tiny MLP on digits",
    "model": {"name": "mlp", "kwargs": {"hidden": 64, "depth": 1, "num_classes": 10, "in_features": 64}},
    "data": {"source": "digits", "calibration_samples": 64},
    "train": {"epochs": 3, "batch_size": 32, "lr": 0.1, "seed": 0},
    "export": {"enabled": False},
}


def write_recipe(tmp_path: Path, data: dict, name: str = "r.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data, sort_keys=False))
    return p


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Report]:
    out = tmp_path_factory.mktemp("run") / "tiny"
    report = compress.apply(TINY, out_dir=out, quiet=True)
    return out, report


def test_apply_writes_the_run_folder(tiny_run: tuple[Path, Report]) -> None:
    out, _report = tiny_run
    for f in ("recipe.yaml", "report.json", "report.md", "run.log", "checkpoints/baseline.pt", "checkpoints/final.pt"):
        assert (out / f).is_file(), f
    data = json.loads((out / "report.json").read_text())
    for key in ("recipe", "versions", "machine", "baseline", "stages", "final", "exports", "validation", "thresholds"):
        assert key in data
    assert set(data["baseline"]) >= {"accuracy", "params", "size_bytes"}
    assert set(data["final"]) >= {"accuracy", "params", "macs"}
    assert data["baseline"]["accuracy"] > 0.85
    assert data["baseline"]["params"] == 64 * 64 + 64 + 64 * 10 + 10
    assert data["final"]["macs"] == 64 * 64 + 64 * 10
    # the resolved recipe reloads to the same recipe
    assert load_recipe(out / "recipe.yaml").to_dict() == load_recipe(TINY).to_dict()
    assert "| baseline |" in (out / "report.md").read_text()
    assert (out / "accuracy_vs_size.png").stat().st_size > 1000


def test_report_states_the_peak_rss(tiny_run: tuple[Path, Report]) -> None:
    import resource

    from compress.cli import summary

    out, report = tiny_run
    data = json.loads((out / "report.json").read_text())
    # at least the memory this process held when the run ended, at most its peak now (Linux: KiB)
    now_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    assert 50 < data["peak_rss_mb"] <= now_mb + 0.1
    assert f"Peak RSS {data['peak_rss_mb']:,.0f} MB" in (out / "report.md").read_text()
    assert f"peak RSS {report.peak_rss_mb:,.0f} MB" in summary(report, out=out)
    # the data as built is stated beside it (text_lm adds whether windows start with BOS)
    assert data["data"]["source"] == "digits" and data["data"]["eval_samples"] > 0
    assert "Data: source: digits" in (out / "report.md").read_text()


def test_existing_run_folder_is_not_overwritten(tiny_run: tuple[Path, Report]) -> None:
    out, _ = tiny_run
    before = (out / "report.json").read_bytes()
    with pytest.raises(RecipeError, match="--overwrite"):
        compress.apply(TINY, out_dir=out, quiet=True)
    assert (out / "report.json").read_bytes() == before


def test_resume_loads_the_baseline_checkpoint(tiny_run: tuple[Path, Report], tmp_path: Path) -> None:
    out, report = tiny_run
    copy = tmp_path / "copy"
    (copy / "checkpoints").mkdir(parents=True)
    state = torch.load(out / "checkpoints" / "baseline.pt", weights_only=True)
    g = torch.Generator().manual_seed(1)
    # scramble the weights: a resumed run must use them, a retrained one would not
    state["model"] = {k: torch.randn(v.shape, generator=g) for k, v in state["model"].items()}
    torch.save(state, copy / "checkpoints" / "baseline.pt")
    (copy / "recipe.yaml").write_text((out / "recipe.yaml").read_text())  # a run folder has its recipe
    resumed = compress.apply(TINY, out_dir=copy, resume=True, quiet=True)
    assert resumed.baseline.accuracy is not None and report.baseline.accuracy is not None
    assert resumed.baseline.accuracy < 0.5 < report.baseline.accuracy


def test_bad_input_is_found_before_the_folder_is_made(tmp_path: Path) -> None:
    bad = {**TINY, "model": {"name": "resnett"}}
    with pytest.raises(RecipeError, match="resnet"):
        compress.apply(bad, out_dir=tmp_path / "x", quiet=True)
    assert not (tmp_path / "x").exists()


def _report(baseline: float, final: float, speedup: float, cosine: float) -> Report:
    r = Report(recipe={}, baseline=ModelFigures(accuracy=baseline), final=ModelFigures(accuracy=final))
    r.validation.append(ValidationRecord(
        runtime="onnxruntime", device="cpu", precision="int8", format="onnx-int8-qdq", model_path=Path("m.onnx"),
        role="final", accuracy=final, parity={"cosine": cosine, "top1_agreement": 0.99},
        speedup={1: 0.9, 32: speedup}, size_bytes=1, threads=1))
    return r


def test_thresholds_compare_measured_values() -> None:
    recipe = load_recipe({**TINY, "validate": {"thresholds": {"max_accuracy_drop": 0.01, "min_speedup": 1.2,
                                                              "min_cosine": 0.99}}})
    ok = {t.name: t for t in check_thresholds(recipe, _report(0.95, 0.945, 1.5, 0.995))}
    assert ok["max_accuracy_drop"].passed and ok["max_accuracy_drop"].value == pytest.approx(0.005)
    assert ok["min_speedup"].passed and ok["min_speedup"].value == 1.5
    bad = {t.name: t for t in check_thresholds(recipe, _report(0.95, 0.90, 1.1, 0.98))}
    assert not bad["max_accuracy_drop"].passed
    assert not bad["min_speedup"].passed
    assert not bad["min_cosine"].passed


# ---- CLI ---------------------------------------------------------------------------------------


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


@pytest.mark.parametrize(
    ("change", "expect"),
    [
        ({"model": {"name": "resnett"}}, "did you mean 'resnet'"),
        ({"model": {"name": "no_such_pkg.mod:factory"}}, "no_such_pkg"),
        ({"model": {"name": "mlp", "checkpoint": "/nonexistent/w.pt"}}, "/nonexistent/w.pt"),
        ({"data": {"source": "digitz"}}, "did you mean 'digits'"),
        ({"train": {"epochs": -1}}, "train.epochs"),
        ({"train": {"metric": "acuracy"}}, "did you mean 'accuracy'"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: dict, expect: str
) -> None:
    recipe = write_recipe(tmp_path, {**TINY, **change})
    rc, _, err = run_cli(capsys, "apply", str(recipe), "--out", str(tmp_path / "out"), "--quiet")
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert expect in lines[0]
    assert str(recipe) in lines[0] or "model" in lines[0] or "data" in lines[0]
    assert not (tmp_path / "out").exists()


def test_cli_malformed_yaml_names_the_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text("version: 1\nmodel:\n  name: mlp\n  kwargs: {hidden: [64\n")
    rc, _, err = run_cli(capsys, "apply", str(p))
    assert rc == 2
    assert f"{p}:" in err and "malformed YAML" in err
    assert len(err.strip().splitlines()) == 1


def test_cli_bad_override_and_bad_argument(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = write_recipe(tmp_path, TINY)
    rc, _, err = run_cli(capsys, "apply", str(recipe), "--set", "train.lr")
    assert rc == 2 and "key=value" in err
    rc, _, err = run_cli(capsys, "apply", str(recipe), "--set", "train.lr=-3")
    assert rc == 2 and "--set train.lr=-3" in err
    with pytest.raises(SystemExit) as exc:
        main(["apply", str(recipe), "--device", "tpu"])
    assert exc.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_cli_apply_dry_run_and_inspect(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = write_recipe(tmp_path, TINY)
    rc, out, _ = run_cli(capsys, "apply", str(recipe), "--dry-run")
    assert rc == 0 and "recipe tiny" in out and "params" in out
    assert not Path("runs/tiny").exists()
    rc, out, _ = run_cli(capsys, "inspect", str(recipe))
    assert rc == 0 and "name: tiny" in out


def test_cli_apply_and_inspect_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = write_recipe(tmp_path, {**TINY, "train": {**TINY["train"], "epochs": 1}})
    out = tmp_path / "run"
    rc, stdout, _ = run_cli(capsys, "apply", str(recipe), "--out", str(out), "--quiet")
    assert rc == 0, stdout
    assert "baseline accuracy" in stdout and (out / "report.json").is_file()
    rc, stdout, _ = run_cli(capsys, "inspect", str(out / "checkpoints" / "final.pt"))
    assert rc == 0 and "tensors" in stdout


def test_cli_recipes_lists_the_shipped_recipes(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_cli(capsys, "recipes")
    assert rc == 0
    assert "quickstart" in out
