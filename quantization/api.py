"""One-shot post-training quantization: ``compress.quantize(model, scheme, data)``."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Literal

import torch
from compress.quantization.algorithms.bias_correction import bias_correction
from compress.quantization.algorithms.kv_cache import (
    KVCache,
    attach_kv_quantization,
    check_kv_calls,
    kv_quantizers,
)
from compress.quantization.algorithms.smoothquant import SmoothQuantField, Unfolded, smooth_quant
from compress.quantization.numerics.calibration import calibrate, input_sharing_groups, last_logits_only
from compress.quantization.numerics.spec import QuantScheme, resolve_scheme
from compress.quantization.placement.activations import capture_first_call, ensure_placed
from compress.quantization.preparation import (
    PrepareParams,
    nvfp4_weight,
    prepare,
    share_global_scales,
)
from pydantic import PositiveInt
from torch import nn

from compress.core.batching import CalibrationData, ForwardLoop, as_forward_loop, require_module
from compress.core.errors import CalibrationError
from compress.core.params import refuse_renamed
from compress.core.progress import with_progress

log = logging.getLogger(__name__)


class QuantizeParams(PrepareParams):
    """The settings of post-training quantization: :func:`quantize` takes them, and the ``ptq``
    recipe modifier is made of them (quantization/modifiers.py). The selection and placement
    settings are :class:`~compress.quantization.preparation.PrepareParams`'; these add:

    ``bn``: fold BatchNorm into the preceding conv (``fold``) or leave it (``keep``).
    ``smoothquant``: SmoothQuant's alpha for Linear layers, ``"auto"`` (chosen per layer), or None (off).
    ``smoothquant_unfolded``: a group whose factor folds into no producer keeps it as a Mul before its
    quantizer (``mul``) or is not smoothed (``skip``: what compressed-tensors checkpoints can hold).
    ``smoothquant_micro_batch``: SmoothQuant's statistics pass runs each calibration batch as pieces of
    this many samples (None: whole); the same statistics, the activation memory of that many samples.
    ``bias_correction``: correct the output mean shift caused by weight rounding.
    ``kv_cache``: int8 keys and values entering attention (decoder LLMs; quantization/algorithms/kv_cache.py):
    ``per_token`` (a scale per head and token, at run time) or ``per_head`` (static, calibrated).
    """

    bn: Literal["fold", "keep"] = "fold"
    smoothquant: SmoothQuantField = None
    smoothquant_unfolded: Unfolded = "mul"
    smoothquant_micro_batch: PositiveInt | None = 1
    bias_correction: bool = False
    kv_cache: KVCache | None = None


@with_progress
@refuse_renamed(forward_loop="data")
def quantize(
    model: nn.Module,
    scheme: QuantScheme | str = "w8a8",
    data: CalibrationData | None = None,
    *,
    targets: Sequence[str] | None = None,
    ignore: Sequence[str] | None = None,
    params: QuantizeParams | None = None,
    progress: bool = True,
) -> nn.Module:
    """Prepare ``model`` (in place) with fake-quant modules and calibrate it; returns it.

    ``scheme`` is a QuantScheme or a preset name (w8a8, w8a8_dynamic, w8_weight_only,
    w4_weight_only_g128). ``data``: calibration batches (an iterable of tensors, ``(inputs, targets)``
    tuples or dicts, such as a DataLoader) or a forward function ``fn(model)``; it may be None only
    when nothing needs data (weight-only or dynamic activations without SmoothQuant or bias
    correction). ``targets`` / ``ignore``: module patterns, as in :class:`QuantizeParams` (where the
    other settings are). ``quantization.strip`` undoes it.
    ``progress``: bars over the calibration batches on a terminal and the steps' log lines; False: silent.
    """
    require_module(model, "quantize: model")
    scheme = resolve_scheme(scheme)
    p = (params or QuantizeParams()).given("quantize", targets=targets, ignore=ignore)
    needs_data = (scheme.needs_data or p.smoothquant is not None or p.bias_correction
                  or p.kv_cache == "per_head")
    if data is None and needs_data:
        raise CalibrationError("quantize: this scheme and params need calibration data; pass data")
    loop = as_forward_loop(data, max_batches=p.num_batches) if data is not None else None
    post_training_quantize(model, scheme, loop, p)
    return model


def post_training_quantize(
    model: nn.Module,
    scheme: QuantScheme,
    loop: ForwardLoop | None,
    params: QuantizeParams,
    *,
    where: str = "quantize",
) -> dict[str, nn.Module]:
    """The PTQ steps shared by :func:`quantize` and the ``ptq`` modifier: trace the first batch and
    prepare, SmoothQuant, calibrate, bias correction; returns the swapped layers by name."""
    p = params
    example = capture_first_call(model, loop) if loop is not None and scheme.static_activations else None
    swapped = prepare(model, scheme, p, bn=p.bn, example_inputs=example, where=where)
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
    _share_nvfp4_globals(model, loop, example)
    return swapped


def _share_nvfp4_globals(model: nn.Module, loop: ForwardLoop | None, example: Any) -> None:
    """NVFP4 weights: Linears that read one tensor share one global scale (share_global_scales),
    found on one call: for a transformers model a few token ids (the readers of a tensor do not depend
    on its values, and no batch's logits are held for it), otherwise the example or the loop's first batch."""
    if not any(nvfp4_weight(m) is not None for m in model.modules()):
        return
    call = None
    if not callable(getattr(model, "get_input_embeddings", None)):
        call = example if example is not None else (capture_first_call(model, loop) if loop is not None else None)
    if call is not None:
        def run(m: nn.Module) -> Any:
            return m(*call.args, **call.kwargs)
    elif callable(getattr(model, "get_input_embeddings", None)):
        def run(m: nn.Module) -> Any:  # a few ids: no calibration batch's logits held for this
            return m(torch.zeros(1, 4, dtype=torch.long))
    else:
        log.info("NVFP4: no data to find the Linears that read one tensor; each keeps its own global scale")
        return
    for group in input_sharing_groups(model, run):
        share_global_scales(group)
