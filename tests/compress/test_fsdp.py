"""FSDP2 (``distributed.strategy: fsdp``): sharding per block found from the model, QAT and
distillation trained sharded, consolidation back to the plain model, sharded DCP checkpoints resumed
on another number of ranks, and a rank killed in a two-"node" torchrun launch."""

from __future__ import annotations

import copy
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml
from torch import nn

import compress
from benchmarks.fsdp import STAGE_KILLER  # rank 1 dies right after the stage's first checkpoint
from compress.core.errors import CompressError, RecipeError
from compress.distributed import (
    DistributedSpec,
    consolidate,
    find_blocks,
    is_sharded,
    load_sharded,
    save_sharded,
    shard,
)

ROOT = Path(__file__).resolve().parents[2]


def _llama(layers: int = 2) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- one process ----------------------------------------------------------------------------------


def test_blocks_are_the_largest_module_lists_children() -> None:
    from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel

    assert [n for n, _ in find_blocks(_llama(3))] == ["model.layers.0", "model.layers.1", "model.layers.2"]
    bert = BertModel(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64))
    assert [n for n, _ in find_blocks(bert)] == ["encoder.layer.0", "encoder.layer.1"]
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64))
    assert [n for n, _ in find_blocks(gpt2)] == ["transformer.h.0", "transformer.h.1"]
    assert find_blocks(nn.Sequential(nn.Linear(4, 4), nn.ReLU())) == []  # the root alone is then the unit


def test_distributed_section_is_checked_in_one_line() -> None:
    base = {"version": 1, "model": {"name": "mlp"}}
    with pytest.raises(RecipeError, match=r"distributed\.strategy: invalid value 'zero3'; valid: ddp, fsdp$"):
        compress.load_recipe({**base, "distributed": {"strategy": "zero3"}})
    with pytest.raises(RecipeError, match=r"distributed\.offload: unknown field 'offload'; .*did you mean 'cpu_offload'"):
        compress.load_recipe({**base, "distributed": {"offload": True}})
    r = compress.load_recipe({**base, "distributed": {"strategy": "fsdp", "cpu_offload": True},
                              "train": {"device": "cpu"}})
    from compress.preflight import check_recipe

    check_recipe(r)  # offload while training on the CPU runs (the same recipe as on GPUs): _gpt2_matches_ddp
    with pytest.raises(RecipeError, match=r"distributed\.cpu_offload: offloads FSDP's sharded state"):
        check_recipe(compress.load_recipe({**base, "distributed": {"cpu_offload": True}}))
    with pytest.raises(RecipeError, match=r"Session\(distributed=\.\.\.\): strategy"):
        compress.Session(base, nn.Linear(2, 2), distributed={"strategy": "zero3"})
    with pytest.raises(CompressError, match="strategy 'fsdp' shards over the ranks of a torchrun launch"):
        shard(nn.Linear(2, 2), DistributedSpec(strategy="fsdp"), device=torch.device("cpu"))


def test_an_interrupted_sharded_checkpoint_is_a_temp_file() -> None:
    from compress.run_folder import is_temp

    assert is_temp(Path("checkpoints/baseline_last.dcp.tmp/__1_0.distcp"))
    assert is_temp(Path("checkpoints/baseline_last.dcp.old/.metadata"))
    assert not is_temp(Path("checkpoints/baseline_last.dcp/__1_0.distcp"))


