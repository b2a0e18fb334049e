"""``compress.apply``: the whole pipeline a recipe describes, writing a run folder.

build model and data -> train or load the baseline -> stages (via a Session fed by the Trainer)
-> export -> validate -> thresholds -> report. Bad input is found before the run folder is touched.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler
from tqdm import tqdm

from compress.core.bounded import load_yaml_file
from compress.core.dryrun import dry_run
from compress.core.errors import RecipeError, RunFolderError, storage_error
from compress.core.io import atomic_write_text
from compress.core.machine import set_threads
from compress.core.progress import LOGGERS, bars_off, fig, seconds
from compress.core.size import count_macs, count_params, deployed_size_bytes
from compress.core.tracing import iter_tensors
from compress.core.trust import CLI_SWITCH, allow_code, code_trusted, locate, no_code
from compress.export.records import ThresholdRecord
from compress.preflight import check_data_fits, check_recipe
from compress.recipe import Recipe, load_recipe
from compress.report import ModelFigures, Report, StageReport, machine, versions
from compress.run_folder import RunFolder
from compress.session import Session, StageResult
from compress.state import save_compressed
from compress.training import (
    Dist,
    Trainer,
    evaluate,
    init_distributed,
    resolve_device,
    save_checkpoint,
    seed_everything,
)

log = logging.getLogger(__name__)
FILE_ONLY = {"file_only": True}  # a log record for run.log, kept off the console (see compress.cli)


class _Run:
    """The objects one run shares between its steps."""

    def __init__(self, recipe: Recipe, *, device: str | None, quiet: bool) -> None:
        from compress.data import build_data
        from compress.models import load_model

        self.recipe = recipe
        # progress bars only on a terminal: redirected, every tqdm update is a line in the file
        self.quiet = quiet or not sys.stderr.isatty()
        self.device = resolve_device(device or recipe.train.device)
        self.dist: Dist = init_distributed(self.device, recipe.distributed)
        set_threads(recipe.train.threads, local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        seed_everything(recipe.train.seed)
        self.data = build_data(
            recipe.data, batch_size=recipe.train.batch_size, seed=recipe.data.seed,
            rank=self.dist.rank, world_size=self.dist.world_size, where=recipe.where,
        )
        seed_everything(recipe.train.seed)
        self.model: nn.Module = load_model(recipe.model, where=recipe.where)
        self.metric = recipe.train.metric
        from compress.core.metrics import make_metric

        # an unknown metric fails here, before any work
        self.higher_is_better = make_metric(self.metric, where=recipe.where("train.metric")).higher_is_better
        self.reference: nn.Module | None = None
        self.report: Report | None = None  # the run's report as far as it got (written on a failure too)
        self.folder: RunFolder | None = None  # rank 0's run folder (records what the run wrote)

    def record(self) -> None:
        """List the files written so far as the run's own (rank 0)."""
        if self.folder is not None:
            self.folder.record()

    @property
    def train_loader(self) -> DataLoader[Any]:
        """The train split, sharded by rank; the same sampler order for one process or many."""
        base = self.data.train
        if base is None:
            raise RecipeError(f"{self.recipe.where('data.source')}: the data source has no train split")
        per_rank = max(self.recipe.train.batch_size // self.dist.world_size, 1)
        sampler: DistributedSampler[Any] = DistributedSampler(
            base.dataset, num_replicas=self.dist.world_size, rank=self.dist.rank, shuffle=True,
            seed=self.recipe.train.seed,
        )
        return DataLoader(base.dataset, batch_size=per_rank, sampler=sampler, num_workers=self.recipe.data.num_workers,
                          collate_fn=base.collate_fn)

    def evaluate(self, model: nn.Module) -> float:
        """The task metric on the eval split (NaN when the data has no eval split)."""
        if self.data.eval is None:
            return float("nan")
        ref = self.reference if self.reference is not None else model
        return evaluate(model, self.data.eval, metric=self.metric, reference=ref, device=self.device,
                        progress=not self.quiet)

    def select_evaluate(self, model: nn.Module) -> float:
        """The task metric on the calibration split: what accuracy control chooses on, so that the
        eval split's figures are not tuned on (the eval split when there is no calibration split)."""
        if self.data.calibration is None:
            return self.evaluate(model)
        ref = self.reference if self.reference is not None else model
        return evaluate(model, self.data.calibration, metric=self.metric, reference=ref, device=self.device)

    def figures(self, model: nn.Module, *, accuracy: float) -> ModelFigures:
        macs = None
        try:
            macs = count_macs(model, _to(self.data.example_inputs, self.device))
        except Exception as exc:  # MACs are informative; a model the counter can't run still reports the rest
            log.warning("could not count MACs: %s", exc)
        return ModelFigures(accuracy=None if math.isnan(accuracy) else accuracy, params=count_params(model), macs=macs, size_bytes=deployed_size_bytes(model))


def _to(x: Any, device: torch.device) -> Any:
    from compress.core.batching import to_device

    return to_device(x, device)


@contextmanager
def _log_to(path: Path | None, quiet: bool) -> Iterator[None]:
    handlers: list[logging.Handler] = []
    if path is not None:
        fh = logging.FileHandler(path, encoding="utf-8")
        fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        handlers.append(fh)
    loggers = [logging.getLogger(n) for n in LOGGERS]
    old = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.INFO)
        for h in handlers:
            lg.addHandler(h)
    try:
        yield
    finally:
        for lg, lvl in zip(loggers, old):
            lg.setLevel(lvl)
            for h in handlers:
                lg.removeHandler(h)
        for h in handlers:
            h.close()


