"""Mixture-of-experts LLMs: transformers' packed experts (3D Parameters) unpacked into per-expert
Linears (compress/moe.py), exact in float, then quantized like any Linear: W8A8 with the
router kept float, exported and run in ONNX Runtime; GPTQ and AWQ int4."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from compress.export.validation.runtimes import ort_coverage
from compress.quantization.placement.fidelity_guards import ROUTER_REASON
from torch import nn

import compress
from compress.core.errors import UnsupportedModelError
from compress.core.moe import UnpackedExperts, expert_blocks, set_dense, unpack_experts

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256)
#: families outside the quantization suite, picked for their expert layouts: concatenated gate/up
#: (Mixtral, Qwen3-MoE), a shared expert beside the routed ones (Qwen2-MoE), transposed weights
#: with biases and an interleaved, clamped GLU (GPT-OSS), grouped top-k routing (DeepSeek-V3)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, head_dim=16)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(num_experts=4, num_experts_per_tok=2,
                                                               moe_intermediate_size=64, shared_expert_intermediate_size=64)),
    "gpt_oss": ("GptOssForCausalLM", "GptOssConfig", dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                                                         layer_types=["full_attention", "sliding_attention"])),
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(
        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
        first_k_dense_replace=1, n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16)),
}


def _build(family: str, seed: int = 0) -> nn.Module:
    cls, cfg, kw = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, cfg)(**{**BASE, **kw})
    config.use_cache = False
    model = getattr(transformers, cls)(config).eval()
    assert all(torch.isfinite(p).all() for p in model.parameters())  # post_init filled the packed experts
    return model  # type: ignore[no-any-return]


def _batches(n: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, 256, (4, 16), generator=g)} for _ in range(n)]


def _logits(m: nn.Module, x: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return m(**x).logits  # type: ignore[no-any-return]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_unpacked_experts_compute_the_packed_model(family: str) -> None:
    model = _build(family)
    x = _batches(1)[0]
    ref = _logits(model, x)
    names = unpack_experts(model)
    assert len(names) >= 1 and all(isinstance(model.get_submodule(n), UnpackedExperts) for n in names)
    assert not any(p.dim() == 3 for p in model.parameters())  # every expert weight is now a Linear's
    assert all(p.requires_grad for p in model.parameters())  # trainable as the packed ones were (QAT, fine-tuning)
    dense = _logits(model, x)
    set_dense(model, False)
    routed = _logits(model, x)
    assert (dense - ref).abs().max() < 1e-5
    assert (routed - ref).abs().max() < 1e-5
    # each expert's Linears hold its slice of the packed Parameters: zeroing one expert changes the output
    block = next(iter(expert_blocks(model).values()))
    with torch.no_grad():
        getattr(block, "0").down_proj.weight.zero_()
    assert (_logits(model, x) - ref).abs().max() > 1e-4


@pytest.mark.slow  # 36 s in a full run: an MoE LLM quantized, exported, run in ORT
def test_w8a8_quantizes_every_expert_keeps_the_router_float_and_runs_in_onnxruntime(tmp_path: Path) -> None:
    import onnxruntime as ort

    model = _build("mixtral")
    fp = copy.deepcopy(model)
    data = _batches(4)
    # 7-bit weight codes: ORT's u8s8 kernels are then exact on CPUs without VNNI (README)
    q = compress.quantize(model, {"preset": "w8a8", "weights": {"reduce_range": True}}, data)
    quant = {n for n, m in q.named_modules() if type(m).__name__ == "QuantLinear"}
    experts = {n for n in quant if ".experts." in n}
    assert len(experts) == 2 * 4 * 2  # layers x experts x (gate_up, down)
    floats = q.quantizer_graph.placement.floats
    routers = {k for k, v in floats.items() if v == ROUTER_REASON}
    assert routers == {f"model.layers.{i}.mlp.gate:linear#0" for i in range(2)}, floats
    x = data[1]
    ref, fq = _logits(fp, x), _logits(q, x)
    sqnr = float(10 * torch.log10(ref.pow(2).mean() / (ref - fq).pow(2).mean()))
    assert sqnr > 20, sqnr
    path = compress.export_onnx(q, data[0]["input_ids"][:2], tmp_path / "moe.onnx")
    s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    out = torch.from_numpy(s.run(None, {s.get_inputs()[0].name: x["input_ids"].numpy()})[0])
    parity = float(10 * torch.log10(fq.pow(2).mean() / (fq - out).pow(2).mean()))
    # the file computes the fake-quant model; rounding ties and requantized fused outputs are the gap
    # that remains (the real-model suite's floor, tests/quantization/test_real_models.py)
    assert parity > 25, parity
    cov = ort_coverage(path)
    # what runs in float is the two routers' MatMuls and RMSNorm's var + eps adds, nothing of the experts
    assert cov.integer >= 2 * (4 + 4 * 2), cov.integer_ops
    assert len([f for f in cov.float_nodes if "MatMul" in f or "Gemm" in f]) <= 2, cov.float_nodes


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_int4_weight_only_on_experts_beats_round_to_nearest(method: str) -> None:
    fp = _build("qwen3_moe")
    data = _batches(4)
    x = _batches(1, seed=9)[0]
    ref = _logits(fp, x)

    def mse(m: nn.Module) -> float:
        return float((_logits(m, x) - ref).pow(2).mean())

    rtn = compress.quantize(copy.deepcopy(fp), "w4_weight_only_g128")
    q = getattr(compress, method)(copy.deepcopy(fp), data, scheme="w4_weight_only_g128")
    assert sum(".experts." in n for n, m in q.named_modules() if type(m).__name__ == "QuantLinear") == 2 * 4 * 2
    assert mse(q) < mse(rtn), (mse(q), mse(rtn))


def test_compressed_tensors_refuses_unpacked_experts_with_a_reason(tmp_path: Path) -> None:
    pytest.importorskip("compressed_tensors")
    q = compress.quantize(_build("mixtral"), "w4_weight_only_g128")
    with pytest.raises(UnsupportedModelError, match="MoE experts"):
        compress.save_compressed_tensors(q, tmp_path / "ct")
    assert not (tmp_path / "ct").exists()


def test_prune_cuts_expert_channels_and_the_plan_replays_on_a_fresh_model(tmp_path: Path) -> None:
    from compress.pruning.api import Pruner
    from compress.pruning.plan import PruningPlan

    model = _build("mixtral")
    fresh = copy.deepcopy(model)
    with pytest.raises(UnsupportedModelError, match="unpack_experts"):  # a training loop's own tracing
        Pruner().trace(copy.deepcopy(model), _batches(1)[0])
    x = _batches(1)[0]
    result = compress.prune(model, x, ratio=0.3)
    expert = model.get_submodule("model.layers.0.mlp.experts.0")
    assert expert.down_proj.in_features < 128 and expert.gate_up_proj.out_features == 2 * expert.down_proj.in_features
    assert torch.isfinite(_logits(model, x)).all()
    result.plan.save(tmp_path / "plan.json")
    PruningPlan.load(tmp_path / "plan.json").apply(fresh)
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(_logits(fresh, x), _logits(model, x))


@pytest.mark.slow  # 34 s in a full run: a GPTQ recipe on an MoE checkpoint
def test_gptq_recipe_on_a_saved_moe_checkpoint_restores_from_its_state(tmp_path: Path) -> None:
    """``compress apply`` on a Mixtral directory (the shipped GPTQ recipe; the single-pass ONNX file,
    validated in ORT by perplexity), then the run's state restored onto a freshly loaded, still
    packed model: the same logits as the run's model."""
    import yaml

    from compress.data.lm import iter_texts, split_files, train_tokenizer
    from compress.models import load_model
    from compress.state import restore_compressed

    tok = train_tokenizer(iter_texts(split_files(0)["train"][:2]), vocab_size=256)
    hf = tmp_path / "mixtral"
    torch.manual_seed(0)
    config = transformers.MixtralConfig(**{**BASE, "vocab_size": len(tok)}, num_local_experts=4, num_experts_per_tok=2,
                                        max_position_embeddings=64)
    transformers.MixtralForCausalLM(config).save_pretrained(hf)
    tok.save_pretrained(hf)
    raw = yaml.safe_load((Path(__file__).parents[2] / "recipes" / "llm_gptq_w4.yaml").read_text())
    raw["model"]["hf_path"] = str(hf)
    raw["data"]["kwargs"] = {"tokenizer": str(hf), "seq_len": 32, "samples": 8}
    raw["data"].update(calibration_samples=8, eval_samples=8, calibration_batch_size=4, eval_batch_size=4)
    raw["export"] = {"generation": False}  # the plain ONNX file, validated by the run's perplexity
    raw["validate"] = {"runtimes": ["onnxruntime"], "warmup": 1, "runs": 2}
    out = tmp_path / "run"
    report = compress.apply(compress.load_recipe(raw), out_dir=out, quiet=True)
    assert report.final.accuracy is not None and report.exports and report.validation  # accuracy: the perplexity
    ort_ppl = [v.accuracy for v in report.validation if v.runtime == "onnxruntime" and v.role == "final"]
    assert ort_ppl and ort_ppl[0] == pytest.approx(report.final.accuracy, rel=0.05), (ort_ppl, report.final.accuracy)
    restored = restore_compressed(lambda: load_model({"hf_path": str(hf)}), out / "checkpoints" / "final.pt")
    assert sum(".experts." in n for n, m in restored.named_modules() if type(m).__name__ == "QuantLinear") == 16
    x = {"input_ids": torch.randint(0, len(tok), (2, 16))}
    run_model = restore_compressed(lambda: load_model({"hf_path": str(hf)}), out / "checkpoints" / "final.pt")
    assert torch.equal(_logits(restored, x), _logits(run_model, x))


