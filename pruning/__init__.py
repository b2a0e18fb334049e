"""Structured pruning that physically shrinks a PyTorch model, dependency-aware.

- ``pruning.trace`` / ``pruning.rules*``: the channel dependency graph from one forward pass
  (a ``__torch_function__`` mode on compress.core.tracing's base; label tensors replayed through
  shape ops; the rule modules share ``pruning.rule_helpers`` and never import one another; its
  pending split decides whether a factored channel dim is heads, q/k/v pieces or shuffle groups;
  width attributes a forward reshapes with are found and follow the cut).
- ``pruning.graph``: items, atoms (channels or attention heads removed together) and groups.
- ``pruning.importance`` / ``pruning.select``: l1, l2, bn_scale, taylor, random, activation
  (Minitron, ``pruning.activation``); local or global,
  caps, overrides, ``round_to``, params/MACs targets with an exact cost model.
- ``pruning.apply`` / ``pruning.plan``: surgery (weights, norm statistics, optimizer state) and the
  replayable :class:`~pruning.plan.PruningPlan`.
- ``pruning.api``: :func:`~pruning.api.prune` (``compress.prune``); ``pruning.modifiers``: the
  ``type: prune`` recipe modifier.

Public names are re-exported lazily from ``compress``; this package imports nothing on import.
"""
