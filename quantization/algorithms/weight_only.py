"""One-shot weight-only LLM quantization: ``compress.gptq(model, data)`` and ``compress.awq(model, data)``.

Both run layer by layer (quantization/algorithms/sequential.py) and leave the standard weight-quantized
format: QuantLinear modules whose ``weight_quantizer`` holds per-channel or per-group scales and
zero points (GPTQ's weights lie exactly on that grid). They compose: ``awq`` then ``gptq`` on the
same model is AWQ's scaling and clipping followed by GPTQ's rounding (the second pass keeps the
first one's QuantLinears and their weight spec).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from compress.core.errors import CalibrationError
from quantization.algorithms.awq import AWQParams, awq_layer, scale_error_ratio
from quantization.algorithms.gptq import GPTQParams, HessianAccumulator, gptq_quantize, layer_error
from quantization.algorithms.sequential import Call, LayerHook, sequential_quantize
from quantization.numerics.calibration import float_mode
from quantization.numerics.modules import QuantLinear
from quantization.numerics.spec import QuantScheme, resolve_scheme

log = logging.getLogger(__name__)

DEFAULT_SCHEME = "w4_weight_only_g128"


@torch.no_grad()
def gptq_layer(layer: nn.Module, linears: dict[str, QuantLinear], calls: Sequence[Call], params: GPTQParams) -> dict[str, Any]:
    """GPTQ on one layer's Linears in place, from Hessians of their float inputs over ``calls``
    (summed across DDP ranks). Returns the summed GPTQ objective before (RTN) and after."""
    # Linears that read one tensor (q/k/v, gate/up) share one accumulator: one K x K sum, one GEMM
    accs: list[HessianAccumulator] = []
    owner: dict[str, int] = {}
    fed: dict[int, tuple[torch.Tensor, int]] = {}  # id(input) -> (input kept alive, accumulator) per call

    def hook(name: str, m: QuantLinear) -> Any:
        def fn(_: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            x = args[0]
            seen = fed.get(id(x))
            if name not in owner:
                if seen is None:
                    accs.append(HessianAccumulator(m.in_features, device=m.weight.device))
                owner[name] = seen[1] if seen is not None else len(accs) - 1
            k = owner[name]
            if seen is None or seen[1] != k:
                fed[id(x)] = (x, k)
                accs[k].add(x)

        return fn

    handles = [m.register_forward_pre_hook(hook(n, m)) for n, m in linears.items()]
    try:
        with float_mode(layer):
            for args, kwargs in calls:
                layer(*args, **kwargs)
                fed.clear()
    finally:
        for handle in handles:
            handle.remove()
    rtn_err = gptq_err = 0.0
    for k, a in enumerate(accs):
        names = [n for n, o in owner.items() if o == k and linears[n].weight_quantizer is not None]
        a.all_reduce()
        h = a.hessian(inplace=True)
        for n in names:
            m = linears[n]
            wq = m.weight_quantizer
            assert wq is not None
            rtn_err += layer_error(m.weight, wq(m.weight), h)
            q, scale, zp = gptq_quantize(m.weight, h, wq.spec, params)
            gptq_err += layer_error(m.weight, q, h)
            m.weight.data.copy_(q)
            wq.set_qparams(scale, zp)
        accs[k] = HessianAccumulator(0)  # free the K x K sum now, not at the end of the layer
    return {"rtn_error": rtn_err, "gptq_error": gptq_err}


def _check_data(data: Any, where: str) -> Iterable[Any]:
    if callable(data) and not isinstance(data, Iterable):
        raise CalibrationError(f"{where}: needs the calibration batches themselves (an iterable such as a DataLoader), not a forward loop")
    return data


def gptq(
    model: nn.Module,
    data: Iterable[Any],
    *,
    scheme: QuantScheme | str = DEFAULT_SCHEME,
    targets: Sequence[str] = ("*",),
    ignore: Sequence[str] = ("lm_head",),
    params: GPTQParams | None = None,
    max_batches: int | None = None,
    load: LayerHook | None = None,
    release: LayerHook | None = None,
) -> nn.Module:
    """GPTQ weight-only quantization of a decoder LLM (in place), one layer at a time; returns it.

    ``data``: calibration batches (input_ids tensors, or dicts / ``(inputs, labels)`` as the data
    sources yield). ``scheme``: a weight-only QuantScheme or preset (``w4_weight_only_g128``,
    ``w4_weight_only``, ``w3_weight_only_g128``, ``w8_weight_only``). ``params``: GPTQParams
    (block size, dampening, act_order). ``load``/``release``: per-layer offloading callbacks.
    """
    p = params or GPTQParams()
    s = resolve_scheme(scheme)
    summary = sequential_quantize(
        model, _check_data(data, "gptq"), s,
        lambda i, layer, lin, calls: gptq_layer(layer, lin, calls, p),
        targets=targets, ignore=ignore, max_batches=max_batches, load=load, release=release, where="gptq",
    )
    _log_summary("gptq", summary)
    return model


def awq(
    model: nn.Module,
    data: Iterable[Any],
    *,
    scheme: QuantScheme | str = DEFAULT_SCHEME,
    targets: Sequence[str] = ("*",),
    ignore: Sequence[str] = ("lm_head",),
    params: AWQParams | None = None,
    max_batches: int | None = None,
    load: LayerHook | None = None,
    release: LayerHook | None = None,
) -> nn.Module:
    """AWQ weight-only quantization of a decoder LLM (in place), one layer at a time; returns it.

    Scales are folded into the preceding norm or Linear wherever the layer proves the fold exact;
    weights are clipped per group; the weight quantizers then hold round-to-nearest qparams of the
    scaled, clipped weights (run :func:`gptq` afterwards for GPTQ rounding instead).
    """
    p = params or AWQParams()
    s = resolve_scheme(scheme)
    summary = sequential_quantize(
        model, _check_data(data, "awq"), s,
        lambda i, layer, lin, calls: awq_layer(layer, lin, calls, p, seed=i),
        targets=targets, ignore=ignore, max_batches=max_batches, load=load, release=release, where="awq",
    )
    _log_summary("awq", summary)
    ratio = scale_error_ratio(summary)
    if ratio is not None:
        log.info("awq: with the scales the groups' module-output error is %.3f of theirs with s = 1 (median)", ratio)
    return model


def _log_summary(name: str, summary: dict[str, Any]) -> None:
    log.info("%s: %d Linears in %d layers, %.1f s", name, summary["quantized_linears"], len(summary["layers"]), summary["seconds"])
