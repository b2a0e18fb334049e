"""Per-layer sensitivity and accuracy-aware mixed precision.

The units are the quantized layers (their own quantizers: the weight's, and the input's under
dynamic schemes) and, where quantizers are placed on the traced graph, each activation quantizer
(one tensor, shared by all its readers: a layer input, a residual add's operand, an attention
matmul's input), named by the first op call and operand it quantizes
(``encoder.layer.0.output:add#0[1]``). Sensitivity quantizes one unit at a time (all other
quantizers off) and measures either the task metric (``evaluate``) or the SQNR of the model output
against float on a few batches. Accuracy control (like NNCF's ``quantize_with_accuracy_control``,
which also reverts activation quantizers) keeps the most sensitive units in float, one at a time,
until the metric drop fits the budget: a layer goes back to its float module, an activation
quantizer leaves the placement, named in ``placement.floats`` with the measured reason, so the
export leaves that tensor float.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, cast

import torch
from compress.quantization.numerics.fake_quant import FakeQuantizer
from compress.quantization.placement.mode import graph_of
from compress.quantization.preparation import calibrate_weight, quant_modules, unwrap
from torch import nn

from compress.core.batching import call_model, primary_output, split_batch, to_device
from compress.core.errors import CalibrationError

log = logging.getLogger(__name__)

Evaluate = Callable[[nn.Module], float]


def _own_quantizers(mod: nn.Module) -> list[FakeQuantizer]:
    return [q for q in mod.modules() if isinstance(q, FakeQuantizer)]


def _set_all(model: nn.Module, enabled: bool) -> dict[FakeQuantizer, bool]:
    saved = {}
    for q in model.modules():
        if isinstance(q, FakeQuantizer):
            saved[q] = q.enabled
            q.enabled = enabled
    return saved


def activation_sites(model: nn.Module) -> dict[str, tuple[str, FakeQuantizer]]:
    """The placed activation quantizers of ``model`` by site name (the first ``op call[operand]``
    each quantizes), with their id in the quantizer graph; empty without a placement."""
    graph = graph_of(unwrap(model))
    if graph is None:
        return {}
    first: dict[str, str] = {}
    for key, entry in graph.placement.entries.items():
        for slot, qid in entry.items():
            first.setdefault(qid, f"{key}[{slot}]")
    out: dict[str, tuple[str, FakeQuantizer]] = {}
    for qid, q in graph.quantizers.items():
        if isinstance(q, FakeQuantizer) and q.role != "weight" and q.enabled and qid in first:
            out[first[qid]] = (qid, q)
    return out


def _units(model: nn.Module) -> list[tuple[str, str, list[FakeQuantizer]]]:
    """(name, type, quantizers) per sensitivity unit: quantized layers, then activation sites."""
    units = [(name, type(mod).__name__, _own_quantizers(mod)) for name, mod in quant_modules(unwrap(model))]
    units += [(site, "activation", [q]) for site, (_, q) in activation_sites(model).items()]
    return units


def _outputs(root: nn.Module, data: Iterable[Any], max_batches: int) -> list[tuple[Any, torch.Tensor]]:
    """(inputs, primary output) of the first ``max_batches`` batches, with the current quantizer states."""
    p = next(root.parameters(), None)
    device = p.device if p is not None else torch.device("cpu")
    out = []
    for i, batch in enumerate(data):
        if i >= max_batches:
            break
        inputs = to_device(split_batch(batch)[0], device)
        out.append((inputs, primary_output(call_model(root, inputs)).float()))
    return out


def _real_positions(inputs: Any, out: torch.Tensor) -> torch.Tensor | float:
    """1 at a text batch's real tokens, 0 at padding (``attention_mask``, when it leads the output's
    shape), broadcastable to ``out``; 1.0 otherwise. Padded positions are discarded downstream."""
    mask = inputs.get("attention_mask") if isinstance(inputs, dict) else None
    if not isinstance(mask, torch.Tensor) or out.dim() < 2 or tuple(mask.shape) != tuple(out.shape[:2]):
        return 1.0
    return mask.to(out.dtype).reshape(*mask.shape, *([1] * (out.dim() - 2)))


def _sqnr(refs: list[tuple[Any, torch.Tensor]], root: nn.Module) -> float:
    sig = err = 0.0
    for inputs, ref in refs:
        out = primary_output(call_model(root, inputs)).float()
        keep = _real_positions(inputs, ref)
        sig += float((ref * keep).pow(2).sum())
        err += float(((ref - out) * keep).pow(2).sum())
    if sig == 0.0:
        raise CalibrationError("sensitivity: no data (or an all-zero float output) to measure SQNR on")
    return math.inf if err == 0.0 else 10.0 * math.log10(sig / err)


def output_sqnr(model: nn.Module, data: Iterable[Any], *, max_batches: int = 8) -> float:
    """SQNR (dB) of the model's output with its current quantizer states against quantizers off."""
    root = unwrap(model)
    was_training = root.training
    root.eval()
    try:
        with torch.no_grad():
            saved = _set_all(root, False)
            try:
                refs = _outputs(root, data, max_batches)
            finally:
                for q, en in saved.items():
                    q.enabled = en
            return _sqnr(refs, root)
    finally:
        root.train(was_training)


