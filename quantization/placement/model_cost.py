"""The model-level check of the cost table's placement: is the int8 model, as a whole, predicted
faster than fp32 at the batch sizes it will be served at?

A layer row of the cost table (cost_table.py) compares one layer's kernels between int8 neighbours.
A whole model also pays what no layer row holds, and at small shapes that decides: a digits ResNet
of width 16 (8x8 images, 16-64 channels; the quickstart's before it was widened to 64) ran its int8
ONNX at 0.84x fp32 at batch 1 and 1.5x at batch 32 (benchmarks/RESULTS.md, ``cost_table``), its
kernels about level at batch 1 while the int8 graph added the input's QuantizeLinear, ORT's NCHW ->
NHWC transposes around the QLinearConv chain, the DequantizeLinear where it left int8, and three
QLinearAdd nodes for residual adds that fp32 ORT fuses into the conv before them. This module walks
the traced graph at each requested batch, sums the layer rows and the table's ``boundary`` rows
(measured by benchmarks/cost_table.py: entering and leaving int8 by element count, float Add against
QLinearAdd) on each side, and predicts both models' cost. Attention on int8 codes is priced from the
table's ``matmul`` rows (QLinearMatMul against MatMul for the scores and the weighted sum, plus
quantizing the softmax output) where the table has them; embeddings stay float gathers on both
sides. Nothing is timed: the same model, table and batch sizes give the same answer.

:func:`decide` compares the placement the layer rows chose, the same with the layers that lose at a
requested batch kept float too, and the whole model float (exactly fp32's cost), and keeps the one
whose slowest requested batch is fastest: int8 is kept only where it is predicted faster than fp32 at
every batch asked for. That is a prediction; placement applies a whole-model-float answer only with
``model_check="float"`` (quantization/preparation.py); by default (``"auto"``) only where a batch it
is predicted slower at is :data:`TRUSTED_BATCH` or more, and at smaller batches logs it, because at
batch 1 on small models the rows predict int8 slower than it runs (RESULTS.md, ``export_int8_quickstart``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from compress.quantization.placement.cost_table import CostTable, layer_shape, slower_by_table
from compress.quantization.placement.speed_check import LayerCall, layer_calls
from compress.quantization.placement.trace import Operand, OpGraph, OpNode
from torch import nn

log = logging.getLogger(__name__)

#: ops whose output is int8 where their one activation input is (ORT folds BN and ReLU into the
#: QLinearConv before them; reshapes, pools and pads run on the codes)
_KEEP = frozenset({"relu", "relu6", "batch_norm", "reshape", "max_pool", "dropout", "pad"})
#: ops that stay int8 where all their activation inputs are (QLinearConcat, QLinearMatMul, QLinearMul,
#: attention on codes); their own cost is counted alike on both sides, so not at all
_JOIN = frozenset({"cat", "matmul", "sdpa", "mul"})


@dataclass(frozen=True)
class ModelCost:
    """Predicted microseconds of the fp32 and the int8 model at ``batch``, and their parts."""

    batch: int
    layers_float_us: float
    layers_int8_us: float
    boundary_us: float
    adds_float_us: float
    adds_int8_us: float
    entries: int
    exits: int
    adds: int
    other_float_us: float = 0.0  # layers kept float in the int8 model (their float cost, both sides)
    #: attention's products of two activations on int8 codes (QLinearMatMul) and the quantization of
    #: the softmax output they read, against float MatMul
    matmul_float_us: float = 0.0
    matmul_int8_us: float = 0.0
    matmuls: int = 0
    float_attention: int = 0  # attention calls kept float (float_ops): alike on both sides

    @property
    def float_us(self) -> float:
        return self.layers_float_us + self.adds_float_us + self.other_float_us + self.matmul_float_us

    @property
    def int8_us(self) -> float:
        return self.layers_int8_us + self.boundary_us + self.adds_int8_us + self.other_float_us + self.matmul_int8_us

    @property
    def speedup(self) -> float:
        return self.float_us / max(self.int8_us, 1e-9)

    def describe(self) -> str:
        return (f"int8 {self.int8_us:.0f} us vs fp32 {self.float_us:.0f} us ({self.speedup:.2f}x): int8 layers "
                f"{self.layers_int8_us:.0f} us where float runs them in {self.layers_float_us:.0f}, entering/leaving "
                f"int8 {self.boundary_us:.0f} us ({self.entries} entries, {self.exits} exits), {self.adds} integer adds and products "
                f"{self.adds_int8_us:.0f} us where float pays {self.adds_float_us:.0f} us"
                + (f", {self.matmuls} attention products {self.matmul_int8_us:.0f} us where float pays "
                   f"{self.matmul_float_us:.0f} us" if self.matmuls else ""))


def _scale(shape: Sequence[int], batch: int, example_batch: int | None) -> list[int]:
    out = list(shape)
    if example_batch and out and out[0] % example_batch == 0:
        out[0] = out[0] // example_batch * batch
    return out


#: what a softmax output passes through on its way to the weighted sum (eval-mode dropout, a head mask)
_TO_PRODUCT = frozenset({"dropout", "reshape", "mul"})


def _net(table: CostTable, us: float, nodes: int) -> float:
    # the rows are profiled per node; the profiler adds its own cost to each (about 1.7 us on a trivial
    # node that runs in 0.2-0.3 us here), which at batch 1 is most of a small kernel's time
    return max(us - nodes * table.profile_overhead_us, 0.1 * us)


def _quantize_us(table: CostTable, elements: float) -> float:
    """Quantizing ``elements`` float values into int8 (one QuantizeLinear node): the ``enter:linear`` row."""
    return _net(table, (table.boundary_us("enter:linear", elements) or (0.0, 0.0))[1], 1)


def scale_shape(shape: Sequence[int], batch: int, example_batch: int | None) -> list[int]:
    """A traced tensor's shape at ``batch`` (the traced call had ``example_batch``)."""
    return _scale(shape, batch, example_batch)


