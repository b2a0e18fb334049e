"""SparseGPT and Wanda (pruning/sparse): the masks against direct computations, N:M groups, the
masks kept by GPTQ, QuantLinear swaps and fine-tuning, the settings' refusals."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch
from compress.pruning.sparse.sparsegpt import SparseGPTParams, sparsegpt_prune
from compress.pruning.sparse.wanda import WandaParams, wanda_mask
from compress.quantization.algorithms.gptq import GPTQParams, gptq_quantize
from compress.quantization.numerics.spec import resolve_scheme
from torch import nn

import compress
from compress.core.errors import RecipeError, TargetMatchError
from compress.core.sparsity import mask_of, masked_modules, nm_groups_ok
from compress.models.families import tiny_decoder


def _batches(n: int = 4, seq: int = 16, vocab: int = 256, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (2, seq), generator=g) for _ in range(n)]


def _layer_linears(model: nn.Module) -> dict[str, nn.Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in n}


def _magnitude_keep(w: torch.Tensor, fraction: float) -> torch.Tensor:
    """Magnitude pruning over the whole matrix, by a full sort (not topk)."""
    k = int(w.numel() * fraction)
    order = torch.argsort(w.abs().flatten())
    keep = torch.ones(w.numel(), dtype=torch.bool)
    keep[order[:k]] = False
    return keep.reshape(w.shape)


def test_sparsegpt_with_a_scaled_identity_hessian_is_magnitude_pruning() -> None:
    torch.manual_seed(3)
    w = torch.randn(24, 64)
    h = torch.eye(64) * 2.5  # diagonal: the inverse's Cholesky factor is diagonal, nothing is updated
    new, keep, qp = sparsegpt_prune(w, h, SparseGPTParams(sparsity=0.5, block_size=64))
    assert qp is None
    assert torch.equal(keep, _magnitude_keep(w, 0.5))
    assert torch.equal(new[keep], w[keep]) and bool((new[~keep] == 0).all())
    # N:M: in every group of 4 the 2 largest magnitudes stay, exactly
    new, keep, _ = sparsegpt_prune(w, h, SparseGPTParams(pattern="2:4", block_size=16))
    groups = w.abs().reshape(24, 16, 4)
    want = torch.zeros_like(groups, dtype=torch.bool).scatter_(2, groups.argsort(dim=2, descending=True)[..., :2], True)
    assert torch.equal(keep, want.reshape(24, 64))
    assert torch.equal(new[keep], w[keep])


def test_sparsegpt_with_a_diagonal_hessian_weighs_columns_by_it() -> None:
    # a diagonal H: the OBS score w^2 / [U]_jj^2 is w^2 * (h_jj + damp): pruning by |w| sqrt(h + damp)
    torch.manual_seed(4)
    w, hd = torch.randn(16, 32), torch.rand(32) + 0.1
    p = SparseGPTParams(sparsity=0.25, block_size=32)
    new, keep, _ = sparsegpt_prune(w, torch.diag(hd), p)
    damped = hd + p.dampening * hd.mean()
    assert torch.equal(keep, _magnitude_keep(w * damped.sqrt(), 0.25))
    assert torch.equal(new[keep], w[keep])


def test_sparsegpt_updates_the_kept_weights_and_beats_masking_alone() -> None:
    torch.manual_seed(5)
    x = torch.randn(512, 32) @ torch.randn(32, 32)  # correlated inputs: a full Hessian
    w = torch.randn(16, 32)
    h = 2 * x.T @ x / x.shape[0]
    new, keep, _ = sparsegpt_prune(w, h, SparseGPTParams(pattern="2:4", block_size=32))
    assert nm_groups_ok(new, 2, 4) and bool((new[~keep] == 0).all())
    masked = w * keep

    def err(v: torch.Tensor) -> float:
        return float(((x @ (w - v).T) ** 2).sum())

    assert err(new) < 0.8 * err(masked)


def _norms_of_layer0(model: nn.Module, batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    sums: dict[str, torch.Tensor] = {}
    handles = []
    for n, m in model.named_modules():
        if isinstance(m, nn.Linear) and n.startswith("model.layers.0."):
            def hook(_: nn.Module, args: tuple[torch.Tensor, ...], n: str = n) -> None:
                x = args[0].reshape(-1, args[0].shape[-1]).double()
                sums[n] = sums.get(n, 0) + (x * x).sum(0)
            handles.append(m.register_forward_pre_hook(hook))
    with torch.no_grad():
        for b in batches:
            model(input_ids=b, use_cache=False)
    for h in handles:
        h.remove()
    return {n: s.sqrt() for n, s in sums.items()}


@pytest.mark.parametrize("pattern", ["unstructured", "2:4"])
def test_wanda_mask_equals_a_direct_computation(pattern: str) -> None:
    model = tiny_decoder("llama")
    dense = copy.deepcopy(model)
    batches = _batches()
    norms = _norms_of_layer0(dense, batches)  # layer 0's inputs: the dense model's
    compress.wanda(model, batches, pattern=pattern, sparsity=0.5 if pattern == "unstructured" else None, progress=False)
    assert set(masked_modules(model)) == set(_layer_linears(model))
    for n, norm in norms.items():
        w = dense.get_submodule(n).weight.detach()
        score = w.abs().double() * norm
        if pattern == "unstructured":  # per output row: its half with the lowest scores goes
            order = score.argsort(dim=1)
            want = torch.ones_like(w, dtype=torch.bool)
            want.scatter_(1, order[:, : w.shape[1] // 2], False)
        else:
            g = score.reshape(w.shape[0], -1, 4)
            want = torch.zeros_like(g, dtype=torch.bool).scatter_(2, g.argsort(dim=2)[..., 2:], True).reshape(w.shape)
        got = mask_of(model.get_submodule(n))
        assert got is not None and torch.equal(got, want), n
        assert torch.equal(model.get_submodule(n).weight.detach(), w * want)  # no update, only zeros
    assert wanda_mask(w, norm, WandaParams(pattern=pattern)).shape == w.shape


@pytest.mark.parametrize("algorithm", ["sparsegpt", "wanda"])
def test_every_2_of_4_group_keeps_at_most_two_and_the_head_is_left_alone(algorithm: str) -> None:
    model = tiny_decoder("llama")
    head = model.lm_head.weight.detach().clone()
    getattr(compress, algorithm)(model, _batches(), pattern="2:4", progress=False)
    lins = _layer_linears(model)
    assert len(lins) == 14  # 2 layers x (q, k, v, o, gate, up, down)
    for n, m in lins.items():
        assert nm_groups_ok(m.weight, 2, 4), n
        assert float((m.weight == 0).float().mean()) == pytest.approx(0.5, abs=0.02), n
    assert torch.equal(model.lm_head.weight, head) and mask_of(model.lm_head) is None


def test_unstructured_sparsity_is_reached_per_linear() -> None:
    model = tiny_decoder("llama")
    compress.sparsegpt(model, _batches(), sparsity=0.7, ignore=["model.layers.1.mlp.down_proj"], progress=False)
    for n, m in _layer_linears(model).items():
        frac = float((m.weight == 0).float().mean())
        assert frac == (pytest.approx(0.7, abs=0.01) if n != "model.layers.1.mlp.down_proj" else 0.0), n


def test_gptq_after_sparsegpt_keeps_every_zero() -> None:
    torch.manual_seed(6)
    x = torch.randn(256, 64) @ torch.randn(64, 64)
    h = 2 * x.T @ x / x.shape[0]
    w, keep, _ = sparsegpt_prune(torch.randn(32, 64), h, SparseGPTParams(pattern="2:4", block_size=64))
    spec = resolve_scheme("w4_weight_only_g128").weights
    assert spec is not None
    for act_order in (True, False):
        free, _, _ = gptq_quantize(w, h, spec, GPTQParams(act_order=act_order))
        assert not nm_groups_ok(free, 2, 4)  # without the mask GPTQ's updates fill the zeros in
        q, _, _ = gptq_quantize(w, h, spec, GPTQParams(act_order=act_order), mask=keep)
        assert nm_groups_ok(q, 2, 4) and bool((q[~keep] == 0).all())


def test_sparsegpt_then_gptq_on_a_model_and_joint_quantization() -> None:
    model = tiny_decoder("llama")
    compress.sparsegpt(model, _batches(), pattern="2:4", progress=False)
    compress.gptq(model, _batches(), scheme="w4_weight_only_g128", ignore=["lm_head"], progress=False)
    for n, m in _layer_linears(model).items():
        assert type(m).__name__ == "QuantLinear" and mask_of(m) is not None, n  # the swap carried the mask
        assert nm_groups_ok(m.weight, 2, 4) and nm_groups_ok(m.quantized_weight(), 2, 4), n
    joint = tiny_decoder("llama")
    compress.sparsegpt(joint, _batches(), pattern="2:4", scheme="w4_weight_only_g128", ignore=["lm_head"],
                       progress=False)
    for n, m in _layer_linears(joint).items():
        assert type(m).__name__ == "QuantLinear", n
        wq = m.quantized_weight()
        assert nm_groups_ok(wq, 2, 4) and torch.equal(wq, m.weight.detach()), n  # the weight lies on the grid


def _recipe(*stages: dict[str, Any]) -> dict[str, Any]:
    return {"version": 1, "model": {"name": "m"}, "stages": list(stages)}


def test_the_mask_survives_qat_fine_tuning_in_a_session() -> None:
    model = tiny_decoder("llama")
    r = _recipe({"name": "sparse", "modifiers": [{"type": "wanda", "pattern": "2:4"}]},
                {"name": "qat", "steps": 4, "modifiers": [{"type": "qat", "scheme": "w8_weight_only"}]})
    opt: torch.optim.Optimizer | None = None
    filled = False
    with compress.Session(r, model, calibration_data=_batches()) as s:
        masks = {n: mask_of(m).clone() for n, m in masked_modules(model).items()}  # type: ignore[union-attr]
        before = {n: model.get_submodule(n).weight.detach().clone() for n in masks}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        model.train()
        for b in _batches(4, seed=7):
            loss = model(input_ids=b, labels=b, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            filled = filled or any(bool((model.get_submodule(n).weight[~k] != 0).any()) for n, k in masks.items())
            s.step()
    assert filled  # the optimizer did move pruned weights: the session's re-masking is what keeps them zero
    assert len(masks) == 14
    for n, keep in masks.items():
        m = s.model.get_submodule(n)
        assert type(m).__name__ == "QuantLinear", n
        assert bool((m.weight[~keep] == 0).all()) and nm_groups_ok(m.weight, 2, 4), n
        assert not torch.equal(m.weight.detach(), before[n]), n  # it was trained


@pytest.mark.parametrize(("settings", "message"), [
    ({"sparsity": 1.5}, "sparsity: Input should be less than 1"),
    ({"sparsity": 0}, "sparsity: Input should be greater than 0"),
    ({"pattern": "4:4"}, "pattern: N:M keeps N of every M weights: it needs 0 < N < M"),
    ({"pattern": "two:four"}, "pattern: pattern is 'unstructured' or 'N:M'"),
    ({"pattern": "2:4", "sparsity": 0.3}, "sparsity 0.3 contradicts pattern 2:4"),
    ({"pattern": "2:4", "block_size": 130}, "block_size 130 must be a multiple of the pattern's M (4)"),
])
def test_settings_are_refused_in_one_line_naming_the_field(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(RecipeError, match=re.escape(message)) as exc:
        SparseGPTParams(**settings)
    assert "\n" not in str(exc.value)


def test_model_dependent_refusals() -> None:
    model = tiny_decoder("llama")
    with pytest.raises(RecipeError, match=r"pattern: 2:5 needs each Linear's input width divisible by 5; "
                                          r"model\.layers\.0\.self_attn\.q_proj has 64"):
        compress.wanda(model, _batches(), pattern="2:5", progress=False)
    with pytest.raises(TargetMatchError, match="lm_head is outside the decoder layers"):
        compress.sparsegpt(model, _batches(), targets=["type:Linear"], progress=False)
    assert not masked_modules(model)  # refused before anything was pruned
    compress.gptq(model, _batches(), scheme="w4_weight_only_g128", ignore=["lm_head"], progress=False)
    with pytest.raises(RecipeError, match="is quantized already: prune before quantizing"):
        compress.sparsegpt(model, _batches(), progress=False)
    with pytest.raises(RecipeError, match="sparsegpt: sparsity is given twice"):
        compress.sparsegpt(model, _batches(), sparsity=0.3, params=SparseGPTParams(sparsity=0.5), progress=False)


def test_gpt2_conv1d_is_planned_and_pruned_as_linears() -> None:
    from compress.pruning.sparse.params import sparse_targets

    model = tiny_decoder("gpt2")
    names = sparse_targets(model, WandaParams(pattern="2:4"), where="wanda")  # before any swap: the dry run's view
    assert "transformer.h.0.attn.c_attn" in names and "transformer.h.1.mlp.c_proj" in names
    compress.wanda(model, _batches(), pattern="2:4", progress=False)
    pruned = masked_modules(model)
    assert set(pruned) == set(names)
    assert all(isinstance(m, nn.Linear) and nm_groups_ok(m.weight, 2, 4) for m in pruned.values())


@pytest.mark.parametrize("quantized", [False, True], ids=["sparse", "sparse-w4"])
def test_the_compressed_tensors_checkpoint_reloads_with_equal_logits_and_every_2_of_4_group(quantized: bool,
                                                                                          tmp_path: Any) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("compressed_tensors")
    import json

    from compress.export.llm.compressed_tensors import save_compressed_tensors

    model = tiny_decoder("qwen2", seed=0)
    compress.sparsegpt(model, _batches(), params=SparseGPTParams(pattern="2:4"), progress=False)
    if quantized:  # llm-compressor's 2:4 + W4A16 recipe: GPTQ after SparseGPT
        compress.gptq(model, _batches(), scheme=resolve_scheme({"weights": {"bits": 4, "granularity": "group",
                                                                            "group_size": 32}, "inputs": None}),
                      ignore=["lm_head"], progress=False)
    out = save_compressed_tensors(model, tmp_path / "ckpt")
    sc = json.loads((out / "config.json").read_text())["quantization_config"]["sparsity_config"]
    assert sc["format"] == "dense" and sc["sparsity_structure"] == "2:4"
    assert sorted(sc["targets"]) == sorted(masked_modules(model)) and sc["global_sparsity"] >= 0.5
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    ids = _batches(n=1, seq=12, vocab=model.config.vocab_size, seed=9)[0]
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=0, rtol=0)
    for name in sc["targets"]:
        assert nm_groups_ok(loaded.get_submodule(name).weight.detach(), 2, 4), name