def layer_sensitivity(
    model: nn.Module,
    *,
    evaluate: Evaluate | None = None,
    data: Iterable[Any] | None = None,
    max_batches: int = 8,
    higher_is_better: bool = True,
) -> list[dict[str, Any]]:
    """One row per unit (quantized layer or activation site, see the module docstring), most
    sensitive first; ``type`` is the layer's class or ``"activation"``.

    With ``evaluate`` a row holds the metric with only that unit quantized and its ``drop`` from
    the float metric (a worsening: a rise for ``higher_is_better=False`` metrics); otherwise ``data``
    is needed and a row holds the output ``sqnr_db``. The model must be calibrated; quantizer states
    are restored afterwards.
    """
    if evaluate is None and data is None:
        raise ValueError("layer_sensitivity needs evaluate or data")
    root = unwrap(model)
    units = _units(root)
    saved = _set_all(root, False)
    was_training = root.training
    rows: list[dict[str, Any]] = []
    try:
        if evaluate is not None:
            base = evaluate(model)
        else:
            root.eval()
            with torch.no_grad():
                refs = _outputs(root, cast(Iterable[Any], data), max_batches)
        for name, kind, own in units:
            for q in own:
                q.enabled = saved[q]
            row: dict[str, Any] = {"layer": name, "type": kind}
            if evaluate is not None:
                value = evaluate(model)
                row.update(metric=value, drop=worsening(base, value, higher_is_better))
            else:
                with torch.no_grad():
                    row["sqnr_db"] = _sqnr(refs, root)
            rows.append(row)
            for q in own:
                q.enabled = False
    finally:
        root.train(was_training)
        for q, en in saved.items():
            q.enabled = en
    key = (lambda r: -r["drop"]) if evaluate is not None else (lambda r: r["sqnr_db"])
    return sorted(rows, key=key)


def plot_sensitivity(rows: list[dict[str, Any]], path: Path, *, title: str = "Per-layer sensitivity") -> Path:
    """A horizontal bar chart of ``rows`` (drop or SQNR per layer) written to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    field = "drop" if rows and "drop" in rows[0] else "sqnr_db"
    label = "metric drop (one layer quantized)" if field == "drop" else "output SQNR, dB (one layer quantized)"
    vals = [float(r[field]) if math.isfinite(float(r[field])) else 0.0 for r in rows]
    fig, ax = plt.subplots(figsize=(7, max(2.5, 0.28 * len(rows) + 1)))
    ax.barh([r["layer"] for r in rows][::-1], vals[::-1], color="#4c72b0")
    ax.set_xlabel(label)
    ax.set_title(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def revert_to_float(model: nn.Module, name: str, *, reason: str = "kept float by accuracy control") -> list[str]:
    """Keep one unit in float: a quantized layer goes back to its float module; an activation site
    (:func:`activation_sites`) leaves the placement, every op call it quantized recorded in
    ``placement.floats`` with ``reason`` (those keys are returned). A SmoothQuant factor its quantizer
    applied goes back into the layers' weights, so the float function is unchanged."""
    root = unwrap(model)
    sites = activation_sites(root)
    if name not in sites:
        mod = root.get_submodule(name)
        root.set_submodule(name, cast(Any, mod).to_float())
        return []
    qid, q = sites[name]
    recorded: list[str] = []
    unsmoothed: set[str] = set()  # a layer called twice has two op-call keys but one weight
    graph = graph_of(root)
    assert graph is not None  # activation_sites found the site in it
    pl = graph.placement
    for key, entry in list(pl.entries.items()):
        for slot in [s for s, v in entry.items() if v == qid]:
            del entry[slot]
            pl.floats[f"{key}[{slot}]"] = reason
            recorded.append(f"{key}[{slot}]")
            scope, _, kind = key.rpartition(":")
            if q.pre_quant_scale is not None and kind.startswith("linear") and scope not in unsmoothed:
                unsmoothed.add(scope)
                layer = root.get_submodule(scope)
                with torch.no_grad():
                    cast(torch.Tensor, layer.weight).mul_(q.pre_quant_scale.to(cast(torch.Tensor, layer.weight).dtype))
                calibrate_weight(layer)
        if not entry:
            del pl.entries[key]
    del graph.quantizers[qid]
    pl.activations.pop(qid, None)
    return recorded


def worsening(reference: float, value: float, higher_is_better: bool) -> float:
    """How much worse ``value`` is than ``reference`` (a rise for lower-is-better metrics)."""
    return reference - value if higher_is_better else value - reference


def accuracy_control(
    model: nn.Module, *, evaluate: Evaluate, max_drop: float, ranking: list[str], float_metric: float,
    higher_is_better: bool = True, metric: float | None = None,
) -> tuple[list[str], float]:
    """Keep the units of ``ranking`` (most sensitive first: layers or activation sites) in float until
    the metric's worsening from ``float_metric`` is at most ``max_drop``; returns the reverted units
    and the final metric. An activation site's reason in ``placement.floats`` gives the metric before
    and after it went float. ``metric``: the model's metric now, when the caller has it."""
    metric = evaluate(model) if metric is None else metric
    reverted: list[str] = []
    for name in ranking:
        if worsening(float_metric, metric, higher_is_better) <= max_drop:
            break
        before = metric
        keys = revert_to_float(model, name)
        reverted.append(name)
        metric = evaluate(model)
        graph = graph_of(unwrap(model))
        if graph is not None:
            for key in keys:
                graph.placement.floats[key] = f"kept float by accuracy control: metric {before:.4g} -> {metric:.4g}"
        log.info("accuracy control: %s kept in float, metric %.4f", name, metric)
    if worsening(float_metric, metric, higher_is_better) > max_drop:
        log.warning("accuracy control: drop %.4f still above %.4f with every layer tried",
                    worsening(float_metric, metric, higher_is_better), max_drop)
    return reverted, metric
