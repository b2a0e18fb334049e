"""GPTQ: the rounding against references (bit-exact where GPTQ must equal round-to-nearest), its
objective against RTN's, the grid format the exporters read, Hessians (bounded, all-reduced under
DDP), and end to end on tiny random Llama (GQA), Qwen2 and GPT-2 (Conv1D) models."""

from __future__ import annotations

import copy
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from compress.quantization.algorithms.gptq import GPTQParams, HessianAccumulator, gptq_quantize, layer_error
from compress.quantization.numerics.modules import QuantLinear
from compress.quantization.numerics.primitives import dynamic_qparams, fake_quantize_spec, quantize_spec
from compress.quantization.numerics.spec import QuantScheme, QuantSpec
from torch import nn

import compress
from compress.core.errors import CalibrationError, RecipeError

SPECS = {
    "w4g32": QuantSpec(bits=4, granularity="group", group_size=32),
    "w4ch": QuantSpec(bits=4, granularity="channel"),
    "w3g32_asym": QuantSpec(bits=3, granularity="group", group_size=32, symmetric=False, dtype="uint8"),
    "w8ch": QuantSpec(bits=8, granularity="channel"),
}


def _problem(k: int = 100, n: int = 24, tokens: int = 512, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) * 0.3 + torch.eye(k)
    x = torch.randn(tokens, k, generator=g) @ mix  # correlated inputs: what gives GPTQ room
    w = torch.randn(n, k, generator=g) * 0.05
    return w, 2 * x.t() @ x / tokens


def _rtn(w: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    s, z = dynamic_qparams(w, spec)
    return fake_quantize_spec(w, s, z, spec)


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_rtn_and_lies_on_the_stored_grid(name: str, act_order: bool) -> None:
    spec = SPECS[name]
    w, h = _problem()  # 100 input features: groups of 32 leave a ragged last group of 4
    q, scale, zp = gptq_quantize(w, h, spec, GPTQParams(act_order=act_order, block_size=16))
    expect_shape = (24, 4) if spec.granularity == "group" else (24,)
    assert scale.shape == zp.shape == expect_shape and zp.dtype == torch.int32
    # the weight quantizer's own arithmetic reproduces q exactly, and codes stay in range
    torch.testing.assert_close(fake_quantize_spec(q, scale, zp, spec), q, atol=0, rtol=0)
    codes = quantize_spec(q, scale, zp, spec).int()
    assert int(codes.min()) >= spec.qmin and int(codes.max()) <= spec.qmax
    rtn, gp = layer_error(w, _rtn(w, spec), h), layer_error(w, q, h)
    assert gp < 0.8 * rtn, (rtn, gp)


def test_gptq_with_a_diagonal_hessian_is_round_to_nearest() -> None:
    # no correlation between inputs: nothing to compensate, so every column rounds to nearest
    w, _ = _problem()
    h = torch.diag(torch.rand(100) + 0.5)
    for spec in (SPECS["w4ch"], SPECS["w4g32"], SPECS["w3g32_asym"]):
        q, scale, zp = gptq_quantize(w, h, spec, GPTQParams(dampening=0.01))
        torch.testing.assert_close(q, _rtn(w, spec), atol=0, rtol=0)
        ref_s, ref_z = dynamic_qparams(w, spec)
        torch.testing.assert_close(scale, ref_s, atol=0, rtol=0)
        torch.testing.assert_close(zp, ref_z, atol=0, rtol=0)


def test_dead_inputs_and_bad_granularity() -> None:
    w, h = _problem()
    h[:, 3] = 0
    h[3, :] = 0  # an input that never fires: its column is dropped, not a NaN
    q, _, _ = gptq_quantize(w, h, SPECS["w4g32"])
    assert torch.isfinite(q).all() and torch.all(q[:, 3] == 0)
    with pytest.raises(CalibrationError, match="per-channel"):
        gptq_quantize(w, h, QuantSpec(bits=4, granularity="tensor"))


def test_hessian_accumulator_is_bounded_and_exact() -> None:
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(3, 7, 16, generator=g) for _ in range(4)]
    acc = HessianAccumulator(16)
    for x in xs:
        acc.add(x)
    assert acc.xtx.shape == (16, 16) and acc.count == 84
    flat = torch.cat([x.reshape(-1, 16) for x in xs])
    torch.testing.assert_close(acc.hessian(), 2 * flat.t() @ flat / 84, rtol=1e-5, atol=1e-5)
    with pytest.raises(CalibrationError, match="no calibration inputs"):
        HessianAccumulator(4).hessian()


