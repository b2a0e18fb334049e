"""ONNX export of decoder-only transformers LLMs (any family :func:`check_decoder` takes: dense, MoE,
sliding-window, soft-capped, post-norm, parallel blocks) for generation with a key/value cache.

``export_llm_onnx(model, path, weights="int4")`` writes a graph that ONNX Runtime runs step by step:

- inputs ``input_ids`` int64 ``[B, S]``, ``attention_mask`` int64 ``[B, P+S]`` (0 marks left
  padding) and, per layer ``i``, ``past_key_values.{i}.key`` / ``.value`` float32
  ``[B, kv_heads, P, head_dim]`` (P = 0 on the first step);
- outputs ``logits`` ``[B, S, vocab]`` and ``present.{i}.key`` / ``.value`` ``[B, kv_heads, P+S,
  head_dim]``, which the next step feeds back as its past (the names ORT GenAI uses).

Positions count the unpadded tokens (``cumsum(attention_mask) - 1``, as transformers' generate
does) and attention is causal over past and new tokens, padding masked out, so batched prompts
of different lengths run left-padded. The graph is traced from :class:`KVDecoder`
(export/llm/decoder.py): the model's own forward over an explicit past (``"decomposed"``, any
family), or a hand-written pre-norm block with ORT's RotaryEmbedding + GroupQueryAttention
(``"fused"``, export/llm/attention.py) where that block is shown to compute the model
(:func:`fused_mismatch`) and the installed onnxruntime's GroupQueryAttention has the inputs it
needs. RoPE whose frequencies change with the sequence length (dynamic, longrope) is refused.

Weights: ``"int4"`` writes every weight-only 4-bit QuantLinear as ``com.microsoft.MatMulNBits``
(bits 4, block size = the group size, float32 scales, packed uint8 zero points when asymmetric;
per-channel scales become one block of the next power of two >= K, and a K not divisible by the
block is padded with zero-point codes, which dequantize to 0; q/k/v and a gated MLP's gate/up packed
into one op each, export/llm/matmul_nbits.py) and other Linears in float;
``"fp32"`` writes every weight in float32 — for a fake-quant model its quantized values, so both
files compute the fake-quant model up to float rounding. ``"w8a8"`` writes Linears with quantized
inputs in integer form (export/llm/w8a8.py: QDQ + MatMul for static per-tensor activations,
per-token quantization + MatMulInteger for dynamic ones), int4 weight-only layers as MatMulNBits
and the rest in float. GPTQ's act_order in this project keeps static groups (no g_idx), so nothing extra is
exported; a g_idx permutation is refused.

:func:`generate_ort` runs greedy generation on such a file; :class:`OrtGenerator` exposes the
prefill and decode steps separately (benchmarks time them).
"""

from __future__ import annotations

import copy
import logging
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from compress.export.llm.attention import fused_attention_supported

# the decoder, the check and generation live in their own modules; their names stay importable from here
from compress.export.llm.decoder import (  # noqa: F401
    CONVENTIONS,
    Attention,
    KVDecoder,
    Layout,
    check_decoder,
    fused_layout,
    fused_mismatch,
    positions,
    sliding_windows,
)

# the MatMulNBits names stay importable from here (tests and callers read them from this module)
from compress.export.llm.matmul_nbits import (  # noqa: F401
    MatMulNBitsLinear,
    _MatMulNBitsFn,
    int8_head,
    matmul_nbits_tensors,
    pack_projections,
)
from compress.export.llm.ort import (  # noqa: F401
    FLOAT_MIN_SQNR_DB,
    MIN_TOP1,
    OrtCheck,
    OrtGenerator,
    check_in_ort,
    decoder_steps,
    generate_ort,
)
from compress.export.llm.symbolics import exporter_fixes
from compress.quantization.lowering.int4 import (
    activation_quantizers,
    dequantize_int4,
    int4_weight,
    is_int4_weight_only,
)
from compress.quantization.view import input_quantizer, remove_placement
from torch import nn

from compress.core.errors import ExportError, UnsupportedModelError
from compress.core.moe import unpack_experts

log = logging.getLogger(__name__)

Weights = Literal["int4", "fp32", "w8a8"]


