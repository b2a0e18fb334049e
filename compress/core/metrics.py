"""Task metrics: a registry of accumulators, plus ``pkg.module:fn`` for user metrics.

A metric sees each eval batch's outputs and targets (and, for fidelity metrics, the reference
model's outputs and the inputs) and returns one float, higher is better (``higher_is_better = False`` for perplexity).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from compress.core.batching import batch_size_of, call_model, primary_output
from compress.core.errors import RecipeError, did_you_mean
from compress.core.imports import import_object, is_import_path
from compress.core.lm_loss import logits_nll, model_nll
from compress.core.registry import Registry


class Metric:
    """Accumulates over batches; ``needs_reference`` metrics get the fp32 model's outputs too."""

    needs_reference = False
    needs_targets = True
    higher_is_better = True

    def __init__(self) -> None:
        self.total = 0.0
        self.count = 0

    def update(self, outputs: Any, targets: Any, *, inputs: Any = None, reference: Any = None) -> None:
        raise NotImplementedError

    def update_model(self, model: nn.Module, inputs: Any, targets: Any, *, reference: Any = None) -> None:
        """Run ``model`` on ``inputs`` and add the batch; a metric that can score a model without
        holding all of its outputs (perplexity) overrides it."""
        self.update(call_model(model, inputs), targets, inputs=inputs, reference=reference)

    def compute(self) -> float:
        return self.total / max(self.count, 1)


METRICS: Registry[type[Metric]] = Registry("metric")


@METRICS.register("accuracy")
class Accuracy(Metric):
    """Top-1 accuracy of classification logits."""

    k = 1

    def update(self, outputs: Any, targets: Any, *, inputs: Any = None, reference: Any = None) -> None:
        logits = primary_output(outputs)
        topk = logits.topk(min(self.k, logits.shape[-1]), dim=-1).indices
        self.total += float((topk == targets.view(-1, 1)).any(dim=-1).sum())
        self.count += int(targets.shape[0])


@METRICS.register("top5")
class Top5(Accuracy):
    """Top-5 accuracy."""

    k = 5


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Sentence embeddings: hidden states averaged over the unmasked tokens."""
    if attention_mask is None:
        return hidden.mean(dim=1)
    m = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp_min(1e-9)


@METRICS.register("embedding_cosine")
class EmbeddingCosine(Metric):
    """Mean cosine similarity of mean-pooled sentence embeddings to the reference model's."""

    needs_reference = True
    needs_targets = False

    def update(self, outputs: Any, targets: Any, *, inputs: Any = None, reference: Any = None) -> None:
        mask = inputs.get("attention_mask") if isinstance(inputs, dict) else None
        a = mean_pool(primary_output(outputs).float(), mask)
        b = mean_pool(primary_output(reference).float(), mask)
        cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
        self.total += float(cos.sum())
        self.count += int(cos.shape[0])


def causal_lm_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed next-token negative log-likelihood (float64) and the number of predicted tokens:
    position t predicts label t+1; labels of -100 (padding) are not counted. Computed in chunks of
    bounded float32 size (compress.core.lm_loss.logits_nll)."""
    return logits_nll(logits, labels)


@METRICS.register("perplexity")
class Perplexity(Metric):
    """Held-out perplexity of a causal LM, ``exp(mean next-token NLL)`` over every predicted token
    of the eval set (batches of ``(inputs, labels)`` windows). Lower is better: unlike the other
    metrics, so read drops with the sign flipped. The loss runs in chunks (compress.core.lm_loss):
    scoring a model never holds its full-vocabulary float32 logits, nor their log-softmax."""

    higher_is_better = False

    def update(self, outputs: Any, targets: Any, *, inputs: Any = None, reference: Any = None) -> None:
        logits = primary_output(outputs)
        self._check(logits.dim(), targets)
        nll, n = causal_lm_nll(logits, targets)
        self.total += float(nll)
        self.count += n

    def update_model(self, model: nn.Module, inputs: Any, targets: Any, *, reference: Any = None) -> None:
        self._check(3, targets)
        nll, n = model_nll(model, inputs, targets)
        self.total += float(nll)
        self.count += n

    @staticmethod
    def _check(dims: int, targets: Any) -> None:
        if dims != 3 or not isinstance(targets, torch.Tensor) or targets.dim() != 2:
            raise RecipeError(
                "perplexity: needs causal-LM logits [batch, tokens, vocab] and token labels (data.source: text_lm)"
            )

    def compute(self) -> float:
        return math.exp(self.total / self.count) if self.count else float("nan")


class FunctionMetric(Metric):
    """A user function ``fn(outputs, targets) -> float`` averaged over samples."""

    def __init__(self, fn: Callable[[Any, Any], float]) -> None:
        super().__init__()
        self.fn = fn

    def update(self, outputs: Any, targets: Any, *, inputs: Any = None, reference: Any = None) -> None:
        n = batch_size_of(inputs) if inputs is not None else 1
        self.total += float(self.fn(outputs, targets)) * n
        self.count += n


def make_metric(name: str, *, where: str = "train.metric") -> Metric:
    """A fresh metric accumulator from a registered name or ``pkg.module:fn``."""
    if is_import_path(name):
        fn = import_object(name, where=where, what="fn")
        if not callable(fn):
            raise RecipeError(f"{where}: '{name}' is not callable")
        return FunctionMetric(fn)
    if name not in METRICS:
        raise RecipeError(f"{where}: unknown metric '{name}'; {did_you_mean(name, METRICS.names())} or pkg.module:fn")
    return METRICS.get(name)()