def _ddp_worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        g = torch.Generator().manual_seed(20 + rank)
        acc = HessianAccumulator(8)
        acc.add(torch.randn(5 + 3 * rank, 8, generator=g) * (1 + rank))
        acc.all_reduce()
        torch.save({"h": acc.hessian(), "n": acc.count}, f"{out}/{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_hessians_are_summed_across_ddp_ranks(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ddp_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    xs = [torch.randn(5 + 3 * r, 8, generator=torch.Generator().manual_seed(20 + r)) * (1 + r) for r in range(2)]
    flat = torch.cat(xs)
    for r in range(2):
        got = torch.load(tmp_path / f"{r}.pt", weights_only=True)
        assert got["n"] == 13
        torch.testing.assert_close(got["h"], 2 * flat.t() @ flat / 13, rtol=1e-5, atol=1e-5)


# ---- end to end on Hugging Face causal LMs ------------------------------------------------------


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=128))


def _qwen2() -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=128))


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64,
                                      bos_token_id=0, eos_token_id=0))


MODELS = {"llama": _llama, "qwen2": _qwen2, "gpt2": _gpt2}
W3 = QuantScheme(weights=QuantSpec(bits=3, granularity="group", group_size=32), inputs=None)


def _calib() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 128, (2, 32), generator=g) for _ in range(6)]


def _logit_mse(a: nn.Module, b: nn.Module, data: list[torch.Tensor]) -> float:
    with torch.no_grad():
        return sum(float(((a(input_ids=x).logits - b(input_ids=x).logits) ** 2).mean()) for x in data)


@pytest.mark.parametrize("arch", list(MODELS))
def test_gptq_on_hf_causal_lms_beats_rtn(arch: str) -> None:
    torch.manual_seed(0)
    fp = MODELS[arch]().eval()
    data = _calib()
    q = compress.gptq(copy.deepcopy(fp), data, scheme=W3, params=GPTQParams(act_order=arch == "llama"), ignore=["lm_head"])
    lins = {n: m for n, m in q.named_modules() if isinstance(m, QuantLinear)}
    assert len(lins) == (7 if arch != "gpt2" else 4) * 2 and "lm_head" not in lins
    for m in lins.values():  # GPTQ's weights are on the grid the quantizer stores
        assert m.weight_quantizer is not None and m.input_quantizer is None
        torch.testing.assert_close(m.weight_quantizer(m.weight), m.weight, atol=0, rtol=0)
    rtn = copy.deepcopy(fp)
    from compress.quantization.preparation import linearize_conv1d

    linearize_conv1d(rtn)
    compress.quantize(rtn, W3, ignore=["lm_head"])
    assert _logit_mse(q, fp, data) < 0.8 * _logit_mse(rtn, fp, data)


