"""Model preparation: swap float layers for quantized ones, fold BatchNorm, and undo it all (strip).

Module swap is the one mechanism (``model.set_submodule``); the quantized modules share the float
Parameters, so preparing copies no weights and ``strip`` gives back float modules with the same
state_dict keys (BatchNorm folded into the conv, SmoothQuant factors folded into the weight).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any, Literal, cast

import torch
from compress.quantization.algorithms.bn_fold import find_conv_bn_pairs, fold_bn_into_conv
from compress.quantization.algorithms.kv_cache import remove_kv_quantization
from compress.quantization.numerics.fake_quant import FakeQuantizer
from compress.quantization.numerics.modules import QUANT_LAYERS, QUANT_TYPES, QuantConv1d, QuantConv2d
from compress.quantization.numerics.primitives import nvfp4_global_scale
from compress.quantization.numerics.spec import QuantScheme, QuantSpec, resolve_scheme
from compress.quantization.placement.activations import (
    GraphConfig,
    bn_pairs_from_graph,
    call_batch,
    example_args,
    layers_by_flow,
    new_graph,
    place_graph,
    targeted_fn,
)
from compress.quantization.placement.cost_table import (
    CostTable,
    deployment_cpu,
    slower_by_table,
    table_for,
)
from compress.quantization.placement.fidelity_guards import ROUTER_REASON, router_layers
from compress.quantization.placement.mode import detach, graph_of, unsmooth
from compress.quantization.placement.model_cost import TRUSTED_BATCH, decide, slower_attention, trusted_slower
from compress.quantization.placement.runtimes import get_profile
from compress.quantization.placement.settings import ModelCheck, PrepareParams
from compress.quantization.placement.speed_check import SpeedCheck, layer_calls, slower_in_int8, time_layers
from compress.quantization.placement.trace import is_op_key, trace_ops
from torch import nn

from compress.core.errors import CompressError
from compress.core.moe import unpack_experts
from compress.core.params import Selection
from compress.core.targets import select_modules

log = logging.getLogger(__name__)

BnMode = Literal["fold", "qat", "keep"]

# 8-bit per-channel weights for first/last layers kept at higher precision under 4-bit schemes
_W8 = QuantSpec(granularity="channel", axis=0)


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DistributedDataParallel / DataParallel wrapper (else ``model``)."""
    inner = getattr(model, "module", None)
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)) and isinstance(inner, nn.Module):
        return inner
    return model


def plan_targets(
    model: nn.Module,
    scheme: QuantScheme,
    params: Selection,
    *,
    where: str = "quantize",
    order: Sequence[str] | None = None,
) -> dict[str, QuantSpec | None]:
    """Layers to swap for quantized modules, mapped to their weight spec; nothing is changed.

    Exact Linear/Conv1d/Conv2d types are swapped. Subclasses (e.g. MultiheadAttention's out_proj,
    read functionally by its parent) and third-party layers (GPT-2's Conv1D) keep their own
    forward: with static activations their weights are quantized at the call that reads them
    (quantization/placement/place.py). ``order``: layer names in data-flow order (from a trace), which
    decides the first and last layer; registration order otherwise.
    """
    model = unwrap(model)
    first_last = params.first_last if isinstance(params, PrepareParams) else "quantize"
    types: tuple[type[nn.Module], ...] = tuple(QUANT_LAYERS)
    selected = select_modules(model, params.targets, ignore=params.ignore, types=types, where=f"{where}: targets")
    out: dict[str, QuantSpec | None] = {}
    for n, m in selected.items():
        if type(m) in QUANT_LAYERS:
            out[n] = scheme.weights
        else:
            log.debug("%s: %s subclasses a supported layer; its weight is quantized where it is used", n, type(m).__name__)
    layers = [n for n in out]
    if order is not None:
        layers = [n for n in order if n in out] or layers
    if layers and first_last != "quantize":
        for n in {layers[0], layers[-1]}:
            if first_last == "float":
                del out[n]
            elif scheme.weights is not None:
                out[n] = _W8
    return out


