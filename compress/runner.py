"""``compress.apply``: the whole pipeline a recipe describes, writing a run folder.

build model and data -> train or load the baseline -> stages (via a Session fed by the Trainer)
-> export -> validate -> thresholds -> report. Bad input is found before the run folder is touched.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import logging
import math
import os
import shutil
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

# module-qualified: the fault tests replace their functions on the module (a run killed right after
# a checkpoint, a model that must not be built yet)
from compress import checkpoints, models
from compress.core.batching import to_device
from compress.core.bounded import load_yaml_file
from compress.core.dryrun import dry_run
from compress.core.errors import RecipeError, RunFolderError, storage_error
from compress.core.io import atomic_write_text
from compress.core.machine import peak_rss_mb, set_threads
from compress.core.metrics import make_metric
from compress.core.progress import LOGGERS, bars_off, fig, seconds
from compress.core.size import count_macs, count_params, deployed_size_bytes
from compress.core.tracing import iter_tensors
from compress.core.trust import CLI_SWITCH, allow_code, code_trusted, locate, no_code
from compress.data import build_data
from compress.distributed import load_sharded, save_sharded
from compress.export.records import ExportRecord, ThresholdRecord
from compress.pipelines import pipeline_name
from compress.preflight import check_data_fits, check_exports, check_recipe
from compress.recipe import Recipe, load_recipe
from compress.report import ModelFigures, Report, StageReport, machine, versions
from compress.run_folder import RunFolder
from compress.session import Session, StageResult
from compress.state import save_compressed
from compress.training import (
    Dist,
    Trainer,
    build_optimizer,
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
        self.model: nn.Module = models.load_model(recipe.model, where=recipe.where)
        self.metric = recipe.train.metric
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
            macs = count_macs(model, to_device(self.data.example_inputs, self.device))
        except Exception as exc:  # MACs are informative; a model the counter can't run still reports the rest
            log.warning("could not count MACs: %s", exc)
        return ModelFigures(accuracy=None if math.isnan(accuracy) else accuracy, params=count_params(model), macs=macs, size_bytes=deployed_size_bytes(model))


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
    after the checks ``apply`` makes before training (field conflicts, this machine, data vs model,
    the requested LLM exports vs the model).

    A plan writes nothing (a GGUF model it has not converted yet is planned from the file's
    metadata), and never imports or calls code the recipe names (``pkg.module:factory``), trusted or not:
    such a recipe's plan lists that code, where its module lies and whether it would run
    (``trust_code``), and leaves the module matching to the run.
    """
    r = recipe if isinstance(recipe, Recipe) and not overrides else load_recipe(recipe, overrides=overrides or [])
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
                "stages": [{"stage": st.name, "epochs": st.epochs, "steps": st.steps, "pipeline": pipeline_name(st),
                            "modifiers": [{"type": m.type, "modules": None} for m in st.modifiers]}
                           for st in r.stages]}
    # belt and braces: nothing below may import a module the recipe names, nor write a file
    with no_code(), dry_run():
        data = build_data(r.data, batch_size=r.train.batch_size, seed=r.data.seed, where=r.where)
        model = models.load_model(r.model, where=r.where)
        if not any(p.is_meta for p in model.parameters()):  # a GGUF model not converted yet has no weights
            check_data_fits(r, model, data.example_inputs)
        check_exports(r, model, data.example_inputs)  # from the structure: a meta-device model is checked too
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
    if _launch_rank() == 0:  # rank 0 alone owns the folder under torchrun
        _check_folder(r, folder, overwrite=overwrite, resume=resume)
    run = _Run(r, device=device, quiet=quiet)  # bad model/data input raises here, before the folder is touched
    check_data_fits(r, run.model, run.data.example_inputs)
    check_exports(r, run.model, run.data.example_inputs)  # before the folder is touched, let alone the training
    main = run.dist.is_main
    run.folder = folder if main else None
    with contextlib.ExitStack() as held:
        if main:
            # held to the end of the run, and the folder checked again under it: another run may
            # have written or started there since the check above
            held.enter_context(folder.lock())
            folder.check(overwrite=overwrite, resume=resume)
        return _run_in_folder(run, folder, out, resume=resume, overwrite=overwrite, quiet=quiet, t0=t0)


