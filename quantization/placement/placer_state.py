"""The state the placement passes (quantization/placement/place.py) share: the placement being
built, the traced graph's indexes (producers, readers, weighted calls, sliced weights, the ops inside
activation functions kept float), the quantized tensors and their scale-sharing groups (a union-find
over tensor ids), and the helpers that hand out quantizers."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from compress.quantization.placement.cost_table import CostTable
from compress.quantization.placement.graph_patterns import (
    activation_regions,
    sliced_weight,
    tensor_consumers,
    weighted_operands,
)
from compress.quantization.placement.records import Placement, WeightUse, new_constant
from compress.quantization.placement.runtimes import RuntimeProfile
from compress.quantization.placement.trace import Operand, OpGraph, OpNode


class TensorGroups:
    """Union-find over tensor ids."""

    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def add(self, t: str) -> None:
        self.parent.setdefault(t, t)

    def find(self, t: str) -> str:
        self.add(t)
        while self.parent[t] != t:
            self.parent[t] = self.parent[self.parent[t]]
            t = self.parent[t]
        return t

    def union(self, a: str, b: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra


class PlacerState:
    """The state :func:`quantization.placement.place.place`'s passes share: the placement being
    built, the graph's indexes, and the quantized tensors with their scale-sharing groups."""

    def __init__(self, graph: OpGraph, profile: RuntimeProfile, *, targeted: Callable[[str], bool], swapped: set[str],
                 skip_layers: Mapping[str, str], quantize_ops: bool, embeddings: bool, tied: dict[str, str],
                 float_ops: Mapping[str, str], serving_batch: int = 1, cost_table: CostTable | None = None,
                 example_batch: int | None = None) -> None:
        self.graph, self.profile, self.targeted, self.swapped = graph, profile, targeted, swapped
        self.skip_layers, self.quantize_ops, self.embeddings, self.tied = skip_layers, quantize_ops, embeddings, tied
        self.float_ops, self.serving_batch = float_ops, serving_batch
        # prices elementwise chains beside integer kernels at the serving batch (the traced call had
        # example_batch); None: the batch rule of integer_chains.FLOAT_WRITER_BATCH
        self.cost_table, self.example_batch = cost_table, example_batch
        self.pl = pl = Placement(target=profile.name)
        self.nodes = nodes = list(graph.nodes.values())
        pl.sites = {n.key: n.site for n in nodes}
        self.inside: set[str] = set()
        for scope, keys in activation_regions(graph).items():
            self.inside.update(keys)
            pl.floats[f"{scope}:activation"] = (
                f"activation written as {len(keys)} elementwise ops: kept float as one piece, which the runtime "
                "fuses (ORT: FastGelu, QuickGelu, ...) and runs faster than one integer op per step"
            )
        self.consumers = tensor_consumers(nodes)
        self.producers = {n.key: n for n in nodes}
        self.sliced = {n.key: sw for n in nodes if (sw := sliced_weight(n, self.producers)) is not None}
        self.weighted_keys = {n.key for n in nodes if weighted_operands(n) is not None} | set(self.sliced)
        self.slice_qids: dict[str, str] = {}  # slicing op -> the quantizer of the whole parameter it cuts
        self.groups = TensorGroups()
        self.quantized: set[str] = set()
        self.requested_out: list[str] = []
        self.by_param: dict[str, str] = {}

    # ---- helpers ------------------------------------------------------------------------------
    def constant_quantizer(self, n: OpNode, o: Operand) -> str:
        """One quantizer per parameter (shared by its readers), else one per operand."""
        if o.source == "param" and o.name:
            if o.name not in self.by_param:
                self.by_param[o.name] = new_constant(self.pl, f"param {o.name}")
            return self.by_param[o.name]
        return new_constant(self.pl, f"{n.key} operand {o.position} ({o.source})")

    def quantize(self, o: Operand) -> bool:
        t = o.tensor_id
        if t is None or not o.floating:
            return False
        self.groups.add(t)
        self.quantized.add(t)
        return True

    def new_weight(self, key: str, position: int, use: WeightUse) -> str:
        qid = f"w{len(self.pl.weights)}"
        self.pl.weights[qid] = use
        self.pl.entries.setdefault(key, {})[str(position)] = qid
        return qid