def _edge_us(table: CostTable, side: str, shape: Sequence[int]) -> float:
    # one QuantizeLinear or DequantizeLinear node: the ``:linear`` rows (a conv region's NHWC transposes,
    # in the ``:conv`` rows, are the region's, paid whether or not an elementwise op beside it is on codes)
    return _net(table, (table.boundary_us(f"{side}:linear", float(math.prod(shape))) or (0.0, 0.0))[1], 1)


def quantize_us(table: CostTable, shape: Sequence[int]) -> float:
    """Quantizing a float tensor of ``shape`` into int8 codes, by the table's ``enter`` rows."""
    return _edge_us(table, "enter", shape)


def dequantize_us(table: CostTable, shape: Sequence[int]) -> float:
    """Dequantizing int8 codes of ``shape`` back to float, by the table's ``leave`` rows."""
    return _edge_us(table, "leave", shape)


def elementwise_us(table: CostTable, kind: str, elements: float) -> tuple[float, float] | None:
    """``(float_us, int8_us)`` of one ``add`` or ``mul`` node writing ``elements`` values (Add against
    QLinearAdd, Mul against QLinearMul), less the profiler's cost per node; None without rows."""
    got = table.boundary_us(kind, elements)
    return None if got is None else (_net(table, got[0], 1), _net(table, got[1], 1))


def _attention_operands(n: OpNode) -> list[Operand]:
    want = {"matmul": 2, "sdpa": 3, "softmax": 1}[n.kind]
    ops = sorted((o for o in n.operands if o.position < want and o.source in ("op", "input") and o.floating
                  and o.shape and o.tensor_id is not None), key=lambda o: o.position)
    return ops if len(ops) == want else []


def _softmax_of(graph: OpGraph, o: Operand) -> OpNode | None:
    """The softmax ``o`` was made by (through eval-mode dropout, reshapes, a head mask), if one was."""
    node = graph.nodes.get(str(o.producer)) if o.source == "op" else None
    while node is not None and node.kind in _TO_PRODUCT:
        src = next((p for p in node.operands if p.source == "op" and p.floating), None)
        node = graph.nodes.get(str(src.producer)) if src is not None else None
    return node if node is not None and node.kind == "softmax" else None


#: the share of subnormal softmax outputs (trace.subnormal_share) from which attention stays on int8
#: codes whatever the ``matmul`` rows say: Swin's shifted windows add a finite -100 mask, and 23-43%
#: of their float probabilities are subnormal; ORT's float Softmax then ran 7x and the weighted-sum
#: MatMul 20x slower than on the unshifted blocks of the same shape (21.4 / 2.9 ms and 84 / 4.3 ms
#: at Swin's serving width, Intel Xeon), and the model with int8 attention 1.69x fp32 against 1.29-1.34x
#: with it float (benchmarks/RESULTS.md, ``real_models``). Quantized probabilities have no subnormals.
SUBNORMAL_SHARE = 0.01