def prepare(
    model: nn.Module,
    scheme: QuantScheme | str,
    params: PrepareParams | None = None,
    *,
    bn: BnMode = "fold",
    example_inputs: Any = None,
    where: str = "quantize",
) -> dict[str, nn.Module]:
    """Swap the layers ``params`` targets in ``model`` (in place) for quantized ones; returns them by name.

    ``bn``: "fold" merges each BatchNorm into the conv before it (PTQ), "qat" hands it to the
    QuantConv, which trains with folded weights and exact BN statistics, "keep" leaves it alone.
    Weight quantizers are calibrated here; activation quantizers need
    :func:`quantization.numerics.calibration.calibrate`.

    Static activation quantizers are placed on the traced graph of the forward pass for
    ``params.runtime`` (quantization/placement/place.py): at residual adds, concats, attention matmuls
    and weighted ops, functional ones included. ``example_inputs`` (a tensor, tuple or dict) is
    traced now; without it, the first forward pass is (``first_last`` then goes by registration
    order instead of data flow, and BatchNorm pairs only by nn.Sequential adjacency). The speed
    check needs ``example_inputs``; attention's products of two activations, which are no layer, are
    decided by the cost table's rule at the batch timed, as on the default path. The cost table's
    name is recorded in ``placement.cost_table`` and in each reason it gave; its whole-model
    prediction counts entering and leaving int8 and integer adds (quantization/placement/model_cost.py).
    """
    p = params or PrepareParams()
    targets, ignore, first_last, target = p.targets, p.ignore, p.first_last, p.runtime
    speed_check, batch_sizes = p.speed_check, p.batch_sizes
    scheme = resolve_scheme(scheme)
    model = unwrap(model)
    if any(isinstance(m, QUANT_TYPES) for m in model.modules()) or graph_of(model) is not None:
        raise CompressError(f"{where}: the model is already quantized; strip() it first")
    get_profile(target)
    graph_mode = scheme.static_activations
    # transformers' Conv1D (GPT-2) and packed MoE experts (3D Parameters) have no layer type to
    # swap: as Linears (exact) they quantize like one under every scheme, as the sequential GPTQ/AWQ
    # path does, and the LLM generation export finds Linears. (The graph path could quantize a
    # Conv1D at its functional call, as it does for layers it cannot swap, but that weight is then
    # not a layer of its own.)
    linearize(model)
    call = example_args(example_inputs) if example_inputs is not None and graph_mode else None
    graph0 = _trace_eval(model, *call) if call is not None else None
    flow = layers_by_flow(graph0) if graph0 is not None else None
    plan = plan_targets(model, scheme, p, where=where, order=flow)
    skip: dict[str, str] = {}
    float_ops: dict[str, str] = {}
    model_float: str | None = None
    if first_last == "float" and graph_mode:
        selected = [n for n in (flow or []) if _is_target(model, n, targets, ignore)]
        skip = dict.fromkeys({selected[0], selected[-1]} if selected else (), "kept float by the first/last-layer policy")
    if graph0 is not None:
        for name in router_layers(graph0) & set(plan):
            del plan[name]
            skip[name] = ROUTER_REASON
    table = (table_for(*deployment_cpu(p.deploy_cpu))
             if p.cost_table and graph_mode and target == "onnxruntime" and graph0 is not None else None)
    if speed_check is not None:
        slow = _rank0_decides(lambda: _measure(model, plan, graph0, call, speed_check, target=target,
                                               graph_mode=graph_mode, where=where), where=where)
        for name in slow:
            del plan[name]
        skip.update(slow)
        # the speed check times layers; attention's products of two activations are no layer, and the
        # cost table's rule decides them at the batch timed, as it does on the default path
        if table is not None and graph0 is not None:
            example = _example_batch(call)
            batch = speed_check.batch or example or 1
            float_ops = _rank0_decides(partial(slower_attention, graph0, table, batches=(batch,), example_batch=example),
                                       where=where)
    elif table is not None and graph0 is not None:
        layers = {n: model.get_submodule(n) for n in plan}
        serving = tuple(batch_sizes) if batch_sizes else (1,)
        slow = _rank0_decides(lambda: _table_decides(graph0, layers, table, call, serving, p.model_check, where),
                              where=where)
        model_float = slow.pop(_WHOLE_MODEL, None)
        float_ops = {k: slow.pop(k) for k in list(slow) if is_op_key(k)}
        for name in (list(plan) if model_float is not None else slow):
            del plan[name]
            skip[name] = model_float or slow[name]
    pairs = find_conv_bn_pairs(model) if bn != "keep" else {}
    if graph0 is not None and bn != "keep":
        pairs.update(bn_pairs_from_graph(model, graph0))
    if bn == "fold":
        for conv_name, bn_name in pairs.items():
            if conv_name in plan:
                fold_bn_into_conv(model.get_submodule(conv_name), model.get_submodule(bn_name))  # type: ignore[arg-type]
                model.set_submodule(bn_name, nn.Identity())
    # with static activations the graph places every activation quantizer; layers own their weight's
    layer_scheme = scheme.model_copy(update={"inputs": None, "outputs": None}) if graph_mode else scheme
    swapped = swap_layers(model, plan, layer_scheme)
    if bn == "qat":
        for conv_name, bn_name in pairs.items():
            q = swapped.get(conv_name)
            if isinstance(q, (QuantConv1d, QuantConv2d)):
                q.attach_bn(model.get_submodule(bn_name))  # type: ignore[arg-type]
                model.set_submodule(bn_name, nn.Identity())
    for mod in swapped.values():
        calibrate_weight(mod)
    if graph_mode:
        assert scheme.inputs is not None
        config = GraphConfig(
            p, activation_spec=scheme.inputs.with_(granularity="tensor", axis=0), weight_spec=scheme.weights,
            swapped=set(swapped), skip_layers=skip, model_float=model_float, float_ops=float_ops,
            serving_batch=_serving_batch(batch_sizes, speed_check), cost_table=table,
        )
        new_graph(model, config)
        if call is not None:
            place_graph(model, config, *call)
    log.info("%s: prepared %d modules (%s)", where, len(swapped), _summary(swapped))
    attach_quantized_save(model)
    return swapped


