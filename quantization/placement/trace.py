"""The graph of a real forward pass, seen at torch-function level, for quantizer placement.

Users' models write ``+``, ``+=``, ``torch.cat``, ``F.relu``, ``@`` and
``F.scaled_dot_product_attention`` in ``forward``; module types do not show where tensors meet.
A ``TorchFunctionMode`` sees every torch function and tensor operator with its arguments (also
under ``no_grad``, through Python control flow and inside Hugging Face models), which is what
NNCF's hook mode does; torch.export/PT2E would replace the user's module by a graph module, which
breaks QAT in the user's own loop. Chosen: the mode, plus global module hooks for the scope.

Every op call gets a stable key ``scope:kind#n``: the innermost module running it, the op kind and
its index among the calls of that kind in that scope during the traced forward pass. Each key also
records its call site (the model code's function and line within it, :func:`call_site`), and the
quantizing mode resolves a call by scope, kind, call site and index among that site's calls. So the
same key names the same call in calibration, QAT, export and conversion even where the forward
takes another path: Hugging Face models build attention masks only under ``torch.export`` (an
extra add at the top of BEiT's layer), which shifted every later plain index in that scope and put
the residual add's quantizers on the mask add. A call the trace never saw (``unseen``) stays float.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
import torch.nn.functional as F
from compress.quantization.placement import attention
from torch import nn

from compress.core import tracing
from compress.core.tracing import ObserverMode, iter_tensors, op_name, tensor_leaves

# ---- op kinds ---------------------------------------------------------------------------------------
# The name of the function or method as written (compress.core.tracing.op_name: ``add_``, ``__iadd__``
# and ``add`` are listed one by one, since an in-place activation such as ``sigmoid_`` is not placed)
# decides the kind; ``None`` kinds are not recorded as ops.
_KIND_BY_NAME: dict[str, str] = {}


def _kinds(kind: str, *names: str) -> None:
    for n in names:
        _KIND_BY_NAME[n] = kind


_kinds("linear", "linear")
_kinds("conv", "conv1d", "conv2d", "conv3d", "_conv_forward")
_kinds("addmm", "addmm")
_kinds("matmul", "matmul", "__matmul__", "__rmatmul__", "bmm", "mm", "baddbmm")
_kinds("einsum", "einsum")
_kinds("add", "add", "__add__", "__radd__", "__iadd__", "add_")
_kinds("sub", "sub", "__sub__", "__rsub__", "__isub__", "sub_")
_kinds("mul", "mul", "__mul__", "__rmul__", "__imul__", "mul_")
_kinds("cat", "cat", "concat", "concatenate")
_kinds("sdpa", "scaled_dot_product_attention", "attention_with_weights")
_kinds("mha", "multi_head_attention_forward")
_kinds("relu", "relu", "relu_")
_kinds("relu6", "relu6", "hardtanh", "hardtanh_", "clamp", "clip", "clamp_", "clamp_min")
_kinds("max_pool", "max_pool1d", "max_pool2d", "max_pool3d", "max_pool1d_with_indices", "max_pool2d_with_indices",
       "adaptive_max_pool2d")
_kinds("avg_pool", "avg_pool1d", "avg_pool2d", "adaptive_avg_pool1d", "adaptive_avg_pool2d")
_kinds("mean", "mean")
_kinds("batch_norm", "batch_norm")
_kinds("layer_norm", "layer_norm", "group_norm", "rms_norm")
_kinds("embedding", "embedding")
_kinds("softmax", "softmax", "log_softmax")
_kinds("sigmoid", "sigmoid")  # QLinearSigmoid; hardsigmoid has no integer kernel in ORT
_kinds("silu", "silu")
_kinds("act", "hardsigmoid", "gelu", "hardswish", "tanh", "leaky_relu", "elu", "mish", "softplus", "erf")
_kinds("reshape", "reshape", "view", "flatten", "transpose", "permute", "contiguous", "squeeze", "unsqueeze",
       "__getitem__", "split", "chunk", "unbind", "expand", "narrow", "movedim", "t", "view_as", "reshape_as",
       "flatten", "unflatten", "repeat_interleave", "expand_as", "pixel_shuffle", "pixel_unshuffle",
       "channel_shuffle", "roll", "select", "split_with_sizes", "tensor_split", "get:T", "get:mT")
_kinds("pad", "pad")
_kinds("dropout", "dropout", "dropout1d", "dropout2d", "alpha_dropout")

#: ops whose output is a view/reordering of one input's values (a quantized input stays exactly on
#: its grid): the tensor after them can share the quantizer of the tensor before them
PASS_THROUGH = frozenset({"reshape", "max_pool", "dropout"})
#: the weighted ops: (weight argument index, per-output-channel axis of that weight)
WEIGHTED: dict[str, tuple[int, int]] = {"linear": (1, 0), "conv": (1, 0), "addmm": (2, 1)}


def call_kind(func: Any) -> str:
    """The kind of any call: a known kind, else ``~name`` (counted on its own, never placed)."""
    kind = op_kind(func)
    if kind is not None:
        return kind
    name = getattr(func, "__name__", None) or type(func).__name__
    return f"~{name}"


def op_kind(func: Any) -> str | None:
    """The kind of a torch function (see ``_KIND_BY_NAME``), None for those not recorded."""
    if func is F.max_pool1d or func is F.max_pool2d or func is F.max_pool3d:
        return "max_pool"
    if func is F.adaptive_max_pool1d or func is F.adaptive_max_pool2d:
        return "max_pool"
    return _KIND_BY_NAME.get(op_name(func))  # Tensor.T / .mT reads arrive as "get:T" / "get:mT"


# ---- the traced graph -----------------------------------------------------------------------------
@dataclass
class Operand:
    """A tensor argument of an op: its flat position among the op's tensor leaves and its source.

    ``source``: "op" (``producer`` = the key of the op that made it, ``index`` = which output),
    "input" (a model input), "param" (``name`` = a parameter or buffer of the model), "const"
    (made outside any recorded op: constants, masks built by untraced code) or "scalar" (a Python
    number operand of an add, ``var + eps``, ``1.0 + tanh(x)``: the exported graph holds it as a
    constant tensor, and a runtime may want it quantized like one).
    """

    position: int
    source: str
    producer: str | None = None
    index: int = 0
    name: str | None = None
    shape: tuple[int, ...] = ()
    floating: bool = True

    @property
    def tensor_id(self) -> str | None:
        """The activation tensor this operand reads (``producer/index``, or ``<input>``); None for
        parameters, constants and scalars."""
        if self.source == "op":
            return f"{self.producer}/{self.index}"
        if self.source == "input":
            return f"<{self.name}>"
        return None


@dataclass
class OpNode:
    """One recorded op call."""

    key: str
    kind: str
    func: str
    scope: str
    operands: list[Operand]
    n_outputs: int
    out_shapes: list[tuple[int, ...]] = field(default_factory=list)
    attrs: dict[str, Any] = field(default_factory=dict)
    site: str = ""


@dataclass
class OpGraph:
    """The ops of one forward pass in call order, with consumers by produced tensor."""

    nodes: dict[str, OpNode] = field(default_factory=dict)
    outputs: set[tuple[str, int]] = field(default_factory=set)  # (producer key, index) returned by the model

    def consumers(self, producer: str, index: int = 0) -> list[tuple[OpNode, Operand]]:
        out = []
        for n in self.nodes.values():
            for o in n.operands:
                if o.source == "op" and o.producer == producer and o.index == index:
                    out.append((n, o))
        return out


# ---- scope and keys: shared by tracing and the quantizing mode ----------------------------------------
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_TORCH_MODULES = os.path.join(_TORCH_DIR, "nn", "modules") + os.sep
#: files of the modes that intercept calls: never a call site
_MODE_FILES: set[str] = {__file__, tracing.__file__}


def register_mode_file(path: str) -> None:
    """Mark a module that intercepts op calls (a TorchFunctionMode's file) as never a call site."""
    _MODE_FILES.add(path)


def call_site() -> str:
    """Where the model's code makes the op call now running: ``function qualname+line offset`` of the
    first frame outside torch's internals and the modes (any ``__torch_function__`` handler: another
    mode active beside this one, such as the KV-cache quantizer's, is not the model's code; a torch.nn
    module's forward counts as model code: nn.Linear calls F.linear there). Offsets are relative to the function's first line, so the
    site holds across edits elsewhere in the file and across install paths."""
    f: FrameType | None = sys._getframe(1)
    while f is not None:
        fn = f.f_code.co_filename
        if fn not in _MODE_FILES and f.f_code.co_name != "__torch_function__" and (
                not fn.startswith(_TORCH_DIR) or fn.startswith(_TORCH_MODULES)):
            return f"{f.f_code.co_qualname}+{f.f_lineno - f.f_code.co_firstlineno}"
        f = f.f_back
    return ""


def split_key(key: str) -> tuple[str, str]:
    """``(scope, kind)`` of a traced op key ``scope:kind#n``."""
    scope, _, rest = key.rpartition(":")
    return scope, rest.split("#", 1)[0]


def is_op_key(name: str) -> bool:
    """Whether ``name`` is a traced op key (``scope:kind#n``) rather than a module name."""
    return ":" in name and "#" in name.rpartition(":")[2]


def is_unseen(key: str) -> bool:
    """Whether ``key`` names a call the placement's trace never saw (see :class:`ScopeTracker`)."""
    return "@" in key


def site_index(sites: dict[str, str]) -> dict[tuple[str, str, str], list[str]]:
    """Traced keys by ``(scope, kind, call site)``, in call order (see :class:`ScopeTracker`)."""
    index: dict[tuple[str, str, str], list[str]] = {}
    for key, site in sites.items():
        scope, kind = split_key(key)
        index.setdefault((scope, kind, site), []).append(key)
    for keys in index.values():
        keys.sort(key=lambda k: int(k.rsplit("#", 1)[1]))
    return index


class ScopeTracker:
    """The innermost module running, via global module hooks installed only inside ``active``, and
    per-(scope, kind) call counters that make op keys. Given the traced keys' call sites (``sites``,
    from :func:`site_index`), a call is resolved to the traced key of its scope, kind and call site
    by its index among that site's calls; a call the trace never saw gets a key no placement holds
    (``scope:kind@site#n``, see :func:`is_unseen`)."""

    def __init__(self, root: nn.Module, sites: dict[tuple[str, str, str], list[str]] | None = None) -> None:
        from compress.quantization.numerics.fake_quant import FakeQuantizer

        self.names = {id(m): n for n, m in root.named_modules()}
        # quantizers (and export stand-ins) run torch calls that are not the model's own ops
        self.quantizer_ids = {id(m) for m in root.modules() if isinstance(m, FakeQuantizer) or getattr(m, "is_quantizer", False)}
        self.stack: list[str] = []
        self.modules: list[int] = []
        self.counts: dict[tuple[str, str], int] = {}
        self.sites = sites or {}
        self.site_counts: dict[tuple[str, str, str], int] = {}
        #: called with (quantizer name, output) after a quantizer module runs (the tracer uses it)
        self.on_quantizer: Callable[[str, Any], None] | None = None

    def in_quantizer(self) -> bool:
        return bool(self.modules) and self.modules[-1] in self.quantizer_ids

    def key(self, kind: str) -> tuple[str, str]:
        scope = self.stack[-1] if self.stack else ""
        if self.sites:
            at = (scope, kind, call_site())
            i = self.site_counts.get(at, 0)
            self.site_counts[at] = i + 1
            keys = self.sites.get(at)
            if keys is not None and i < len(keys):
                return keys[i], scope
            return f"{scope}:{kind}@{at[2]}#{i}", scope
        n = self.counts.get((scope, kind), 0)
        self.counts[(scope, kind)] = n + 1
        return f"{scope}:{kind}#{n}", scope

    def _pre(self, mod: nn.Module, args: Any) -> None:
        name = self.names.get(id(mod))
        self.stack.append(name if name is not None else (self.stack[-1] if self.stack else ""))
        self.modules.append(id(mod))

    def _post(self, mod: nn.Module, args: Any, out: Any) -> None:
        if self.stack:
            name = self.stack.pop()
            self.modules.pop()
            if self.on_quantizer is not None and id(mod) in self.quantizer_ids:
                self.on_quantizer(name, out)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        from torch.nn.modules import module as module_mod

        h1 = module_mod.register_module_forward_pre_hook(self._pre)
        h2 = module_mod.register_module_forward_hook(self._post, always_call=True)
        try:
            yield
        finally:
            h1.remove()
            h2.remove()
            self.stack.clear()
            self.modules.clear()
            self.counts.clear()


class GraphTracer(ObserverMode):
    """Records an OpGraph of every forward pass run inside it (the model itself runs unchanged)."""

    def __init__(self, root: nn.Module) -> None:
        super().__init__()
        self.root = root
        self.scopes = ScopeTracker(root)
        self.graph = OpGraph()
        self.params = {id(t): n for n, t in [*root.named_parameters(), *root.named_buffers()]}
        self._made_ids: dict[int, tuple[weakref.ref[Any], tuple[str, int]]] = {}
        self._key: tuple[str, str, str, str] = ("", "", "", "")  # the running call's kind, key, scope, site
        self.inputs: dict[int, int] = {}
        self._keep: list[Any] = []
        self.scopes.on_quantizer = self._quantized_weight

    def _quantized_weight(self, name: str, out: Any) -> None:
        """A swapped layer's weight quantizer ran: its output stands for the layer's weight."""
        if name.endswith(".weight_quantizer") and isinstance(out, torch.Tensor):
            self.params[id(out)] = name.removesuffix("_quantizer")
            self._keep.append(out)  # keep the id from being reused during the trace

    def mark_inputs(self, args: Any, kwargs: Any) -> None:
        self._inputs_refs = [t for _, t in tensor_leaves((args, kwargs or {}))]
        self.inputs = {id(t): k for k, t in enumerate(self._inputs_refs)}

    def _source(self, pos: int, t: torch.Tensor) -> Operand:
        hit = self._made_ids.get(id(t))
        shape, fl = tuple(t.shape), t.is_floating_point()
        if hit is not None and hit[0]() is t:
            return Operand(pos, "op", producer=hit[1][0], index=hit[1][1], shape=shape, floating=fl)
        if id(t) in self.params:
            return Operand(pos, "param", name=self.params[id(t)], shape=shape, floating=fl)
        if id(t) in self.inputs:
            return Operand(pos, "input", name=f"input{self.inputs[id(t)]}", shape=shape, floating=fl)
        return Operand(pos, "const", shape=shape, floating=fl)

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.scopes.in_quantizer():
            return func(*args, **kwargs)
        run = attention.redirect(func, args, kwargs)
        if run is not None:  # nn.MultiheadAttention: its decomposition's calls are the ops
            with self:
                return run()
        # the call's key is taken before it runs, as the quantizing mode takes it: a call that raises
        # (and whose error the model catches) still uses its index in both
        kind = call_kind(func)
        self._key = (kind, *self.scopes.key(kind), call_site())
        return super().__torch_function__(func, types, args, kwargs)

    def observe(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Record one call after it ran, under the key taken before it (the mode is off while it
        runs, so no other call is counted in between)."""
        kind, key, scope, site = self._key
        leaves = tensor_leaves((args, kwargs))
        outs = list(iter_tensors(out))
        if not outs:  # size(), dim(), item(): no tensor flows on from here
            return
        operands = [self._source(p, t) for p, t in leaves]
        if kind in _SCALAR_OPERAND_KINDS and "alpha" not in kwargs:
            operands += [Operand(p, "scalar") for p, v in enumerate(args) if _is_number(v)]
            operands.sort(key=lambda o: o.position)
        node = OpNode(key, kind, getattr(func, "__name__", str(func)), scope, operands, len(outs),
                      [tuple(t.shape) for t in outs], _attrs(kind, args, kwargs), site)
        if node.func in _CASTS and len(outs) == 1 and leaves and outs[0] is leaves[0][1]:
            # a cast that returned its input (``x.to(torch.float32)`` of a float32 tensor, ``.float()``):
            # the values stay on any grid they were on (RMSNorm's casts around its products); an
            # in-place op also returns its input, with other values, so only these calls count
            node.attrs["identity"] = True
        self.graph.nodes[key] = node
        for i, t in enumerate(outs):
            self._made_ids[id(t)] = (weakref.ref(t), (key, i))

    def mark_outputs(self, out: Any) -> None:
        for t in iter_tensors(out):
            hit = self._made_ids.get(id(t))
            if hit is not None and hit[0]() is t:
                self.graph.outputs.add(hit[1])


#: calls that change at most a tensor's dtype or layout: returning their input, they changed nothing
_CASTS = frozenset({"to", "float", "double", "half", "bfloat16", "type", "type_as", "contiguous", "detach"})

#: op kinds whose Python number operands are recorded (as "scalar" operands)
_SCALAR_OPERAND_KINDS = frozenset({"add", "mul"})


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _amax(v: Any) -> float:
    if isinstance(v, torch.Tensor):
        return float(v.detach().abs().amax()) if v.is_floating_point() and v.numel() else 0.0
    return abs(float(v)) if _is_number(v) else 0.0


def _rms(v: Any) -> float:
    if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel():
        return float(v.detach().float().pow(2).mean().sqrt())
    return 0.0


#: float32's smallest normal and smallest subnormal, as natural logs: a softmax output exp(x - max)
#: is subnormal where x - max falls between them
_LOG_NORMAL, _LOG_SUBNORMAL = math.log(torch.finfo(torch.float32).tiny), math.log(2.0**-149)


def subnormal_share(logits: Any, dim: int = -1) -> float:
    """The share of a float32 softmax's outputs over ``logits`` (along ``dim``) that are subnormal:
    a finite mask such as Swin's -100 pushes scores 87-103 below their row's largest, whose
    probabilities x86 CPUs compute and multiply many times slower than normal floats."""
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or not logits.numel():
        return 0.0
    x = logits.detach().float()
    gap = x - x.amax(dim=dim, keepdim=True)
    return float(((gap < _LOG_NORMAL) & (gap > _LOG_SUBNORMAL)).float().mean())


def _sdpa_ranges(args: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The largest |score| (``q @ k^T * scale``) and |mask| of an attention call with a float mask:
    placement quantizes the mask add only where one 8-bit scale serves both; ``masked`` names a
    boolean or causal mask (filled, not added: see attention.MASK_GAP)."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    a = dict(zip(names, args, strict=False)) | kwargs
    q, k, mask = a.get("query"), a.get("key"), a.get("attn_mask")
    if isinstance(mask, torch.Tensor) and not mask.is_floating_point():
        return {"masked": "bool"}
    if a.get("is_causal"):
        return {"masked": "causal"}
    if not isinstance(mask, torch.Tensor) or not isinstance(q, torch.Tensor):
        return {}
    assert isinstance(k, torch.Tensor)
    if q.dim() >= 3 and k.dim() >= 3 and q.size(-3) != k.size(-3):
        k = k.repeat_interleave(q.size(-3) // k.size(-3), dim=-3)
    scale = a.get("scale") or 1.0 / math.sqrt(q.size(-1))
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    return {"amax": {"scores": _amax(scores), "mask": _amax(mask)}, "subnormal": subnormal_share(scores + mask)}


#: the largest operand whose per-tensor 8-bit SQNR the tracer computes (a per-channel scale vector)
_SQNR_NUMEL = 4096


def _per_tensor_sqnr(v: Any) -> float | None:
    """The SQNR (dB) of ``v`` quantized to uint8 with one scale over its min/max range (zero
    included), as a runtime stores a constant operand: what a per-channel vector (a layer scale)
    keeps of itself. None for a non-tensor or a tensor past _SQNR_NUMEL elements."""
    if not isinstance(v, torch.Tensor) or not v.is_floating_point() or not 0 < v.numel() <= _SQNR_NUMEL:
        return None
    x = v.detach().double()
    if not bool(torch.isfinite(x).all()):  # a mask of -inf: no 8-bit scale holds it
        return None
    lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    if hi == lo:
        return math.inf
    scale = (hi - lo) / 255
    zp = round(-lo / scale)
    err = ((torch.clamp(torch.round(x / scale) + zp, 0, 255) - zp) * scale - x).pow(2).sum()
    return math.inf if float(err) == 0 else float(10 * torch.log10(x.pow(2).sum() / err))


#: the largest broadcast factor whose 8-bit fidelity the tracer computes (RMSNorm's rsqrt is a value
#: per token, rotary's cos/sin one per position and channel: far below it at any sequence length)
_FACTOR_NUMEL = 1 << 20


def _factor_db(args: Any) -> list[float | None]:
    """For each tensor operand of a product that is broadcast against the other (fewer elements than
    the product: a value per row, RMSNorm's ``rsqrt(var + eps)``, rotary's cos/sin): the dB one uint8
    min/max scale keeps of it as a factor. That is its per-tensor SQNR, and, for an operand of one
    sign (a normalizer, which scales each row by its own value), no more than its smallest value's
    worst-case relative precision, 20 log10(510 amin / amax): a row scaled by a value on the grid's
    first codes (the massive-activation token's rsqrt) loses itself, which the tensor's SQNR hides.
    None for operands of the product's size, numbers, and tensors past _FACTOR_NUMEL elements."""
    tensors = [v for v in args if isinstance(v, torch.Tensor)]
    if len(tensors) != 2:
        return [None for _ in args]
    try:
        size = math.prod(torch.broadcast_shapes(tensors[0].shape, tensors[1].shape))
    except RuntimeError:
        return [None for _ in args]
    out: list[float | None] = []
    for v in args:
        if not isinstance(v, torch.Tensor) or not v.is_floating_point() or not 0 < v.numel() < size \
                or v.numel() > _FACTOR_NUMEL:
            out.append(None)
            continue
        x = v.detach().double()
        if not bool(torch.isfinite(x).all()):
            out.append(None)
            continue
        lo, hi = float(x.min()), float(x.max())
        scale = (max(hi, 0.0) - min(lo, 0.0)) / 255
        if scale == 0:
            out.append(math.inf)
            continue
        zp = round(-min(lo, 0.0) / scale)
        err = ((torch.clamp(torch.round(x / scale) + zp, 0, 255) - zp) * scale - x).pow(2).sum()
        db = math.inf if float(err) == 0 else float(10 * torch.log10(x.pow(2).sum() / err))
        if lo > 0 or hi < 0:  # one sign: each value scales a row of its own
            amin = float(x.abs().min())
            db = min(db, 20 * math.log10(max(510 * amin / max(abs(lo), abs(hi)), 1e-30)))
        out.append(db)
    return out


def _attrs(kind: str, args: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The few non-tensor arguments placement reads (clamp bounds, pooling output size) and, for adds
    and attention masks, the largest magnitude of each operand in the traced call."""
    if kind == "add":
        return {"amax": [_amax(v) for v in args], "rms": [_rms(v) for v in args]}
    if kind == "sdpa":
        return _sdpa_ranges(args, kwargs)
    if kind == "mul":
        return {"const_sqnr": [_per_tensor_sqnr(v) for v in args], "amax": [_amax(v) for v in args],
                "rms": [_rms(v) for v in args], "factor_db": _factor_db(args)}
    if kind in ("silu", "sigmoid"):
        return {"amax": [_amax(v) for v in args[:1]], "rms": [_rms(v) for v in args[:1]]}
    if kind == "relu6":
        lo = kwargs.get("min", kwargs.get("min_val", args[1] if len(args) > 1 else None))
        hi = kwargs.get("max", kwargs.get("max_val", args[2] if len(args) > 2 else None))
        return {"min": lo if isinstance(lo, (int, float)) else None, "max": hi if isinstance(hi, (int, float)) else None}
    if kind == "mha":  # not decomposed (see quantization/placement/attention.py): say why
        a = attention.bind_mha(args, kwargs)
        return {"reason": attention.mha_unsupported(a["query"], a["key"], a["value"]) or "nn.MultiheadAttention left whole"}
    if kind == "cat":  # the largest magnitude it joins: an angle read by cos/sin stays float (fidelity_guards.py)
        parts = args[0] if args and isinstance(args[0], (list, tuple)) else kwargs.get("tensors", ())
        return {"amax": max((_amax(v) for v in parts), default=0.0)}
    if kind == "softmax":
        dim = kwargs.get("dim", args[1] if len(args) > 1 else -1)
        return {"subnormal": subnormal_share(args[0] if args else kwargs.get("input"), dim if isinstance(dim, int) else -1)}
    if kind == "avg_pool":
        size = kwargs.get("output_size", args[1] if len(args) > 1 else None)
        return {"output_size": size}
    if kind == "mean":
        return {"global_pool": _global_pool(args, kwargs)}
    return {}


def _global_pool(args: Any, kwargs: dict[str, Any]) -> bool:
    """A mean over exactly the spatial dims of an image tensor (rank >= 4, dims 2 ..): a global
    average pool, exported as one (export/graph_forms.py). Rank 3 is left out: there a mean over the
    last dim is a norm's statistic."""
    x = args[0] if args else kwargs.get("input")
    dims = kwargs.get("dim", args[1] if len(args) > 1 else None)
    if not isinstance(x, torch.Tensor) or x.dim() < 4 or dims is None or kwargs.get("dtype") is not None:
        return False
    dims = [dims] if isinstance(dims, int) else list(dims)
    return all(isinstance(d, int) for d in dims) and sorted(d % x.dim() for d in dims) == list(range(2, x.dim()))


def trace_ops(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> OpGraph:
    """The OpGraph of ``model(*args, **kwargs)`` (run once, under no_grad, in the model's mode)."""
    tracer = GraphTracer(model)
    tracer.mark_inputs(args, kwargs)
    with torch.no_grad(), tracer.scopes.active(), tracer:
        out = model(*args, **kwargs)
    tracer.mark_outputs(out)
    return tracer.graph
