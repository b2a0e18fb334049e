"""Files a user hands over that cannot be used: corrupt or truncated checkpoints (``--resume``,
``model.checkpoint``, ``compress inspect``) and ONNX files without inputs or outputs (``compress
validate``, ``compress inspect``, ``compress.validate``). Each is one line naming the file, exit 2,
before any work starts, and nothing on disk changes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import onnx
import pytest
import torch
import yaml
from onnx import TensorProto, helper
from torch import nn

import compress
from compress.checkpoints import check_resumable, load_baseline
from compress.cli import main
from compress.core.errors import RecipeError
from compress.core.io import safe_torch_load
from tests.compress.cases import one_error_line, tiny

TINY = tiny(export={"enabled": False})  # the resumed run never gets that far; a few seconds per run


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run folder (baseline.pt, baseline_last.pt, final.pt), made once; tests copy it."""
    out = tmp_path_factory.mktemp("finished") / "run"
    compress.apply(TINY, out_dir=out, quiet=True)
    return out


# ---- checkpoints -------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["baseline.pt", "baseline_last.pt", "stage_last.pt"])
def test_resume_from_a_truncated_checkpoint_exits_2_before_any_work(
    which: str, finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    ckpt = out / "checkpoints"
    bad = ckpt / which
    if which == "baseline_last.pt":  # read only when the trained baseline is not there
        (ckpt / "baseline.pt").unlink()
    if which == "stage_last.pt":  # as a run killed mid-stage leaves it, cut short
        shutil.copy(ckpt / "final.pt", bad)
    _truncate(bad)
    before = _tree(out)

    def no_model(*args: Any, **kwargs: Any) -> nn.Module:
        raise AssertionError("the model was built before the checkpoints were checked")

    monkeypatch.setattr("compress.models.load_model", no_model)
    rc = main(["apply", str(out / "recipe.yaml"), "--out", str(out), "--resume", "--quiet"])
    line = one_error_line(capsys.readouterr().err)
    assert rc == 2, line
    assert f"--resume: checkpoint {bad} is corrupt or truncated" in line, line
    assert "--overwrite instead of --resume" in line
    assert _tree(out) == before  # nothing cleared, nothing written


def test_resume_from_a_checkpoint_of_another_kind_exits_2(
    finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    torch.save({"weights": torch.ones(3)}, out / "checkpoints" / "baseline.pt")  # loads, but holds no 'model'
    rc = main(["apply", str(out / "recipe.yaml"), "--out", str(out), "--resume", "--quiet"])
    line = one_error_line(capsys.readouterr().err)
    assert rc == 2 and "baseline.pt: not a checkpoint of this version (no 'model')" in line, line


def test_load_baseline_names_a_checkpoint_that_does_not_fit(tmp_path: Path) -> None:
    path = tmp_path / "baseline.pt"
    torch.save({"model": nn.Linear(4, 3).state_dict(), "epoch": 1}, path)
    with pytest.raises(RecipeError, match=r"--resume: .*baseline.pt: does not fit the model \(.*size mismatch"):
        load_baseline(path, nn.Linear(4, 5))
    model = nn.Linear(4, 3)
    assert load_baseline(path, model)["epoch"] == 1


def _sharded(folder: Path) -> Path:
    """A stage_last.dcp folder as save_sharded writes it: the shards, .metadata and extra.pt."""
    import torch.distributed.checkpoint as dcp

    from compress.distributed import EXTRA_FILE

    with pytest.warns(UserWarning):  # DCP says it saves in one process: it does
        dcp.save({"model.w": torch.randn(64, 64), "epoch": torch.tensor(1)}, checkpoint_id=str(folder))
    progress = {"session": {"stage": 0, "epochs_done": 1}, "report_stages": [], "world_size": 1}
    torch.save({"objects": {}, "progress": json.dumps(progress), "tensors": {}}, folder / EXTRA_FILE)
    return folder


def test_resume_checks_sharded_checkpoints_before_any_work(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoints"
    folder = _sharded(ckpt / "stage_last.dcp")
    check_resumable(ckpt, trains_baseline=True)  # whole: passes
    shard = next(folder.glob("*.distcp"))
    _truncate(shard)
    with pytest.raises(RecipeError, match=rf"--resume: checkpoint {folder} is corrupt or truncated \(shard "
                                          rf"{shard.name} holds [\d,]+ of [\d,]+ bytes\); delete it"):
        check_resumable(ckpt, trains_baseline=True)
    (folder / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(RecipeError, match=r"corrupt or truncated \(its \.metadata: "):
        check_resumable(ckpt, trains_baseline=True)
    _truncate(folder / "extra.pt")
    with pytest.raises(RecipeError, match=r"checkpoint .*extra.pt is corrupt or truncated"):
        check_resumable(ckpt, trains_baseline=True)


def test_resume_ignores_what_the_run_would_not_read(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    (ckpt / "baseline_last.pt").write_bytes(b"PK\x03\x04 cut")  # a baseline the recipe does not train
    check_resumable(ckpt, trains_baseline=False)
    with pytest.raises(RecipeError, match=r"baseline_last\.pt is corrupt or truncated"):
        check_resumable(ckpt, trains_baseline=True)
    torch.save({"model": {}, "epoch": 1}, ckpt / "baseline.pt")  # the trained baseline wins: the last epoch is not read
    check_resumable(ckpt, trains_baseline=True)


def test_safe_torch_load_names_each_kind_of_bad_file(tmp_path: Path) -> None:
    good = tmp_path / "good.pt"
    torch.save({"model": {"w": torch.randn(32, 32)}}, good)
    assert torch.equal(safe_torch_load(good, mmap=True)["model"]["w"], safe_torch_load(good)["model"]["w"])
    cut = tmp_path / "cut.pt"
    cut.write_bytes(good.read_bytes()[:-40])
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    for path in (cut, empty):
        with pytest.raises(RecipeError, match=rf"^checkpoint {path} is corrupt or truncated \([\d,]+ bytes; "):
            safe_torch_load(path)
    junk = tmp_path / "junk.pt"
    junk.write_text("not a checkpoint")
    with pytest.raises(RecipeError, match=r"junk.pt: not a readable checkpoint \(not a file torch.save wrote"):
        safe_torch_load(junk)
    module = tmp_path / "module.pt"
    torch.save(nn.Linear(2, 2), module)
    with pytest.raises(RecipeError, match=r"holds pickled Python objects.*; rerun$"):
        safe_torch_load(module, hint="rerun")


def test_inspect_of_a_truncated_checkpoint_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "model.pt"
    torch.save({"model": nn.Linear(8, 8).state_dict()}, path)
    _truncate(path)
    rc = main(["inspect", str(path)])
    line = one_error_line(capsys.readouterr().err)
    assert rc == 2 and f"checkpoint {path} is corrupt or truncated" in line, line


def test_a_truncated_model_checkpoint_names_the_recipe_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    weights = tmp_path / "weights.pt"
    torch.save({"model": {"w": torch.randn(64, 64)}}, weights)
    _truncate(weights)
    recipe = tmp_path / "recipe.yaml"
    data = {**TINY, "model": {**TINY["model"], "checkpoint": str(weights)}}
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    rc = main(["apply", str(recipe), "--dry-run"])
    line = one_error_line(capsys.readouterr().err)
    assert rc == 2, line
    assert f"{recipe}:" in line and "model.checkpoint" in line and f"checkpoint {weights} is corrupt or truncated" in line


# ---- ONNX files without inputs or outputs ----------------------------------------------------------------


def _onnx(path: Path, *, inputs: bool = True, outputs: bool = True) -> Path:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])
    if inputs:
        nodes = [helper.make_node("Relu", ["x"], ["y"])]
    else:  # a graph of constants: valid ONNX, nothing to feed
        value = helper.make_tensor("v", TensorProto.FLOAT, [1, 64], [1.0] * 64)
        nodes = [helper.make_node("Constant", [], ["c"], value=value), helper.make_node("Identity", ["c"], ["y"])]
    graph = helper.make_graph(nodes, "g", [x] if inputs else [], [y] if outputs else [])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)  # a valid file: the problem is what it takes or returns
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize(("kind", "words"), [("inputs", "without inputs"), ("outputs", "without outputs")])
def test_onnx_without_inputs_or_outputs_exits_2(
    kind: str, words: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _onnx(tmp_path / f"no_{kind}.onnx", inputs=kind != "inputs", outputs=kind != "outputs")
    for argv in (["validate", str(path), "--batch-sizes", "1", "--runs", "2"], ["inspect", str(path)]):
        rc = main(argv)
        line = one_error_line(capsys.readouterr().err)
        assert rc == 2 and f"'{path}' is an ONNX model {words}" in line, (argv, line)
    good = _onnx(tmp_path / "good.onnx")
    rc = main(["validate", str(good), "--reference", str(path)])
    line = one_error_line(capsys.readouterr().err)
    assert rc == 2 and line.startswith(f"compress: error: --reference: '{path}' is an ONNX model {words}"), line
    with pytest.raises(RecipeError, match=words):
        compress.validate(path)
    with pytest.raises(RecipeError, match=rf"^reference: '{path}' is an ONNX model {words}"):
        compress.validate(good, reference=path)


def test_inspect_still_describes_a_good_onnx_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _onnx(tmp_path / "good.onnx")
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "inputs:  x: float32[1, 64]" in out and "outputs: y: float32[1, 64]" in out