def _check_same_recipe(recipe: Recipe, out_dir: Path) -> None:
    """--resume continues the run its folder describes: a different recipe would mix two runs."""
    saved = load_yaml_file(RunFolder(out_dir).inside("recipe.yaml"), what="run's recipe")
    with contextlib.suppress(RecipeError):  # through the current schema: fields added since are no difference
        saved = load_recipe(saved).to_dict()
    now = recipe.to_dict()
    for d in (saved, now):
        if isinstance(d, dict) and isinstance(d.get("train"), dict):
            d["train"].pop("threads", None)  # how many threads ran it does not change the run
    if saved != now:
        keys = sorted({*saved, *now} if isinstance(saved, dict) else now)
        differ = [k for k in keys if not isinstance(saved, dict) or saved.get(k) != now.get(k)]
        raise RecipeError(
            f"--resume: the recipe differs from {out_dir / 'recipe.yaml'} in {', '.join(differ)}; "
            "resume with the run's own recipe (compress apply RUN/recipe.yaml --resume) or start a new run"
        )


def plan(recipe: Recipe | str | Path, *, overrides: list[str] | None = None, device: str | None = None,
         trust_code: bool = False) -> dict[str, Any]:
    """The resolved plan of a recipe without running it: stages and the modules each modifier matches,
    after the checks ``apply`` makes before training (field conflicts, this machine, data vs model).

    A plan writes nothing (a GGUF model it has not converted yet is planned from the file's
    metadata), and never imports or calls code the recipe names (``pkg.module:factory``), trusted or not:
    such a recipe's plan lists that code, where its module lies and whether it would run
    (``trust_code``), and leaves the module matching to the run.
    """
    r = recipe if isinstance(recipe, Recipe) and not overrides else load_recipe(recipe, overrides=overrides or [])
    from compress.data import build_data
    from compress.models import load_model

    check_recipe(r, device=device)
    refs = r.code()
    if refs:
        trusted = trust_code or r.trusts_code
        runs = "runs in the run" if trusted else f"refused without {CLI_SWITCH}"
        return {"recipe": r.name, "model": _model_label(r), "params": None, "data": f"{r.data.source}",
                "code": [{"field": r.where(path), "callable": ref, "runs": runs,
                          "where": "the model folder's own Python files" if ref.endswith("(trust_remote_code)")
                          else locate(ref)}
                         for path, ref in refs],
                "stages": [{"stage": st.name, "epochs": st.epochs, "steps": st.steps,
                            "modifiers": [{"type": m.type, "modules": None} for m in st.modifiers]}
                           for st in r.stages]}
    # belt and braces: nothing below may import a module the recipe names, nor write a file
    with no_code(), dry_run():
        data = build_data(r.data, batch_size=r.train.batch_size, seed=r.data.seed, where=r.where)
        model = load_model(r.model, where=r.where)
        if not any(p.is_meta for p in model.parameters()):  # a GGUF model not converted yet has no weights
            check_data_fits(r, model, data.example_inputs)
        session = Session(r, model)
        stages = session.plan()
    shapes = ", ".join(str(list(t.shape)) for t in iter_tensors(data.example_inputs))
    return {"recipe": r.name, "model": type(model).__name__, "params": count_params(model), "stages": stages,
            "data": f"{r.data.source}, batches of {shapes or 'no example inputs'}"}


