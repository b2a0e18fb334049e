"""Recipe modifiers ``type: sparsegpt`` and ``type: wanda``: one-shot, layer by layer on the
stage's calibration batches; every pruned Linear keeps its mask through the later stages.

    - type: sparsegpt
      pattern: "2:4"          # or unstructured with sparsity: 0.5
      ignore: []
      block_size: 128
      dampening: 0.01

Their kind is ``sparsify``: the order rules (compress.core.modifier) refuse one after a quantize
modifier (sparsity comes before quantization) and a structured ``prune`` after one.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
from compress.pruning.sparse.params import sparse_targets
from compress.pruning.sparse.sparsegpt import SparseGPTParams, sparsegpt_layer
from compress.pruning.sparse.wanda import WandaParams, wanda_layer
from compress.quantization.algorithms.sequential import sequential_quantize
from compress.quantization.preparation import linearize
from torch import nn

from compress.core.batching import RankShare
from compress.core.errors import CalibrationError
from compress.core.modifier import Modifier, ModifierSpec, State, register_modifier
from compress.core.sparsity import mask_of, set_mask


def _weight(m: nn.Module) -> torch.Tensor:
    w = m.weight
    assert isinstance(w, torch.Tensor)
    return w


class _SparseSpec(ModifierSpec):
    kind: ClassVar[str] = "sparsify"
    needs: ClassVar[frozenset[str]] = frozenset({"calibration"})
    calibration_flow: ClassVar[str] = "layer-by-layer"


# Settings class first: its fields follow ModifierSpec's in the resolved recipe.
class SparseGPTSpec(SparseGPTParams, _SparseSpec):
    """SparseGPT: ``sparsity`` or ``pattern`` (N:M), ``block_size``, ``dampening``."""

    type: Literal["sparsegpt"] = "sparsegpt"


class WandaSpec(WandaParams, _SparseSpec):
    """Wanda: ``sparsity`` or ``pattern`` (N:M)."""

    type: Literal["wanda"] = "wanda"


class _SparseModifier(Modifier[Any]):
    #: the per-layer function: (layer, linears, calls, spec) -> report
    layer_fn: ClassVar[Any]

    def __init__(self, spec: Any, *, where: str = "") -> None:
        super().__init__(spec, where=where)
        self.pruned: list[str] = []  # the Linears on_calibrate pruned

    def plan(self, model: nn.Module) -> list[str]:
        return sparse_targets(model, self.spec, where=self.where)

    def on_calibrate(self, state: State) -> None:
        s = self.spec
        if state.calibration_data is None:
            raise CalibrationError(f"{self.where}: {s.type} needs calibration data (data.calibration_samples > 0)")
        was_training = state.model.training
        state.model.eval()
        linearize(state.model)
        names = sparse_targets(state.model, s, where=self.where)
        fn = type(self).layer_fn
        summary = sequential_quantize(
            state.model, RankShare(state.calibration_data, max_batches=s.num_batches), None,
            lambda i, layer, lin, calls: fn(layer, lin, calls, s), s,
            device=state.device, where=self.where, plain_linears=names,
        )
        state.model.train(was_training)
        self.pruned = names
        zeros = total = 0
        for n in names:
            w = _weight(state.model.get_submodule(n))
            zeros, total = zeros + int((w == 0).sum()), total + w.numel()
        state.metrics["sparse_linears"] = len(names)
        state.metrics["sparsity"] = round(zeros / max(total, 1), 4)
        state.metrics[f"{s.type}_seconds"] = round(summary["seconds"], 2)
        rows = [r for r in summary["layers"] if "sparse_error" in r]
        if rows:
            state.metrics["sparse_error"] = sum(r["sparse_error"] for r in rows)

    def save_state(self, model: nn.Module) -> dict[str, Any]:
        # the zeros are in the state_dict; the masks (not saved there) are rebuilt from them on restore
        return {"pruned": [n for n in self.pruned if mask_of(model.get_submodule(n)) is not None]}

    @classmethod
    def restore_state(cls, model: nn.Module, data: dict[str, Any], *, where: str) -> None:
        names = list(data.get("pruned", []))
        for n in names:
            model.get_submodule(n)  # raises on a model without the module, before anything loads

        def masks_from_zeros(module: nn.Module, _: Any) -> None:
            for n in names:
                m = module.get_submodule(n)
                set_mask(m, _weight(m) != 0)
            handle.remove()

        handle = model.register_load_state_dict_post_hook(masks_from_zeros)


@register_modifier
class SparseGPTModifier(_SparseModifier):
    """Handler of ``type: sparsegpt``."""

    spec_cls = SparseGPTSpec
    layer_fn = staticmethod(sparsegpt_layer)


@register_modifier
class WandaModifier(_SparseModifier):
    """Handler of ``type: wanda``."""

    spec_cls = WandaSpec
    layer_fn = staticmethod(wanda_layer)


__all__ = ["SparseGPTModifier", "SparseGPTSpec", "WandaModifier", "WandaSpec"]
