"""The settings SparseGPT and Wanda share, and the Linears they prune."""

from __future__ import annotations

import logging
import re

from compress.quantization.algorithms.sequential import decoder_layers, split_by_layer
from compress.quantization.numerics.modules import QuantLinear
from compress.quantization.preparation import unwrap
from pydantic import Field, field_validator, model_validator
from torch import nn

from compress.core.errors import RecipeError, TargetMatchError
from compress.core.params import Selection
from compress.core.targets import select_modules

log = logging.getLogger(__name__)

_NM = re.compile(r"^(\d+):(\d+)$")


class SparsityParams(Selection):
    """What SparseGPT and Wanda share: ``sparsity``, the fraction of each Linear's weights set to
    zero (unstructured: any place; 0 < sparsity < 1), and ``pattern``: ``unstructured`` or ``N:M``
    (``2:4``: in every group of M consecutive input columns of a row, N are kept; the sparsity is
    then 1 - N/M and need not be given). ``targets``/``ignore`` select among the decoder layers'
    Linears (``*``: all of them; a Linear outside the decoder layers, such as ``lm_head``, is not
    pruned); ``num_batches``: calibration batches read."""

    sparsity: float = Field(0.5, gt=0, lt=1)
    pattern: str = "unstructured"

    @field_validator("pattern")
    @classmethod
    def _pattern(cls, v: str) -> str:
        if v == "unstructured":
            return v
        m = _NM.match(v)
        if m is None:
            raise ValueError("pattern is 'unstructured' or 'N:M' (e.g. '2:4')")
        n, mm = int(m.group(1)), int(m.group(2))
        if not 0 < n < mm:
            raise ValueError(f"N:M keeps N of every M weights: it needs 0 < N < M (got {n}:{mm})")
        return v

    @model_validator(mode="after")
    def _sparsity_of_pattern(self) -> SparsityParams:
        nm = self.nm
        if nm is not None and "sparsity" in self.model_fields_set and abs(self.sparsity - (1 - nm[0] / nm[1])) > 1e-9:
            raise ValueError(f"sparsity {self.sparsity} contradicts pattern {self.pattern}, which prunes "
                             f"{1 - nm[0] / nm[1]:g}: give one of them")
        return self

    @property
    def nm(self) -> tuple[int, int] | None:
        """``(N, M)`` of an N:M pattern, None when unstructured."""
        m = _NM.match(self.pattern)
        return (int(m.group(1)), int(m.group(2))) if m else None

    @property
    def pruned_fraction(self) -> float:
        """The fraction of each pruned Linear's weights that become zero."""
        nm = self.nm
        return 1 - nm[0] / nm[1] if nm is not None else self.sparsity


def sparse_targets(model: nn.Module, params: SparsityParams, *, where: str, quantizing: bool = False) -> list[str]:
    """The Linears ``params`` prunes (full names, all inside the decoder layers); nothing is changed.

    Refused, naming the module: a Linear outside the decoder layers that a pattern other than ``*``
    selects; a pattern whose M does not divide a Linear's input width; a Linear quantized already
    (sparsity comes before quantization)."""
    root = unwrap(model)
    path, _ = decoder_layers(root)
    # GPT-2's Conv1D counts as the Linear it becomes (quantization.preparation.linearize, before pruning)
    conv1d = tuple({type(m) for m in root.modules() if type(m).__name__ == "Conv1D" and hasattr(m, "nf")})
    selected = select_modules(root, params.targets, ignore=params.ignore, types=(nn.Linear, *conv1d),
                              where=f"{where}: targets")
    _, _, outside = split_by_layer(root, list(selected))
    if outside and params.targets != ["*"]:
        raise TargetMatchError(f"{where}: targets: {outside[0]} is outside the decoder layers ({path}); only their "
                               "Linears are pruned (add it to ignore)")
    names = [n for n in selected if n not in set(outside)]
    if outside:
        log.debug("%s: %s outside the decoder layers: not pruned", where, ", ".join(outside))
    nm = params.nm
    for n in names:
        m = selected[n]
        if isinstance(m, QuantLinear) and not quantizing:
            raise RecipeError(f"{where}: {n} is quantized already: prune before quantizing (sparsity, then GPTQ/AWQ/RTN)")
        width = m.in_features if isinstance(m, nn.Linear) else int(getattr(m, "weight").shape[0])  # noqa: B009  # Conv1D: [in, out]
        if nm is not None and width % nm[1]:
            raise RecipeError(f"{where}: pattern: {params.pattern} needs each Linear's input width divisible by "
                              f"{nm[1]}; {n} has {width}")
    if not names:
        raise TargetMatchError(f"{where}: targets: no Linear of the decoder layers ({path}) is selected")
    return names
