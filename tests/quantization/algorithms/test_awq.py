"""AWQ: fold groups found in the traced layer (the exact folds of Llama MHA/GQA, Qwen2 and GPT-2),
folds that leave the float model unchanged, a scale search never worse than rounding to nearest,
the clip search, and AWQ then GPTQ composed."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from compress.quantization.algorithms.awq import scale_error_ratio
from compress.quantization.algorithms.awq_folds import find_fold_groups
from compress.quantization.algorithms.awq_search import AWQParams, search_clip, search_scales
from compress.quantization.algorithms.sequential import capture_inputs, decoder_layers
from compress.quantization.numerics.calibration import float_mode
from compress.quantization.numerics.modules import QuantLinear
from compress.quantization.numerics.primitives import dynamic_qparams, fake_quantize_spec
from compress.quantization.numerics.spec import QuantScheme, QuantSpec
from compress.quantization.preparation import linearize_conv1d
from torch import nn

import compress
from compress.core.errors import CalibrationError
from compress.core.params import Selection

W3 = QuantScheme(weights=QuantSpec(bits=3, granularity="group", group_size=32), inputs=None)


def _llama(kv_heads: int = 2) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=kv_heads, vocab_size=128)).eval()


def _qwen2() -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=128)).eval()


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64,
                                      bos_token_id=0, eos_token_id=0)).eval()


def _gemma() -> nn.Module:
    from transformers import GemmaConfig, GemmaForCausalLM

    torch.manual_seed(0)
    return GemmaForCausalLM(GemmaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2, head_dim=16,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=128)).eval()


def _neox() -> nn.Module:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    return GPTNeoXForCausalLM(GPTNeoXConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, vocab_size=128, max_position_embeddings=64)).eval()


def _calib() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 128, (2, 32), generator=g) for _ in range(6)]


LLAMA_GQA = [
    (["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], "input_layernorm"),
    (["self_attn.o_proj"], "self_attn.v_proj"),  # GQA: each v_proj row feeds 2 o_proj inputs (tied scales)
    (["mlp.gate_proj", "mlp.up_proj"], "post_attention_layernorm"),
    (["mlp.down_proj"], "mlp.up_proj"),  # through SwiGLU's product
]


@pytest.mark.parametrize(
    "make,expected",
    [
        (_llama, LLAMA_GQA),
        (lambda: _llama(kv_heads=4), LLAMA_GQA),
        (_qwen2, LLAMA_GQA),
        (_gpt2, [(["attn.c_attn"], "ln_1"), (["attn.c_proj"], None), (["mlp.c_fc"], "ln_2"), (["mlp.c_proj"], None)]),
        # attention.dense (64 wide) divides dense_4h_to_h's input (128): probed, no channel map, no fold
        (_neox, [(["attention.query_key_value"], "input_layernorm"), (["attention.dense"], None),
                 (["mlp.dense_h_to_4h"], "post_attention_layernorm"), (["mlp.dense_4h_to_h"], None)]),
        (_gemma, LLAMA_GQA),  # its norms multiply by 1 + weight: the factors fold into that
        # bf16 (how LLMs are loaded): proved on a float32 copy, where bf16 rounding would refuse every fold
        (lambda: _llama().to(torch.bfloat16), LLAMA_GQA),
    ],
    ids=["llama_gqa", "llama_mha", "qwen2", "gpt2", "neox", "gemma", "llama_bf16"],
)
def test_fold_groups_are_found_in_the_traced_layer(make, expected) -> None:  # type: ignore[no-untyped-def]
    model = make()
    linearize_conv1d(model)
    _, layers = decoder_layers(model)
    calls = capture_inputs(model, layers[0], _calib()[:1])
    names = [n for n, m in layers[0].named_modules() if isinstance(m, nn.Linear)]
    groups = find_fold_groups(layers[0], names, calls[0])
    assert [(g.consumers, g.producer) for g in groups] == expected
    for g in groups:
        # Gemma's RMSNorm (and only it here) scales by 1 + weight
        assert g.offset == ("Gemma" in type(model).__name__ and "layernorm" in str(g.producer))
        if g.producer == "self_attn.v_proj":
            cfg = model.config
            d = cfg.hidden_size // cfg.num_attention_heads
            rep = cfg.num_attention_heads // cfg.num_key_value_heads
            c = torch.arange(cfg.hidden_size)
            # o_proj input channel (head h, dim j) carries v_proj row (h // rep, j): transformers' repeat_kv
            want = None if rep == 1 else (c // d // rep) * d + c % d
            assert (g.index is None) == (want is None) and (want is None or torch.equal(g.index, want))


@pytest.mark.parametrize("make", [_llama, _gpt2, _gemma], ids=["llama", "gpt2", "gemma"])
def test_awq_folds_leave_the_float_model_unchanged_and_beat_rtn(make) -> None:  # type: ignore[no-untyped-def]
    fp = make()
    data = _calib()
    q = compress.awq(copy.deepcopy(fp), data, scheme=W3, ignore=["lm_head"])
    with torch.no_grad():
        ref = torch.cat([fp(input_ids=x).logits for x in data])
        with float_mode(q):  # quantizers off: only the folds and the clipping remain
            folded = torch.cat([q(input_ids=x).logits for x in data])
        got = torch.cat([q(input_ids=x).logits for x in data])
    rtn = copy.deepcopy(fp)
    linearize_conv1d(rtn)
    compress.quantize(rtn, W3, ignore=["lm_head"])
    with torch.no_grad():
        base = torch.cat([rtn(input_ids=x).logits for x in data])
    unclipped = compress.awq(copy.deepcopy(fp), data, scheme=W3, params=AWQParams(clip=False), ignore=["lm_head"])
    with torch.no_grad(), float_mode(unclipped):
        exact = torch.cat([unclipped(input_ids=x).logits for x in data])
    torch.testing.assert_close(exact, ref, rtol=1e-4, atol=1e-4)  # scale folds alone are exact in float
    assert float(((folded - ref) ** 2).mean()) < float(((got - ref) ** 2).mean())  # clipping is a small change
    assert float(((got - ref) ** 2).mean()) < float(((base - ref) ** 2).mean())


def test_scale_search_never_loses_to_rtn_and_favours_salient_channels() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 64, generator=g)
    x[:, :4] *= 20  # four salient input channels
    w = torch.randn(48, 64, generator=g) * 0.05
    spec = W3.weights
    assert spec is not None
    pick = search_scales(x, [w], spec, AWQParams(clip=False))
    sc, zp = dynamic_qparams(w, spec)
    rtn_err = float(((x @ fake_quantize_spec(w, sc, zp, spec).t() - x @ w.t()) ** 2).mean())
    assert pick.unscaled_error == pytest.approx(rtn_err, rel=1e-4)  # s = 1 is plain rounding
    assert pick.alpha >= 0 and pick.error < 0.9 * rtn_err
    assert float(pick.scales[:4].min()) > float(pick.scales[4:].max())  # the salient channels are scaled up


def test_scales_are_chosen_for_the_clipped_weights_they_will_get() -> None:
    """With clip_in_search each candidate is judged after the clip search the weights will get;
    the error it reports is that of the final weights, and never above the error of scales chosen
    on rounding alone and clipped afterwards."""
    from compress.quantization.algorithms.awq_search import clip_weight

    g = torch.Generator().manual_seed(2)
    x = torch.randn(512, 64, generator=g)
    x[:, :4] *= 20
    w = torch.randn(48, 64, generator=g) * 0.05
    w[::5, 7] = 0.6  # outlier weights: the clip search cuts them
    spec = W3.weights
    assert spec is not None

    def final(s: torch.Tensor) -> float:
        ws = w * s
        clipped = clip_weight(ws, search_clip(x / s, ws, spec, AWQParams()), spec)
        sc, zp = dynamic_qparams(clipped, spec)
        return float(((x @ (fake_quantize_spec(clipped, sc, zp, spec) / s).t() - x @ w.t()) ** 2).mean())

    aware = search_scales(x, [w], spec, AWQParams(), clip_rows=x)
    blind = search_scales(x, [w], spec, AWQParams(clip_in_search=False))
    assert aware.error == pytest.approx(final(aware.scales), rel=1e-4)
    assert aware.unscaled_error == pytest.approx(final(torch.ones(64)), rel=1e-4)  # judged alike
    assert final(aware.scales) <= final(blind.scales) * (1 + 1e-6)


def test_clip_search_bounds_lie_within_the_range_and_do_not_hurt() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 80, generator=g)
    w = torch.randn(16, 80, generator=g)
    w[0, 5] = 20.0  # an outlier weight: clipping it pays off for its group
    spec = QuantSpec(bits=4, granularity="group", group_size=32)  # 80 = 32 + 32 + 16
    bound = search_clip(x, w, spec, AWQParams())
    amax = torch.stack([w[:, :32].abs().amax(1), w[:, 32:64].abs().amax(1), w[:, 64:].abs().amax(1)], dim=1)
    assert bound.shape == (16, 3) and torch.all(bound <= amax) and torch.all(bound >= 0.5 * amax - 1e-6)
    assert float(bound[0, 0]) < 20.0
    clipped = torch.maximum(torch.minimum(w, bound.repeat_interleave(32, 1)[:, :80]), -bound.repeat_interleave(32, 1)[:, :80])
    err = lambda v: float(((x @ fake_quantize_spec(v, *dynamic_qparams(v, spec), spec).t() - x @ w.t()) ** 2).mean())  # noqa: E731
    assert err(clipped) <= err(w)


@pytest.mark.parametrize(("spec", "rows"), [
    (QuantSpec(bits=3, granularity="group", group_size=32), 256),  # groups narrower than the rows: Gram path
    (QuantSpec(bits=4, granularity="channel"), 40),  # a row of 80 wider than the 40 rows: per-row products
])
def test_clip_search_picks_each_groups_best_shrink_on_either_path(spec: QuantSpec, rows: int) -> None:
    """Against a brute force over the shrink grid, the bound found is each (output channel, group)'s
    least output error on the rows, whichever way the error is computed."""
    from compress.quantization.numerics.primitives import to_groups

    g = torch.Generator().manual_seed(4)
    x = torch.randn(rows, 80, generator=g) * (1 + 3 * torch.rand(80, generator=g))
    w = torch.randn(24, 80, generator=g) * 0.05
    w[::3, 7] = 0.6
    params = AWQParams(clip_tokens=16)
    bound = search_clip(x, w, spec, params)
    gs = 32 if spec.granularity == "group" else 80
    xt, wg = to_groups(x, gs), to_groups(w, gs)
    amax = wg.abs().amax(-1)

    def err(b: torch.Tensor) -> torch.Tensor:  # [out, G]
        cw = torch.maximum(torch.minimum(wg, b.unsqueeze(-1)), -b.unsqueeze(-1))
        sc, zp = dynamic_qparams(cw.reshape(-1, gs), QuantSpec(bits=spec.bits, granularity="channel"))
        q = fake_quantize_spec(cw.reshape(-1, gs), sc, zp, QuantSpec(bits=spec.bits, granularity="channel"))
        return ((torch.einsum("ngk,bgk->bng", xt, q.reshape(wg.shape) - wg)) ** 2).sum(1)

    best = torch.stack([err(amax * (1 - i / 20)) for i in range(10)]).amin(0)
    assert torch.all(err(bound) <= best * (1 + 1e-4) + 1e-9)
    assert bool((bound < amax).any())  # clipping pays off somewhere: the check is not of the unclipped max alone


def test_awq_then_gptq_keeps_awq_and_rounds_with_gptq() -> None:
    fp = _llama()
    data = _calib()
    a = compress.awq(copy.deepcopy(fp), data, scheme=W3, ignore=["lm_head"])
    ln = a.model.layers[0].input_layernorm.weight.detach().clone()
    both = compress.gptq(a, data, scheme=W3, ignore=["lm_head"])
    torch.testing.assert_close(both.model.layers[0].input_layernorm.weight, ln, atol=0, rtol=0)
    for m in both.modules():
        if isinstance(m, QuantLinear):
            assert m.weight_quantizer is not None
            torch.testing.assert_close(m.weight_quantizer(m.weight), m.weight, atol=0, rtol=0)
    w4 = QuantScheme(weights=QuantSpec(bits=4, granularity="channel"), inputs=None)
    with pytest.raises(CalibrationError, match="another weight spec"):
        compress.gptq(both, data, scheme=w4, ignore=["lm_head"])


def test_scale_search_reads_each_group_at_its_module_output() -> None:
    """q/k/v are judged on the attention block's output (through RoPE and the softmax), gate/up on
    the MLP's, down_proj on its own: AutoAWQ's module2inspect, found from the names, not a table."""
    from compress.quantization.algorithms.awq import awq_layer
    from compress.quantization.algorithms.sequential import sequential_quantize

    reports: list[dict[str, Any]] = []
    sequential_quantize(
        _llama(), _calib(), W3, lambda i, layer, lin, calls: reports.append(awq_layer(layer, lin, calls, AWQParams())),
        Selection(ignore=["lm_head"]), load=None, release=None, where="test",
    )
    got = {tuple(g["consumers"]): g.get("inspected") for g in reports[0]["groups"]}
    assert got == {
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"): "self_attn",
        ("self_attn.o_proj",): "self_attn.o_proj",  # GQA: folded into v_proj, scales tied
        ("mlp.gate_proj", "mlp.up_proj"): "mlp",
        ("mlp.down_proj",): "mlp.down_proj",
    }
    searched = [g for r in reports for g in r["groups"] if g["producer"] is not None]
    assert all(0 <= g["error"] <= g["unscaled_error"] for g in searched)  # s = 1 is always a candidate
    ratio = scale_error_ratio({"layers": reports})
    assert ratio is not None and 0 < ratio <= 1


def test_a_clip_is_kept_only_where_the_inspected_module_agrees() -> None:
    """The clip search judges each Linear alone; a clip that raises the attention output's error
    (here q_proj cut to a tenth of its range) is rejected, one that changes nothing is kept."""
    from compress.quantization.algorithms.awq import _guard_clips
    from compress.quantization.algorithms.awq_search import ModuleOutputError, clip_weight
    from compress.quantization.algorithms.sequential import sequential_quantize

    seen: list[set[str]] = []

    def process(i: int, layer: nn.Module, lin: dict[str, QuantLinear], calls: list[Any]) -> None:
        if i:
            return
        groups = find_fold_groups(layer, list(lin), calls[0])
        recorded: list[tuple[Any, Any, torch.Tensor]] = []
        h = layer.get_submodule("self_attn").register_forward_hook(
            lambda m, a, k, out: recorded.append((a, k, out[0].detach().float())), with_kwargs=True)
        with float_mode(layer), torch.no_grad():
            for a, k in calls:
                layer(*a, **k)
        h.remove()
        spec = lin["self_attn.q_proj"].weight_quantizer.spec  # type: ignore[union-attr]
        wq, wv = lin["self_attn.q_proj"].weight.detach(), lin["self_attn.v_proj"].weight.detach()
        harmful = clip_weight(wq, 0.1 * wq.abs().reshape(wq.shape[0], -1, 32).amax(-1), spec)
        harmless = clip_weight(wv, wv.abs().reshape(wv.shape[0], -1, 32).amax(-1), spec)
        qkv = [lin[f"self_attn.{p}_proj"] for p in "qkv"]
        assert torch.equal(harmless, wv)
        seen.append(_guard_clips(layer, groups, lin, {"self_attn.q_proj": harmful, "self_attn.v_proj": harmless},
                                 {"self_attn": ModuleOutputError(layer.get_submodule("self_attn"), qkv, recorded)}, {}))

    sequential_quantize(_llama(), _calib(), W3, process, Selection(ignore=["lm_head"]), load=None, release=None,
                        where="test")
    assert seen == [{"self_attn.q_proj"}]


def _awq_ddp_worker(rank: int, port: int, out: str) -> None:
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        g = torch.Generator().manual_seed(10 + rank)  # each rank calibrates on its own shard, of its own size
        shard = [torch.randint(0, 128, (2, 32), generator=g) for _ in range(3 - rank)]
        q = compress.awq(_llama(), shard, scheme=W3, ignore=["lm_head"])
        torch.save({n: p.detach() for n, p in q.state_dict().items() if n.endswith("weight")}, f"{out}/{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # 26 s alone: 2 gloo processes
def test_awq_ranks_choose_the_same_scales_and_clips(tmp_path: Any) -> None:
    """Under DDP every rank folds the same scales and keeps the same clips (the searches sum their
    errors over all ranks' tokens, in chunks sized alike on every rank whatever its token count),
    so the quantized models agree exactly; a rank alone would not."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_awq_ddp_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    w0, w1 = (torch.load(tmp_path / f"{r}.pt", weights_only=True) for r in range(2))
    assert w0.keys() == w1.keys()
    for n in w0:
        assert torch.equal(w0[n], w1[n]), n
    alone = compress.awq(_llama(), [torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(10))
                                    for _ in range(3)], scheme=W3, ignore=["lm_head"]).state_dict()
    assert any(not torch.equal(alone[n], w0[n]) for n in w0)  # the shards do differ


