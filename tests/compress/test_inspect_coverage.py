"""``compress inspect`` reports integer coverage: for a run folder and for an exported int8 ONNX file,
the share of Conv/MatMul/Gemm/Add work ORT runs in integers, the nodes it still runs in float by
name, and what the quantizer placement kept float on purpose with its reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import compress
from compress.cli import main

#: a small ResNet whose first conv and last Linear the ptq modifier keeps float (first_last: float):
#: ORT runs them as a float Conv and Gemm, the residual blocks as integer kernels
RECIPE = {
    "version": 1,
    "name": "coverage",
    "description": "ptq with first/last layers kept float",
    "model": {"name": "resnet", "kwargs": {"width": 4, "depth": 1, "num_classes": 10, "in_channels": 1}},
    "data": {"source": "digits", "calibration_samples": 32},
    "train": {"epochs": 1, "batch_size": 32, "lr": 0.1, "seed": 0},
    "stages": [{"name": "ptq", "modifiers": [{"type": "ptq", "scheme": "w8a8", "num_batches": 1,
                                                "first_last": "float"}]}],
    "validate": {"enabled": False},
}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("inspect") / "run"
    compress.apply(RECIPE, out_dir=out, quiet=True)
    return out


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    rc = main(["inspect", *argv])
    return rc, capsys.readouterr().out


def test_inspect_run_folder_names_float_nodes_and_reasons(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    final = next(e for e in json.loads((run_dir / "report.json").read_text())["exports"] if e["role"] == "final")
    assert final["float_nodes"] and final["kept_float"]  # the recipe leaves float layers to report
    rc, out = _cli(capsys, str(run_dir))
    assert rc == 0
    assert "integer coverage:" in out and "still float in ORT" in out
    for node in final["float_nodes"]:
        assert node in out  # by name, e.g. Conv:node_conv2d
    assert "kept float by the first/last-layer policy" in out


def test_inspect_onnx_names_float_nodes(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from compress.export.validation.runtimes import ort_coverage

    final = next(e for e in json.loads((run_dir / "report.json").read_text())["exports"] if e["role"] == "final")
    path = run_dir / final["path"]  # relative to the run folder
    cov = ort_coverage(path)
    assert any(n.startswith(("Conv:", "Gemm:")) for n in cov.float_nodes), cov
    rc, out = _cli(capsys, str(path))
    assert rc == 0
    assert f"integer coverage: {cov.share:.2f}" in out
    assert all(n in out for n in cov.float_nodes)
    # the run's report.json beside the file gives the placement's reasons too
    assert "kept float by the first/last-layer policy" in out


def test_inspect_folder_without_report_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no report.json" in err[0]
