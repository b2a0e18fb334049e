"""Structured pruning that physically shrinks a PyTorch model, dependency-aware.

- ``pruning.trace`` / ``pruning.rules*``: the channel dependency graph from one forward pass
  (a ``__torch_function__`` mode; label tensors replayed through shape ops).
- ``pruning.graph``: items, atoms (channels or attention heads removed together) and groups.
- ``pruning.importance`` / ``pruning.select``: l1, l2, bn_scale, taylor, random; local or global,
  caps, overrides, ``round_to``, params/MACs targets with an exact cost model.
- ``pruning.apply`` / ``pruning.plan``: surgery (weights, norm statistics, optimizer state) and the
  replayable :class:`~pruning.plan.PruningPlan`.
- ``pruning.api``: :func:`~pruning.api.prune` (``compress.prune``); ``pruning.modifiers``: the
  ``type: prune`` recipe modifier.

Public names are re-exported lazily from ``compress``; this package imports nothing on import.
"""