def test_gptq_w8a8_dynamic_beats_round_to_nearest_and_keeps_its_activation_quantizers() -> None:
    """llm-compressor's W8A8 (int8 per-channel weights by GPTQ, int8 per-token dynamic activations):
    each layer runs with its activations quantized to feed the next, as it will be deployed."""
    fp: Any = _llama().eval()
    for layer in fp.model.layers:  # the few large channels trained LLMs have: what int8 activations must cover
        with torch.no_grad():
            layer.input_layernorm.weight[:3] = 30.0
    data = _calib()
    q = compress.gptq(copy.deepcopy(fp), data, scheme="W8A8", ignore=["lm_head"])
    lins = [m for m in q.modules() if isinstance(m, QuantLinear)]
    assert len(lins) == 14
    for m in lins:
        assert m.input_quantizer is not None and m.input_quantizer.spec.dynamic
        assert m.input_quantizer.enabled and m.weight_quantizer is not None
        torch.testing.assert_close(m.weight_quantizer(m.weight), m.weight, atol=0, rtol=0)
    rtn = compress.quantize(copy.deepcopy(fp), "W8A8", data, ignore=["lm_head"],
                            params=compress.QuantizeParams(quantize_ops=False))
    held = [torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(9))]
    assert _logit_mse(q, fp, held) < _logit_mse(rtn, fp, held)  # 2.85e-5 vs 3.17e-5: at 8 bits the activations dominate


def test_gptq_after_smoothquant_sees_the_inputs_the_weights_see(monkeypatch: pytest.MonkeyPatch) -> None:
    """SmoothQuant then GPTQ (llm-compressor's W8A8 recipe): where the factor stays a pre-quant
    Mul (o_proj under GQA) the weight holds ``s``, so GPTQ's Hessian is of ``x / s``, not of ``x``."""
    from compress.quantization.algorithms.gptq import gptq_layer
    from compress.quantization.algorithms.sequential import capture_inputs

    from compress.core.batching import as_batches

    data = _calib()
    q = compress.quantize(_llama().eval(), "w8a8_dynamic", data, ignore=["lm_head"],
                          params=compress.QuantizeParams(quantize_ops=False, smoothquant=0.5))
    layer = q.model.layers[0]
    o_proj = layer.self_attn.o_proj
    pre = o_proj.input_quantizer.pre_quant_scale
    assert pre is not None and not torch.allclose(pre, torch.ones_like(pre))
    raw: list[torch.Tensor] = []
    fed: list[torch.Tensor] = []
    o_proj.register_forward_pre_hook(lambda m, a: raw.append(a[0].detach().clone()))
    add = HessianAccumulator.add

    def spy(self: HessianAccumulator, x: torch.Tensor) -> None:
        fed.append(x.detach().clone())
        add(self, x)

    monkeypatch.setattr(HessianAccumulator, "add", spy)
    calls = capture_inputs(q, layer, as_batches(data, q))
    gptq_layer(layer, {"self_attn.o_proj": o_proj}, calls, GPTQParams())
    assert len(fed) == len(raw) == len(data)
    for x, r in zip(fed, raw):
        torch.testing.assert_close(x, r * pre)


def test_gptq_inputs_are_checked() -> None:
    with pytest.raises(CalibrationError, match="static activation scales come from calibration"):
        compress.gptq(_llama(), _calib(), scheme="w8a8", ignore=["lm_head"])
    with pytest.raises(CalibrationError, match="weight-only"):
        compress.awq(_llama(), _calib(), scheme="w8a8_dynamic", ignore=["lm_head"])
    with pytest.raises(CalibrationError, match="fed no batch"):
        compress.gptq(_llama(), lambda m: None, ignore=["lm_head"])  # a forward function that runs nothing
    with pytest.raises(RecipeError, match="unknown quantization scheme"):
        compress.gptq(_llama(), _calib(), scheme="w4_g128", ignore=["lm_head"])


