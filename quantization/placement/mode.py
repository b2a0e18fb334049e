"""Applying a Placement while the model runs: a torch-function mode entered by removable root hooks.

``QuantizerGraph`` is a submodule attached to the model (``quantizer_graph``): it owns the
activation quantizers (and the quantizers of functionally used weights) and keeps the placement
as its extra state, so ``state_dict`` holds both the qparams and where they apply, and
``torch.load(weights_only=True)`` restores them. While the model's forward runs, ``QuantizeMode``
counts op calls exactly as the tracer did and, for each call listed in the placement, replaces
the listed operands by their quantized versions. A tensor read by several consumers is quantized
once per forward (a small identity cache), so export traces one Q/DQ pair per tensor.

Attention through ``F.scaled_dot_product_attention`` runs decomposed (``q @ k^T * scale``, mask,
softmax, ``@ v``) with quantizers on q, k, the probabilities and v, which is the graph the ONNX
exporter writes for it anyway; ``nn.MultiheadAttention`` runs as its projections and SDPA
(quantization/placement/attention.py), so its packed weights and matmuls are placed like any others.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from compress.quantization.numerics.fake_quant import FakeQuantizer
from compress.quantization.numerics.spec import QuantSpec
from compress.quantization.placement.attention import (
    MASK_GAP,
    attention_with_weights,
    decomposed_attention,
    redirect,
)
from compress.quantization.placement.records import CONSTANT_PREFIX, Placement
from compress.quantization.placement.trace import (
    ScopeTracker,
    call_kind,
    is_unseen,
    register_mode_file,
    site_index,
)
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils.hooks import RemovableHandle

from compress.core.errors import CalibrationError

ATTR = "quantizer_graph"
register_mode_file(__file__)  # this mode's frames are never an op's call site
#: op kinds a runtime turns into kernels worth naming when they run float
UNSEEN_KINDS = frozenset({"add", "linear", "conv", "matmul", "addmm", "sdpa", "cat"})
UNSEEN_REASON = ("called only on another path than the traced forward (the model branches on torch.export "
                 "tracing, as transformers does to build attention masks, or on its inputs): the placement "
                 "never saw it, so it stays float")


class QuantizerGraph(nn.Module):
    """The activation quantizers of a model placed on its graph, and the placement itself.

    ``pending`` until a forward pass (or a loaded state_dict) gives it a placement: ``placer``,
    set by prepare, traces that first call and places the quantizers.
    """

    def __init__(self, placement: Placement, *, activation_spec: QuantSpec, weight_spec: QuantSpec | None,
                 pending: bool = False) -> None:
        super().__init__()
        self.placement = placement
        self.activation_spec = activation_spec
        self.weight_spec = weight_spec
        self.pending = pending
        self.placing = False
        self.placer: Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], None] | None = None
        self.quantizers = nn.ModuleDict()
        self._handles: list[RemovableHandle] = []
        #: op calls of a forward pass that the placement's trace never saw (kept float), with kinds
        #: that would matter to a runtime; an export names them with the reason
        self.unseen: dict[str, None] = {}

    def get_extra_state(self) -> dict[str, Any]:
        return {
            "placement": None if self.pending else self.placement.to_data(),
            "activation_spec": self.activation_spec.model_dump(),
            "weight_spec": None if self.weight_spec is None else self.weight_spec.model_dump(),
        }

    def set_extra_state(self, state: Any) -> None:
        # runs before the children load: build the quantizers whose scales follow in the state_dict
        self.activation_spec = QuantSpec(**state["activation_spec"])
        self.weight_spec = None if state["weight_spec"] is None else QuantSpec(**state["weight_spec"])
        if state["placement"] is not None:
            self.placement = Placement.from_data(state["placement"])
            self.pending = False
            for k in list(self.quantizers.keys()):
                del self.quantizers[k]
            build_quantizers(self)

    def site_index(self) -> dict[tuple[str, str, str], list[str]]:
        """The placement's traced keys by scope, kind and call site (built once per placement)."""
        sites = self.placement.sites
        cached = self.__dict__.get("_site_index")
        if cached is None or cached[0] is not sites:
            cached = (sites, site_index(sites))
            self.__dict__["_site_index"] = cached
        return cached[1]

    def produced(self) -> dict[str, list[tuple[int, str]]]:
        """The quantized op outputs to quantize where they are made, by op key: ``[(output index,
        quantizer id)]``; only those every reader still reads through that quantizer (checked per
        forward pass: SmoothQuant and accuracy control rewrite readers' entries in place)."""
        entries = self.placement.entries
        by_key: dict[str, list[tuple[int, str]]] = {}
        for t, (qid, *readers) in self.placement.produced.items():
            slots = (r.rpartition("|") for r in readers)
            if all(entries.get(key, {}).get(pos) == qid for key, _, pos in slots):
                key, idx = t.rsplit("/", 1)
                by_key.setdefault(key, []).append((int(idx), qid))
        return by_key

    def extra_repr(self) -> str:
        state = "pending" if self.pending else f"{len(self.placement.entries)} op calls"
        return f"target={self.placement.target}, {state}"

    def forward(self, x: Any) -> Any:
        # an nn.Sequential root calls its children in turn, this one last: pass the output through
        return x