def _launch_rank() -> int:
    """This process's rank under torchrun (0 alone), read before the process group exists."""
    return int(os.environ.get("RANK", "0"))


def _check_folder(r: Recipe, folder: RunFolder, *, overwrite: bool, resume: bool) -> None:
    """Rank 0, before the model is built: the folder may take this run; --resume continues its own."""
    folder.check(overwrite=overwrite, resume=resume)
    if resume:
        _check_same_recipe(r, folder.path)
        # a corrupt or truncated checkpoint stops the run here (exit 2), not after the model is built
        checkpoints.check_resumable(folder.path / "checkpoints", trains_baseline=r.train.epochs > 0)


def _prepare_folder(run: _Run, folder: RunFolder, out: Path, *, resume: bool, overwrite: bool) -> None:
    """Rank 0: clear what a resumed or overwritten run leaves behind, write the resolved recipe."""
    if resume:
        folder.clear_unfinished()
    elif overwrite and (folder.is_run() or folder.is_legacy_run()):
        folder.clear()
    try:
        (out / "checkpoints").mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "recipe.yaml", run.recipe.to_yaml())
        folder.record()
    except OSError as exc:
        raise RunFolderError(f"--out {out}: cannot write the run folder ({exc.strerror or exc})") from None


def _log_file(run: _Run, out: Path) -> Path:
    """rank 0 writes run.log; under torchrun every other rank its own file beside it."""
    return out / ("run.log" if run.dist.is_main else f"run.rank{run.dist.rank}.log")


def _run_in_folder(run: _Run, folder: RunFolder, out: Path, *, resume: bool, overwrite: bool, quiet: bool,
                   t0: float) -> Report:
    """Prepare the run folder (rank 0), run the pipeline with its log, write the report."""
    main = run.dist.is_main
    if main:
        _prepare_folder(run, folder, out, resume=resume, overwrite=overwrite)
    if run.dist.enabled:  # the other ranks write their logs only into the folder rank 0 has prepared
        torch.distributed.barrier()
    try:
        with _log_to(_log_file(run, out), quiet):
            try:
                report = _run(run, out, resume=resume)
            except Exception as exc:
                _report_failure(run, folder, out, exc, t0=t0)
                storage = storage_error(exc)
                if storage is not None:
                    raise storage from exc
                raise
            report.seconds = time.perf_counter() - t0
            report.peak_rss_mb = peak_rss_mb()
            if main:
                report.write(out)
                folder.record()
            if run.dist.enabled:
                report = _share_report(report, group=run.dist.wait_group)
    finally:
        if run.dist.enabled and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return report


def _report_failure(run: _Run, folder: RunFolder, out: Path, exc: Exception, *, t0: float) -> None:
    """The traceback goes to run.log only (the console's one line is the CLI's), and (rank 0) the
    folder gets a report that says the run failed and where it got to; the caller re-raises."""
    log.error("run failed: %s: %s", type(exc).__name__, exc, exc_info=True, extra=FILE_ONLY)
    if not run.dist.is_main:
        return
    storage = storage_error(exc)
    r = run.recipe
    failed = run.report or Report(recipe=r.to_dict(), versions=versions(), machine=machine())
    failed.error = str(storage) if storage else f"{type(exc).__name__}: {exc}"
    failed.seconds = time.perf_counter() - t0
    failed.peak_rss_mb = peak_rss_mb()
    try:
        failed.write(out)
        folder.record()
    except OSError as again:  # the disk that filled up takes no report either
        log.warning("could not write the failed run's report: %s", again.strerror or again, extra=FILE_ONLY)


