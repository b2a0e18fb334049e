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
        data = safe_torch_load(pt)
        extra, path = data, pt
    else:
        return None
    if not isinstance(extra, dict) or not isinstance(extra.get("progress"), str):
        raise RecipeError(f"{path}: not a stage checkpoint of this version (no progress); rerun without --resume")
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
