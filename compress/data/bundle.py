"""DataBundle (what ``build_data`` returns) and how split datasets become DataLoaders."""

from __future__ import annotations

from collections.abc import Callable, Sequence, Sized
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset, default_collate

Task = Literal["classification", "embedding", "causal_lm"]


@dataclass
class DataBundle:
    """Loaders yielding ``(inputs, targets)`` batches (targets None for unlabelled data), plus what
    tracing and export need: ``example_inputs`` (a batch of 2), ``num_classes`` and the per-sample
    ``input_shape`` (of ``input_ids`` for text). ``train_sampler`` is the DistributedSampler the
    trainer calls ``set_epoch`` on when the train set is sharded (None otherwise)."""

    train: DataLoader[Any] | None
    calibration: DataLoader[Any] | None
    eval: DataLoader[Any] | None
    example_inputs: Any
    num_classes: int | None
    input_shape: tuple[int, ...]
    task: Task = "classification"
    source: str = ""
    train_sampler: DistributedSampler[Any] | None = None
    sizes: dict[str, int] = field(default_factory=dict)
    #: what the source states about its samples (text_lm: ``bos``, ``seq_len``), for the report
    description: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """Plain-data description for reports."""
        return {
            "source": self.source,
            "task": self.task,
            "num_classes": self.num_classes,
            "input_shape": list(self.input_shape),
            **{f"{k}_samples": v for k, v in self.sizes.items()},
            **self.description,
        }


@dataclass
class Splits:
    """What a data source produces: datasets per split and a description of the samples."""

    train: Dataset[Any] | None
    calibration: Dataset[Any] | None
    eval: Dataset[Any] | None
    num_classes: int | None
    task: Task = "classification"
    collate: Callable[[list[Any]], Any] | None = None
    #: plain data the report states about the samples (e.g. text_lm's ``bos``)
    description: dict[str, Any] = field(default_factory=dict)


def collate_unlabelled(samples: list[Any]) -> tuple[Any, None]:
    """Collate samples that are bare inputs (or ``(inputs, None)``) into ``(inputs, None)``."""
    inputs = [s[0] if isinstance(s, tuple) else s for s in samples]
    return default_collate(inputs), None


def size(dataset: Dataset[Any]) -> int:
    """Number of samples of a map-style dataset."""
    return len(cast(Sized, dataset))


def head(dataset: Dataset[Any], n: int | None) -> Dataset[Any]:
    """The first ``n`` samples of ``dataset`` (all when ``n`` is None or larger)."""
    if n is None or n >= size(dataset):
        return dataset
    return Subset(dataset, range(n))


def stratified_indices(
    labels: Sequence[int] | torch.Tensor, fractions: Sequence[float], seed: int
) -> list[list[int]]:
    """Split indices into ``len(fractions)`` parts with the class balance of ``labels`` in each part.

    Within each class the indices are shuffled by ``seed`` and cut at the rounded cumulative
    fractions of the class count, so every part holds every class in proportion.
    """
    y = torch.as_tensor(labels).long()
    g = torch.Generator().manual_seed(seed)
    parts: list[list[int]] = [[] for _ in fractions]
    total = float(sum(fractions))
    for c in torch.unique(y).tolist():
        members = torch.nonzero(y == c).flatten()
        idx: list[int] = members[torch.randperm(len(members), generator=g)].tolist()
        bounds, acc = [0], 0.0
        for f in fractions:
            acc += f / total
            bounds.append(round(acc * len(idx)))
        for i in range(len(fractions)):
            parts[i] += idx[bounds[i] : bounds[i + 1]]
    # interleave classes: a seeded permutation of each part
    out: list[list[int]] = []
    for p in parts:
        perm = torch.randperm(len(p), generator=g).tolist()
        out.append([p[i] for i in perm])
    return out
