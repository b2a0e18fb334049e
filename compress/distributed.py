"""How a run trains under torchrun: DistributedDataParallel (the default) or FSDP2 sharding.

With ``strategy: fsdp`` the model is sharded in place with ``torch.distributed.fsdp.fully_shard``:
one FSDP unit per block, the blocks being the children of the model's largest ``nn.ModuleList``
(decoder layers, encoder blocks: found from the model, never from a per-family table), then the
root. Parameters become DTensors holding 1/world of each tensor; FSDP2 all-gathers a block's full
weights for its forward and backward, so weight fake-quantizers see the full weight.

Training is the only sharded phase. Before modifiers act on the weights (an epoch's end, a stage's
finalize) the model is *consolidated*: every DTensor parameter is gathered back into a plain
Parameter on every rank (tied weights stay tied), the optimizer's state follows, and FSDP's hooks
and class are taken off again, so pruning surgery, calibration, ``state_dict`` and export see the
ordinary model. The next training epoch shards it again, moving the optimizer state with it.
"""

from __future__ import annotations

import datetime
import logging
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from pydantic import Field
from torch import nn

from compress.core.errors import CompressError
from compress.core.reference import StrictSpec

log = logging.getLogger(__name__)

_FSDP_HOOK_MODULE = "torch.distributed.fsdp"
_STATE_KEY_PREFIX = "__composable_api_state_key"
_FSDP_ATTRS = ("_is_fsdp_managed_module", "_fsdp_use_orig_params")
#: the gradient hooks of each sharded model's replicated (0-dim) parameters, removed when consolidated
_GRAD_SYNC: weakref.WeakKeyDictionary[nn.Module, list[Any]] = weakref.WeakKeyDictionary()
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_state_dict_hooks", "_state_dict_pre_hooks",
               "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


class DistributedSpec(StrictSpec):
    """How ``compress apply`` trains under torchrun (ignored in a single process).

    ``ddp`` replicates the model on every rank; ``fsdp`` shards parameters, gradients and optimizer
    state over the ranks (FSDP2, one unit per block). ``mixed_precision`` is FSDP's compute dtype
    (parameters and optimizer state stay float32; gradients are reduced in float32).
    ``cpu_offload`` keeps the sharded state in host memory between uses (on the CPU it already is).
    ``timeout_s`` bounds every collective: a rank that died makes the others fail after it.
    """

    strategy: Literal["ddp", "fsdp"] = "ddp"
    mixed_precision: Literal["none", "bf16", "fp16"] = "none"
    cpu_offload: bool = False
    timeout_s: float | None = Field(None, gt=0)


def timeout_of(spec: DistributedSpec) -> datetime.timedelta | None:
    return datetime.timedelta(seconds=spec.timeout_s) if spec.timeout_s is not None else None


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's repeated blocks: the children (with parameters) of its largest ``nn.ModuleList``
    by parameter count, e.g. a decoder's layers; empty when the model has none (the root alone is
    then one FSDP unit)."""
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) > 1:
            n = sum(p.numel() for p in m.parameters())
            if n and (best is None or n > best[0]):
                best = (n, name, m)
    if best is None:
        return []
    _, name, blocks = best
    prefix = f"{name}." if name else ""
    return [(f"{prefix}{i}", b) for i, b in enumerate(blocks) if next(b.parameters(), None) is not None]


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` (or a module inside it) is sharded with FSDP2."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def shard(model: nn.Module, spec: DistributedSpec, *, device: torch.device,
          optimizer: torch.optim.Optimizer | None = None, forward_only: bool = False,
          where: str = "distributed") -> list[str]:
    """Shard ``model`` in place with FSDP2 over all ranks (per block, then the root); the
    optimizer's parameters (and any state they have) move to the sharded ones. Returns the blocks.

    ``forward_only`` (a teacher): the root's weights too are freed after each forward (FSDP keeps a
    root's gathered weights for the backward that follows, which a forward-only model never runs)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if _world() <= 1:
        raise CompressError(f"{where}: strategy 'fsdp' shards over the ranks of a torchrun launch; none is running")
    if spec.cpu_offload and device.type != "cuda":
        log.info("%s.cpu_offload: training on the CPU, the sharded state is in host memory anyway", where)
    mesh = init_device_mesh(device.type, (_world(),))
    dtype = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[spec.mixed_precision]
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype is not None else None)
    # pinned host memory needs an accelerator: FSDP2's default pinning fails on a CPU-only machine
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if spec.cpu_offload else OffloadPolicy()
    places = _param_places(model)
    blocks = find_blocks(model)
    # FSDP2 shards no 0-dim parameter (a per-tensor LSQ scale): those stay replicated, their
    # gradients averaged over the ranks as under DDP
    scalars = {p for p in model.parameters() if p.dim() == 0}
    for _, block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=offload, ignored_params=scalars)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload, ignored_params=scalars,
                reshard_after_forward=True if forward_only else None)
    _GRAD_SYNC[model] = [p.register_post_accumulate_grad_hook(_average_grad) for p in scalars if p.requires_grad]
    if optimizer is not None:
        _move_optimizer(optimizer, {pid: getattr(mod, name) for pid, (mod, name) in places.items()}, to_dtensor=True)
    log.info("FSDP2: sharded over %d ranks in %d block(s)%s", _world(), len(blocks),
             f" ({blocks[0][0]} .. {blocks[-1][0]})" if blocks else " (no repeated blocks: the root alone)")
    return [n for n, _ in blocks]


