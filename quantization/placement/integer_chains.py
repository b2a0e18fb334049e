"""The placement's integer-chain passes (quantization/placement/place.py runs them): products whose
output is quantized anyway get quantized operands where one 8-bit scale holds them (RMSNorm's
``x * rsqrt(var + eps) * weight``, rotary's products, SwiGLU's ``silu(gate) * up``), so the runtime
runs them as QLinearMul, elementwise ops whose inputs are all quantized extend into integer
chains, and a chain with no integer kernel on either side returns to float. The fidelity bars they
apply live in quantization/placement/fidelity_guards.py."""

from __future__ import annotations

import math

from compress.quantization.placement import fidelity_guards as guards
from compress.quantization.placement.cost_table import CostTable
from compress.quantization.placement.model_cost import dequantize_us, elementwise_us, quantize_us, scale_shape
from compress.quantization.placement.placer_state import PlacerState, TensorGroups
from compress.quantization.placement.records import new_internal
from compress.quantization.placement.trace import Operand, OpNode

#: why a chain with no integer kernel beside it returns to float (pass 4b)
ISLAND_REASON = ("elementwise op between float ops (no integer kernel makes its inputs or reads its output): on codes "
                 "it would add a quantize before it and a dequantize after it")

#: how deep a product's operands are followed back through integer-kernel ops (RMSNorm's two
#: products, SiLU's gate): the chains that pay off are short
PRODUCT_DEPTH = 3

#: without a cost table for the target: the serving batch from which an elementwise chain stays on
#: codes next to a Linear that could write float instead: there its int8 kernels, reading and writing a
#: quarter of the bytes, beat float ones and the dequantization after them, where below it each extra
#: node's fixed cost weighs more. Measured pairwise (Intel Xeon, AVX-512 VNNI, ORT 1 thread): at batch 1
#: such chains in float ran the windowed-attention model 1.52x -> 1.58x of fp32 and Llama 0.99x -> 1.03x
#: (its rotary products); at batch 32 Swin's residual adds in float ran it 2.05x -> 1.96x, Llama level at
#: 2.52x (benchmarks/RESULTS.md). With a table the chain is priced instead (:meth:`IntegerChains._priced`):
#: the same question asked in elements, so text at 8 x 64 tokens and images at batch 1 are answered alike
FLOAT_WRITER_BATCH = 16