def _model_label(r: Recipe) -> str:
    m = r.model
    return f"factory '{m.name}'" if m.name is not None else f"'{m.hf_path}'"


def apply(
    recipe: Recipe | str | Path,
    *,
    out_dir: str | Path,
    overrides: list[str] | None = None,
    device: str | None = None,
    overwrite: bool = False,
    resume: bool = False,
    quiet: bool = False,
    trust_code: bool = False,
) -> Report:
    """Run a recipe end to end and write the run folder; returns the Report.

    The folder gets the resolved ``recipe.yaml``, ``report.json``, ``report.md`` (+ plot),
    ``checkpoints/`` and ``run.log``. A missed threshold is reported in ``report.thresholds``
    (the CLI exits 3); it does not raise here. Code the recipe names (``pkg.module:factory``) runs
    only with ``trust_code=True`` or a recipe loaded with it; otherwise the run is refused first.
    """
    r = recipe if isinstance(recipe, Recipe) and not overrides else load_recipe(recipe, overrides=overrides or [])
    trusted = trust_code or r.trusts_code
    if not trusted:
        r.require_trust()
    with allow_code(trusted), bars_off(quiet):
        return _apply(r, out=Path(out_dir), device=device, overwrite=overwrite, resume=resume, quiet=quiet)


def _apply(r: Recipe, *, out: Path, device: str | None, overwrite: bool, resume: bool, quiet: bool) -> Report:
    t0 = time.perf_counter()
    check_recipe(r, device=device)
    folder = RunFolder(out)
    if int(os.environ.get("RANK", "0")) == 0:  # rank 0 alone owns the folder under torchrun
        folder.check(overwrite=overwrite, resume=resume)
        if resume:
            _check_same_recipe(r, out)
            from compress.checkpoints import check_resumable

            # a corrupt or truncated checkpoint stops the run here (exit 2), not after the model is built
            check_resumable(out / "checkpoints", trains_baseline=r.train.epochs > 0)
    run = _Run(r, device=device, quiet=quiet)  # bad model/data input raises here, before the folder is touched
    check_data_fits(r, run.model, run.data.example_inputs)
    main = run.dist.is_main
    run.folder = folder if main else None
    with contextlib.ExitStack() as held:
        if main:
            # held to the end of the run, and the folder checked again under it: another run may
            # have written or started there since the check above
            held.enter_context(folder.lock())
            folder.check(overwrite=overwrite, resume=resume)
        return _run_in_folder(run, folder, out, resume=resume, overwrite=overwrite, quiet=quiet, t0=t0)


