"""Calibration: run a forward loop with activation observers on, then fix the qparams."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from compress.quantization.placement.activations import ensure_placed
from compress.quantization.placement.mode import graph_of, input_quantizer
from compress.quantization.preparation import nvfp4_weight, quantizers, unwrap
from torch import nn

from compress.core.batching import CalibrationData, as_forward_loop
from compress.core.errors import CalibrationError

log = logging.getLogger(__name__)


@contextmanager
def float_mode(model: nn.Module) -> Iterator[None]:
    """Quantizers off (and not observing) inside the block, restored after; the model in eval."""
    qs = list(quantizers(model))
    saved = [(q.enabled, q.observing) for _, q in qs]
    was_training = model.training
    for _, q in qs:
        q.enabled = q.observing = False
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
        for (_, q), (en, ob) in zip(qs, saved):
            q.enabled, q.observing = en, ob


@contextmanager
def last_logits_only(model: nn.Module, *, ops_placed: bool) -> Iterator[None]:
    """Inside the block, a causal LM's forward computes the last position's logits only
    (transformers' ``logits_to_keep=1``) when no quantizer reads the logits or the output layer's
    input: not the layer's own, not a placed one, and no op-level placement (``ops_placed``). The
    full ``[batch, tokens, vocab]`` logits are the largest tensor of a calibration forward (SmolLM2,
    8 x 512 tokens: 0.8 GB) and its largest GEMM; calibration needs the activations before them.
    A placement still pending is left alone (its trace must see the model's own forward), and so is
    a call that passes ``labels`` or ``logits_to_keep`` itself."""
    root = unwrap(model)
    get_head: Any = getattr(root, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    head_name = next((n for n, m in root.named_modules() if m is head), None) if isinstance(head, nn.Module) else None
    try:
        takes = "logits_to_keep" in inspect.signature(root.forward).parameters
    except (TypeError, ValueError):
        takes = False
    graph = graph_of(root)
    if (not takes or head is None or head_name is None or ops_placed or (graph is not None and graph.pending)
            or any(True for _ in quantizers(head)) or input_quantizer(root, head_name) is not None):
        yield
        return

    def pre(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if "labels" in kwargs or "logits_to_keep" in kwargs:
            return None
        return args, {**kwargs, "logits_to_keep": 1}

    handle = root.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def calibrate(model: nn.Module, forward_loop: CalibrationData, *, where: str = "calibration") -> None:
    """Observe activations over ``forward_loop`` (float forward, quantizers off), then set qparams.

    Raises CalibrationError when the loop feeds no data, when a quantizer saw none (its module was
    never called) or when activations hold NaN/inf.
    """
    loop = as_forward_loop(forward_loop)
    root = unwrap(model)
    ensure_placed(root, loop)
    acts = [(n, q) for n, q in quantizers(root) if q.role != "weight" and q.observer is not None]
    if not acts:
        return
    with float_mode(root), torch.no_grad():
        for _, q in acts:
            assert q.observer is not None
            q.observer.reset()
            q.observing = True
        loop(model)
    if all(q.observer is not None and q.observer.num_updates == 0 for _, q in acts):
        raise CalibrationError(f"{where}: the forward loop fed no data (empty calibration set?)")
    for _, q in acts:
        q.finish_calibration()
    log.info("%s: calibrated %d activation quantizers", where, len(acts))


def input_sharing_groups(model: nn.Module, run: Callable[[nn.Module], Any]) -> list[list[nn.Module]]:
    """The NVFP4 layers of ``model`` grouped by the tensor they read in one call of ``run(model)``
    (float forward, no grad): a group is what a serving stack fuses into one GEMM."""
    seen: dict[int, list[nn.Module]] = {}
    keep: list[torch.Tensor] = []  # inputs kept alive: ids stay unique

    def hook(m: nn.Module, args: tuple[Any, ...]) -> None:
        if args and isinstance(args[0], torch.Tensor):
            keep.append(args[0])
            group = seen.setdefault(id(args[0]), [])
            if not any(g is m for g in group):
                group.append(m)

    handles = [m.register_forward_pre_hook(hook) for m in model.modules() if nvfp4_weight(m) is not None]
    if not handles:
        return []
    try:
        with float_mode(model), torch.no_grad():
            run(model)
    finally:
        for h in handles:
            h.remove()
    return [g for g in seen.values() if len(g) > 1]
