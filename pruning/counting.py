"""Parameter and MAC counts measured on a model (conv, linear, matmul, attention), per sample.

One counter for the whole project: compress.core.size's torch-function mode (it sees ``@``,
``F.linear``, SDPA and ``nn.MultiheadAttention`` calls, not only modules)."""

from __future__ import annotations

from compress.core.size import count_macs, count_params

__all__ = ["count_macs", "count_params"]
