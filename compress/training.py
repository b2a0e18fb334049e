"""The built-in trainer and evaluator.

The trainer feeds a Session (when given one) the events of an ordinary loop: ``loss`` per batch,
``step`` per optimizer step, ``epoch_end`` per epoch. It runs the same under torchrun
(DistributedDataParallel, or FSDP2 sharding with ``distributed.strategy: fsdp``; gloo on CPU, nccl
on CUDA), with rank 0 alone writing files.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Sized
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from compress.core.batching import call_model, count_non_finite, primary_output, split_batch, to_device
from compress.core.errors import CompressError, DataError
from compress.core.io import atomic_torch_save
from compress.core.lm_loss import logits_nll
from compress.core.metrics import make_metric
from compress.core.progress import Eta, ensure_console, fig, report
from compress.core.progress import bar as progress_bar
from compress.core.sparsity import apply_masks
from compress.distributed import DistributedSpec, distribute, gather, timeout_of
from compress.recipe import TrainSpec

if TYPE_CHECKING:
    from compress.session import Session

log = logging.getLogger(__name__)


# ---- distributed ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Dist:
    """This process's place in a (possibly single-process) run."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    #: how training runs across the ranks (DDP or FSDP2)
    spec: DistributedSpec = field(default_factory=DistributedSpec)
    #: the process group for waits that last as long as rank 0's own work (its export and
    #: validation), which ``spec.timeout_s`` must not cut short; None: the default group
    wait_group: Any = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def sharded(self) -> bool:
        """Whether training shards the model (FSDP2) rather than replicating it."""
        return self.enabled and self.spec.strategy == "fsdp"


def init_distributed(device: torch.device, spec: DistributedSpec | None = None) -> Dist:
    """Join the process group torchrun describes in the environment (no-op when not under torchrun).

    ``spec.timeout_s`` bounds every collective: when a rank dies, the others fail with an error
    after at most that long instead of waiting for it."""
    spec = spec or DistributedSpec()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist(spec=spec)
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", timeout=timeout_of(spec))
    if device.type == "cuda":
        torch.cuda.set_device(local)
    wait = None
    if spec.timeout_s is not None:  # a dead peer still fails it at once (a closed connection); a hung one in a day
        wait = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=1))
    return Dist(rank, world, local, spec, wait)


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu; ``cuda`` without CUDA is an error."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise CompressError("train.device is 'cuda' but no CUDA device is available")
    if name == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device(name)


def seed_everything(seed: int) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# ---- optimizer and schedule -------------------------------------------------------------------


