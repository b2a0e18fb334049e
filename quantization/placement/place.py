"""Quantizer placement on the traced graph, by a runtime profile.

Input: the OpGraph of one forward pass (quantization/placement/trace.py) and a RuntimeProfile
(quantization/placement/runtimes.py). Output: a ``Placement``, plain data saved with the model:

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
  its int8 form would cost fidelity.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from quantization.placement.runtimes import RuntimeProfile
from quantization.placement.trace import Operand, OpGraph, OpNode

#: weighted kinds: (data operand position, weight operand position, weight per-channel axis)
_WEIGHTED_POS: dict[str, tuple[int, int, int]] = {"linear": (0, 1, 0), "conv": (0, 1, 0), "addmm": (1, 2, 1)}


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
        )


def weighted_operands(node: OpNode) -> tuple[Operand, Operand, int] | None:
    """``(data, weight, weight axis)`` of a weighted op call whose weight is a model parameter."""
    ops = {o.position: o for o in node.operands}
    if node.kind in _WEIGHTED_POS:
        d, w, axis = _WEIGHTED_POS[node.kind]
        data, weight = ops.get(d), ops.get(w)
        if data is not None and weight is not None and weight.source == "param":
            return data, weight, axis
        return None
    if node.kind == "matmul" and len(node.operands) == 2:
        a, b = node.operands
        if b.source == "param" and a.source != "param" and len(b.shape) >= 2:
            return a, b, len(b.shape) - 1
    return None


#: ops that cut a tensor into pieces of the same rank (a weight sliced from a packed parameter)
_SLICING = frozenset({"split", "chunk", "narrow", "split_with_sizes", "tensor_split"})


def sliced_weight(node: OpNode, producers: dict[str, OpNode]) -> tuple[Operand, OpNode, Operand, int] | None:
    """``(data, slicing op, parameter operand, axis)`` of a weighted op call whose weight is a slice
    of a model parameter, cut by one split/chunk/narrow call that keeps the rank."""
    ops = {o.position: o for o in node.operands}
    if node.kind not in _WEIGHTED_POS:
        return None
    d, w, axis = _WEIGHTED_POS[node.kind]
    data, weight = ops.get(d), ops.get(w)
    if data is None or weight is None or weight.source != "op":
        return None
    cut = producers.get(str(weight.producer))
    if cut is None or cut.kind != "reshape" or cut.func not in _SLICING or not cut.operands:
        return None
    param = cut.operands[0]
    if param.source != "param" or param.position != 0 or any(len(s) != len(param.shape) for s in cut.out_shapes):
        return None
    return data, cut, param, axis


class _Groups:
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


def place(
    graph: OpGraph,
    profile: RuntimeProfile,
    *,
    targeted: Callable[[str], bool],
    swapped: set[str],
    skip_layers: Mapping[str, str] | None = None,
    quantize_ops: bool = True,
    embeddings: bool = True,
    tied: dict[str, str] | None = None,
    model_float: str | None = None,
) -> Placement:
    """Place quantizers on ``graph`` for ``profile``.

    ``targeted(scope)``: whether ops running in that module are to be quantized (targets/ignore);
    ``swapped``: names of layers swapped for quantized modules (they quantize their own weight);
    ``skip_layers``: layers kept float on purpose (first/last policy, measured placement), not quantized
    at all, mapped to the reason recorded in ``floats``;
    ``embeddings``: give embedding tables int8 weight quantizers; ``tied``: parameter name -> the
    swapped layer whose weight it also is (a tied embedding reads that layer's quantized weight).

    The passes, in order (:class:`_Placer`): each op's inputs by its kind (embedding tables,
    weighted ops, attention, adds, concats, matmuls, the rest), the outputs the runtime wants
    quantized, pass-through ops sharing their neighbours' quantizers, products whose output is
    quantized anyway given quantized operands where one 8-bit scale holds them, elementwise ops
    extended into integer chains, then one quantizer id per group of tensors.

    ``model_float``: the whole model stays float for this reason; nothing is placed, and each
    weighted op, add, concat, matmul and attention call is named in ``floats`` with it.
    """
    if model_float is not None:
        pl = Placement(target=profile.name, model_float=model_float)
        pl.sites = {n.key: n.site for n in graph.nodes.values()}
        for n in graph.nodes.values():
            if n.kind in ("add", "cat", "matmul", "sdpa", "embedding") or weighted_operands(n) is not None:
                pl.floats[n.key] = model_float
        return pl
    placer = _Placer(graph, profile, targeted=targeted, swapped=swapped, skip_layers=skip_layers or {},
                     quantize_ops=quantize_ops, embeddings=embeddings, tied=tied or {})
    for n in placer.nodes:
        if n.key not in placer.inside:
            placer.op(n)
    placer.output_quantizers()
    placer.pass_through()
    placer.integer_products()
    placer.extend_chains()
    placer.assign_ids()
    placer.report_unquantized()
    return placer.pl


class _Placer:
    """The state :func:`place`'s passes share: the placement being built, the graph's indexes, and
    the quantized tensors with their scale-sharing groups."""

    def __init__(self, graph: OpGraph, profile: RuntimeProfile, *, targeted: Callable[[str], bool], swapped: set[str],
                 skip_layers: Mapping[str, str], quantize_ops: bool, embeddings: bool, tied: dict[str, str]) -> None:
        self.graph, self.profile, self.targeted, self.swapped = graph, profile, targeted, swapped
        self.skip_layers, self.quantize_ops, self.embeddings, self.tied = skip_layers, quantize_ops, embeddings, tied
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
        self.consumers = _consumers(nodes)
        self.producers = {n.key: n for n in nodes}
        self.sliced = {n.key: sw for n in nodes if (sw := sliced_weight(n, self.producers)) is not None}
        self.weighted_keys = {n.key for n in nodes if weighted_operands(n) is not None} | set(self.sliced)
        self.slice_qids: dict[str, str] = {}  # slicing op -> the quantizer of the whole parameter it cuts
        self.groups = _Groups()
        self.quantized: set[str] = set()
        self.requested_out: list[str] = []
        self.by_param: dict[str, str] = {}

    # ---- helpers ------------------------------------------------------------------------------
    def constant_quantizer(self, n: OpNode, o: Operand) -> str:
        """One quantizer per parameter (shared by its readers), else one per operand."""
        if o.source == "param" and o.name:
            if o.name not in self.by_param:
                self.by_param[o.name] = _new_constant(self.pl, f"param {o.name}")
            return self.by_param[o.name]
        return _new_constant(self.pl, f"{n.key} operand {o.position} ({o.source})")

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

    # ---- pass 1: each op's inputs, by kind ----------------------------------------------------
    def op(self, n: OpNode) -> None:
        pl, profile = self.pl, self.profile
        if n.kind == "embedding":
            self.embedding(n)
            return
        rule = profile.rules.get(n.kind)
        cut = self.sliced.get(n.key)
        w = (cut[0], cut[2], cut[3]) if cut is not None else weighted_operands(n)
        if w is not None:
            self.weighted(n, rule, w, cut)
            return
        if n.kind == "mha":  # an nn.MultiheadAttention call the modes did not decompose
            pl.floats[n.key] = str(n.attrs.get("reason", "nn.MultiheadAttention left whole"))
            return
        if rule is None or not self.quantize_ops:
            if rule is not None and n.kind in ("add", "sdpa") and n.scope not in self.swapped:
                pl.floats[n.key] = "tensor ops are not quantized (quantize_ops: false)"
            return
        if not self.targeted(n.scope):
            if n.kind in ("add", "sdpa", "matmul", "cat"):
                pl.floats[n.key] = "excluded by targets/ignore"
            return
        if n.kind == "sdpa":
            self.sdpa(n)
            return
        # an empty operand carries no values (a KV cache's empty past, concatenated on the first step)
        acts = [o for o in n.operands if o.source in ("op", "input") and o.floating and 0 not in o.shape]
        if n.kind == "matmul":
            chosen = acts if len(acts) == 2 else []
        elif n.kind == "add":
            chosen = self.add_inputs(n, rule, acts)
        elif n.kind == "cat":
            chosen = acts if acts and len(acts) == len(n.operands) else []
            phase = _phase_error(n, self.consumers.get(f"{n.key}/0", []))
            if chosen and phase is not None:
                pl.floats[n.key] = phase
                return
        else:
            chosen = acts[:1]
        if rule.inputs == "none" or not chosen:
            return
        for o in chosen:
            self.quantize(o)
        if rule.shared:
            tids = [o.tensor_id for o in chosen]
            for t in tids[1:]:
                self.groups.union(str(tids[0]), str(t))
            out = f"{n.key}/0"
            self.groups.union(str(tids[0]), out)
            self.quantized.add(out)
        elif rule.output:
            self.requested_out.append(n.key)

    def embedding(self, n: OpNode) -> None:
        table = next((o for o in n.operands if o.position == 1), None)
        if table is None or table.source != "param" or not table.floating or len(table.shape) != 2:
            return
        if not self.embeddings:
            self.pl.floats[n.key] = "embedding table kept float (quantize_embeddings: false)"
        elif not self.quantize_ops:  # the Linear-layers-only mode (what the W8A8 LLM export runs)
            self.pl.floats[n.key] = "embedding table kept float (quantize_ops: false quantizes layers only)"
        elif not self.targeted(n.scope):
            self.pl.floats[n.key] = "excluded by targets/ignore"
        else:
            self.new_weight(n.key, 1, WeightUse(table.name or "", 0, self.tied.get(table.name or ""), table=True))

    def weighted(self, n: OpNode, rule: Any, w: tuple[Operand, Operand, int],
                 cut: tuple[Operand, OpNode, Operand, int] | None) -> None:
        pl = self.pl
        data, weight, axis = w
        layer = weight.name.rsplit(".", 1)[0] if weight.name and "." in weight.name else ""
        skipped = self.skip_layers.get(layer) or self.skip_layers.get(n.scope)
        if skipped is not None:
            pl.floats[n.key] = skipped
            return
        if not self.targeted(n.scope) or not self.targeted(layer):
            pl.floats[n.key] = "excluded by targets/ignore"
            return
        if not data.floating or data.source not in ("op", "input"):
            pl.floats[n.key] = "its input is not a floating activation"
            return
        if _feeds_topk(n, self.producers, self.consumers, self.weighted_keys):
            pl.floats[n.key] = ROUTER_REASON
            return
        if cut is not None:
            # the quantizer runs on the whole parameter, where the slicing op reads it
            if cut[1].key not in self.slice_qids:
                self.slice_qids[cut[1].key] = self.new_weight(
                    cut[1].key, weight.position,
                    WeightUse(weight.name or "", axis, layer if layer in self.swapped else None))
        elif n.scope != layer or layer not in self.swapped:
            self.new_weight(n.key, weight.position,
                            WeightUse(weight.name or "", axis, layer if layer in self.swapped else None))
        self.quantize(data)
        if rule is not None and rule.output:
            self.requested_out.append(n.key)
        elif rule is not None and rule.fold_output:
            out, cons = f"{n.key}/0", self.consumers.get(f"{n.key}/0", [])
            if len(cons) == 1 and _foldable(cons[0][0], self.profile) and out not in _outputs(self.graph):
                self.requested_out.append(n.key)

    def sdpa(self, n: OpNode) -> None:
        if len(n.operands) < 3 or not all(o.floating for o in n.operands[:3]):
            self.pl.floats[n.key] = "attention inputs are not floating tensors"
            return
        roles = ["q", "k", "v", "p"]
        ranges = n.attrs.get("amax", {})
        add_rule = self.profile.rules.get("add")
        # the scores run in integer up to the softmax (QLinearMatMul, QLinearMul by the scale,
        # QLinearAdd of a bias or QLinearWhere of a boolean/causal mask, QLinearSoftmax) where the
        # runtime has those kernels (a boolean mask's fill: attention.MASK_GAP)
        integer = self.profile.integer_scores and {"mul", "softmax"} <= self.profile.extend
        if ranges and add_rule is not None and add_rule.constants:
            # a float mask or bias is added to the scores: quantized as an add the runtime fuses
            lopsided = _lopsided([ranges["scores"], ranges["mask"]])
            if lopsided:
                self.pl.floats[f"{n.key}.mask"] = lopsided
            else:
                roles += ["scores", "mask", "biased"] + (["qk"] if integer else [])
        elif integer:
            roles += ["qk", "scores"]
        entry = self.pl.entries.setdefault(n.key, {})
        entry.update({p: _new_internal(self.pl, f"{n.key}.{p}") for p in roles})
        if "qk" in roles:  # the score scale: a one-value constant, which one 8-bit code holds exactly
            entry["scale"] = _new_constant(self.pl, f"{n.key} score scale")

    def add_inputs(self, n: OpNode, rule: Any, acts: list[Operand]) -> list[Operand]:
        """The operands of an add to quantize (none: it stays float, or was handled here)."""
        pl = self.pl
        out_shape = n.out_shapes[0] if n.out_shapes else ()
        same = [o for o in acts if o.shape == out_shape]
        if len(n.operands) != 2 or len(same) != 2:
            if n.scope in self.swapped:  # a quantized layer's own arithmetic (a QAT conv's BatchNorm bias)
                return []
            lopsided = _lopsided(n.attrs.get("amax", []))
            if rule.constants and lopsided and len(n.operands) == 2 and acts:
                pl.floats[n.key] = lopsided
            elif rule.constants and len(n.operands) == 2 and acts and all(o.floating for o in n.operands):
                for o in n.operands:
                    if not self.quantize(o):  # a parameter, buffer, constant or number: a quantizer of its own
                        pl.entries.setdefault(n.key, {})[str(o.position)] = self.constant_quantizer(n, o)
                if rule.output:
                    self.requested_out.append(n.key)
            elif acts:
                pl.floats[n.key] = "one operand is a constant or broadcast (bias, mask, scale)"
            return []
        returned = [o for o in same if o.producer in self.weighted_keys and (o.producer, o.index) in self.graph.outputs]
        if returned and rule.output:
            pl.floats[n.key] = RETURNED_REASON
            return []
        outlier = _outlier_operand(n.attrs)
        if outlier is not None and rule.output:
            # a fused integer add needs 8-bit inputs and output: keep the whole add float instead
            pl.floats[n.key] = outlier
            return []
        if rule.inputs == "residual":
            skip = [o for o in same if o.producer not in self.weighted_keys]
            return skip if len(skip) == 1 else same
        return same

    # ---- pass 2: an op whose output the runtime wants quantized, after a foldable activation ----
    def output_quantizers(self) -> None:
        for key in self.requested_out:
            t = f"{key}/0"
            node = self.producers[key]
            if node.kind == "conv":
                # a QAT conv holding its BatchNorm computes the norm inside its own forward: the layer's
                # output is the norm's
                inner = [m for m in self.nodes if m.scope == node.scope and m.kind == "batch_norm"]
                if inner:
                    t = f"{inner[-1].key}/0"
            while True:
                cons = self.consumers.get(t, [])
                if len(cons) == 1 and _foldable(cons[0][0], self.profile) and t not in _outputs(self.graph) \
                        and cons[0][0].key not in self.inside:
                    t = f"{cons[0][0].key}/0"
                    continue
                break
            if self.consumers.get(t):
                self.groups.add(t)
                self.quantized.add(t)
            elif key.split(":")[-1].startswith("conv"):
                self.pl.floats[key] = "its output is a model output (the runtime needs a quantizer after it to fuse)"

    # ---- pass 3: pass-through ops: the tensor before shares the quantizer of the tensor after ----
    def pass_through(self) -> None:
        changed = True
        while changed:
            changed = False
            for n in reversed(self.nodes):
                if n.kind not in self.profile.pass_through or f"{n.key}/0" not in self.quantized:
                    continue
                src = [o for o in n.operands if o.source in ("op", "input") and o.floating]
                if len(src) != 1:
                    continue
                t = src[0].tensor_id
                assert t is not None
                for i in range(n.n_outputs):
                    out = f"{n.key}/{i}"
                    if out in self.quantized:
                        self.groups.union(t, out)
                if t not in self.quantized:
                    self.quantized.add(t)
                    changed = True

    # ---- pass 4: elementwise ops whose inputs are all quantized by now run as integer kernels too
    # (a chain extends one op at a time, in graph order); their output gets a quantizer. A product's
    # other operand may be a constant (attention's ``q * scale``, a Python number, a layer scale): it
    # gets a quantizer of its own (ORT's QLinearMul reads it as a quantized initializer) where one
    # 8-bit scale holds it (_holds: a per-channel layer scale that spans decades stays float)
    def extend_chains(self) -> None:
        for n in self.nodes:
            kind = n.func if n.kind in ("act", "softmax") else n.kind  # hardsigmoid, leaky_relu: by their call
            if kind not in self.profile.extend or not self.targeted(n.scope) or not self.quantize_ops \
                    or n.key in self.inside:
                continue
            acts = [o for o in n.operands if o.source in ("op", "input") and o.floating]
            arity = 2 if kind == "mul" else 1
            out = f"{n.key}/0"
            if len(n.operands) != arity or not acts or not self.consumers.get(out):
                continue
            consts = [o for o in n.operands if o not in acts]
            if consts and (any(not o.floating or not _holds(n, o) for o in consts) or len(acts) != 1):
                continue
            if not all(self.on_grid(o) for o in acts) and not (
                    any(math.prod(o.shape) > 1 for o in consts) and self.pull_onto_grid(acts[0]) and self.on_grid(acts[0])):
                continue
            self.groups.add(out)
            self.quantized.add(out)
            for o in consts:
                self.pl.entries.setdefault(n.key, {})[str(o.position)] = self.constant_quantizer(n, o)
            if kind in ("silu", "hardswish"):  # run as x * q(gate(x)): a QLinearMul with a quantized gate
                self.pl.entries.setdefault(n.key, {})["g"] = _new_internal(self.pl, f"{n.key}.g")

    def pull_onto_grid(self, o: Operand) -> bool:
        """Quantize ``o`` where it is a Linear/Conv output read by this op alone (through pass-through
        ops): the layer's output quantizer fuses into its integer kernel (QGemm, QLinearConv with an
        8-bit output), so a layer-scale product after it runs as QLinearMul instead of a float Mul
        between the layer's float output and the next quantizer."""
        t = o.tensor_id
        while t is not None and o.source == "op" and len(self.consumers.get(t, [])) == 1:
            prod = self.producers.get(str(o.producer))
            if prod is None or prod.key in self.inside:
                return False
            if prod.key in self.weighted_keys and prod.key not in self.pl.floats:
                self.groups.add(t)
                self.quantized.add(t)
                return True
            src = [p for p in prod.operands if p.source in ("op", "input") and p.floating]
            if prod.kind not in self.profile.pass_through or len(src) != 1:
                return False
            o, t = src[0], src[0].tensor_id
        return False

    # ---- pass 4a: a product whose output is quantized anyway (a Linear's input, an integer add's
    # operand) gets quantized operands, so the runtime runs it as QLinearMul instead of a float Mul
    # between a DQ and that Q: RMSNorm's ``x * rsqrt(var + eps) * weight``, rotary's ``q * cos``
    # and ``rotate_half(q) * sin``, SwiGLU's ``silu(gate) * up``. Walked from the last op back, so a
    # chain is decided from the product its reader reads.
    def integer_products(self) -> None:
        if "mul" not in self.profile.extend or not self.quantize_ops:
            return
        for n in reversed(self.nodes):
            if n.kind != "mul" or f"{n.key}/0" not in self.quantized or n.key in self.pl.floats:
                continue
            plan = self.product_plan(n, 0)
            if isinstance(plan, str):
                if plan:
                    self.pl.floats[n.key] = plan
                continue
            for t in plan:
                self.groups.add(t)
                self.quantized.add(t)

    def product_plan(self, n: OpNode, depth: int) -> list[str] | str:
        """The tensors to quantize so that product ``n`` runs in integer, or why it cannot (an empty
        reason: nothing to record, the product is not one this pass places)."""
        if n.key in self.inside or not self.targeted(n.scope) or len(n.operands) != 2 or depth > PRODUCT_DEPTH:
            return ""
        acts = [o for o in n.operands if o.source in ("op", "input") and o.floating]
        consts = [o for o in n.operands if o not in acts]
        if not acts or any(not o.floating for o in consts):
            return ""
        for o in consts:
            if not _holds(n, o):
                sq = n.attrs.get("const_sqnr", [])
                db = sq[o.position] if o.position < len(sq) else None
                return (f"its constant operand {o.name or o.position} keeps {_db(db)} under one 8-bit scale "
                        f"(< {CONSTANT_MIN_SQNR:.0f} dB): the product stays float")
        off = [o for o in acts if not self.grid_known(o)]
        if not off:
            return []
        plan: list[str] = []
        need: list[Operand] = []
        for o in off:
            why = _unheld(n, o)
            if why is not None:
                return why
            part = self.operand_plan(o, depth, others=False)
            if isinstance(part, str):
                need.append(o)
            else:
                plan += part
        # a quantizer after a float op (rsqrt, cos) pays off only where the integer product also
        # saves a dequantization: another operand already quantized, or quantized for free
        if need and len(need) == len(acts):
            return ""
        for o in need:
            part = self.operand_plan(o, depth, others=True)
            if isinstance(part, str):
                return part
            plan += part
        return plan

    def operand_plan(self, o: Operand, depth: int, *, others: bool) -> list[str] | str:
        """The tensors to quantize to put operand ``o`` of a product on an 8-bit grid: its root
        (before pass-through ops and identity casts) where a Linear/Conv makes it (the layer's output
        quantizer fuses into its integer kernel) or the model takes it; an integer-kernel op's inputs
        (SiLU, sigmoid, another product) where they can be put there in turn; else a quantizer after
        the op that makes it (``others``: only where the product has another quantized operand)."""
        root = o
        while root.source == "op":
            prod = self.producers.get(str(root.producer))
            if prod is None or prod.key in self.inside:
                return ""
            src = [p for p in prod.operands if p.source in ("op", "input") and p.floating]
            if not self.passes(prod) or len(src) != 1:
                break
            root = src[0]
        t = root.tensor_id
        if t is None:
            return ""
        if root.source == "input":
            return [t]
        prod = self.producers[str(root.producer)]
        if prod.key in self.weighted_keys:
            return [t] if prod.key not in self.pl.floats else ""
        if prod.kind in ("silu", "sigmoid") and len(prod.operands) == 1 and prod.kind in self.profile.extend:
            inner = prod.operands[0]
            if self.grid_known(inner):
                return []
            if _unheld(prod, inner) is None:
                part = self.operand_plan(inner, depth + 1, others=False)
                if not isinstance(part, str):
                    return part
        if prod.kind == "mul" and depth < PRODUCT_DEPTH:
            part = self.product_plan(prod, depth + 1)
            if not isinstance(part, str):
                return [t, *part]
        return [t] if others and prod.n_outputs == 1 else ""

    def grid_known(self, o: Operand) -> bool:
        """Whether ``o`` is quantized or shares a quantized tensor's grid through pass-through ops,
        without recording it (:meth:`on_grid` records)."""
        t = o.tensor_id
        while t is not None and t not in self.quantized:
            prod = self.producers.get(str(o.producer)) if o.source == "op" else None
            if prod is None or not self.passes(prod) or prod.key in self.inside:
                return False
            src = [p for p in prod.operands if p.source in ("op", "input") and p.floating]
            if len(src) != 1:
                return False
            o, t = src[0], src[0].tensor_id
        return t is not None

    def passes(self, n: OpNode) -> bool:
        """Whether a tensor keeps its grid through ``n``: a pass-through op of the profile, or a call
        that returned its input (a cast to the dtype it had)."""
        return n.kind in self.profile.pass_through or bool(n.attrs.get("identity"))

    def on_grid(self, o: Operand) -> bool:
        """Whether a tensor is quantized, or made by pass-through ops (a select, a reshape) from one
        that is: then it is on that quantizer's grid and shares it (attention's ``q = qkv[0]``)."""
        t = o.tensor_id
        if t is None:
            return False
        if t in self.quantized:
            return True
        prod = self.producers.get(str(o.producer)) if o.source == "op" else None
        if prod is None or not self.passes(prod) or prod.key in self.inside:
            return False
        src = [p for p in prod.operands if p.source in ("op", "input") and p.floating]
        if len(src) != 1 or not self.on_grid(src[0]):
            return False
        self.groups.union(str(src[0].tensor_id), t)
        self.quantized.add(t)
        return True

    # ---- pass 5: one quantizer id per group, read by every consumer of its tensors --------------
    def assign_ids(self) -> None:
        pl = self.pl
        ids: dict[str, str] = {}
        model_outputs = _outputs(self.graph)
        for t in sorted(self.quantized, key=_order(self.nodes)):
            root = self.groups.find(t)
            if root not in ids:
                ids[root] = f"a{len(ids)}"
            qid = ids[root]
            pl.activations.setdefault(qid, []).append(t)
            readers = self.consumers.get(t, [])
            for n, o in readers:
                pl.entries.setdefault(n.key, {}).setdefault(str(o.position), qid)
            if t.rsplit("/", 1)[0] in self.producers and t not in model_outputs:  # a model output stays unquantized
                pl.produced[t] = [qid, *(f"{n.key}|{o.position}" for n, o in readers)]

    def report_unquantized(self) -> None:
        """Weighted ops whose input ended up unquantized are named in ``floats``."""
        for n in self.nodes:
            if n.key in self.weighted_keys and n.key not in self.pl.floats:
                cut = self.sliced.get(n.key)
                data_op = cut[0] if cut is not None else weighted_operands(n)[0]  # type: ignore[index]
                t = data_op.tensor_id
                if t is None or t not in self.quantized:
                    self.pl.floats[n.key] = "its input is not quantized"


