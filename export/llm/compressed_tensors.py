"""Hugging Face checkpoints in the compressed-tensors format (what vLLM and llm-compressor load).

``save_compressed_tensors(model, out_dir)`` writes a folder that ``transformers``'
``from_pretrained`` (and vLLM) read: ``config.json`` with the ``quantization_config`` llm-compressor
writes (``quant_method: compressed-tensors``, ``format: pack-quantized``, one config group per
distinct weight scheme, the unquantized Linears in ``ignore``) and ``model.safetensors`` where each
weight-only int4 Linear ``P`` is stored as

- ``P.weight_packed`` int32 ``[N, K/8]``: codes + 8 as unsigned nibbles, element ``i`` of a word at
  bits ``4i..4i+3``, packed by compressed-tensors' own ``pack_to_int32``;
- ``P.weight_scale`` ``[N, G]`` (group) or ``[N, 1]`` (channel), in the model's dtype;
- ``P.weight_zero_point`` int32 ``[ceil(N/8), G]`` (asymmetric only; packed along the output dim);
- ``P.weight_shape`` int64 ``[2]``.

compressed-tensors keeps int4 codes signed (-8..7) with signed zero points; ours for asymmetric
weights are uint4 (0..15) with zero points 0..15. Both dequantize as ``(q - zp) * scale``, and both
store ``q + 8`` resp. the unsigned code, so the packed bits are the same nibbles
(:class:`quantization.lowering.int4.Int4Weight`). 8-bit layers (int8 ``int-quantized``, fp8
``float-quantized``) store ``P.weight`` as codes and ``P.weight_scale``. fp4 layers (``nvfp4-pack-quantized``,
``mxfp4-pack-quantized``) store ``P.weight_packed`` uint8 ``[N, K/2]`` (two e2m1 nibbles a byte, the
first element low), ``P.weight_scale`` ``[N, K/16]`` float8 e4m3 (NVFP4, times the global scale) or
``[N, K/32]`` uint8 e8m0 exponents (MXFP4), NVFP4's ``P.weight_global_scale`` float32 ``[1]`` and, for
W4A4 NVFP4, the calibrated ``P.input_global_scale``. Everything else (embeddings, norms, lm_head, biases) is
written as it is in the model. Needs the ``llm`` extra (``pip install 'compress-toolkit[llm]'``) (the config is built and
validated with compressed-tensors' own pydantic models).
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

import torch
from compress.quantization.lowering.int4 import (
    Int4Weight,
    activation_quantizers,
    int4_weight,
    is_int4_weight_only,
)
from torch import nn

from compress.core.errors import ExportError, UnsupportedModelError
from compress.core.imports import install_hint
from compress.core.sparsity import masked_modules, nm_groups_ok

log = logging.getLogger(__name__)

INSTALL_HINT = install_hint("llm")


def require_compressed_tensors(what: str = "compressed-tensors export") -> None:
    """Raise an ExportError naming the extra to install when compressed-tensors is missing."""
    if importlib.util.find_spec("compressed_tensors") is None:
        raise ExportError(f"{what} needs the compressed-tensors package: {INSTALL_HINT}")


def pack_int32(codes: torch.Tensor, *, packed_dim: int = 1) -> torch.Tensor:
    """uint8 codes 0..15 packed 8 to an int32 along ``packed_dim``, by compressed-tensors' own packer
    (it takes signed int4 and adds 8 back: our codes are exactly its ``q + 8``)."""
    from compressed_tensors.compressors import pack_to_int32

    return pack_to_int32((codes.to(torch.int16) - 8).to(torch.int8), 4, packed_dim=0 if packed_dim == 0 else 1)


def _strategy(w: Int4Weight, k: int, where: str) -> dict[str, Any]:
    if w.g_idx is not None:
        raise UnsupportedModelError(f"{where}: act_order with a g_idx permutation is not written (static groups are)")
    if w.num_groups == 1:
        return {"strategy": "channel", "group_size": None}
    return {"strategy": "group", "group_size": w.group_size}


def _scheme_args(w: Int4Weight, k: int, where: str, observer: str) -> dict[str, Any]:
    return {
        "num_bits": 4,
        "type": "int",
        "symmetric": w.symmetric,
        "dynamic": False,
        "observer": observer,
        **_strategy(w, k, where),
    }


_TOKEN_INT8 = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True, "strategy": "token", "observer": None}


def _token_int8_inputs(name: str, mod: nn.Module) -> bool:
    """Whether ``mod`` quantizes its inputs, as W4A8/W8A8 checkpoints hold them (dynamic per-token
    symmetric int8); UnsupportedModelError for any other input quantizer, or a SmoothQuant factor."""
    iq: Any = getattr(mod, "input_quantizer", None)
    if iq is None or not iq.enabled:
        return False
    s = iq.spec
    if not (s.dynamic and s.granularity == "token" and s.symmetric and s.dtype == "int8" and s.bits == 8):
        raise UnsupportedModelError(f"{name}: only dynamic per-token symmetric int8 inputs are written (W4A8); "
                                    f"its inputs are {s.bits}-bit {s.dtype} per {s.granularity}"
                                    f"{' (static)' if not s.dynamic else ''}")
    _refuse_unfolded_factor(name, iq)
    return True


def _refuse_unfolded_factor(name: str, iq: Any) -> None:
    """UnsupportedModelError when SmoothQuant left a factor before ``iq`` (the format has no place for it)."""
    if iq.pre_quant_scale is not None:
        raise UnsupportedModelError(
            f"{name}: SmoothQuant left a per-channel factor before its input quantizer (no exact fold into "
            "the layer before it); compressed-tensors has no place for it: quantize with "
            "smoothquant_unfolded='skip'")


def compressed_state_dict(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]], list[str]]:
    """``(tensors, args_by_layer, unquantized_linears)`` of an int4 model: weight-only (W4A16), or
    with dynamic per-token int8 inputs (W4A8, llm-compressor's preset of that name)."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    tensors: dict[str, torch.Tensor] = {}
    args: dict[str, dict[str, Any]] = {}
    quant_prefixes: list[str] = []
    plain: list[str] = []
    ragged: list[str] = []
    for name, mod in model.named_modules():
        wq = getattr(mod, "weight_quantizer", None)
        if wq is None:
            if isinstance(mod, nn.Linear):
                plain.append(name)
            continue
        w4a8 = _token_int8_inputs(name, mod)
        if wq.spec.bits != 4 or wq.spec.is_float or not (w4a8 or is_int4_weight_only(mod)):
            raise UnsupportedModelError(
                f"{name}: only 4-bit integer layers are written as pack-quantized (it is {wq.spec.bits}-bit "
                f"{wq.spec.dtype})")
        w = int4_weight(mod, where=name)
        n, k = w.shape
        if w.num_groups > 1 and k % w.group_size and w4a8:
            raise UnsupportedModelError(f"{name}: {k} input features are not a multiple of group_size {w.group_size}; "
                                        "a W4A8 layer has no float form to leave it in")
        if w.num_groups > 1 and k % w.group_size:
            # compressed-tensors quantizes whole groups only (its forward raises on a shorter last one);
            # llm-compressor's escape is to leave such a layer out: it goes into ``ignore`` with our
            # fake-quant values as its float weight, so the loaded model computes what ours does
            log.warning("%s: %d input features are not a multiple of group_size %d: written in float (listed in "
                        "ignore), as llm-compressor leaves such layers", name, k, w.group_size)
            ragged.append(name)
            tensors[f"{name}.weight"] = mod.quantized_weight().detach().to(dtype).contiguous()
            continue
        weight_args = _scheme_args(w, k, name, wq.spec.observer)
        args[name] = {"weights": weight_args, "input_activations": dict(_TOKEN_INT8)} if w4a8 else weight_args
        tensors[f"{name}.weight_packed"] = pack_int32(w.codes)
        tensors[f"{name}.weight_scale"] = w.scale.to(dtype).contiguous()
        tensors[f"{name}.weight_shape"] = torch.tensor([n, k], dtype=torch.int64)
        if not w.symmetric:
            tensors[f"{name}.weight_zero_point"] = pack_int32(w.zero_point, packed_dim=0)
        quant_prefixes.append(name + ".")
    if not args and not ragged and masked_modules(model):  # pruned, not quantized: dense weights with their zeros
        return _other_tensors(model, set()), {}, plain
    if not args:
        raise UnsupportedModelError("compressed-tensors export: the model has no quantized layers whole groups can "
                                    f"hold; quantize it first{' (or choose a group size dividing ' + ragged[0] + ')' if ragged else ''}")
    others = [n for n in activation_quantizers(model) if not any(n.startswith(p) for p in quant_prefixes)]
    if others:
        raise UnsupportedModelError(f"{others[0]}: quantized activations outside the W4A8 Linears are not written")
    tensors.update(_other_tensors(model, {*quant_prefixes, *(r + "." for r in ragged)}))
    return tensors, args, plain + ragged


def _other_tensors(model: nn.Module, written: set[str]) -> dict[str, torch.Tensor]:
    """The model's state beside the layers written above (prefixes ``written``, with a dot): no
    quantizer state, tied weights (lm_head = embed_tokens) stored once, retied on load."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, t in model.state_dict().items():
        prefix = key.rsplit(".", 1)[0] + "."
        if "_quantizer." in key or (key.endswith(".weight") and prefix in written):
            continue
        ptr = t.data_ptr()
        if ptr in seen and t.numel() > 0:
            continue
        seen.add(ptr)
        out[key] = t.detach().contiguous().clone()
    return out


def _embeddings(model: nn.Module) -> tuple[Any, Any]:
    """A transformers model's (input embedding, output head) modules (None where it has none)."""
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    return (get_in() if callable(get_in) else None), (get_out() if callable(get_out) else None)


def _quantized_head_tied(model: nn.Module, args: dict[str, dict[str, Any]]) -> bool:
    """Whether the output head is written quantized while it shares its weight with the input
    embedding (a tied model whose head a weight-only pass quantized)."""
    emb, head = _embeddings(model)
    if head is None or emb is None or getattr(head, "weight", None) is not getattr(emb, "weight", None):
        return False
    return any(model.get_submodule(n) is head for n in args)


def eight_bit_state_dict(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]], list[str]]:
    """``(tensors, args_by_layer, unquantized_linears)`` of an 8-bit model: fp8 (FP8_DYNAMIC, or fp8
    weights alone) or int8 (llm-compressor's ``W8A8``: symmetric int8 weights, dynamic per-token int8
    inputs, or int8 weights alone). Each layer ``P`` as ``P.weight`` codes (float8_e4m3fn or int8) and
    ``P.weight_scale`` (``[N, 1]`` per channel, ``[1]`` per tensor, float32); the inputs' per-token
    dynamic scheme in its args."""
    tensors: dict[str, torch.Tensor] = {}
    args: dict[str, dict[str, Any]] = {}
    plain: list[str] = []
    done: set[str] = set()
    family = "float" if _is_fp8_model(model) else "int"
    for name, mod in model.named_modules():
        wq = getattr(mod, "weight_quantizer", None)
        if wq is None:
            if isinstance(mod, nn.Linear):
                plain.append(name)
            continue
        s = wq.spec
        kind = "float" if s.is_float else "int"
        if (kind != family or s.bits != 8 or s.granularity not in ("channel", "tensor")
                or (kind == "int" and (not s.symmetric or s.dtype != "int8"))):
            raise UnsupportedModelError(
                f"{name}: an 8-bit {family} checkpoint holds symmetric 8-bit {family} layers per channel or tensor only "
                f"(it is {s.bits}-bit {s.dtype} {'sym' if s.symmetric else 'asym'} per {s.granularity})")
        iq = getattr(mod, "input_quantizer", None)
        a: dict[str, Any] = {"weights": {"num_bits": 8, "type": kind, "symmetric": True, "dynamic": False,
                                         "strategy": s.granularity, "observer": s.observer}}
        if iq is not None and iq.enabled:
            scheme = "FP8_DYNAMIC" if kind == "float" else "W8A8"
            if not (iq.spec.is_float == (kind == "float") and iq.spec.dynamic and iq.spec.granularity == "token"
                    and iq.spec.symmetric and iq.spec.bits == 8):
                raise UnsupportedModelError(f"{name}: only dynamic per-token symmetric 8-bit {kind} inputs are "
                                            f"written ({scheme}); its inputs are {iq.spec.dtype} per {iq.spec.granularity}")
            _refuse_unfolded_factor(name, iq)
            a["input_activations"] = {"num_bits": 8, "type": kind, "symmetric": True, "dynamic": True,
                                      "strategy": "token", "observer": None}
        with torch.no_grad():
            codes = wq.int_repr(mod.weight.detach().float())
            scale = wq.scale.detach().float()
        n = codes.shape[0]
        tensors[f"{name}.weight"] = (codes if kind == "float" else codes.round().to(torch.int8)).contiguous()
        tensors[f"{name}.weight_scale"] = (scale.reshape(n, 1) if scale.numel() == n else scale.reshape(1)).clone()
        args[name] = a
        done.add(name + ".")
    if not args:
        raise UnsupportedModelError("compressed-tensors export: the model has no 8-bit layers")
    others = [n for n in activation_quantizers(model) if not any(n.startswith(p) for p in done)]
    if others:
        raise UnsupportedModelError(f"{others[0]}: a static activation quantizer is not written (compressed-tensors "
                                    "8-bit checkpoints hold dynamic per-token inputs: W8A8, FP8_DYNAMIC)")
    tensors.update(_other_tensors(model, done))
    return tensors, args, plain


