"""Sequential, layer-by-layer calibration of decoder LLMs in bounded memory.

The inputs of the first decoder layer are captured for every calibration batch (the forward stops
there), then one layer at a time is loaded, prepared (module swap to QuantLinear), calibrated by a
``process`` function (GPTQ, AWQ, ...) on its recorded inputs, run again *quantized* to produce the
next layer's inputs (as GPTQ and llm-compressor's sequential pipeline do), and released. With
``load``/``release`` callbacks the layers can live elsewhere (on disk as safetensors, or not yet
initialized): peak memory is then about one layer, its Hessians and the activations, not the model.

Decoder layers are found, not named: the ``nn.ModuleList`` holding most parameters whose items are
all one class (``model.layers`` of Llama/Qwen2/Mistral/Phi, ``transformer.h`` of GPT-2).
GPT-2's ``Conv1D`` (a Linear with its weight stored transposed) is swapped for an equal
``nn.Linear`` first (:func:`quantization.preparation.linearize`: GPT-2's Conv1D, packed MoE experts), so every architecture quantizes one way.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from compress.quantization.numerics.calibration import float_mode
from compress.quantization.numerics.modules import QuantLinear
from compress.quantization.numerics.spec import QuantScheme, QuantSpec
from compress.quantization.preparation import (
    PrepareParams,
    attach_quantized_save,
    calibrate_weight,
    linearize,
    plan_targets,
    prepare,
    swap_layers,
    unwrap,
)
from torch import nn

from compress.core.batching import split_batch, to_device
from compress.core.errors import CalibrationError, UnsupportedModelError
from compress.core.params import Selection
from compress.core.progress import bar, report
from compress.core.targets import select_modules

log = logging.getLogger(__name__)

#: the scheme the layer-by-layer weight-only algorithms (GPTQ, AWQ) default to
DEFAULT_SCHEME = "w4_weight_only_g128"

Call = tuple[tuple[Any, ...], dict[str, Any]]
ProcessLayer = Callable[[int, nn.Module, dict[str, QuantLinear], list[Call]], dict[str, Any] | None]
LayerHook = Callable[[int, nn.Module], None]


class _Captured(Exception):
    """Raised by the first layer's pre-hook to stop the forward once its inputs are recorded."""


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """``(path, ModuleList)`` of the model's repeated blocks (raises UnsupportedModelError if none)."""
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, mod in unwrap(model).named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0 and len({type(m) for m in mod}) == 1:
            n = sum(p.numel() for p in mod.parameters())
            if best is None or n > best[0]:
                best = (n, name, mod)
    if best is None or best[0] == 0:
        raise UnsupportedModelError(
            f"sequential calibration: {type(model).__name__} has no list of repeated layers (decoder blocks)"
        )
    return best[1], best[2]


def _model_inputs(batch: Any, device: torch.device) -> dict[str, Any]:
    inputs, _ = split_batch(batch)
    if isinstance(inputs, torch.Tensor):
        inputs = {"input_ids": inputs}
    if not isinstance(inputs, Mapping):
        raise CalibrationError("sequential calibration: batches need input_ids (a tensor or a dict of tensors)")
    out = dict(to_device(dict(inputs), device))
    out.setdefault("use_cache", False)  # a KV cache would grow every time a layer is re-run
    return out