#: how much slower the ``matmul`` rows must price attention on int8 codes than in float before it
#: stays float: their own repeatability. The shipped Intel table measured the same shape twice at
#: 1.21x and 0.94x, and a shape of BERT's remeasured moved from 0.85x to 1.11x. Set between what
#: the suites measured (benchmarks/RESULTS.md, ``real_models``): toy-width attention the rows price
#: 1.2-1.6x slower ran faster float, by 1-15% of the model; BERT's at serving width, priced 1.17x
#: slower, ran 4-10% faster on codes.
ATTENTION_MARGIN = 1.2


def subnormal_softmax(graph: OpGraph, n: OpNode) -> float:
    """The share of subnormal float softmax outputs attention call ``n`` computes or reads."""
    if n.kind == "sdpa":
        return float(n.attrs.get("subnormal", 0.0))
    sm = [s for o in _attention_operands(n) if (s := _softmax_of(graph, o)) is not None]
    return max((float(s.attrs.get("subnormal", 0.0)) for s in sm), default=0.0)


def attention_us(graph: OpGraph, n: OpNode, table: CostTable, *, batch: int,
                 example_batch: int | None) -> tuple[float, float, int, float] | None:
    """``(float_us, int8_us, products, softmax elements)`` of an attention call ``n`` (an SDPA call, or
    a product of two activations) at ``batch``: its products as MatMul against QLinearMatMul (the
    table's ``matmul`` rows), and how many softmax outputs the int8 form quantizes for the weighted
    sum (SDPA's, or a product operand a softmax made); None where ``n`` is not one or the table has
    no rows."""
    if n.kind not in ("matmul", "sdpa") or not table.prices_attention:
        return None
    ops = _attention_operands(n)
    if not ops:
        return None
    shapes = [_scale(o.shape, batch, example_batch) for o in ops]
    quantized = 0.0
    if n.kind == "matmul":
        a, b = shapes
        products = [(float(math.prod(a[:-2])), a[-2] if len(a) > 1 else 1, a[-1], b[-1])]
        quantized = sum(float(math.prod(s)) for o, s in zip(ops, shapes, strict=True) if _softmax_of(graph, o))
    else:
        q, k, v = shapes
        bh, length, keys = float(math.prod(q[:-2])), q[-2], k[-2]
        products = [(bh, length, q[-1], keys), (bh, length, keys, v[-1])]
        quantized = bh * length * keys
    fl = i8 = 0.0
    for shape in products:
        got = table.matmul_us(*(float(f) for f in shape)) or (0.0, 0.0)
        fl += _net(table, got[0], 1)
        i8 += _net(table, got[1], 1)
    return fl, i8, len(products), quantized


def slower_attention(graph: OpGraph, table: CostTable, *, batches: Sequence[int],
                     example_batch: int | None) -> dict[str, str]:
    """``{op key: reason}`` for the attention calls (SDPA, products of two activations) whose
    integer form the table's ``matmul`` rows price slower than float at one of ``batches``: the
    placement keeps them float (their inputs are not quantized for them). The per-layer rule of the
    cost table, for attention: on the Intel Xeon's table QLinearMatMul lost to MatMul at 27 of 36
    attention shapes, and keeping such calls float ran the small suite's six attention models
    1.01-1.58x fp32 where they ran 0.94-1.37x with int8 attention (benchmarks/RESULTS.md,
    ``real_models``). Only a loss past the rows' repeatability counts (:data:`ATTENTION_MARGIN`), and
    a call whose float softmax is subnormal-heavy (:data:`SUBNORMAL_SHARE`) stays int8."""
    slow: dict[str, str] = {}
    if not table.prices_attention:
        return slow
    for n in graph.nodes.values():
        if n.kind in ("matmul", "sdpa") and subnormal_softmax(graph, n) >= SUBNORMAL_SHARE:
            continue
        for b in batches:
            got = attention_us(graph, n, table, batch=b, example_batch=example_batch)
            if got is None:
                break
            fl, i8, products, quantized = got
            if quantized:
                i8 += _quantize_us(table, quantized)
            if i8 >= fl * ATTENTION_MARGIN:
                what = f"{products} product{'s' if products > 1 else ''} of activations" + (
                    f" and quantizing {quantized:.0f} softmax outputs" if quantized else "")
                slow[n.key] = (f"kept float by {table.named} at batch {b}: {what} predicted "
                               f"{i8:.0f} us on int8 codes vs {fl:.0f} us in float (QLinearMatMul vs MatMul rows)")
                break
    if slow:
        log.info("%s: %d attention calls keep float", table.named, len(slow))
    return slow