def _is_fp8_model(model: nn.Module) -> bool:
    return any(getattr(getattr(m, "weight_quantizer", None), "spec", None) is not None
               and m.weight_quantizer.spec.is_fp8 for m in model.modules())  # type: ignore[union-attr]


def _fp4_formats(model: nn.Module) -> set[str]:
    """The ecosystem names of the fp4 weight grids in ``model`` (NVFP4, MXFP4)."""
    names = {"fp8_e4m3": "NVFP4", "e8m0": "MXFP4", "float32": "fp4 with float32 scales"}
    specs: list[Any] = [getattr(getattr(m, "weight_quantizer", None), "spec", None) for m in model.modules()]
    return {names[sp.scale_dtype] for sp in specs if sp is not None and sp.is_fp4}


def fp4_state_dict(model: nn.Module, kind: str) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]], list[str]]:
    """``(tensors, args_by_layer, unquantized_linears)`` of an fp4 model (``kind`` NVFP4 or MXFP4):
    weight-only (NVFP4A16, MXFP4A16) or W4A4 (fp4 inputs scaled per group at run time; NVFP4's with
    their calibrated global scale). The args are compressed-tensors' own presets of that name."""
    from compress.quantization.lowering.fp4 import fp4_weight, pack_pairs
    from compressed_tensors.quantization import preset_name_to_scheme

    tensors: dict[str, torch.Tensor] = {}
    args: dict[str, dict[str, Any]] = {}
    plain: list[str] = []
    done: set[str] = set()
    for name, mod in model.named_modules():
        wq = getattr(mod, "weight_quantizer", None)
        if wq is None:
            if isinstance(mod, nn.Linear):
                plain.append(name)
            continue
        s = wq.spec
        gs = 16 if kind == "NVFP4" else 32
        if not (s.is_fp4 and s.group_size == gs and {"NVFP4": "fp8_e4m3", "MXFP4": "e8m0"}[kind] == s.scale_dtype):
            raise UnsupportedModelError(f"{name}: a {kind} checkpoint holds {kind} layers only (it is {s.bits}-bit "
                                        f"{s.dtype} per {s.granularity}{', ' + s.scale_dtype + ' scales' if s.is_fp4 else ''})")
        iq: Any = getattr(mod, "input_quantizer", None)
        w4a4 = iq is not None and iq.enabled
        if w4a4 and not (iq.spec.is_fp4 and iq.spec.scale_dtype == s.scale_dtype and iq.spec.group_size == gs):
            raise UnsupportedModelError(f"{name}: {kind} checkpoints hold {kind} inputs or none; its inputs are "
                                        f"{iq.spec.dtype} per {iq.spec.granularity}")
        if w4a4:
            _refuse_unfolded_factor(name, iq)
        k = mod.weight.shape[1]
        if k % gs and w4a4:
            raise UnsupportedModelError(f"{name}: {k} input features are not a multiple of {kind}'s group of {gs}; "
                                        "leave the layer out (ignore)")
        if k % gs:  # as the int4 writer (and llm-compressor): in float, with our fake-quant values, in ignore
            log.warning("%s: %d input features are not a multiple of %s's group of %d: written in float (listed in "
                        "ignore)", name, k, kind, gs)
            tensors[f"{name}.weight"] = mod.quantized_weight().detach().contiguous()
            plain.append(name)
            done.add(name + ".")
            continue
        preset = preset_name_to_scheme(kind if w4a4 else f"{kind}A16", ["Linear"])
        a: dict[str, Any] = {"weights": preset.weights.model_dump()}
        if w4a4:
            assert preset.input_activations is not None
            a["input_activations"] = preset.input_activations.model_dump()
        f4 = fp4_weight(mod, where=name)
        tensors[f"{name}.weight_packed"] = pack_pairs(f4.nibbles)
        if f4.e4m3_scale is not None and f4.global_scale is not None:
            tensors[f"{name}.weight_scale"] = f4.e4m3_scale.contiguous()
            tensors[f"{name}.weight_global_scale"] = f4.global_scale
            if w4a4:
                tensors[f"{name}.input_global_scale"] = iq.global_scale.detach().float().reshape(1).clone()
        else:
            assert f4.e8m0 is not None
            tensors[f"{name}.weight_scale"] = f4.e8m0.contiguous()
        args[name] = a
        done.add(name + ".")
    if not args:
        raise UnsupportedModelError(f"compressed-tensors export: the model has no {kind} layers whole groups can hold")
    others = [n for n in activation_quantizers(model) if not any(n.startswith(p) for p in done)]
    if others:
        raise UnsupportedModelError(f"{others[0]}: an activation quantizer outside the {kind} Linears is not written")
    tensors.update(_other_tensors(model, done))
    return tensors, args, plain