def _swap_linears(model: nn.Module, weights: Weights, accuracy_level: int) -> dict[str, int]:
    """Replace quantized layers in place: W8A8 modules (w8a8), MatMulNBitsLinear (int4) or float Linear."""
    counts = {"int4": 0, "float": 0, "w8a8": 0}
    w8a8: dict[str, nn.Module] = {}
    if weights == "w8a8":
        from compress.export.llm.w8a8 import w8a8_linear

        shared: dict[int, Any] = {}
        for name, mod in list(model.named_modules()):
            if getattr(mod, "weight_quantizer", None) is not None:
                new8 = w8a8_linear(model, name, mod, shared)
                if new8 is not None:
                    w8a8[name] = new8
    for name, mod in list(model.named_modules()):
        if getattr(mod, "weight_quantizer", None) is None:
            continue
        if name in w8a8:
            model.set_submodule(name, w8a8[name])
            counts["w8a8"] += 1
            continue
        if getattr(mod, "input_quantizer", None) is not None or getattr(mod, "output_quantizer", None) is not None:
            raise UnsupportedModelError(
                f"{name}: quantized activations (W8A8) are not exported for generation here; weight-only layers are"
            )
        if weights in ("int4", "w8a8") and is_int4_weight_only(mod):
            new: nn.Module = MatMulNBitsLinear(int4_weight(mod, where=name), mod.bias,
                                               accuracy_level=accuracy_level, where=name)
            counts["int4"] += 1
        else:
            with torch.no_grad():
                w = (dequantize_int4(int4_weight(mod, where=name)) if is_int4_weight_only(mod)
                     else mod.quantized_weight().detach())
            lin = nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None)
            lin.weight = nn.Parameter(w.float().clone(), requires_grad=False)
            if mod.bias is not None:
                lin.bias = nn.Parameter(mod.bias.detach().float().clone(), requires_grad=False)
            new = lin
            counts["float"] += 1
        model.set_submodule(name, new)
    return counts


class _ScaledLinear(nn.Module):
    """``Linear(x * pre_scale)``: a quantized layer's float computation (SmoothQuant's ``1/s`` kept)."""

    pre_scale: torch.Tensor | None

    def __init__(self, linear: nn.Linear, pre_scale: torch.Tensor | None) -> None:
        super().__init__()
        self.linear = linear
        self.register_buffer("pre_scale", pre_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x if self.pre_scale is None else x * self.pre_scale)


def _float_linears(model: nn.Module) -> None:
    """Replace every quantized Linear of ``model`` by its float computation, in place: the weight as
    held (already smoothed) and the input quantizer's ``pre_quant_scale``, wherever the placement
    keeps that quantizer (on the Linear, or on a reshape before it, which KVDecoder does not run)."""
    for name, mod in list(model.named_modules()):
        if getattr(mod, "weight_quantizer", None) is None:
            continue
        iq: Any = input_quantizer(model, name)
        pre = None if iq is None or iq.pre_quant_scale is None else iq.pre_quant_scale.detach().float().clone()
        lin = nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None)
        weight: Any = mod.weight
        lin.weight = nn.Parameter(weight.detach().float().clone(), requires_grad=False)
        if mod.bias is not None:
            lin.bias = nn.Parameter(mod.bias.detach().float().clone(), requires_grad=False)
        model.set_submodule(name, _ScaledLinear(lin, pre))


def io_names(n_layers: int, *, position_ids: bool = False) -> tuple[list[str], list[str]]:
    past = [f"past_key_values.{i}.{kv}" for i in range(n_layers) for kv in ("key", "value")]
    present = [f"present.{i}.{kv}" for i in range(n_layers) for kv in ("key", "value")]
    return ["input_ids", "attention_mask", *(["position_ids"] if position_ids else []), *past], ["logits", *present]