def model_cost(graph: OpGraph, layers: Mapping[str, nn.Module], int8: set[str], table: CostTable, *, batch: int,
               example_batch: int | None, float_ops: Collection[str] = ()) -> ModelCost:
    """The predicted cost of ``graph``'s model at ``batch`` (the traced batch is ``example_batch``)
    with the layers ``int8`` of ``layers`` quantized and the others float, and the attention calls
    ``float_ops`` (op keys) float; ops other than layers, adds and attention cost the same in both
    models and are left out."""
    region: dict[str, str] = {}  # int8 tensor -> its layout ("conv": NHWC codes, "linear")
    conv_out: set[str] = set()  # made by a conv (through BN): fp32 ORT fuses an add after it into the conv
    paid: set[str] = set()
    lf = li = other = bd = af = ai = mf = mi = 0.0
    entries = exits = adds = mm = kept = 0

    def net(us: float, nodes: int) -> float:
        return _net(table, us, nodes)

    def elements(shape: Sequence[int]) -> float:
        return float(math.prod(_scale(shape, batch, example_batch)))

    def boundary(kind: str, shape: Sequence[int]) -> float:
        got = table.boundary_us(kind, elements(shape))
        # entering or leaving a conv chain is two nodes (QuantizeLinear and the NHWC transpose, or the
        # transpose back and DequantizeLinear); a Linear's one
        return net(got[1], 2 if kind.endswith(":conv") else 1) if got is not None else 0.0

    def leave(t: str | None, shape: Sequence[int]) -> None:
        nonlocal bd, exits
        if t is not None and t in region and f"leave {t}" not in paid:
            paid.add(f"leave {t}")
            bd += boundary(f"leave:{region[t]}", shape)
            exits += 1

    def attention(n: OpNode, out: str) -> None:
        # as placement runs it: a product of two activations or an SDPA call not kept float quantizes
        # its operands (those not int8 already enter it) and runs on codes, SDPA quantizing its softmax
        # output inside; a softmax on int8 scores quantizes its output for the weighted sum
        nonlocal mf, mi, mm, bd, entries, kept
        ops = _attention_operands(n)
        if n.kind == "softmax":
            if ops and ops[0].tensor_id in region:
                bd += boundary("enter:linear", ops[0].shape)
                entries += 1
                region[out] = "linear"
            return
        got = attention_us(graph, n, table, batch=batch, example_batch=example_batch) if n.key not in float_ops else None
        kept += n.key in float_ops
        if got is None:
            for o in ops:
                leave(o.tensor_id, o.shape)
            return
        for o in ops:
            if o.tensor_id not in region and f"enter {o.tensor_id}" not in paid:
                paid.add(f"enter {o.tensor_id}")
                bd += boundary("enter:linear", o.shape)
                entries += 1
        fl, i8, products, quantized = got
        if n.kind == "sdpa":
            bd += _quantize_us(table, quantized)
            entries += 1
        mf, mi, mm = mf + fl, mi + i8, mm + products
        region[out] = "linear"

    for n in graph.nodes.values():
        acts = [o for o in n.operands if o.source in ("op", "input") and o.floating and o.shape]
        ids = [t for t in (o.tensor_id for o in acts) if t is not None]  # acts are ops' outputs or model inputs
        out = f"{n.key}/0"
        if n.kind in ("linear", "conv") and n.scope in layers:
            mod = layers[n.scope]
            data = next((o for o in n.operands if o.position == 0), None)
            key = layer_shape(mod, _scale(data.shape, batch, example_batch)) if data is not None and data.shape else None
            row = table.nearest(key) if key is not None else None
            # the nearest row's times scaled by the work (the product of the shape features: rows x in x
            # out, channels x kernel x pixels) from its shape to this one: the grid is coarse, and a sum
            # over a model needs each layer's time, not only its ratio
            work = math.prod(key.features) / max(math.prod(row.shape.features), 1.0) if key is not None and row else 0.0
            bias = 0.0
            if isinstance(mod, nn.Linear) and mod.bias is not None and data is not None and len(data.shape) > 2:
                # fp32 ORT runs a Linear over batched rows as MatMul then a separate bias Add (Gemm, with
                # the bias inside, is 2-D only); QGemm / MatMulIntegerToFloat take the bias in the kernel
                rows = math.prod(_scale(data.shape, batch, example_batch)[:-1])
                bias = net((table.boundary_us("add", float(rows * mod.out_features)) or (0.0, 0.0))[0], 1)
            if n.scope in int8:
                layout = "linear" if isinstance(mod, nn.Linear) else "conv"
                lf += (net(row.float_kernel, 1) * work if row is not None else 0.0) + bias
                li += net(row.int8_us, 1) * work if row is not None else 0.0
                t = data.tensor_id if data is not None else None
                if t is not None and t not in region and f"enter {t}" not in paid and data is not None:
                    paid.add(f"enter {t}")
                    bd += boundary(f"enter:{layout}", data.shape)
                    entries += 1
                region[out] = layout
            else:
                other += (net(row.float_kernel, 1) * work if row is not None else 0.0) + bias
                for t, o in zip(ids, acts, strict=True):
                    leave(t, o.shape)
            if n.kind == "conv":
                conv_out.add(out)
            continue
        if n.kind in _KEEP and acts:
            if ids[0] in region:
                for i in range(max(n.n_outputs, 1)):
                    region[f"{n.key}/{i}"] = region[ids[0]]
            if n.kind == "batch_norm" and ids[0] in conv_out:
                conv_out.add(out)
            continue
        if len(acts) == 2 and (n.kind == "add" or (n.kind == "mul" and table.boundary_us("mul", 1.0) is not None)):
            # a residual add, or a product of two activations (a gate, x * hardsigmoid(x)): QLinearAdd /
            # QLinearMul where both are int8; a product by the elements it writes (a gate broadcasts one
            # operand), and fp32 ORT fuses an add after a conv into the conv
            size = elements(acts[0].shape) if n.kind == "add" else max(elements(o.shape) for o in acts)
            got = table.boundary_us(n.kind, size) or (0.0, 0.0)
            fused = n.kind == "add" and any(t in conv_out for t in ids)
            if all(t in region for t in ids):
                ai += net(got[1], 1)
                af += 0.0 if fused else net(got[0], 1)
                adds += 1
                region[out] = region[ids[0]]
            else:
                for t, o in zip(ids, acts, strict=True):
                    leave(t, o.shape)
            continue
        if table.prices_attention and n.kind in ("matmul", "sdpa", "softmax"):
            attention(n, out)
            continue
        if n.kind in _JOIN and acts and all(t in region for t in ids):
            region[out] = region[ids[0]]
            continue
        for t, o in zip(ids, acts, strict=True):
            leave(t, o.shape)
    for k, i in sorted(graph.outputs):
        node = graph.nodes.get(k)
        if node is not None and i < len(node.out_shapes):
            leave(f"{k}/{i}", node.out_shapes[i])
    return ModelCost(batch, lf, li, bd, af, ai, entries, exits, adds, other, mf, mi, mm, kept)