def _is_8bit_model(model: nn.Module) -> bool:
    """fp8 layers, or int8 ones (any 8-bit integer weight: the int4 writer refuses the rest by name)."""
    specs: list[Any] = [getattr(getattr(m, "weight_quantizer", None), "spec", None) for m in model.modules()]
    specs = [sp for sp in specs if sp is not None]
    return any(sp.is_float or sp.bits == 8 for sp in specs)


def quantization_config(args: dict[str, dict[str, Any]], ignore: list[str], *, fmt: str = "pack-quantized") -> dict[str, Any]:
    """The config.json ``quantization_config`` llm-compressor writes, validated by compressed-tensors.
    ``args`` per layer: weight-args (int4), or ``{"weights": ..., "input_activations": ...}`` (fp8)."""
    require_compressed_tensors()
    import compressed_tensors
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    groups: dict[str, list[str]] = {}
    key_args: dict[str, dict[str, Any]] = {}
    for name, a in args.items():
        key = json.dumps(a, sort_keys=True)
        groups.setdefault(key, []).append(name)
        key_args[key] = a
    config_groups: dict[str, Any] = {}
    for i, (key, names) in enumerate(groups.items()):
        targets = ["Linear"] if len(groups) == 1 else sorted(names)
        a = key_args[key]
        parts = a if "weights" in a else {"weights": a}
        config_groups[f"group_{i}"] = QuantizationScheme(
            targets=targets, format=fmt, **{k: QuantizationArgs(**v) for k, v in parts.items()}
        )
    qc = QuantizationConfig(
        config_groups=config_groups, format=fmt, quantization_status="compressed", ignore=sorted(ignore),
    )
    data = qc.model_dump(exclude={"quant_method"})
    return {
        "version": compressed_tensors.__version__,
        "quant_method": "compressed-tensors",
        "sparsity_config": {},
        "transform_config": {},
        **json.loads(json.dumps(data, default=str)),
    }


