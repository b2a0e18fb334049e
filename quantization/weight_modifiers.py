"""Recipe modifiers for weight-only LLM quantization: ``type: gptq``, ``type: awq`` and ``type: autoround``.

Both calibrate layer by layer on the stage's calibration batches (quantization/algorithms/sequential.py) and
leave QuantLinear modules with per-group or per-channel weight qparams. In one stage,
``[awq, gptq]`` is AWQ's scaling and clipping followed by GPTQ's rounding.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from compress.quantization.algorithms.autoround import AutoRoundLayers, AutoRoundParams
from compress.quantization.algorithms.awq import awq_layer, scale_error_ratio
from compress.quantization.algorithms.awq_search import AWQParams
from compress.quantization.algorithms.gptq import GPTQParams, gptq_layer
from compress.quantization.algorithms.sequential import DEFAULT_SCHEME, sequential_quantize
from compress.quantization.numerics.spec import QuantScheme, resolve_scheme
from compress.quantization.preparation import (
    linearize,
    plan_targets,
    prepare_saved,
    quant_modules,
    saved_quantization,
    set_saved_flags,
)
from pydantic import field_validator
from torch import nn

from compress.core.batching import RankShare
from compress.core.errors import CalibrationError
from compress.core.modifier import Modifier, ModifierSpec, State, register_modifier


class _WeightOnlySpec(ModifierSpec):
    """The recipe's own field of gptq and awq: a weight-only scheme (preset name or mapping); the
    rest is the settings class each is made of (GPTQParams, AWQParams)."""

    kind: ClassVar[str] = "quantize"
    needs: ClassVar[frozenset[str]] = frozenset({"calibration"})
    calibration_flow: ClassVar[str] = "layer-by-layer"  # on_calibrate runs sequential_quantize

    scheme: str | QuantScheme = DEFAULT_SCHEME

    @field_validator("scheme", mode="before")
    @classmethod
    def _scheme(cls, v: Any) -> Any:
        s = resolve_scheme(v) if isinstance(v, (str, dict)) else v
        if isinstance(s, QuantScheme) and (s.weights is None or s.inputs is not None or s.outputs is not None):
            raise ValueError("needs a weight-only scheme (weights set, inputs and outputs null), e.g. w4_weight_only_g128")
        return s

    def resolved_scheme(self) -> QuantScheme:
        return resolve_scheme(self.scheme)


# Settings class first: its fields follow ModifierSpec's and the scheme in the resolved recipe.
class GPTQSpec(GPTQParams, _WeightOnlySpec):
    """GPTQ: ``block_size``, ``dampening`` (fraction of the mean Hessian diagonal) and
    ``act_order`` (columns in decreasing Hessian-diagonal order, static groups). The scheme may
    also quantize Linear inputs dynamically (``W8A8``, ``w8a8_dynamic``: llm-compressor's W8A8)."""

    type: Literal["gptq"] = "gptq"

    @field_validator("scheme", mode="before")
    @classmethod
    def _scheme(cls, v: Any) -> Any:
        s = resolve_scheme(v) if isinstance(v, (str, dict)) else v
        if isinstance(s, QuantScheme) and s.weights is not None and s.outputs is None and s.inputs is not None:
            if not s.inputs.dynamic:
                raise ValueError("static activation scales come from a ptq modifier; gptq takes weight-only or "
                                 "dynamic-activation schemes (W8A8, w8a8_dynamic)")
            return s
        return super()._scheme(v)


class AWQSpec(AWQParams, _WeightOnlySpec):
    """AWQ: scale search over ``grid`` alphas (``duo_scaling``: with the weight term), then a
    clipping search (``clip``) over ``clip_grid`` steps down to ``1 - max_shrink`` of each group's
    range, skipping ``clip_ignore``; ``sample_tokens``/``clip_tokens`` bound the searches' cost."""

    type: Literal["awq"] = "awq"


class AutoRoundSpec(AutoRoundParams, _WeightOnlySpec):
    """AutoRound: ``iters`` signed-gradient steps per layer at ``lr`` (default 1/iters) on
    ``batch_size`` samples per step, clipping factors learned at ``range_lr`` (``tune_range``),
    from round-to-nearest or from GPTQ's solution (``init: gptq``)."""

    type: Literal["autoround"] = "autoround"

    @field_validator("scheme", mode="after")
    @classmethod
    def _integer_grid(cls, v: Any) -> Any:
        w = resolve_scheme(v).weights
        if w is not None and w.is_float:
            # its rounding offsets and range factors are learned on integer grids; fp4/fp8 grids are not taken yet
            raise ValueError(f"AutoRound learns integer grids; {w.dtype} weights go to gptq, awq or ptq")
        return v


class _WeightOnlyModifier(Modifier[Any]):
    def plan(self, model: nn.Module) -> list[str]:
        s = self.spec
        return list(plan_targets(model, s.resolved_scheme(), s, where=self.where))

    #: set by the run: the model's quantized layers were all there before and none was added (GPTQ
    #: after AWQ or after a ptq modifier re-rounds their weights): the structure is the earlier one's
    refines = False

    def save_state(self, model: nn.Module) -> dict[str, Any]:
        return {**saved_quantization(model, self.spec), **({"refines": True} if self.refines else {})}

    @classmethod
    def restore_state(cls, model: nn.Module, data: dict[str, Any], *, where: str) -> None:
        if data.get("refines"):  # the earlier modifier's restore made the structure; weights come from the state_dict
            set_saved_flags(model, data)
            return
        s: Any = cls.spec_cls.model_validate(data["spec"])
        # weight-only: layers only, no first/last policy
        prepare_saved(model, data, s.resolved_scheme(), s, where=where)
        set_saved_flags(model, data)

    def _run(self, state: State, process: Any) -> dict[str, Any]:
        s = self.spec
        if state.calibration_data is None:
            raise CalibrationError(f"{self.where}: {s.type} needs calibration data (data.calibration_samples > 0)")
        was_training = state.model.training
        state.model.eval()
        linearize(state.model)
        before = {n for n, _ in quant_modules(state.model)}
        # under torchrun each rank runs the layer-by-layer pipeline on its share of the batches (GPTQ's
        # Hessians and AWQ's statistics are summed across ranks, so every rank quantizes alike)
        summary = sequential_quantize(
            state.model, RankShare(state.calibration_data, max_batches=s.num_batches), s.resolved_scheme(), process, s,
            device=state.device, where=self.where, activations=s.type == "gptq",
        )
        state.model.train(was_training)
        self.refines = bool(before) and {n for n, _ in quant_modules(state.model)} == before
        state.metrics["quantized_modules"] = summary["quantized_linears"]
        state.metrics[f"{s.type}_seconds"] = round(summary["seconds"], 2)
        return summary


@register_modifier
class GPTQModifier(_WeightOnlyModifier):
    """Handler of ``type: gptq``."""

    spec_cls = GPTQSpec

    def on_calibrate(self, state: State) -> None:
        p = self.spec
        summary = self._run(state, lambda i, layer, lin, calls: gptq_layer(layer, lin, calls, p))
        rows = [r for r in summary["layers"] if "gptq_error" in r]
        state.metrics["gptq_error"] = sum(r["gptq_error"] for r in rows)
        state.metrics["rtn_error"] = sum(r["rtn_error"] for r in rows)
        state.tables["gptq_layers"] = [
            {"layer": r["layer"], "linears": r["linears"], "rtn_error": r["rtn_error"], "gptq_error": r["gptq_error"]}
            for r in rows
        ]


@register_modifier
class AWQModifier(_WeightOnlyModifier):
    """Handler of ``type: awq``."""

    spec_cls = AWQSpec

    def on_calibrate(self, state: State) -> None:
        p = self.spec
        summary = self._run(state, lambda i, layer, lin, calls: awq_layer(layer, lin, calls, p, seed=i))
        rows = []
        for r in summary["layers"]:
            for g in r.get("groups", []):
                rows.append({"layer": r["layer"], "linears": ", ".join(g["consumers"]), "folded_into": g["producer"] or "-",
                             "alpha": g["alpha"], "unscaled_error": g.get("unscaled_error"), "error": g.get("error")})
        state.tables["awq_groups"] = rows
        state.metrics["awq_scaled_groups"] = sum(1 for r in rows if r["alpha"] is not None and r["alpha"] >= 0)
        ratio = scale_error_ratio(summary)
        if ratio is not None:
            state.metrics["awq_scale_error_ratio"] = round(ratio, 4)


@register_modifier
class AutoRoundModifier(_WeightOnlyModifier):
    """Handler of ``type: autoround``."""

    spec_cls = AutoRoundSpec

    def on_calibrate(self, state: State) -> None:
        summary = self._run(state, AutoRoundLayers(self.spec))
        rows = [r for r in summary["layers"] if r.get("autoround_best_loss") is not None]
        state.tables["autoround_layers"] = [
            {"layer": r["layer"], "linears": r["linears"], "start_mse": r["autoround_first_loss"],
             "best_mse": r["autoround_best_loss"]} for r in rows
        ]


__all__ = ["AWQModifier", "AWQSpec", "AutoRoundModifier", "AutoRoundSpec", "GPTQModifier", "GPTQSpec"]