def test_recipe_modifiers_validate_their_fields() -> None:
    base = {"version": 1, "model": {"hf_path": "x"}, "data": {"source": "text_lm"}, "train": {"metric": "perplexity"}}

    def recipe(mod: dict[str, object]) -> object:
        return compress.load_recipe({**base, "stages": [{"name": "q", "modifiers": [mod]}]})

    r = recipe({"type": "gptq", "act_order": True, "scheme": {"preset": "w4_weight_only_g128", "weights": {"group_size": 64}}})
    spec = r.stages[0].modifiers[0]  # type: ignore[attr-defined]
    assert isinstance(spec, compress.GPTQParams) and spec.act_order  # the recipe spec is the settings object
    assert spec.resolved_scheme().weights.group_size == 64
    with pytest.raises(RecipeError, match=r"act_ordr.*did you mean 'act_order'"):
        recipe({"type": "gptq", "act_ordr": True})
    w8a8 = recipe({"type": "gptq", "scheme": "W8A8"}).stages[0].modifiers[0]  # type: ignore[attr-defined]
    assert w8a8.resolved_scheme().inputs.dynamic
    with pytest.raises(RecipeError, match=r"scheme: static activation scales come from a ptq modifier"):
        recipe({"type": "gptq", "scheme": "w8a8"})
    with pytest.raises(RecipeError, match=r"scheme: needs a weight-only scheme"):
        recipe({"type": "awq", "scheme": "W8A8"})
    with pytest.raises(RecipeError, match="weight-only scheme"):
        recipe({"type": "awq", "scheme": "w8a8"})
    with pytest.raises(RecipeError, match="needs calibration data"):
        compress.load_recipe({**base, "data": {"source": "text_lm", "calibration_samples": 0},
                              "stages": [{"name": "q", "modifiers": [{"type": "awq"}]}]})


@pytest.mark.parametrize(("first", "scheme"), [
    ({"type": "ptq", "scheme": "W8A8", "ignore": ["lm_head"], "quantize_ops": False, "smoothquant": "auto"}, "W8A8"),
    ({"type": "awq", "scheme": "W4A16", "ignore": ["lm_head"]}, "W4A16"),
], ids=["smoothquant-gptq-w8a8", "awq-gptq-w4a16"])
def test_recipe_gptq_after_another_quantize_modifier(first: dict[str, Any], scheme: str, tiny_llm_dir: str,
                                                     tmp_path: Path) -> None:
    """llm-compressor's W8A8 and AWQ+GPTQ recipes as compress recipes: a ptq modifier (dynamic
    per-token activations, SmoothQuant) or AWQ, then gptq rounding the same Linears' weights; the
    saved run restores (the first modifier makes the structure, GPTQ's weights are in the state_dict)."""
    recipe = compress.load_recipe({
        "version": 1, "name": "sq_gptq_w8a8", "model": {"hf_path": tiny_llm_dir},
        "data": {"source": "text_lm", "kwargs": {"tokenizer": tiny_llm_dir, "seq_len": 32, "samples": 8},
                 "calibration_samples": 8, "eval_samples": 4},
        "train": {"epochs": 0, "metric": "perplexity"},
        "stages": [{"name": "q", "modifiers": [first, {"type": "gptq", "scheme": scheme, "ignore": ["lm_head"]}]}],
        "export": {"enabled": False}, "validate": {"enabled": False},
    })
    report = compress.apply(recipe, out_dir=tmp_path / "run", quiet=True)
    metrics = report.stages[0].metrics
    assert metrics["quantized_modules"] == 14 and metrics["gptq_error"] < metrics["rtn_error"]
    # the saved run restores: ptq's entry makes the structure, gptq's re-rounded weights are in the state_dict
    from compress.models import load_model
    from compress.state import restore_compressed
    from compress.training import evaluate

    model = restore_compressed(lambda: load_model(recipe.model), tmp_path / "run" / "checkpoints" / "final.pt")
    lins = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(lins) == 14 and all((m.input_quantizer is not None) == (scheme == "W8A8") for m in lins)
    data = compress.build_data(recipe.data, batch_size=4, seed=recipe.data.seed)
    ppl = evaluate(model, data.eval, metric="perplexity", device=torch.device("cpu"))
    assert ppl == pytest.approx(report.final.accuracy, rel=1e-6)  # "accuracy" holds the recipe metric
