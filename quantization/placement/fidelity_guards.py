"""The fidelity guards of the placement: the measured bars that keep a tensor, an add, a product,
a concat or a layer float where one 8-bit scale would cost too much (a constant operand's SQNR, an
angle's phase step, an operand's peak over its RMS, lopsided or mask-filled add operands, a Linear
output the model also returns, an MoE router's top-k), and the reasons recorded in
``Placement.floats`` when they do. The placement passes read the bars through this module, so a
test or benchmark that moves one bar moves it for every pass."""

from __future__ import annotations

import math
from typing import Any

from compress.quantization.placement.graph_patterns import tensor_consumers, weighted_operands
from compress.quantization.placement.trace import Operand, OpGraph, OpNode

#: a constant tensor operand of a product runs as a quantized initializer (QLinearMul) only when one
#: 8-bit scale keeps it at this SQNR or better (the tracer computes it from its values): a layer scale
#: initialized to one value (ConvNeXt's 1e-6) passes; trained layer scales spanning decades do not,
#: and their small channels would round to zero (measured: tests/quantization/placement/test_placement_elementwise.py)
CONSTANT_MIN_SQNR = 40.0


#: calls whose error is their input's absolute error (a phase), not a relative one
_PERIODIC = frozenset({"~cos", "~sin"})
#: the largest phase step one 8-bit scale may put on an angle read only by cos/sin (radians): with
#: it cos/sin keep about 40 dB (CONSTANT_MIN_SQNR), a step 0.02 rad rounding by at most 0.01
MAX_PHASE_STEP = 0.02


def phase_error(n: OpNode, readers: list[tuple[OpNode, Operand]]) -> str | None:
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


def sqnr_text(v: float | None) -> str:
    return "an unmeasured SQNR" if v is None else f"{v:.1f} dB"


def unheld(n: OpNode, o: Operand) -> str | None:
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
                f"{sqnr_text(db)} (< {CONSTANT_MIN_SQNR:.0f} dB; a row scaled by a value on the grid's first codes "
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


def holds(n: OpNode, o: Operand) -> bool:
    """Whether the constant operand ``o`` of product ``n`` keeps its values under one 8-bit scale."""
    if math.prod(o.shape) == 1:
        return True
    sq = n.attrs.get("const_sqnr", [])
    v = sq[o.position] if o.position < len(sq) else None
    return v is not None and v >= CONSTANT_MIN_SQNR


#: an add whose operands' magnitudes differ by more than this stays float: its output's 8-bit scale
#: follows the larger one, and the smaller falls within one step and is lost. Masks (-1e4, finfo.min)
#: and RMSNorm's ``var + eps`` (eps 1e-6: a token whose variance rounds to zero gets rsqrt(0)) are the
#: cases; position embeddings, biases and GELU's ``1 + tanh`` are well inside it.
MAX_OPERAND_RATIO = 256.0


#: a tensor whose largest magnitude is this many times its RMS loses too much to one 8-bit scale:
#: per-tensor uint8 SQNR is about 52.9 - 20 log10(amax / rms) dB, so 32x is about 23 dB (the
#: outlier channels of BERT-style FFN outputs; Gaussian-like activations sit near 4-6x)
MAX_PEAK_TO_RMS = 32.0


def outlier_operand(attrs: dict[str, Any]) -> str | None:
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


def lopsided(amax: list[float]) -> str | None:
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


def feeds_topk(n: OpNode, producers: dict[str, OpNode], consumers: dict[str, list[tuple[OpNode, Operand]]],
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


def router_layers(graph: OpGraph) -> set[str]:
    """The layers whose weighted call feeds a top-k (MoE routers, see :func:`feeds_topk`), by name."""
    nodes = list(graph.nodes.values())
    producers = {n.key: n for n in nodes}
    consumers = tensor_consumers(nodes)
    weighted = {n.key for n in nodes if weighted_operands(n) is not None}
    out = set()
    for n in nodes:
        w = weighted_operands(n)
        if w is not None and w[1].name and "." in w[1].name and feeds_topk(n, producers, consumers, weighted):
            out.add(w[1].name.rsplit(".", 1)[0])
    return out