#: a constant tensor operand of a product runs as a quantized initializer (QLinearMul) only when one
#: 8-bit scale keeps it at this SQNR or better (the tracer computes it from its values): a layer scale
#: initialized to one value (ConvNeXt's 1e-6) passes; trained layer scales spanning decades do not,
#: and their small channels would round to zero (measured: tests/quantization/test_placement_elementwise.py)
CONSTANT_MIN_SQNR = 40.0


#: calls whose error is their input's absolute error (a phase), not a relative one
_PERIODIC = frozenset({"~cos", "~sin"})
#: the largest phase step one 8-bit scale may put on an angle read only by cos/sin (radians): with
#: it cos/sin keep about 40 dB (CONSTANT_MIN_SQNR), a step 0.02 rad rounding by at most 0.01
MAX_PHASE_STEP = 0.02


def _phase_error(n: OpNode, readers: list[tuple[OpNode, Operand]]) -> str | None:
    """Why a tensor read only by cos/sin stays float (None: it does not, or it holds): it is an angle,
    whose 8-bit step is an absolute phase error in every value it feeds. Rotary embeddings join
    ``position * inv_freq`` with itself: positions up to 127 put 0.5 rad on one step."""
    if not readers or any(r.kind not in _PERIODIC for r, _ in readers):
        return None
    amax = float(n.attrs.get("amax", 0.0))
    step = amax / 255  # the finest grid that reaches amax (one sign)
    if step <= MAX_PHASE_STEP:
        return None
    return (f"its output is an angle read only by cos/sin reaching {amax:.3g} rad: one 8-bit step would be "
            f"{step:.2g} rad of phase or more (> {MAX_PHASE_STEP} rad), so the concat stays float")