@dataclass(frozen=True)
class ModelDecision:
    """What :func:`decide` chose: layers to keep float besides the layer rows' (with reasons), or the
    whole model (``whole_model``: the reason), and the predicted costs of the int8 placement kept
    (or, for a float model, of the best one rejected) by batch."""

    float_layers: dict[str, str]
    whole_model: str | None
    costs: dict[int, ModelCost]

    @property
    def has_attention(self) -> bool:
        """Whether the predicted model holds attention, on int8 codes (priced by the table's ``matmul``
        rows) or kept float by them."""
        return any(c.matmuls or c.float_attention for c in self.costs.values())


#: the smallest batch at which a predicted-slower model is kept float by default (``model_check="auto"``):
#: at batch 32 (16 sequences for text) every model without attention that the check judged measured on
#: its predicted side of 1 or level (on the Intel Xeon, every layer int8: the small suite's ResNet
#: 0.66-0.75x predicted / 0.91-1.00x measured over three runs, RegNet 0.70x / 0.77-0.92x, hardswish_net
#: 0.72-0.76x / 0.76-0.77x, MobileNetV2 1.06-1.21x / 1.40-1.42x, a zoo ResNet 1.23x / 1.47x); at batch 1 it
#: was not (two of four small nets predicted 0.63-0.76x ran 1.09-1.47x, on the AMD and the Intel CPU
#: alike): benchmarks/RESULTS.md, ``real_models`` and ``export_int8_quickstart``. Below it the
#: prediction is only logged.
TRUSTED_BATCH = 16


