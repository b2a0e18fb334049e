"""SmoothQuant (Xiao et al., 2023): move activation outliers into the weights of Linear layers.

Per input feature j, ``s_j = max|X_j|^alpha / max|W_:,j|^(1-alpha)``; the weight is scaled by
``s`` and the input by ``1/s``, which leaves the float product unchanged but evens out the
per-channel activation ranges that one per-tensor activation scale must cover. The ``1/s`` lives
in the input quantizer as ``pre_quant_scale`` (a Mul before QuantizeLinear when exported), so it
works for post-LN transformers such as BERT, where the LayerNorm output also feeds the residual
and cannot absorb the factor.

No single alpha suits every layer (and on a model without strong outliers any fixed alpha can
hurt), so ``alpha="auto"`` picks it per layer: each candidate, and no smoothing at all, is scored
by the squared error of the layer's quantized output against its float output on a bounded
reservoir sample of the layer's calibration inputs (ranges fitted on one half, error measured on
the other), and the best one is kept.

Where the smoothed tensor is made by a module that nothing else reads (a decoder's pre-attention and
pre-MLP RMSNorm before q/k/v and gate/up) or by an elementwise product with a sibling Linear
(SwiGLU's ``act(gate) * up`` before down_proj), ``1/s`` is folded into that producer's weight
instead (the norm's weight, up_proj's output rows): no Mul is left in the model or its export. The
fold is found in the running model and proved numerically, as AWQ does (quantization/algorithms/awq_folds.py): a
random factor folded into the candidate must leave the model's outputs unchanged. Elsewhere (a
post-LN encoder, whose LayerNorm output also feeds the residual) the factor stays a
``pre_quant_scale``.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import torch
from compress.quantization.numerics.calibration import float_mode
from compress.quantization.numerics.fake_quant import FakeQuantizer
from compress.quantization.numerics.modules import QuantLinear
from compress.quantization.numerics.primitives import dynamic_qparams, fake_quantize_spec, qparams_from_range
from compress.quantization.placement.activations import capture_first_call, ensure_placed
from compress.quantization.placement.mode import input_quantizer, set_smoothing
from compress.quantization.preparation import calibrate_weight, quant_modules, unwrap
from pydantic import Field
from torch import nn
from torch.utils import _pytree as pytree

from compress.core.batching import ForwardLoop, as_forward_loop, micro_batches
from compress.core.errors import CalibrationError
from compress.core.progress import track, with_progress
from compress.core.tracing import tensor_leaves

log = logging.getLogger(__name__)

#: candidates of ``alpha="auto"``; ``None`` (no smoothing) is always tried as well
ALPHA_GRID: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
Alpha = float | Literal["auto"]
#: the recipe / QuantizeParams field: an alpha in [0, 1], "auto", or None (off)
SmoothQuantField = Annotated[float, Field(ge=0, le=1)] | Literal["auto"] | None
#: a group whose factor folds into no producer: a Mul before its quantizer, or not smoothed
Unfolded = Literal["mul", "skip"]


class _Reservoir:
    """A uniform sample of at most ``size`` input rows over the whole forward loop (memory stays
    ``size x features`` however many batches are seen)."""

    def __init__(self, size: int, seed: int = 0) -> None:
        self.size = size
        self.rows: torch.Tensor | None = None
        self.seen = 0
        self.gen = torch.Generator().manual_seed(seed)

    def add(self, x: torch.Tensor) -> None:
        rows = x.reshape(-1, x.shape[-1]).float().cpu()
        if self.rows is None:
            self.rows = rows.new_empty(0, rows.shape[1])
        free = self.size - len(self.rows)
        if free > 0:
            self.rows = torch.cat([self.rows, rows[:free]])
            self.seen += min(free, len(rows))
            rows = rows[free:]
        if len(rows) == 0:
            return
        pos = self.seen + torch.arange(len(rows), dtype=torch.float64)
        slot = (torch.rand(len(rows), generator=self.gen, dtype=torch.float64) * (pos + 1)).long()
        keep = slot < self.size
        self.rows[slot[keep]] = rows[keep]
        self.seen += len(rows)


@with_progress
def smooth_quant(
    model: nn.Module,
    forward_loop: ForwardLoop | Any,
    *,
    alpha: Alpha = 0.5,
    min_scale: float = 1e-2,
    sample_rows: int = 512,
    unfolded: Unfolded = "mul",
    micro_batch: int | None = 1,
    progress: bool = True,
) -> dict[str, torch.Tensor]:
    """Smooth every QuantLinear that quantizes its input; returns the factors ``s`` by layer name
    (all ones where ``alpha="auto"`` chose no smoothing). ``1/s`` is folded into the tensor's
    producer where that is exact (see the module docstring), else kept as the input quantizer's
    ``pre_quant_scale`` (``unfolded="mul"``), or that group is left unsmoothed (``"skip"``: every
    smoothed tensor is then absorbed by weights, as llm-compressor's mappings smooth only where they
    fold, and formats with no per-channel input scale, compressed-tensors, can hold the model).

    Runs ``forward_loop`` once in float to record per-feature activation maxima (O(features)
    memory; with ``"auto"`` also ``sample_rows`` input rows per group), then rescales weights in
    place and recalibrates the weight quantizers. The statistics are maxima over tokens and a
    reservoir of rows in order, so the loop's batches are run as micro-batches of ``micro_batch``
    samples (None: as they come): the same statistics, at the activation memory of that many
    samples (SmolLM2, 8 x 512 tokens: the KV cache and the MLP activations of 8 windows at once). A
    forward function ``fn(model)`` feeds the model its own batches. Layers that read the same tensor (BERT's query,
    key and value) get one ``s``, from the maxima of all their weights, so the exported graph
    quantizes that tensor once. ``s`` is clamped to ``[min_scale, 1/min_scale]`` so that dead
    features do not blow up the weight. ``progress``: bars on a terminal and a line per tenth of the
    groups smoothed; False: silent.
    """
    auto = alpha == "auto"
    if not auto and not (isinstance(alpha, (int, float)) and 0.0 <= float(alpha) <= 1.0):
        raise ValueError(f"smoothquant alpha must be in [0, 1] or 'auto' (got {alpha!r})")
    loop = as_forward_loop(forward_loop)
    root = unwrap(model)
    ensure_placed(root, loop)
    layers = {n: m for n, m in quant_modules(root) if isinstance(m, QuantLinear) and input_quantizer(root, n) is not None}
    if not layers:
        return {}
    amax: dict[str, torch.Tensor] = {}
    first_input: dict[str, tuple[Any, ...]] = {}
    samples = {n: _Reservoir(sample_rows, seed=i) for i, n in enumerate(layers)} if auto else {}
    # a layer that reads the very tensor the layer hooked before it read (k and v after q, up after
    # gate) takes its rows from that layer's sample: the alpha search reads one sample per group
    sampled_by: dict[str, str] = {}
    last: list[Any] = [None, ""]

    def hook(name: str) -> Any:
        def fn(_: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0].detach()
            a = x.abs().reshape(-1, x.shape[-1]).amax(0).float()
            amax[name] = torch.maximum(amax[name], a) if name in amax else a
            if name not in first_input:  # a fingerprint of the first input: equal for layers that share it
                flat = x.reshape(-1)
                first_input[name] = (tuple(x.shape), float(flat.double().sum()), tuple(flat[:16].tolist()))
            if auto:
                if name not in sampled_by:
                    sampled_by[name] = last[1] if args[0] is last[0] else name
                if sampled_by[name] == name:
                    samples[name].add(x)
                last[:] = [args[0], sampled_by[name]]

        return fn

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in layers.items()]
    try:
        with float_mode(root), torch.no_grad(), micro_batches(micro_batch):
            loop(model)
    finally:
        for h in handles:
            h.remove()
        last.clear()
    for name in layers:
        if name not in amax:
            raise CalibrationError(f"smoothquant: layer '{name}' saw no data during the forward loop")
    groups: dict[tuple[Any, ...], list[str]] = {}
    for name in layers:
        groups.setdefault(first_input[name], []).append(name)
    call = capture_first_call(root, loop)
    producers = find_producers(root, list(groups.values()), *_proof_call(root, call.args, call.kwargs)) if call else {}
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    scales: dict[str, torch.Tensor] = {}
    chosen: list[float | None] = []
    for names in track(list(groups.values()), logger=log, desc="smoothquant", unit="group"):
        mods = [layers[n] for n in names]
        with torch.no_grad():
            raw = []
            for name, mod in zip(names, mods):
                iq = input_quantizer(root, name)
                assert iq is not None
                if iq.pre_quant_scale is not None:  # smoothed before: start again from the raw weight
                    mod.weight.mul_(iq.pre_quant_scale.to(mod.weight.dtype))
                    iq.pre_quant_scale = None
                raw.append(mod.weight.detach().clone())
            if unfolded == "skip" and producers.get(names[0]) is None:
                set_smoothing(root, names, None)
                for name, mod in zip(names, mods):
                    calibrate_weight(mod)
                    scales[name] = torch.ones_like(amax[name])
                chosen.append(None)
                continue
            a = torch.stack([amax[n] for n in names]).amax(0)  # the hooks saw the raw input
            if distributed:  # ranks may calibrate on different shards: every rank must smooth alike
                torch.distributed.all_reduce(a, op=torch.distributed.ReduceOp.MAX)
            w = torch.stack([r.abs().amax(0).float() for r in raw]).amax(0)
            if auto:
                rows = samples[sampled_by.get(names[0], names[0])].rows
                assert rows is not None
                best = _pick_alpha(mods, raw, rows, a, w, min_scale, input_quantizer(root, names[0]))
                if distributed:  # rank 0's choice, so the weights stay identical across ranks
                    pick = torch.tensor([-1 if best is None else ALPHA_GRID.index(best)], device=a.device)
                    torch.distributed.broadcast(pick, src=0)
                    best = None if int(pick) < 0 else ALPHA_GRID[int(pick)]
                chosen.append(best)
                s = _factors(a, w, best, min_scale) if best is not None else torch.ones_like(a)
            else:
                s = _factors(a, w, float(alpha), min_scale)
            for mod, r in zip(mods, raw):
                mod.weight.copy_(r * s.to(r.dtype))
            producer = producers.get(names[0])
            if producer is not None and not torch.all(s == 1):
                made_by = root.get_submodule(producer.name)
                divide_output_channels(made_by, s, offset=producer.offset)
                if getattr(made_by, "weight_quantizer", None) is not None:
                    # a quantized producer (up_proj before down_proj): its rows changed after its own
                    # weight scales were fitted; stale scales would clip the rows that grew
                    calibrate_weight(made_by)
        if producer is not None:
            set_smoothing(root, names, None)
        else:
            set_smoothing(root, names, None if torch.all(s == 1) else (1.0 / s).to(mods[0].weight.device))
        for name, mod in zip(names, mods):
            calibrate_weight(mod)
            scales[name] = s
    into = {p.name.rsplit(".", 1)[-1] for n in groups.values() if (p := producers.get(n[0])) is not None}
    folded = sum(1 for names in groups.values() if producers.get(names[0]) is not None)
    log.info("smoothquant: %d of %d input groups folded into their producer (%s), %d %s",
             folded, len(groups), ", ".join(sorted(into)), len(groups) - folded,
             "left unsmoothed (no exact fold)" if unfolded == "skip" else "as a Mul before the quantizer")
    if auto:
        picked = [v for v in chosen if v is not None]
        log.info(
            "smoothquant: auto alpha on %d Linear layers in %d input groups; %d groups smoothed (alphas %s), "
            "%d left as they were", len(scales), len(groups), len(picked), sorted(set(picked)), len(chosen) - len(picked),
        )
    else:
        log.info("smoothquant: alpha=%.2f on %d Linear layers in %d input groups", float(alpha), len(scales), len(groups))
    return scales


@dataclass(frozen=True)
class Producer:
    """The module whose output channels absorb a group's ``1/s``; ``offset``: a norm that scales by
    ``1 + weight`` (Gemma's RMSNorm), so the factor goes into ``1 + weight``."""

    name: str
    offset: bool = False


def divide_output_channels(mod: nn.Module, s: torch.Tensor, *, offset: bool = False) -> None:
    """Divide ``mod``'s output channel ``j`` by ``s[j]``: a norm's weight (and bias), a Linear's
    weight rows (and bias); ``offset``: the norm multiplies by ``1 + weight``."""
    w = getattr(mod, "weight", None)
    if not isinstance(w, torch.Tensor):
        raise CalibrationError(f"smoothquant: {type(mod).__name__} has no weight to fold a scale into")
    with torch.no_grad():
        if offset:
            w.copy_((1 + w) / s.to(w.device, w.dtype) - 1)
        else:
            w.div_(s.to(w.device, w.dtype).unsqueeze(1) if w.dim() == 2 else s.to(w.device, w.dtype))
        b = getattr(mod, "bias", None)
        if isinstance(b, torch.Tensor):
            b.div_(s.to(b.device, b.dtype))


#: the attribute find_producers tags a module's output with during its forward: the module's name
_MADE_BY = "_compress_made_by"
#: the keywords transformers' models take a KV cache by (4.x and 5.x names)
_CACHE_KWARGS = ("past_key_values", "past_key_value", "cache")


def _proof_call(root: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call the fold proofs run: cut to its first sample when every tensor in it has the same
    leading (batch) size (one sample proves a fold as well as many), and without a KV cache when the
    model takes ``use_cache`` and the call brings no cache of its own. The proofs copy each decoder
    layer's inputs as they were, and a cache filled as the forward goes is in every later layer's
    inputs: SmolLM2's 30 copies of it (0.7 GB at 512 tokens) were SmoothQuant's peak memory."""
    sizes = {t.shape[0] if t.dim() else -1 for _, t in tensor_leaves((args, kwargs or {}))}
    if len(sizes) == 1 and next(iter(sizes)) > 1:
        args, kwargs = pytree.tree_map(lambda t: t[:1] if isinstance(t, torch.Tensor) else t, (args, kwargs))
    try:
        takes = "use_cache" in inspect.signature(root.forward).parameters
    except (TypeError, ValueError):
        takes = False
    if takes and all(kwargs.get(k) is None for k in _CACHE_KWARGS):
        kwargs = {**kwargs, "use_cache": False}
    return args, kwargs


def _outputs(out: Any) -> torch.Tensor:
    leaves = [t.detach().float().reshape(-1) for _, t in tensor_leaves(out) if t.is_floating_point()]
    return torch.cat(leaves) if leaves else torch.zeros(0)


@torch.no_grad()
def find_producers(
    root: nn.Module, groups: list[list[str]], args: tuple[Any, ...], kwargs: dict[str, Any], *, tol: float = 1e-3
) -> dict[str, Producer | None]:
    """For each group of Linears reading one tensor: the module whose output channels can absorb
    ``1/s`` exactly (by consumer name; None where no fold is exact). A norm's weight is tried as a
    plain scale, then as an offset one (``1 + weight``).

    Candidates: the module with weights that produced the tensor; when no module did (an
    elementwise product), Linears of the same parent module with as many outputs as the tensor
    has features. Each candidate is proved on ``(args, kwargs)``: random factors in [0.5, 2]
    folded into it (and multiplied into the group's weights) must leave the outputs unchanged to
    ``tol``, relative; the model is restored after every trial. The outputs compared are those of
    the smallest module holding the producer and the group (a decoder layer) rerun on the inputs
    it had in the model's forward, or of ``root`` where that module runs more than once or shares a
    touched weight with modules outside it: a trial then costs one layer, not the whole model."""
    mods = dict(root.named_modules())
    consumers = {n for g in groups for n in g}
    # what each consumer read: its width and the module with weights that made it, tagged on the
    # tensor as it is made (holding every activation of the forward to match them afterwards by
    # identity would keep the whole forward's activations alive)
    reads: dict[str, tuple[int, str | None]] = {}
    tagged: list[weakref.ref[torch.Tensor]] = []
    scopes = _Scopes(root, groups)
    handles = scopes.hooks()

    def read(m: nn.Module, a: tuple[Any, ...], n: str) -> None:
        if n not in reads:
            reads[n] = (a[0].shape[-1], a[0].__dict__.get(_MADE_BY))

    for name, mod in mods.items():
        if name in consumers:
            handles.append(mod.register_forward_pre_hook(functools.partial(read, n=name)))
        if name and any(True for _ in mod.parameters(recurse=False)) and name not in consumers:

            def post(m: nn.Module, a: Any, out: Any, n: str = name) -> None:
                if isinstance(out, torch.Tensor) and _MADE_BY not in out.__dict__:  # the first maker counts
                    setattr(out, _MADE_BY, n)
                    tagged.append(weakref.ref(out))

            handles.append(mod.register_forward_hook(post))
    try:
        with float_mode(root):
            ref = _outputs(root(*args, **kwargs))
    finally:
        for h in handles:
            h.remove()
        for r in tagged:  # a tensor that outlives the forward (a module returning its own weight) is left as it was
            if (t := r()) is not None:
                delattr(t, _MADE_BY)
    scopes.whole = (args, kwargs, ref)
    found: dict[str, Producer | None] = {}
    proved: dict[tuple[Any, ...], bool] = {}

    def exact(c: str, group: list[str], width: int, off: bool) -> bool:
        # a fold's exactness is a property of the code the tensor flows through, so a trial proved in
        # one decoder layer holds for every layer of the same structure (same classes, relative names
        # and weight shapes): 30 layers cost one trial each, not 30
        key = _structure([c, *group], mods, off)
        if key not in proved:
            proved[key] = _fold_is_exact(root, c, group, width, scopes, tol, offset=off)
        return proved[key]

    for group in groups:
        seen = reads.get(group[0])
        producer: Producer | None = None
        if seen is not None:
            width, made_by = seen
            if made_by is not None:
                cands = [made_by]
            else:
                parent = group[0].rpartition(".")[0]
                cands = [n for n, m in mods.items() if isinstance(m, nn.Linear) and n.rpartition(".")[0] == parent
                         and n not in group and m.out_features == width]
            producer = next((Producer(c, off) for c in cands for off in (False, True)
                             if (not off or not isinstance(mods[c], nn.Linear)) and exact(c, group, width, off)), None)
        for n in group:
            found[n] = producer
    return found


def _structure(names: list[str], mods: dict[str, nn.Module], offset: bool) -> tuple[Any, ...]:
    """What a fold trial's outcome depends on: the classes of the modules that hold ``names`` (up
    to the root), and for each name the classes on its path down from their nearest common holder,
    its weight shape and its name relative to that holder (``model.layers.3.self_attn.q_proj`` ->
    ``self_attn.q_proj``): an MLP of another class around the same Linears is another structure."""
    common = _common_prefix(names)
    cut = len(common) + 1 if common else 0
    holders = tuple(type(mods[a]).__name__ for a in [common, *_ancestors(common)] if a in mods) if common else ()
    parts = []
    for n in names:
        w = getattr(mods[n], "weight", None)
        path = [a for a in reversed(_ancestors(n)) if len(a) > len(common)] + [n]
        parts.append((n[cut:], tuple(type(mods[a]).__name__ for a in path),
                      tuple(w.shape) if isinstance(w, torch.Tensor) else None))
    return (holders, tuple(parts), offset)


class _Scopes:
    """The modules a fold trial may rerun instead of the whole model: every ancestor of a group's
    first Linear, with the inputs of its first call (copied before it ran: a KV cache it appends to
    is seen as it was) and how often it was called.

    Inputs are copied for the first module of each build (class, submodules, weight shapes) only:
    trials are made once per layer structure, in the first layer that has it, so SmolLM2's 29 later
    decoder layers would hold copies no trial reads. A trial whose scope has no copy runs the next
    enclosing scope that has one (the whole model at worst)."""

    def __init__(self, root: nn.Module, groups: list[list[str]]) -> None:
        self.root = root
        self.names = sorted({a for g in groups for a in _ancestors(g[0])})
        self.builds = {n: _build(root.get_submodule(n)) for n in self.names}
        self.copied: set[Any] = set()
        self.calls: dict[str, int] = {}
        self.inputs: dict[str, tuple[tuple[Any, ...], dict[str, Any]] | None] = {}
        self.refs: dict[str, torch.Tensor] = {}
        self.whole: tuple[tuple[Any, ...], dict[str, Any], torch.Tensor] | None = None
        owners: dict[int, list[str]] = {}
        for n, prm in root.named_parameters(remove_duplicate=False):
            owners.setdefault(id(prm), []).append(n)
        self.owners = owners

    def hooks(self) -> list[Any]:
        def pre(n: str) -> Any:
            def fn(m: nn.Module, a: tuple[Any, ...], kw: dict[str, Any]) -> None:
                self.calls[n] = self.calls.get(n, 0) + 1
                if n not in self.inputs and self.builds[n] not in self.copied:
                    self.copied.add(self.builds[n])
                    try:
                        self.inputs[n] = copy.deepcopy((tuple(a), dict(kw)))
                    except Exception:  # an argument that cannot be copied: trials run the whole model
                        self.inputs[n] = None
            return fn

        return [self.root.get_submodule(n).register_forward_pre_hook(pre(n), with_kwargs=True) for n in self.names]

    def pick(self, touched: list[str]) -> tuple[Callable[[], torch.Tensor], torch.Tensor]:
        """How to compute the outputs of the smallest usable scope holding the ``touched`` modules,
        and those outputs now (call it before changing any weight)."""
        common = _common_prefix(touched)
        for n in [common, *_ancestors(common)] if common else []:
            inputs = self.inputs.get(n)
            if self.calls.get(n) != 1 or inputs is None or not self._owns(n, touched):
                continue
            mod = self.root.get_submodule(n)
            if n not in self.refs:
                self.refs[n] = self._call(mod, inputs)
            return functools.partial(self._call, mod, inputs), self.refs[n]
        assert self.whole is not None
        args, kwargs, ref = self.whole
        return functools.partial(self._call, self.root, (args, kwargs)), ref

    def _call(self, mod: nn.Module, inputs: tuple[tuple[Any, ...], dict[str, Any]]) -> torch.Tensor:
        a, kw = copy.deepcopy(inputs)
        with float_mode(self.root):
            return _outputs(mod(*a, **kw))

    def _owns(self, scope: str, touched: list[str]) -> bool:
        # a weight tied to a module outside the scope (an embedding shared with lm_head) changes
        # outputs the scope's own do not show
        for t in touched:
            for prm in self.root.get_submodule(t).parameters(recurse=False):
                if any(not o.startswith(scope + ".") for o in self.owners.get(id(prm), [])):
                    return False
        return True


def _build(mod: nn.Module) -> tuple[Any, ...]:
    """What tells a module's build apart: the classes of it and its submodules by relative name, and
    the shapes and dtypes of their own weights and buffers."""
    return tuple((rel, type(sub).__name__, tuple((k, tuple(t.shape), t.dtype) for k, t in
                                                 [*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False)]))
                 for rel, sub in mod.named_modules())


def _ancestors(name: str) -> list[str]:
    """The proper ancestors of module ``name``, nearest first, the root ('') excluded."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]


def _common_prefix(names: list[str]) -> str:
    split = [n.split(".") for n in names]
    common: list[str] = []
    for level in zip(*split):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    if common and any(len(s) == len(common) for s in split):  # one of them holds the others
        common.pop()
    return ".".join(common)


def _fold_is_exact(root: nn.Module, producer: str, group: list[str], width: int, scopes: _Scopes, tol: float,
                   *, offset: bool = False) -> bool:
    p = root.get_submodule(producer)
    w = getattr(p, "weight", None)
    if not isinstance(w, torch.Tensor) or w.shape[0] != width or (w.dim() != 2 and tuple(w.shape) != (width,)):
        return False
    touched = [p, *(root.get_submodule(n) for n in group)]
    saved = [{k: v.detach().clone() for k, v in m.named_parameters(recurse=False)} for m in touched]
    gen = torch.Generator().manual_seed(width)
    if w.dtype == torch.float32:
        s = torch.empty(width).uniform_(0.5, 2.0, generator=gen)
    else:  # bf16/fp16: powers of two scale exactly, so an exact fold changes no bit and rounding hides nothing
        s = 2.0 ** torch.randint(-1, 2, (width,), generator=gen).float()
    run, ref = scopes.pick([producer, *group])
    try:
        divide_output_channels(p, s, offset=offset)
        for n in group:
            cw = root.get_submodule(n).weight
            assert isinstance(cw, torch.Tensor)  # the groups are QuantLinears
            cw.mul_(s.to(cw.device, cw.dtype))
        out = run()
        err = float((out - ref).norm() / ref.norm().clamp_min(1e-12)) if out.shape == ref.shape else float("inf")
    finally:
        for m, params in zip(touched, saved):
            for k, v in params.items():
                getattr(m, k).copy_(v)
    return err < tol


def _factors(amax_x: torch.Tensor, amax_w: torch.Tensor, alpha: float, min_scale: float) -> torch.Tensor:
    s = (amax_x.clamp(min=1e-8).pow(alpha) / amax_w.clamp(min=1e-8).pow(1 - alpha)).clamp(min_scale, 1 / min_scale)
    return torch.where((amax_x > 0) & (amax_w > 0), s, torch.ones_like(s))


def _pick_alpha(
    mods: list[QuantLinear], raw: list[torch.Tensor], rows: torch.Tensor, amax_x: torch.Tensor,
    amax_w: torch.Tensor, min_scale: float, iq: FakeQuantizer | None,
) -> float | None:
    """The candidate (``None`` = no smoothing) with the least summed output error of the group's
    layers on held-out rows.

    The activation range comes from one half of the sample and the error from the other: smoothing
    can concentrate the range in a few columns whose extremes a sample estimates poorly, and only
    out-of-sample rows show the clipping that follows.
    """
    assert iq is not None
    x = rows.to(raw[0].device, raw[0].dtype)
    fit, held = (x[0::2], x[1::2]) if len(x) >= 2 else (x, x)
    refs = [held @ r.t() for r in raw]
    best: float | None = None
    best_err = float("inf")
    for al in (None, *ALPHA_GRID):
        s = torch.ones_like(amax_x) if al is None else _factors(amax_x, amax_w, al, min_scale)
        s = s.to(x.dtype)
        xs = held / s
        if iq.spec.dynamic:
            sc, zp = dynamic_qparams(xs, iq.spec)
        else:
            xf = fit / s
            sc, zp = qparams_from_range(
                xf.min(), xf.max(), qmin=iq.spec.qmin, qmax=iq.spec.qmax, symmetric=iq.spec.symmetric
            )
        xq = fake_quantize_spec(xs, sc, zp, iq.spec) if iq.spec.granularity in ("tensor", "token") else xs
        err = 0.0
        for mod, r, ref in zip(mods, raw, refs):
            ws = r * s.to(r.dtype)
            wq = mod.weight_quantizer
            if wq is not None:
                wsc, wzp = dynamic_qparams(ws, wq.spec)
                ws = fake_quantize_spec(ws, wsc, wzp, wq.spec)
            err += float((xq @ ws.t() - ref).pow(2).sum())
        if err < best_err:
            best, best_err = al, err
    return best