def swap_layers(model: nn.Module, plan: dict[str, QuantSpec | None], scheme: QuantScheme) -> dict[str, nn.Module]:
    """Swap each planned layer of ``model`` for its quantized module with the planned weight spec;
    returns them by name (weights not yet calibrated)."""
    swapped: dict[str, nn.Module] = {}
    for name, wspec in plan.items():
        mod = model.get_submodule(name)
        new = QUANT_LAYERS[type(mod)].from_float(mod, scheme, name=name, weights=wspec)
        _to_device_of(new, mod)
        model.set_submodule(name, new)
        swapped[name] = new
    return swapped


def _serving_batch(batch_sizes: Sequence[int] | None, speed_check: SpeedCheck | None) -> int:
    """The largest batch the model will be served at: ``batch_sizes``, else the batch ``speed_check``
    is told to time at, else 1."""
    if batch_sizes:
        return max(batch_sizes)
    return speed_check.batch if speed_check is not None and speed_check.batch else 1


def _save_pretrained_quantized(self: nn.Module, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
    """``save_pretrained`` of a quantized transformers model: the compressed checkpoint transformers and
    vLLM reload (weight-only int4, int8 with dynamic inputs or none, or fp8, as compressed-tensors). Other schemes have no such form
    (the class's own save would write float weights and quantizer state no loader reads): one line
    says what to use instead."""
    from compress.core.errors import UnsupportedModelError
    from compress.core.services import save_quantized

    try:
        return save_quantized(self, save_directory, tokenizer=kwargs.get("tokenizer"))
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(
            f"save_pretrained: {exc}; a transformers checkpoint holds weight-only int4, int8 (W8A8: dynamic "
            "per-token inputs) or fp8 models: export "
            "this one with compress.export_onnx, or save its state with torch.save(model.state_dict())"
        ) from None


class _QuantizedSave:
    """The instance's ``save_pretrained``: an object, not a bound method, so that a pickled model
    (``torch.save(model)``) loads again (a bound method pickles as an attribute lookup of its
    function's name, which the model lacks); deep copies rebind it to the copy."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
        return _save_pretrained_quantized(self.model, save_directory, *args, **kwargs)


def attach_quantized_save(model: nn.Module) -> None:
    """Make ``model.save_pretrained`` write the compressed checkpoint, for transformers models (set on
    the instance; :func:`strip` removes it)."""
    root = unwrap(model)
    if callable(getattr(type(root), "save_pretrained", None)) and hasattr(root, "config"):
        root.__dict__["save_pretrained"] = _QuantizedSave(root)


def linearize_conv1d(model: nn.Module) -> list[str]:
    """Swap transformers' ``Conv1D`` (GPT-2; weight ``[in, out]``) for ``nn.Linear`` with the same
    Parameters' values transposed (``[out, in]``); returns the swapped names. Exact in float."""
    root = unwrap(model)
    swapped = []
    for name, mod in list(root.named_modules()):
        if type(mod).__name__ != "Conv1D" or not hasattr(mod, "nf"):
            continue
        w = mod.weight
        lin = nn.Linear(w.shape[0], w.shape[1], bias=mod.bias is not None, device="meta")
        lin.weight = nn.Parameter(w.detach().t().contiguous(), requires_grad=w.requires_grad)
        if mod.bias is not None:
            lin.bias = mod.bias
        lin.train(mod.training)
        root.set_submodule(name, lin)
        swapped.append(name)
    if swapped:
        log.info("linearized %d Conv1D modules (GPT-2 style) into nn.Linear", len(swapped))
    return swapped


def linearize(model: nn.Module) -> list[str]:
    """Give every weight the quantizers handle an ``nn.Linear`` of its own: GPT-2's Conv1D
    (:func:`linearize_conv1d`) and transformers' packed MoE experts (compress/core/moe.py), in
    place; returns the swapped names. Exact in float."""
    root = unwrap(model)
    return linearize_conv1d(root) + unpack_experts(root)


def saved_quantization(model: nn.Module, spec: Any) -> dict[str, Any]:
    """What restores a quantize modifier's model: its spec, the layers it left quantized and each
    quantizer's ``enabled`` flag (the qparams travel in the state_dict)."""
    return {
        "spec": spec.model_dump(mode="json"),
        "modules": [n for n, _ in quant_modules(model)],
        "quantizers": {n: {"enabled": bool(fq.enabled)} for n, fq in quantizers(model)},
    }


def as_prepare(params: Selection) -> PrepareParams:
    """``params`` as the PrepareParams :func:`prepare` takes: a weight-only algorithm's settings
    (GPTQParams, AWQParams) select layers only, with every placement setting at its default."""
    if isinstance(params, PrepareParams):
        return params
    return PrepareParams(targets=params.targets, ignore=params.ignore, num_batches=params.num_batches)


def prepare_saved(model: nn.Module, data: dict[str, Any], scheme: QuantScheme, params: Selection, *,
                  bn: Literal["fold", "keep"] = "fold", where: str) -> None:
    """Swap in the quantized modules :func:`saved_quantization` recorded, as the run did, without
    calibrating; layers the run reverted to float (accuracy control) stay float."""
    linearize(model)  # as the run's prepare() did first: Conv1D and MoE experts are Linears to plan over
    kept = set(data["modules"])
    p = as_prepare(params)
    planned = plan_targets(model, scheme, p, where=where)
    reverted = [n for n in planned if n not in kept]
    # placement settings as the run had them; nothing is timed on restore (the run's decisions are in `kept`)
    prepare(model, scheme, p.model_copy(update={"ignore": [*p.ignore, *reverted], "speed_check": None}), bn=bn,
            where=where)


def set_saved_flags(model: nn.Module, data: dict[str, Any]) -> None:
    """Calibration over, each quantizer enabled as the run left it."""
    flags = data["quantizers"]
    for name, fq in quantizers(model):
        fq.observing = False
        fq.enabled = bool(flags.get(name, {}).get("enabled", True))


def _rank0_decides(decide: Callable[[], dict[str, str]], *, where: str) -> dict[str, str]:
    """``decide()`` on rank 0 only, its answer on every rank under torchrun: timings (and, across
    nodes, the CPU's int8 instructions) differ between ranks, the quantized structure must not (the
    ranks reduce their calibration statistics quantizer by quantizer). Rank 0 alone times, so the
    ranks on one machine do not slow each other's kernels."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return decide()
    box: list[Any] = [None]
    failure: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            box[0] = decide()
        except Exception as exc:  # the other ranks are told, not left waiting at the broadcast
            failure, box[0] = exc, f"{type(exc).__name__}: {exc}"
    dist.broadcast_object_list(box, src=0)
    if failure is not None:
        raise failure
    if isinstance(box[0], str):
        raise CompressError(f"{where}: rank 0 failed to decide which layers stay float: {box[0]}")
    return dict(box[0])


#: marks a log record for the run's run.log only: compress's console handler drops it (compress.runner.FILE_ONLY)
_FILE_ONLY = {"file_only": True}

#: the key of :func:`_table_decides`'s answer that keeps the whole model float (never a layer name:
#: the root module's name is the empty string, and the root is not a layer the plan holds)
_WHOLE_MODEL = ""


def _table_decides(graph0: Any, layers: dict[str, nn.Module], table: CostTable, call: Any,
                   batches: tuple[int, ...], model_check: ModelCheck, where: str) -> dict[str, str]:
    """``{layer or attention op key: reason}`` kept float by the cost table's layer and attention rows
    and its model-level check (``{_WHOLE_MODEL: reason}`` for the whole model with ``model_check="float"``)."""
    calls = layer_calls(graph0, layers)
    slow = slower_by_table(layers, calls, table)
    ops = slower_attention(graph0, table, batches=batches, example_batch=_example_batch(call))
    slow.update(ops)
    if not table.boundary or not layers:
        return slow
    decision = decide(graph0, layers, set(layers) - set(slow), calls, table, batches=batches,
                      example_batch=_example_batch(call), float_ops=ops)
    if decision.whole_model is not None:
        trusted = trusted_slower(decision)
        slow_b = min(decision.costs, key=lambda b: decision.costs[b].speedup)
        # the console gets one short line; the prediction's figures go to run.log (a record marked
        # file_only, which compress's console handler drops) and, where it decides, to the report
        head = f"{where}: int8 predicted slower than fp32 at batch {slow_b} ({decision.costs[slow_b].speedup:.2f}x)"
        if model_check == "float" or (model_check == "auto" and trusted):
            why = ("model_check: float" if model_check == "float" else
                   f"model_check: auto, predicted slower at batch {trusted[0]} >= {TRUSTED_BATCH}, where the prediction holds")
            reason = (f"{decision.whole_model}; the whole model stays float ({why}; cost_table: false "
                      "quantizes it anyway, speed_check times its layers here)")
            log.warning("%s; the whole model stays float (model_check: %s)", head, model_check)
            log.info("%s: %s", where, reason, extra=_FILE_ONLY)
            return {_WHOLE_MODEL: reason}
        # a prediction, not a decision, at small batches: on small models at batch 1 the table's rows
        # (profiled kernels of a few microseconds) predicted 0.72-0.96x for nets that ran 1.18-1.55x
        log.warning("%s; int8 kept (model_check: %s%s)", head, model_check,
                    "" if model_check == "warn" else f" acts from batch {TRUSTED_BATCH}"
                    + (", not for attention" if decision.has_attention else ""))
        log.info("%s: %s; int8 kept (model_check: float keeps such a model float; auto does from batch %d%s)",
                 where, decision.whole_model, TRUSTED_BATCH, ", not for attention, whose prediction is coarser"
                 if decision.has_attention else "", extra=_FILE_ONLY)
        return slow
    return {**slow, **decision.float_layers}


def _example_batch(call: Any) -> int | None:
    return call_batch(call[0], call[1])


def _measure(
    model: nn.Module, plan: dict[str, QuantSpec | None], graph0: Any, call: Any, check: SpeedCheck, *, target: str,
    graph_mode: bool, where: str,
) -> dict[str, str]:
    """The planned layers whose ORT integer kernel is slower than their float one, with the reason."""
    if target != "onnxruntime":
        raise CompressError(f"{where}: speed_check times ONNX Runtime's CPU kernels; the runtime is {target}")
    if not graph_mode:
        raise CompressError(f"{where}: speed_check applies to schemes with static activations (e.g. w8a8)")
    if graph0 is None:
        raise CompressError(f"{where}: speed_check needs the traced shapes: pass example inputs or calibration data")
    layers = {n: model.get_submodule(n) for n in plan}
    timings = time_layers(layers, layer_calls(graph0, layers), check, example_batch=_example_batch(call))
    return slower_in_int8(timings, check)


def _trace_eval(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    was_training = model.training
    model.eval()
    try:
        return trace_ops(model, args, kwargs)
    finally:
        model.train(was_training)


def _is_target(model: nn.Module, name: str, targets: Sequence[str], ignore: Sequence[str]) -> bool:
    return targeted_fn(model, targets, ignore)(name)


def calibrate_weight(mod: nn.Module) -> None:
    """Set a layer's weight quantizer qparams from its current weight (BN-folded under QAT)."""
    wq = getattr(mod, "weight_quantizer", None)
    if not isinstance(wq, FakeQuantizer):
        return
    with torch.no_grad():
        w = mod.weight
        if not isinstance(w, torch.Tensor):
            return
        full = getattr(w, "full_tensor", None)
        if full is not None:  # a weight sharded by FSDP2 (a DTensor): its qparams are the whole weight's
            w = full()
        if isinstance(mod, (QuantConv1d, QuantConv2d)) and mod.bn is not None:
            w = w * mod._bn_factor(mod.bn).reshape([-1] + [1] * (w.dim() - 1))
        wq.observe(w)
        wq.compute_qparams()


def nvfp4_weight(mod: nn.Module) -> FakeQuantizer | None:
    """``mod``'s weight quantizer when it is NVFP4 (fp4 groups under a global scale), else None."""
    wq = getattr(mod, "weight_quantizer", None)
    ok = isinstance(wq, FakeQuantizer) and wq.spec.is_fp4 and wq.spec.scale_dtype == "fp8_e4m3"
    return wq if ok else None


def share_global_scales(mods: Sequence[nn.Module]) -> None:
    """Give NVFP4 layers that read one tensor (q/k/v, gate/up) one global scale, the smallest of
    theirs (the largest amax), with their group scales recomputed under it from their current
    weights: serving stacks run such layers as one fused GEMM with one global scale (vLLM's
    qkv_proj), and llm-compressor writes them so. Other layers are left alone."""
    qs = [(m, q) for m in mods if (q := nvfp4_weight(m)) is not None]
    if len(qs) < 2:
        return
    with torch.no_grad():
        amax = torch.stack([m.get_parameter("weight").detach().float().abs().amax() for m, _ in qs]).amax()
        g = nvfp4_global_scale(amax)
        for m, q in qs:
            q.global_scale = g.clone()
            q.fixed_global = True
            calibrate_weight(m)


def strip(model: nn.Module) -> nn.Module:
    """Swap every quantized module back to its float module (in place); returns ``model``.

    BatchNorm held by a QuantConv is folded into it, SmoothQuant factors are folded back into
    the weight and KV-cache quantizers are removed, so the float model computes what the prepared model computes with quantizers off.
    """
    root = unwrap(model)
    root.__dict__.pop("save_pretrained", None)  # the class's own save again
    unsmooth(root)
    detach(root)
    remove_kv_quantization(root)
    for name, mod in list(root.named_modules()):
        if isinstance(mod, QUANT_TYPES):
            root.set_submodule(name, cast(Any, mod).to_float())
    return model


def quant_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(name, module)`` of every quantized module."""
    for name, mod in unwrap(model).named_modules():
        if isinstance(mod, QUANT_TYPES):
            yield name, mod


def quantizers(model: nn.Module) -> Iterator[tuple[str, FakeQuantizer]]:
    """``(name, quantizer)`` of every FakeQuantizer."""
    for name, mod in unwrap(model).named_modules():
        if isinstance(mod, FakeQuantizer):
            yield name, mod


def set_quantizers(
    model: nn.Module,
    *,
    enabled: bool | None = None,
    observing: bool | None = None,
    roles: Sequence[str] = ("weight", "input", "output"),
) -> None:
    """Switch quantizers of the given roles on/off and in/out of observing."""
    for _, q in quantizers(model):
        if q.role not in roles:
            continue
        if enabled is not None:
            q.enabled = enabled
        if observing is not None:
            q.observing = observing and q.observer is not None


def _to_device_of(new: nn.Module, old: nn.Module) -> None:
    p = next(old.parameters(), None)
    if p is not None:
        new.to(p.device)


def _summary(swapped: dict[str, Any]) -> str:
    counts: dict[str, int] = {}
    for m in swapped.values():
        counts[type(m).__name__] = counts.get(type(m).__name__, 0) + 1
    return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))