#: how deep a product's operands are followed back through integer-kernel ops (RMSNorm's two
#: products, SiLU's gate): the chains that pay off are short
PRODUCT_DEPTH = 3


def _db(v: float | None) -> str:
    return "an unmeasured SQNR" if v is None else f"{v:.1f} dB"


def _unheld(n: OpNode, o: Operand) -> str | None:
    """Why one 8-bit scale does not hold activation operand ``o`` of op ``n`` (None: it does). A
    factor broadcast over the product (a value per row: RMSNorm's rsqrt, rotary's cos/sin) must keep
    CONSTANT_MIN_SQNR, as a constant factor must (tracer: ``factor_db``, which counts the row whose
    factor sits on the grid's first codes); an operand of the product's size, the activation bar of
    the residual adds (peak within MAX_PEAK_TO_RMS of its RMS)."""
    fdb = n.attrs.get("factor_db", [])
    db = fdb[o.position] if o.position < len(fdb) else None
    out = math.prod(n.out_shapes[0]) if n.out_shapes else 0
    if math.prod(o.shape) < out:
        if db is not None and db >= CONSTANT_MIN_SQNR:
            return None
        return (f"operand {o.position} is a factor broadcast over the product that one 8-bit scale keeps at "
                f"{_db(db)} (< {CONSTANT_MIN_SQNR:.0f} dB; a row scaled by a value on the grid's first codes "
                "loses itself): the product stays float")
    amax, rms = n.attrs.get("amax", []), n.attrs.get("rms", [])
    a = amax[o.position] if o.position < len(amax) else 0.0
    r = rms[o.position] if o.position < len(rms) else 0.0
    if r > 0 and a / r <= MAX_PEAK_TO_RMS:
        return None
    if r <= 0:
        return ""
    return (f"operand {o.position} peaks at {a / r:.0f}x its RMS: one 8-bit scale would cost about "
            f"{52.9 - 20 * math.log10(a / r):.0f} dB, so the product stays float")


