"""Mid-stage checkpoints of a run's training stages (QAT, distillation; not pruning schedules, whose
steps reshape the model mid-stage: ``Session.resumable``).

At the end of every epoch of a training stage that does not end the stage, ``compress apply``
saves where the session is: the model's and optimizer's state, the companion models' (a
distillation teacher's), the finished stages' structure as data, each current modifier's own
state (QAT's observer statistics and schedule flags, the distiller's adapters), the counters and
the random state. ``--resume`` rebuilds the session from it and trains the stage's remaining epochs.

Under FSDP2 every rank writes its part with ``torch.distributed.checkpoint`` into
``checkpoints/stage_last.dcp/`` (resumable on any number of ranks); otherwise rank 0 writes
``checkpoints/stage_last.pt``. Both are read with ``weights_only=True``. What differs between the
ranks (observer statistics: each rank observes its own batches until the ranges freeze) is saved
per rank; a run resumed on as many ranks continues exactly, one resumed on another number gives
rank ``r`` the statistics of saved rank ``r mod N``.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from compress.core.errors import RecipeError
from compress.core.io import atomic_torch_save, safe_torch_load
from compress.distributed import check_extra_states, load_sharded, read_extra, save_sharded
from compress.session import Session
from compress.training import Dist

log = logging.getLogger(__name__)

STAGE_PT = "stage_last.pt"
STAGE_DCP = "stage_last.dcp"
BASELINE_PT = "baseline.pt"  # the trained baseline (written once its training ends)
BASELINE_LAST = "baseline_last.pt"  # baseline training's last epoch (one process, DDP)
BASELINE_DCP = "baseline_last.dcp"  # the same under FSDP2: every rank's shards

#: how a message about a checkpoint --resume cannot use ends: what the user can do about it
RESUME_HINT = "delete it to redo that part of the run, or start over with --overwrite instead of --resume"


@dataclass
class StageCheckpoint:
    """A mid-stage checkpoint read back: where the session was and what to load."""

    path: Path
    progress: dict[str, Any]  # {"session": Session.progress()'s data, "report_stages": [...], "world_size": N}
    tensors: dict[str, torch.Tensor]  # the modifiers' tensors, keyed "rank{r}.{key}"
    rng: torch.Tensor | None
    data: dict[str, Any] | None  # stage_last.pt's content (None: DCP, loaded from path)

    @property
    def stage(self) -> int:
        return int(self.progress["session"]["stage"])

    @property
    def epochs_done(self) -> int:
        return int(self.progress["session"]["epochs_done"])


def _json_default(o: Any) -> Any:
    return o.item() if hasattr(o, "item") else str(o)


def save_stage(ckpt_dir: Path, session: Session, model: nn.Module, optimizer: torch.optim.Optimizer, epoch: int, *,
               ranks: Dist, report_stages: list[dict[str, Any]]) -> None:
    """Write the session's mid-stage checkpoint (every rank calls it; the model is gathered)."""
    progress, tensors = session.progress()
    local = {k: v.detach().cpu() for k, v in tensors.items()}
    box: list[Any] = [local]
    if ranks.enabled:
        box = [None] * ranks.world_size
        dist.all_gather_object(box, local)
    extra = {
        "progress": json.dumps({"session": progress, "report_stages": report_stages, "world_size": ranks.world_size},
                               default=_json_default),
        "tensors": {f"rank{r}.{k}": v for r, ts in enumerate(box) for k, v in ts.items()},
        "rng": torch.get_rng_state(),
    }
    companions = session.state.companions
    pt, sharded = ckpt_dir / STAGE_PT, ckpt_dir / STAGE_DCP
    if ranks.sharded:
        save_sharded(sharded, model, optimizer, epoch, companions=companions, extra=extra)
    elif ranks.is_main:
        atomic_torch_save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch,
                           "companions": [c.state_dict() for c in companions], **extra}, pt)
    if ranks.is_main:  # a resumed run that changed strategy: the older kind must not be resumed from next
        stale = pt if ranks.sharded else sharded
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)