def _share_report(report: Report, *, group: Any = None) -> Report:
    """Rank 0's report, on every rank: one set of records, one threshold verdict, one exit code.
    The other ranks wait here through rank 0's export and validation: ``group`` is one whose
    timeout is not distributed.timeout_s."""
    box: list[Any] = [report.model_dump(mode="json") if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(box, src=0, group=group)
    return Report.model_validate(box[0])


def _run(run: _Run, out: Path, *, resume: bool) -> Report:
    """The baseline, then each stage on its pipeline, then the final model, export and validation."""
    model = run.model.to(run.device)
    trainer = Trainer(run.recipe.train, device=run.device, distributed=run.dist, progress=not run.quiet)
    trainer.data_name = f"data '{run.recipe.data.source}'"
    _baseline(run, trainer, model, out / "checkpoints", resume=resume)
    report = _baseline_report(run, model)
    stages = _Stages(run, trainer, model, out, report, resume=resume)
    with stages.session.drive() as session:
        while not session.finished:
            session.run_stage(stages.train)
    trainer.stage_checkpoint = None
    _finish(run, model, session, out, report)
    return report


def _baseline(run: _Run, trainer: Trainer, model: nn.Module, ckpt_dir: Path, *, resume: bool) -> None:
    """The model the stages start from: loaded from the run's baseline.pt on --resume, else trained
    for train.epochs (resumed from its last epoch's checkpoint), else the model as built."""
    r = run.recipe
    baseline_ckpt = ckpt_dir / "baseline.pt"
    if resume and baseline_ckpt.exists():
        checkpoints.load_baseline(baseline_ckpt, model)
        log.info("resumed: baseline loaded from %s", baseline_ckpt)
        return
    if r.train.epochs <= 0:
        return
    last = ckpt_dir / "baseline_last.pt"
    # under FSDP2 each rank writes its shards (torch.distributed.checkpoint); resumable on any
    # number of ranks, one included
    sharded = ckpt_dir / "baseline_last.dcp"
    start, opt = _resume_baseline(run, model, last, sharded) if resume else (0, None)

    def checkpoint(m: nn.Module, o: torch.optim.Optimizer | None, e: int) -> None:
        if run.dist.sharded:
            save_sharded(sharded, m, o, e)
            stale: Path = last
        else:
            save_checkpoint(last, m, o, e)
            stale = sharded
        if run.dist.is_main:  # a resumed run that changed strategy: the older kind must not be resumed from next
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)
        run.record()

    trainer.checkpoint = checkpoint
    res = trainer.fit(model, run.train_loader, epochs=r.train.epochs, optimizer=opt, start_epoch=start,
                      desc="baseline")
    trainer.checkpoint = None
    log.info("baseline trained: %d epochs, final loss %s, %s", res.epochs, fig(res.final_loss), seconds(res.seconds))
    if run.dist.is_main:
        save_checkpoint(baseline_ckpt, model, None, int(r.train.epochs))
        run.record()


def _resume_baseline(run: _Run, model: nn.Module, last: Path, sharded: Path) -> tuple[int, torch.optim.Optimizer | None]:
    """The epoch baseline training resumes at and its optimizer, loaded from the last epoch's
    checkpoint (sharded or not); (0, None) when there is none."""
    if sharded.is_dir():
        opt = build_optimizer(model, run.recipe.train)
        start = load_sharded(sharded, model, opt)
        log.info("resumed baseline training at epoch %d from %s (%d rank(s))", start, sharded.name,
                 run.dist.world_size)
        return start, opt
    if not last.exists():
        return 0, None
    state = checkpoints.load_baseline(last, model)
    opt = build_optimizer(model, run.recipe.train)
    if state.get("optimizer"):
        opt.load_state_dict(state["optimizer"])
    log.info("resumed baseline training at epoch %d", int(state["epoch"]))
    return int(state["epoch"]), opt


def _baseline_report(run: _Run, model: nn.Module) -> Report:
    """Freeze the baseline as the reference model and start the run's report with its figures."""
    run.reference = copy.deepcopy(model).eval()
    for p in run.reference.parameters():
        p.requires_grad_(False)
    report = run.report = Report(recipe=run.recipe.to_dict(), versions=versions(), machine=machine(),
                                 metric=run.metric, data=run.data.summary())
    report.baseline = run.figures(model, accuracy=run.evaluate(model))
    log.info("baseline %s: %s", run.metric, fig(report.baseline.accuracy))
    return report


