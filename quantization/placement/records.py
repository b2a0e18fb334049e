"""What a placement is, as data: :class:`Placement` (saved with the model) and :class:`WeightUse`,
and the quantizer ids the placement passes (quantization/placement/place.py) hand out.

A ``Placement``, for one runtime profile, holds:

- one activation quantizer per quantized tensor, shared by every consumer of that tensor, so the
  exported graph has one Q/DQ pair per tensor; tensors that must share a scale (concat inputs and
  output, the two sides of pass-through ops such as reshape or max-pool) share one quantizer;
- ``entries``: for each op call (by its stable key), which operand positions read which
  quantizer; attention (SDPA) calls get quantizers inside the decomposed attention (``q``, ``k``,
  ``v`` and the softmax output ``p``);
- ``weights``: weights used functionally (a parameter passed to ``F.linear``/``addmm``/``@`` outside
  a swapped layer's own forward: GPT-2's Conv1D, a helper that calls ``F.linear(x, self.qkv.weight)``,
  nn.MultiheadAttention's packed ``in_proj_weight``) get a weight quantizer at that call; a weight
  that is a slice of a parameter (``w.split``/``chunk``, as cross-attention slices the packed
  projection) gets one on the whole parameter, at the slicing call, so its per-channel scales
  slice along with it;
- ``floats``: every weighted op, add and attention left in float, and every product or concat a
  fidelity guard keeps float, with the reason;
- embedding tables (``F.embedding`` of a 2-D parameter, with ``embeddings``) get a per-row int8
  weight quantizer (``WeightUse.table``), the table tied to a swapped layer's weight (GPT-2's
  lm_head) that layer's own, so both read the same codes; graph_prepare keeps a table float when
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class WeightUse:
    """A parameter quantized where it is used functionally: ``param`` names it in the model;
    ``axis`` is its per-output-channel axis in that use; ``module`` is the swapped layer whose own
    weight quantizer applies (None: the placement owns a quantizer for it); ``table``: an embedding
    table read by ``F.embedding`` (int8, one scale per row)."""

    param: str
    axis: int
    module: str | None = None
    table: bool = False


@dataclass
class Placement:
    """Where the activation (and functional weight) quantizers sit; see the module docstring."""

    target: str
    activations: dict[str, list[str]] = field(default_factory=dict)
    entries: dict[str, dict[str, str]] = field(default_factory=dict)
    weights: dict[str, WeightUse] = field(default_factory=dict)
    floats: dict[str, str] = field(default_factory=dict)
    #: every traced op key -> its call site (quantization.placement.trace.call_site); empty in placements saved
    #: before sites were recorded, which resolve calls by plain per-scope index
    sites: dict[str, str] = field(default_factory=dict)
    #: quantized op outputs: ``key/index`` -> ``[quantizer, "reader key|position", ...]``. Applied
    #: where the op makes them while every reader still reads that quantizer (SmoothQuant or accuracy
    #: control may change a reader's), so an export that inserts ops between producer and reader
    #: (transformers' ``repeat_kv`` once a mask exists) keeps the Q right after the producer, where
    #: the runtime fuses it
    produced: dict[str, list[str]] = field(default_factory=dict)
    #: why the whole model was left float (the cost table predicted int8 slower than fp32 at a batch it
    #: will be served at, quantization/placement/model_cost.py); None where quantizers were placed
    model_float: str | None = None
    #: the cost table that decided (``onnxruntime vnni:intel``: the deployment CPU's,
    #: quantization/placement/cost_table.py); None where none did (cost_table off, no table for the CPU)
    cost_table: str | None = None

    def to_data(self) -> dict[str, Any]:
        """A plain dict (torch.load(weights_only=True) and JSON can hold it)."""
        return {
            "target": self.target,
            "activations": {k: list(v) for k, v in self.activations.items()},
            "entries": {k: dict(v) for k, v in self.entries.items()},
            "weights": {k: [w.param, w.axis, w.module, w.table] for k, w in self.weights.items()},
            "floats": dict(self.floats),
            "sites": dict(self.sites),
            "produced": {k: list(v) for k, v in self.produced.items()},
            "model_float": self.model_float,
            "cost_table": self.cost_table,
        }

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> Placement:
        return cls(
            target=str(data["target"]),
            activations={k: list(v) for k, v in data["activations"].items()},
            entries={k: dict(v) for k, v in data["entries"].items()},
            weights={k: WeightUse(v[0], int(v[1]), v[2], bool(v[3]) if len(v) > 3 else False)
                     for k, v in data["weights"].items()},
            floats=dict(data.get("floats", {})),
            sites=dict(data.get("sites", {})),
            produced={k: list(v) for k, v in data.get("produced", {}).items()},
            model_float=data.get("model_float"),
            cost_table=data.get("cost_table"),
        )


#: quantizer ids of constant operands: calibrated from their value by min/max (hooks.build_quantizers)
CONSTANT_PREFIX = "c"


def new_constant(pl: Placement, label: str) -> str:
    qid = f"{CONSTANT_PREFIX}{sum(k.startswith(CONSTANT_PREFIX) for k in pl.activations)}"
    pl.activations[qid] = [label]
    return qid


def new_internal(pl: Placement, label: str) -> str:
    qid = f"s{sum(k.startswith('s') for k in pl.activations)}"
    pl.activations[qid] = [label]
    return qid
