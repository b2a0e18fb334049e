"""Distillation benchmark: what KD buys and what it costs, measured on scikit-learn digits.

    python -m benchmarks.distillation [--seeds 3] [--quick]

1. A narrow ResNet student trained from scratch with and without KD from a wide ResNet teacher.
2. A ResNet pruned by 70% of its channels, fine-tuned with and without KD from itself before pruning.
3. QAT (w8a8 and 4-bit weights) with and without KD from the float model.
4. Training-step time of KD over plain fine-tuning (median of timed steps after warm-up).

Every accuracy is on the 450-sample eval split; each row is the mean and standard deviation over
seeds (the seed sets the student's init and the training data order, the same for the runs with
and without KD). Everything runs through the recipe
path (Session + the built-in Trainer), as ``compress apply`` does.
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from compress.distillation.api import Distiller
from compress.distillation.losses import divergence

from benchmarks._results import median_time_ms, table, write_section
from compress.core.batching import split_batch
from compress.data import build_data
from compress.models import build_zoo_model
from compress.recipe import TrainSpec
from compress.session import Session
from compress.training import Trainer, evaluate, seed_everything

KD = {"type": "kd", "temperature": 4.0, "weight": 0.5}
COLUMNS = ["setting", "accuracy mean", "std", "per seed", "KL to teacher"]


def _data(seed: int = 0) -> Any:
    # the split is fixed (data seed 0); ``seed`` sets the train shuffle order, so that the runs with
    # and without KD at one seed see the same batches in the same order
    return build_data({"source": "digits", "calibration_samples": 256}, batch_size=32, seed=seed)


def _resnet(width: int) -> torch.nn.Module:
    return build_zoo_model("resnet", {"width": width, "depth": 1})


def _train(model: torch.nn.Module, loader: Any, *, epochs: float, lr: float, session: Session | None = None) -> None:
    spec = TrainSpec(epochs=epochs, lr=lr, batch_size=32)
    trainer = Trainer(spec, device=torch.device("cpu"), progress=False)
    if session is None:
        trainer.fit(model, loader, epochs=epochs)
        return
    with session:
        while not session.finished:
            stage = session.stage
            if stage is None:
                break
            trainer.fit(model, loader, epochs=stage.epochs, lr=stage.lr, session=session, desc=stage.name)


@torch.no_grad()
def _kl(student: torch.nn.Module, teacher: torch.nn.Module, loader: Any) -> float:
    student.eval()
    teacher.eval()
    vals = [float(divergence(student(x), teacher(x))[0]) for x, _ in loader]
    return sum(vals) / len(vals)


def _session(model: torch.nn.Module, stages: list[dict[str, Any]], data: Any) -> Session:
    recipe = {"version": 1, "model": {"name": "resnet"}, "stages": stages}
    return Session(recipe, model, calibration_data=data.calibration, train_data=data.train,
                   example_inputs=data.example_inputs)


def _stats(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def _row(name: str, accs: list[float], kls: list[float] | None = None) -> dict[str, Any]:
    m, s = _stats(accs)
    row: dict[str, Any] = {"setting": name, "accuracy mean": f"{100 * m:.2f}%", "std": f"{100 * s:.2f}",
                           "per seed": ", ".join(f"{100 * a:.1f}" for a in accs)}
    if kls is not None:
        row["KL to teacher"] = f"{statistics.mean(kls):.4f}"
    return row


# ---- 1. student from scratch --------------------------------------------------------------------


def student_from_scratch(data: Any, seeds: list[int], *, epochs: int, teacher_epochs: int) -> dict[str, Any]:
    seed_everything(0)
    teacher = _resnet(32)
    _train(teacher, data.train, epochs=teacher_epochs, lr=0.05)
    t_acc = evaluate(teacher, data.eval)
    ckpt = "/tmp/_distill_bench_teacher.pt"
    torch.save(teacher.state_dict(), ckpt)
    out: dict[str, Any] = {"teacher_accuracy": t_acc, "plain": [], "kd": [], "plain_kl": [], "kd_kl": []}
    teacher_spec = {"name": "resnet", "kwargs": {"width": 32, "depth": 1}, "checkpoint": ckpt}
    for seed in seeds:
        for variant in ("plain", "kd"):
            data = _data(seed)
            seed_everything(seed)
            student = _resnet(4)
            mods = [] if variant == "plain" else [
                {"type": "distill", "teacher": teacher_spec, "task_weight": 0.5, "losses": [KD], "eval_batches": 0}
            ]
            _train(student, data.train, epochs=epochs, lr=0.05,
                   session=_session(student, [{"name": "train", "epochs": epochs, "modifiers": mods}], data))
            out[variant].append(evaluate(student, data.eval))
            out[f"{variant}_kl"].append(_kl(student, teacher, data.eval))
    return out


# ---- 2. pruning and 3. QAT recovery -----------------------------------------------------------------


def _base(data: Any, epochs: int) -> torch.nn.Module:
    seed_everything(0)
    base = _resnet(16)
    _train(base, data.train, epochs=epochs, lr=0.05)
    return base


def recovery(
    base: torch.nn.Module, seeds: list[int], *, stage: dict[str, Any], variants: dict[str, list[dict[str, Any]] | None]
) -> dict[str, list[float]]:
    """Accuracy (``variant``) and KL at T=1 to ``base`` (``variant_kl``) after ``stage`` on a copy of
    ``base``, per variant: None = the stage alone, else the stage plus a self-teacher distill modifier
    with those losses."""
    out: dict[str, list[float]] = {k: [] for v in variants for k in (v, f"{v}_kl")}
    for seed in seeds:
        for variant, losses in variants.items():
            data = _data(seed)
            seed_everything(seed)
            model = copy.deepcopy(base)
            mods = list(stage["modifiers"])
            if losses is not None:
                mods.append({"type": "distill", "teacher": "self", "task_weight": 0.5, "losses": losses,
                             "eval_batches": 0})
            st = {**stage, "modifiers": mods}
            _train(model, data.train, epochs=st["epochs"], lr=st["lr"], session=_session(model, [st], data))
            out[variant].append(evaluate(model, data.eval))
            out[f"{variant}_kl"].append(_kl(model, base, data.eval))
    return out


def pruned_without_finetune(data: Any, base: torch.nn.Module, ratio: float) -> float:
    model = copy.deepcopy(base)
    session = _session(model, [{"name": "p", "modifiers": [{"type": "prune", "ratio": ratio}]}], data)
    with session:
        pass
    return evaluate(model, data.eval)


# ---- 4. step time ---------------------------------------------------------------------------------


def step_times(data: Any, *, rounds: int) -> list[dict[str, Any]]:
    x, y = split_batch(next(iter(data.train)))
    x = torch.cat([x, x])[:64]
    y = torch.cat([y, y])[:64]
    seed_everything(0)
    student = _resnet(16)
    wide = _resnet(32)
    cases: list[tuple[str, Distiller | None]] = [
        ("plain fine-tuning (CE)", None),
        ("CE + KD, self teacher (width 16)", Distiller(copy.deepcopy(student), student, losses=[KD])),
        ("CE + KD + feature hint, self teacher",
         Distiller(copy.deepcopy(student), student, losses=[KD, {"type": "feature", "layers": {"layer3": "layer3"}}],
                   example_inputs=x)),
        ("CE + KD, wide teacher (width 32)", Distiller(wide, student, losses=[KD])),
        ("CE + KD + feature hint via adapter, wide teacher",
         Distiller(wide, student, losses=[KD, {"type": "feature", "layers": {"layer3": "layer3"}}], example_inputs=x)),
    ]
    steps: dict[str, Any] = {}
    for name, d in cases:
        params = list(student.parameters()) + (list(d.parameters()) if d is not None else [])
        opt = torch.optim.SGD(params, lr=0.01, momentum=0.9)

        def step(d: Distiller | None = d, opt: torch.optim.Optimizer = opt) -> None:
            out = student(x)
            loss = F.cross_entropy(out, y)
            if d is not None:
                loss = d(x, out, loss)
            opt.zero_grad()
            loss.backward()
            opt.step()

        steps[name] = step
    student.train()
    # interleaved rounds: load from other processes on a shared box hits every case alike
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            samples[name].append(median_time_ms(step, warmup=2, runs=10))
    times = {name: statistics.median(v) for name, v in samples.items()}
    for _, d in cases:
        if d is not None:
            d.remove()
    rows: list[dict[str, Any]] = []
    plain = times["plain fine-tuning (CE)"]
    for name, ms in times.items():
        rows.append({"step": name, "median ms": round(ms, 2), "x plain": f"{ms / plain:.2f}x"})
    return rows


def _delta(res: dict[str, list[float]], a: str, b: str) -> str:
    (ma, sa), (mb, sb) = _stats(res[a]), _stats(res[b])
    kl = ""
    if f"{a}_kl" in res:
        ka, kb = statistics.mean(res[f"{a}_kl"]), statistics.mean(res[f"{b}_kl"])
        ratio = f"{kb / max(ka, 1e-12):.2f}x lower with KD" if ka <= kb else f"{ka / max(kb, 1e-12):.2f}x higher with KD"
        kl = f", KL to the teacher {ka:.4f} vs {kb:.4f} ({ratio})"
    return f"{100 * ma:.2f}% ± {sa * 100:.2f} vs {100 * mb:.2f}% ± {sb * 100:.2f} ({100 * (ma - mb):+.2f} points){kl}"


def _reading(scratch: dict[str, Any], pruned: dict[str, list[float]], qat: dict[str, dict[str, list[float]]],
             steps: list[dict[str, Any]]) -> str:
    """The comparisons the tables hold, as sentences computed from the same numbers (KD first)."""
    lines = [
        f"- Student from scratch, KD vs CE only: {_delta(scratch, 'kd', 'plain')}.",
        f"- Pruning recovery, KD vs CE only: {_delta(pruned, 'kd', 'plain')}; with the hint: "
        f"{_delta(pruned, 'kd_hint', 'plain')}.",
    ]
    lines += [f"- QAT {label}, KD vs CE only: {_delta(res, 'kd', 'plain')}." for label, res in qat.items()]
    over = ", ".join(f"{r['step']}: {r['x plain']}" for r in steps[1:])
    lines.append(f"- Step time over plain fine-tuning: {over}.")
    return "Reading (computed from the tables; ± is the standard deviation over seeds):\n\n" + "\n".join(lines) + "\n"


# ---- main -----------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="fewer epochs and timed steps (a smoke run)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)  # a shared 2-core box: one intra-op thread gives stable, comparable timings
    seeds = list(range(args.seeds))
    q = args.quick
    t0 = time.perf_counter()
    data = _data()

    scratch = student_from_scratch(data, seeds, epochs=2 if q else 6, teacher_epochs=2 if q else 15)
    base = _base(data, 2 if q else 15)
    base_acc = evaluate(base, data.eval)
    ratio = 0.7
    pruned0 = pruned_without_finetune(data, base, ratio)
    prune_stage = {"name": "prune", "epochs": 1 if q else 2, "lr": 0.02,
                   "modifiers": [{"type": "prune", "ratio": ratio, "importance": "l2"}]}
    hint = {"type": "feature", "layers": {"layer3": "layer3"}, "weight": 0.1, "normalize": True}
    pruned = recovery(base, seeds, stage=prune_stage, variants={"plain": None, "kd": [KD], "kd_hint": [KD, hint]})
    qat: dict[str, dict[str, Any]] = {}
    schemes: list[tuple[str, Any]] = [
        ("w8a8", "w8a8"),
        ("w4a8, 4-bit per-channel weights", {"preset": "w8a8", "weights": {"bits": 4, "granularity": "channel"}}),
        ("w4a8, 4-bit per-tensor weights", {"preset": "w8a8", "weights": {"bits": 4, "granularity": "tensor"}}),
    ]
    for label, scheme in schemes:
        stage = {"name": "qat", "epochs": 1 if q else 2, "lr": 0.005, "modifiers": [{"type": "qat", "scheme": scheme}]}
        qat[label] = recovery(base, seeds, stage=stage, variants={"plain": None, "kd": [KD]})
    steps = step_times(data, rounds=3 if q else 12)
    minutes = (time.perf_counter() - t0) / 60

    rows1 = [
        {"setting": "teacher: ResNet width 32", "accuracy mean": f"{100 * scratch['teacher_accuracy']:.2f}%",
         "std": "", "per seed": "seed 0 only"},
        _row("student width 4, CE only", scratch["plain"], scratch["plain_kl"]),
        _row("student width 4, 0.5 CE + 0.5 KD (T=4)", scratch["kd"], scratch["kd_kl"]),
    ]
    rows2 = [
        {"setting": "ResNet width 16 before pruning", "accuracy mean": f"{100 * base_acc:.2f}%", "std": "", "per seed": ""},
        {"setting": f"pruned {int(ratio * 100)}% of channels, no fine-tuning", "accuracy mean": f"{100 * pruned0:.2f}%",
         "std": "", "per seed": ""},
        _row(f"pruned + {prune_stage['epochs']} epochs CE", pruned["plain"], pruned["plain_kl"]),
        _row(f"pruned + {prune_stage['epochs']} epochs 0.5 CE + 0.5 KD (self teacher)", pruned["kd"], pruned["kd_kl"]),
        _row(f"pruned + {prune_stage['epochs']} epochs 0.5 CE + 0.5 KD + 0.1 hint on layer3", pruned["kd_hint"],
             pruned["kd_hint_kl"]),
    ]
    rows3 = []
    for label, res in qat.items():
        rows3.append(_row(f"QAT {label}, CE", res["plain"], res["plain_kl"]))
        rows3.append(_row(f"QAT {label}, 0.5 CE + 0.5 KD (self teacher)", res["kd"], res["kd_kl"]))
    md = (
        "## Distillation (`python -m benchmarks.distillation`)\n\n"
        "Distillation on scikit-learn digits (450-sample eval split), through Session + the built-in Trainer"
        f" (SGD, cosine LR), torch on 1 thread, seeds {seeds}; total {minutes:.1f} min."
        + (" **Quick smoke run: fewer epochs than the full benchmark.**" if q else "") + "\n\n"
        f"**Student from scratch** ({'2' if q else '6'} epochs; KL at T=1 to the teacher on the eval split):\n\n"
        + table(rows1, COLUMNS)
        + f"\n**Pruning recovery** (one-shot L2 pruning of {int(ratio * 100)}% of the channels of every group;"
        " KD from the unpruned model; KL at T=1 to the unpruned model):\n\n"
        + table(rows2, COLUMNS)
        + f"\n**QAT** ({'1' if q else '2'} epochs from the trained float model, lr 0.005; fake-quant accuracy in PyTorch;"
        " KL at T=1 to the float model):\n\n"
        + table(rows3, COLUMNS)
        + "\n" + _reading(scratch, pruned, qat, steps)
        + "\n**Training-step time** (ResNet width 16 student, batch 64 of 1x8x8 digits, forward + loss + backward"
        " + SGD step; per case the median over interleaved rounds (12; 3 when quick) of 10 timed steps after warm-up, all cases in one"
        " process):\n\n"
        + table(steps)
    )
    write_section("distillation", md, {
        "seeds": seeds, "quick": q, "scratch": scratch, "base_accuracy": base_acc, "pruned_no_ft": pruned0,
        "prune_ratio": ratio, "pruned": pruned, "qat": qat, "step_times": steps, "minutes": minutes,
    })
    print(md)


if __name__ == "__main__":
    main()