def distribute(model: nn.Module, spec: DistributedSpec, *, device: torch.device,
               optimizer: torch.optim.Optimizer | None = None, companions: Sequence[nn.Module] = ()) -> nn.Module:
    """The model to train under torchrun by ``spec``: the model itself in one process; DDP's
    wrapper; or (FSDP2) the model sharded in place, the optimizer moved onto its shards and the
    companion models (a distillation teacher, forward only) sharded alike."""
    if _world() <= 1:
        return model
    if spec.strategy == "fsdp":
        if not is_sharded(model):
            shard(model, spec, device=device, optimizer=optimizer)
        for c in companions:
            if not is_sharded(c):
                shard(c, spec, device=device, forward_only=True)
        return model
    ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids)


def gather(model: nn.Module, *, optimizer: torch.optim.Optimizer | None = None,
           companions: Sequence[nn.Module] = ()) -> None:
    """:func:`consolidate` the model (with its optimizer) and its companions; no-op when unsharded."""
    for m, opt in ((model, optimizer), *((c, None) for c in companions)):
        consolidate(m, optimizer=opt)


def consolidate(model: nn.Module, *, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Undo :func:`shard` in place: full plain parameters on every rank (a collective: every rank
    calls it), the optimizer's state gathered with them, FSDP's hooks and classes removed."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not fsdp_modules:
        return
    for m in fsdp_modules:
        m.reshard()  # the registered parameters are then the sharded DTensors
    full: dict[int, nn.Parameter] = {}
    for mod in model.modules():  # the same order on every rank: the gathers pair up
        for name, p in list(mod._parameters.items()):
            if isinstance(p, DTensor):
                if id(p) not in full:
                    full[id(p)] = nn.Parameter(_gather(p), requires_grad=p.requires_grad)
                mod._parameters[name] = full[id(p)]
    if optimizer is not None:
        _move_optimizer(optimizer, full, to_dtensor=False)
    for mod in model.modules():
        _strip_fsdp(mod)
    for h in _GRAD_SYNC.pop(model, []):
        h.remove()


def _average_grad(p: torch.Tensor) -> None:
    if p.grad is not None:
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def _gather(t: Any) -> torch.Tensor:
    local = t.to_local()
    if local.device.type != t.device_mesh.device_type:  # offloaded to host: gather on the mesh's device
        from torch.distributed.tensor import DTensor

        t = DTensor.from_local(local.to(t.device_mesh.device_type), t.device_mesh, t.placements,
                               shape=t.shape, stride=t.stride())
        return t.full_tensor().detach().to(local.device)
    return t.full_tensor().detach()


def _strip_fsdp(mod: nn.Module) -> None:
    from torch.distributed._composable_state import _module_state_mapping
    from torch.distributed.fsdp import FSDPModule

    for d in _HOOK_DICTS:
        hooks = getattr(mod, d, None)
        if not hooks:
            continue
        for h in [h for h, fn in hooks.items() if _hook_module(fn).startswith(_FSDP_HOOK_MODULE)]:
            del hooks[h]
            getattr(mod, "_forward_hooks_with_kwargs", {}).pop(h, None)
            getattr(mod, "_forward_pre_hooks_with_kwargs", {}).pop(h, None)
            getattr(mod, "_forward_hooks_always_called", {}).pop(h, None)
    for k in [k for k in mod.__dict__ if isinstance(k, str) and k.startswith(_STATE_KEY_PREFIX)]:
        del mod.__dict__[k]
    for a in _FSDP_ATTRS:
        mod.__dict__.pop(a, None)
    _module_state_mapping.pop(mod, None)  # the composable API's own record of the module's FSDP state
    if isinstance(mod, FSDPModule):
        # fully_shard put a generated subclass (FSDP, then the module's class) in place: its class again
        mod.__class__ = next(b for b in type(mod).__bases__ if b is not FSDPModule)


def _hook_module(fn: Any) -> str:
    inner = getattr(fn, "func", fn)  # functools.partial
    inner = getattr(inner, "__func__", inner)  # bound method
    return str(getattr(inner, "__module__", "") or "")


def _param_places(model: nn.Module) -> dict[int, tuple[nn.Module, str]]:
    places: dict[int, tuple[nn.Module, str]] = {}
    for mod in model.modules():
        for name, p in mod._parameters.items():
            if p is not None:
                places.setdefault(id(p), (mod, name))
    return places


def _move_optimizer(opt: torch.optim.Optimizer, new: dict[int, nn.Parameter], *, to_dtensor: bool) -> None:
    """Point the optimizer's groups at the new parameters and convert their state alike."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for group in opt.param_groups:
        params = group["params"]
        for i, old in enumerate(params):
            p = new.get(id(old))
            if p is None or p is old:
                continue
            params[i] = p
            st = opt.state.pop(old, None)
            if st is None:
                continue
            for k, v in list(st.items()):
                if not isinstance(v, torch.Tensor) or v.shape != p.shape or v.dim() == 0:
                    continue
                if to_dtensor and isinstance(p, DTensor) and not isinstance(v, DTensor):
                    # every rank holds the same full state: each keeps its own shard, no communication
                    st[k] = distribute_tensor(v.to(p.to_local().device), p.device_mesh, p.placements,
                                              src_data_rank=None)
                elif not to_dtensor and isinstance(v, DTensor):
                    st[k] = _gather(v)
            opt.state[p] = st


# ---- sharded checkpoints (torch.distributed.checkpoint) ---------------------------------------------


#: the file beside the DCP shards holding what is not a tensor (optimizer hyperparameters, modules'
#: extra state) and the caller's ``extra``: DCP would pickle such values and unpickle them with
#: ``weights_only=False`` on load; this file is read with ``weights_only=True``
EXTRA_FILE = "extra.pt"
_EXTRA_STATE = "_extra_state"  # torch's state_dict key suffix of Module.get_extra_state()


def save_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, epoch: int, *,
                 companions: Sequence[nn.Module] = (), extra: dict[str, Any] | None = None) -> None:
    """Every rank writes its shards of the model and optimizer state (and of the companion models:
    a distillation teacher) to the folder ``path`` (DCP), with the epoch reached; a collective.
    Rank 0 writes what is not a tensor, and ``extra`` (the same on every rank), beside the shards in
    ``extra.pt`` (:func:`read_extra`). Written beside and renamed, so a crash leaves the last
    complete checkpoint in place. A plain (gathered) model is written too: each tensor once, the
    ranks sharing the writing."""
    import shutil

    import torch.distributed.checkpoint as dcp

    from compress.core.io import atomic_torch_save

    state = _dcp_state(model, optimizer, companions)
    state["epoch"] = torch.tensor(epoch)
    tensors, objects = _split(state)
    tmp = path.with_name(path.name + ".tmp")
    rank0 = dist.get_rank() == 0 if dist.is_initialized() else True
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
    dcp.save(tensors, checkpoint_id=str(tmp))
    if rank0:
        atomic_torch_save({**(extra or {}), "objects": objects}, tmp / EXTRA_FILE)
    if dist.is_initialized():
        dist.barrier()
    if rank0:
        old = path.with_name(path.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()


def _dcp_state(model: nn.Module, optimizer: torch.optim.Optimizer | None,
               companions: Sequence[nn.Module]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)  # initializes any state to fill
    for i, c in enumerate(companions):
        state[f"companion{i}"] = get_model_state_dict(c)
    return state


def _split(obj: Any) -> tuple[Any, Any]:
    """A nested state dict as (its tensors, everything else), each with the same nesting; None
    where a side has nothing."""
    if isinstance(obj, torch.Tensor):
        return obj, None
    if not isinstance(obj, dict):
        return None, obj
    tensors, objects = {}, {}
    for k, v in obj.items():
        t, o = _split(v)
        if t is not None:
            tensors[k] = t
        if o is not None or t is None:
            objects[k] = o
    return (tensors or None), (objects or ({} if not tensors else None))


def _merge(tensors: Any, objects: Any) -> Any:
    if not isinstance(tensors, dict) or not isinstance(objects, dict):
        return tensors if tensors is not None else objects
    return {k: _merge(tensors.get(k), objects.get(k)) for k in {**objects, **tensors}}


def load_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, *,
                 companions: Sequence[nn.Module] = (), before_optimizer: Any = None) -> int:
    """Load a :func:`save_sharded` folder into a plain (unsharded) model, companions and optimizer,
    on any number of ranks (DCP reshards: every rank reads the full tensors); returns the epoch.
    ``before_optimizer()`` runs once the models are loaded, before the optimizer's state is.

    The tensors load in place; a module's extra state (a quantizer placement) must equal the one
    the model has (set_extra_state would rebuild modules whose parameters the optimizer holds)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    from compress.core.errors import RecipeError

    saved = read_extra(path)
    if saved is None or not isinstance(saved.get("objects"), dict):
        raise RecipeError(f"{path}: no {EXTRA_FILE} beside the shards (written by an older version); start over with --overwrite instead of --resume")
    objects: dict[str, Any] = saved["objects"]
    state = _dcp_state(model, None, companions)
    state["epoch"] = torch.tensor(0)
    tensors, _ = _split(state)
    dcp.load(tensors, checkpoint_id=str(path))
    # the plain models' state_dict tensors are their own storage: DCP loaded them in place
    # (set_model_state_dict would assign new Parameters and part the optimizer from the model)
    for key, m in (("model", model), *((f"companion{i}", c) for i, c in enumerate(companions))):
        check_extra_states(m, objects.get(key) or {}, where=str(path))
    if before_optimizer is not None:
        before_optimizer()
    if optimizer is not None:
        opt_tensors, _ = _split({"optimizer": _dcp_state(model, optimizer, ())["optimizer"]})
        if opt_tensors is not None:
            dcp.load(opt_tensors, checkpoint_id=str(path))
        merged = _merge((opt_tensors or {}).get("optimizer"), objects.get("optimizer"))
        set_optimizer_state_dict(model, optimizer, merged)
    return int(tensors["epoch"])


def check_extra_states(model: nn.Module, saved: dict[str, Any], *, where: str) -> None:
    """Every module extra state in ``saved`` (state_dict keys ending in ``_extra_state``) must equal
    what the module holds now: the resumed stage built the same structure (a quantizer placement)."""
    from compress.core.errors import RecipeError

    for key, value in saved.items():
        if not key.endswith(_EXTRA_STATE):
            continue
        name = key[: -len(_EXTRA_STATE)].rstrip(".")
        mod = model.get_submodule(name) if name else model
        if mod.get_extra_state() != value:
            raise RecipeError(f"{where}: the saved state of '{name}' differs from the one the resumed stage built; "
                              "was the model or the recipe changed? start over with --overwrite instead of --resume")


def read_extra(path: Path) -> dict[str, Any] | None:
    """What :func:`save_sharded` wrote beside the shards (None when there is no such file), loaded
    weights-only."""
    from compress.core.io import safe_torch_load

    f = Path(path) / EXTRA_FILE
    if not f.is_file():
        return None
    data = safe_torch_load(f)
    return data if isinstance(data, dict) else None
