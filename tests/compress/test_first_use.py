"""What a new user meets first: recipe names from any folder, file modes, one-line errors, a Session
that fails mid-loop, inf/nan in numbers (issue 11, items 5-8)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import yaml

import compress
from compress.cli import main
from compress.core.errors import RecipeError

ROOT = Path(__file__).resolve().parents[2]
MLP = {"name": "mlp", "kwargs": {"hidden": 16, "depth": 1, "num_classes": 10, "in_features": 64}}


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


# ---- item 5: one resolution rule for shipped recipes ----------------------------------------------


@pytest.mark.parametrize("arg", ["qat_w8a8", "qat_w8a8.yaml", "recipes/qat_w8a8.yaml"])
def test_load_recipe_finds_shipped_recipes_from_any_folder(arg: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert compress.load_recipe(arg).name == "qat_w8a8"


def test_a_local_file_wins_and_a_typo_names_the_closest_shipped_recipe(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "qat_w8a8.yaml").write_text(yaml.safe_dump({"version": 1, "name": "mine", "model": MLP}))
    assert compress.load_recipe("recipes/qat_w8a8.yaml").name == "mine"
    with pytest.raises(RecipeError, match=r"qat_w8a9: recipe file not found .*did you mean 'qat_w8a8'"):
        compress.load_recipe("qat_w8a9")
    with pytest.raises(RecipeError, match="recipe file not found"):
        compress.load_recipe("elsewhere/qat_w8a8.yaml")  # only the shipped folder's own name maps


# ---- item 6: files written atomically respect the umask ------------------------------------------


def test_atomic_writes_respect_the_umask(tmp_path: Path) -> None:
    from compress.core.io import atomic_write_text

    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "a.txt", "x")
        (tmp_path / "b.txt").write_text("x")
        os.umask(0o077)
        atomic_write_text(tmp_path / "c.txt", "x")
    finally:
        os.umask(old)
    mode = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert mode == {"a.txt": 0o644, "b.txt": 0o644, "c.txt": 0o600}


def test_direct_onnx_export_respects_the_umask(tmp_path: Path) -> None:
    import torch
    from compress.export.onnx import export_onnx

    old = os.umask(0o022)
    try:
        path = export_onnx(torch.nn.Linear(4, 2), torch.randn(2, 4), tmp_path / "m.onnx")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


# ---- item 7: error paths -------------------------------------------------------------------------


def _recipe_file(tmp_path: Path, **changes: Any) -> Path:
    data = {"version": 1, "name": "r", "model": MLP,
            "stages": [{"name": "ptq", "modifiers": [{"type": "ptq", "scheme": "w8a8"}]}], **changes}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_an_unknown_scheme_names_file_line_and_field(tmp_path: Path) -> None:
    path = _recipe_file(tmp_path, stages=[{"name": "ptq", "modifiers": [{"type": "ptq", "scheme": "w8a9"}]}])
    with pytest.raises(RecipeError) as exc:
        compress.load_recipe(path)
    assert str(exc.value).startswith(f"{path}:") and "stages.0.modifiers.0.scheme: unknown quantization scheme" in str(
        exc.value)
    line = int(str(exc.value).split(":")[1])
    assert "scheme: w8a9" in path.read_text().splitlines()[line - 1]


def test_a_typo_in_model_kwargs_points_at_the_kwarg(tmp_path: Path) -> None:
    path = _recipe_file(tmp_path, model={"name": "mlp", "kwargs": {"hidden": 16, "hiden": 3}})
    with pytest.raises(RecipeError, match=r"model\.kwargs\.hiden: zoo model 'mlp' has no kwarg 'hiden'"):
        compress.apply(path, out_dir=tmp_path / "run")


def test_validate_on_a_non_onnx_file_is_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = cli(capsys, "validate", str(_recipe_file(tmp_path)))
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "not an ONNX model" in err


def test_resume_of_a_missing_folder_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = cli(capsys, "apply", str(_recipe_file(tmp_path)), "--out", str(tmp_path / "nope"), "--resume")
    assert rc == 2 and "--resume" in err and "does not exist" in err
    assert not (tmp_path / "nope").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_fails_the_dry_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = cli(capsys, "apply", str(_recipe_file(tmp_path)), "--device", "cuda", "--dry-run")
    assert rc == 2 and "--device cuda" in err and "no CUDA" in err and out == ""


def test_inspect_of_a_pickled_module_is_one_plain_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.save(torch.nn.Linear(2, 2), tmp_path / "final_model.pt")
    rc, _, err = cli(capsys, "inspect", str(tmp_path / "final_model.pt"))
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "\x1b" not in err and "pickled" in err


def test_inspect_into_a_closed_pipe_ends_quietly() -> None:
    code = ("import sys; sys.argv = ['compress', 'inspect', 'quickstart']\n"
            "from compress.cli import main\nrc = main()\nsys.stdout.flush()\nsys.exit(rc)")
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None and p.stderr is not None
    p.stdout.readline()
    p.stdout.close()  # `| head -1`
    err = p.stderr.read().decode()
    p.wait(timeout=60)
    assert "BrokenPipe" not in err and "internal error" not in err, err


def test_recipes_lists_whole_sentences(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = cli(capsys, "recipes")
    assert rc == 0
    for line in out.strip().splitlines():
        assert line.rstrip().endswith((".", ")")), line


def test_the_summary_rounds_its_figures() -> None:
    from compress.export.records import ValidationRecord

    from compress.cli import summary
    from compress.report import ModelFigures, Report

    r = Report(recipe={"name": "x"}, baseline=ModelFigures(accuracy=0.98765432), final=ModelFigures(accuracy=0.97))
    r.validation.append(ValidationRecord(
        runtime="onnxruntime", device="cpu", precision="int8", format="onnx-int8-qdq", model_path=Path("m.onnx"),
        role="final", accuracy=0.9711111111, latency_ms={1: 0.1166884999861395}, speedup={1: 1.2345678},
        size_bytes=1, threads=1))
    text = summary(r, out=Path("run"))
    assert "0.1166884999861395" not in text and "0.1167 ms" in text and "1.235x" in text and "0.9877" in text


def test_progress_bars_stay_out_of_redirected_output(tmp_path: Path) -> None:
    path = _recipe_file(tmp_path, train={"epochs": 1, "batch_size": 32}, stages=[], export={"enabled": False})
    proc = subprocess.run([sys.executable, "-m", "compress.cli", "apply", str(path), "--out", str(tmp_path / "run")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "it/s" not in proc.stderr and "\r" not in proc.stderr, proc.stderr[-500:]


# ---- item 8: a Session that fails mid-loop; inf/nan numbers --------------------------------------


def test_an_exception_in_the_loop_leaves_no_hooks_on_the_model() -> None:
    torch.manual_seed(0)
    recipe = {"version": 1, "model": MLP, "stages": [{"name": "kd", "epochs": 1, "modifiers": [
        {"type": "distill", "teacher": "self",
         "losses": [{"type": "kd", "temperature": 2.0}, {"type": "feature", "layers": {"body": "body"}}]}]}]}
    model = compress.load_model(MLP)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))

    def hooks() -> int:
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())

    with pytest.raises(RuntimeError, match="user bug"), compress.Session(recipe, model, optimizer=opt,
                                                                         steps_per_epoch=1) as s:
        out = s.model(x)
        s.loss(F.cross_entropy(out, y), inputs=x, outputs=out).backward()
        assert hooks() > 0  # feature capture is attached while the stage runs
        raise RuntimeError("user bug")
    assert hooks() == 0
    with pytest.raises(Exception, match="after finalize"):
        s.step()


@pytest.mark.parametrize("mod", [
    {"type": "distill", "teacher": "self", "losses": [{"type": "kd", "temperature": 2.0}], "start_epoch": ".inf"},
    {"type": "ptq", "scheme": "w8a8", "end_epoch": ".inf"},
    {"type": "distill", "teacher": "self", "losses": [{"type": "kd", "temperature": ".inf"}]},
])
def test_modifier_numbers_refuse_inf_and_nan(mod: dict[str, Any], tmp_path: Path) -> None:
    text = yaml.safe_dump({"version": 1, "model": MLP, "stages": [{"name": "s", "epochs": 1, "modifiers": [mod]}]})
    path = tmp_path / "r.yaml"
    path.write_text(text.replace("'.inf'", ".inf").replace("'.nan'", ".nan"))
    with pytest.raises(RecipeError, match=r"r\.yaml:\d+: stages\.0\.modifiers\.0\.(start_epoch|end_epoch|losses\.0\."
                                          r"temperature)"):
        compress.load_recipe(path)
