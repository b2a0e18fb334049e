"""Recipe modifier ``type: rotate``: the exact orthogonal rotations of a decoder LLM
(quantization/algorithms/rotation.py), run when its stage starts, before the quantizers that
follow it in the recipe.

    - type: rotate
      matrix: hadamard      # or random
      heads: true           # also each value/output head pair (R2)
      seed: 0

Its kind is ``rotate``: the order rules (compress.core.modifier) refuse it after a quantize or a
sparsify modifier (a rotation would move the calibrated grids and fill the pruned zeros).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from compress.quantization.algorithms.rotation import RotationParams, rotate, untie_head
from compress.quantization.algorithms.sequential import decoder_layers
from torch import nn

from compress.core.modifier import Modifier, ModifierSpec, State, register_modifier


# Settings class first: its fields follow ModifierSpec's in the resolved recipe.
class RotateSpec(RotationParams, ModifierSpec):
    """Rotation: ``matrix`` (hadamard or random), ``heads`` (R2), ``seed``, ``tol``."""

    type: Literal["rotate"] = "rotate"
    kind: ClassVar[str] = "rotate"


@register_modifier
class RotateModifier(Modifier[RotateSpec]):
    """Handler of ``type: rotate``."""

    spec_cls = RotateSpec

    def __init__(self, spec: RotateSpec, *, where: str = "") -> None:
        super().__init__(spec, where=where)
        self.report: dict[str, Any] = {}

    def plan(self, model: nn.Module) -> list[str]:
        path, layers = decoder_layers(model)
        return [f"{path}.{i}" if path else str(i) for i in range(len(layers))]

    def on_initialize(self, state: State) -> None:
        was_training = state.model.training
        self.report = rotate(state.model, RotationParams(**{k: getattr(self.spec, k)
                                                             for k in RotationParams.model_fields}))
        state.model.train(was_training)
        state.metrics["rotated_layers"] = self.report["layers"]
        state.metrics["rotated_head_pairs"] = self.report["head_pairs"]
        state.metrics["rotation_logits_change"] = self.report["logits_relative_change"]

    def save_state(self, model: nn.Module) -> dict[str, Any]:
        # the rotated weights are in the state_dict; a tied head was untied, which the model rebuilt
        # from its config must be before that state loads
        return {"untied_head": bool(self.report.get("untied_head"))}

    @classmethod
    def restore_state(cls, model: nn.Module, data: dict[str, Any], *, where: str) -> None:
        if data.get("untied_head"):
            untie_head(model)


__all__ = ["RotateModifier", "RotateSpec"]
