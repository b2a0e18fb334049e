"""Recipe modifiers: ``type: ptq`` (post-training calibration) and ``type: qat`` (quantization-aware
training). Both prepare the model by module swap; see quantization/preparation.py."""

from __future__ import annotations

import logging
from typing import Any, ClassVar, Literal

import torch
from compress.quantization.algorithms.kv_cache import KVCache, attach_kv_quantization
from compress.quantization.algorithms.sensitivity import (
    Evaluate,
    accuracy_control,
    layer_sensitivity,
    plot_sensitivity,
    worsening,
)
from compress.quantization.api import QuantizeParams, post_training_quantize
from compress.quantization.numerics.calibration import calibrate
from compress.quantization.numerics.fake_quant import FakeQuantizer
from compress.quantization.numerics.modules import QuantConv1d, QuantConv2d
from compress.quantization.numerics.spec import QuantScheme, QuantSpec, resolve_scheme
from compress.quantization.placement.activations import capture_first_call
from compress.quantization.preparation import (
    PrepareParams,
    calibrate_weight,
    plan_targets,
    prepare,
    prepare_saved,
    quant_modules,
    quantizers,
    saved_quantization,
    set_saved_flags,
)
from compress.quantization.view import view
from pydantic import Field, ValidationInfo, field_validator, model_validator
from torch import nn

from compress.core.batching import ForwardLoop, as_forward_loop
from compress.core.errors import CalibrationError, RecipeError
from compress.core.modifier import Modifier, ModifierSpec, State, register_modifier

log = logging.getLogger(__name__)


