"""The batch convention shared by the trainer, calibration loops and modifiers.

A batch is ``(inputs, targets)``: ``inputs`` a Tensor or a dict of Tensors (Hugging Face style
keyword inputs), ``targets`` a Tensor or None. A bare Tensor or dict is a batch without targets.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.utils import _pytree as pytree

from compress.core.errors import CalibrationError, RecipeError
from compress.core.progress import bar
from compress.core.tracing import iter_tensors

Inputs = torch.Tensor | Mapping[str, torch.Tensor]


def split_batch(batch: Any) -> tuple[Any, Any]:
    """``(inputs, targets)`` of a batch; targets is None for unlabelled batches."""
    if isinstance(batch, (tuple, list)):
        if len(batch) == 2:
            return batch[0], batch[1]
        if len(batch) == 1:
            return batch[0], None
    return batch, None


def call_model(model: nn.Module, inputs: Any) -> Any:
    """Run ``model`` on inputs in either convention (positional tensor or keyword dict)."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)


def to_device(obj: Any, device: torch.device | str) -> Any:
    """Move tensors nested in tuples, lists and dicts to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, Mapping):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


#: the micro-batch size the calibration loops cut their batches to (None: the batches as they are)
_MICRO_BATCH: contextvars.ContextVar[int | None] = contextvars.ContextVar("micro_batch", default=None)


@contextlib.contextmanager
def micro_batches(size: int | None) -> Iterator[None]:
    """Inside the block, the calibration loops (:func:`as_forward_loop`'s and the session's) run each
    batch as micro-batches of at most ``size`` samples (:func:`run_batch`), so a statistics pass that
    only needs every sample seen peaks at the activations of ``size`` samples, not of the whole batch.
    A forward function ``fn(model)`` calls the model itself and keeps its own batch size."""
    if size is not None and size < 1:
        raise CalibrationError(f"micro-batch size must be at least 1 (got {size})")
    token = _MICRO_BATCH.set(size)
    try:
        yield
    finally:
        _MICRO_BATCH.reset(token)


def split_inputs(inputs: Any, size: int) -> list[Any]:
    """``inputs`` cut along the batch dimension into pieces of at most ``size`` samples, in order;
    ``[inputs]`` when they cannot be cut safely (no tensor, or tensors whose leading sizes differ:
    which of them is the batch is then unknown)."""
    leaves = list(iter_tensors(inputs))
    sizes = {t.shape[0] if t.dim() else -1 for t in leaves}
    if len(sizes) != 1 or (n := next(iter(sizes))) <= size:
        return [inputs]
    return [pytree.tree_map(lambda t, lo=lo: t[lo : lo + size] if isinstance(t, torch.Tensor) else t, inputs)
            for lo in range(0, n, size)]


def run_batch(model: nn.Module, inputs: Any) -> None:
    """Run ``model`` on a calibration batch for what its hooks see (the outputs are dropped): whole,
    or micro-batch by micro-batch inside :func:`micro_batches`."""
    size = _MICRO_BATCH.get()
    for piece in [inputs] if size is None else split_inputs(inputs, size):
        call_model(model, piece)


def primary_output(outputs: Any) -> torch.Tensor:
    """The tensor a metric or loss reads: logits, or an HF model's first output."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, Mapping):
        for key in ("logits", "last_hidden_state", "pooler_output"):
            if key in outputs:
                return outputs[key]
        return next(iter(outputs.values()))
    if isinstance(outputs, (tuple, list)):
        return primary_output(outputs[0])
    if hasattr(outputs, "logits"):
        return outputs.logits
    if hasattr(outputs, "last_hidden_state"):
        return outputs.last_hidden_state
    raise TypeError(f"cannot find a tensor in model outputs of type {type(outputs).__name__}")


def batch_size_of(inputs: Any) -> int:
    """Number of samples in ``inputs``."""
    if isinstance(inputs, torch.Tensor):
        return int(inputs.shape[0])
    if isinstance(inputs, Mapping):
        return batch_size_of(next(iter(inputs.values())))
    if isinstance(inputs, (tuple, list)):
        return batch_size_of(inputs[0])
    raise TypeError(f"cannot tell the batch size of {type(inputs).__name__}")


# ---- calibration data: one convention for every one-shot call -----------------------------------

#: ``fn(model)`` that runs the model over calibration batches
ForwardLoop = Callable[[nn.Module], Any]
#: what every one-shot call takes as calibration data: an iterable of batches (tensors, ``(inputs,
#: targets)`` tuples, dicts such as Hugging Face tokenized batches; a DataLoader of any of them), or
#: a forward function ``fn(model)`` that runs the model itself
CalibrationData = Iterable[Any] | ForwardLoop