def find_stage(ckpt_dir: Path) -> StageCheckpoint | None:
    """The run's mid-stage checkpoint, or None when it has none."""
    sharded, pt = ckpt_dir / STAGE_DCP, ckpt_dir / STAGE_PT
    data: dict[str, Any] | None = None
    if sharded.is_dir():
        extra, path = read_extra(sharded), sharded
    elif pt.is_file():
        data = read_resume(pt, keys=("model", "optimizer", "progress"))
        extra, path = data, pt
    else:
        return None
    if not isinstance(extra, dict) or not isinstance(extra.get("progress"), str):
        raise RecipeError(f"--resume: {path}: not a stage checkpoint of this version (no progress); {RESUME_HINT}")
    return StageCheckpoint(path, json.loads(extra["progress"]), dict(extra.get("tensors") or {}), extra.get("rng"),
                           data)


def load_stage(ck: StageCheckpoint, session: Session, model: nn.Module, optimizer: torch.optim.Optimizer, *,
               rank: int) -> None:
    """Load ``ck`` into the session's resumed stage (after ``initialize``, the optimizer set): the
    model and the companions, then the modifiers' own state, then the optimizer's; every rank calls it."""
    saved_world = int(ck.progress["world_size"])
    prefix = f"rank{rank % saved_world}."
    tensors = {k[len(prefix):]: v for k, v in ck.tensors.items() if k.startswith(prefix)}

    def modifiers() -> None:  # after the models (their state may rebuild nothing the modifiers set),
        # before the optimizer (a distiller's adapters join it first: its saved state holds theirs)
        session.load_progress(ck.progress["session"], tensors)

    companions = session.state.companions
    if ck.data is None:
        load_sharded(ck.path, model, optimizer, companions=companions, before_optimizer=modifiers)
    else:
        saved = ck.data.get("companions") or []
        if len(saved) != len(companions):
            raise RecipeError(f"{ck.path}: holds {len(saved)} companion model(s), the stage has {len(companions)}")
        for m, sd in ((model, ck.data["model"]), *zip(companions, saved)):
            _load_model(m, sd, where=str(ck.path))
        modifiers()
        optimizer.load_state_dict(ck.data["optimizer"])
    if ck.rng is not None:
        torch.set_rng_state(ck.rng)


