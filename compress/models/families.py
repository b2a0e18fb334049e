"""Small random-weight decoders of many transformers families, built from their configs: the suite
every LLM export and algorithm is checked on (tests/, benchmarks/), so that a capability is shown
on architectures this project did not write and that no export table lists.

Each entry sets only what makes a family itself (its norms, activation, positions, head layout,
window pattern, scalings); the sizes are shared. Nothing here is read by the exports: they take
what the built module shows.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from compress.core.errors import UnsupportedModelError
from compress.models.hf import _transformers

#: sizes every family shares: 2 layers, 4 query and 2 key/value heads (GQA), head_dim 16
SIZES: dict[str, Any] = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                             bos_token_id=1, eos_token_id=2, pad_token_id=0)

#: model_type -> what makes the family itself (config keyword arguments over :data:`SIZES`)
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": dict(sliding_window=4, use_sliding_window=True, max_window_layers=1),  # a window on layer 2 only
    "qwen3": dict(head_dim=16),  # per-head q/k RMSNorms
    "mistral": dict(sliding_window=8),  # every layer windowed
    "phi3": dict(partial_rotary_factor=0.5),  # fused qkv_proj and gate_up_proj, half the dims rotated
    "gemma": dict(head_dim=16, hidden_activation="gelu_pytorch_tanh"),  # (1 + weight) norms, scaled embedding
    "gemma2": dict(head_dim=16, sliding_window=4, query_pre_attn_scalar=16, attn_logit_softcapping=50.0,
                   final_logit_softcapping=30.0),  # pre/post norms, soft-capping, alternating windows
    "gemma3_text": dict(head_dim=16, sliding_window=4, query_pre_attn_scalar=16, rope_local_base_freq=10000.0,
                        layer_types=["sliding_attention", "full_attention"]),  # q/k norms, per-layer rope bases
    "olmo2": {},  # post-norms only, q/k norms over the whole projection
    "granite": dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.25,
                    logits_scaling=8.0),
    "stablelm": dict(partial_rotary_factor=0.25, use_qkv_bias=True),  # LayerNorm, partial rotary
    "cohere": dict(logit_scale=0.125, use_qk_norm=False),  # parallel attention and MLP, interleaved rotary
    "smollm3": dict(no_rope_layer_interval=2),  # NoPE on every second layer
}


def tiny_decoder(family: str, *, seed: int = 0, **overrides: Any) -> nn.Module:
    """A random-weight ``AutoModelForCausalLM`` of ``family`` (a :data:`FAMILIES` key or any
    transformers model_type), eval mode, fp32, eager attention; ``overrides`` go to its config."""
    transformers = _transformers("decoder families")
    kwargs = {**SIZES, **FAMILIES.get(family, {}), **overrides}
    try:
        config = transformers.AutoConfig.for_model(family, **kwargs)
    except ValueError as err:
        raise UnsupportedModelError(f"transformers {transformers.__version__} has no model_type {family!r}") from err
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model: Any = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8)  # sharper logits: a wrong graph moves the greedy tokens
        for p in model.parameters():  # norm weights and biases off their init (0 or 1), where a
            if p.ndim == 1:  # `1 + weight` norm read as a plain one would still compute the same
                p.add_(torch.randn_like(p) * 0.2)
    out: nn.Module = model.float().eval()
    return out
