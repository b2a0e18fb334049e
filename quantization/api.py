"""One-shot post-training quantization: ``compress.quantize(model, scheme, data)``."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence

import torch
from compress.quantization.algorithms.bias_correction import bias_correction
from compress.quantization.algorithms.kv_cache import (
    KVCache,
    attach_kv_quantization,
    check_kv_calls,
    kv_quantizers,
)
from compress.quantization.algorithms.smoothquant import SmoothQuantField, Unfolded, smooth_quant
from compress.quantization.numerics.calibration import calibrate, last_logits_only
from compress.quantization.numerics.spec import QuantScheme, resolve_scheme
from compress.quantization.placement.activations import capture_first_call, ensure_placed
from compress.quantization.placement.cost_table import PORTABLE_CPU, DeployCpu
from compress.quantization.placement.runtimes import Target
from compress.quantization.placement.speed_check import SpeedCheck
from compress.quantization.preparation import BnMode, FirstLast, ModelCheck, prepare
from pydantic import ConfigDict, Field, PositiveInt
from torch import nn

from compress.core.batching import CalibrationData, ForwardLoop, as_forward_loop, require_module
from compress.core.errors import CalibrationError
from compress.core.params import ApiParams
from compress.core.progress import with_progress

log = logging.getLogger(__name__)


class QuantizeParams(ApiParams):
    """Advanced knobs of :func:`quantize` (and of the ``ptq`` modifier).

    ``first_last``: quantize / keep in ``float`` / give ``w8`` weights to the first and last layer.
    ``bn``: fold BatchNorm into the preceding conv (``fold``) or leave it (``keep``).
    ``smoothquant``: SmoothQuant's alpha for Linear layers, ``"auto"`` (chosen per layer), or None (off).
    ``smoothquant_unfolded``: a group whose factor folds into no producer keeps it as a Mul before its
    quantizer (``mul``) or is not smoothed (``skip``: what compressed-tensors checkpoints can hold).
    ``smoothquant_micro_batch``: SmoothQuant's statistics pass runs each calibration batch as pieces of
    this many samples (None: whole); the same statistics, the activation memory of that many samples.
    ``bias_correction``: correct the output mean shift caused by weight rounding.
    ``max_batches``: cap on calibration batches when ``forward_loop`` is an iterable.
    ``target``: the runtime whose fusion rules place the activation quantizers (onnxruntime,
    tensorrt, openvino).
    ``kv_cache``: int8 keys and values entering attention (decoder LLMs; quantization/algorithms/kv_cache.py):
    ``per_token`` (a scale per head and token, at run time) or ``per_head`` (static, calibrated).
    ``quantize_embeddings``: store embedding tables as int8 rows (static schemes; a table whose int8
    form loses fidelity stays float, named in ``placement.floats``; ``quantize_ops=False``, the
    layers-only mode, keeps them float too); False keeps them all float.
    ``speed_check``: time each layer's ONNX Runtime integer kernel against its float kernel at the
    traced shape (the batch scaled to ``speed_check.batch``) and keep the layers float where int8 is
    slower, the times named in ``placement.floats`` (quantization/placement/speed_check.py; target onnxruntime).
    ``cost_table``: without ``speed_check``, keep float the layers that the shipped ORT CPU cost table
    for ``deploy_cpu`` says run slower in int8 (quantization/placement/cost_table.py): nothing is timed
    at quantize time, so the placement is reproducible; False quantizes them all.
    ``deploy_cpu``: the CPU the model will be served on, ``isa:vendor`` (``vnni:intel``, ``vnni:amd``,
    ``amx:intel``, ``avx2:intel``, ``avx2:amd``), whose table decides; the default ``vnni:intel`` does
    not depend on the machine that quantizes (one model and data give one file everywhere);
    ``"this-machine"`` reads the quantizing CPU's table. Each reason names the table
    (``by the onnxruntime vnni:intel cost table``).
    ``batch_sizes``: the batches the model will be served at (default: batch 1). With ``cost_table``,
    the table predicts the whole int8 model against fp32 at each of them, the costs of entering and
    leaving int8 and of integer adds included (quantization/placement/model_cost.py).
    ``model_check``: where that prediction says int8 is not faster at every one of them, ``"float"``
    keeps the whole model float, the reason in ``placement.model_float``; ``"warn"`` logs it and keeps
    the int8 placement; ``"auto"`` (default) keeps float where int8 is predicted slower at a batch of
    16 or more and warns at smaller ones, since at batch 1 on small models the table's rows predict
    int8 slower than it runs (benchmarks/RESULTS.md, ``export_int8_quickstart``).
    """

    model_config = ConfigDict(extra="forbid")

    first_last: FirstLast = "quantize"
    bn: BnMode = "fold"
    quantize_ops: bool = True
    smoothquant: SmoothQuantField = None
    smoothquant_unfolded: Unfolded = "mul"
    smoothquant_micro_batch: PositiveInt | None = 1
    bias_correction: bool = False
    max_batches: int | None = Field(None, ge=1)
    target: Target = "onnxruntime"
    kv_cache: KVCache | None = None
    quantize_embeddings: bool = True
    speed_check: SpeedCheck | None = None
    cost_table: bool = True
    batch_sizes: tuple[PositiveInt, ...] | None = Field(None, min_length=1)
    model_check: ModelCheck = "auto"
    deploy_cpu: DeployCpu = PORTABLE_CPU


@with_progress
def quantize(
    model: nn.Module,
    scheme: QuantScheme | str = "w8a8",
    data: CalibrationData | None = None,
    *,
    targets: Sequence[str] = ("*",),
    ignore: Sequence[str] = (),
    params: QuantizeParams | None = None,
    forward_loop: CalibrationData | None = None,
    progress: bool = True,
) -> nn.Module:
    """Prepare ``model`` (in place) with fake-quant modules and calibrate it; returns it.

    ``scheme`` is a QuantScheme or a preset name (w8a8, w8a8_dynamic, w8_weight_only,
    w4_weight_only_g128). ``data``: calibration batches (an iterable of tensors, ``(inputs, targets)``
    tuples or dicts, such as a DataLoader) or a forward function ``fn(model)``; it may be None only when nothing needs data (weight-only or dynamic
    activations without SmoothQuant or bias correction). ``quantization.strip`` undoes it.
    ``progress``: bars over the calibration batches on a terminal and the steps' log lines; False: silent.
    """
    if forward_loop is not None:
        warnings.warn("quantize(forward_loop=...) is deprecated: pass the calibration data as data=",
                      DeprecationWarning, stacklevel=3)  # the caller's line, above with_progress
        data = forward_loop if data is None else data
    require_module(model, "quantize: model")
    scheme = resolve_scheme(scheme)
    p = params or QuantizeParams()
    needs_data = (scheme.static_activations or p.smoothquant is not None or p.bias_correction
                  or p.kv_cache == "per_head")
    if data is None and needs_data:
        raise CalibrationError("quantize: this scheme and params need calibration data; pass data")
    loop = as_forward_loop(data, max_batches=p.max_batches) if data is not None else None
    post_training_quantize(model, scheme, loop, targets=targets, ignore=ignore, params=p)
    return model


def post_training_quantize(
    model: nn.Module,
    scheme: QuantScheme,
    loop: ForwardLoop | None,
    *,
    targets: Sequence[str],
    ignore: Sequence[str],
    params: QuantizeParams,
    where: str = "quantize",
) -> dict[str, nn.Module]:
    """The PTQ steps shared by :func:`quantize` and the ``ptq`` modifier: trace the first batch and
    prepare, SmoothQuant, calibrate, bias correction; returns the swapped layers by name."""
    p = params
    example = capture_first_call(model, loop) if loop is not None and scheme.static_activations else None
    swapped = prepare(
        model, scheme, targets=targets, ignore=ignore, first_last=p.first_last, bn=p.bn,
        quantize_ops=p.quantize_ops, target=p.target, quantize_embeddings=p.quantize_embeddings,
        example_inputs=example, speed_check=p.speed_check, cost_table=p.cost_table, batch_sizes=p.batch_sizes, model_check=p.model_check,
        deploy_cpu=p.deploy_cpu, where=where,
    )
    if p.kv_cache is not None:
        attach_kv_quantization(model, p.kv_cache)
    if loop is not None:
        ensure_placed(model, loop)  # the placement traces the model's own forward, every position
        with last_logits_only(model, ops_placed=p.quantize_ops):
            if p.smoothquant is not None:
                smooth_quant(model, loop, alpha=p.smoothquant, unfolded=p.smoothquant_unfolded,
                             micro_batch=p.smoothquant_micro_batch)
            calibrate(model, loop, where=where)
            if p.bias_correction:
                bias_correction(model, loop)
            if p.kv_cache is not None:
                if all(k.calls == 0 for k in kv_quantizers(model).values()):
                    with torch.no_grad():
                        loop(model)  # nothing above ran the model (dynamic scheme): check the hooks see attention
                check_kv_calls(model)
    return swapped
