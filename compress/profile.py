"""Model size figures: parameters, bytes of the state dict, and multiply-accumulates per sample."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from compress.batching import batch_size_of, call_model


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


@torch.no_grad()
def count_macs(model: nn.Module, example_inputs: Any) -> int:
    """Multiply-accumulates of one forward pass per sample, from Conv/Linear/matmul shapes.

    Counted by forward hooks on the modules that hold the arithmetic (conv, linear, attention
    matmul modules); elementwise ops and norms are left out, as in the usual MACs convention.
    """
    total = 0

    def hook(m: nn.Module, inp: Any, out: Any) -> None:
        nonlocal total
        if isinstance(m, nn.modules.conv._ConvNd):
            total += out.numel() * (m.in_channels // m.groups) * int(torch.tensor(m.kernel_size).prod())
        elif isinstance(m, nn.Linear):
            total += out.numel() * m.in_features
        elif isinstance(m, nn.MultiheadAttention):
            # its projections run inside F.multi_head_attention_forward, not as submodule calls
            q = inp[0]
            tokens, e = q.numel() // q.shape[-1], m.embed_dim
            seq = q.shape[1] if m.batch_first else q.shape[0]
            total += 4 * tokens * e * e + 2 * tokens * seq * e
        else:  # MatMul modules: (..., n, k) @ (..., k, m)
            total += out.numel() * int(inp[0].shape[-1])

    handles = [
        mod.register_forward_hook(hook)
        for mod in model.modules()
        if isinstance(mod, (nn.modules.conv._ConvNd, nn.Linear, nn.MultiheadAttention))
        or type(mod).__name__ in ("MatMul", "QuantMatMul")
    ]
    was = model.training
    model.eval()
    try:
        call_model(model, example_inputs)
    finally:
        model.train(was)
        for h in handles:
            h.remove()
    n = batch_size_of(example_inputs)
    return total // max(n, 1)

