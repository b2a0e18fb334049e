"""Int8 key/value cache, simulated: fake-quantize the keys and values entering attention.

A decoder's cache stores every token's key and value once and reads them at every later step, so
quantizing the tensors that enter ``F.scaled_dot_product_attention`` (after RoPE, after the past
is concatenated) computes exactly what an int8 cache written once per token computes: per-token
scales depend on the token's own row only, and static scales are fixed, so quantizing again at
every step gives the same values.

Two layouts, the usual ones for int8 caches:

- ``per_token``: one symmetric scale per (head, token) row of ``head_dim`` values, computed when
  the token is written (no calibration);
- ``per_head``: one static symmetric scale per head for keys and one for values, calibrated with
  the other activation quantizers (what a cache with fixed scales in the checkpoint uses).

The quantizers sit in a ``kv_quantizer`` submodule of each attention module (so ``state_dict``
holds the per-head scales and the calibration sees them), and removable forward hooks on that
module enter a torch-function mode that quantizes the key and value operands of its SDPA calls;
transformers' Llama, Qwen2/3, Mistral and Phi-3-style attention modules (``k_proj``/``v_proj``
or ``qkv_proj``, SDPA attention) are found without a per-model table.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from compress.quantization.numerics.fake_quant import FakeQuantizer
from compress.quantization.numerics.spec import QuantSpec
from torch import nn
from torch.overrides import TorchFunctionMode

from compress.core.errors import UnsupportedModelError

log = logging.getLogger(__name__)

KVCache = Literal["per_token", "per_head"]
ATTR = "kv_quantizer"

SPECS: dict[str, QuantSpec] = {
    "per_token": QuantSpec(dtype="int8", symmetric=True, granularity="token", dynamic=True),
    "per_head": QuantSpec(dtype="int8", symmetric=True, granularity="channel", axis=1),
}


class KVQuantizer(nn.Module):
    """The key and value quantizers of one attention module."""

    def __init__(self, mode: KVCache, name: str) -> None:
        super().__init__()
        if mode not in SPECS:
            raise UnsupportedModelError(f"kv_cache: unknown layout '{mode}'; choose one of {sorted(SPECS)}")
        self.mode = mode
        self.key = FakeQuantizer(SPECS[mode], role="input", name=f"{name}.{ATTR}.key")
        self.value = FakeQuantizer(SPECS[mode], role="input", name=f"{name}.{ATTR}.value")
        self.calls = 0
        self._active: list[_KVMode] = []

    def extra_repr(self) -> str:
        return f"int8 {self.mode}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # not called; the hooks apply the quantizers
        return x


class _KVMode(TorchFunctionMode):
    """Quantizes the key and value operands of the SDPA calls made while it is active."""

    def __init__(self, kvq: KVQuantizer) -> None:
        super().__init__()
        self.kvq = kvq

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        args = list(args)
        for pos, name, q in ((1, "key", self.kvq.key), (2, "value", self.kvq.value)):
            if len(args) > pos:
                args[pos] = q(args[pos])
            elif name in kwargs:
                kwargs[name] = q(kwargs[name])
        self.kvq.calls += 1
        return func(*args, **kwargs)


# module-level hook functions that find the quantizer on the module they run for: a deep copy of
# the model (which copies hook dicts but not functions) then uses its own quantizers
def _enter(mod: nn.Module, args: Any) -> None:
    kvq = getattr(mod, ATTR, None)
    if isinstance(kvq, KVQuantizer):
        m = _KVMode(kvq)
        m.__enter__()
        kvq._active.append(m)


def _leave(mod: nn.Module, args: Any, out: Any) -> None:
    kvq = getattr(mod, ATTR, None)
    if isinstance(kvq, KVQuantizer) and kvq._active:
        kvq._active.pop().__exit__(None, None, None)


def attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The attention modules of a transformers decoder: those with ``k_proj`` and ``v_proj`` (or a
    fused ``qkv_proj``) children."""
    out = {}
    for name, mod in model.named_modules():
        kids = dict(mod.named_children())
        if ("k_proj" in kids and "v_proj" in kids) or "qkv_proj" in kids:
            out[name] = mod
    return out


def attach_kv_quantization(model: nn.Module, mode: KVCache) -> dict[str, KVQuantizer]:
    """Give every attention module of ``model`` an int8 key/value quantizer (in place); returns them.

    Static (``per_head``) quantizers still need calibration (``quantization.numerics.calibration.calibrate``
    finds them); ``per_token`` ones work at once. Raises UnsupportedModelError when the model has
    no attention module of a known shape."""
    attn = attention_modules(model)
    if not attn:
        raise UnsupportedModelError(
            f"kv_cache: {type(model).__name__} has no attention module with k_proj/v_proj (or qkv_proj) to quantize"
        )
    out = {}
    for name, mod in attn.items():
        if isinstance(getattr(mod, ATTR, None), KVQuantizer):
            raise UnsupportedModelError(f"kv_cache: {name} already has a {ATTR}; remove_kv_quantization() first")
        kvq = KVQuantizer(mode, name)
        p = next(mod.parameters(), None)
        if p is not None:
            kvq.to(p.device)
        mod.add_module(ATTR, kvq)
        mod.register_forward_pre_hook(_enter)
        mod.register_forward_hook(_leave, always_call=True)
        out[name] = kvq
    log.info("kv_cache: int8 %s keys/values in %d attention modules", mode, len(out))
    return out


def kv_quantizers(model: nn.Module) -> dict[str, KVQuantizer]:
    """The KV quantizers of ``model`` by attention module name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, KVQuantizer)}


def check_kv_calls(model: nn.Module) -> None:
    """Raise UnsupportedModelError when an attention module with a KV quantizer ran without an SDPA
    call (eager attention computes with matmuls, which these quantizers do not see)."""
    for name, kvq in kv_quantizers(model).items():
        if kvq.calls == 0:
            raise UnsupportedModelError(
                f"kv_cache: {name.rsplit('.', 1)[0]} ran without F.scaled_dot_product_attention (load the model with "
                "attn_implementation='sdpa'); its keys and values would not be quantized"
            )


def remove_kv_quantization(model: nn.Module) -> int:
    """Remove every KV quantizer and its hooks (in place); returns how many were removed."""
    n = 0
    for name in list(kv_quantizers(model)):
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        for hooks in (parent._forward_pre_hooks, parent._forward_hooks):
            for k in [k for k, fn in hooks.items() if fn in (_enter, _leave)]:
                del hooks[k]
        delattr(parent, ATTR)
        n += 1
    return n