def _run_in_folder(run: _Run, folder: RunFolder, out: Path, *, resume: bool, overwrite: bool, quiet: bool,
                   t0: float) -> Report:
    """Prepare the run folder (rank 0), run the pipeline with its log, write the report."""
    r = run.recipe
    main = run.dist.is_main
    if main:
        if resume:
            folder.clear_unfinished()
        elif overwrite and (folder.is_run() or folder.is_legacy_run()):
            folder.clear()
        try:
            (out / "checkpoints").mkdir(parents=True, exist_ok=True)
            atomic_write_text(out / "recipe.yaml", r.to_yaml())
            folder.record()
        except OSError as exc:
            raise RunFolderError(f"--out {out}: cannot write the run folder ({exc.strerror or exc})") from None
    if run.dist.enabled:  # the other ranks write their logs only into the folder rank 0 has prepared
        torch.distributed.barrier()
    try:
        # rank 0 writes run.log; under torchrun every other rank its own file beside it
        with _log_to(out / ("run.log" if main else f"run.rank{run.dist.rank}.log"), quiet):
            try:
                report = _run(run, out, resume=resume)
            except Exception as exc:
                # the traceback belongs in run.log only (the console's one line is the CLI's), and the
                # folder gets a report that says the run failed and where it got to; then re-raise
                log.error("run failed: %s: %s", type(exc).__name__, exc, exc_info=True, extra=FILE_ONLY)
                storage = storage_error(exc)
                if main:
                    failed = run.report or Report(recipe=r.to_dict(), versions=versions(), machine=machine())
                    failed.error = str(storage) if storage else f"{type(exc).__name__}: {exc}"
                    failed.seconds = time.perf_counter() - t0
                    try:
                        failed.write(out)
                        folder.record()
                    except OSError as again:  # the disk that filled up takes no report either
                        log.warning("could not write the failed run's report: %s", again.strerror or again, extra=FILE_ONLY)
                if storage is not None:
                    raise storage from exc
                raise
            report.seconds = time.perf_counter() - t0
            if main:
                report.write(out)
                folder.record()
            if run.dist.enabled:
                report = _share_report(report, group=run.dist.wait_group)
    finally:
        if run.dist.enabled and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return report