def _holds(n: OpNode, o: Operand) -> bool:
    """Whether the constant operand ``o`` of product ``n`` keeps its values under one 8-bit scale."""
    if math.prod(o.shape) == 1:
        return True
    sq = n.attrs.get("const_sqnr", [])
    v = sq[o.position] if o.position < len(sq) else None
    return v is not None and v >= CONSTANT_MIN_SQNR


#: recorded op kinds that are elementwise, and other elementwise calls (named as the tracer records
#: calls it gives no kind) that may make up an activation function
_ELEMENTWISE_KINDS = frozenset({"add", "sub", "mul", "act", "silu", "sigmoid", "relu", "relu6"})
_ELEMENTWISE_CALLS = frozenset({
    "~pow", "~__pow__", "~__rpow__", "~div", "~__truediv__", "~__rtruediv__", "~true_divide", "~exp", "~neg",
    "~__neg__", "~abs", "~sqrt", "~rsqrt", "~reciprocal", "~log", "~log1p", "~expm1", "~square",
})


def activation_regions(graph: OpGraph) -> dict[str, list[str]]:
    """``{module scope: op keys}`` for every parameterless module that computes an activation
    function from elementwise calls (GPT-2's tanh GELU, CLIP's QuickGELU, Mish): at least two ops,
    one tensor in, one tensor out, every intermediate of the input's shape. Quantizing each step
    costs a Q/DQ or an integer kernel per op and stops the runtime from fusing the function into one
    float kernel; outermost qualifying module wins."""
    by_scope: dict[str, list[OpNode]] = {}
    for n in graph.nodes.values():
        parts = n.scope.split(".") if n.scope else []
        for i in range(1, len(parts) + 1):
            by_scope.setdefault(".".join(parts[:i]), []).append(n)
    outputs = _outputs(graph)
    readers: dict[str, set[str]] = {}
    for n in graph.nodes.values():
        for o in n.operands:
            t = o.tensor_id
            if t is not None:
                readers.setdefault(t, set()).add(n.key)
    found: dict[str, list[str]] = {}
    for scope in sorted(by_scope, key=lambda s: s.count(".")):
        if any(scope.startswith(f"{f}.") for f in found):
            continue
        ops = by_scope[scope]
        keys = {n.key for n in ops}
        if len(ops) < 2 or any(n.kind not in _ELEMENTWISE_KINDS and n.kind not in _ELEMENTWISE_CALLS for n in ops):
            continue
        if any(o.source == "param" for n in ops for o in n.operands):
            continue
        ins = {t for n in ops for o in n.operands if (t := o.tensor_id) is not None and t.split("/")[0] not in keys}
        outs = {f"{n.key}/{i}" for n in ops for i in range(n.n_outputs)}
        leaving = {t for t in outs if t in outputs or readers.get(t, set()) - keys}
        if len(ins) != 1 or len(leaving) != 1:
            continue
        shape = next(o.shape for n in ops for o in n.operands if o.tensor_id in ins)
        if any(n.out_shapes[:1] != [shape] for n in ops):
            continue
        if _gated(ops, ins):
            continue
        found[scope] = [n.key for n in ops]
    return found