def capture_inputs(model: nn.Module, layer: nn.Module, data: Iterable[Any], *, max_batches: int | None = None,
                   device: torch.device | str = "cpu") -> list[Call]:
    """The ``(args, kwargs)`` ``layer`` is called with, for each calibration batch; the model's forward
    stops at ``layer`` (later layers are never run, and may be offloaded or uninitialized)."""
    calls: list[Call] = []

    def hook(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        kw = dict(kwargs)
        for key in ("past_key_values", "past_key_value", "cache"):  # transformers 4.x / 5.x names of the KV cache
            if key in kw:
                kw[key] = None
        calls.append((tuple(args), kw))
        raise _Captured

    handle = layer.register_forward_pre_hook(hook, with_kwargs=True)
    dev = torch.device(device)
    try:
        with torch.no_grad():
            for i, batch in enumerate(bar(data, desc="capture inputs", cap=max_batches, unit="batch")):
                if max_batches is not None and i >= max_batches:
                    break
                with contextlib.suppress(_Captured):
                    model(**_model_inputs(batch, dev))
    finally:
        handle.remove()
    if not calls:
        raise CalibrationError("sequential calibration: the calibration data fed no batch (empty calibration set?)")
    return calls


def hidden_of(call: Call) -> torch.Tensor:
    """The hidden state a recorded layer call carries (its first argument, or ``hidden_states``)."""
    args, kwargs = call
    return args[0] if args else kwargs["hidden_states"]


def with_hidden(call: Call, hidden: torch.Tensor) -> Call:
    """``call`` with its hidden state replaced by ``hidden`` (the other arguments shared)."""
    args, kwargs = call
    if args:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


def _run_layer(layer: nn.Module, calls: list[Call]) -> list[Call]:
    """``calls`` with each hidden state replaced by ``layer``'s output, in place: a batch's input is
    freed as its output is made, so the calibration activations are held once, not twice."""
    with torch.no_grad():
        for i, call in enumerate(calls):
            y = layer(*call[0], **call[1])
            calls[i] = with_hidden(call, y[0] if isinstance(y, (tuple, list)) else y)
            del call, y
    return calls


def sequential_quantize(
    model: nn.Module,
    data: Iterable[Any],
    scheme: QuantScheme | None,
    process: ProcessLayer,
    params: Selection | None = None,
    *,
    load: LayerHook | None = None,
    release: LayerHook | None = None,
    device: torch.device | str = "cpu",
    where: str = "sequential",
    activations: bool = False,
    plain_linears: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Quantize ``model``'s decoder layers one at a time (in place) with weight-only ``scheme``
    (``activations``: a scheme with input quantizers too, dynamic, or static on a model that
    quantize() prepared and calibrated; each layer then runs with them to feed the next).

    ``process(i, layer, linears, calls)`` calibrates layer ``i`` (its targeted Linears, already
    QuantLinear, by name inside the layer; ``calls`` its recorded inputs). ``load(i, layer)`` is
    called before a layer is touched and ``release(i, layer)`` after its quantized outputs were
    computed (offloading). ``params``: the layers it applies to and ``num_batches``. Targeted Linears
    outside the decoder layers (a decoder's lm_head, unless ignored) get round-to-nearest. Returns a summary (per-layer reports, seconds).

    ``scheme`` None: nothing is quantized or swapped (SparseGPT, Wanda): ``process`` gets the plain
    Linears ``plain_linears`` names (all inside the decoder layers; the caller selected them), by name
    inside each layer, as ``nn.Linear``.
    """
    sel = params or Selection()
    root = unwrap(model)
    if scheme is None:
        return _sequential_plain(root, data, process, sel, plain_linears or [], load=load, release=release,
                                 device=device, where=where)
    prepared = any(isinstance(m, QuantLinear) for m in root.modules())
    if scheme.weights is None or scheme.outputs is not None or (scheme.inputs is not None and not activations):
        raise CalibrationError(f"{where}: needs a weight-only scheme (weights set, inputs and outputs null)")
    if scheme.inputs is not None and not scheme.inputs.dynamic and not prepared:
        raise CalibrationError(
            f"{where}: static activation scales come from calibration: run quantize() with this scheme first "
            "(the weights are then rounded again here), or take dynamic activations (w8a8_dynamic, W8A8)"
        )
    t0 = time.perf_counter()
    linearize(root)
    path, layers = decoder_layers(root)
    if prepared:
        # a second pass (GPTQ after AWQ): the Linears the first pass swapped, as selected here
        plan: Sequence[str] = list(select_modules(root, sel.targets, ignore=sel.ignore, types=(QuantLinear,),
                                                  where=f"{where}: targets"))
    else:
        plan = list(plan_targets(root, scheme, sel, where=where))
    prefix = f"{path}." if path else ""
    _, per_layer, outside = split_by_layer(root, plan)
    if load is not None:
        load(0, layers[0])
    calls = capture_inputs(root, layers[0], data, max_batches=sel.num_batches, device=device)
    reports: list[dict[str, Any]] = []
    for i, layer in enumerate(bar(layers, desc=where, unit="layer")):
        t_layer = time.perf_counter()
        if i > 0 and load is not None:
            load(i, layer)
        linears = _prepared(layer, per_layer[i], scheme, where=f"{where}: {prefix}{i}")
        layer.eval()
        _calibrate_input_globals(layer, linears, calls)
        rep = process(i, layer, linears, calls) if linears else None
        calls = _run_layer(layer, calls)
        reports.append({"layer": i, "linears": len(linears), **(rep or {})})
        if release is not None:
            release(i, layer)
        report(log, "%s", progress_line(where, i, len(layers), reports[-1], time.perf_counter() - t_layer,
                                        time.perf_counter() - t0))
    if outside:
        # swapped one by one: the decoder layers' Linears are quantized already, which prepare() refuses
        fresh: dict[str, QuantSpec | None] = {
            n: scheme.weights for n in outside if not isinstance(root.get_submodule(n), QuantLinear)}
        for mod in swap_layers(root, fresh, scheme).values():
            calibrate_weight(mod)
        log.info("%s: %d targeted layers outside the decoder layers got round-to-nearest", where, len(outside))
    attach_quantized_save(root)  # model.save_pretrained writes the compressed checkpoint
    return {"layers": reports, "seconds": time.perf_counter() - t0, "quantized_linears": sum(len(p) for p in per_layer)}


def _calibrate_input_globals(layer: nn.Module, linears: Mapping[str, QuantLinear], calls: list[Call]) -> None:
    """Calibrate the per-tensor global scales of the layer's NVFP4 input quantizers on the layer's own
    inputs (float forward), so that the quantized layers after it see the scales they will run with."""
    qs = [q for m in linears.values() if (q := m.input_quantizer) is not None and q.calibrated_global
          and not q.calibrated and q.observer is not None]
    if not qs:
        return
    with float_mode(layer), torch.no_grad():
        for q in qs:
            assert q.observer is not None
            q.observer.reset()
            q.observing = True
        _run_layer(layer, calls)
    for q in qs:
        q.finish_calibration()


def split_by_layer(model: nn.Module, names: Sequence[str]) -> tuple[str, list[list[str]], list[str]]:
    """``(decoder layers' path, names inside each layer, names outside them)`` of module ``names``."""
    path, layers = decoder_layers(model)
    prefix = f"{path}." if path else ""
    per_layer: list[list[str]] = [[] for _ in layers]
    outside: list[str] = []
    for name in names:
        if name.startswith(prefix) and name[len(prefix):].split(".", 1)[0].isdigit():
            idx, rest = name[len(prefix):].split(".", 1)
            per_layer[int(idx)].append(rest)
        else:
            outside.append(name)
    return path, per_layer, outside


def _sequential_plain(root: nn.Module, data: Iterable[Any], process: ProcessLayer, sel: Selection, names: Sequence[str],
                      *, load: LayerHook | None, release: LayerHook | None, device: torch.device | str,
                      where: str) -> dict[str, Any]:
    """The layer-by-layer pipeline without quantization: ``process`` changes each layer's plain
    Linears (``names``) in place, and the next layer's inputs come from the changed layer."""
    t0 = time.perf_counter()
    linearize(root)
    path, layers = decoder_layers(root)
    _, per_layer, outside = split_by_layer(root, names)
    if outside:
        raise CalibrationError(f"{where}: {', '.join(outside[:3])} outside the decoder layers ({path}): "
                               "only their Linears are processed layer by layer")
    if load is not None:
        load(0, layers[0])
    calls = capture_inputs(root, layers[0], data, max_batches=sel.num_batches, device=device)
    reports: list[dict[str, Any]] = []
    for i, layer in enumerate(bar(layers, desc=where, unit="layer")):
        t_layer = time.perf_counter()
        if i > 0 and load is not None:
            load(i, layer)
        lins: Any = {n: m for n, m in layer.named_modules() if n in set(per_layer[i])}  # plain Linears
        layer.eval()
        rep = process(i, layer, lins, calls) if lins else None
        calls = _run_layer(layer, calls)
        reports.append({"layer": i, "linears": len(lins), **(rep or {})})
        if release is not None:
            release(i, layer)
        report(log, "%s", progress_line(where, i, len(layers), reports[-1], time.perf_counter() - t_layer,
                                        time.perf_counter() - t0))
    return {"layers": reports, "seconds": time.perf_counter() - t0, "quantized_linears": sum(len(p) for p in per_layer)}


def _fmt_s(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def progress_line(where: str, i: int, total: int, report: Mapping[str, Any], seconds: float, elapsed: float) -> str:
    """One plain progress line per decoder layer: index/total, the layer's seconds, elapsed and ETA
    (the mean layer time so far times the layers left), and the layer's output error before and
    after the algorithm when its report has them (GPTQ: ``rtn_error``/``gptq_error``, the summed
    ``tr(dW H dW^T)/2``; AWQ: the searched groups' ``unscaled_error``/``error``)."""
    eta = elapsed / (i + 1) * (total - i - 1)
    line = (f"{where}: layer {i + 1}/{total} ({report.get('linears', 0)} Linears) {seconds:.1f} s, "
            f"elapsed {_fmt_s(elapsed)}, ETA {_fmt_s(eta)}")
    before = after = None
    if "rtn_error" in report and "gptq_error" in report:
        before, after = float(report["rtn_error"]), float(report["gptq_error"])
    elif report.get("groups"):
        searched = [g for g in report["groups"] if g.get("unscaled_error") is not None]
        if searched:
            before = sum(float(g["unscaled_error"]) for g in searched)
            after = sum(float(g["error"]) for g in searched)
    if report.get("autoround_first_loss") is not None:  # AutoRound: step 0 (the start) and the best step's loss
        line += (f", output MSE {float(report['autoround_first_loss']):.3g} -> "
                 f"{float(report['autoround_best_loss']):.3g}")
    if "sparse_error" in report:  # SparseGPT: the summed tr(dW H dW^T)/2 of the pruned weights
        line += f", pruned error {float(report['sparse_error']):.3g}"
    if before is not None and after is not None:
        change = f" ({(after - before) / before:+.0%})" if before > 0 else ""
        line += f", error RTN {before:.3g} -> {after:.3g}{change}"
    return line


def _prepared(layer: nn.Module, names: list[str], scheme: QuantScheme, *, where: str) -> dict[str, QuantLinear]:
    """The layer's targeted Linears as QuantLinear: swapped now, or kept when an earlier pass
    (AWQ before GPTQ) swapped them with the same weight spec."""
    if not names:
        return {}
    existing = {n: m for n, m in layer.named_modules() if isinstance(m, QuantLinear)}
    if existing:
        out = {}
        for n in names:
            m = existing.get(n)
            if m is None or m.weight_quantizer is None:
                raise CalibrationError(f"{where}.{n}: the layer is partly quantized already; strip() it first")
            if m.weight_quantizer.spec != scheme.weights:
                raise CalibrationError(
                    f"{where}.{n}: already quantized with another weight spec ({m.weight_quantizer.extra_repr()})"
                )
            out[n] = m
        return out
    swapped = prepare(layer, scheme, PrepareParams(targets=names), where=where)
    return {n: m for n, m in swapped.items() if isinstance(m, QuantLinear)}


# ---- offloading -----------------------------------------------------------------------------------


class DiskOffload:
    """``release`` saves a processed layer's state (weights and qparams) to ``dir/layer_{i}.safetensors``
    and moves the layer to the meta device; :meth:`restore` loads every saved layer back."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)

    def path(self, i: int) -> Path:
        return self.dir / f"layer_{i}.safetensors"

    def release(self, i: int, layer: nn.Module) -> None:
        from safetensors.torch import save_file

        state = {k: v.detach().contiguous() for k, v in layer.state_dict().items()}
        save_file(state, str(self.path(i)))
        layer.to("meta")

    def restore(self, layers: nn.ModuleList) -> None:
        from safetensors.torch import load_file

        for i, layer in enumerate(layers):
            layer.load_state_dict(load_file(str(self.path(i))), assign=True)


def log_summary(name: str, summary: dict[str, Any]) -> None:
    """Log a :func:`sequential_quantize` summary on one line."""
    log.info("%s: %d Linears in %d layers, %.1f s", name, summary["quantized_linears"], len(summary["layers"]), summary["seconds"])