@pytest.mark.parametrize(("family", "weights"), [("mixtral", "int4"), ("qwen2_moe", "int4"), ("mixtral", "w8a8")])
def test_generation_export_of_moe_generates_the_pytorch_tokens(family: str, weights: str, tmp_path: Path) -> None:
    fp = _build(family)
    data = _batches(4)
    if weights == "int4":
        q = compress.gptq(copy.deepcopy(fp), data, scheme="w4_weight_only_g128", ignore=["lm_head"])
    else:  # the layers-only W8A8 the generation export takes (README)
        q = compress.quantize(copy.deepcopy(fp), {"preset": "w8a8", "weights": {"reduce_range": True}}, data,
                              ignore=["lm_head"], params=compress.QuantizeParams(quantize_ops=False))
    path = compress.export_llm_onnx(q, tmp_path / "m.onnx", weights=weights)  # type: ignore[arg-type]
    ids = data[0]["input_ids"][:2, :8]
    got = compress.generate_ort(path, ids, max_new_tokens=6)
    with torch.no_grad():
        ref = q.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    assert torch.equal(torch.as_tensor(got)[:, 8:], ref[:, 8:])


def test_prune_with_an_optimizer_refuses_packed_experts_before_changing_anything() -> None:
    model = _build("mixtral")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    names = [n for n, _ in model.named_modules()]
    with pytest.raises(UnsupportedModelError, match="unpack_experts"):
        compress.prune(model, _batches(1)[0], ratio=0.3, optimizer=opt)
    assert [n for n, _ in model.named_modules()] == names  # still packed: the optimizer's Parameters are the model's


def test_export_of_a_packed_model_runs_and_leaves_it_packed(tmp_path: Path) -> None:
    import onnxruntime as ort

    model = _build("qwen3_moe")
    params = {n: p.data_ptr() for n, p in model.named_parameters()}
    x = _batches(1)[0]
    path = compress.export_onnx(model, x, tmp_path / "fp32.onnx")
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == params  # an optimizer's Parameters still
    s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    out = torch.from_numpy(s.run(None, {"input_ids": x["input_ids"].numpy()})[0])
    assert (out - _logits(model, x)).abs().max() < 1e-4