class _Stages:
    """The recipe's stages in this run: the session, what each stage's end reports, the mid-stage
    checkpoints, and the Trainer that feeds a training stage (resumed from a checkpoint on --resume)."""

    def __init__(self, run: _Run, trainer: Trainer, model: nn.Module, out: Path, report: Report, *,
                 resume: bool) -> None:
        self.run, self.trainer, self.model, self.out, self.report = run, trainer, model, out, report
        self.ckpt_dir = out / "checkpoints"
        main = run.dist.is_main
        calib = run.data.calibration
        calibration = (
            tqdm(calib, desc="calibrate", disable=run.quiet or not main, leave=False) if calib is not None else None
        )
        self.session = Session(
            run.recipe, model, steps_per_epoch=len(run.train_loader), calibration_data=calibration,
            train_data=run.train_loader, example_inputs=to_device(run.data.example_inputs, run.device),
            evaluate=run.evaluate, select_evaluate=run.select_evaluate, higher_is_better=run.higher_is_better,
            device=run.device, out_dir=out / "artifacts" if main else None, trust_code=code_trusted(),
        )
        self.session.on_stage_end(self._ended)
        self._t0 = time.perf_counter()
        # a training stage killed mid-way continues from its last epoch's checkpoint
        self.point = checkpoints.find_stage(self.ckpt_dir) if resume else None
        if self.point is not None:
            self.session.resume(self.point.progress["session"])
            report.stages = [StageReport.model_validate(x) for x in self.point.progress["report_stages"]]
        trainer.stage_checkpoint = self._checkpoint

    def train(self, session: Session) -> None:
        """Feed the training stage in progress through the Trainer (the training pipeline's feed)."""
        stage = session.stage
        assert stage is not None  # the training pipeline feeds only a stage in progress
        opt, start = None, 0
        point = self.point
        if point is not None and session.stage_index == point.stage:
            opt = build_optimizer(self.model, self.run.recipe.train, lr=stage.lr)  # as Trainer.fit builds it
            session.optimizer = opt
            checkpoints.load_stage(point, session, self.model, opt, rank=self.run.dist.rank)
            start = point.epochs_done
            log.info("resumed stage '%s' at epoch %d from %s (%d rank(s))", stage.name, start, point.path.name,
                     self.run.dist.world_size)
            self.point = None
        self.trainer.fit(self.model, self.run.train_loader, epochs=stage.epochs, steps=stage.steps, lr=stage.lr,
                         session=session, optimizer=opt, start_epoch=start, desc=stage.name)

    def _ended(self, s: Session, res: StageResult) -> None:
        run, out = self.run, self.out
        acc = run.evaluate(s.model)
        elapsed = time.perf_counter() - self._t0
        self.report.stages.append(StageReport(
            name=res.name, metrics=res.metrics, tables=res.tables,
            artifacts=[str(Path(a).relative_to(out)) if Path(a).is_relative_to(out) else a for a in res.artifacts],
            model=run.figures(s.model, accuracy=acc), seconds=elapsed,
        ))
        log.info("stage '%s' done: %s %s (%s)", res.name, run.metric, fig(acc), seconds(elapsed))
        run.record()
        self._t0 = time.perf_counter()

    def _checkpoint(self, m: nn.Module, o: torch.optim.Optimizer, e: int) -> None:
        if not self.session.resumable:  # e.g. a pruning schedule: --resume reruns this stage from its start
            return
        checkpoints.save_stage(self.ckpt_dir, self.session, m, o, e, ranks=self.run.dist,
                   report_stages=[x.model_dump(mode="json") for x in self.report.stages])
        self.run.record()


def _finish(run: _Run, model: nn.Module, session: Session, out: Path, report: Report) -> None:
    """The final model's figures and checkpoint; export, validation and thresholds on rank 0 alone
    (the others receive its report)."""
    report.final = run.figures(model, accuracy=run.evaluate(model))
    if not run.dist.is_main:
        return
    # weights plus the compression state as data (pruning plans, quantizer config): restorable
    # with weights_only=True (compress.state.restore_compressed), never a pickled module
    save_compressed(out / "checkpoints" / "final.pt", model, [m for stage in session.modifiers for m in stage])
    run.record()
    r = run.recipe
    if r.export.enabled and run.data.example_inputs is not None:
        _export_and_validate(run, model, out, report)
    report.thresholds = check_thresholds(r, report)