def _share_report(report: Report, *, group: Any = None) -> Report:
    """Rank 0's report, on every rank: one set of records, one threshold verdict, one exit code.
    The other ranks wait here through rank 0's export and validation: ``group`` is one whose
    timeout is not distributed.timeout_s."""
    box: list[Any] = [report.model_dump(mode="json") if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(box, src=0, group=group)
    return Report.model_validate(box[0])


def _run(run: _Run, out: Path, *, resume: bool) -> Report:
    r = run.recipe
    main = run.dist.is_main
    ckpt_dir = out / "checkpoints"
    model = run.model.to(run.device)
    trainer = Trainer(r.train, device=run.device, distributed=run.dist, progress=not run.quiet)
    trainer.data_name = f"data '{r.data.source}'"

    # ---- baseline ----
    baseline_ckpt = ckpt_dir / "baseline.pt"
    if resume and baseline_ckpt.exists():
        from compress.checkpoints import load_baseline

        load_baseline(baseline_ckpt, model)
        log.info("resumed: baseline loaded from %s", baseline_ckpt)
    elif r.train.epochs > 0:
        last = ckpt_dir / "baseline_last.pt"
        # under FSDP2 each rank writes its shards (torch.distributed.checkpoint); resumable on any
        # number of ranks, one included
        sharded = ckpt_dir / "baseline_last.dcp"
        start, opt = 0, None
        if resume and sharded.is_dir():
            from compress.distributed import load_sharded
            from compress.training import build_optimizer

            opt = build_optimizer(model, r.train)
            start = load_sharded(sharded, model, opt)
            log.info("resumed baseline training at epoch %d from %s (%d rank(s))", start, sharded.name,
                     run.dist.world_size)
        elif resume and last.exists():
            from compress.checkpoints import load_baseline

            state = load_baseline(last, model)
            from compress.training import build_optimizer

            opt = build_optimizer(model, r.train)
            if state.get("optimizer"):
                opt.load_state_dict(state["optimizer"])
            start = int(state["epoch"])
            log.info("resumed baseline training at epoch %d", start)
        def checkpoint(m: nn.Module, o: torch.optim.Optimizer | None, e: int) -> None:
            if run.dist.sharded:
                from compress.distributed import save_sharded

                save_sharded(sharded, m, o, e)
                stale: Path = last
            else:
                save_checkpoint(last, m, o, e)
                stale = sharded
            if main:  # a resumed run that changed strategy: the older kind must not be resumed from next
                if stale.is_dir():
                    import shutil

                    shutil.rmtree(stale, ignore_errors=True)
                else:
                    stale.unlink(missing_ok=True)
            run.record()

        trainer.checkpoint = checkpoint
        res = trainer.fit(model, run.train_loader, epochs=r.train.epochs, optimizer=opt, start_epoch=start,
                          desc="baseline")
        trainer.checkpoint = None
        log.info("baseline trained: %d epochs, final loss %s, %s", res.epochs, fig(res.final_loss), seconds(res.seconds))
        if main:
            save_checkpoint(baseline_ckpt, model, None, int(r.train.epochs))
            run.record()
    run.reference = copy.deepcopy(model).eval()
    for p in run.reference.parameters():
        p.requires_grad_(False)
    report = run.report = Report(recipe=r.to_dict(), versions=versions(), machine=machine(), metric=run.metric)
    report.baseline = run.figures(model, accuracy=run.evaluate(model))
    log.info("baseline %s: %s", run.metric, fig(report.baseline.accuracy))

    # ---- stages ----
    calib = run.data.calibration
    calibration = (
        tqdm(calib, desc="calibrate", disable=run.quiet or not main, leave=False) if calib is not None else None
    )
    session = Session(
        r, model, steps_per_epoch=len(run.train_loader), calibration_data=calibration, train_data=run.train_loader,
        example_inputs=_to(run.data.example_inputs, run.device), evaluate=run.evaluate,
        select_evaluate=run.select_evaluate, higher_is_better=run.higher_is_better, device=run.device,
        out_dir=out / "artifacts" if main else None, trust_code=code_trusted(),
    )
    stage_t = [time.perf_counter()]

    def on_end(s: Session, res: StageResult) -> None:
        acc = run.evaluate(s.model)
        report.stages.append(StageReport(
            name=res.name, metrics=res.metrics, tables=res.tables,
            artifacts=[str(Path(a).relative_to(out)) if Path(a).is_relative_to(out) else a for a in res.artifacts],
            model=run.figures(s.model, accuracy=acc), seconds=time.perf_counter() - stage_t[0],
        ))
        log.info("stage '%s' done: %s %s (%s)", res.name, run.metric, fig(acc), seconds(time.perf_counter() - stage_t[0]))
        run.record()
        stage_t[0] = time.perf_counter()

    session.on_stage_end(on_end)
    # a training stage killed mid-way continues from its last epoch's checkpoint
    from compress.checkpoints import find_stage, load_stage, save_stage

    point = find_stage(ckpt_dir) if resume else None
    if point is not None:
        session.resume(point.progress["session"])
        report.stages = [StageReport.model_validate(x) for x in point.progress["report_stages"]]

    def stage_checkpoint(m: nn.Module, o: torch.optim.Optimizer, e: int) -> None:
        if not session.resumable:  # e.g. a pruning schedule: --resume reruns this stage from its start
            return
        save_stage(ckpt_dir, session, m, o, e, ranks=run.dist,
                   report_stages=[x.model_dump(mode="json") for x in report.stages])
        run.record()

    trainer.stage_checkpoint = stage_checkpoint
    with session:
        while not session.finished:
            stage = session.stage
            assert stage is not None  # not finished implies a current stage
            opt, start = None, 0
            if point is not None and session.stage_index == point.stage:
                from compress.training import build_optimizer

                opt = build_optimizer(model, r.train, lr=stage.lr)  # as Trainer.fit builds it
                session.optimizer = opt
                load_stage(point, session, model, opt, rank=run.dist.rank)
                start = point.epochs_done
                log.info("resumed stage '%s' at epoch %d from %s (%d rank(s))", stage.name, start, point.path.name,
                         run.dist.world_size)
                point = None
            trainer.fit(model, run.train_loader, epochs=stage.epochs, steps=stage.steps, lr=stage.lr,
                        session=session, optimizer=opt, start_epoch=start, desc=stage.name)
    trainer.stage_checkpoint = None
    report.final = run.figures(model, accuracy=run.evaluate(model))
    if main:
        # weights plus the compression state as data (pruning plans, quantizer config): restorable
        # with weights_only=True (compress.state.restore_compressed), never a pickled module
        save_compressed(ckpt_dir / "final.pt", model, [m for stage in session.modifiers for m in stage])
        run.record()

    # ---- export, validation and thresholds: rank 0 alone; the others receive its report ----
    if main:
        if r.export.enabled and run.data.example_inputs is not None:
            _export_and_validate(run, model, out, report)
        report.thresholds = check_thresholds(r, report)
    return report


def _export_and_validate(run: _Run, model: nn.Module, out: Path, report: Report) -> None:
    from compress.export.pipeline import export_model
    from compress.export.validation.measure import validate_exports

    r = run.recipe
    model = model.to("cpu").eval()
    reference = run.reference.to("cpu") if run.reference is not None else None
    import hashlib

    meta = {"recipe": r.name, "recipe_sha256": hashlib.sha256(r.to_yaml().encode()).hexdigest()[:16]}
    records = export_model(model, _to(run.data.example_inputs, torch.device("cpu")), r.export, out / "export",
                           name=r.name, baseline=reference, metadata=meta)
    report.exports = [rec.model_copy(update={"path": _rel(rec.path, out)}) for rec in records]
    run.record()
    if not r.validate_.enabled or run.data.eval is None:
        return
    if r.export.generation:
        from compress.export.llm.generation import prompts_from, validate_generation

        cfg = getattr(model, "config", None)
        prompts = prompts_from(run.data.eval, count=4, new_tokens=r.validate_.generate_tokens,
                               max_positions=getattr(cfg, "max_position_embeddings", None))
        gvals = validate_generation(records, r.validate_, prompts, reference=model, baseline_reference=reference)
        report.validation = [v.model_copy(update={"model_path": _rel(v.model_path, out)}) for v in gvals]
        return
    from compress.core.metrics import make_metric

    needs_ref = make_metric(run.metric).needs_reference
    # the run's own metric (perplexity for a causal LM exported without the generation file), not the task's default
    vals = validate_exports(records, r.validate_, eval_loader=run.data.eval, reference=model, metric=run.metric,
                            baseline_reference=reference, task="embedding" if needs_ref else "classification")
    report.validation = [v.model_copy(update={"model_path": _rel(v.model_path, out)}) for v in vals]


def _rel(path: Path, root: Path) -> Path:
    p = Path(path)
    return p.relative_to(root) if p.is_relative_to(root) else p


def check_thresholds(recipe: Recipe, report: Report) -> list[ThresholdRecord]:
    """The recipe's validate.thresholds against what the run measured (export.validation.measure.check_thresholds)."""
    from compress.core.metrics import make_metric
    from compress.export.validation.measure import check_thresholds as check

    return check(recipe.validate_.thresholds, report.validation, exports=report.exports,
                 baseline_accuracy=report.baseline.accuracy, final_accuracy=report.final.accuracy,
                 higher_is_better=make_metric(recipe.train.metric).higher_is_better)
