"""Quantizer placement on the traced graph, by a runtime profile: :func:`place` runs the passes.

Input: the OpGraph of one forward pass (quantization/placement/trace.py) and a RuntimeProfile
(quantization/placement/runtimes.py). Output: a :class:`~quantization.placement.records.Placement`,
plain data saved with the model (what it holds: quantization/placement/records.py). The passes
here place each op's inputs by its kind, the outputs the runtime wants quantized and the
pass-through ops' shared quantizers, then assign one quantizer id per group of tensors; the
integer-chain passes are in quantization/placement/integer_chains.py, the fidelity guards they all
apply in quantization/placement/fidelity_guards.py, the state they share in
quantization/placement/placer_state.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from compress.quantization.placement import fidelity_guards as guards
from compress.quantization.placement.cost_table import CostTable
from compress.quantization.placement.graph_patterns import output_tensors, weighted_operands
from compress.quantization.placement.integer_chains import IntegerChains
from compress.quantization.placement.records import Placement, WeightUse, new_constant, new_internal
from compress.quantization.placement.runtimes import RuntimeProfile
from compress.quantization.placement.trace import Operand, OpGraph, OpNode


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
    float_ops: Mapping[str, str] | None = None,
    serving_batch: int = 1,
    cost_table: CostTable | None = None,
    example_batch: int | None = None,
) -> Placement:
    """Place quantizers on ``graph`` for ``profile``.

    ``targeted(scope)``: whether ops running in that module are to be quantized (targets/ignore);
    ``swapped``: names of layers swapped for quantized modules (they quantize their own weight);
    ``skip_layers``: layers kept float on purpose (first/last policy, measured placement), not quantized
    at all, mapped to the reason recorded in ``floats``;
    ``embeddings``: give embedding tables int8 weight quantizers; ``tied``: parameter name -> the
    swapped layer whose weight it also is (a tied embedding reads that layer's quantized weight).

    The passes, in order (:class:`_Placer`, :class:`IntegerChains`): each op's inputs by its kind
    (embedding tables, weighted ops, attention, adds, concats, matmuls, the rest), the outputs the runtime wants
    quantized, pass-through ops sharing their neighbours' quantizers, products whose output is
    quantized anyway given quantized operands where one 8-bit scale holds them, elementwise ops
    extended into integer chains, chains with no integer kernel on either side returned to float,
    then one quantizer id per group of tensors.

    ``float_ops``: attention calls (op keys: an SDPA call, a product of two activations) kept float,
    mapped to the reason recorded in ``floats``; their operands are not quantized for them.

    ``serving_batch``: the largest batch the model will be served at; ``cost_table`` (the target's,
    None for none) prices an elementwise chain beside integer kernels at that batch, on codes against in
    float (the traced call's batch is ``example_batch``); without a table, below
    :data:`~quantization.placement.integer_chains.FLOAT_WRITER_BATCH`, a Linear whose codes only an
    elementwise chain reads does not keep that chain on codes (it writes float instead).

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
                     quantize_ops=quantize_ops, embeddings=embeddings, tied=tied or {}, float_ops=float_ops or {},
                     serving_batch=serving_batch, cost_table=cost_table, example_batch=example_batch)
    for n in placer.nodes:
        if n.key not in placer.inside:
            placer.op(n)
    placer.output_quantizers()
    placer.pass_through()
    placer.integer_products()
    placer.extend_chains()
    placer.float_islands()
    placer.assign_ids()
    placer.report_unquantized()
    return placer.pl


class _Placer(IntegerChains):
    """:func:`place`'s passes but the integer chains (:class:`IntegerChains`), on the state they share
    (:class:`~quantization.placement.placer_state.PlacerState`)."""

    # ---- pass 1: each op's inputs, by kind ----------------------------------------------------
    def op(self, n: OpNode) -> None:
        pl, profile = self.pl, self.profile
        if n.kind == "embedding":
            self.embedding(n)
            return
        # a mean over an image's spatial dims is a global average pool (trace.py), placed as one
        rule = profile.rules.get("avg_pool" if n.kind == "mean" and n.attrs.get("global_pool") else n.kind)
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
        if n.key in self.float_ops:
            pl.floats[n.key] = self.float_ops[n.key]
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
            phase = guards.phase_error(n, self.consumers.get(f"{n.key}/0", []))
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
        if guards.feeds_topk(n, self.producers, self.consumers, self.weighted_keys):
            pl.floats[n.key] = guards.ROUTER_REASON
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
            if len(cons) == 1 and _foldable(cons[0][0], self.profile) and out not in output_tensors(self.graph):
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
            lopsided = guards.lopsided([ranges["scores"], ranges["mask"]])
            if lopsided:
                self.pl.floats[f"{n.key}.mask"] = lopsided
            else:
                roles += ["scores", "mask", "biased"] + (["qk"] if integer else [])
        elif integer:
            roles += ["qk", "scores"]
        entry = self.pl.entries.setdefault(n.key, {})
        entry.update({p: new_internal(self.pl, f"{n.key}.{p}") for p in roles})
        if "qk" in roles:  # the score scale: a one-value constant, which one 8-bit code holds exactly
            entry["scale"] = new_constant(self.pl, f"{n.key} score scale")

    def add_inputs(self, n: OpNode, rule: Any, acts: list[Operand]) -> list[Operand]:
        """The operands of an add to quantize (none: it stays float, or was handled here)."""
        pl = self.pl
        out_shape = n.out_shapes[0] if n.out_shapes else ()
        same = [o for o in acts if o.shape == out_shape]
        if len(n.operands) != 2 or len(same) != 2:
            if n.scope in self.swapped:  # a quantized layer's own arithmetic (a QAT conv's BatchNorm bias)
                return []
            lopsided = guards.lopsided(n.attrs.get("amax", []))
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
            pl.floats[n.key] = guards.RETURNED_REASON
            return []
        outlier = guards.outlier_operand(n.attrs)
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
                if len(cons) == 1 and _foldable(cons[0][0], self.profile) and t not in output_tensors(self.graph) \
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

    # ---- pass 5: one quantizer id per group, read by every consumer of its tensors --------------
    def assign_ids(self) -> None:
        pl = self.pl
        ids: dict[str, str] = {}
        model_outputs = output_tensors(self.graph)
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


def _foldable(n: OpNode, profile: RuntimeProfile) -> bool:
    if n.kind not in profile.fold:
        return False
    if n.kind == "relu6":
        return n.attrs.get("min") == 0
    return True


def _order(nodes: list[OpNode]) -> Callable[[str], tuple[int, str]]:
    index = {n.key: i for i, n in enumerate(nodes)}

    def key(t: str) -> tuple[int, str]:
        if t.startswith("<"):
            return (-1, t)
        return (index.get(t.rsplit("/", 1)[0], len(index)), t)

    return key