def test_a_sharded_checkpoint_keeps_the_lr_schedule_and_pickles_nothing(tmp_path: Path) -> None:
    """The optimizer's groups come back whole (an LR scheduler's initial_lr too: without it a resumed
    schedule restarts from the decayed lr), from extra.pt read weights-only; the shards hold tensors only."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from compress.recipe import TrainSpec
    from compress.training import build_optimizer, build_schedule

    spec = TrainSpec(optimizer="adamw", lr=1e-3, epochs=2)
    m = _llama()
    opt = build_optimizer(m, spec)
    sched = build_schedule(opt, spec, total_steps=6, steps_per_epoch=3)
    x = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        m(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    save_sharded(tmp_path / "ckpt", m, opt, 1)
    meta = FileSystemReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata
    assert not [k for k, v in meta.items() if isinstance(v, BytesStorageMetadata)]
    fresh = _llama()
    fresh_opt = build_optimizer(fresh, spec)
    assert load_sharded(tmp_path / "ckpt", fresh, fresh_opt) == 1
    want, got = opt.state_dict(), fresh_opt.state_dict()
    assert got["param_groups"] == want["param_groups"] and "initial_lr" in got["param_groups"][0]
    for i, st in want["state"].items():
        for k, v in st.items():
            assert torch.equal(v, got["state"][i][k]), (i, k)


# ---- two processes (gloo) -------------------------------------------------------------------------


def _prepared(seed: int = 5) -> tuple[nn.Module, torch.Tensor]:
    """A tiny Llama with QAT fake quantizers (w8a8, LSQ scales) calibrated on one batch."""
    from compress.quantization import PrepareParams, calibrate, prepare, quantizers

    m = _llama()
    x = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(seed))
    prepare(m, "w8a8", PrepareParams(ignore=["lm_head"]), example_inputs=(x,))
    calibrate(m, [x])
    for _, q in quantizers(m):
        if not q.spec.dynamic:
            q.enable_lsq()
    return m, x


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        res: dict[str, Any] = {}
        m, _ = _prepared()
        ddp_model = copy.deepcopy(m)
        fsdp_opt = torch.optim.SGD(m.parameters(), lr=0.1)
        ddp_opt = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
        full_numel = sum(p.numel() for p in m.parameters())
        blocks = shard(m, DistributedSpec(strategy="fsdp"), device=torch.device("cpu"), optimizer=fsdp_opt)
        res["blocks"] = blocks
        res["local_fraction"] = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                                    for p in m.parameters()) / full_numel
        # the weight fake-quantizer of a sharded layer sees the whole weight in forward
        seen: list[tuple[int, ...]] = []
        wq = m.model.layers[0].mlp.down_proj.weight_quantizer
        h = wq.register_forward_pre_hook(lambda _m, a: seen.append(tuple(a[0].shape)))
        ddp = nn.parallel.DistributedDataParallel(ddp_model)
        x = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(100 + rank))
        for model, opt in ((m, fsdp_opt), (ddp, ddp_opt)):
            loss = model(input_ids=x, labels=x).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
        h.remove()
        res["seen"] = seen[0]
        res["grad_shard_sync"] = _scalar_grads_agree(m)
        # sharded checkpoint of the sharded state (each rank its shards), then back to the plain model
        save_sharded(Path(out) / "ckpt", m, fsdp_opt, 7)
        consolidate(m, optimizer=fsdp_opt)
        res["plain"] = type(m).__name__ == "LlamaForCausalLM" and not is_sharded(m)
        res["tied"] = m.lm_head.weight is m.model.embed_tokens.weight
        ref = dict(ddp_model.named_parameters())
        res["max_diff_vs_ddp"] = max(float((p.detach() - ref[n].detach()).abs().max()) for n, p in m.named_parameters())
        copy.deepcopy(m)  # an FSDP module refuses deepcopy: the plain model again does not
        # shard again, the optimizer state moves with the parameters, and consolidate once more
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        same = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(3))  # unsharded: same data
        loss = m(input_ids=same, labels=same).loss
        loss.backward()
        opt.step()
        shard(m, DistributedSpec(strategy="fsdp"), device=torch.device("cpu"), optimizer=opt)
        loss = m(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        consolidate(m, optimizer=opt)
        res["adam_state_plain"] = all(not hasattr(v, "to_local") for st in opt.state.values() for v in st.values())
        res["adam_state_params"] = {id(p) for p in opt.state} <= {id(p) for p in m.parameters()}
        res["state"] = {k: v for k, v in m.state_dict().items() if isinstance(v, torch.Tensor)}
        # the same checkpoint loaded on these 2 ranks into a fresh plain model
        fresh, _ = _prepared()
        fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1)
        res["epoch"] = load_sharded(Path(out) / "ckpt", fresh, fresh_opt)
        res["loaded_diff"] = max(float((p.detach() - ref[n].detach()).abs().max()) for n, p in fresh.named_parameters())
        res["ddp_step"] = {n: p.detach().clone() for n, p in ddp_model.named_parameters()}
        # bf16 compute: the forward runs in bfloat16, the parameters and their state stay float32
        mixed, _ = _prepared()
        mopt = torch.optim.AdamW(mixed.parameters(), lr=1e-3)
        shard(mixed, DistributedSpec(strategy="fsdp", mixed_precision="bf16"), device=torch.device("cpu"),
              optimizer=mopt)
        logits = mixed(input_ids=x).logits
        torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), x[:, 1:].flatten()).backward()
        mopt.step()
        consolidate(mixed, optimizer=mopt)
        res["bf16"] = (logits.dtype, {p.dtype for p in mixed.parameters()},
                       all(bool(torch.isfinite(p).all()) for p in mixed.parameters()))
        res["lsq_grads"] = _lsq_scale_grads(rank)
        res["ddp_stage_checkpoint"] = _ddp_stage_checkpoint(rank, Path(out))
        res["speed_check"] = _speed_check_on_ranks(rank)
        res["gpt2"] = _gpt2_matches_ddp(rank)
        res["gpt2_offload"] = _gpt2_matches_ddp(rank, cpu_offload=True)
        res["distill"] = _distill_sharded(rank)
        torch.save(res, Path(out) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _speed_check_on_ranks(rank: int) -> tuple[bool, bool]:
    """PTQ's speed_check under torchrun: rank 0 alone times the kernels (here: says down_proj of layer 0
    is slower in int8) and every rank keeps the same layers float."""
    import compress.quantization.preparation as qp
    from compress.quantization import PrepareParams, prepare
    from compress.quantization.numerics.modules import QuantLinear
    from compress.quantization.placement.speed_check import SpeedCheck

    def measure(*_: Any, **__: Any) -> dict[str, str]:
        if rank != 0:
            raise AssertionError("only rank 0 times")
        return {"model.layers.0.mlp.down_proj": "int8 slower (rank 0's timing)"}

    saved, qp._measure = qp._measure, measure
    try:
        m = _llama()
        x = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(5))
        prepare(m, "w8a8", PrepareParams(ignore=["lm_head"], speed_check=SpeedCheck()), example_inputs=(x,))
    finally:
        qp._measure = saved
    return (not isinstance(m.model.layers[0].mlp.down_proj, QuantLinear),
            isinstance(m.model.layers[1].mlp.down_proj, QuantLinear))


def _ddp_stage_checkpoint(rank: int, out: Path) -> dict[str, bool]:
    """A QAT stage's mid-stage checkpoint under DDP: rank 0 writes ``stage_last.pt`` holding every
    rank's observer statistics (each rank observed its own batch); each rank reads its own back into
    a fresh session, with the model's and the optimizer's state."""
    from compress.checkpoints import find_stage, load_stage, save_stage
    from compress.training import Dist

    recipe = {"version": 1, "model": {"name": "mlp"}, "stages": [{"name": "qat", "epochs": 2, "modifiers": [
        {"type": "qat", "scheme": "w8a8", "ignore": ["lm_head"], "num_batches": 1}]}]}
    calib = [torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))]
    x = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(20 + rank))
    model = _llama()
    with compress.Session(recipe, model, calibration_data=calib) as s:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        s.optimizer = opt
        ddp = nn.parallel.DistributedDataParallel(model)
        ddp(input_ids=x, labels=x).loss.backward()
        opt.step()
        s.step()
        s.epoch_end()
        save_stage(out, s, model, opt, 1, ranks=Dist(rank, 2), report_stages=[])
        dist.barrier()  # rank 0 wrote it
        before, _ = s.progress()
        # the parameters (the observing quantizers' scales are recomputed from each rank's own
        # statistics at every forward: rank 0's copy in the file is never used before that)
        want_sd, want_opt = {n: p.detach().clone() for n, p in model.named_parameters()}, opt.state_dict()
        mine = _observer_stats(model)
    fresh = _llama()
    point = find_stage(out)
    assert point is not None and point.path.name == "stage_last.pt"
    s2 = compress.Session(recipe, fresh, calibration_data=calib)
    s2.resume(point.progress["session"])
    with s2:
        opt2 = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
        s2.optimizer = opt2
        load_stage(point, s2, fresh, opt2, rank=rank)
        after, _ = s2.progress()
        got_sd, got_opt = dict(fresh.named_parameters()), opt2.state_dict()
        got = _observer_stats(fresh)
    other = [None, None]
    dist.all_gather_object(other, mine)
    return {
        "own_statistics": got.keys() == mine.keys() and all(torch.equal(got[k], mine[k]) for k in mine),
        "ranks_differed": any(not torch.equal(other[0][k], other[1][k]) for k in mine),
        "model": want_sd.keys() == got_sd.keys() and all(torch.equal(v, got_sd[k]) for k, v in want_sd.items()),
        "optimizer": all(torch.equal(v, got_opt["state"][i][k]) for i, st in want_opt["state"].items()
                         for k, v in st.items()),
        "counters": (after["epochs_done"], after["step"], after["modifiers"]) == (
            before["epochs_done"], before["step"], before["modifiers"]),
    }


def _observer_stats(model: nn.Module) -> dict[str, torch.Tensor]:
    from compress.quantization import quantizers

    return {f"{n}.{a}": v.clone() for n, q in quantizers(model) if q.observer is not None
            for a, v in vars(q.observer).items() if isinstance(v, torch.Tensor) and q.role != "weight"}


def _lsq_scale_grads(rank: int | None) -> dict[str, torch.Tensor]:
    """The LSQ scales' gradients of one loss on a batch of 4: in one process (``rank`` None) on all
    of it; under DDP on this rank's half (DDP averages the ranks' gradients)."""
    m, _ = _prepared()
    x = torch.randint(0, 96, (4, 8), generator=torch.Generator().manual_seed(11))
    model: nn.Module = m
    if rank is not None:
        x = x[2 * rank: 2 * rank + 2]
        model = nn.parallel.DistributedDataParallel(m)
    model(input_ids=x, labels=x).loss.backward()
    return {n: p.grad.clone() for n, p in m.named_parameters() if n.endswith(".scale") and p.grad is not None}


def _gpt2_matches_ddp(rank: int, *, cpu_offload: bool = False) -> tuple[str, bool, float]:
    """Another architecture (GPT-2: Conv1D layers in ``transformer.h``, tied head): one sharded step
    equals one DDP step, and the plain model comes back. ``cpu_offload``: FSDP2's CPUOffloadPolicy
    on this CPU (gloo), which its default pinned memory would refuse without an accelerator."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    m = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=16,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))  # no dropout: comparable steps
    ref = copy.deepcopy(m)
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
    opt, ref_opt = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    shard(m, DistributedSpec(strategy="fsdp", cpu_offload=cpu_offload), device=torch.device("cpu"), optimizer=opt)
    for model, o in ((m, opt), (nn.parallel.DistributedDataParallel(ref), ref_opt)):
        model(input_ids=x, labels=x).loss.backward()
        o.step()
    consolidate(m, optimizer=opt)
    want = dict(ref.named_parameters())
    diff = max(float((p.detach() - want[n].detach()).abs().max()) for n, p in m.named_parameters())
    return type(m).__name__, m.lm_head.weight is m.transformer.wte.weight, diff


