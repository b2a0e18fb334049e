"""Mixture-of-experts blocks as one ``nn.Linear`` per expert projection.

transformers (5.x) stores a MoE block's experts as 3D Parameters, ``gate_up_proj`` (or ``up_proj``)
``[E, out, in]`` and ``down_proj`` (``[E, in, out]`` when ``is_transposed``, biases optional), and
runs them through grouped or batched matmul kernels chosen by ``config._experts_implementation``
(``transformers.integrations.moe.use_experts_implementation``: Mixtral, Qwen2/3-MoE, DeepSeek,
OLMoE, GPT-OSS and ~60 more). No Linear exists there for quantization, GPTQ/AWQ or export to find,
so the experts, most of such a model's weights, would stay float, and the ONNX exporter has no
function for the grouped-matmul op. :func:`unpack_experts` swaps each such module, found by that
convention rather than by model name, for :class:`UnpackedExperts`: per expert, Linears holding the
same values, and the module's own gating (``_apply_gate``: SwiGLU, GPT-OSS's clamped GLU),
activation and post-expert norm. Exact in float up to summation order.

Routing is kept: an expert's output counts only for the tokens the router sent to it. With
``dense`` (the default) every expert runs on every token and the others get weight 0, as
llm-compressor calibrates MoE models: each expert's observers and GPTQ/AWQ statistics see data even
when the calibration set routes few tokens to it, and the ONNX graph has no data-dependent shapes
(ORT then computes every expert, E / top-k times the routed work). ``dense = False`` runs only the
routed tokens through each expert (eager PyTorch, for speed).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from torch import nn

log = logging.getLogger(__name__)
_Fn = Callable[[torch.Tensor], torch.Tensor]


def is_packed_experts(m: nn.Module) -> bool:
    """transformers' experts convention: 3D ``down_proj`` and ``gate_up_proj`` / ``up_proj``
    Parameters with the layout flags ``use_experts_implementation`` sets."""
    if not (hasattr(m, "has_gate") and hasattr(m, "is_transposed") and hasattr(m, "num_experts")):
        return False
    up = getattr(m, "gate_up_proj" if m.has_gate else "up_proj", None)
    down = getattr(m, "down_proj", None)
    return (isinstance(up, nn.Parameter) and isinstance(down, nn.Parameter) and up.dim() == 3 and down.dim() == 3
            and up.shape[0] == down.shape[0] == m.num_experts)


def _linear(w: torch.Tensor, b: torch.Tensor | None, transposed: bool, requires_grad: bool) -> nn.Linear:
    w = w.t() if transposed else w
    lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device="meta", dtype=w.dtype)
    # views of the packed tensors (no copy: unpacking costs no memory, and a temporary unpack for an
    # export leaves the packed module as it was); trainable as they were
    lin.weight = nn.Parameter(w.detach(), requires_grad=requires_grad)
    if b is not None:
        lin.bias = nn.Parameter(b.detach(), requires_grad=requires_grad)
    return lin


class ExpertMLP(nn.Module):
    """One expert's projections: ``gate_up_proj`` (or ``up_proj``) and ``down_proj`` Linears."""

    def __init__(self, up_name: str, up: nn.Linear, down: nn.Linear) -> None:
        super().__init__()
        self.up_name = up_name
        self.add_module(up_name, up)
        self.down_proj = down

    @property
    def up(self) -> nn.Module:
        """The input projection (``gate_up_proj`` or ``up_proj``)."""
        mod: nn.Module = getattr(self, self.up_name)
        return mod