#: gates whose product with their own input a runtime runs in integer (QLinearSigmoid or a float
#: gate between Q/DQ, then QLinearMul): hardswish as ``x * hardsigmoid(x)``, SiLU as ``x * sigmoid(x)``
_GATES = frozenset({"sigmoid", "hardsigmoid"})


def _gated(ops: list[OpNode], ins: set[str]) -> bool:
    """Whether a region is ``x * gate(x)`` (two ops): quantize_static runs its product as
    QLinearMul, so it is left to the integer-chain pass instead of kept float as one piece."""
    if len(ops) != 2:
        return False
    gate, mul = ops
    if mul.kind != "mul" or (gate.func if gate.kind == "act" else gate.kind) not in _GATES:
        return False
    return {o.tensor_id for o in mul.operands} == {*ins, f"{gate.key}/0"}


#: an add whose operands' magnitudes differ by more than this stays float: its output's 8-bit scale
#: follows the larger one, and the smaller falls within one step and is lost. Masks (-1e4, finfo.min)
#: and RMSNorm's ``var + eps`` (eps 1e-6: a token whose variance rounds to zero gets rsqrt(0)) are the
#: cases; position embeddings, biases and GELU's ``1 + tanh`` are well inside it.
MAX_OPERAND_RATIO = 256.0


