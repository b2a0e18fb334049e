"""One int8 GEMM for the Linears that read the same tensor (q/k/v, gate/up): horizontal fusion.

A decoder layer's q_proj, k_proj and v_proj read one normalized tensor, and gate_proj and up_proj
another. Converted separately, each is its own GEMM launch over its own weight; at decode, where a
launch costs about as much as a 4096-wide layer's weight read, that is three launches where one
would do, each too narrow to keep every SM streaming. Serving stacks concatenate such weights at
load time (vLLM's fused QKV); transformers' modules call the projections one by one, so here the
layers stay as they are and share a :class:`HorizontalGemm`: the first of them to see a tensor runs
one GEMM over the concatenated weights and keeps the result; the others, given the same tensor
unchanged (identity and version counter, as :class:`~quantization.lowering.shared_input.SharedCodes`
checks), return their column slice of it. The members' weights become views of the concatenated
one: no second copy.

Which layers: those of one input-quantization group (they read their input identically) that were
seen reading one tensor, one after the other, in an eager call (:class:`ReaderTracker`, fed by the
layers' forward); the merge happens right after, never during CUDA-graph capture or under
torch.compile. Every element of the output is the same integer sum and the same epilogue as the
layer's own GEMM, so outputs are bit-identical to the unfused layers. A member called with a tensor
the group has not computed (another caller, an in-place change, inference-mode tensors, which carry
no version counter) runs its own slice of the weight alone: never a wrong or a wasted product.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

from quantization.lowering.kernels import load
from quantization.lowering.kernels.ops import compiling

log = logging.getLogger(__name__)


def _capturing() -> bool:
    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


class HorizontalGemm:
    """The concatenated weights of several Int8Linears reading one tensor, and the last product."""

    def __init__(self, members: list[Any]) -> None:
        self.members = members
        self.spans: list[tuple[int, int]] = []  # members[i]'s output columns (a deep copy keeps the order)
        start = 0
        for m in members:
            self.spans.append((start, start + m.out_features))
            start += m.out_features
        self._concatenate()
        for m in members:
            object.__setattr__(m, "horizontal", self)
        self._src: weakref.ref[torch.Tensor] | None = None
        self._version = -1
        self._out: torch.Tensor | None = None

    def _concatenate(self) -> None:
        """Concatenate the members' tensors and make theirs views of the result (again after the
        model was moved or cast: ``.to()`` gives each member new tensors of its own)."""
        members = self.members
        dev = members[0].weight_q.device
        self.weight_q = torch.cat([m.weight_q for m in members])
        self.weight_scale = torch.cat([m.weight_scale.float() for m in members])
        self.weight_colsum = torch.cat([m.weight_colsum for m in members])
        has_bias = any(m.bias is not None for m in members)
        self.bias = torch.cat([m.bias.float() if m.bias is not None else torch.zeros(m.out_features, device=dev)
                               for m in members]) if has_bias else None
        for m, (a, b) in zip(members, self.spans, strict=True):
            m._buffers["weight_q"] = self.weight_q[a:b]
            m._buffers["weight_scale"] = self.weight_scale[a:b]
            m._buffers["weight_colsum"] = self.weight_colsum[a:b]
            if self.bias is not None and m.bias is not None:
                m._buffers["bias"] = self.bias[a:b]

    def _stale(self) -> bool:
        first = self.members[0]
        return (first.weight_q.data_ptr() != self.weight_q.data_ptr()
                or first.weight_scale.data_ptr() != self.weight_scale.data_ptr())

    def output(self, member: Any, x: torch.Tensor) -> torch.Tensor | None:
        """``member``'s output for ``x`` as its slice of one GEMM over all members, or None when the
        member must compute alone (a tensor that cannot be matched to the last product)."""
        if x.is_inference() or torch.is_grad_enabled():
            return None
        src = self._src() if self._src is not None else None
        a, b = self.span(member)
        if src is x and x._version == self._version and self._out is not None:
            out = self._out
        else:
            if a != 0:  # not the group's first reader: another caller's tensor, compute alone
                return None
            if self._stale():  # moved or cast since the merge
                self._concatenate()
            lead = x.shape[:-1]
            xq, sa = member._codes(x, x.reshape(-1, member.in_features))
            y = load("gemm").int8_gemm(
                xq.reshape(-1, member.in_features), self.weight_q, a_scale=sa, b_scale=self.weight_scale,
                bias=self.bias, a_zero_point=member.input_zero_point, b_colsum=self.weight_colsum,
                activation=member.activation, out_dtype=member._out_dtype(x),
            )
            out = y.reshape(*lead, y.shape[-1])
            self._src, self._version, self._out = weakref.ref(x), x._version, out
        return out[..., a:b]

    def span(self, member: Any) -> tuple[int, int]:
        """The output columns of ``member`` in the concatenated product."""
        return self.spans[next(i for i, m in enumerate(self.members) if m is member)]

    def clear(self) -> None:
        """Forget the last product (frees its memory)."""
        self._src, self._version, self._out = None, -1, None


def _compatible(members: list[Any]) -> bool:
    first = members[0]
    return all(
        m.in_features == first.in_features and m.activation == first.activation and m.output_quantizer is None
        and m.input_signature() == first.input_signature() and getattr(m, "horizontal", None) is None
        and m.weight_q.device == first.weight_q.device
        for m in members
    )


class ReaderTracker:
    """Watches which layers of one input-quantization group read the same tensor, one after the
    other, and merges each such set (two or more) into a HorizontalGemm once."""

    def __init__(self) -> None:
        self._src: weakref.ref[torch.Tensor] | None = None
        self._version = -1
        self._readers: list[Any] = []
        self.merged = 0

    def observe(self, layer: Any, x: torch.Tensor) -> None:
        """Record that ``layer`` reads ``x`` (called by the layer's eager forward)."""
        if compiling() or _capturing() or x.is_inference() or torch.is_grad_enabled():
            return
        src = self._src() if self._src is not None else None
        if src is x and x._version == self._version:
            if layer not in self._readers:
                self._readers.append(layer)
            return
        self._finish()
        self._src, self._version, self._readers = weakref.ref(x), x._version, [layer]

    def _finish(self) -> None:
        readers = self._readers
        self._readers = []
        if len(readers) >= 2 and _compatible(readers):
            HorizontalGemm(readers)
            self.merged += len(readers)
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
