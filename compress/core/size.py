"""Model size figures: parameters, bytes of the state dict, and multiply-accumulates per sample."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from compress.core.batching import batch_size_of, call_model
from compress.core.tracing import ObserverMode, op_name


def count_params(model: nn.Module) -> int:
    """Number of parameters (shared ones counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def state_size_bytes(model: nn.Module) -> int:
    """Bytes the model's tensors take (parameters and buffers, in their stored dtypes)."""
    seen: dict[int, torch.Tensor] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        seen[id(t)] = t
    return sum(t.numel() * t.element_size() for t in seen.values())


def deployed_size_bytes(model: nn.Module) -> int:
    """Bytes the model's weights take deployed: a weight with an enabled weight quantizer at its bit
    width (int8: 1 byte, int4: half), every other parameter and buffer in its dtype, quantizer
    scales included; observers' running statistics and empty placeholders are not deployed.

    In-memory sizes show a fake-quant model as large as (or larger than) its float baseline; this
    is the figure the report plots against accuracy."""
    quantized: dict[int, float] = {}
    skip: set[int] = set()
    for m in model.modules():
        q = getattr(m, "weight_quantizer", None)
        w = getattr(m, "weight", None)
        if q is not None and getattr(q, "enabled", False) and isinstance(w, torch.Tensor):
            quantized[id(w)] = getattr(q.spec, "bits", 8) / 8
        obs = getattr(m, "observer", None)
        if isinstance(obs, nn.Module):
            skip.update(id(t) for t in obs.buffers())
    seen: dict[int, torch.Tensor] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in skip and t.numel() > 0:
            seen[id(t)] = t
    total = sum(t.numel() * quantized.get(i, t.element_size()) for i, t in seen.items())
    return round(total)


class _MacCounter(ObserverMode):
    """Adds up the multiply-accumulates of every conv, linear, matmul and attention call it sees
    (functional ones and operators included: ``@``, ``F.linear``, ``F.scaled_dot_product_attention``).
    A call runs with the mode off, so what it calls inside itself is not counted twice. Names are
    taken as written: ``addmm_`` (in place) is not counted, ``__rmatmul__`` swaps its operands."""

    def __init__(self) -> None:
        super().__init__()
        self.macs = 0

    def observe(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        name = op_name(func)
        if name in _MAC_OPS:
            # an unusual call signature is not a MAC op we count
            with contextlib.suppress(IndexError, KeyError, TypeError, AttributeError, RuntimeError):
                self.macs += _macs(name, args, kwargs, out)


_MAC_OPS = frozenset({
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "linear", "addmm",
    "matmul", "mm", "bmm", "baddbmm", "__matmul__", "__rmatmul__", "einsum", "scaled_dot_product_attention",
    "multi_head_attention_forward",
})


def _macs(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    if name in ("conv1d", "conv2d", "conv3d"):
        w = args[1] if len(args) > 1 else kwargs["weight"]
        return int(out.numel() * w[0].numel())
    if name.startswith("conv_transpose"):
        x, w = args[0], args[1] if len(args) > 1 else kwargs["weight"]
        return int(x.numel() * w[0].numel())
    if name == "linear":
        w = args[1] if len(args) > 1 else kwargs["weight"]
        return int(out.numel() * w.shape[1])
    if name == "addmm":
        return int(out.numel() * args[1].shape[-1])
    if name == "baddbmm":
        return int(out.numel() * args[1].shape[-1])
    if name in ("matmul", "mm", "bmm", "__matmul__", "__rmatmul__"):
        a, b = (args[1], args[0]) if name == "__rmatmul__" else (args[0], args[1])
        if a.dim() < 2 or b.dim() < 2:
            return int(a.numel() if a.dim() == 1 else b.numel())
        return int(out.numel() * a.shape[-1])
    if name == "einsum":  # every index of the operands is summed or kept: the product of all sizes
        equation = args[0]
        operands = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
        if "." in equation:
            return 0  # broadcast dims (...) have no letter to size them by
        sizes: dict[str, int] = {}
        for spec, t in zip(equation.split("->")[0].split(","), operands, strict=False):
            for ch, n in zip(spec.strip(), t.shape, strict=False):
                sizes[ch] = int(n)
        return math.prod(sizes.values())
    if name == "scaled_dot_product_attention":
        q, k, v = args[:3]
        batch = math.prod(q.shape[:-2])
        return int(batch * q.shape[-2] * k.shape[-2] * (q.shape[-1] + v.shape[-1]))
    if name == "multi_head_attention_forward":
        return _mha_macs(args, kwargs)
    return 0


def _mha_macs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """In-projections, the two attention products and the out-projection of one
    ``F.multi_head_attention_forward`` call (inputs sequence-first or unbatched)."""
    names = ("query", "key", "value", "embed_dim_to_check", "num_heads", "in_proj_weight")
    a = dict(zip(names, args, strict=False)) | kwargs
    q, k, v = a["query"], a["key"], a["value"]
    e = int(a["embed_dim_to_check"])
    w_out = args[11] if len(args) > 11 else kwargs["out_proj_weight"]
    tq, tk = q.numel() // q.shape[-1], k.numel() // k.shape[-1]
    batch = q.shape[1] if q.dim() == 3 else 1
    proj = tq * q.shape[-1] * e + tk * k.shape[-1] * e + tk * v.shape[-1] * e
    attention = 2 * (tq // batch) * (tk // batch) * batch * e
    return int(proj + attention + tq * e * w_out.shape[0])


@torch.no_grad()
def count_macs(model: nn.Module, example_inputs: Any) -> int:
    """Multiply-accumulates of one forward pass per sample: every conv, linear, matmul (``@``,
    ``bmm``, ``einsum``) and attention call (SDPA, ``nn.MultiheadAttention``), seen by a torch-function
    mode, so models written with plain tensor ops count fully; elementwise ops and norms are left
    out, as in the usual MACs convention.

    Not ``torch.utils.flop_counter.FlopCounterMode``: it counts at aten level and, on CPU, misses
    ``nn.MultiheadAttention``'s fused eval path (``_native_multi_head_attention``: 0 MACs) and the
    fused SDPA kernel (BERT and GPT-2 lose their attention products), so its figures are lower on
    models this one counts exactly (it agrees on convs, linears and decomposed attention)."""
    counter = _MacCounter()
    was = model.training
    model.eval()
    try:
        with counter:
            call_model(model, example_inputs)
    finally:
        model.train(was)
    n = batch_size_of(example_inputs)
    return counter.macs // max(n, 1)