class _QuantSpecBase(ModifierSpec):
    """The recipe's own fields of ptq and qat: the scheme and its observer overrides (the rest is the
    settings class each is made of: QuantizeParams, PrepareParams)."""

    kind: ClassVar[str] = "quantize"

    scheme: str | QuantScheme = "w8a8"
    observer: str | None = None
    observer_params: dict[str, Any] = Field(default_factory=dict)
    weight_observer: str | None = None

    @field_validator("scheme", mode="before")
    @classmethod
    def _scheme(cls, v: Any) -> Any:
        return resolve_scheme(v) if isinstance(v, (str, dict)) else v

    # An unknown observer, a bad observer_params value or a per-tensor observer on per-channel
    # weights would otherwise fail when the stage builds its quantizers, after the baseline trained:
    # the recipe is refused as it loads, naming the field.
    @field_validator("observer", "weight_observer")
    @classmethod
    def _known_observer(cls, v: str | None) -> str | None:
        if v is not None:
            from compress.quantization.numerics.observers import OBSERVERS

            try:
                OBSERVERS.get(v)
            except RecipeError as exc:
                raise ValueError(str(exc)) from None
        return v

    @field_validator("observer_params")
    @classmethod
    def _observer_params(cls, v: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if not v:
            return v
        if "observer" not in info.data:  # the observer itself failed: that error is the one to report
            return v
        name = info.data["observer"]
        if name is None:
            raise ValueError("observer_params apply to the activation observer override: set observer too "
                             "(a scheme's own observers take theirs in the scheme)")
        _check_observer(QuantSpec(observer=name, observer_params=v), None)
        return v

    @model_validator(mode="after")
    def _observers_fit(self) -> _QuantSpecBase:
        s = self.resolved_scheme()
        for name in ("weights", "inputs", "outputs"):
            spec: QuantSpec | None = getattr(s, name)
            if spec is None or spec.dynamic:  # dynamic ranges are computed at run time: no observer
                continue
            overridden = self.weight_observer if name == "weights" else self.observer
            _check_observer(spec, ("weight_observer" if name == "weights" else "observer") if overridden
                            else f"scheme.{name}")
        return self

    def resolved_scheme(self) -> QuantScheme:
        """The scheme with the observer overrides applied."""
        s = resolve_scheme(self.scheme)
        upd: dict[str, QuantSpec | None] = {}
        if self.observer is not None:
            for name in ("inputs", "outputs"):
                spec: QuantSpec | None = getattr(s, name)
                if spec is not None and not spec.dynamic:
                    upd[name] = spec.with_(observer=self.observer, observer_params=self.observer_params)
        if self.weight_observer is not None and s.weights is not None:
            upd["weights"] = s.weights.with_(observer=self.weight_observer, observer_params={})
        return s.model_copy(update=upd) if upd else s


# Settings class first: its fields follow ModifierSpec's and _QuantSpecBase's in the resolved recipe.
class PTQSpec(QuantizeParams, _QuantSpecBase):
    """Post-training quantization: the settings of :class:`~compress.quantization.api.QuantizeParams`
    (what ``compress.quantize`` takes), calibrated over ``num_batches`` calibration batches, plus what
    needs the run's evaluation: ``sensitivity`` ("metric" or "sqnr") adds a per-layer table and plot;
    ``max_accuracy_drop`` (metric units, e.g. 0.005 = half a point of accuracy) keeps the most
    sensitive layers in float until the drop fits. ``batch_sizes`` defaults to the recipe's
    ``validate.batch_sizes``.
    """

    type: Literal["ptq"] = "ptq"
    needs: ClassVar[frozenset[str]] = frozenset({"calibration"})

    sensitivity: Literal["none", "metric", "sqnr"] = "none"
    max_accuracy_drop: float | None = Field(None, ge=0)


class QATSpec(PrepareParams, _QuantSpecBase):
    """Quantization-aware training within a training stage, with the selection and placement
    settings of :class:`~compress.quantization.preparation.PrepareParams`.

    Activation ranges follow an EMA observer (``observer``, default ``ema``) until
    ``freeze_observers_epoch``; BatchNorm trains folded into the conv and its statistics freeze
    at ``freeze_bn_epoch``; ``lsq`` learns the scales (LSQ). The model starts from a calibration
    over ``num_batches`` batches (calibration data, else training data).

    With ``lsq`` the scales join the optimizer as a new param group (no weight decay) when the
    modifier initializes; an LR scheduler built before that does not schedule the new group (it
    keeps its initial lr), so build schedulers after the Session has started.
    """

    type: Literal["qat"] = "qat"
    needs: ClassVar[frozenset[str]] = frozenset({"training"})

    # the defaults QAT needs (ranges that follow training; a short initial calibration)
    observer: str | None = "ema"
    num_batches: int | None = Field(8, ge=1)
    freeze_observers_epoch: float | None = Field(None, ge=0)
    freeze_bn_epoch: float | None = Field(None, ge=0)
    lsq: bool = False


def _check_observer(spec: QuantSpec, where: str | None) -> None:
    """:func:`~quantization.numerics.observers.check_observer` as a ValueError (a spec validator's);
    ``where`` None: the error's location already names the field."""
    from compress.quantization.numerics.observers import check_observer

    try:
        check_observer(spec, where=where or "-")
    except RecipeError as exc:
        raise ValueError(str(exc).removeprefix("-: ")) from None


def _plan(spec: PTQSpec | QATSpec, model: nn.Module, where: str) -> list[str]:
    return list(plan_targets(model, spec.resolved_scheme(), spec, where=where))


def _restore(spec: PTQSpec | QATSpec, model: nn.Module, data: dict[str, Any], *, bn: Literal["fold", "keep"],
             kv_cache: KVCache | None, where: str) -> None:
    prepare_saved(model, data, spec.resolved_scheme(), spec, bn=bn, where=where)
    if kv_cache is not None:  # the KV quantizers the run attached (their per-head scales are in the state)
        attach_kv_quantization(model, kv_cache)
    set_saved_flags(model, data)


def _serving(spec: PTQSpec | QATSpec, state: State) -> Any:
    """The spec with the run's serving batch sizes (``validate.batch_sizes``) where it names none."""
    if spec.batch_sizes is not None or state.serving_batch_sizes is None:
        return spec
    return spec.model_copy(update={"batch_sizes": state.serving_batch_sizes})


def _record_cost_table(state: State, spec: PTQSpec | QATSpec) -> None:
    """The stage's metrics name the declared deployment CPU and the cost table that decided for it
    (``onnxruntime vnni:intel``; None where none did: cost_table off, dynamic activations, another
    target), as ``placement.cost_table`` records it."""
    state.metrics["deploy_cpu"] = spec.deploy_cpu
    state.metrics["cost_table"] = view(state.model).cost_table


def _judge(state: State) -> Evaluate | None:
    """The metric function accuracy control and metric sensitivity choose on."""
    return state.select_evaluate or state.evaluate


@register_modifier
class PTQModifier(Modifier[PTQSpec]):
    """Handler of ``type: ptq``."""

    spec_cls = PTQSpec

    def plan(self, model: nn.Module) -> list[str]:
        return _plan(self.spec, model, self.where)

    def save_state(self, model: nn.Module) -> dict[str, Any]:
        return saved_quantization(model, self.spec)

    @classmethod
    def restore_state(cls, model: nn.Module, data: dict[str, Any], *, where: str) -> None:
        s = PTQSpec.model_validate(data["spec"])
        _restore(s, model, data, bn=s.bn, kv_cache=s.kv_cache, where=where)

    def on_calibrate(self, state: State) -> None:
        s = self.spec
        scheme = s.resolved_scheme()
        model = state.model
        if state.calibration_data is None:
            raise CalibrationError(f"{self.where}: ptq needs calibration data (data.calibration_samples > 0)")

        # under torchrun each rank calibrates on its share of the batches where what it gathers reduces
        # exactly across the ranks (min/max ranges, SmoothQuant's maxima); histogram ranges merge only
        # to a bin and bias correction does not reduce, so those see every batch on every rank
        share = not s.bias_correction and s.kv_cache is None and _ranges_reduce_exactly(scheme)

        def loop(m: nn.Module) -> int:
            return state.forward_loop(m, max_batches=s.num_batches, share=share)

        float_metric = None
        judge = _judge(state)
        if s.max_accuracy_drop is not None or s.sensitivity == "metric":
            if judge is None:
                raise CalibrationError(f"{self.where}: sensitivity/max_accuracy_drop need an evaluate function")
            float_metric = judge(model)
        swapped = post_training_quantize(model, scheme, loop, _serving(s, state), where=self.where)
        state.metrics["quantized_modules"] = len(swapped)
        _record_cost_table(state, s)
        self._sensitivity(state, float_metric)

    def _sensitivity(self, state: State, float_metric: float | None) -> None:
        s = self.spec
        want = s.sensitivity != "none" or s.max_accuracy_drop is not None
        if not want:
            return
        judge = _judge(state)

        def rank(by_metric: bool) -> list[dict[str, Any]]:
            return layer_sensitivity(
                state.model,
                evaluate=judge if by_metric else None,
                data=None if by_metric else state.calibration_data,
                max_batches=s.num_batches or 8,
                higher_is_better=state.higher_is_better,
            )

        rows: list[dict[str, Any]] | None = None
        if s.sensitivity != "none":
            rows = rank(s.sensitivity == "metric")
            state.tables["quantization_sensitivity"] = rows
            if state.out_dir is not None:
                path = plot_sensitivity(rows, state.out_dir / f"sensitivity_{state.stage_name}.png")
                state.artifacts.append(str(path))
        if s.max_accuracy_drop is not None:
            assert judge is not None and float_metric is not None  # checked in on_calibrate
            metric = judge(state.model)
            missed = worsening(float_metric, metric, state.higher_is_better) > s.max_accuracy_drop
            if rows is None and missed:  # ranked (one metric run per unit) only when the budget is missed
                rows = rank(True)
            reverted, metric = accuracy_control(
                state.model,
                evaluate=judge,
                max_drop=s.max_accuracy_drop,
                ranking=[r["layer"] for r in rows] if rows is not None and missed else [],
                float_metric=float_metric,
                higher_is_better=state.higher_is_better,
                metric=metric,
            )
            state.metrics.update(
                float_metric=float_metric,
                quantized_metric=metric,
                float_layers=len(reverted),
                met_budget=worsening(float_metric, metric, state.higher_is_better) <= s.max_accuracy_drop,
            )
            state.tables["quantization_kept_float"] = [{"layer": n} for n in reverted]


@register_modifier
class QATModifier(Modifier[QATSpec]):
    """Handler of ``type: qat``."""

    spec_cls = QATSpec

    def __init__(self, spec: QATSpec, *, where: str = "") -> None:
        super().__init__(spec, where=where)
        self._observers_frozen = False
        self._bn_frozen = False
        self._started = False

    def plan(self, model: nn.Module) -> list[str]:
        return _plan(self.spec, model, self.where)

    def save_state(self, model: nn.Module) -> dict[str, Any]:
        return saved_quantization(model, self.spec)

    @classmethod
    def restore_state(cls, model: nn.Module, data: dict[str, Any], *, where: str) -> None:
        # QAT trains BN folded-in and folds it at its end
        _restore(QATSpec.model_validate(data["spec"]), model, data, bn="fold", kv_cache=None, where=where)

    def on_initialize(self, state: State) -> None:
        s = self.spec
        model = state.model
        scheme = s.resolved_scheme()
        loop = self._init_loop(state)
        example = capture_first_call(model, loop) if scheme.static_activations else None
        swapped = prepare(model, scheme, _serving(s, state), bn="qat", example_inputs=example, where=self.where)
        calibrate(model, loop, where=self.where)
        state.metrics["quantized_modules"] = len(swapped)
        _record_cost_table(state, s)
        if s.lsq:
            scales = [q.enable_lsq() for _, q in quantizers(model) if not q.spec.dynamic]
            if state.optimizer is not None:
                known = {id(p) for g in state.optimizer.param_groups for p in g["params"]}
                new = [p for p in scales if id(p) not in known]
                if new:
                    state.optimizer.add_param_group({"params": new, "weight_decay": 0.0})
        self._update(state)

    def _init_loop(self, state: State) -> ForwardLoop:
        n = self.spec.num_batches
        if state.calibration_data is not None:
            # every batch on every rank: QAT's EMA ranges depend on the order of the batches (an average
            # of the ranks' EMAs is not the EMA of all batches)
            return lambda m: state.forward_loop(m, max_batches=n)
        if state.train_data is not None:
            return as_forward_loop(state.train_data, max_batches=n)
        raise CalibrationError(f"{self.where}: qat needs calibration or training data to initialize its ranges")

    def _update(self, state: State) -> None:
        """Apply the schedule: quantization on within [start, end), observer and BN freezes."""
        s = self.spec
        active = self.active(state)
        model = state.model
        e = state.stage_epoch
        freeze_obs = s.freeze_observers_epoch is not None and e >= s.freeze_observers_epoch
        if self._started and not active and s.end_epoch is not None and e >= s.end_epoch:
            freeze_obs = True  # past the end: keep quantizing with frozen ranges
            active = True
        if active and not self._started:
            self._started = True
        on = self._started
        for _, q in quantizers(model):
            q.enabled = on
            q.observing = on and not freeze_obs and not q.learnable and q.observer is not None
        if freeze_obs and not self._observers_frozen:
            self._freeze_observers(model)
        if s.freeze_bn_epoch is not None and e >= s.freeze_bn_epoch and not self._bn_frozen:
            for _, m in quant_modules(model):
                if isinstance(m, (QuantConv1d, QuantConv2d)) and m.bn is not None:
                    m.bn_frozen = True
            self._bn_frozen = True
            log.info("%s: BatchNorm statistics frozen at epoch %.2f", self.where, e)

    def _freeze_observers(self, model: nn.Module) -> None:
        for _, q in quantizers(model):
            if q.role != "weight" and q.observer is not None and not q.learnable and q.observer.num_updates:
                q.finish_calibration()  # all-reduces across DDP ranks
            q.observing = False
        for _, m in quant_modules(model):
            wq = getattr(m, "weight_quantizer", None)
            if wq is not None and not wq.learnable:
                calibrate_weight(m)
        self._observers_frozen = True

    def on_step(self, state: State) -> None:
        self._update(state)

    def on_epoch_end(self, state: State) -> None:
        self._update(state)

    def progress_state(self, state: State) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The schedule's flags, each quantizer's flags and its observer's statistics (plain
        attributes, not in the state_dict; per rank: under torchrun each rank observes its own batches
        until the ranges freeze). Scales, zero points and LSQ parameters are in the state_dict."""
        data: dict[str, Any] = {"started": self._started, "observers_frozen": self._observers_frozen,
                                "bn_frozen": self._bn_frozen, "quantizers": {}, "bn_frozen_modules": []}
        tensors: dict[str, torch.Tensor] = {}
        for name, q in quantizers(state.model):
            entry: dict[str, Any] = {"enabled": q.enabled, "observing": q.observing, "group_size": q.group_size,
                                     "stat_shape": list(q._stat_shape) if q._stat_shape is not None else None}
            if q.observer is not None:
                scalars: dict[str, Any] = {}
                for attr, v in vars(q.observer).items():
                    if isinstance(v, torch.Tensor):
                        tensors[f"{name}.{attr}"] = v.detach().clone()
                    elif v is None or isinstance(v, (bool, int, float)):
                        scalars[attr] = v
                entry["observer"] = scalars
            data["quantizers"][name] = entry
        data["bn_frozen_modules"] = [n for n, m in quant_modules(state.model) if getattr(m, "bn_frozen", False)]
        return data, tensors

    def load_progress(self, state: State, data: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        self._started, self._observers_frozen = bool(data["started"]), bool(data["observers_frozen"])
        self._bn_frozen = bool(data["bn_frozen"])
        saved = data["quantizers"]
        found = dict(quantizers(state.model))
        if set(saved) != set(found):
            raise CalibrationError(
                f"{self.where}: the checkpoint's quantizers do not match the model's ({len(saved)} saved, "
                f"{len(found)} now); was the model or the recipe changed?")
        for name, q in found.items():
            entry = saved[name]
            q.enabled, q.observing, q.group_size = bool(entry["enabled"]), bool(entry["observing"]), entry["group_size"]
            q._stat_shape = tuple(entry["stat_shape"]) if entry["stat_shape"] is not None else None
            if q.observer is not None and "observer" in entry:
                for attr, v in entry["observer"].items():
                    setattr(q.observer, attr, v)
                prefix = f"{name}."
                for key, t in tensors.items():
                    if key.startswith(prefix) and "." not in key[len(prefix):]:
                        setattr(q.observer, key[len(prefix):], t.to(state.device))
        frozen = set(data["bn_frozen_modules"])
        for n, m in quant_modules(state.model):
            if n in frozen and isinstance(m, (QuantConv1d, QuantConv2d)):
                m.bn_frozen = True

    def on_finalize(self, state: State) -> None:
        model = state.model
        self._started = True
        if not self._observers_frozen:
            self._freeze_observers(model)
        for _, m in quant_modules(model):
            if isinstance(m, (QuantConv1d, QuantConv2d)) and m.bn is not None:
                m.fold_bn()
                if not (m.weight_quantizer is not None and m.weight_quantizer.learnable):
                    calibrate_weight(m)
        for _, q in quantizers(model):
            q.disable_lsq()
            q.enabled, q.observing = True, False
        state.metrics["lsq"] = self.spec.lsq


def _ranges_reduce_exactly(scheme: QuantScheme) -> bool:
    """Whether the scheme's static activation ranges merge exactly across ranks (min/max observers)."""
    specs = [q for q in (scheme.inputs, scheme.outputs) if q is not None and not q.dynamic]
    return all(q.observer == "minmax" for q in specs)


def scales_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Current scales of all static quantizers by name (for logging and tests)."""
    return {n: q.scale.detach().clone() for n, q in quantizers(model) if isinstance(q, FakeQuantizer) and q.calibrated}


__all__ = ["PTQModifier", "PTQSpec", "QATModifier", "QATSpec", "scales_of"]