def attach(root: nn.Module, graph: QuantizerGraph) -> None:
    """Attach ``graph`` to ``root`` and register the root hooks that enter the mode."""
    root.add_module(ATTR, graph)
    graph._handles = [
        root.register_forward_pre_hook(_enter, with_kwargs=True),
        root.register_forward_hook(_exit, always_call=True),
    ]


def detach(root: nn.Module) -> QuantizerGraph | None:
    """Remove the hooks and the quantizer graph from ``root``; returns it (None if absent)."""
    graph = getattr(root, ATTR, None)
    if not isinstance(graph, QuantizerGraph):
        return None
    for h in graph._handles:
        h.remove()
    # hooks copied with the module (deepcopy) are not in _handles: drop ours by identity
    for hooks in (root._forward_pre_hooks, root._forward_hooks):
        for k in [k for k, fn in hooks.items() if fn in (_enter, _exit)]:
            del hooks[k]
    delattr(root, ATTR)
    return graph


def graph_of(root: nn.Module) -> QuantizerGraph | None:
    g = getattr(root, ATTR, None)
    return g if isinstance(g, QuantizerGraph) else None


_ACTIVE: list[tuple[QuantizeMode, Any]] = []
_UNSEEN_SINKS: list[dict[str, None]] = []


@contextlib.contextmanager
def collect_unseen() -> Iterator[dict[str, None]]:
    """The unseen op calls (see ``QuantizerGraph.unseen``) of every quantized forward run inside:
    torch.export runs the model on copies of its modules, whose graphs the caller never holds."""
    sink: dict[str, None] = {}
    _UNSEEN_SINKS.append(sink)
    try:
        yield sink
    finally:
        _UNSEEN_SINKS.remove(sink)


def _enter(module: nn.Module, args: Any, kwargs: Any) -> None:
    graph = graph_of(module)
    if graph is None or graph.placing:
        return None
    if graph.pending:
        if graph.placer is None:
            raise CalibrationError(f"{type(module).__name__}: its quantizers were never placed; load a state_dict "
                                   "of a quantized model or run a calibration batch first")
        graph.placing = True
        try:
            graph.placer(module, tuple(args), dict(kwargs))
        finally:
            graph.placing = False
    mode = QuantizeMode(module, graph)
    scopes = mode.scopes.active()
    scopes.__enter__()
    mode.__enter__()
    _ACTIVE.append((mode, scopes))
    return None


def _exit(module: nn.Module, args: Any, out: Any) -> None:
    if _ACTIVE and _ACTIVE[-1][0].root is module:
        mode, scopes = _ACTIVE.pop()
        mode.__exit__(None, None, None)
        scopes.__exit__(None, None, None)
    return None