def build_optimizer(model: nn.Module, spec: TrainSpec, *, lr: float | None = None) -> torch.optim.Optimizer:
    """SGD (momentum, nesterov) or AdamW over the trainable parameters; no weight decay on norms/biases."""
    lr = lr if lr is not None else spec.lr
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.ndim <= 1 else decay).append(p)
    groups = [{"params": decay, "weight_decay": spec.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if spec.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=spec.momentum, nesterov=spec.momentum > 0)
    return torch.optim.AdamW(groups, lr=lr)


def build_schedule(
    optimizer: torch.optim.Optimizer, spec: TrainSpec, *, total_steps: int, steps_per_epoch: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Per-step LR multiplier: linear warm-up, then cosine, step or constant."""
    warm = int(spec.warmup_epochs * steps_per_epoch)

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        if spec.schedule == "cosine":
            t = (step - warm) / max(total_steps - warm, 1)
            return 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))
        if spec.schedule == "step":
            return float(spec.gamma ** ((step // max(steps_per_epoch, 1)) // spec.step_size))
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ---- training ----------------------------------------------------------------------------------


@dataclass
class FitResult:
    """What one call of :meth:`Trainer.fit` did."""

    epochs: int = 0
    steps: int = 0
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def final_loss(self) -> float | None:
        return self.losses[-1] if self.losses else None


def task_loss(outputs: Any, targets: Any, *, label_smoothing: float = 0.0) -> torch.Tensor:
    """Cross-entropy for labelled batches; a constant zero (no gradient) for unlabelled ones, which
    only a modifier's loss term (distillation) can turn into a training signal."""
    logits = primary_output(outputs)
    if targets is None:
        return torch.zeros((), device=logits.device)
    if logits.dim() == 3 and targets.dim() == 2:
        # causal LM: position t predicts token t+1 (labels are the inputs, shifted there), in chunks
        # that never copy the logits whole
        total, n = logits_nll(logits, targets, label_smoothing=label_smoothing)
        return (total / max(n, 1)).float()
    return F.cross_entropy(logits, targets, label_smoothing=label_smoothing)


class Trainer:
    """Trains a model by a TrainSpec, optionally driving a Session's lifecycle events."""

    def __init__(
        self,
        spec: TrainSpec,
        *,
        device: torch.device | None = None,
        distributed: Dist | None = None,
        progress: bool = True,
        checkpoint: Callable[[nn.Module, torch.optim.Optimizer, int], None] | None = None,
    ) -> None:
        self.spec = spec
        self.device = device or resolve_device(spec.device)
        self.dist = distributed or Dist()
        self.progress = progress and self.dist.is_main
        self.checkpoint = checkpoint
        #: called on every rank at the end of each epoch of a session's training stage that does not
        #: end the stage, after the session's epoch_end, on the gathered (plain) model
        self.stage_checkpoint: Callable[[nn.Module, torch.optim.Optimizer, int], None] | None = None
        #: how errors name the training data (the runner sets the recipe's data source)
        self.data_name = "the training data"

    def _non_finite(self, loss: torch.Tensor, inputs: Any, *, desc: str, epoch: int, step: int) -> None:
        """Stop at the step where the loss stops being a number, naming the cause: the batch itself
        (NaN/inf in the data) or the training (finite data, diverging loss)."""
        at = f"{desc}: epoch {epoch + 1}, batch {step + 1}"
        n = count_non_finite(inputs)
        if n:
            raise DataError(f"{at}: the batch from {self.data_name} holds {n} NaN/inf values; the loss is "
                            f"{float(loss.detach())}; clean the data (nothing was trained on this batch)")
        raise DataError(f"{at}: the loss became {float(loss.detach())} on finite data from {self.data_name}: the "
                        f"training diverged; lower the learning rate (train.lr) or check the model")

    def _wrap(self, model: nn.Module, opt: torch.optim.Optimizer, session: Session | None) -> nn.Module:
        if not self.dist.enabled:
            return model
        if session is not None and session.model is model:  # its teacher is sharded with it (FSDP2)
            return session.distribute()
        return distribute(model, self.dist.spec, device=self.device, optimizer=opt)

    def _consolidate(self, model: nn.Module, opt: torch.optim.Optimizer, session: Session | None) -> None:
        """Back to plain tensors (FSDP2) before anything but the training loop reads the weights."""
        if not self.dist.enabled:
            return
        if session is not None and session.model is model:
            session.gather()
        else:
            gather(model, optimizer=opt)  # no-op unless sharded

    def fit(
        self,
        model: nn.Module,
        loader: Iterable[Any],
        *,
        epochs: float,
        steps: int | None = None,
        lr: float | None = None,
        session: Session | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        start_epoch: int = 0,
        desc: str = "train",
    ) -> FitResult:
        """Train for ``epochs`` (or ``steps``); with a session, until its current stage ends. A line per
        epoch (compress.core.progress.report: silenced inside ``progress.scope(False)``); the
        trainer's ``progress`` draws a bar over each epoch's batches too, on a terminal."""
        ensure_console()
        model.to(self.device)
        n_batches = len(loader) if isinstance(loader, Sized) else None
        if steps is None and n_batches is None:
            raise CompressError("fit needs a sized loader or a step count")
        n_epochs = math.ceil(epochs) if steps is None else math.ceil(steps / max(n_batches or steps, 1))
        total = steps if steps is not None else n_epochs * (n_batches or 0)
        opt = optimizer or build_optimizer(model, self.spec, lr=lr)
        if session is not None:  # the trainer only reports events to the session, through its public API
            session.optimizer = opt
            if session.steps_per_epoch is None:
                session.steps_per_epoch = n_batches
        sched = build_schedule(opt, self.spec, total_steps=total, steps_per_epoch=n_batches or total)
        for _ in range(start_epoch * (n_batches or 0)):
            sched.step()
        use_amp = self.spec.amp and self.device.type == "cuda"
        scaler = torch.amp.GradScaler("cuda") if use_amp else None
        stage = session.stage if session is not None else None
        result = FitResult()
        t0 = time.perf_counter()
        wrapped, wrapped_params = self._wrap(model, opt, session), _param_ids(model)
        eta = Eta(n_epochs - start_epoch)
        for epoch in range(start_epoch, n_epochs):
            if _param_ids(model) != wrapped_params:
                # a modifier reshaped the model (DDP must re-register), or it was consolidated (FSDP)
                wrapped, wrapped_params = self._wrap(model, opt, session), _param_ids(model)
            set_epoch = getattr(getattr(loader, "sampler", None), "set_epoch", None)
            if set_epoch is not None:
                set_epoch(epoch)
            wrapped.train()
            bar = progress_bar(loader, desc=f"{desc} {epoch + 1}/{n_epochs}", unit="batch") if self.progress else loader
            running, seen = 0.0, 0
            for batch in bar:
                inputs, targets = split_batch(to_device(batch, self.device))
                with torch.autocast("cuda", dtype=torch.float16) if use_amp else nullcontext():
                    outputs = call_model(wrapped, inputs)
                    loss = task_loss(outputs, targets, label_smoothing=self.spec.label_smoothing)
                    if session is not None:
                        loss = session.loss(loss, inputs=inputs, outputs=outputs)
                if not torch.isfinite(loss.detach()).all():
                    self._non_finite(loss, inputs, desc=desc, epoch=epoch, step=seen)
                if not loss.requires_grad:
                    raise CompressError(
                        f"{desc}: the loss has no gradient (unlabelled data and no distillation term to train on)"
                    )
                opt.zero_grad(set_to_none=True)
                if scaler is not None:
                    scaler.scale(loss).backward()
                    scaler.unscale_(opt)
                else:
                    loss.backward()
                if self.spec.grad_clip is not None:
                    nn.utils.clip_grad_norm_(model.parameters(), self.spec.grad_clip)
                if scaler is not None:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
                if session is None:  # a session re-applies them at its step
                    apply_masks(model)
                sched.step()
                result.steps += 1
                running += float(loss.detach())
                seen += 1
                if isinstance(bar, tqdm):
                    bar.set_postfix(loss=f"{running / seen:.4f}")
                if session is not None:
                    session.step()
                    if session.stage is not stage:  # the stage ended (or the session did)
                        break
                if steps is not None and result.steps >= steps:
                    break
            result.epochs += 1
            result.losses.append(running / max(seen, 1))
            report(log, "%s epoch %d/%d: loss %s (%s)", desc, epoch + 1, n_epochs, fig(result.losses[-1]),
                   eta.line(epoch + 1 - start_epoch))
            if self.checkpoint is not None and (self.dist.is_main or self.dist.sharded):
                self.checkpoint(model, opt, epoch + 1)  # sharded: every rank writes its shards
            if session is not None:
                if session.stage is not stage:
                    break
                # modifiers act on the weights at an epoch's end (pruning steps, observer freezes)
                self._consolidate(model, opt, session)
                session.epoch_end()
                if session.stage is not stage:
                    break
                if self.stage_checkpoint is not None:  # every rank: the writing may be a collective
                    self.stage_checkpoint(model, opt, epoch + 1)
            elif steps is not None and result.steps >= steps:
                break
        self._consolidate(model, opt, session)
        result.seconds = time.perf_counter() - t0
        return result


def _param_ids(model: nn.Module) -> tuple[int, ...]:
    return tuple(id(p) for p in model.parameters())


# ---- evaluation --------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: Iterable[Any],
    *,
    metric: str = "accuracy",
    reference: nn.Module | None = None,
    device: torch.device | str | None = None,
    progress: bool = False,
    max_batches: int | None = None,
) -> float:
    """The task metric of ``model`` on ``loader`` (higher is better).

    Fidelity metrics such as ``embedding_cosine`` compare against ``reference`` (the fp32 model).
    """
    m = make_metric(metric)
    if m.needs_reference and reference is None:
        raise CompressError(f"metric '{metric}' needs a reference model")
    dev = torch.device(device) if device is not None else _device_of(model)
    was = model.training
    model.eval()
    if reference is not None:
        reference.eval()
    for i, batch in enumerate(progress_bar(loader, desc="eval", cap=max_batches, unit="batch") if progress else loader):
        if max_batches is not None and i >= max_batches:
            break
        inputs, targets = split_batch(to_device(batch, dev))
        if m.needs_targets and targets is None:
            raise CompressError(f"metric '{metric}' needs labelled data; use a fidelity metric such as embedding_cosine")
        bad = count_non_finite(inputs)
        if bad:  # a metric over NaN inputs would be a number that means nothing
            raise DataError(f"eval: batch {i + 1} holds {bad} NaN/inf values; clean the evaluation data")
        ref = call_model(reference, inputs) if m.needs_reference and reference is not None else None
        m.update_model(model, inputs, targets, reference=ref)
    model.train(was)
    return m.compute()


def _device_of(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def fit(
    model: nn.Module,
    loader: Iterable[Any],
    *,
    epochs: float,
    spec: TrainSpec | None = None,
    lr: float | None = None,
    device: torch.device | str | None = None,
    progress: bool = False,
) -> FitResult:
    """Train ``model`` with a TrainSpec's optimizer and schedule (default spec when None)."""
    spec = spec or TrainSpec()
    dev = torch.device(device) if device is not None else resolve_device(spec.device)
    return Trainer(spec, device=dev, progress=progress).fit(model, loader, epochs=epochs, lr=lr)


def save_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, epoch: int) -> None:
    """Atomically write model and optimizer state with the epoch they reached."""
    atomic_torch_save(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict() if optimizer else None, "epoch": epoch}, path
    )


def train_for(model: nn.Module, data: Iterable[Any], *, epochs: float, lr: float | None,
              device: torch.device, desc: str) -> float | None:
    """Train a side model (a distillation teacher) with the default TrainSpec; its final loss.

    Under torchrun each rank holds a shard of the data, so the model trains data-parallel too and
    every rank ends with the same weights."""
    train = TrainSpec(epochs=epochs, lr=lr or TrainSpec().lr)
    ranks = None
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        ranks = Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))
    return Trainer(train, device=device, distributed=ranks, progress=False).fit(
        model, data, epochs=epochs, desc=desc).final_loss