def _scalar_grads_agree(m: nn.Module) -> bool:
    """0-dim (per-tensor LSQ) scales stay replicated: their averaged gradients agree across ranks."""
    g = torch.stack([p.grad for p in m.parameters() if p.dim() == 0 and p.grad is not None])
    other = g.clone()
    dist.broadcast(other, src=0)
    return bool(torch.equal(g, other)) and g.numel() > 0


def _distill_sharded(rank: int) -> dict[str, Any]:
    """The Session API: a QAT + distillation stage (teacher 'self') under FSDP2, teacher sharded too."""
    recipe = {"version": 1, "model": {"name": "mlp"}, "data": {"calibration_samples": 4},
              "distributed": {"strategy": "fsdp"},
              "stages": [{"name": "qat_kd", "steps": 2, "modifiers": [
                  {"type": "qat", "scheme": "w8a8", "ignore": ["lm_head"], "num_batches": 1},
                  {"type": "distill", "losses": [{"type": "kd", "temperature": 1.0}], "eval_batches": 0}]}]}
    model = _llama()
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, 96, (2, 8), generator=g) for _ in range(2)]
    teacher_sharded: list[bool] = []
    with compress.Session(recipe, model, calibration_data=batches[:1], example_inputs=batches[0]) as s:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        s.optimizer = opt
        train = s.distribute()
        for x in batches:
            out = train(input_ids=x)
            loss = s.loss(torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), x[:, 1:].flatten()),
                          inputs=x, outputs=out)
            opt.zero_grad()
            loss.backward()
            opt.step()
            teacher_sharded.append(all(is_sharded(c) for c in s.state.companions) and bool(s.state.companions))
            # after its forward the teacher holds its shards only (its root's weights freed too)
            t = s.state.companions[0]
            local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in t.parameters())
            teacher_sharded.append(local / sum(p.numel() for p in t.parameters()) < 0.55)
            s.step()
    return {"teacher_sharded": teacher_sharded, "plain_after": not is_sharded(model),
            "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters())}


@pytest.mark.slow  # 36 s in a full run: 2 FSDP2 processes
def test_fsdp2_qat_and_distillation_two_processes(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert r0["blocks"] == ["model.layers.0", "model.layers.1"]
    assert r0["local_fraction"] < 0.55  # each rank holds about half of every tensor
    assert r0["seen"] == (32, 64) == r1["seen"]  # the full down_proj weight, not a [16, 64] shard
    assert r0["grad_shard_sync"] and r1["grad_shard_sync"]
    assert r0["plain"] and r0["tied"]
    # one SGD step sharded equals one step under DDP (same data per rank, gradients averaged)
    assert r0["max_diff_vs_ddp"] < 1e-5 and r1["max_diff_vs_ddp"] < 1e-5
    assert r0["adam_state_plain"] and r0["adam_state_params"]
    for k, v in r0["state"].items():  # consolidated: every rank holds the same full weights
        assert torch.equal(v, r1["state"][k]), k
    assert r0["epoch"] == 7 and r0["loaded_diff"] < 1e-5 and r1["loaded_diff"] < 1e-5
    assert r0["bf16"] == (torch.bfloat16, {torch.float32}, True)
    name, tied, diff = r0["gpt2"]
    assert name == "GPT2LMHeadModel" and tied and diff < 1e-5, r0["gpt2"]
    name, tied, diff = r0["gpt2_offload"]
    assert name == "GPT2LMHeadModel" and tied and diff < 1e-5, r0["gpt2_offload"]
    assert r0["distill"] == {"teacher_sharded": [True] * 4, "plain_after": True, "finite": True}
    assert r0["speed_check"] == (True, True) == r1["speed_check"]
    want = {"own_statistics": True, "ranks_differed": True, "model": True, "optimizer": True, "counters": True}
    assert r0["ddp_stage_checkpoint"] == want == r1["ddp_stage_checkpoint"], (r0["ddp_stage_checkpoint"],
                                                                              r1["ddp_stage_checkpoint"])
    # LSQ: two ranks on the halves of a batch give the scales the gradients one process gives them on
    # the whole batch (an activation scale's gradient scale 1/sqrt(N Qp) counts the global batch)
    one = _lsq_scale_grads(None)
    assert set(one) == set(r0["lsq_grads"]) and any(".a" in n or "input_quantizer" in n for n in one), sorted(one)
    # gradients that are zero but for rounding (a rotary table's scale: 1e-14) are compared to the largest
    floor = 1e-5 * max(float(g.norm()) for g in one.values())
    for n, g in one.items():
        diff = float((r0["lsq_grads"][n] - g).norm())
        assert diff <= 1e-3 * float(g.norm()) + floor, (n, diff, float(g.norm()))
    # DCP resharding: the checkpoint the 2 ranks wrote loads in one process, no process group
    fresh, _ = _prepared()
    assert load_sharded(tmp_path / "ckpt", fresh, torch.optim.SGD(fresh.parameters(), lr=0.1)) == 7
    for n, p in fresh.named_parameters():
        assert float((p.detach() - r0["ddp_step"][n]).abs().max()) < 1e-5, n


# ---- compress apply under torchrun: two "nodes", a rank killed, resumed on 2 ranks and on 1 -------

# rank 1 SIGKILLs itself right after the epoch-1 sharded checkpoint, inside epoch 2
_DRIVER = """
import os, signal, sys
import compress.distributed as d
save = d.save_sharded
def save_then_die(path, model, opt, epoch):
    save(path, model, opt, epoch)
    if os.environ.get("RANK") == "1" and epoch == 1:
        os.kill(os.getpid(), signal.SIGKILL)
d.save_sharded = save_then_die
from compress.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _tiny_llm_recipe(tmp: Path, **fields: Any) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from compress.data.lm import iter_texts, split_files, train_tokenizer

    llm = tmp / "llm"
    tok = train_tokenizer(iter_texts(split_files(0)["train"][:4]), vocab_size=256)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 tie_word_embeddings=True)).save_pretrained(llm)
    tok.save_pretrained(llm)
    recipe = {
        "version": 1, "name": "fsdp_llm", "model": {"hf_path": str(llm)},
        "data": {"source": "text_lm", "kwargs": {"tokenizer": str(llm), "seq_len": 16, "samples": 48},
                 "calibration_samples": 4, "calibration_batch_size": 4, "eval_batch_size": 8, "eval_samples": 8},
        "train": {"epochs": 3, "metric": "perplexity", "batch_size": 8, "optimizer": "adamw", "lr": 0.001,
                  "device": "cpu"},
        "distributed": {"strategy": "fsdp", "timeout_s": 60},
        "stages": [{"name": "qat", "epochs": 1, "modifiers": [
            {"type": "qat", "scheme": "w8a8", "ignore": ["lm_head"], "lsq": True, "num_batches": 1}]}],
        "export": {"enabled": False}, "validate": {"enabled": False},
    }
    recipe.update(fields)
    path = tmp / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.mark.slow  # 43 s in a full run: multi-process runs, killed and resumed
def test_killed_rank_two_nodes_then_resume_on_two_ranks_and_on_one(tmp_path: Path) -> None:
    recipe = _tiny_llm_recipe(tmp_path)
    driver = tmp_path / "driver.py"
    driver.write_text(_DRIVER)
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    port = _free_port()
    # the multi-node command of docs/distributed.md, as two nodes of one process each on this machine.
    # Node 0 hosts the rendezvous store, as the node the endpoint names does on real machines: here
    # both match the endpoint's host, and whichever bound first hosted it, so the killed rank's node
    # could take the store down with it and the survivor's agent stop rank 0 before it said anything
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", f"--node-rank={n}",
         "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=fsdp-test",
         f"--rdzv-conf=is_host={int(n == 0)}",
         str(driver), "apply", str(recipe), "--out", str(out)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in (0, 1)]
    t0 = time.monotonic()
    results = [p.communicate(timeout=240) for p in nodes]
    assert all(p.returncode != 0 for p in nodes), [r[1][-2000:] for r in results]
    stderr = "".join(r[1] for r in results)
    lines = [ln for ln in stderr.splitlines() if ln.startswith("compress: error: rank 0: lost the other ranks")]
    assert len(lines) == 1, stderr[-3000:]
    assert time.monotonic() - t0 < 200
    # never taken for complete: no report, or one that says the run failed
    report = out / "report.json"
    assert not report.exists() or json.loads(report.read_text())["error"]
    dcp = out / "checkpoints" / "baseline_last.dcp"
    assert sorted(p.name for p in dcp.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "extra.pt"]
    marker = json.loads((out / ".compress-run.json").read_text())
    assert {"checkpoints/baseline_last.dcp/.metadata", "checkpoints/baseline_last.dcp/__1_0.distcp"} <= set(
        marker["files"]), marker

    one = tmp_path / "run_one_rank"
    shutil.copytree(out, one)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
         f"--master-port={_free_port()}", "-m", "compress.cli", "apply", str(recipe), "--out", str(out), "--resume"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed baseline training at epoch 1 from baseline_last.dcp (2 rank(s))" in (out / "run.log").read_text()
    two_ranks = json.loads(report.read_text())
    assert two_ranks["error"] is None
    # the same checkpoint on one rank (DCP reshards the two ranks' shards)
    rep = compress.apply(recipe, out_dir=one, resume=True, quiet=True)
    assert rep.error is None
    assert "resumed baseline training at epoch 1 from baseline_last.dcp (1 rank(s))" in (one / "run.log").read_text()
    # one rank wrote plain checkpoints from there on: the older sharded one is gone, never resumed from again
    assert (one / "checkpoints" / "baseline_last.pt").is_file()
    assert not (one / "checkpoints" / "baseline_last.dcp").exists()
    w2 = torch.load(out / "checkpoints" / "baseline.pt", weights_only=True)["model"]
    w1 = torch.load(one / "checkpoints" / "baseline.pt", weights_only=True)["model"]
    for k in w1:  # the same global batch from the same epoch-1 state: the same training, up to rounding
        rel = float((w1[k] - w2[k]).norm() / w1[k].norm().clamp_min(1e-12))
        assert rel < 0.02, (k, rel)
    assert abs(rep.baseline.accuracy - two_ranks["baseline"]["accuracy"]) < 0.05 * two_ranks["baseline"]["accuracy"]


@pytest.mark.slow  # 27 s in a full run: 2 FSDP2 processes
def test_pruning_schedule_with_kd_trains_sharded_between_its_steps(tmp_path: Path) -> None:
    """Minitron-style width pruning in two steps a training epoch apart, recovered by KD from the
    unpruned model: each step cuts the gathered (plain) model, the next epoch shards the narrower one."""
    recipe = _tiny_llm_recipe(tmp_path, train={"epochs": 0, "metric": "perplexity", "batch_size": 8,
                                               "optimizer": "adamw", "lr": 0.001, "device": "cpu"},
                              stages=[{"name": "prune_kd", "epochs": 2, "modifiers": [
                                  {"type": "prune", "budget": {"params": 0.8}, "importance": "activation",
                                   "num_batches": 1, "steps": 2},
                                  {"type": "distill", "task_weight": 0.0, "eval_batches": 0,
                                   "losses": [{"type": "kd", "temperature": 1.0}]}]}])
    out = tmp_path / "fsdp"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
         f"--master-port={_free_port()}", "-m", "compress.cli", "apply", str(recipe), "--out", str(out)],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (out / "run.log").read_text()
    # student and teacher sharded in each of the 2 epochs, the second time after the second cut
    assert log.count("FSDP2: sharded over 2 ranks") == 4, log
    assert log.index("step 2/2") < log.rindex("FSDP2: sharded")
    sharded = json.loads((out / "report.json").read_text())
    single = compress.apply(recipe, out_dir=tmp_path / "single", quiet=True)
    assert sharded["final"]["params"] == single.final.params < single.baseline.params
    assert single.final.accuracy is not None
    assert abs(sharded["final"]["accuracy"] - single.final.accuracy) < 0.02 * single.final.accuracy


def _hang_worker(rank: int, port: int, out: str) -> None:
    from compress.cli import _lost_peers
    from compress.training import init_distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    init_distributed(torch.device("cpu"), DistributedSpec(timeout_s=1))
    if rank == 1:  # hangs: never joins the collective, never exits before its peer gave up
        time.sleep(5)
        return
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
        line = "no error"
    except Exception as exc:  # what the CLI prints for it
        line = str(_lost_peers(exc))
    Path(out, "hang.json").write_text(json.dumps({"seconds": time.monotonic() - t0, "line": line}))
    # the test needs only this line: leave without tearing down the group whose collective timed out
    # (at interpreter exit gloo may abort on it while the hung peer is still there)
    os._exit(0)


def test_a_hung_rank_fails_the_others_after_the_timeout(tmp_path: Path) -> None:
    mp.spawn(_hang_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    got = json.loads((tmp_path / "hang.json").read_text())
    # the collective gave up at the timeout, not when the hung rank finally went away
    assert "Timed out" in got["line"] and got["seconds"] < 4, got
    assert got["line"].startswith("rank 0: lost the other ranks (one died, or hung past distributed.timeout_s)"), got


def _slow_export_worker(rank: int, port: int, out: str) -> None:
    from compress.report import Report
    from compress.runner import _share_report
    from compress.training import init_distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    d = init_distributed(torch.device("cpu"), DistributedSpec(timeout_s=1))
    try:
        if rank == 0:
            time.sleep(3)  # rank 0 exports and validates for longer than distributed.timeout_s
        got = _share_report(Report(recipe={"rank": rank}), group=d.wait_group)
        Path(out, f"share{rank}.json").write_text(json.dumps(got.recipe))
    finally:
        dist.destroy_process_group()


def test_the_other_ranks_wait_out_rank_0s_export_past_the_timeout(tmp_path: Path) -> None:
    mp.spawn(_slow_export_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    assert json.loads((tmp_path / "share1.json").read_text()) == {"rank": 0}


# ---- mid-stage resume of a QAT + KD stage --------------------------------------------------------


def _qat_kd_recipe(tmp: Path, *, lsq: bool, prune_first: bool = False) -> Path:
    """No baseline training; one 2-epoch stage of w8a8 QAT (EMA observers, or LSQ scales) + KD from the
    model before it (``prune_first``: after a one-shot pruning stage)."""
    prune = [{"name": "prune", "modifiers": [{"type": "prune", "budget": {"params": 0.8}, "importance": "l2"}]}]
    return _tiny_llm_recipe(
        tmp, train={"epochs": 0, "metric": "perplexity", "batch_size": 8, "optimizer": "adamw", "lr": 0.001,
                    "device": "cpu"},
        stages=[*(prune if prune_first else []), {"name": "qat_kd", "epochs": 2, "modifiers": [
            {"type": "qat", "scheme": "w8a8", "ignore": ["lm_head"], "lsq": lsq, "num_batches": 1},
            {"type": "distill", "eval_batches": 0, "losses": [{"type": "kd", "temperature": 2.0}]}]}])


def _final(run: Path) -> dict[str, torch.Tensor]:
    sd = torch.load(run / "checkpoints" / "final.pt", weights_only=True)["model"]
    return {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}


def _resumed_epochs(run: Path) -> list[str]:
    """The epochs a run's attempts trained, in order, and where an attempt resumed."""
    return [ln.split("INFO ")[-1] for ln in (run / "run.log").read_text().splitlines()
            if "qat_kd epoch" in ln or "resumed stage" in ln]


def test_a_killed_qat_kd_stage_resumes_at_its_epoch_in_one_process(tmp_path: Path, monkeypatch: Any) -> None:
    """One process: the stage's state at the end of epoch 1 (LSQ scales and their AdamW state, the
    teacher, the observers' flags; the pruning stage before it as data) is saved, and the resumed run
    ends bit-equal to an uninterrupted one, its final.pt restorable like any."""
    import compress.checkpoints as ck
    from compress.state import restore_compressed

    recipe = _qat_kd_recipe(tmp_path, lsq=True, prune_first=True)
    whole = compress.apply(recipe, out_dir=tmp_path / "whole", quiet=True)
    save = ck.save_stage

    def save_then_fail(*args: Any, **kwargs: Any) -> None:
        save(*args, **kwargs)
        raise RuntimeError("killed after the epoch-1 checkpoint")

    monkeypatch.setattr(ck, "save_stage", save_then_fail)
    with pytest.raises(RuntimeError, match="killed"):
        compress.apply(recipe, out_dir=tmp_path / "run", quiet=True)
    monkeypatch.setattr(ck, "save_stage", save)
    rep = compress.apply(recipe, out_dir=tmp_path / "run", quiet=True, resume=True)
    assert _resumed_epochs(tmp_path / "run") == [
        "compress.training: qat_kd epoch 1/2" + _resumed_epochs(tmp_path / "run")[0].split("epoch 1/2")[1],
        "compress.runner: resumed stage 'qat_kd' at epoch 1 from stage_last.pt (1 rank(s))",
        "compress.training: qat_kd epoch 2/2" + _resumed_epochs(tmp_path / "run")[2].split("epoch 2/2")[1],
    ]
    want, got = _final(tmp_path / "whole"), _final(tmp_path / "run")
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    assert rep.final.accuracy == whole.final.accuracy
    assert [s.name for s in rep.stages] == ["prune", "qat_kd"]
    assert rep.stages[0].model.params == whole.stages[0].model.params < whole.baseline.params
    from transformers import AutoModelForCausalLM

    restored = restore_compressed(lambda: AutoModelForCausalLM.from_pretrained(tmp_path / "llm"),
                                  tmp_path / "run" / "checkpoints" / "final.pt")
    for k, v in restored.state_dict().items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, want[k]), k


def test_a_pruning_schedule_stage_is_not_checkpointed_mid_way(tmp_path: Path) -> None:
    """Its steps reshape the model between epochs, which the stage's checkpoint would not rebuild:
    such a stage resumes from its start."""
    recipe = _tiny_llm_recipe(tmp_path, train={"epochs": 0, "metric": "perplexity", "batch_size": 8,
                                               "optimizer": "adamw", "lr": 0.001, "device": "cpu"},
                              stages=[{"name": "prune", "epochs": 2, "modifiers": [
                                  {"type": "prune", "budget": {"params": 0.8}, "importance": "l2", "steps": 2}]}])
    compress.apply(recipe, out_dir=tmp_path / "run", quiet=True)
    assert not (tmp_path / "run" / "checkpoints" / "stage_last.pt").exists()


def test_a_killed_fsdp_qat_kd_stage_resumes_on_two_ranks_and_on_one(tmp_path: Path) -> None:
    recipe = _qat_kd_recipe(tmp_path, lsq=False)
    driver = tmp_path / "driver.py"
    driver.write_text(STAGE_KILLER)
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}

    def torchrun(*program: str, resume: bool = False) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
             f"--master-port={_free_port()}", *program, "apply", str(recipe), "--out", str(out),
             *(["--resume"] if resume else [])],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)

    killed = torchrun(str(driver))
    assert killed.returncode != 0, killed.stderr[-3000:]
    ckpt = out / "checkpoints" / "stage_last.dcp"
    assert sorted(p.name for p in ckpt.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "extra.pt"]
    marker = json.loads((out / ".compress-run.json").read_text())
    assert "checkpoints/stage_last.dcp/extra.pt" in marker["files"], marker
    one = tmp_path / "run_one_rank"
    shutil.copytree(out, one)

    resumed = torchrun("-m", "compress.cli", resume=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    lines = _resumed_epochs(out)
    assert [ln.split(":", 1)[1].split(" (")[0].strip() for ln in lines] == [
        "qat_kd epoch 1/2: loss " + lines[0].split("loss ")[1].split(" (")[0],
        "resumed stage 'qat_kd' at epoch 1 from stage_last.dcp",
        "qat_kd epoch 2/2: loss " + lines[2].split("loss ")[1].split(" (")[0]], lines
    assert "(2 rank(s))" in lines[1]
    # the same checkpoint in one process: DCP reshards; each rank's observer statistics were saved
    rep = compress.apply(recipe, out_dir=one, resume=True, quiet=True)
    assert "resumed stage 'qat_kd' at epoch 1 from stage_last.dcp (1 rank(s))" in (one / "run.log").read_text()
    single = compress.apply(recipe, out_dir=tmp_path / "single", quiet=True)
    # the same global batch, one process or two ranks: the same training up to data-parallel rounding
    # (measured 0.013). The activations' ranges are not compared: each rank's EMA follows its half
    # batches until they freeze at the stage's end, which one process's cannot match
    w2, w1, ws = _final(out), _final(one), _final(tmp_path / "single")
    for k in (k for k in ws if "quantizer" not in k):
        for got in (w2, w1):
            rel = float((got[k].float() - ws[k].float()).norm() / ws[k].float().norm().clamp_min(1e-12))
            assert rel < 0.03, (k, rel)
    two = json.loads((out / "report.json").read_text())["final"]["accuracy"]
    assert abs(two - single.final.accuracy) < 0.02 * single.final.accuracy
    assert abs(rep.final.accuracy - single.final.accuracy) < 0.02 * single.final.accuracy
