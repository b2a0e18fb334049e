"""Per-layer sensitivity and accuracy-aware mixed precision.

Sensitivity quantizes one layer at a time (all other quantizers off) and measures either the task
metric (``evaluate``) or the SQNR of the model output against float on a few batches. Accuracy
control (like NNCF's ``quantize_with_accuracy_control``) swaps the most sensitive layers back to
float, one at a time, until the metric drop fits the budget.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from compress.batching import call_model, primary_output, split_batch, to_device
from compress.errors import CalibrationError
from quantization.fake_quant import FakeQuantizer
from quantization.preparation import quant_modules, unwrap

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


def output_sqnr(model: nn.Module, data: Iterable[Any], *, max_batches: int = 8) -> float:
    """SQNR (dB) of the model's output with its current quantizer states against quantizers off."""
    root = unwrap(model)
    p = next(root.parameters(), None)
    device = p.device if p is not None else torch.device("cpu")
    sig = err = 0.0
    was_training = root.training
    root.eval()
    with torch.no_grad():
        for i, batch in enumerate(data):
            if i >= max_batches:
                break
            inputs = to_device(split_batch(batch)[0], device)
            out = primary_output(call_model(root, inputs)).float()
            saved = _set_all(root, False)
            ref = primary_output(call_model(root, inputs)).float()
            for q, en in saved.items():
                q.enabled = en
            sig += float(ref.pow(2).sum())
            err += float((ref - out).pow(2).sum())
    root.train(was_training)
    if sig == 0.0:
        raise CalibrationError("sensitivity: no data (or an all-zero float output) to measure SQNR on")
    return math.inf if err == 0.0 else 10.0 * math.log10(sig / err)


def layer_sensitivity(
    model: nn.Module,
    *,
    evaluate: Evaluate | None = None,
    data: Iterable[Any] | None = None,
    max_batches: int = 8,
    higher_is_better: bool = True,
) -> list[dict[str, Any]]:
    """One row per quantized module, most sensitive first.

    With ``evaluate`` a row holds the metric with only that module quantized and its ``drop`` from
    the float metric (a worsening: a rise for ``higher_is_better=False`` metrics); otherwise ``data`` is needed and a row holds the output ``sqnr_db``.
    The model must be calibrated; quantizer states are restored afterwards.
    """
    if evaluate is None and data is None:
        raise ValueError("layer_sensitivity needs evaluate or data")
    root = unwrap(model)
    mods = list(quant_modules(root))
    saved = _set_all(root, False)
    rows: list[dict[str, Any]] = []
    try:
        base = evaluate(model) if evaluate is not None else None
        for name, mod in mods:
            own = _own_quantizers(mod)
            for q in own:
                q.enabled = saved[q]
            row: dict[str, Any] = {"layer": name, "type": type(mod).__name__}
            if evaluate is not None:
                value = evaluate(model)
                row.update(metric=value, drop=_worsening(cast(float, base), value, higher_is_better))
            else:
                row["sqnr_db"] = output_sqnr(model, cast(Iterable[Any], data), max_batches=max_batches)
            rows.append(row)
            for q in own:
                q.enabled = False
    finally:
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


def revert_to_float(model: nn.Module, name: str) -> None:
    """Swap one quantized module back to its float module."""
    root = unwrap(model)
    mod = root.get_submodule(name)
    root.set_submodule(name, cast(Any, mod).to_float())


def _worsening(reference: float, value: float, higher_is_better: bool) -> float:
    return reference - value if higher_is_better else value - reference


def accuracy_control(
    model: nn.Module, *, evaluate: Evaluate, max_drop: float, ranking: list[str], float_metric: float,
    higher_is_better: bool = True,
) -> tuple[list[str], float]:
    """Revert the layers of ``ranking`` (most sensitive first) to float until the metric's worsening
    from ``float_metric`` is at most ``max_drop``; returns the reverted layers and the final metric."""
    metric = evaluate(model)
    reverted: list[str] = []
    for name in ranking:
        if _worsening(float_metric, metric, higher_is_better) <= max_drop:
            break
        revert_to_float(model, name)
        reverted.append(name)
        metric = evaluate(model)
        log.info("accuracy control: %s kept in float, metric %.4f", name, metric)
    if _worsening(float_metric, metric, higher_is_better) > max_drop:
        log.warning("accuracy control: drop %.4f still above %.4f with every layer tried",
                    _worsening(float_metric, metric, higher_is_better), max_drop)
    return reverted, metric