def test_awq_recipe_reports_what_the_scales_bought(tiny_llm_dir: str, tmp_path: Path) -> None:
    """The report's awq_groups table gives each group's module-output error with its scales and
    with s = 1 (judged alike), as the GPTQ table gives RTN's and GPTQ's; the stage metric is their
    median ratio, what a user reads to see whether AWQ's scales helped their model at all."""
    raw = {
        "version": 1, "model": {"hf_path": tiny_llm_dir},
        "data": {"source": "text_lm", "kwargs": {"tokenizer": tiny_llm_dir, "seq_len": 32, "samples": 8},
                 "calibration_samples": 8, "eval_samples": 8, "calibration_batch_size": 4, "eval_batch_size": 4},
        "train": {"metric": "perplexity"}, "export": {"enabled": False},
        "stages": [{"name": "awq", "modifiers": [{"type": "awq", "scheme": "w4_weight_only_g128", "ignore": ["lm_head"]}]}],
    }
    report = compress.apply(compress.load_recipe(raw), out_dir=tmp_path / "run", quiet=True)
    stage = report.stages[0]
    rows = [r for r in stage.tables["awq_groups"] if r["folded_into"] != "-"]
    assert rows and all(0 <= r["error"] <= r["unscaled_error"] for r in rows)
    ratios = sorted(r["error"] / r["unscaled_error"] for r in rows)
    assert stage.metrics["awq_scale_error_ratio"] == pytest.approx(ratios[(len(ratios) - 1) // 2], abs=1e-4)


def test_a_lone_linears_objective_is_read_from_its_gram_matrix_not_rerun() -> None:
    """o_proj's and down_proj's groups are judged on their own output: the same error as rerunning
    the Linear on the recorded tokens, read from ``X^T X`` once, so AWQ passes each calibration
    token through down_proj about once (the recording pass), not once per scale candidate."""
    from compress.quantization.algorithms.awq import awq_layer
    from compress.quantization.algorithms.awq_search import LinearOutputError, ModuleOutputError
    from compress.quantization.algorithms.sequential import sequential_quantize

    g = torch.Generator().manual_seed(5)
    lin = nn.Linear(48, 16)
    x = torch.randn(3, 20, 48, generator=g)
    with torch.no_grad():
        calls: list[tuple[Any, Any, torch.Tensor]] = [((x[i],), {}, lin(x[i])) for i in range(3)]
    rows = x.reshape(-1, 48)
    cand = [lin.weight.detach() + 0.05 * torch.randn(16, 48, generator=g)]
    rerun = ModuleOutputError(lin, [lin], calls)  # type: ignore[list-item]
    gram = LinearOutputError(lin.weight, rows.t() @ rows, rows.shape[0])
    torch.testing.assert_close(gram(cand), rerun(cand), rtol=1e-4, atol=0)
    assert gram.numel == rerun.numel

    alone: list[int] = []  # tokens down_proj saw when run by itself, not inside the MLP's forward
    in_mlp = [False]

    def process(i: int, layer: nn.Module, lins: dict[str, QuantLinear], calls: list[Any]) -> dict[str, Any]:
        mlp = layer.get_submodule("mlp")
        hs = [mlp.register_forward_pre_hook(lambda m, a: in_mlp.__setitem__(0, True)),
              mlp.register_forward_hook(lambda m, a, o: in_mlp.__setitem__(0, False)),
              lins["mlp.down_proj"].register_forward_pre_hook(
                  lambda m, a: None if in_mlp[0] else alone.append(a[0].shape[:-1].numel()))]
        try:
            return awq_layer(layer, lins, calls, AWQParams())
        finally:
            for h in hs:
                h.remove()

    reports: list[dict[str, Any]] = []

    def keep(i: int, layer: nn.Module, lins: dict[str, QuantLinear], calls: list[Any]) -> dict[str, Any]:
        reports.append(process(i, layer, lins, calls))
        return reports[-1]

    sequential_quantize(_llama(), _calib(), W3, keep, Selection(ignore=["lm_head"]), load=None, release=None,
                        where="test")
    assert sum(alone) == 0, sum(alone)
    down = [gr for r in reports for gr in r["groups"] if gr["consumers"] == ["mlp.down_proj"]]
    assert len(down) == 2 and all(0 <= gr["error"] <= gr["unscaled_error"] for gr in down)


def test_module_reruns_are_screened_to_the_best_candidates(monkeypatch: pytest.MonkeyPatch) -> None:
    """Judging a scale candidate at the attention's output reruns the attention (most of AWQ's
    time): the grid is screened by the Linears' own output error and only s = 1 and the best
    ``module_candidates - 1`` are rerun; here the screen keeps the full grid's winner."""
    from compress.quantization.algorithms.awq_search import ModuleOutputError

    model = _llama()
    layer = decoder_layers(model)[1][0]
    calls = capture_inputs(model, layer, _calib())
    attn = layer.get_submodule("self_attn")
    lins: list[Any] = [attn.get_submodule(f"{p}_proj") for p in "qkv"]
    recorded: list[tuple[Any, Any, torch.Tensor]] = []
    xs: list[torch.Tensor] = []
    hs = [attn.register_forward_hook(lambda m, a, k, o: recorded.append((a, k, o[0].detach())), with_kwargs=True),
          lins[0].register_forward_pre_hook(lambda m, a: xs.append(a[0].reshape(-1, a[0].shape[-1])))]
    with torch.no_grad():
        for a, k in calls:
            layer(*a, **k)
    for h in hs:
        h.remove()
    reruns = [0]
    call = ModuleOutputError.__call__

    def counted(self: ModuleOutputError, w: Any) -> torch.Tensor:
        reruns[0] += 1
        return call(self, w)

    monkeypatch.setattr(ModuleOutputError, "__call__", counted)
    spec = W3.weights
    assert spec is not None
    picks: dict[int, Any] = {}
    for top in (0, 6):
        reruns[0] = 0
        with torch.no_grad():
            picks[top] = search_scales(torch.cat(xs), [m.weight for m in lins], spec, AWQParams(module_candidates=top),
                                     output_error=ModuleOutputError(attn, lins, recorded))
        assert reruns[0] == (21 if top == 0 else 6)
    assert picks[6].alpha == picks[0].alpha and picks[6].error == pytest.approx(picks[0].error)
    assert picks[6].error < picks[6].unscaled_error


def test_rows_sampled_from_chunks_are_those_sampled_from_their_concatenation() -> None:
    from compress.quantization.algorithms.awq_search import sample_chunks, sample_rows

    g = torch.Generator().manual_seed(0)
    chunks = [torch.randn(n, 8, generator=g) for n in (5, 17, 9)]
    assert torch.equal(sample_chunks(chunks, 12, 3), sample_rows(torch.cat(chunks), 12, 3))
    assert torch.equal(sample_chunks(chunks, 40, 3), torch.cat(chunks))