#: a tensor whose largest magnitude is this many times its RMS loses too much to one 8-bit scale:
#: per-tensor uint8 SQNR is about 52.9 - 20 log10(amax / rms) dB, so 32x is about 23 dB (the
#: outlier channels of BERT-style FFN outputs; Gaussian-like activations sit near 4-6x)
MAX_PEAK_TO_RMS = 32.0


def _outlier_operand(attrs: dict[str, Any]) -> str | None:
    """The reason to keep a residual add float when an operand has outliers one scale cannot hold."""
    worst = max((a / r for a, r in zip(attrs.get("amax", []), attrs.get("rms", []), strict=False) if r > 0),
                default=0.0)
    if worst <= MAX_PEAK_TO_RMS:
        return None
    return (f"an operand peaks at {worst:.0f}x its RMS (outlier channels): one 8-bit scale would cost about "
            f"{52.9 - 20 * math.log10(worst):.0f} dB, so the add and its inputs stay float")


#: magnitudes at or past float16's largest finite value are mask fills (finfo.min, -inf, -1e9), not
#: data: an add of two masks (GPT-Neo adds its padding mask to scores already filled with finfo.min)
#: has no lopsided pair, and its sum overflows to -inf, which no 8-bit scale holds
MASK_FILL = 65504.0