def _export_and_validate(run: _Run, model: nn.Module, out: Path, report: Report) -> None:
    # export's stack (onnx, its runtimes) takes seconds to import: imported where a run exports, so
    # that a dry run, a plan and a run without export never pay for it
    from compress.export.pipeline import export_model
    from compress.export.validation.measure import validate_exports

    r = run.recipe
    model = model.to("cpu").eval()
    reference = run.reference.to("cpu") if run.reference is not None else None
    meta = {"recipe": r.name, "recipe_sha256": hashlib.sha256(r.to_yaml().encode()).hexdigest()[:16]}
    records = export_model(model, to_device(run.data.example_inputs, torch.device("cpu")), r.export, out / "export",
                           name=r.name, baseline=reference, metadata=meta)
    report.exports = [rec.model_copy(update={"path": _rel(rec.path, out)}) for rec in records]
    if r.export.compressed_tensors:
        report.exports.append(_write_checkpoint(run, model, out))
    run.record()
    if not r.validate_.enabled or run.data.eval is None or not records:
        return
    if r.export.generation:
        from compress.export.llm.generation import prompts_from, validate_generation

        cfg = getattr(model, "config", None)
        prompts = prompts_from(run.data.eval, count=4, new_tokens=r.validate_.generate_tokens,
                               max_positions=getattr(cfg, "max_position_embeddings", None))
        gvals = validate_generation(records, r.validate_, prompts, reference=model, baseline_reference=reference)
        report.validation = [v.model_copy(update={"model_path": _rel(v.model_path, out)}) for v in gvals]
        return
    needs_ref = make_metric(run.metric).needs_reference
    # the run's own metric (perplexity for a causal LM exported without the generation file), not the task's default
    vals = validate_exports(records, r.validate_, eval_loader=run.data.eval, reference=model, metric=run.metric,
                            baseline_reference=reference, task="embedding" if needs_ref else "classification")
    report.validation = [v.model_copy(update={"model_path": _rel(v.model_path, out)}) for v in vals]


def _write_checkpoint(run: _Run, model: nn.Module, out: Path) -> ExportRecord:
    """The compressed-tensors folder of the final model (export.compressed_tensors), with the
    tokenizer of the recipe's ``model.hf_path`` when it has one."""
    from compress.export.llm.compressed_tensors import checkpoint_format, save_compressed_tensors
    from compress.models import load_tokenizer

    hf_path = run.recipe.model.hf_path
    tokenizer = None
    if hf_path is not None:
        try:
            tokenizer = load_tokenizer(hf_path, where="model.hf_path")
        except RecipeError as exc:  # the weights are written all the same; a server needs the tokenizer beside them
            log.warning("export.compressed_tensors: written without a tokenizer (%s)", exc)
    folder = save_compressed_tensors(model, out / "export" / "compressed-tensors", tokenizer=tokenizer)
    size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
    fmt = checkpoint_format(folder)
    return ExportRecord(path=_rel(folder, out), format=f"compressed-tensors {fmt}", role="checkpoint",
                        precision=fmt, size_bytes=size)


def _rel(path: Path, root: Path) -> Path:
    p = Path(path)
    return p.relative_to(root) if p.is_relative_to(root) else p


def check_thresholds(recipe: Recipe, report: Report) -> list[ThresholdRecord]:
    """The recipe's validate.thresholds against what the run measured (export.validation.measure.check_thresholds)."""
    # local: see _export_and_validate
    from compress.export.validation.measure import check_thresholds as check

    return check(recipe.validate_.thresholds, report.validation, exports=report.exports,
                 baseline_accuracy=report.baseline.accuracy, final_accuracy=report.final.accuracy,
                 higher_is_better=make_metric(recipe.train.metric).higher_is_better)