def trusted_slower(decision: ModelDecision) -> list[int]:
    """The batches of ``decision`` at which ``model_check="auto"`` acts on a predicted-slower model:
    :data:`TRUSTED_BATCH` or more, and none for a model with attention, whose predictions have not
    held (benchmarks/RESULTS.md, ``real_models``). With attention priced on int8 codes, on the small
    suite's six such models, two runs each, the prediction fell on the wrong side of 1 in 5 of 12
    (predicted / measured, then measured again: ViT 0.87x / 1.03x, 0.75x; Swin 0.94x / 1.07x, 0.97x;
    BERT 0.96x / 0.99x, 1.03x; the windowed-attention model 0.98x / 1.18x, 1.41x). With attention kept
    float by the ``matmul`` rows, it predicted 0.75-0.99x for eight models (ViT 0.82x, Swin 0.94x,
    LeViT 0.75x, GPT-2 0.98x, BERT 0.98x, the windowed-attention model 0.98x, Llama 0.77x, Qwen2
    0.82x) that in two runs ran 0.93-1.58x: int8 ran 2-60% faster than predicted on every one, and
    the prediction fell on the wrong side of 1 for five and six of them. That is a bias the layer and
    boundary rows do not explain, where conv nets' predictions held; acting on it would keep all
    eight float."""
    if decision.has_attention:
        return []
    return sorted(b for b, c in decision.costs.items() if c.speedup <= 1.0 and b >= TRUSTED_BATCH)

#: ops whose int8 form a table may have no rows for (attention's QLinearMatMul on activations and the
#: softmax around it, QLinearMul, embeddings): a model holding them is not judged by such a table. A
#: table with ``mul`` rows prices products of two activations, one with ``matmul`` rows attention,
#: softmax and embeddings; ``mha`` and ``einsum`` stay unpriced
UNPRICED = frozenset({"matmul", "sdpa", "mha", "einsum", "softmax", "mul", "embedding"})


def unpriced_ops(graph: OpGraph, table: CostTable | None = None) -> dict[str, int]:
    """Counts of the ops of ``graph`` whose int8 gain ``table`` cannot price (:data:`UNPRICED`):
    activation products and attention (a product with a constant operand is a scale, not counted);
    a product of two activations is priced by a table with ``mul`` rows."""
    priced = {"mul"} if table is not None and table.boundary_us("mul", 1.0) is not None else set()
    if table is not None and table.prices_attention:
        # embeddings stay float gathers in the int8 export: alike on both sides
        priced |= {"matmul", "sdpa", "softmax", "embedding"}
    out: dict[str, int] = {}
    for n in graph.nodes.values():
        acts = [o for o in n.operands if o.source in ("op", "input") and o.floating]
        if n.kind in UNPRICED - priced and (n.kind not in ("mul", "matmul") or len(acts) >= 2):
            out[n.kind] = out.get(n.kind, 0) + 1
    return out


#: how far (summed |log2| over the shape features, :meth:`LayerShape.distance`) a layer may be from
#: its nearest measured row for the model-level sum to use it: up to 8x the work along one feature.
#: Past it a row's ratio is extrapolated too far to add up: the small suite's HF ResNet at batch 32
#: has a 3 -> 32 channel 7x7 stem on 32k pixels, 5.8 from the nearest row (3 -> 16, 3x3, 6272
#: pixels, int8 3.5x slower), which scaled by work predicted the model at 0.33x where it ran 1.09x
MAX_DISTANCE = 3.0


def _uncovered(layers: Mapping[str, nn.Module], int8: set[str], calls: Mapping[str, LayerCall], table: CostTable,
               batch: int, example_batch: int | None) -> str | None:
    """Why the table cannot price the int8 layers at ``batch`` (a layer with no row within
    :data:`MAX_DISTANCE`), None where it can. Float layers cost the same in both models: not checked."""
    for name in sorted(int8):
        call = calls.get(name)
        key = layer_shape(layers[name], _scale(call.shape, batch, example_batch)) if call is not None else None
        row = table.nearest(key) if key is not None else None
        if key is not None and (row is None or key.distance(row.shape) > MAX_DISTANCE):
            near = "none" if row is None else "x".join(f"{f:g}" for f in row.shape.features)
            return (f"{name} ({key.kind} {'x'.join(f'{f:g}' for f in key.features)}) has no measured shape near it "
                    f"(nearest: {near})")
    return None


