"""Conversion of a calibrated (PTQ) or trained (QAT) fake-quant model into real int8 modules.

``convert(model, backend="cuda")`` swaps every QuantLinear / QuantConv2d the int8 kernels can run
for an Int8Linear / Int8Conv2d computing the same integer codes, every weight-only int4
QuantLinear for a W4A16Linear (quantization/lowering/w4a16.py) and every float8 QuantLinear for an
FP8Linear (quantization/lowering/fp8.py). A layer that cannot be converted
(weight-only 8-bit or W4A8 schemes, grouped convolutions, per-channel activations, ...) stays as it is,
a fake-quant layer computing in float, and the reason is logged and reported. QAT BatchNorms held
by a QuantConv are folded first (on the copy). A ReLU/GELU module that alone consumes a converted
layer's output is fused into the kernel epilogue and replaced by Identity (found with torch.fx,
or by nn.Sequential adjacency when the model does not trace).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from compress.quantization.algorithms.bn_fold import sequential_pairs
from compress.quantization.lowering.fp8 import FP8Linear
from compress.quantization.lowering.fused_norm import fuse_norms as fuse_norm_modules
from compress.quantization.lowering.horizontal import track_readers
from compress.quantization.lowering.int4 import is_int4_weight_only
from compress.quantization.lowering.int8 import Int8Conv2d, Int8Linear, StaticQDQ
from compress.quantization.lowering.kernels import require_triton
from compress.quantization.lowering.kernels.ops import register as register_ops
from compress.quantization.lowering.shared_input import share_input_codes
from compress.quantization.lowering.speed import keep_float_reason, layer_input_shapes
from compress.quantization.lowering.w4a16 import W4A16Linear
from compress.quantization.numerics.fake_quant import FakeQuantizer
from compress.quantization.numerics.modules import QUANT_TYPES, QuantConv1d, QuantConv2d, QuantLinear
from compress.quantization.placement.mode import detach as detach_placement
from compress.quantization.placement.mode import input_quantizer
from compress.quantization.preparation import unwrap
from torch import nn

from compress.core.errors import RecipeError, UnsupportedModelError, did_you_mean

log = logging.getLogger(__name__)

BACKENDS = ("cuda",)
PLACED = ("fuse", "drop")
_LAYERS = (QuantLinear, QuantConv2d, QuantConv1d)


@dataclass(frozen=True)
class LayerConversion:
    """What happened to one quantized module: converted to ``int8_type`` or kept float (``reason``).

    ``kind``: ``"layer"`` for quantized layers, ``"norm"`` for RMSNorms and LayerNorms (``int8_type``
    FusedRMSNorm / FusedLayerNorm: one kernel that also quantizes for its readers; else kept as they
    are, with the reason)."""

    name: str
    quant_type: str
    int8_type: str | None
    activation: str = "none"
    reason: str = ""
    kind: str = "layer"

    @property
    def converted(self) -> bool:
        return self.int8_type is not None


def _activation_of(mod: nn.Module) -> str | None:
    if isinstance(mod, nn.ReLU):
        return "relu"
    if isinstance(mod, nn.GELU) and mod.approximate == "none":
        return "gelu"
    return None


def _fusable(layer: nn.Module, act: nn.Module) -> bool:
    return isinstance(layer, _LAYERS) and _activation_of(act) is not None


class _LeafTracer:
    """A torch.fx tracer that keeps quantized layers and quantizers opaque (built lazily)."""

    @staticmethod
    def trace(model: nn.Module) -> Any:
        from torch import fx

        class Tracer(fx.Tracer):
            def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
                return isinstance(m, (*QUANT_TYPES, FakeQuantizer)) or super().is_leaf_module(m, module_qualified_name)

        return Tracer().trace(model)


def fusable_activations(model: nn.Module) -> dict[str, str]:
    """``{layer_name: activation_module_name}`` for activations that alone consume a layer's output.

    Identity modules in between (folded BatchNorms) are looked through. Uses torch.fx when the
    model traces, else adjacent children of nn.Sequential containers.
    """
    mods = dict(model.named_modules())
    try:
        graph = _LeafTracer.trace(model)
    except Exception as exc:  # fx cannot trace data-dependent control flow; adjacency is still certain
        log.debug("fx tracing failed (%s); fusing activations by Sequential adjacency only", exc)
        return sequential_pairs(model, _fusable)
    calls: dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "call_module":
            calls[str(node.target)] = calls.get(str(node.target), 0) + 1
    pairs: dict[str, str] = {}
    for node in graph.nodes:
        if node.op != "call_module" or _activation_of(mods[str(node.target)]) is None:
            continue
        src = node.args[0] if node.args else None
        while src is not None and getattr(src, "op", None) == "call_module" and isinstance(mods[str(src.target)], nn.Identity):
            src = src.args[0] if len(src.users) == 1 and src.args else None
        if src is None or getattr(src, "op", None) != "call_module" or len(src.users) != 1:
            continue
        layer, act = str(src.target), str(node.target)
        if isinstance(mods[layer], _LAYERS) and calls[layer] == 1 and calls[act] == 1:
            pairs[layer] = act
    return pairs


def _is_fp8(mod: nn.Module) -> bool:
    wq = getattr(mod, "weight_quantizer", None)
    return wq is not None and wq.spec.is_fp8


def _builder(mod: nn.Module) -> Callable[..., nn.Module]:
    if type(mod) is QuantLinear:
        if _is_fp8(mod):
            return FP8Linear.from_quant  # float8 e4m3: cuBLASLt's _scaled_mm (quantization/lowering/fp8.py)
        # weight-only int4 (w4_weight_only_g128, GPTQ, AWQ) runs the W4A16 kernel (quantization/lowering/w4a16.py)
        return W4A16Linear.from_quant if is_int4_weight_only(mod) else Int8Linear.from_quant
    if type(mod) is QuantConv2d:
        if _is_fp8(mod):
            raise UnsupportedModelError("fp8 convolutions have no kernel here (fp8 Linear layers do)")
        return Int8Conv2d.from_quant
    raise UnsupportedModelError(f"{type(mod).__name__} has no int8 kernel (Linear and Conv2d do)")


def _float_inputs(example: Any, dtype: torch.dtype) -> Any:
    if isinstance(example, torch.Tensor):
        return example.to(dtype) if example.is_floating_point() else example
    if isinstance(example, dict):
        return {k: _float_inputs(v, dtype) for k, v in example.items()}
    if isinstance(example, (tuple, list)):
        return type(example)(_float_inputs(v, dtype) for v in example)
    return example


def convert_with_report(
    model: nn.Module, *, backend: str = "cuda", inplace: bool = False, fuse_activations: bool = True,
    speed_check: Any = None, speed_dtype: torch.dtype = torch.float16,
    speed_timer: Callable[..., tuple[float, float]] | None = None, placed: str = "drop", fuse_norms: bool | None = None,
    horizontal: bool = True,
) -> tuple[nn.Module, list[LayerConversion]]:
    """:func:`convert`, also returning what happened to each quantized module.

    ``speed_check``: example inputs (on the model's device). Each converted layer is then timed at
    the shape these inputs give it against its float form in ``speed_dtype``; a layer whose kernel
    is slower stays float (a plain Linear/Conv with the original weights) and the report says so
    with both times (quantization/lowering/speed.py). ``speed_timer`` replaces the timing (tests).

    ``placed``: what becomes of the activation quantizers placed on tensors (not owned by a layer;
    the ONNX placement puts them where ONNX Runtime has integer ops, e.g. residual adds). ``fuse``
    keeps them, each as one kernel pass, so the converted model computes exactly what the
    fake-quant model does (parity checks); ``drop`` removes them, since CUDA runs those ops in
    float: every int8 layer still quantizes its own input with the calibrated parameters, so only
    the emulation of integer adds goes, and with it a pass over each tensor (deployment, the
    default). With nothing left to place, the placement's per-op interception is removed too, so the
    model runs without it eagerly and traces in one graph under torch.compile; a ``fuse`` model keeps
    the interception, which torch.compile does not run (its placed quantizers would be skipped).

    ``fuse_norms``: replace each Llama-family RMSNorm and each LayerNorm (proven equal on probe
    inputs) by a FusedRMSNorm / FusedLayerNorm, one kernel that also writes the per-token codes its
    dynamic int8/fp8 readers would compute (quantization/lowering/fused_norm.py); reported as
    ``kind="norm"`` rows. The kernel sums
    in another order than torch (its output may differ by a unit in the last place, and a code then
    by one step), so the default (None) fuses for deployment (``placed="drop"``) and not for the
    parity model (``placed="fuse"``, the fake-quant model's exact arithmetic).

    ``horizontal``: int8 Linears seen reading one tensor (q/k/v, gate/up) run one GEMM over their
    concatenated weights from the call after (quantization/lowering/horizontal.py; bit-identical).
    """
    if placed not in PLACED:
        raise RecipeError(f"convert: placed='{placed}' unknown; valid: {', '.join(PLACED)}")
    if backend not in BACKENDS:
        raise RecipeError(f"unknown int8 backend '{backend}'; {did_you_mean(backend, BACKENDS)}")
    require_triton(f"convert(backend='{backend}')")
    register_ops()  # torch.ops.compress.*, what the converted modules call under torch.compile
    if not inplace:
        model = copy.deepcopy(model)
    root = unwrap(model)
    layers = {n: m for n, m in root.named_modules() if isinstance(m, QUANT_TYPES)}
    if not layers:
        raise UnsupportedModelError("convert: the model has no quantized modules; quantize (PTQ or QAT) it first")
    for mod in layers.values():
        if isinstance(mod, (QuantConv1d, QuantConv2d)) and mod.bn is not None:
            mod.fold_bn()  # QAT-attached BatchNorm: merge it so the int8 weight is the folded one
    acts = fusable_activations(root) if fuse_activations else {}
    shapes: dict[str, tuple[int, ...]] = {}
    if speed_check is not None:
        dtype = next((p.dtype for p in root.parameters() if p.is_floating_point()), torch.float32)
        shapes = layer_input_shapes(root, list(layers), _float_inputs(speed_check, dtype))
    report: list[LayerConversion] = []
    for name, mod in layers.items():
        qtype = type(mod).__name__
        act_name = acts.get(name)
        act = "none"
        if act_name is not None and mod.output_quantizer is None:
            act = _activation_of(root.get_submodule(act_name)) or "none"
        try:
            new = _builder(mod)(mod, activation=act, input_quantizer=input_quantizer(root, name))
        except UnsupportedModelError as exc:
            log.info("convert: %s (%s) stays float: %s", name, qtype, exc)
            report.append(LayerConversion(name, qtype, None, reason=str(exc)))
            continue
        if name in shapes and isinstance(mod, _LAYERS):
            why = keep_float_reason(name, new, mod, shapes[name], speed_dtype, timer=speed_timer)
            if why is not None:
                log.info("convert: %s (%s) stays float: %s", name, qtype, why)
                root.set_submodule(name, mod.to_float())
                report.append(LayerConversion(name, qtype, None, reason=why))
                continue
        root.set_submodule(name, new)
        if act != "none" and act_name is not None:
            root.set_submodule(act_name, nn.Identity())  # now applied in the kernel epilogue
        report.append(LayerConversion(name, qtype, type(new).__name__, activation=act))
    shared = share_input_codes(
        (m for m in root.modules() if isinstance(m, (Int8Linear, Int8Conv2d, FP8Linear))),
        lambda m: cast(Any, m).input_signature(),
    )
    if shared:
        log.info("convert: %d layers share their input quantization with another reader of the same tensor", shared)
    if (placed == "drop" if fuse_norms is None else fuse_norms) and _any_converted(report):
        norms = fuse_norm_modules(root, record=lambda n, t, why, new: report.append(
            LayerConversion(n, t, None if why else new, reason=why or "", kind="norm")))
        if norms:
            log.info("convert: %s run as one kernel that also quantizes for their readers",
                     ", ".join(f"{n} {form}s" for form, n in norms.items()))
    if horizontal:
        track_readers([m for m in root.modules() if isinstance(m, Int8Linear)])
    fused = _fuse_static_quantizers(root, drop=placed == "drop") if _any_converted(report) else 0
    if fused:
        log.info("convert: %d placed activation quantizers %s", fused,
                 "dropped (CUDA runs their ops in float)" if placed == "drop" else "now run as one kernel each")
    if placed == "drop" and not _placed_left(root):
        # nothing left for the placement to apply: its per-op interception goes too (eager speed;
        # torch.compile traces the model in one graph)
        detach_placement(root)
    done = sum(r.converted for r in report if r.kind == "layer")
    n_layers = sum(r.quant_type in {c.__name__ for c in _LAYERS} for r in report)
    log.info("convert(backend=%s): %d of %d quantized layers now run int8 kernels", backend, done, n_layers)
    if done == 0:
        log.warning("convert(backend=%s): no layer could be converted; the model is unchanged", backend)
    return model, report


def _any_converted(report: list[LayerConversion]) -> bool:
    return any(r.converted for r in report if r.kind == "layer")


def _placed_left(root: nn.Module) -> bool:
    """Whether a quantizer outside the layers (one the placement applies to an op) still acts."""
    inside = {id(q) for m in root.modules() if isinstance(m, QUANT_TYPES) for q in m.modules() if q is not m}
    return any(isinstance(m, (FakeQuantizer, StaticQDQ)) and id(m) not in inside and getattr(m, "role", "") != "weight"
               for m in root.modules())


def _fuse_static_quantizers(root: nn.Module, *, drop: bool = False) -> int:
    """Swap the static per-tensor activation quantizers left in the converted model (placed on
    tensors that float ops read, or output quantizers) for their one-kernel form, or with ``drop``
    remove them (those carrying SmoothQuant's factor stay: a float reader needs the factor)."""
    count = 0
    inside = {id(q) for m in root.modules() if isinstance(m, QUANT_TYPES) for q in m.modules() if q is not m}
    for name, mod in list(root.named_modules()):
        # a fake-quant layer kept float reads its own quantizers' specs: those stay FakeQuantizers
        if not isinstance(mod, FakeQuantizer) or mod.role == "weight" or not mod.enabled or id(mod) in inside:
            continue
        if drop and mod.pre_quant_scale is None and not mod.observing:
            root.set_submodule(name, nn.Identity())
            count += 1
            continue
        try:
            new: nn.Module = StaticQDQ.from_quantizer(mod)
        except UnsupportedModelError:
            continue
        root.set_submodule(name, new)
        count += 1
    return count


def convert(model: nn.Module, *, backend: str = "cuda", inplace: bool = False, fuse_activations: bool = True,
            speed_check: Any = None, speed_dtype: torch.dtype = torch.float16, placed: str = "drop",
            fuse_norms: bool | None = None, horizontal: bool = True) -> nn.Module:
    """A copy of the fake-quant ``model`` (or ``model`` itself with ``inplace``) running int8 kernels.

    Layers the kernels cannot run stay fake-quant (float) with the reason logged; with
    ``speed_check`` (example inputs on the GPU) layers whose kernel is slower than their float form
    in ``speed_dtype`` at their input shape stay float too; ``placed="drop"`` removes the activation
    quantizers that only emulate integer ops CUDA runs in float; ``horizontal`` lets the int8 Linears
    reading one tensor share one GEMM. See :func:`convert_with_report`
    for the per-layer record. Needs the triton extra; the converted model runs on CUDA (move it with
    ``.cuda()`` before or after converting).
    """
    return convert_with_report(model, backend=backend, inplace=inplace, fuse_activations=fuse_activations,
                               speed_check=speed_check, speed_dtype=speed_dtype, placed=placed,
                               fuse_norms=fuse_norms, horizontal=horizontal)[0]