def sparsity_config(model: nn.Module) -> dict[str, Any]:
    """The config.json ``sparsity_config`` of a model pruned inside its Linears (SparseGPT, Wanda:
    the modules holding a mask), validated by compressed-tensors; empty when none is. Its format is
    ``dense``: the weights are written with their zeros (compressed-tensors 0.20 has no compressor
    left for its ``sparse-24-bitmask`` form), and the structure says ``2:4`` when every pruned Linear
    keeps at most 2 of every 4 consecutive inputs."""
    masked = masked_modules(model)
    if not masked:
        return {}
    from compressed_tensors.config import SparsityCompressionConfig

    weights = [m.get_parameter("weight").detach() for m in masked.values()]
    two_four = all(nm_groups_ok(w, 2, 4) for w in weights)
    zeros = sum(int((w == 0).sum()) for w in weights)
    total = sum(w.numel() for w in weights)
    cfg = SparsityCompressionConfig.load_from_registry(
        "dense", targets=sorted(masked), ignore=[], global_sparsity=round(zeros / max(total, 1), 4),
        sparsity_structure="2:4" if two_four else "unstructured")
    return json.loads(json.dumps(cfg.model_dump(exclude={"registry_requires_subclass"}), default=str))


def checkpoint_format(folder: Path) -> str:
    """The ``format`` a checkpoint folder's config names (``pack-quantized``, ``nvfp4-pack-quantized``,
    ...; ``dense`` for a sparse float model)."""
    qc = json.loads((Path(folder) / "config.json").read_text()).get("quantization_config", {})
    return str(qc.get("format") or qc.get("sparsity_config", {}).get("format") or "dense")


