"""What a user's mistakes and a machine's faults do: input -> exit code -> message -> what was left on disk.

    python -m benchmarks.faults            # writes the `faults` section of RESULTS.md

(The README's quickstart is timed by benchmarks/quickstart.py.)

Each case runs the installed ``compress`` command (or a Python snippet for API cases) in a fresh
temporary folder, the way a user would, and records the exit code, the first stderr line and the
files that changed. The disk-full case mounts a 600 KiB tmpfs (needs root; skipped otherwise).
tests/compress/test_reliability.py asserts each behaviour; this table shows them side by side.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TINY = """version: 1
name: tiny
model: {name: mlp, kwargs: {hidden: 16, depth: 1, num_classes: 10, in_features: 64}}
data: {source: digits, calibration_samples: 32, eval_samples: 64}
train: {epochs: 1, batch_size: 64, lr: 0.1, seed: 0}
stages: [{name: ptq, modifiers: [{type: ptq, scheme: w8a8}]}]
validate: {batch_sizes: [1], warmup: 0, runs: 2}
"""


def _compress() -> list[str]:
    exe = shutil.which("compress", path=str(Path(sys.executable).parent))
    return [exe] if exe else [sys.executable, "-m", "compress.cli"]


def _snapshot(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()[:12]
            for p in sorted(root.rglob("*")) if p.is_file() and ".git/" not in p.as_posix() + "/"}


def _left(before: dict[str, str], after: dict[str, str]) -> str:
    gone = sorted(set(before) - set(after))
    changed = sorted(k for k in before if k in after and before[k] != after[k])
    added = sorted(set(after) - set(before))
    if not (gone or changed or added):
        return "nothing changed"
    parts = []
    if gone:
        parts.append(f"deleted {', '.join(gone[:4])}" + (" ..." if len(gone) > 4 else ""))
    if changed:
        parts.append(f"rewrote {', '.join(changed[:4])}" + (" ..." if len(changed) > 4 else ""))
    if added:
        tmp = [a for a in added if a.endswith(".tmp")]
        parts.append(f"added {len(added)} files" + (f" ({len(tmp)} .tmp)" if tmp else ", no .tmp"))
    return "; ".join(parts)


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: int = 600) -> tuple[int, str]:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(cwd), **(env or {})}
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=full_env)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and " INFO " not in ln and not ln.startswith("INFO")]
    return proc.returncode, (lines[-1] if lines else "(nothing on stderr)")


def _cases(finished: Path) -> list[tuple[str, Callable[[Path], tuple[list[str], Path]]]]:
    c = _compress()

    def recipe(d: Path, text: str = TINY) -> str:
        (d / "r.yaml").write_text(text)
        return str(d / "r.yaml")

    def user_folder(d: Path) -> tuple[list[str], Path]:
        w = d / "work"
        w.mkdir()
        (w / "notes.txt").write_text("months of notes")
        (w / "my_recipe.yaml").write_text("name: mine\n")
        return [*c, "apply", recipe(d), "--out", str(w), "--overwrite", "--quiet"], w

    def cwd_folder(d: Path) -> tuple[list[str], Path]:
        shutil.copytree(finished, d / "here")
        (d / "here" / "mine.txt").write_text("keep")
        return [*c, "apply", recipe(d), "--out", ".", "--overwrite", "--quiet", "#cwd=here"], d / "here"

    def git_root(d: Path) -> tuple[list[str], Path]:
        subprocess.run(["git", "init", "-q", str(d / "repo")], check=True)
        (d / "repo" / "train.py").write_text("print('mine')\n")
        return [*c, "apply", recipe(d), "--out", str(d / "repo"), "--overwrite", "--quiet"], d / "repo"

    def user_file_in_run(d: Path) -> tuple[list[str], Path]:
        out = shutil.copytree(finished, d / "run")
        (out / "checkpoints" / "my_best.pt").write_bytes(b"mine")
        return [*c, "apply", recipe(d), "--out", str(out), "--overwrite", "--quiet"], out

    def resume_user_file(d: Path) -> tuple[list[str], Path]:
        out = shutil.copytree(finished, d / "run")
        (out / "export" / "notes.md").write_text("mine")
        return [*c, "apply", str(out / "recipe.yaml"), "--out", str(out), "--resume", "--quiet"], out

    def overwrite_run(d: Path) -> tuple[list[str], Path]:
        out = shutil.copytree(finished, d / "run")
        return [*c, "apply", recipe(d), "--out", str(out), "--overwrite", "--quiet"], out

    def out_unwritable(d: Path) -> tuple[list[str], Path]:
        return [*c, "apply", recipe(d), "--out", "/proc/x", "--quiet"], d

    def validate_shape(d: Path) -> tuple[list[str], Path]:
        return [*c, "validate", str(finished / "export" / "tiny.int8.onnx"), "--data", "synthetic",
                "--data-kwargs", '{"shape": [32]}', "--runs", "1"], d

    def validate_reference(d: Path) -> tuple[list[str], Path]:
        import torch

        import compress

        m = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 7)).eval()
        compress.export_onnx(m, torch.randn(2, 1, 8, 8), d / "seven.onnx")
        return [*c, "validate", str(finished / "export" / "tiny.int8.onnx"), "--reference", str(d / "seven.onnx"),
                "--runs", "1"], d

    def data_kwargs(d: Path) -> tuple[list[str], Path]:
        return [*c, "validate", str(finished / "export" / "tiny.int8.onnx"), "--data-kwargs", "{bad"], d

    def garbage_onnx(d: Path) -> tuple[list[str], Path]:
        (d / "g.onnx").write_text("garbage")
        return [*c, "inspect", str(d / "g.onnx")], d

    def factory_raises(d: Path) -> tuple[list[str], Path]:
        (d / "userfac.py").write_text("def make():\n    raise RuntimeError('weights file missing')\n")
        text = TINY.replace("model: {name: mlp, kwargs: {hidden: 16, depth: 1, num_classes: 10, in_features: 64}}",
                            "model: {name: 'userfac:make'}")
        return [*c, "apply", recipe(d, text), "--out", str(d / "run"), "--quiet", "--trust-code"], d

    def hf_bad_config(d: Path) -> tuple[list[str], Path]:
        (d / "hf").mkdir()
        (d / "hf" / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": "big"}))
        text = TINY.replace("model: {name: mlp, kwargs: {hidden: 16, depth: 1, num_classes: 10, in_features: 64}}",
                            f"model: {{hf_path: '{d / 'hf'}'}}")
        return [*c, "apply", recipe(d, text), "--out", str(d / "run"), "--quiet"], d

    def nan_data(d: Path) -> tuple[list[str], Path]:
        (d / "nandata.py").write_text(
            "import torch\nfrom torch.utils.data import TensorDataset\n"
            "def make():\n    x = torch.randn(256, 1, 8, 8)\n    x[::10, 0, 0, 0] = float('nan')\n"
            "    return TensorDataset(x, torch.randint(0, 10, (256,)))\n")
        text = TINY.replace("data: {source: digits, calibration_samples: 32, eval_samples: 64}",
                            "data: {source: 'nandata:make'}")
        return [*c, "apply", recipe(d, text), "--out", str(d / "run"), "--quiet", "--trust-code"], d

    def dynamic_scheme(d: Path) -> tuple[list[str], Path]:
        return [*c, "apply", recipe(d), "--out", str(d / "run"), "--quiet",
                "--set", "stages.0.modifiers.0.scheme=w8a8_dynamic"], d

    def dry_run_dynamic(d: Path) -> tuple[list[str], Path]:
        return [*c, "apply", recipe(d), "--dry-run", "--set", "stages.0.modifiers.0.scheme=w8a8_dynamic"], d

    def data_misfit(d: Path) -> tuple[list[str], Path]:
        return [*c, "apply", recipe(d, TINY.replace("in_features: 64", "in_features: 32")), "--out",
                str(d / "run"), "--quiet"], d

    def pickled_module(d: Path) -> tuple[list[str], Path]:
        import torch

        torch.save(torch.nn.Linear(64, 10), d / "module.pt")
        text = TINY.replace("in_features: 64}}", f"in_features: 64}}, checkpoint: '{d / 'module.pt'}'}}")
        return [*c, "apply", recipe(d, text), "--out", str(d / "run"), "--quiet"], d

    def disk_full(d: Path) -> tuple[list[str], Path]:
        mnt = d / "full"
        mnt.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(mnt)], check=True, capture_output=True)
        big = TINY.replace("hidden: 16", "hidden: 1024")  # checkpoints of ~0.3 MB each fill 600 KiB
        return [*c, "apply", recipe(d, big), "--out", str(mnt / "run"), "--quiet"], mnt

    # ---- the trust issue: code in recipes, run-folder jail, bounded YAML, one run per folder ----
    zoo = "model: {name: mlp, kwargs: {hidden: 16, depth: 1, num_classes: 10, in_features: 64}}"

    def shell_recipe(d: Path, field: str = "model") -> str:
        touch = f"{{name: 'os:system', kwargs: {{command: 'touch {d / 'PWNED'}'}}}}"
        if field == "model":
            return recipe(d, TINY.replace(zoo, f"model: {touch}"))
        return recipe(d, TINY.replace("data: {source: digits,", f"data: {{source: 'os:system', kwargs: {{command: 'touch {d / 'PWNED'}'}},"))

    def code_model(d: Path) -> tuple[list[str], Path]:
        return [*c, "apply", shell_recipe(d), "--out", str(d / "run"), "--quiet"], d

    def code_data(d: Path) -> tuple[list[str], Path]:
        return [*c, "apply", shell_recipe(d, "data"), "--out", str(d / "run"), "--quiet"], d

    def code_dry_run(d: Path) -> tuple[list[str], Path]:
        return [*c, "apply", shell_recipe(d), "--dry-run", "--trust-code"], d

    def code_inspect(d: Path) -> tuple[list[str], Path]:
        return [*c, "inspect", shell_recipe(d)], d

    def code_trusted(d: Path) -> tuple[list[str], Path]:
        return [*c, "apply", shell_recipe(d), "--out", str(d / "run"), "--quiet", "--trust-code"], d

    def marker_entry(entry: Callable[[Path], str]) -> Callable[[Path], tuple[list[str], Path]]:
        def case(d: Path) -> tuple[list[str], Path]:
            out = shutil.copytree(finished, d / "run")
            (d / "victim.txt").write_text("precious")
            data = json.loads((out / ".compress-run.json").read_text())
            data["files"].append(entry(d))
            (out / ".compress-run.json").write_text(json.dumps(data))
            return [*c, "apply", recipe(d), "--out", str(out), "--overwrite", "--quiet"], d
        return case

    def link_out(d: Path) -> tuple[list[str], Path]:
        out = shutil.copytree(finished, d / "run")
        (d / "victim.txt").write_text("precious")
        (out / "artifacts").symlink_to(d, target_is_directory=True)
        data = json.loads((out / ".compress-run.json").read_text())
        data["files"].append("artifacts/victim.txt")
        (out / ".compress-run.json").write_text(json.dumps(data))
        return [*c, "apply", str(out / "recipe.yaml"), "--out", str(out), "--resume", "--quiet"], d

    def alias_bomb(d: Path) -> tuple[list[str], Path]:
        text = TINY + 'a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n'
        for i in range(1, 10):
            text += f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]\n"
        return [*c, "apply", recipe(d, text), "--dry-run"], d

    def concurrent(d: Path) -> tuple[list[str], Path]:
        out = d / "run"
        holder = ("import pathlib, time\nfrom compress.run_folder import RunFolder\n"
                  f"with RunFolder(pathlib.Path({str(out)!r})).lock():\n    print('held', flush=True); time.sleep(60)\n")
        proc = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        return [*c, "apply", recipe(d), "--out", str(out), "--quiet"], out

    def truncated_resume(d: Path) -> tuple[list[str], Path]:
        out = shutil.copytree(finished, d / "run")
        ck = out / "checkpoints" / "baseline.pt"
        ck.write_bytes(ck.read_bytes()[:100])
        return [*c, "apply", str(out / "recipe.yaml"), "--out", str(out), "--resume", "--quiet"], out

    def onnx_no_inputs(d: Path) -> tuple[list[str], Path]:
        import onnx
        from onnx import TensorProto, helper

        const = helper.make_node("Constant", [], ["y"], value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0]))
        graph = helper.make_graph([const], "g", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
        onnx.save(helper.make_model(graph), str(d / "noin.onnx"))
        return [*c, "validate", str(d / "noin.onnx")], d

    def batch_zero(d: Path) -> tuple[list[str], Path]:
        return [*c, "apply", recipe(d, TINY.replace("batch_sizes: [1]", "batch_sizes: [0]")), "--out",
                str(d / "run"), "--quiet"], d

    def recipe_folder(d: Path) -> tuple[list[str], Path]:
        (d / "r.yaml").mkdir()
        return [*c, "apply", str(d / "r.yaml"), "--out", str(d / "run")], d

    def llm_dry_run(d: Path) -> tuple[list[str], Path]:
        return [*c, "apply", "llm_gptq_w4", "--dry-run", "#env=COMPRESS_CACHE_DIR=" + str(d / "cache")], d

    def api(code: str) -> Callable[[Path], tuple[list[str], Path]]:
        def case(d: Path) -> tuple[list[str], Path]:
            script = ("import torch, compress\n"
                      "m = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.Flatten(), torch.nn.Linear(144, 10))\n"
                      "x = torch.randn(4, 1, 8, 8)\n"
                      f"try:\n    {code}\nexcept compress.CompressError as e:\n"
                      "    import sys; print(f'{type(e).__name__}: {e}', file=sys.stderr); sys.exit(e.exit_code)\n")
            (d / "api.py").write_text(script)
            return [sys.executable, str(d / "api.py")], d
        return case

    return [
        ("`--overwrite` on a folder of the user's files (no run marker)", user_folder),
        ("`--out . --overwrite` in a run folder that is the current folder", cwd_folder),
        ("`--out <git checkout> --overwrite`", git_root),
        ("`--overwrite` on a run folder holding a user's checkpoints/my_best.pt", user_file_in_run),
        ("`--overwrite` on a run folder of only the run's files", overwrite_run),
        ("`--resume` on a finished run with a user's export/notes.md", resume_user_file),
        ("`--out /proc/x`", out_unwritable),
        ("disk full during the run (600 KiB tmpfs)", disk_full),
        ("`validate` with data of another input shape", validate_shape),
        ("`validate --reference` with another output shape", validate_reference),
        ("`validate --data-kwargs '{bad'`", data_kwargs),
        ("`inspect` a garbage .onnx", garbage_onnx),
        ("a user model factory that raises (`--trust-code`)", factory_raises),
        ("an HF directory with an invalid config.json", hf_bad_config),
        ("a checkpoint holding a pickled module", pickled_module),
        ("NaN in the training data (user data factory, `--trust-code`)", nan_data),
        ("data whose batches do not fit the model", data_misfit),
        ("`--set scheme=w8a8_dynamic` with the QDQ export", dynamic_scheme),
        ("`--dry-run` with the same override", dry_run_dynamic),
        ("recipe `model.name: os:system` (touch a file), no `--trust-code`", code_model),
        ("recipe `data.source: os:system`, no `--trust-code`", code_data),
        ("`--dry-run --trust-code` of the `os:system` recipe", code_dry_run),
        ("`inspect` the `os:system` recipe", code_inspect),
        ("the `os:system` recipe with `--trust-code` (the user trusts it: it runs)", code_trusted),
        ("`--overwrite`, marker lists `../victim.txt`", marker_entry(lambda d: "../victim.txt")),
        ("`--overwrite`, marker lists an absolute path", marker_entry(lambda d: str(d / "victim.txt"))),
        ("`--resume`, a link in the run folder leads out of it", link_out),
        ("YAML alias bomb (9 nested levels, ~400 bytes)", alias_bomb),
        ("a second `apply` into a folder another run holds", concurrent),
        ("`--resume` with a truncated checkpoints/baseline.pt", truncated_resume),
        ("`validate` an ONNX file without inputs", onnx_no_inputs),
        ("`validate.batch_sizes: [0]`", batch_zero),
        ("a recipe path that is a folder", recipe_folder),
        ("`--dry-run` of the SmolLM2 GPTQ recipe, empty cache", llm_dry_run),
        ("API: `quantize(model, 8, data)`", api("compress.quantize(m, 8, [x])")),
        ("API: `QuantizeParams(runtime='gpu')`", api("compress.QuantizeParams(runtime='gpu')")),
        ("API: `quantize('resnet', ...)`", api("compress.quantize('resnet', 'w8a8', [x])")),
        ("API: one tensor as calibration data", api("compress.quantize(m, 'w8a8', x)")),
        ("API: `prune(example_inputs=None)`", api("compress.prune(m, example_inputs=None, ratio=0.5)")),
        ("API: `ignore=['x']` matching nothing", api("compress.quantize(m, 'w8a8', [x], ignore=['x'])")),
    ]


def fault_table() -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as base:
        finished = Path(base) / "finished"
        rc, msg = _run([*_compress(), "apply", _write(Path(base), TINY), "--out", str(finished), "--quiet"], Path(base))
        if rc != 0:
            raise SystemExit(f"benchmarks.faults: the reference run failed: {msg}")
        for what, make in _cases(finished):
            d = Path(tempfile.mkdtemp(dir=base))
            try:
                cmd, watch = make(d)
            except subprocess.CalledProcessError:
                rows.append({"input": what, "exit": "-", "message": "skipped (cannot mount a tmpfs here)", "left": "-"})
                continue
            cwd, env = d, {}
            if cmd[-1].startswith("#cwd="):
                cwd = d / cmd.pop().removeprefix("#cwd=")
            if cmd[-1].startswith("#env="):
                key, _, value = cmd.pop().removeprefix("#env=").partition("=")
                env[key] = value
            before = _snapshot(watch)
            rc, msg = _run(cmd, cwd, env)
            after = _snapshot(watch)
            if watch.name == "full":
                subprocess.run(["umount", str(watch)], check=False)
            msg = msg.replace(str(d), "<tmp>").replace(base, "<tmp>")
            rows.append({"input": what, "exit": rc, "message": msg.replace("|", "\\|")[:220],
                         "left": _left(before, after)})
            print(f"{rc:>3}  {what}: {msg[:120]}", flush=True)
    return rows


def _write(d: Path, text: str) -> str:
    (d / "tiny.yaml").write_text(text)
    return str(d / "tiny.yaml")


def main() -> None:
    argparse.ArgumentParser(description=__doc__).parse_args()
    write(fault_table())


def write(rows: list[dict[str, Any]]) -> None:
    """The `faults` section of RESULTS.md (and results/faults.json) from the table's rows."""
    from benchmarks._results import table, write_section

    md = ["## Faults: input -> exit code -> message -> what was left on disk", "",
          "Written by `python -m benchmarks.faults`: each row runs the installed `compress` command (or a Python "
          "snippet, for API rows) in a fresh folder. Exit codes: 0 ok, 2 bad input, 1 internal error. 'What was "
          "left' compares the watched folder (the --out folder, or the case's folder) before and after.", "",
          table(rows, ["input", "exit", "message", "left"])]
    write_section("faults", "\n".join(md), {"faults": rows})


if __name__ == "__main__":
    main()