def export_llm_onnx(
    model: nn.Module,
    path: str | Path,
    *,
    weights: Weights = "int4",
    accuracy_level: int = 4,
    opset: int = 17,
    check: bool = True,
    metadata: Mapping[str, str] | None = None,
    position_ids: bool = False,
    attention: Literal["auto", "fused", "decomposed"] = "auto",
    lm_head: Literal["auto", "int8", "float"] = "auto",
    logits: Literal["all", "last"] = "all",
) -> Path:
    """Write ``model`` (a transformers causal LM :func:`check_decoder` takes, float or fake-quant)
    as a single ONNX file with past/present key-value tensors. Returns the path.

    ``weights="int4"`` writes weight-only 4-bit layers as MatMulNBits (``accuracy_level`` is its
    attribute: 4, the default, lets ORT's CPU kernel quantize activations to int8 per block, as
    llama.cpp's Q4_0 dot products do and about 1.4x faster decode; 0 computes in float32, the
    fake-quant model's numbers); ``lm_head="int8"`` writes a float lm_head of such a file as an
    8-bit MatMulNBits (round to nearest, blocks of 32: llama.cpp's default Q8_0 for SmolLM2's tied
    embedding), which decodes about 3x faster than its float32 MatMul at a negligible perplexity cost
    (benchmarks/RESULTS.md ``ort_decode_sweep``), ``"float"`` keeps it float, ``"auto"`` (default) is
    int8 at accuracy_level 4 and float at 0 (whose file computes the model's own numbers); an lm_head
    the model quantized to 4 bits is written as it is;
    ``"fp32"`` writes all weights in float32; ``"w8a8"`` writes Linears with quantized inputs as
    integer ops (module docstring). The model itself is not modified. ``check`` runs the file once
    in ONNX Runtime against the traced PyTorch module (ExportError when they disagree). The file's
    ``metadata_props`` carry ``compress.precision`` (int4/int8/fp32), ``compress.kind`` (generation),
    the toolkit version and ``metadata``; it is written whole or not at all. ``position_ids`` adds
    that input after ``attention_mask`` (``[B, S]`` int64, what Optimum's ORTModelForCausalLM feeds;
    without it the graph derives positions from the mask). ``attention``: ``"fused"`` writes each
    layer's attention as ``com.microsoft`` RotaryEmbedding + GroupQueryAttention (export/llm/attention.py),
    ``"decomposed"`` as plain ONNX ops (masks, matmuls, softmax: any ONNX runtime, ORT before 1.32);
    ``"auto"`` (default) is fused where the installed onnxruntime's GroupQueryAttention has the inputs
    the fused form feeds and the fused block computes the model (:func:`fused_mismatch`), else
    decomposed. ``logits``: ``"all"`` (default) outputs ``[B, S, V]``, what
    perplexity and Optimum's forward read; ``"last"`` outputs the last position's ``[B, 1, V]``, what
    generation reads (ORT GenAI, :class:`export.llm.ort.OrtGenerator`), and skips the lm_head over the
    rest of the prompt, as llama.cpp does by default (benchmarks/RESULTS.md ``llm_llamacpp``).
    """
    if logits not in ("all", "last"):
        raise ExportError(f"export_llm_onnx: logits must be 'all' or 'last' (got {logits!r})")
    if weights not in ("int4", "fp32", "w8a8"):
        raise ExportError(f"export_llm_onnx: weights must be 'int4', 'fp32' or 'w8a8' (got {weights!r})")
    if attention not in ("auto", "fused", "decomposed"):
        raise ExportError(f"export_llm_onnx: attention must be 'auto', 'fused' or 'decomposed' (got {attention!r})")
    if attention != "decomposed" and not fused_attention_supported():
        if attention == "fused":
            import onnxruntime

            raise ExportError(f"export_llm_onnx(attention='fused'): onnxruntime {onnxruntime.__version__}'s "
                              "GroupQueryAttention lacks attention_bias/query_seqlens (needs 1.32); use 'decomposed'")
        log.info("onnxruntime's GroupQueryAttention lacks attention_bias/query_seqlens: attention written decomposed")
    form: Attention = "decomposed" if attention == "decomposed" or not fused_attention_supported() else "fused"
    check_decoder(model)
    if weights == "w8a8":
        from compress.export.llm.w8a8 import check_w8a8_exportable

        check_w8a8_exportable(model)
    else:
        acts = activation_quantizers(model)
        if acts:
            raise UnsupportedModelError(
                f"{acts[0]}: quantized activations (W8A8) are exported with weights='w8a8', not '{weights}'"
            )
    m: Any = copy.deepcopy(model).float().eval()
    float_reference = None
    if check and weights == "w8a8":  # the W8A8 check's yardstick: the same model with its quantizers off
        flt: Any = copy.deepcopy(model).float().eval()
        unpack_experts(flt)
        _float_linears(flt)
        remove_placement(flt)
        float_reference = KVDecoder(flt).eval()
    unpack_experts(m)  # packed MoE experts (grouped_mm) as per-expert Linears: MatMulNBits / integer ops each
    counts = _swap_linears(m, weights, accuracy_level)
    if form == "fused":  # the block must compute this model, shown on a probe before anything is packed
        why = fused_mismatch(m)
        if why is not None and attention == "fused":
            raise UnsupportedModelError(f"export_llm_onnx(attention='fused'): {why}; use 'decomposed'")
        if why is not None:
            log.info("attention written decomposed: %s", why)
            form = "decomposed"
    lay = fused_layout(m)
    if counts["int4"] and form == "fused" and lay is not None:
        # q/k/v and gate/up as one MatMulNBits each, as ORT GenAI's builder writes them; the decomposed
        # form runs the model's own attention, which calls q_proj, k_proj and v_proj by name
        pack_projections(getattr(getattr(m, lay.base), lay.layers), attn=lay.attn)
    if weights == "int4" and counts["int4"] == 0:
        raise UnsupportedModelError("export_llm_onnx(weights='int4'): the model has no weight-only 4-bit layers")
    if lm_head not in ("auto", "int8", "float"):
        raise ExportError(f"export_llm_onnx: lm_head must be 'auto', 'int8' or 'float' (got {lm_head!r})")
    head = getattr(m, "lm_head", None)
    head_int8 = lm_head == "int8" or (lm_head == "auto" and accuracy_level == 4)
    if weights == "int4" and head_int8 and type(head) is nn.Linear:
        # always accuracy_level 4: ORT's 8-bit kernel at level 0 took 277 ms for this head where level 4 took 3
        m.lm_head = int8_head(head, accuracy_level=4)
    if weights == "w8a8" and counts["w8a8"] == 0:
        raise UnsupportedModelError("export_llm_onnx(weights='w8a8'): the model has no Linears with quantized inputs")
    remove_placement(m)  # its quantizers now live in the swapped layers
    dec = KVDecoder(m, attention=form).eval()
    dec.explicit_positions = position_ids
    dec.last_logits = logits == "last"
    if float_reference is not None:
        float_reference.explicit_positions = position_ids
        float_reference.last_logits = dec.last_logits
    inputs, outputs = io_names(dec.n_layers, position_ids=position_ids)
    dyn: dict[str, dict[int, str]] = {"input_ids": {0: "batch", 1: "sequence"},
                                      "logits": {0: "batch"} if dec.last_logits else {0: "batch", 1: "sequence"},
                                      "attention_mask": {0: "batch", 1: "total_sequence"}}
    if position_ids:
        dyn["position_ids"] = {0: "batch", 1: "sequence"}
    for name in inputs[3 if position_ids else 2 :]:
        dyn[name] = {0: "batch", 2: "past_sequence"}
    for name in outputs[1:]:
        dyn[name] = {0: "batch", 2: "total_sequence"}
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad(), warnings.catch_warnings(), exporter_fixes(opset), \
            tempfile.TemporaryDirectory(dir=out.parent, prefix=".llm_onnx.") as tmp:
        # the TorchScript exporter: custom ops export through autograd.Function.symbolic (the dynamo
        # exporter needs an onnxscript translation per op)
        warnings.simplefilter("ignore")
        traced = Path(tmp) / out.name
        try:
            torch.onnx.export(
                dec, dec.dummy_inputs(1, 2, 3), str(traced), input_names=inputs, output_names=outputs,
                dynamic_axes=dyn, opset_version=opset, dynamo=False,
                custom_opsets={"com.microsoft": 1} if counts["int4"] or form == "fused" else None,
                # no folding: a tied lm_head stays one initializer shared with the embedding (folding writes a
                # transposed copy); ORT folds the weight transposes in memory when it loads the file
                do_constant_folding=False,
            )
        except (RuntimeError, AssertionError, TypeError, ValueError) as err:  # the exporter's own failures
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise ExportError(f"export_llm_onnx: torch.onnx could not trace {type(model).__name__} "
                              f"({form} attention): {first[:300]}") from err
        import onnx
        from compress.export.edge import set_metadata
        from compress.export.files import atomic_save

        proto = onnx.load(str(traced))
        if dec.last_logits:  # the exporter leaves the slice's length symbolic: it is one position
            proto.graph.output[0].type.tensor_type.shape.dim[1].dim_value = 1
        precision = {"int4": "int4" if counts["int4"] else "fp32", "w8a8": "int8", "fp32": "fp32"}[weights]
        set_metadata(proto, {"compress.precision": precision, "compress.kind": "generation",
                             "compress.model_type": str(m.config.model_type), "compress.attention": form,
                             "compress.logits": logits,
                             **(metadata or {})})
        atomic_save(proto, out)
    log.info("LLM ONNX (%s weights: %d W8A8, %d MatMulNBits, %d float Linears; %s attention) written to %s", weights,
             counts["w8a8"], counts["int4"], counts["float"], form, out)
    if check:
        check_in_ort(out, dec, float_check=weights != "w8a8", float_dec=float_reference)
    return out
