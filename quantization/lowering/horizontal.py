"""One int8 GEMM for the Linears that read the same tensor (q/k/v, gate/up): horizontal fusion.

A decoder layer's q_proj, k_proj and v_proj read one normalized tensor, and gate_proj and up_proj
another. Converted separately, each is its own GEMM launch over its own weight; at decode, where a
launch costs about as much as a 4096-wide layer's weight read, that is three launches where one
would do, each too narrow to keep every SM streaming. Serving stacks concatenate such weights at
load time (vLLM's fused QKV); transformers' modules call the projections one by one, so here the
layers stay as they are and share a :class:`HorizontalGemm`: the first of them to see a tensor runs
one GEMM over the concatenated weights; the others, given the same tensor unchanged (identity and
version counter, as :class:`~quantization.lowering.shared_input.SharedCodes` checks), return their
column slice of it, and the product is released once every member took its slice. The members'
weights are views of the concatenated tensors, which nothing else holds: no second copy, and a
model moved or cast (``.to()`` gives each member new tensors) is concatenated again at its next call.

Which layers: those of one input-quantization group (they read their input identically) seen
reading one tensor, one after the other (:class:`ReaderTracker`, fed by the layers' eager
forward). Each reader that joins extends the group at once, so one eager call is enough. Once a
layer of the group has run under CUDA-graph capture, its tracker merges nothing more: a graph
keeps reading the tensors it captured, which a later merge would free. Not under torch.compile,
not under autograd, not for ``torch.inference_mode`` tensors (no version counter: logged once).

Every element of the output is the same integer sum and the same epilogue as the layer's own GEMM,
so outputs are bit-identical to the unfused layers. A member called with a tensor the group has not
computed (another caller, an in-place change) runs its own slice of the weight alone. The outputs
are column slices of one product (strided views, not contiguous): splitting the last dimension
(heads) works as before, flattening it with other dimensions by ``view`` does not.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch
from compress.quantization.lowering.kernels import load
from compress.quantization.lowering.kernels.ops import compiling

log = logging.getLogger(__name__)
_TENSORS = ("weight_q", "weight_scale", "weight_colsum", "bias")
_warned_inference = False


def _capturing() -> bool:
    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _off_for(x: torch.Tensor) -> bool:
    """Whether sharing across layers is off for this call (autograd, inference-mode tensors)."""
    global _warned_inference
    if x.is_inference():
        if not _warned_inference:
            _warned_inference = True
            log.warning("a converted model runs under torch.inference_mode: its tensors carry no version counter, "
                        "so layers reading one tensor cannot share its GEMM or quantization; torch.no_grad() keeps them")
        return True
    return torch.is_grad_enabled()


class HorizontalGemm:
    """Several Int8Linears reading one tensor: their weights are slices of one concatenation."""

    def __init__(self, members: list[Any]) -> None:
        self.members = members
        self.spans: list[tuple[int, int]] = []  # members[i]'s output columns (a deep copy keeps the order)
        start = 0
        for m in members:
            self.spans.append((start, start + m.out_features))
            start += m.out_features
        self.has_bias = any(m.bias is not None for m in members)
        self._concatenate()
        for m in members:
            object.__setattr__(m, "horizontal", self)
        self._src: weakref.ref[torch.Tensor] | None = None
        self._version = -1
        self._out: torch.Tensor | None = None
        self._served: set[int] = set()

    def __getstate__(self) -> dict[str, Any]:
        # torch.save of a model: the last product and its tensor's weak reference are not state
        return {**self.__dict__, "_src": None, "_version": -1, "_out": None, "_served": set()}

    def _concatenate(self) -> None:
        """Concatenate the members' tensors and make theirs views of the result."""
        members = self.members
        dev = members[0].weight_q.device
        cat = {
            "weight_q": torch.cat([m.weight_q for m in members]),
            "weight_scale": torch.cat([m.weight_scale.float() for m in members]),
            "weight_colsum": torch.cat([m.weight_colsum for m in members]),
        }
        if self.has_bias:
            cat["bias"] = torch.cat([m.bias.float() if m.bias is not None else torch.zeros(m.out_features, device=dev)
                                     for m in members])
        for m, (a, b) in zip(members, self.spans, strict=True):
            for name, full in cat.items():
                if name != "bias" or m.bias is not None:
                    m._buffers[name] = full[a:b]

    def tensors(self) -> dict[str, torch.Tensor] | None:
        """The concatenated tensors, found as the common base of the members' views, or None when
        any member's tensor is no longer its slice of it (moved, cast, reassigned, loaded)."""
        out: dict[str, torch.Tensor] = {}
        for name in _TENSORS if self.has_bias else _TENSORS[:3]:
            base = None
            for m, (a, b) in zip(self.members, self.spans, strict=True):
                t = getattr(m, name)
                if t is None:  # a member without a bias: zeros in the concatenation
                    continue
                base = base if base is not None else t._base
                if base is None or t._base is not base or t.data_ptr() != base[a:b].data_ptr() or t.shape != base[a:b].shape:
                    return None
            if base is None:
                return None
            out[name] = base
        return out

    def output(self, member: Any, x: torch.Tensor) -> torch.Tensor | None:
        """``member``'s output for ``x`` as its slice of one GEMM over all members, or None when the
        member must compute alone (a tensor that cannot be matched to the group's product)."""
        if _off_for(x):
            return None
        i = next(j for j, m in enumerate(self.members) if m is member)
        a, b = self.spans[i]
        src = self._src() if self._src is not None else None
        if src is x and x._version == self._version and self._out is not None and i not in self._served:
            out = self._out
        else:
            if i != 0:  # not the group's first reader: another caller's tensor, compute alone
                return None
            full = self.tensors()
            if full is None:  # a member's tensors were replaced since the merge
                self._concatenate()
                full = self.tensors()
                assert full is not None
            lead = x.shape[:-1]
            xq, sa = member._codes(x, x.reshape(-1, member.in_features))
            y = load("gemm").int8_gemm(
                xq.reshape(-1, member.in_features), full["weight_q"], a_scale=sa, b_scale=full["weight_scale"],
                bias=full.get("bias"), a_zero_point=member.input_zero_point, b_colsum=full["weight_colsum"],
                activation=member.activation, out_dtype=member._out_dtype(x),
            )
            out = y.reshape(*lead, y.shape[-1])
            self._src, self._version, self._out, self._served = weakref.ref(x), x._version, out, set()
        self._served.add(i)
        if len(self._served) == len(self.members):  # every member has its slice: the product is theirs now
            self._out = None
        return out[..., a:b]

    def span(self, member: Any) -> tuple[int, int]:
        """The output columns of ``member`` in the concatenated product."""
        return self.spans[next(i for i, m in enumerate(self.members) if m is member)]


