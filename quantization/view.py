"""What the packages above quantization read of a quantized model: the one view export uses.

export/ never reads the placement's layout by attribute name or imports the runtime mode; it asks
here. Everything is a read, except :func:`record_unseen` and :func:`remove_placement`, which an
export applies to its own copy of the model. A model without quantizers gives empty answers, so an
fp32 export needs no special case.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace

import torch
from compress.quantization.algorithms.kv_cache import kv_quantizers
from compress.quantization.numerics.fake_quant import FakeQuantizer
from compress.quantization.placement.mode import (
    UNSEEN_REASON,
    QuantizerGraph,
    collect_unseen,
    detach,
    graph_of,
    input_quantizer,
)
from compress.quantization.preparation import quantizers
from torch import nn

__all__ = [
    "FakeQuantizer",
    "QuantizedView",
    "functional_weights",
    "input_quantizer",
    "is_quantized",
    "quantizers",
    "record_unseen",
    "remove_placement",
    "tracking_unseen",
    "view",
]


@dataclass(frozen=True)
class QuantizedView:
    """A quantized model as its exporters see it.

    ``target``: the runtime the placement was made for (``onnxruntime`` when none was placed).
    ``kept_float``: op keys left float on purpose, with the reason (placement choices, and calls the
    placement never saw). ``tables``: quantizer ids that quantize embedding tables (they feed
    Gathers, not integer GEMMs). ``op_entries``: placed op keys that quantize an operand.
    ``placed_weights``: weights the placement quantizes where they are used functionally (quantizer id
    -> parameter name; :func:`functional_weights` gives those without a layer of their own).
    ``kv_cache``: names of attention modules with a simulated int8 KV cache.
    ``model_float``: why the whole model was left float (the cost table's model-level check), else None.
    ``cost_table``: the cost table that decided (``onnxruntime vnni:intel``), None where none did.
    """

    target: str = "onnxruntime"
    kept_float: dict[str, str] = field(default_factory=dict)
    tables: frozenset[str] = frozenset()
    op_entries: tuple[str, ...] = ()
    placed_weights: dict[str, str] = field(default_factory=dict)
    kv_cache: tuple[str, ...] = ()
    model_float: str | None = None
    cost_table: str | None = None

    def with_unseen(self, calls: Iterable[str]) -> QuantizedView:
        """This view with ``calls`` kept float as unseen: what :func:`view` gives once they are recorded
        on the model (an export adds its trace's calls to the view it built before, not building it anew)."""
        calls = dict.fromkeys(calls, UNSEEN_REASON)
        return replace(self, kept_float={**self.kept_float, **calls}) if calls else self


def view(model: nn.Module) -> QuantizedView:
    """The view of ``model`` (empty for a model without a placement)."""
    kv = tuple(kv_quantizers(model))
    graph = graph_of(model)
    if graph is None:
        return QuantizedView(kv_cache=kv)
    p = graph.placement
    return QuantizedView(
        target=str(p.target),
        kept_float={**p.floats, **dict.fromkeys(graph.unseen, UNSEEN_REASON)},
        tables=frozenset(qid for qid, use in p.weights.items() if use.table),
        op_entries=tuple(k for k, entry in p.entries.items() if entry),
        placed_weights={qid: use.param for qid, use in p.weights.items()},
        kv_cache=kv,
        model_float=p.model_float,
        cost_table=p.cost_table,
    )


def functional_weights(model: nn.Module) -> dict[int, torch.Tensor]:
    """Placement-owned weight quantizers, by ``id``, with the weight each one quantizes (they sit in
    the placement, not beside their weight)."""
    out: dict[int, torch.Tensor] = {}
    graphs = [m for m in model.modules() if isinstance(m, QuantizerGraph)]  # a wrapped model holds it deeper
    if not graphs:
        return out
    tensors: dict[str, torch.Tensor] = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for graph in graphs:
        for qid, use in graph.placement.weights.items():
            w = tensors.get(use.param)
            if use.module is None and qid in graph.quantizers and w is not None:
                out[id(graph.quantizers[qid])] = w.detach()
    return out


def is_quantized(model: nn.Module) -> bool:
    """Whether ``model`` holds at least one enabled fake-quantizer (and so exports as QDQ)."""
    return any(q.enabled for _, q in quantizers(model))


@contextlib.contextmanager
def tracking_unseen(model: nn.Module) -> Iterator[dict[str, None]]:
    """Record on ``model`` the op calls its quantized forwards made inside that the placement never
    saw (torch.export runs copies of the modules, so the calls are gathered, then recorded). Yields
    the calls recorded, filled on exit (none for a model without a placement), for
    :meth:`QuantizedView.with_unseen`."""
    recorded: dict[str, None] = {}
    with collect_unseen() as unseen:
        yield recorded
    if record_unseen(model, unseen):
        recorded.update(unseen)


def record_unseen(model: nn.Module, calls: dict[str, None]) -> bool:
    """Add ``calls`` to the model's unseen calls (its export record names them as kept float);
    False where the model has no placement to record them on."""
    graph = graph_of(model)
    if graph is None:
        return False
    graph.unseen.update(calls)
    return True


def remove_placement(model: nn.Module) -> None:
    """Drop the placement and its hooks from ``model`` (a copy whose quantizers now live in swapped layers)."""
    detach(model)
