"""The fault suite of the reliability issue: nothing of the user's is ever deleted, every bad input
exits 2 in one line, nothing half-written survives a failure.

Each test drives what a user did (the CLI or the Python API) and checks the exit code, the message
and what is left on disk.
"""

from __future__ import annotations

import errno
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import compress
from compress.cli import main
from compress.core.errors import RunFolderError
from compress.run_folder import MARKER

TINY: dict[str, Any] = {
    "version": 1,
    "name": "tiny",
    "model": {"name": "mlp", "kwargs": {"hidden": 16, "depth": 1, "num_classes": 10, "in_features": 64}},
    "data": {"source": "digits", "calibration_samples": 32, "eval_samples": 64},
    "train": {"epochs": 1, "batch_size": 64, "lr": 0.1, "seed": 0},
    "export": {"enabled": False},
}


def _recipe(tmp_path: Path, data: dict[str, Any] | None = None) -> Path:
    p = tmp_path / "recipe.yaml"
    p.write_text(yaml.safe_dump(data or TINY, sort_keys=False))
    return p


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _one_error_line(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("compress: error:"), err
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run folder, made once; tests copy it."""
    out = tmp_path_factory.mktemp("finished") / "run"
    compress.apply(TINY, out_dir=out, quiet=True)
    return out


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


# ---- 1. data loss ------------------------------------------------------------------------------------


def test_overwrite_refuses_a_folder_the_run_did_not_make(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "my_recipe.yaml").write_text("name: mine\n")
    (work / "notes.txt").write_text("months of notes")
    torch.save({"w": torch.ones(2)}, work / "model.pt")
    before = _tree(work)
    rc = main(["apply", str(_recipe(tmp_path)), "--out", str(work), "--overwrite", "--quiet"])
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and "not a compress run folder" in line and str(work) in line
    assert _tree(work) == before


def test_overwrite_refuses_the_current_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    here = tmp_path / "here"
    here.mkdir()
    recipe = _recipe(tmp_path)
    monkeypatch.chdir(here)
    # even a real run folder: the current folder is never cleared
    assert main(["apply", str(recipe), "--out", ".", "--quiet"]) == 0
    (here / "mine.txt").write_text("keep")
    before = _tree(here)
    rc = main(["apply", str(recipe), "--out", ".", "--overwrite", "--quiet"])
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and "current folder" in line
    assert _tree(here) == before


def test_overwrite_refuses_a_repository_root(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "train.py").write_text("print('mine')\n")
    before = _tree(repo)
    rc = main(["apply", str(_recipe(tmp_path)), "--out", str(repo), "--overwrite", "--quiet"])
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and "repository root" in line
    assert _tree(repo) == before


def test_overwrite_replaces_only_the_runs_files(finished: Path, tmp_path: Path) -> None:
    out = _copy(finished, tmp_path / "run")
    (out / "checkpoints" / "old_extra.pt.tmp").write_bytes(b"half")  # an interrupted write of the run
    (out / "my_empty_dir").mkdir()  # the user's, holding nothing: not the run's to remove either
    report = compress.apply(TINY, out_dir=out, overwrite=True, quiet=True)
    assert (out / "my_empty_dir").is_dir()
    assert report.baseline.accuracy is not None
    assert not (out / "checkpoints" / "old_extra.pt.tmp").exists()
    written = set(json.loads((out / MARKER).read_text())["files"])
    assert {"recipe.yaml", "report.json", "report.md", "run.log", "checkpoints/final.pt"} <= written


def test_overwrite_names_a_users_file_in_a_run_folder(finished: Path, tmp_path: Path) -> None:
    out = _copy(finished, tmp_path / "run")
    (out / "checkpoints" / "my_best.pt").write_bytes(b"the user's")
    before = _tree(out)
    with pytest.raises(RunFolderError, match=r"checkpoints/my_best\.pt was not written by the run"):
        compress.apply(TINY, out_dir=out, overwrite=True, quiet=True)
    assert _tree(out) == before


def test_resume_keeps_a_users_file_and_never_adopts_it(finished: Path, tmp_path: Path) -> None:
    out = _copy(finished, tmp_path / "run")
    (out / "export").mkdir(exist_ok=True)
    (out / "export" / "notes.md").write_text("mine")
    compress.apply(TINY, out_dir=out, resume=True, quiet=True)
    assert (out / "export" / "notes.md").read_text() == "mine"
    assert "export/notes.md" not in json.loads((out / MARKER).read_text())["files"]
    # so a later --overwrite still refuses rather than deleting it
    with pytest.raises(RunFolderError, match=r"export/notes\.md"):
        compress.apply(TINY, out_dir=out, overwrite=True, quiet=True)


def test_out_that_cannot_be_created_is_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    rc = main(["apply", str(_recipe(tmp_path)), "--out", str(blocker / "run"), "--quiet"])
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and "--out" in line


@pytest.mark.parametrize("how", ["oserror", "torch-zip-writer"])
def test_disk_full_is_one_line_and_leaves_no_half_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str], how: str) -> None:
    import shutil
    from collections import namedtuple

    real_save = torch.save
    real_usage = shutil.disk_usage
    full_disk = [False]

    def full(obj: Any, f: Any, *a: Any, **k: Any) -> None:
        if str(f).endswith(".tmp") and "final.pt" in str(f):
            Path(f).write_bytes(b"half a checkpoint")
            full_disk[0] = True
            if how == "oserror":
                raise OSError(errno.ENOSPC, "No space left on device", str(f))
            # what torch 2.x really raises when its zip writer hits a full disk
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 571776 vs 571664")
        real_save(obj, f, *a, **k)

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(torch, "save", full)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1, 1, 0) if full_disk[0] else real_usage(p))
    out = tmp_path / "run"
    rc = main(["apply", str(_recipe(tmp_path)), "--out", str(out), "--quiet"])
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and "No space left on device" in line and "final.pt" in line
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]
    assert not (out / "checkpoints" / "final.pt").exists()
    assert "Traceback" in (out / "run.log").read_text()  # the traceback is kept, in run.log


# ---- 2. the distribution's name ------------------------------------------------------------------------


def test_install_hints_name_this_project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tomllib

    import compress.core.imports as imports

    root = Path(imports.__file__).resolve().parents[2]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    # PyPI's `compress` is someone else's project: ours has its own name
    assert project["name"] == imports.DISTRIBUTION != "compress"
    monkeypatch.chdir(root)
    assert imports.install_hint("hf") == "pip install -e '.[hf]'"  # a clone: its own path
    monkeypatch.chdir(tmp_path)
    assert imports.install_hint("openvino") == f"pip install -e '{root}[openvino]'"
    # an install from the index: the index name
    monkeypatch.setattr(imports, "__file__", str(tmp_path / "site-packages" / "compress" / "core" / "imports.py"))
    assert imports.install_hint("triton") == "pip install 'compress-toolkit[triton]'"


# ---- 3. bad input: exit 2, one line -----------------------------------------------------------------


def _onnx_classifier(path: Path, classes: int) -> Path:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, classes)).eval()
    compress.export_onnx(model, torch.randn(2, 1, 8, 8), path)
    return path


@pytest.fixture(scope="module")
def classifiers(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("onnx")
    return _onnx_classifier(d / "ten.onnx", 10), _onnx_classifier(d / "seven.onnx", 7)


@pytest.mark.parametrize(
    ("argv", "expect"),
    [
        (["--data", "synthetic", "--data-kwargs", '{"shape": [32]}'], "input 'input' of ten.onnx takes shape"),
        (["--data-kwargs", "{bad"], "--data-kwargs: not valid JSON"),
        (["--reference", "SEVEN"], "a reference must compute the same outputs"),
    ],
    ids=["data-shape", "data-kwargs-json", "reference-shape"],
)
def test_validate_bad_input_is_one_line_exit_2(classifiers: tuple[Path, Path], argv: list[str], expect: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    ten, seven = classifiers
    argv = [str(seven) if a == "SEVEN" else a for a in argv]
    rc = main(["validate", str(ten), "--runs", "1", "--batch-sizes", "1", *argv])
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and expect in line


def test_inspect_of_a_garbage_onnx_is_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "g.onnx"
    bad.write_text("garbage")
    assert main(["inspect", str(bad)]) == 2
    assert "is not a readable ONNX model" in _one_error_line(capsys.readouterr().err)


def test_labels_the_model_cannot_predict_are_warned(classifiers: tuple[Path, Path],
                                                   caplog: pytest.LogCaptureFixture) -> None:
    _ten, seven = classifiers
    with caplog.at_level("WARNING"):
        compress.validate(seven, data="digits", batch_sizes=[1], runs=1, warmup=0)
    assert any("predicts 7 classes" in r.getMessage() for r in caplog.records), caplog.text


def test_a_user_factory_that_raises_names_the_factory_and_the_recipe_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "userfac.py").write_text("def make():\n    raise RuntimeError('weights file missing')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    recipe = _recipe(tmp_path, {**TINY, "model": {"name": "userfac:make"}})
    rc = main(["apply", str(recipe), "--out", str(tmp_path / "run"), "--quiet", "--trust-code"])
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and "recipe.yaml:4: model.name" in line and "'userfac:make' raised RuntimeError" in line
    assert not (tmp_path / "run").exists()  # found before the folder is touched


def test_an_hf_directory_with_an_invalid_config_is_bad_input(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": "big"}))
    recipe = _recipe(tmp_path, {**TINY, "model": {"hf_path": str(hf)}})
    rc = main(["apply", str(recipe), "--out", str(tmp_path / "run"), "--quiet"])
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and "model.hf_path" in line and "hidden_size" in line


def test_a_pickled_module_is_refused_without_advice_to_turn_safety_off(tmp_path: Path) -> None:
    from compress.core.errors import RecipeError

    torch.save(torch.nn.Linear(64, 10), tmp_path / "module.pt")  # a whole module: needs code to load
    with pytest.raises(RecipeError) as info:
        compress.load_model({"name": "mlp", "checkpoint": str(tmp_path / "module.pt")})
    msg = str(info.value)
    assert "will not run code" in msg and "weights_only set to False" not in msg and "\n" not in msg


# ---- 3b. the Python API: one-line CompressErrors, not TypeErrors from deep inside --------------------

_CONV = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(144, 10))
_X = torch.randn(4, 1, 8, 8)


@pytest.mark.parametrize(
    ("call", "error", "expect"),
    [
        (lambda: compress.quantize(_CONV, 8, [_X]), "RecipeError", "scheme: int 8 is not a QuantScheme"),
        (lambda: compress.quantize(_CONV, "w8a8", [_X], params=compress.QuantizeParams(runtime="gpu")),
         "RecipeError", "QuantizeParams: runtime:"),
        (lambda: compress.quantize("resnet", "w8a8", [_X]), "RecipeError", "quantize: model: expected a torch nn.Module"),
        (lambda: compress.quantize(_CONV, "w8a8", _X), "CalibrationError", "one tensor of shape [4, 1, 8, 8]"),
        (lambda: compress.gptq(_CONV, _X, ignore=["lm_head"]), "CalibrationError", "one tensor of shape"),
        (lambda: compress.prune(_CONV, example_inputs=None, ratio=0.5), "RecipeError", "prune: example_inputs is None"),
        (lambda: compress.quantize(_CONV, "w8a8", [_X], ignore=["x"]), "TargetMatchError",
         "quantize: ignore: pattern 'x'"),
        (lambda: compress.export_onnx("resnet", _X, "/tmp/never.onnx"), "RecipeError", "export_onnx: model: expected"),
        (lambda: compress.Session(TINY, "resnet"), "RecipeError", "Session: model: expected a torch nn.Module"),
        (lambda: compress.validate("/no/such.onnx"), "RecipeError", "model file '/no/such.onnx' not found"),
    ],
    ids=["scheme-int", "params-target", "model-string", "tensor-as-data", "gptq-tensor", "prune-no-example",
         "ignore-names-ignore", "export-string", "session-string", "validate-missing"],
)
def test_api_bad_input_is_a_one_line_compress_error(call: Any, error: str, expect: str) -> None:
    import copy

    from compress.core.errors import CompressError

    global _CONV
    saved = copy.deepcopy(_CONV)
    try:
        with pytest.raises(CompressError) as info:
            call()
    finally:
        _CONV = saved
    assert type(info.value).__name__ == error and expect in str(info.value), str(info.value)
    assert "\n" not in str(info.value) and "errors.pydantic.dev" not in str(info.value)


# ---- 4. conflicts found before training, by the run and by --dry-run alike ---------------------------


@pytest.mark.parametrize("scheme,why", [("w8a8_dynamic", "no QDQ ONNX form"), ("FP8", "float8 schemes have no ONNX")])
@pytest.mark.parametrize("dry", [True, False], ids=["dry-run", "apply"])
def test_a_scheme_without_qdq_form_with_export_is_refused_before_training(
        tmp_path: Path, dry: bool, scheme: str, why: str, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = _recipe(tmp_path, {**TINY, "export": {"enabled": True},
                                "stages": [{"name": "ptq", "modifiers": [{"type": "ptq", "scheme": "w8a8"}]}]})
    out = tmp_path / "run"
    rc = main(["apply", str(recipe), "--out", str(out), "--quiet",
               "--set", f"stages.0.modifiers.0.scheme={scheme}", *(["--dry-run"] if dry else [])])
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and "stages.0.modifiers.0.scheme" in line and why in line
    assert not out.exists()  # nothing trained, nothing written


@pytest.mark.parametrize("dry", [True, False], ids=["dry-run", "apply"])
def test_data_that_does_not_fit_the_model_is_named_before_training(
        tmp_path: Path, dry: bool, capsys: pytest.CaptureFixture[str]) -> None:
    wrong = {**TINY, "model": {"name": "mlp", "kwargs": {"hidden": 16, "depth": 1, "num_classes": 10, "in_features": 32}}}
    out = tmp_path / "run"
    rc = main(["apply", str(_recipe(tmp_path, wrong)), "--out", str(out), "--quiet", *(["--dry-run"] if dry else [])])
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and "data.source" in line and "digits" in line and "do not fit the model" in line
    assert not out.exists()


def test_dry_run_shows_the_overrides_it_applied(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = _recipe(tmp_path)
    assert main(["apply", str(recipe), "--dry-run"]) == 0
    plain = capsys.readouterr().out
    assert main(["apply", str(recipe), "--dry-run", "--set", "train.epochs=2"]) == 0
    shown = capsys.readouterr().out
    assert "overrides applied: train.epochs=2" in shown and "overrides" not in plain


def test_a_failed_run_claims_no_threshold_verdict_and_the_recipe_reads_as_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import compress.runner as runner

    def broken(*a: Any, **k: Any) -> None:
        raise RuntimeError("export broke")

    monkeypatch.setattr(runner, "_export_and_validate", broken)
    recipe = {**TINY, "train": {**TINY["train"], "epochs": 1}, "export": {"enabled": True},
              "validate": {"thresholds": {"max_accuracy_drop": 0.5}}}
    out = tmp_path / "run"
    with pytest.raises(RuntimeError):
        compress.apply(recipe, out_dir=out, quiet=True)
    md = (out / "report.md").read_text()
    assert "The run FAILED" in md and "Thresholds: not checked (the run failed)" in md and "passed" not in md
    assert "epochs: 1\n" in (out / "recipe.yaml").read_text()


# ---- 5. numbers: NaN stops the run where it appears ---------------------------------------------------


def test_nan_in_training_data_stops_at_the_step_naming_the_data() -> None:
    from compress.core.errors import DataError
    from compress.recipe import TrainSpec
    from compress.training import Trainer

    x = torch.randn(8, 64)
    bad = x.clone()
    bad[3, 5] = float("nan")
    loader = [(x, torch.zeros(8, dtype=torch.long)), (bad, torch.zeros(8, dtype=torch.long))]
    model = torch.nn.Linear(64, 10)
    trainer = Trainer(TrainSpec(epochs=1, lr=0.1), device=torch.device("cpu"), progress=False)
    trainer.data_name = "data 'mine'"
    before = model.weight.detach().clone()
    with pytest.raises(DataError, match=r"train: epoch 1, batch 2: the batch from data 'mine' holds 1 NaN/inf"):
        trainer.fit(model, loader, epochs=1)
    assert not torch.equal(before, model.weight)  # batch 1 trained; the NaN batch stopped it
    assert torch.isfinite(model.weight).all()  # and nothing of it reached the weights


def test_a_diverging_loss_is_named_as_such() -> None:
    from compress.core.errors import DataError
    from compress.recipe import TrainSpec
    from compress.training import Trainer

    x = torch.full((8, 64), 1e30)  # finite data ...
    model = torch.nn.Linear(64, 10)
    with torch.no_grad():
        model.weight.fill_(1e10)  # ... and weights whose product overflows float32
    trainer = Trainer(TrainSpec(epochs=1, lr=0.1), device=torch.device("cpu"), progress=False)
    with pytest.raises(DataError, match="the training diverged"):
        trainer.fit(model, [(x, torch.zeros(8, dtype=torch.long))], epochs=1)


def test_nan_in_calibration_data_names_the_batch_not_a_quantizer() -> None:
    from compress.core.errors import CalibrationError

    x = torch.randn(4, 1, 8, 8)
    bad = x.clone()
    bad[0, 0, 0, 0] = float("inf")
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    with pytest.raises(CalibrationError, match="calibration batch 2 holds 1 NaN/inf"):
        compress.quantize(model, "w8a8", [x, bad])


@pytest.mark.parametrize("reduce_range", [False, True], ids=["8-bit-codes", "7-bit-codes"])
def test_validate_says_when_8bit_weights_can_saturate_on_this_cpu(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], reduce_range: bool) -> None:
    import compress.export.validation.measure as ev

    monkeypatch.setattr(ev, "has_vnni", lambda: False)  # the CPU the issue measured on
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    data = [torch.randn(8, 1, 8, 8) for _ in range(4)]
    scheme = {"preset": "w8a8", "weights": {"reduce_range": reduce_range}}
    compress.quantize(model, scheme, data)
    path = compress.export_onnx(model.eval(), data[0], tmp_path / "m.int8.onnx")
    assert main(["validate", str(path), "--runs", "1", "--batch-sizes", "1"]) == 0
    out = capsys.readouterr().out
    assert ("warning: onnxruntime m.int8.onnx: CPU without VNNI" in out) is (not reduce_range), out


def test_overwrite_takes_a_run_folder_from_before_the_marker(finished: Path, tmp_path: Path) -> None:
    out = _copy(finished, tmp_path / "run")
    (out / MARKER).unlink()  # what an earlier version left: the run's files at their names, no list
    compress.apply(TINY, out_dir=out, overwrite=True, quiet=True)
    assert (out / MARKER).is_file() and (out / "report.json").is_file()
    (out / MARKER).unlink()
    (out / "my_notes.txt").write_text("mine")
    with pytest.raises(RunFolderError, match=r"my_notes\.txt was not written by the run"):
        compress.apply(TINY, out_dir=out, overwrite=True, quiet=True)
    assert (out / "my_notes.txt").read_text() == "mine"


def test_preflight_names_a_runtime_that_is_not_installed_and_lets_cuda_skip_without_a_gpu(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from compress.core.errors import RecipeError
    from compress.preflight import check_recipe
    from compress.recipe import load_recipe

    recipe = load_recipe(_recipe(tmp_path, {**TINY, "export": {"enabled": True},
                                            "validate": {"runtimes": ["onnxruntime", "openvino", "cuda"]}}))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "openvino" else real(name, *a))
    with pytest.raises(RecipeError, match=r"recipe.yaml:\d+: validate.runtimes.1: runtime 'openvino' is not installed"):
        check_recipe(recipe)
    monkeypatch.setattr(importlib.util, "find_spec", real)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    check_recipe(recipe)  # cuda without a GPU: validation skips it with a note, as a portable recipe needs