def _load_model(model: nn.Module, sd: dict[str, Any], *, where: str) -> None:
    """``load_state_dict`` strictly, but leaving alone the modules' extra state, which must equal the
    saved one: loading it would rebuild modules (a quantizer placement's) the resumed stage built
    already and whose parameters the optimizer holds."""
    check_extra_states(model, sd, where=where)
    missing, unexpected = model.load_state_dict({k: v for k, v in sd.items() if not k.endswith("_extra_state")},
                                                strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RecipeError(f"{where}: the saved state does not fit the model (missing {sorted(missing)[:5]}, "
                          f"unexpected {sorted(unexpected)[:5]}); was the model or the recipe changed?")


# ---- what --resume reads, checked before any work ------------------------------------------------


def read_resume(path: Path, *, keys: tuple[str, ...] = ("model",), mmap: bool = False) -> dict[str, Any]:
    """A checkpoint ``--resume`` reads, loaded weights-only (``mmap``: tensors mapped, not read); a
    RecipeError (exit 2) naming the file when it is corrupt, truncated or lacks one of ``keys``."""
    data = safe_torch_load(path, where="--resume", hint=RESUME_HINT, mmap=mmap)
    missing = [k for k in keys if not isinstance(data, dict) or k not in data]
    if missing:
        raise RecipeError(f"--resume: {path}: not a checkpoint of this version (no {', '.join(map(repr, missing))}); "
                          f"{RESUME_HINT}")
    if "model" in keys and not isinstance(data["model"], dict):
        raise RecipeError(f"--resume: {path}: its 'model' is not a state_dict; {RESUME_HINT}")
    return data


def load_baseline(path: Path, model: nn.Module) -> dict[str, Any]:
    """Load a baseline checkpoint (``baseline.pt`` or ``baseline_last.pt``) into ``model``, strictly;
    returns what the file holds (optimizer, epoch). RecipeError naming the file when it is unreadable
    or does not fit the model."""
    data = read_resume(path, keys=("model", "epoch") if path.name == BASELINE_LAST else ("model",))
    try:
        model.load_state_dict(data["model"])
    except RuntimeError as exc:  # missing, unexpected or misshaped keys
        why = " ".join(str(exc).split())[:300]
        raise RecipeError(f"--resume: {path}: does not fit the model ({why}); was the model or the recipe changed? "
                          f"{RESUME_HINT}") from None
    return data


def resume_files(ckpt_dir: Path, *, trains_baseline: bool) -> list[Path]:
    """The checkpoints ``--resume`` would read from ``ckpt_dir``, in the order the run reads them:
    the trained baseline, else (when the recipe trains one) the last baseline epoch, then the last
    training stage's epoch; the sharded (DCP) form where the run would take it."""
    found: list[Path] = []
    if (ckpt_dir / BASELINE_PT).exists():
        found.append(ckpt_dir / BASELINE_PT)
    elif trains_baseline:
        if (ckpt_dir / BASELINE_DCP).is_dir():
            found.append(ckpt_dir / BASELINE_DCP)
        elif (ckpt_dir / BASELINE_LAST).exists():
            found.append(ckpt_dir / BASELINE_LAST)
    if (ckpt_dir / STAGE_DCP).is_dir():
        found.append(ckpt_dir / STAGE_DCP)
    elif (ckpt_dir / STAGE_PT).exists():
        found.append(ckpt_dir / STAGE_PT)
    return found


def check_resumable(ckpt_dir: Path, *, trains_baseline: bool) -> None:
    """Before any work (the model and data are not built yet): every checkpoint ``--resume`` would
    read from ``ckpt_dir`` loads (tensors memory-mapped, not read) and holds what the run takes from
    it; else a RecipeError (exit 2) naming the file, e.g. ``--resume: checkpoint RUN/checkpoints/
    baseline.pt is corrupt or truncated (...); delete it to redo that part of the run, or ...``."""
    for path in resume_files(ckpt_dir, trains_baseline=trains_baseline):
        if path.suffix == ".dcp":
            _check_sharded(path)
        elif path.name == BASELINE_PT:
            read_resume(path, mmap=True)
        elif path.name == BASELINE_LAST:
            read_resume(path, keys=("model", "epoch"), mmap=True)
        else:
            data = read_resume(path, keys=("model", "optimizer", "progress"), mmap=True)
            _check_progress(path, data)


def _check_progress(path: Path, data: dict[str, Any]) -> None:
    try:
        progress = json.loads(data["progress"])
        counts = [progress["session"]["stage"], progress["session"]["epochs_done"], progress["world_size"]]
        if not all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in counts):
            raise TypeError(f"stage, epochs_done and world_size are {counts}, not numbers")
    except (TypeError, ValueError, KeyError) as exc:
        raise RecipeError(f"--resume: {path}: not a stage checkpoint of this version (progress: "
                          f"{type(exc).__name__}: {exc}); {RESUME_HINT}") from None


def _check_sharded(path: Path) -> None:
    """A DCP folder ``save_sharded`` wrote: its extra file loads, its metadata reads and every shard
    file is as long as the metadata says (a truncated shard fails here, not after the model is built)."""
    from compress.distributed import EXTRA_FILE

    extra = path / EXTRA_FILE
    if not extra.is_file():
        raise RecipeError(f"--resume: {path}: no {EXTRA_FILE} beside the shards (an older version, or an "
                          f"interrupted write); {RESUME_HINT}")
    data = read_resume(extra, keys=("objects",), mmap=True)
    if path.name == STAGE_DCP:
        _check_progress(extra, data)
    from torch.distributed.checkpoint import FileSystemReader

    try:
        meta = FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # a missing, truncated or foreign .metadata file
        why = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
        raise RecipeError(f"--resume: checkpoint {path} is corrupt or truncated (its .metadata: {why}); "
                          f"{RESUME_HINT}") from None
    need: dict[str, int] = {}
    for info in (getattr(meta, "storage_data", None) or {}).values():
        rel = str(info.relative_path)
        need[rel] = max(need.get(rel, 0), int(info.offset) + int(info.length))
    for rel, size in sorted(need.items()):
        f = path / rel
        have = f.stat().st_size if f.is_file() else None
        if have is None or have < size:
            what = "is missing" if have is None else f"holds {have:,} of {size:,} bytes"
            raise RecipeError(f"--resume: checkpoint {path} is corrupt or truncated (shard {rel} {what}); "
                              f"{RESUME_HINT}")