def _lopsided(amax: list[float]) -> str | None:
    """The reason to keep an add float when one operand dwarfs the other (see MAX_OPERAND_RATIO) or
    holds mask fill values (MASK_FILL)."""
    vals = [a for a in amax if a > 0]
    fill = max(vals, default=0.0)
    if fill >= MASK_FILL:
        return (f"an operand reaches {fill:.0e} in magnitude, a mask fill (finfo.min, -inf, -1e9): no 8-bit scale "
                "holds it, so the add stays float")
    if len(vals) < 2:
        return None
    ratio = max(vals) / min(vals)
    if ratio <= MAX_OPERAND_RATIO:
        return None
    return (f"one operand is {ratio:.0e}x the other in magnitude (a mask or an epsilon): one 8-bit scale "
            "for the sum would round the smaller away")


#: an add reading a weighted op's output that the model also returns (DeiT-with-teacher averages
#: its two heads' logits and returns each): a Q on that tensor stops ORT fusing the Gemm, whose
#: output must reach the Q alone, so the add stays float and the Gemm runs as QGemm with a float output
RETURNED_REASON = ("an operand is a Linear/Conv output the model also returns: quantizing it for this add would "
                   "stop the runtime fusing that layer (its output must reach the quantizer alone), so the add "
                   "stays float")