def _compatible(members: list[Any]) -> bool:
    first = members[0]
    return all(
        m.in_features == first.in_features and m.activation == first.activation and m.output_quantizer is None
        and m.input_signature() == first.input_signature() and m.weight_q.device == first.weight_q.device
        for m in members
    )


class ReaderTracker:
    """Watches which layers of one input-quantization group read the same tensor, one after the
    other, and makes each such set (two or more) a HorizontalGemm, extended as readers join."""

    def __init__(self) -> None:
        self._src: weakref.ref[torch.Tensor] | None = None
        self._version = -1
        self._readers: list[Any] = []
        self.frozen = False  # a layer of the group ran under graph capture: merge nothing more

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_src": None, "_version": -1, "_readers": []}

    def observe(self, layer: Any, x: torch.Tensor) -> None:
        """Record that ``layer`` reads ``x`` (called by the layer's forward)."""
        if self.frozen or compiling():
            return
        if _capturing():
            self.frozen = True
            return
        if x.is_inference() or torch.is_grad_enabled():
            return
        src = self._src() if self._src is not None else None
        if not (src is x and x._version == self._version):
            self._src, self._version, self._readers = weakref.ref(x), x._version, [layer]
            return
        if any(r is layer for r in self._readers):
            return
        self._readers.append(layer)
        self._merge(self._readers)

    def _merge(self, readers: list[Any]) -> None:
        current = readers[0].horizontal
        if current is not None and all(any(r is m for m in current.members) for r in readers):
            return  # the group already holds these readers (later calls: they read in the same order)
        # a reader already in another group (read elsewhere first): leave both as they are
        if any(r.horizontal is not None and r.horizontal is not current for r in readers):
            return
        if not _compatible(readers):
            return
        for r in readers:  # the group grows: its members leave the smaller one
            object.__setattr__(r, "horizontal", None)
        HorizontalGemm(list(readers))
        log.debug("horizontal GEMM: %d layers now share one GEMM", len(readers))


def track_readers(layers: list[Any]) -> int:
    """Give layers that share an input quantization (``shared_codes``) a ReaderTracker per group.
    Returns how many layers are tracked."""
    trackers: dict[int, ReaderTracker] = {}
    n = 0
    for layer in layers:
        cache = getattr(layer, "shared_codes", None)
        if cache is None:
            continue
        tracker = trackers.setdefault(id(cache), ReaderTracker())
        object.__setattr__(layer, "reader_tracker", tracker)
        n += 1
    return n