def is_forward_function(data: Any) -> bool:
    """Whether calibration ``data`` is a forward function rather than an iterable of batches."""
    return callable(data) and not isinstance(data, Iterable)


def require_module(model: Any, where: str = "model") -> nn.Module:
    """``model`` itself when it is a torch module; a one-line RecipeError otherwise (a name or a
    path where a module belongs, say)."""
    if not isinstance(model, nn.Module):
        hint = " (compress.load_model builds one from a zoo name or a path)" if isinstance(model, (str, Path)) else ""
        raise RecipeError(f"{where}: expected a torch nn.Module, got {type(model).__name__} {model!r:.60}{hint}")
    return model


def model_batch(batch: Any, index: int = 0, where: str = "data") -> Any:
    """A calibration batch as a model takes it. A dataset row (a dict of lists or of 1-D tensors, as a
    Hugging Face ``datasets.Dataset`` yields, raw or ``with_format("torch")``) becomes a batch of one;
    a field the model cannot take (text, None) is named in a CalibrationError."""
    if not isinstance(batch, Mapping):
        return batch
    out: dict[str, Any] = {}
    for key, value in batch.items():
        v = value
        if isinstance(v, (list, tuple)) and v and not isinstance(v[0], (str, bytes)):
            try:
                v = torch.tensor(v)
            except (TypeError, ValueError) as exc:
                raise CalibrationError(
                    f"{where}: field '{key}' of calibration batch {index + 1} is not a rectangular list of numbers "
                    f"({exc}); pad the sequences to one length (e.g. DataCollatorWithPadding)"
                ) from None
        if isinstance(v, (str, bytes)) or (isinstance(v, (list, tuple)) and v and isinstance(v[0], (str, bytes))):
            raise CalibrationError(
                f"{where}: field '{key}' of calibration batch {index + 1} holds text; calibration needs token ids: "
                f"tokenize first (dataset.map(lambda r: tokenizer(r['{key}']), remove_columns=['{key}']))"
            )
        if not isinstance(v, torch.Tensor):
            raise CalibrationError(
                f"{where}: field '{key}' of calibration batch {index + 1} holds {type(v).__name__}, not a tensor "
                "or a list of numbers; drop that column"
            )
        out[key] = v
    ids = out.get("input_ids")
    if isinstance(ids, torch.Tensor) and ids.dim() == 1:  # one row of a dataset: make it a batch of one
        out = {k: t.unsqueeze(0) if t.dim() == 1 else t for k, t in out.items()}
    return out


class _ModelBatches:
    """Re-iterable view of calibration data whose batches go through :func:`model_batch`; a failure of
    the data's own iterator (a DataLoader that cannot collate) is named as the data's."""

    def __init__(self, data: Iterable[Any], where: str) -> None:
        self.data, self.where = data, where

    def __len__(self) -> int:
        return len(self.data)  # type: ignore[arg-type]

    def __iter__(self) -> Any:
        it = iter(self.data)
        i = 0
        while True:
            try:
                batch = next(it)
            except StopIteration:
                return
            except CalibrationError:
                raise
            except Exception as exc:  # the user's loader failed to make a batch
                why = " ".join(f"{type(exc).__name__}: {exc}".split())[:240]
                raise CalibrationError(f"{self.where}: making calibration batch {i + 1} failed ({why})") from None
            inputs, targets = split_batch(batch)
            inputs = model_batch(inputs, i, self.where)
            yield inputs if targets is None else (inputs, targets)
            i += 1


def check_calibration_data(data: Any, where: str = "data") -> Iterable[Any]:
    """``data`` as an iterable of model batches (see :func:`model_batch`); a one-line
    CalibrationError for what is not one. A single tensor is refused: iterating it would feed its
    rows one by one, each the wrong shape."""
    if torch.is_tensor(data):
        raise CalibrationError(
            f"{where}: one tensor of shape {list(data.shape)} where an iterable of batches belongs; pass "
            "[tensor] for a single batch, or a DataLoader"
        )
    if isinstance(data, (str, bytes)) or not isinstance(data, Iterable):
        raise CalibrationError(
            f"{where}: {type(data).__name__} is not calibration data (an iterable of batches, such as a list of "
            "tensors or a DataLoader, or a forward function fn(model))"
        )
    return _ModelBatches(data, where)


