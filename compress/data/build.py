"""``build_data``: a recipe's DataSpec to train / calibration / eval DataLoaders."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping, Sized
from typing import Any, cast

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler, random_split

from compress.core.batching import split_batch
from compress.core.errors import RecipeError, did_you_mean
from compress.core.imports import import_object, is_import_path
from compress.core.registry import Registry
from compress.core.trust import allow_code
from compress.data.bundle import DataBundle, Splits, collate_unlabelled, head, size
from compress.data.digits import FRACTIONS, digits
from compress.data.synthetic import synthetic
from compress.recipe import DataSpec

log = logging.getLogger(__name__)

SOURCES: Registry[Callable[..., Splits]] = Registry("data source")
SOURCES.add("digits", digits)
SOURCES.add("synthetic", synthetic)

_SPLITS = ("train", "calibration", "eval")


def _text(**kwargs: Any) -> Splits:
    # imported on use: the text source needs transformers, the others must not
    from compress.data.text import text

    return text(**kwargs)


def _text_lm(**kwargs: Any) -> Splits:
    from compress.data.lm import text_lm

    return text_lm(**kwargs)


def source_kwargs(name: str) -> dict[str, Any]:
    """The kwargs a built-in source takes (besides ``seed``), with their defaults."""
    fn = _text_signature() if name == "text" else _text_lm_signature() if name == "text_lm" else SOURCES.get(name)
    return {p.name: p.default for p in inspect.signature(fn).parameters.values() if p.name != "seed"}


def _text_signature() -> Callable[..., Splits]:
    from compress.data.text import text

    return text


def _text_lm_signature() -> Callable[..., Splits]:
    from compress.data.lm import text_lm

    return text_lm


SOURCES.add("text", _text)
SOURCES.add("text_lm", _text_lm)


def build_data(
    spec: DataSpec | Mapping[str, Any],
    *,
    batch_size: int,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    where: str | Callable[[str], str] = "data",
    trust_code: bool = False,
) -> DataBundle:
    """Build the loaders a DataSpec describes.

    ``spec.seed`` fixes the split; ``seed`` fixes the train shuffle order. With ``world_size > 1``
    the train loader shards through a DistributedSampler (``bundle.train_sampler``); calibration
    and eval are not sharded. ``where`` names the recipe section in error messages: a string (``"data"`` gives
    ``data.source: ...``) or a callable such as ``recipe.where`` that gets the field path
    (``data.source``) and returns ``file:line: data.source``. A ``pkg.module:factory`` source runs
    only with ``trust_code=True`` (or inside a run of a trusted recipe): see compress.core.trust.
    """
    if not isinstance(spec, DataSpec):
        spec = DataSpec.model_validate(dict(spec))
    if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
        raise RecipeError(
            f"{_at(where, 'data')}: need batch_size >= 1 and 0 <= rank < world_size (got {batch_size}, {rank}, {world_size})"
        )
    with allow_code(trust_code):
        splits = _splits(spec, where=where)
    train = splits.train
    calib = head(splits.calibration, spec.calibration_samples) if splits.calibration is not None else None
    if spec.calibration_samples == 0:
        calib = None
    evaluation = head(splits.eval, spec.eval_samples) if splits.eval is not None else None
    common: dict[str, Any] = {"num_workers": spec.num_workers, "collate_fn": splits.collate}
    if spec.num_workers:
        common["persistent_workers"] = True
    sampler: DistributedSampler[Any] | None = None
    train_loader = None
    if train is not None and size(train):
        n = size(train)
        if world_size > 1:
            sampler = DistributedSampler(train, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
            n = len(sampler)
            train_sampler: Any = sampler
        else:
            train_sampler = RandomSampler(cast(Sized, train), generator=torch.Generator().manual_seed(seed))
        # a trailing batch of one sample breaks BatchNorm in training: drop it only then
        train_loader = DataLoader(
            train, batch_size=batch_size, sampler=train_sampler, drop_last=n % batch_size == 1, **common
        )
    calib_loader = (
        DataLoader(calib, batch_size=spec.calibration_batch_size, **common) if calib is not None else None
    )
    eval_loader = (
        DataLoader(evaluation, batch_size=spec.eval_batch_size, **common) if evaluation is not None else None
    )
    first = next(d for d in (evaluation, calib, train) if d is not None and size(d))
    collate = splits.collate or _default_collate
    inputs, _ = split_batch(collate([first[i] for i in range(min(2, size(first)))]))
    sample = inputs["input_ids"] if isinstance(inputs, Mapping) else inputs
    sizes = {
        k: size(d)
        for k, d in (("train", train), ("calibration", calib), ("eval", evaluation))
        if d is not None
    }
    return DataBundle(
        train=train_loader,
        calibration=calib_loader,
        eval=eval_loader,
        example_inputs=inputs,
        num_classes=splits.num_classes,
        input_shape=tuple(sample.shape[1:]),
        task=splits.task,
        source=spec.source,
        train_sampler=sampler,
        sizes=sizes,
        description=dict(splits.description),
    )


def _default_collate(samples: list[Any]) -> Any:
    from torch.utils.data import default_collate

    return default_collate(samples)


def _at(where: str | Callable[[str], str], path: str) -> str:
    if callable(where):
        return where(path)
    return where + path.removeprefix("data")


def _splits(spec: DataSpec, *, where: str | Callable[[str], str]) -> Splits:
    if is_import_path(spec.source):
        return _from_factory(spec, where=_at(where, "data.source"))
    if spec.source not in SOURCES:
        raise RecipeError(
            f"{_at(where, 'data.source')}: unknown data source '{spec.source}'; {did_you_mean(spec.source, SOURCES.names())} or pkg.module:factory"
        )
    valid = source_kwargs(spec.source)
    for key in spec.kwargs:
        if key not in valid:
            raise RecipeError(
                f"{_at(where, f'data.kwargs.{key}')}: data source '{spec.source}' has no kwarg '{key}'; {did_you_mean(key, list(valid))}"
            )
    try:
        return SOURCES.get(spec.source)(seed=spec.seed, **spec.kwargs)
    except (TypeError, ValueError) as exc:
        shown = ", ".join(f"{k}={v!r}" for k, v in valid.items())
        raise RecipeError(
            f"{_at(where, 'data.kwargs')}: data source '{spec.source}' rejected its kwargs: {exc} (kwargs and defaults: {shown})"
        ) from None


def _from_factory(spec: DataSpec, *, where: str) -> Splits:
    """A user factory returning a Dataset, or a dict with train/calibration/eval Datasets.

    A single Dataset is split 60/15/25 with ``spec.seed``; in a dict a missing calibration set is
    taken from the train set. Targets that are integer class ids make a classification task.
    """
    factory = import_object(spec.source, where=where)
    if not callable(factory):
        raise RecipeError(
            f"{where}: '{spec.source}' is a {type(factory).__name__}, not a callable data factory"
        )
    try:
        out = factory(**spec.kwargs)
    except TypeError as exc:
        raise RecipeError(
            f"{where}: factory '{spec.source}' rejected kwargs {sorted(spec.kwargs)} ({exc})"
        ) from None
    except Exception as exc:  # the user's factory failed: name it and the recipe line
        why = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        raise RecipeError(f"{where}: data factory '{spec.source}' raised {why}") from None
    if isinstance(out, Mapping):
        bad = [k for k in out if k not in _SPLITS]
        if bad or not out:
            raise RecipeError(
                f"{where}: factory '{spec.source}' returned keys {sorted(map(str, out))}; valid keys: {', '.join(_SPLITS)}"
            )
        parts = {k: _as_dataset(v, spec.source, k, where) for k, v in out.items()}
        loaders = [v for v in out.values() if isinstance(v, DataLoader)]
        if "calibration" not in parts and "train" in parts:
            parts["calibration"] = parts["train"]
    else:
        full = _as_dataset(out, spec.source, "dataset", where)
        loaders = [out] if isinstance(out, DataLoader) else []
        g = torch.Generator().manual_seed(spec.seed)
        tr, ca, ev = random_split(full, list(FRACTIONS), generator=g)
        parts = {"train": tr, "calibration": ca, "eval": ev}
    probe = next(iter(parts.values()))
    if not size(probe):
        raise RecipeError(f"{where}: factory '{spec.source}' returned an empty dataset")
    _, target = split_batch(probe[0])
    labelled = isinstance(target, int) or (
        isinstance(target, torch.Tensor) and target.ndim == 0 and not target.is_floating_point()
    )
    num_classes = _num_classes(parts) if labelled else None
    # a factory's own DataLoader keeps its collate_fn (batch sizes come from the recipe)
    collate = loaders[0].collate_fn if loaders else None
    if collate is None and target is None:
        collate = collate_unlabelled
    return Splits(
        train=parts.get("train"),
        calibration=parts.get("calibration"),
        eval=parts.get("eval"),
        num_classes=num_classes,
        task="classification" if labelled else "embedding",
        collate=collate,
    )


def _as_dataset(obj: Any, source: str, what: str, where: str) -> Dataset[Any]:
    if isinstance(obj, DataLoader):
        return obj.dataset
    if isinstance(obj, Dataset) and hasattr(obj, "__len__") and hasattr(obj, "__getitem__"):
        return obj
    raise RecipeError(
        f"{where}: factory '{source}' gave {what} as a {type(obj).__name__}; expected a map-style torch Dataset or a DataLoader"
    )


def _num_classes(parts: Mapping[str, Dataset[Any]]) -> int | None:
    for ds in parts.values():
        for attr in ("num_classes",):
            if isinstance(getattr(ds, attr, None), int):
                return int(getattr(ds, attr))
        if isinstance(getattr(ds, "classes", None), (list, tuple)):
            return len(ds.classes)  # type: ignore[attr-defined]
    # otherwise, from the labels themselves (bounded scan: factories hand small or medium sets)
    top = -1
    for ds in parts.values():
        for i in range(min(size(ds), 20000)):
            _, t = split_batch(ds[i])
            top = max(top, int(t))
    return top + 1 if top >= 0 else None
