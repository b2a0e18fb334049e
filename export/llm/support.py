"""Whether an LLM export can take a model, from the model's structure alone (its config and module
tree): no weights read, so the checks run on a meta-device model (a dry run's GGUF skeleton) as on a
loaded one, and no optional runtime imported.

Each check is the one its export calls first, so a refusal reads the same before a run and at its
export: :func:`export.llm.decoder.check_decoder` (the generation ONNX, and the GenAI / Optimum
runtime files beside it), :func:`export.llm.gguf_file.check_gguf`,
:func:`export.llm.compressed_tensors.check_compressed_tensors`. :func:`requested_checks` says which
of them an ``export:`` section asks for; ``compress.preflight`` runs those before anything trains.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from compress.export.llm.decoder import check_decoder
from compress.export.specs import ExportSpec
from torch import nn

Check = Callable[[nn.Module], Any]


def requested_checks(spec: ExportSpec) -> list[tuple[str, Check]]:
    """``(field, check)`` for each LLM export ``spec`` asks for: the field of the ``export:`` section
    that asks (``"generation"``) and the structural check of the export it runs. Empty when the
    section asks for none (the single-pass ONNX export refuses by tracing, not by family)."""
    if not spec.enabled:
        return []
    checks: list[tuple[str, Check]] = []
    if spec.generation:  # export_llm_onnx, and the GenAI/Optimum runtime files beside its graph
        checks.append(("generation", check_decoder))
    if spec.compressed_tensors:
        from compress.export.llm.compressed_tensors import check_compressed_tensors

        checks.append(("compressed_tensors", check_compressed_tensors))
    return checks