class UnpackedExperts(nn.Module):
    """transformers' packed experts as ``ExpertMLP`` children ``"0"`` .. ``"E-1"``; called like the
    packed module: ``(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``."""

    def __init__(self, packed: Any, *, dense: bool = True) -> None:
        super().__init__()
        up_name = "gate_up_proj" if packed.has_gate else "up_proj"
        up_w, down_w = getattr(packed, up_name), packed.down_proj
        bias = bool(getattr(packed, "has_bias", False))
        t = bool(packed.is_transposed)
        # the module's plain attributes (config, layout flags, GPT-OSS's alpha/limit) and submodules
        # (act_fn, post_expert_norm) carry over, so its own _apply_gate runs unchanged on this one
        for k, v in vars(packed).items():
            if not k.startswith("_") and not isinstance(v, (torch.Tensor, nn.Module)):
                object.__setattr__(self, k, v)
        for k, child in packed.named_children():
            self.add_module(k, child)
        for k, buf in packed.named_buffers(recurse=False):
            self.register_buffer(k, buf)
        packed_params = {up_name, "down_proj", f"{up_name}_bias", "down_proj_bias"}
        for k, p in packed.named_parameters(recurse=False):
            if k not in packed_params:
                self.register_parameter(k, p)
        self._gate: Callable[[Any, torch.Tensor], torch.Tensor] | None = (
            type(packed)._apply_gate if packed.has_gate else None)
        self.dense = dense
        self.n_experts = int(packed.num_experts)
        grad = bool(up_w.requires_grad)
        for e in range(self.n_experts):
            up = _linear(up_w[e], getattr(packed, f"{up_name}_bias")[e] if bias else None, t, grad)
            down = _linear(down_w[e], packed.down_proj_bias[e] if bias else None, t, grad)
            self.add_module(str(e), ExpertMLP(up_name, up, down))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` on rows ``x`` (before the routing weight)."""
        ex: ExpertMLP = getattr(self, str(e))
        h = ex.up(x)
        h = self._gate(self, h) if self._gate is not None else cast(_Fn, self.act_fn)(h)
        h = ex.down_proj(h)
        if getattr(self, "has_post_expert_norm", False):
            h = cast(_Fn, self.post_expert_norm)(h)
        return h

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        n = self.n_experts
        if self.dense or torch.compiler.is_compiling() or torch.jit.is_tracing():
            # summed from the first expert's output, not from zeros_like(hidden_states): that op would
            # read the experts' (quantized) input as one more consumer of its quantizer
            total: torch.Tensor | None = None
            for e in range(n):
                w = (top_k_weights * (top_k_index == e).to(top_k_weights.dtype)).sum(dim=-1, keepdim=True)
                y = self.expert(e, hidden_states) * w.to(hidden_states.dtype)
                total = y if total is None else total + y
            assert total is not None  # a block has at least one expert
            return total
        out = torch.zeros_like(hidden_states)
        for e in range(n):
            token, slot = torch.where(top_k_index == e)
            if token.numel() == 0:
                continue
            y = self.expert(e, hidden_states[token]) * top_k_weights[token, slot, None].to(hidden_states.dtype)
            out.index_add_(0, token, y)
        return out


def unpack_experts(model: nn.Module, *, dense: bool = True) -> list[str]:
    """Swap every packed-experts module of ``model`` (transformers' convention, see the module
    docstring) for :class:`UnpackedExperts`, in place; returns the swapped names."""
    swapped = []
    for name, mod in list(model.named_modules()):
        if name and is_packed_experts(mod):
            model.set_submodule(name, UnpackedExperts(mod, dense=dense).train(mod.training))
            swapped.append(name)
    if swapped:
        n = getattr(model.get_submodule(swapped[0]), "n_experts", "?")
        log.info("unpacked %d MoE expert blocks (%s experts each) into per-expert nn.Linear", len(swapped), n)
    return swapped


@contextlib.contextmanager
def unpacked_experts(model: nn.Module) -> Iterator[list[str]]:
    """``model`` with its packed expert blocks unpacked for the duration (an export), then the
    packed modules put back: a training loop's optimizer keeps holding the model's Parameters."""
    packed = {n: m for n, m in model.named_modules() if n and is_packed_experts(m)}
    names = unpack_experts(model)
    try:
        yield names
    finally:
        for n, m in packed.items():
            model.set_submodule(n, m)


def expert_blocks(model: nn.Module) -> dict[str, UnpackedExperts]:
    """The unpacked expert blocks of ``model`` by name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, UnpackedExperts)}


def set_dense(model: nn.Module, dense: bool) -> None:
    """Run every unpacked expert block densely (all experts on all tokens) or routed only."""
    for m in expert_blocks(model).values():
        m.dense = dense


__all__ = ["ExpertMLP", "UnpackedExperts", "expert_blocks", "is_packed_experts", "set_dense", "unpack_experts",
           "unpacked_experts"]