class IntegerChains(PlacerState):
    """Passes 4, 4a and 4b of :func:`quantization.placement.place.place`, on the state they share."""

    # ---- pass 4: elementwise ops whose inputs are all quantized by now run as integer kernels too
    # (a chain extends one op at a time, in graph order); their output gets a quantizer. A product's
    # other operand may be a constant (attention's ``q * scale``, a Python number, a layer scale): it
    # gets a quantizer of its own (ORT's QLinearMul reads it as a quantized initializer) where one
    # 8-bit scale holds it (guards.holds: a per-channel layer scale that spans decades stays float)
    def extend_chains(self) -> None:
        for n in self.nodes:
            kind = n.func if n.kind in ("act", "softmax") else n.kind  # hardsigmoid, leaky_relu: by their call
            if kind not in self.profile.extend or not self.targeted(n.scope) or not self.quantize_ops \
                    or n.key in self.inside:
                continue
            acts = self._acts(n)
            arity = 2 if kind == "mul" else 1
            out = f"{n.key}/0"
            if len(n.operands) != arity or not acts or not self.consumers.get(out):
                continue
            consts = [o for o in n.operands if o not in acts]
            if consts and (any(not o.floating or not guards.holds(n, o) for o in consts) or len(acts) != 1):
                continue
            if not all(self.on_grid(o) for o in acts) and not (
                    any(math.prod(o.shape) > 1 for o in consts) and self.pull_onto_grid(acts[0]) and self.on_grid(acts[0])):
                continue
            self.groups.add(out)
            self.quantized.add(out)
            for o in consts:
                self.pl.entries.setdefault(n.key, {})[str(o.position)] = self.constant_quantizer(n, o)
            if kind in ("silu", "hardswish"):  # run as x * q(gate(x)): a QLinearMul with a quantized gate
                self.pl.entries.setdefault(n.key, {})["g"] = new_internal(self.pl, f"{n.key}.g")

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
            src = self._acts(prod)
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
        acts = self._acts(n)
        consts = [o for o in n.operands if o not in acts]
        if not acts or any(not o.floating for o in consts):
            return ""
        for o in consts:
            if not guards.holds(n, o):
                sq = n.attrs.get("const_sqnr", [])
                db = sq[o.position] if o.position < len(sq) else None
                return (f"its constant operand {o.name or o.position} keeps {guards.sqnr_text(db)} under one 8-bit scale "
                        f"(< {guards.CONSTANT_MIN_SQNR:.0f} dB): the product stays float")
        off = [o for o in acts if not self.grid_known(o)]
        if not off:
            return []
        plan: list[str] = []
        need: list[Operand] = []
        for o in off:
            why = guards.unheld(n, o)
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
            src = self._acts(prod)
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
            if guards.unheld(prod, inner) is None:
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
            src = self._acts(prod)
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
        src = self._acts(prod)
        if len(src) != 1 or not self.on_grid(src[0]):
            return False
        self.groups.union(str(src[0].tensor_id), t)
        self.quantized.add(t)
        return True

    # ---- pass 4b: a chain of elementwise integer ops with no integer kernel on either side (its
    # inputs made by float ops or the model, its outputs read by float ops only) returns to float:
    # on codes it pays a QuantizeLinear on each way in and a DequantizeLinear on each way out for
    # elementwise work ORT's integer kernels do no faster. LeViT's attention-bias add and softmax,
    # between a scores product and a weighted sum the cost table kept float, ran as QuantizeLinear,
    # QLinearAdd, QLinearSoftmax and DequantizeLinear; its QLinearSoftmax alone took 167 us where the
    # float file's Softmax took 83 (small suite, batch 32, Intel Xeon, profiled in ORT). Concats on
    # codes are chain members. A chain with integer kernels beside it is priced where the target has a
    # cost table (:meth:`_priced`); without one, below FLOAT_WRITER_BATCH a Linear or product whose
    # codes only the chain reads counts as a float maker (:meth:`_writes_codes`)
    def float_islands(self) -> None:
        if not self.quantize_ops:
            return
        ew = {n.key: n for n in self.nodes if self._elementwise_on_codes(n) or self._cat_on_codes(n)}
        links = TensorGroups()
        first_reader: dict[str, str] = {}
        for key, n in ew.items():
            links.add(key)
            for o in self._acts(n):
                root = self._root(o)
                if root.source == "op" and str(root.producer) in ew:
                    links.union(key, str(root.producer))
                elif root.tensor_id is not None:
                    # chains reading one tensor's codes are decided together: each would otherwise
                    # keep the others on codes as integer readers of it (rotary's cos and sin, read
                    # by every layer's products)
                    links.union(key, first_reader.setdefault(root.tensor_id, key))
        chains: dict[str, list[OpNode]] = {}
        for key, n in ew.items():
            chains.setdefault(links.find(key), []).append(n)
        for chain in chains.values():
            decided = self._island(chain, ew)
            if decided is not None:
                self._to_float(chain, *decided)

    @staticmethod
    def _acts(n: OpNode) -> list[Operand]:
        """``n``'s floating activation operands (ops' outputs and model inputs)."""
        return [o for o in n.operands if o.source in ("op", "input") and o.floating]

    def _elementwise_on_codes(self, n: OpNode) -> bool:
        kind = n.func if n.kind in ("act", "softmax") else n.kind
        add = self.profile.rules.get("add")
        if not (kind in self.profile.extend or (kind == "add" and add is not None and add.output)):
            return False
        if n.key in self.weighted_keys or n.key in self.inside or n.key in self.pl.floats:
            return False
        acts = self._acts(n)
        return f"{n.key}/0" in self.quantized and bool(acts) and all(self.grid_known(o) for o in acts)

    def _cat_on_codes(self, n: OpNode) -> bool:
        """A concat the runtime requantizes on codes (ORT's QLinearConcat): data movement that joins
        the chain it sits in (rotary's ``rotate_half``), on codes or in float with it."""
        if n.kind != "cat" or not self._requantizes_cats():
            return False
        if n.key in self.inside or n.key in self.pl.floats or f"{n.key}/0" not in self.quantized:
            return False
        acts = self._acts(n)
        return bool(acts) and all(self.grid_known(o) for o in acts)

    def _requantizes_cats(self) -> bool:
        rule = self.profile.rules.get("cat")
        return rule is not None and rule.output and not rule.shared

    def _writes_codes(self, n: OpNode) -> bool:
        """Whether integer kernel ``n`` writes codes: QLinearConv, QLinearAdd, QLinearConcat, a pool and
        an int8 gather do; ORT's MatMulIntegerToFloat and QGemm write float at no cost (rules with no
        ``output``: Linear, addmm, products, attention)."""
        rule = self.profile.rules.get(n.kind)
        return rule is None or rule.output

    def _root(self, o: Operand) -> Operand:
        """The operand whose codes ``o`` reads, before pass-through ops on quantized tensors."""
        while o.source == "op":
            prod = self.producers.get(str(o.producer))
            if prod is None or not self.passes(prod) or prod.key in self.inside:
                break
            src = self._acts(prod)
            if len(src) != 1 or src[0].tensor_id not in self.quantized:
                break
            o = src[0]
        return o

    def _readers(self, t: str, path: list[str]) -> list[tuple[OpNode, Operand]]:
        """The ops reading tensor ``t``'s codes, through pass-through ops whose outputs are quantized
        (their tensors appended to ``path``)."""
        out: list[tuple[OpNode, Operand]] = []
        for n, o in self.consumers.get(t, []):
            nxt = f"{n.key}/0"
            if self.passes(n) and n.key not in self.inside and nxt in self.quantized:
                path.append(nxt)
                out += self._readers(nxt, path)
            else:
                out.append((n, o))
        return out

    def _on_codes(self, n: OpNode, ew: dict[str, OpNode]) -> bool:
        """Whether ``n`` runs as an integer kernel on the codes of its quantized inputs."""
        if n.key in ew:
            return True
        if n.key in self.pl.floats or n.key in self.inside:
            return False
        if n.kind == "embedding":  # a gather from an int8 table reads codes
            return n.key in self.pl.entries
        if n.kind == "cat" and self._requantizes_cats():  # QLinearConcat only with its output quantized
            return self._cat_on_codes(n)
        pool = n.kind == "avg_pool" or (n.kind == "mean" and bool(n.attrs.get("global_pool")))
        if n.key not in self.weighted_keys and n.kind not in ("matmul", "sdpa", "cat") and not pool:
            return False
        if n.kind == "sdpa":  # quantizes its own inputs where it is not kept float
            return True
        acts = self._acts(n)
        return bool(acts) and any(self.grid_known(o) for o in acts)

    def _island(self, chain: list[OpNode], ew: dict[str, OpNode]) -> tuple[list[str], str] | None:
        """The quantized tensors of ``chain`` and around it to drop, and why, where the chain returns to
        float: no integer kernel writes its inputs or reads its outputs, or the cost table prices it
        faster in float with the ones that do (:meth:`_priced`); None where it stays on codes. Tensors an
        integer kernel writes as codes or reads stay quantized either way."""
        keys = {n.key for n in chain}
        drop: list[str] = []
        bill = _Bill()
        seen: set[str] = set()
        beside = 0  # integer kernels writing the chain's inputs or reading its outputs

        def readers(t: str) -> tuple[bool, bool, list[str]]:
            # (read by an integer kernel outside the chain, read by a float op outside it, the tensors
            # from t through pass-through ops)
            path = [t]
            rs = [m for m, _ in self._readers(t, path) if m.key not in keys]
            on = [self._on_codes(m, ew) for m in rs]
            return any(on), not all(on), path

        for n in chain:
            for o in self._acts(n):
                root = self._root(o)
                t = str(root.tensor_id)
                if (root.source == "op" and str(root.producer) in keys) or t in seen:
                    continue
                seen.add(t)
                prod = self.producers.get(str(root.producer)) if root.source == "op" else None
                writer = prod is not None and self._on_codes(prod, ew)
                read_int, _, path = readers(t)
                if read_int or (writer and prod is not None and self._writes_codes(prod)):
                    beside += 1
                    bill.add("float", "dequantize", root.shape)  # in float the chain reads DQ(codes)
                    continue
                drop.extend(path)
                if writer and (self.cost_table is not None or self.serving_batch >= FLOAT_WRITER_BATCH):
                    # a Linear or product whose codes only the chain reads: its output quantizer fuses into
                    # the integer kernel, and in float it writes float instead; free either way
                    beside += 1
                elif not writer:
                    bill.add("codes", "quantize", root.shape)
            out = f"{n.key}/0"
            read_int, read_float, path = readers(out)
            if read_int:  # stays quantized for its integer readers; in float a QuantizeLinear writes it
                beside += 1
                bill.add("float", "quantize", n.out_shapes[0] if n.out_shapes else ())
            else:
                drop.extend(path)
                if read_float:
                    bill.add("codes", "dequantize", n.out_shapes[0] if n.out_shapes else ())
            bill.op(n)
        if not beside:
            return drop, ISLAND_REASON
        priced = self._priced(bill, len(chain))
        return (drop, priced) if priced is not None else None

    def _priced(self, bill: _Bill, ops: int) -> str | None:
        """Why a chain with integer kernels beside it returns to float: the cost table prices its ops'
        integer and float kernels (the ``add`` and ``mul`` rows; other ops cost alike) and the
        quantizes and dequantizes each placement adds at the serving batch, and float is cheaper;
        None where codes are, or without a table."""
        table = self.cost_table
        if table is None:
            return None
        codes, flt = bill.total(table, self.serving_batch, self.example_batch)
        if flt >= codes:
            return None
        return (f"elementwise chain of {ops} op{'s' if ops > 1 else ''} priced faster in float at batch "
                f"{self.serving_batch}: {flt:.0f} us in float ({bill.describe('float')}) vs {codes:.0f} us on codes "
                f"({bill.describe('codes')}), by {table.named}")

    def _to_float(self, chain: list[OpNode], drop: list[str], reason: str) -> None:
        self.quantized.difference_update(drop)
        pl = self.pl
        gone: set[str] = set()
        for n in chain:
            gone.update(pl.entries.pop(n.key, {}).values())  # constant operands' quantizers, a gate's
            pl.floats[n.key] = reason
        used = {q for e in pl.entries.values() for q in e.values()}
        for qid in gone - used:
            pl.activations.pop(qid, None)
        for name in [k for k, v in self.by_param.items() if v in gone - used]:
            del self.by_param[name]