def decide(graph: OpGraph, layers: Mapping[str, nn.Module], int8: set[str], calls: Mapping[str, LayerCall],
           table: CostTable, *, batches: Sequence[int], example_batch: int | None,
           float_ops: Collection[str] = ()) -> ModelDecision:
    """Keep ``int8`` (the layers the layer rows left int8), or also keep float the layers whose row
    loses at a requested batch, or keep the whole model float: whichever's slowest requested batch is
    predicted fastest, int8 only where it is predicted faster than fp32 at every one of ``batches``;
    the attention calls ``float_ops`` (:func:`slower_attention`) float in every option.
    A model with ops the table cannot price (:func:`unpriced_ops`) keeps the layer rows' placement,
    and a batch at which an int8 layer has no measured shape near it (:data:`MAX_DISTANCE`) is not
    predicted."""
    where = table.named
    unpriced = unpriced_ops(graph, table)
    if unpriced:
        log.info("cost table: no model-level check (integer ops it has no rows for: %s)",
                 ", ".join(f"{k} x{v}" for k, v in sorted(unpriced.items())))
        return ModelDecision({}, None, {})
    far = {b: why for b in batches if (why := _uncovered(layers, int8, calls, table, b, example_batch)) is not None}
    for b, why in far.items():
        log.info("cost table: no model-level prediction at batch %d: %s", b, why)
    batches = [b for b in batches if b not in far]
    if not batches:
        return ModelDecision({}, None, {})
    losers: dict[str, str] = {}
    for name in sorted(int8):
        call = calls.get(name)
        if call is None or call.pooled or call.model_output:  # kept int8 by the layer rule too
            continue
        for b in batches:
            key = layer_shape(layers[name], _scale(call.shape, b, example_batch))
            row = table.nearest(key) if key is not None else None
            if row is not None and row.speedup < 1.0:
                feats = "x".join(f"{f:g}" for f in row.shape.features)
                losers[name] = (f"kept float by {where} at batch {b}: the nearest measured {row.shape.kind} ({feats}) "
                                f"ran int8 {row.int8_us:.0f} us vs float {row.float_us:.0f} us ({row.speedup:.2f}x)")
                break
    options: list[tuple[dict[str, str], set[str]]] = [({}, set(int8))]
    if losers:
        options.append((losers, set(int8) - set(losers)))
    scored = []
    for extra, kept in options:
        costs = {b: model_cost(graph, layers, kept, table, batch=b, example_batch=example_batch, float_ops=float_ops)
                 for b in batches}
        scored.append((min(c.speedup for c in costs.values()), len(extra), extra, costs))
    best = max(scored, key=lambda s: (s[0], -s[1]))
    worst, _, extra, costs = best
    if worst > 1.0:
        for b, c in costs.items():
            log.info("cost table: int8 model predicted at batch %d: %s", b, c.describe())
        return ModelDecision(extra, None, costs)
    slow_b = min(costs, key=lambda b: costs[b].speedup)
    others = ", ".join([f"batch {b}: {c.speedup:.2f}x" for b, c in costs.items() if b != slow_b]
                       + [f"batch {b}: not predicted, {why}" for b, why in far.items()])
    # the prediction only: what follows from it (float or a warning) is the caller's model_check
    reason = (f"int8 predicted slower than fp32 at batch {slow_b}: {costs[slow_b].describe()}, by {where}"
              f"{f' ({others} predicted)' if others else ''}")
    return ModelDecision({}, reason, costs)


def predict(graph: OpGraph, layers: Mapping[str, nn.Module], table: CostTable, *, batches: Sequence[int],
            example_batch: int | None) -> ModelDecision:
    """The check as default placement runs it on ``layers`` of the traced ``graph``: the table's layer
    and attention rows first, then :func:`decide` on the layers they leave int8 (for benchmarks and
    reports)."""
    calls = layer_calls(graph, layers)
    kept = set(layers) - set(slower_by_table(layers, calls, table))
    ops = slower_attention(graph, table, batches=batches, example_batch=example_batch)
    return decide(graph, layers, kept, calls, table, batches=batches, example_batch=example_batch, float_ops=ops)