#: how many unweighted ops (softmax, sigmoid, a bias add, casts, reshapes) may sit between a
#: weighted op and the top-k that makes it a router
ROUTER_DEPTH = 6
ROUTER_REASON = ("its output feeds a top-k (an MoE router picking experts, or another top-k selection): rounding "
                 "its weight or input flips the choice near a tie; a router is a tiny share of the weights "
                 "(ModelOpt and llm-compressor leave MoE gates float too)")


def _feeds_topk(n: OpNode, producers: dict[str, OpNode], consumers: dict[str, list[tuple[OpNode, Operand]]],
                weighted: set[str]) -> bool:
    """Whether ``n``'s output reaches a ``topk`` through at most ROUTER_DEPTH unweighted ops."""
    frontier, seen = [n.key], {n.key}
    for _ in range(ROUTER_DEPTH):
        nxt = []
        for key in frontier:
            node = producers[key]
            for i in range(node.n_outputs):
                for c, _ in consumers.get(f"{key}/{i}", []):
                    if c.func == "topk":
                        return True
                    if c.key not in seen and c.key not in weighted:
                        seen.add(c.key)
                        nxt.append(c.key)
        frontier = nxt
    return False


def _consumers(nodes: list[OpNode]) -> dict[str, list[tuple[OpNode, Operand]]]:
    """The ops reading each produced tensor (by tensor id), with the operand they read it as."""
    consumers: dict[str, list[tuple[OpNode, Operand]]] = {}
    for n in nodes:
        for o in n.operands:
            t = o.tensor_id
            if t is not None:
                consumers.setdefault(t, []).append((n, o))
    return consumers


def router_layers(graph: OpGraph) -> set[str]:
    """The layers whose weighted call feeds a top-k (MoE routers, see :func:`_feeds_topk`), by name."""
    nodes = list(graph.nodes.values())
    producers = {n.key: n for n in nodes}
    consumers = _consumers(nodes)
    weighted = {n.key for n in nodes if weighted_operands(n) is not None}
    out = set()
    for n in nodes:
        w = weighted_operands(n)
        if w is not None and w[1].name and "." in w[1].name and _feeds_topk(n, producers, consumers, weighted):
            out.add(w[1].name.rsplit(".", 1)[0])
    return out


#: quantizer ids of constant operands: calibrated from their value by min/max (hooks.build_quantizers)
CONSTANT_PREFIX = "c"


def _new_constant(pl: Placement, label: str) -> str:
    qid = f"{CONSTANT_PREFIX}{sum(k.startswith(CONSTANT_PREFIX) for k in pl.activations)}"
    pl.activations[qid] = [label]
    return qid


def _new_internal(pl: Placement, label: str) -> str:
    qid = f"s{sum(k.startswith('s') for k in pl.activations)}"
    pl.activations[qid] = [label]
    return qid


def _foldable(n: OpNode, profile: RuntimeProfile) -> bool:
    if n.kind not in profile.fold:
        return False
    if n.kind == "relu6":
        return n.attrs.get("min") == 0
    return True


def _outputs(graph: OpGraph) -> set[str]:
    return {f"{k}/{i}" for k, i in graph.outputs}


def _order(nodes: list[OpNode]) -> Callable[[str], tuple[int, str]]:
    index = {n.key: i for i, n in enumerate(nodes)}

    def key(t: str) -> tuple[int, str]:
        if t.startswith("<"):
            return (-1, t)
        return (index.get(t.rsplit("/", 1)[0], len(index)), t)

    return key
