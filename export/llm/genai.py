"""Files beside an :func:`export.llm.onnx.export_llm_onnx` graph so that the LLM runtimes load its folder
as it is.

- ONNX Runtime GenAI (``onnxruntime_genai.Model(dir)``): ``genai_config.json`` in its documented
  decoder schema — the graph's input/output names (``past_key_values.%d.key`` ... ``present.%d.value``),
  the head layout, the special tokens and greedy search defaults. The model type is GenAI's generic
  ``"decoder"``: the graph computes the whole family itself (positions from the mask, its own norms,
  rotary and scalings), so GenAI needs no family of its own for it (olmo2, stablelm and cohere are
  not in GenAI 0.18's type list and load this way). ``past_present_share_buffer`` is true
  for fused attention (GroupQueryAttention appends to the past in place, the cache is not copied each
  step) and false for the decomposed graph, which concatenates; ``position_ids`` is declared when the graph
  takes it (``export_llm_onnx(position_ids=True)``), else positions come from ``attention_mask``.
- The tokenizer files (``tokenizer.json``, ``tokenizer_config.json``) and ``config.json`` /
  ``generation_config.json`` of the model, which GenAI's tokenizer and transformers-style clients read.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import onnx

from compress.core.errors import ExportError
from compress.core.imports import install_hint

log = logging.getLogger(__name__)


def _token_id(value: Any) -> int | list[int] | None:
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value] if len(value) > 1 else (int(value[0]) if value else None)
    return None if value is None else int(value)


def genai_config(onnx_path: str | Path, config: Any, *, max_length: int | None = None) -> dict[str, Any]:
    """The ``genai_config.json`` content for the export at ``onnx_path`` of a model with transformers
    ``config``. ExportError when the file is not an export_llm_onnx graph."""
    path = Path(onnx_path)
    proto = onnx.load(str(path), load_external_data=False)
    graph = proto.graph
    # GroupQueryAttention appends to a past bound as its own present in place; the decomposed graph
    # concatenates a new present
    shared = {p.key: p.value for p in proto.metadata_props}.get("compress.attention") == "fused"
    inputs = [i.name for i in graph.input]
    outputs = [o.name for o in graph.output]
    layers = int(config.num_hidden_layers)
    if inputs[:2] != ["input_ids", "attention_mask"] or f"past_key_values.{layers - 1}.value" not in inputs \
            or f"present.{layers - 1}.value" not in outputs:
        raise ExportError(f"{path}: not an export_llm_onnx graph of a {layers}-layer model (inputs {inputs[:3]}...)")
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    context: int = max_length or int(getattr(config, "max_position_embeddings", None) or 2048)
    eos = _token_id(getattr(config, "eos_token_id", None))
    pad = _token_id(getattr(config, "pad_token_id", None))
    first_eos = eos[0] if isinstance(eos, list) else eos
    return {
        "model": {
            "bos_token_id": _token_id(getattr(config, "bos_token_id", None)),
            "context_length": context,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": path.name,
                "head_size": head_dim,
                "hidden_size": int(config.hidden_size),
                "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                           **({"position_ids": "position_ids"} if "position_ids" in inputs else {}),
                           "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"},
                "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                            "present_value_names": "present.%d.value"},
                "num_attention_heads": heads,
                "num_hidden_layers": layers,
                "num_key_value_heads": int(getattr(config, "num_key_value_heads", None) or heads),
            },
            "eos_token_id": eos,
            "pad_token_id": pad if pad is not None else first_eos,
            "type": "decoder",
            "vocab_size": int(config.vocab_size),
        },
        "search": {
            "diversity_penalty": 0.0, "do_sample": False, "early_stopping": True, "length_penalty": 1.0,
            "max_length": context, "min_length": 0, "no_repeat_ngram_size": 0, "num_beams": 1,
            "num_return_sequences": 1, "past_present_share_buffer": shared, "repetition_penalty": 1.0,
            "temperature": 1.0, "top_k": 1, "top_p": 1.0,
        },
    }


def write_runtime_files(onnx_path: str | Path, model: Any, *, tokenizer: Any = None,
                        max_length: int | None = None) -> list[Path]:
    """Write ``genai_config.json``, ``config.json``, ``generation_config.json`` (when the model has one)
    and, given a transformers ``tokenizer``, its files beside ``onnx_path``. Returns the paths written.

    The folder then loads in ONNX Runtime GenAI as it is (``og.Model(folder)``, ``og.Tokenizer``)."""
    path = Path(onnx_path)
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise ExportError("write_runtime_files: needs a transformers model (one with a .config)")
    out = path.parent
    written = [out / "genai_config.json"]
    written[0].write_text(json.dumps(genai_config(path, config, max_length=max_length), indent=2))
    cfg = config.to_dict()
    cfg.pop("quantization_config", None)  # the ONNX graph carries the quantization itself
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str))
    written.append(out / "config.json")
    gen = getattr(model, "generation_config", None)
    if gen is not None and hasattr(gen, "save_pretrained"):
        gen.save_pretrained(out)
        written.append(out / "generation_config.json")
    if tokenizer is not None:
        written.extend(Path(p) for p in tokenizer.save_pretrained(out))
    log.info("runtime files beside %s: %s", path.name, ", ".join(p.name for p in written))
    return written


def genai_greedy(folder: str | Path, prompt: Any, *, max_length: int) -> list[int]:
    """Greedy token ids (prompt included) that ONNX Runtime GenAI generates from ``folder`` (what
    :func:`write_runtime_files` wrote) for one ``prompt`` (``[1, T]`` token ids), up to
    ``max_length`` tokens or its EOS. Needs ``onnxruntime-genai`` (the ``llm`` extra)."""
    import numpy as np

    try:
        import onnxruntime_genai as og
    except ImportError:
        raise ExportError(f"ONNX Runtime GenAI is not installed; {install_hint('llm')}") from None
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=max_length, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(np.asarray(prompt, dtype=np.int32))
    while not gen.is_done():
        gen.generate_next_token()
    return [int(t) for t in gen.get_sequence(0)]