class _Bill:
    """What an elementwise chain costs on codes and in float beyond what both placements share: its
    add and product kernels, and the quantizes and dequantizes at its edges, each as (what, the
    tensor's traced shape), priced by :meth:`total` against a cost table at the serving batch."""

    def __init__(self) -> None:
        self.items: dict[str, list[tuple[str, tuple[int, ...]]]] = {"codes": [], "float": []}

    def add(self, side: str, what: str, shape: tuple[int, ...]) -> None:
        self.items[side].append((what, tuple(shape)))

    def op(self, n: OpNode) -> None:
        if n.kind not in ("add", "mul"):
            return  # softmax, sigmoid, concat: no rows, priced alike on both sides
        shapes = [tuple(o.shape) for o in n.operands if o.shape] + [tuple(s) for s in n.out_shapes[:1]]
        shape = max(shapes, key=math.prod, default=())
        self.add("codes", n.kind, shape)
        self.add("float", n.kind, shape)

    def total(self, table: CostTable, batch: int, example_batch: int | None) -> tuple[float, float]:
        """Microseconds on codes and in float."""
        def us(side: str, what: str, traced: tuple[int, ...]) -> float:
            shape = scale_shape(traced, batch, example_batch)
            if what == "quantize":
                return quantize_us(table, shape)
            if what == "dequantize":
                return dequantize_us(table, shape)
            got = elementwise_us(table, what, math.prod(shape))
            return 0.0 if got is None else got[1 if side == "codes" else 0]
        codes, flt = (sum(us(side, w, shape) for w, shape in self.items[side]) for side in ("codes", "float"))
        return codes, flt

    def describe(self, side: str) -> str:
        counts: dict[str, int] = {}
        for what, _ in self.items[side]:
            counts[what] = counts.get(what, 0) + 1
        return ", ".join(f"{v} {w}" for w, v in counts.items()) or "nothing"