def _bar(batches: Iterable[Any], cap: int | None) -> Iterable[Any]:
    """The calibration batches under a progress bar where one is drawn (compress.core.progress.bar)."""
    return bar(batches, desc="calibrate", cap=cap, unit="batch")


def count_non_finite(batch: Any) -> int:
    """NaN/inf values in the floating-point tensors of ``batch`` (any nesting of tuples, lists, dicts)."""
    return sum(int((~torch.isfinite(t)).sum()) for t in iter_tensors(batch) if t.is_floating_point())


def as_forward_loop(data: CalibrationData, *, max_batches: int | None = None) -> ForwardLoop:
    """A ``forward_loop(model)`` from calibration data: a forward function as it is, an iterable run
    batch by batch without grad (inputs moved to the model's device)."""
    if is_forward_function(data):
        return cast(ForwardLoop, data)
    batches = check_calibration_data(data)

    def loop(model: nn.Module) -> int:
        p = next(model.parameters(), None)
        device = p.device if p is not None else torch.device("cpu")
        n = 0
        with torch.no_grad():
            for i, batch in enumerate(_bar(batches, max_batches)):
                if max_batches is not None and i >= max_batches:
                    break
                inputs, _ = split_batch(batch)
                bad = count_non_finite(inputs)
                if bad:  # NaN scales would follow: name the batch instead
                    raise CalibrationError(f"data: calibration batch {i + 1} holds {bad} NaN/inf values; clean the data")
                run_batch(model, to_device(inputs, device))
                n += 1
        return n

    return loop


class _Enough(Exception):
    """Raised inside the model once a forward function has fed the batches asked for."""


def as_batches(data: CalibrationData, model: nn.Module, *, max_batches: int | None = None) -> Iterable[Any]:
    """The calibration batches themselves (what layer-by-layer algorithms replay): an iterable as it
    is; a forward function is run once, without grad, and each call it makes to ``model`` is kept
    as a dict of keyword arguments (its arguments bound to ``forward``'s parameter names, extra
    keywords merged in). The model runs whole, up to ``max_batches`` calls: pass batches when it
    only fits layer by layer."""
    require_module(model)
    if not is_forward_function(data):
        return check_calibration_data(data)
    signature = inspect.signature(model.forward)
    kinds = {name: p.kind for name, p in signature.parameters.items()}
    recorded: list[dict[str, Any]] = []

    def record(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if max_batches is not None and len(recorded) >= max_batches:
            raise _Enough
        batch: dict[str, Any] = {}
        for name, value in signature.bind(*args, **kwargs).arguments.items():
            if kinds[name] is inspect.Parameter.VAR_KEYWORD:
                batch.update(value)
            elif kinds[name] is inspect.Parameter.VAR_POSITIONAL:
                if value:  # positional extras have no name to replay them by
                    raise CalibrationError(f"calibration: the forward function calls {type(model).__name__} with "
                                           f"{len(value)} positional arguments past its named ones; pass batches instead")
            else:
                batch[name] = value
        recorded.append(batch)

    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        with torch.no_grad(), contextlib.suppress(_Enough):
            cast(ForwardLoop, data)(model)
    finally:
        handle.remove()
    return recorded


class RankShare:
    """This rank's share of the first ``max_batches`` batches of ``data`` under torchrun: batch i
    when ``i % world == rank``, so the ranks' shares together are the batches one process would see.

    For calibrations whose statistics are reduced across ranks (observers, GPTQ Hessians, AWQ and
    SmoothQuant statistics): each rank then runs the model on 1/world of the batches. Every batch on
    every rank when not distributed, or when there are fewer batches than ranks (a rank with none
    would have no statistics to contribute).
    """

    def __init__(self, data: Iterable[Any], *, max_batches: int | None = None) -> None:
        import torch.distributed as dist

        self.data, self.max_batches = data, max_batches
        self.rank, self.world = 0, 1
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            n = len(data) if hasattr(data, "__len__") else None  # type: ignore[arg-type]
            if max_batches is not None and n is not None:
                n = min(n, max_batches)
            if n is None or n >= dist.get_world_size():
                self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def __iter__(self) -> Any:
        for i, batch in enumerate(self.data):
            if self.max_batches is not None and i >= self.max_batches:
                return
            if i % self.world == self.rank:
                yield batch

    def __len__(self) -> int:
        n = len(self.data)  # type: ignore[arg-type]
        if self.max_batches is not None:
            n = min(n, self.max_batches)
        return len(range(self.rank, n, self.world))