def check_compressed_tensors(model: nn.Module) -> Any:
    """The model's config if :func:`save_compressed_tensors` can write its structure, else
    UnsupportedModelError saying why (no transformers config; MoE experts, whose checkpoint names are
    per model): from the config and module tree alone, so it runs on a meta-device model, and it is
    the writer's own first check of the model."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise UnsupportedModelError("compressed-tensors export needs a transformers model (one with a .config)")
    from compress.core.moe import expert_blocks

    moe = next(iter(expert_blocks(model)), None)
    if moe is not None:  # transformers reads per-model expert names (w1/w3, gate_proj/up_proj) through its own conversions
        raise UnsupportedModelError(f"{moe}: MoE experts were unpacked into per-expert Linears for quantization; "
                                    "the compressed-tensors writer does not write transformers' expert checkpoint names")
    return config


def save_compressed_tensors(model: nn.Module, out_dir: str | Path, *, tokenizer: Any = None) -> Path:
    """Write ``model`` (a transformers model quantized weight-only int4, int8, fp8, NVFP4 or MXFP4) as a compressed-tensors checkpoint.

    Layers must be weight-only 4-bit QuantLinears (GPTQ, AWQ, RTN ``w4_weight_only_g128``, per
    group or per channel; ``pack-quantized``), int8 ones (llm-compressor's ``W8A8``: symmetric
    per-channel int8 weights, dynamic per-token int8 inputs, or the weights alone; ``int-quantized``)
    or fp8 ones (``FP8_DYNAMIC``, or fp8 weights alone; ``float-quantized``, what vLLM serves on
    Hopper), or fp4 ones (``NVFP4A16``/``NVFP4``, ``MXFP4A16``/``MXFP4``: :func:`fp4_state_dict`); a SmoothQuant factor left before a layer is refused (the format has no place for it); other Linears are stored in float and listed in ``ignore``, and so are
    layers whose width is not a multiple of their group size (compressed-tensors has no shorter
    last group; llm-compressor ignores such layers), written with their fake-quant values. The
    model's ``generation_config.json`` and, given a transformers ``tokenizer``, its files go beside.
    A model pruned inside its Linears (SparseGPT, Wanda; quantized or not) gets a ``sparsity_config``
    (:func:`sparsity_config`: dense weights with their zeros, ``2:4`` or ``unstructured``).
    Returns the folder, loadable with ``AutoModelForCausalLM.from_pretrained`` (compressed-tensors
    installed).
    """
    require_compressed_tensors()
    from safetensors.torch import save_file

    config = check_compressed_tensors(model)
    fp4 = _fp4_formats(model)
    if len(fp4) > 1 or fp4 == {"fp4 with float32 scales"}:
        raise UnsupportedModelError(f"compressed-tensors export: fp4 layers of {' and '.join(sorted(fp4))}; a checkpoint "
                                    "holds one fp4 format, NVFP4 (e4m3 scales, groups of 16) or MXFP4 (e8m0, groups of 32)")
    fp8 = _is_fp8_model(model)
    eight = not fp4 and _is_8bit_model(model)
    if fp4:
        kind = next(iter(fp4))
        tensors, args, plain = fp4_state_dict(model, kind)
        fmt = f"{kind.lower()}-pack-quantized"
    else:
        tensors, args, plain = eight_bit_state_dict(model) if eight else compressed_state_dict(model)
        fmt = "float-quantized" if fp8 else "int-quantized" if eight else "pack-quantized"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = config.to_dict()
    sparse = sparsity_config(model)
    if args:
        cfg["quantization_config"] = {**quantization_config(args, plain, fmt=fmt), "sparsity_config": sparse}
    else:  # sparsity alone: the config llm-compressor writes for a pruned float model
        import compressed_tensors

        cfg["quantization_config"] = {"version": compressed_tensors.__version__, "quant_method": "compressed-tensors",
                                      "sparsity_config": sparse, "transform_config": {}}
    if cfg.get("tie_word_embeddings") and _quantized_head_tied(model, args):
        # the head's codes cannot be the float embedding table (which _other_tensors writes as it is):
        # the checkpoint holds both, untied, as llm-compressor unties a quantized head
        cfg["tie_word_embeddings"] = False
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str))
    save_file({k: v.cpu() for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    gen = getattr(model, "generation_config", None)
    if gen is not None and hasattr(gen, "save_pretrained"):
        gen.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    log.info("compressed-tensors checkpoint: %d %s layers, %d float Linears%s, written to %s", len(args),
             next(iter(fp4)) if fp4 else "fp8" if fp8 else "int8" if eight else "int4", len(plain),
             f", {len(sparse['targets'])} sparse ({sparse['sparsity_structure']})" if sparse else "", out)
    return out