class QuantizeMode(TorchFunctionMode):
    """Applies a QuantizerGraph's placement to the op calls of one forward pass."""

    def __init__(self, root: nn.Module, graph: QuantizerGraph) -> None:
        super().__init__()
        self.root = root
        self.graph = graph
        self.scopes = ScopeTracker(root, graph.site_index())
        self.entries = graph.placement.entries
        self.produced = graph.produced()
        self.quantizers: dict[str, nn.Module] = dict(graph.quantizers.items())
        self.cache: dict[tuple[int, str], tuple[weakref.ref[Any], weakref.ref[Any]]] = {}

    def quantizer(self, qid: str) -> Callable[[torch.Tensor], torch.Tensor]:
        q = self.quantizers.get(qid)
        if q is not None:
            return q
        use = self.graph.placement.weights.get(qid)
        if use is not None and use.module is not None:
            layer = self.root.get_submodule(use.module)
            wq = getattr(layer, "weight_quantizer", None)
            if isinstance(wq, nn.Module):
                return wq
        return _identity

    def apply(self, qid: str, x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            return x
        key = (id(x), qid)
        hit = self.cache.get(key)
        if hit is not None and hit[0]() is x:
            y = hit[1]()
            if y is not None:
                return y
        y = self.quantizer(qid)(x)
        self.cache[key] = (weakref.ref(x), weakref.ref(y))
        if y is not x:  # its consumers read it through the same quantizer: no second Q/DQ pair
            self.cache[(id(y), qid)] = (weakref.ref(y), weakref.ref(y))
        return y

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.scopes.in_quantizer():
            return func(*args, **kwargs)
        run = redirect(func, args, kwargs)
        if run is not None:  # the same decomposition the tracer saw, under this mode
            with self:
                return run()
        kind = call_kind(func)
        key, _ = self.scopes.key(kind)
        entry, made = self.entries.get(key), self.produced.get(key)
        if entry is None:
            out = func(*args, **kwargs)
            # index arithmetic (a mask's positions) is no float work: only float results are named
            if kind in UNSEEN_KINDS and is_unseen(key) and isinstance(out, torch.Tensor) and out.is_floating_point():
                self._unseen(key)
        else:
            out = self._call(func, entry, args, kwargs)
        return out if made is None else self._quantize_outputs(out, made)

    def _unseen(self, key: str) -> None:
        if len(self.graph.unseen) < 1000:
            self.graph.unseen[key] = None
        for sink in _UNSEEN_SINKS:
            sink[key] = None

    def _quantize_outputs(self, out: Any, made: list[tuple[int, str]]) -> Any:
        leaves, spec = pytree.tree_flatten(out)
        tensors = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        for idx, qid in made:
            if idx < len(tensors):
                leaves[tensors[idx]] = self.apply(qid, leaves[tensors[idx]])
        return pytree.tree_unflatten(leaves, spec)

    def _call(self, func: Callable[..., Any], entry: dict[str, str], args: Any, kwargs: dict[str, Any]) -> Any:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        for pos, qid in entry.items():
            if pos.isdigit() and int(pos) < len(leaves):
                leaf = leaves[int(pos)]
                if isinstance(leaf, (int, float)) and not isinstance(leaf, bool):
                    leaf = _as_tensor(leaf, leaves)  # a number operand quantized as the constant it exports as
                leaves[int(pos)] = self.apply(qid, leaf)
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        if "q" in entry:  # attention, decomposed with its own quantizers inside
            return self._attention(func, entry, args, kwargs)
        if "g" in entry:  # SiLU as x * q(sigmoid(x)): what ORT runs as QLinearSigmoid + QLinearMul
            gate = F.hardsigmoid if getattr(func, "__name__", "") == "hardswish" else torch.sigmoid  # hardswish too
            return args[0] * self.apply(entry["g"], gate(args[0]))
        return func(*args, **kwargs)

    def _attention(self, func: Any, entry: dict[str, str], args: Any, kwargs: dict[str, Any]) -> Any:
        def quant(role: str, t: torch.Tensor) -> torch.Tensor:
            if role == "filled":  # masked scores, on the scores' grid
                return _masked_scores(self, entry.get("scores"), t)
            return self.apply(entry[role], t) if role in entry else t

        if func is attention_with_weights:
            return decomposed_attention(*args, **kwargs, quant=quant, return_probs=True)
        return decomposed_attention(*args, **kwargs, quant=quant)


def _masked_scores(mode: Any, qid: str | None, t: torch.Tensor) -> torch.Tensor:
    """Masked attention scores (or the fill value alone) through the scores' quantizer ``qid``. While
    it calibrates, the fill values are not data: it sees instead the lowest score less MASK_GAP, so its
    grid reaches far enough below the scores that a masked key, at the lowest code, weighs next to
    nothing after the softmax."""
    if qid is None or not t.is_floating_point():
        return t
    q = mode.quantizer(qid)
    if isinstance(q, FakeQuantizer) and q.observing:
        real = t[t > torch.finfo(t.dtype).min]
        if real.numel():
            q.observe((real.detach().amin() - MASK_GAP).reshape(1))
        return t
    return mode.apply(qid, t)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _as_tensor(value: float, leaves: list[Any]) -> Any:
    """A Python number as a 0-d tensor of the op's floating tensor operand (unchanged without one)."""
    ref = next((t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()), None)
    return value if ref is None else torch.tensor(value, dtype=ref.dtype, device=ref.device)


#: embedding tables: int8, symmetric, one scale per row (a looked-up vector keeps its own range);
#: what ORT's Gather runs on int8 codes with a gathered per-row scale (export/qdq/weights.py)
TABLE_SPEC = QuantSpec(granularity="channel", axis=0)


def _weight_spec(graph: QuantizerGraph, axis: int) -> QuantSpec | None:
    spec = graph.weight_spec
    if spec is None:
        return None
    if spec.granularity == "channel":
        return spec.with_(axis=axis)
    if spec.granularity == "group" and axis != 0:
        return spec.with_(granularity="channel", axis=axis)  # groups run along the input features
    return spec


def build_quantizers(graph: QuantizerGraph) -> None:
    """Create the (uncalibrated) FakeQuantizers a placement names: one per activation group, one
    per functionally used weight that no swapped layer owns."""
    for qid in graph.placement.activations:
        if qid not in graph.quantizers:
            spec = graph.activation_spec
            if qid.startswith(CONSTANT_PREFIX):  # a constant's range is known exactly: clipping it only biases
                spec = spec.with_(observer="minmax", observer_params={})
            graph.quantizers[qid] = FakeQuantizer(spec, role="input", name=f"{ATTR}.quantizers.{qid}")
    for qid, use in graph.placement.weights.items():
        wspec = TABLE_SPEC if use.table else _weight_spec(graph, use.axis)
        if use.module is None and wspec is not None and qid not in graph.quantizers:
            graph.quantizers[qid] = FakeQuantizer(wspec, role="weight", name=f"{ATTR}.quantizers.{qid}")


def calibrate_weights(graph: QuantizerGraph, root: nn.Module) -> None:
    """Set the qparams of the placement's own weight quantizers from the weights they quantize."""
    tensors = dict(root.named_parameters()) | dict(root.named_buffers())
    for qid, use in graph.placement.weights.items():
        q = _member(graph, qid)
        if isinstance(q, FakeQuantizer) and use.param in tensors:
            w = tensors[use.param]
            q.to(w.device)
            with torch.no_grad():
                q.observe(w.detach())
                q.compute_qparams()


def _member(graph: QuantizerGraph, qid: str | None) -> nn.Module | None:
    return graph.quantizers[qid] if qid is not None and qid in graph.quantizers else None


def _layer_keys(placement: Placement, layer: str, kind: str = "linear") -> list[str]:
    prefix = f"{layer}:{kind}#"
    return [k for k in placement.entries if k.startswith(prefix)]


def input_quantizer(root: nn.Module, name: str) -> FakeQuantizer | None:
    """The quantizer of a layer's input: its own (dynamic schemes), else the placed one."""
    mod = root.get_submodule(name)
    own = getattr(mod, "input_quantizer", None)
    if isinstance(own, FakeQuantizer):
        return own
    graph = graph_of(root)
    if graph is None:
        return None
    for kind in ("linear", "conv"):
        for k in _layer_keys(graph.placement, name, kind):
            qid = graph.placement.entries[k].get("0")
            q = _member(graph, qid)
            if isinstance(q, FakeQuantizer):
                return q
    return None


def set_smoothing(root: nn.Module, names: list[str], pre_scale: torch.Tensor | None) -> None:
    """Give the Linear layers ``names`` (which read one tensor) the input factor ``pre_scale``.

    Placed quantizers are shared with the tensor's other consumers (a residual add reads the
    unsmoothed tensor), so the layers get a quantizer of their own for the smoothed tensor."""
    graph = graph_of(root)
    if graph is None:
        for n in names:
            iq = getattr(root.get_submodule(n), "input_quantizer", None)
            if isinstance(iq, FakeQuantizer):
                iq.pre_quant_scale = pre_scale
        return
    keys = [k for n in names for k in _layer_keys(graph.placement, n)]
    current = {graph.placement.entries[k].get("0") for k in keys}
    if pre_scale is None:
        for qid in current:
            q = _member(graph, qid)
            if isinstance(q, FakeQuantizer) and qid is not None and qid.startswith("m"):
                q.pre_quant_scale = None
        return
    first = next(iter(current))
    base = _member(graph, first)
    if not isinstance(base, FakeQuantizer):
        return
    if len(current) == 1 and first is not None and first.startswith("m"):
        base.pre_quant_scale = pre_scale
        return
    qid = f"m{sum(k.startswith('m') for k in graph.quantizers)}"
    q = FakeQuantizer(base.spec, role="input", name=f"{ATTR}.quantizers.{qid}").to(pre_scale.device)
    q.pre_quant_scale = pre_scale
    graph.quantizers[qid] = q
    graph.placement.activations[qid] = [f"{n} input, smoothed" for n in names]
    for k in keys:
        graph.placement.entries[k]["0"] = qid
    # pass-through ops before the layers (an attention output's transpose/reshape) share the old
    # quantizer only to hand it to the layers: left in place they would quantize the unsmoothed
    # tensor first, with the outlier range smoothing removes
    real = {v for key, e in graph.placement.entries.items() if ":reshape#" not in key for v in e.values()}
    for key in [k for k, e in graph.placement.entries.items() if ":reshape#" in k]:
        entry = graph.placement.entries[key]
        for pos in [p for p, v in entry.items() if v in current and v not in real]:
            del entry[pos]
        if not entry:
            del graph.placement.entries[key]
    # the old quantizer stays for the tensor's other readers only where one of them runs in integer:
    # readers kept float (an add outside the targets, a lopsided add) gain nothing from it, and its
    # rounding was all they got (MiniLM's FFN residual inputs: the six most damaging quantizers)
    floats = graph.placement.floats
    for old in current:
        readers = [(k, p) for k, e in graph.placement.entries.items() for p, v in e.items() if v == old]
        if old is not None and readers and all(k in floats for k, _ in readers):
            for k, pos in readers:
                del graph.placement.entries[k][pos]
                if not graph.placement.entries[k]:
                    del graph.placement.entries[k]
    used = {v for e in graph.placement.entries.values() for v in e.values()}
    for old in current:  # a quantizer only these layers read is replaced, not left unobserved
        if old is not None and old not in used and old in graph.quantizers:
            del graph.quantizers[old]
            graph.placement.activations.pop(old, None)


def unsmooth(root: nn.Module) -> None:
    """Fold SmoothQuant factors of placed quantizers back into their Linear weights (strip)."""
    graph = graph_of(root)
    if graph is None:
        return
    done: set[str] = set()
    for key, entry in graph.placement.entries.items():
        qid = entry.get("0")
        q = _member(graph, qid)
        scope, _, kind = key.rpartition(":")
        if not isinstance(q, FakeQuantizer) or q.pre_quant_scale is None or not kind.startswith("linear"):
            continue
        if scope in done:
            continue
        done.add(scope)
        weight = root.get_submodule(scope).weight
        if isinstance(weight, torch.Tensor):
            with torch.no_grad():
                weight.mul_(q.pre_quant_scale.to(weight.dtype))
    for q in graph.quantizers.values():
        if isinstance(q, FakeQuantizer):
            q.pre_quant_scale = None
