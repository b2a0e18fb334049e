"""Calibration across ranks: under torchrun each rank runs GPTQ, AWQ, and PTQ with SmoothQuant on
its share of the calibration batches (half of them, on 2 gloo processes), and the statistics reduced
across ranks give the weights and qparams one process gets on all of them."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import compress
from compress.core.batching import RankShare

STAGES: dict[str, dict[str, Any]] = {
    "gptq": {"type": "gptq", "scheme": "w4_weight_only", "ignore": ["lm_head"]},
    "awq": {"type": "awq", "scheme": "w4_weight_only", "ignore": ["lm_head"], "grid": 5},
    "smoothquant": {"type": "ptq", "scheme": "w8a8", "ignore": ["lm_head"], "quantize_ops": False,
                    "smoothquant": 0.5},
}


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 96, (2, 16), generator=g) for _ in range(4)]


def _calibrate(kind: str) -> tuple[dict[str, torch.Tensor], int]:
    """The stage's model state after calibration, and how many batches this process ran."""
    model = _llama()
    seen = [0]
    h = model.model.embed_tokens.register_forward_pre_hook(lambda *_: seen.__setitem__(0, seen[0] + 1))
    recipe = {"version": 1, "model": {"name": "mlp"}, "export": {"enabled": False},
              "stages": [{"name": kind, "modifiers": [STAGES[kind]]}]}
    batches = _batches()
    with compress.Session(recipe, model, calibration_data=batches, example_inputs=batches[0]) as s:
        pass
    h.remove()
    state = {k: v.detach().clone() for k, v in s.model.state_dict().items()
             if isinstance(v, torch.Tensor) and v.is_floating_point()}
    return state, seen[0]


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        shares = [list(RankShare(range(5))), len(RankShare(range(5), max_batches=3)), list(RankShare(range(1)))]
        result = {"shares": shares, **{kind: _calibrate(kind) for kind in STAGES}}
        torch.save(result, Path(out) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # 20-39 s: 2 gloo processes run GPTQ, AWQ and PTQ
def test_each_rank_calibrates_on_its_share_and_ends_as_one_process(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    mp.spawn(_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert ranks[0]["shares"] == [[0, 2, 4], 2, [0]] and ranks[1]["shares"] == [[1, 3], 1, [0]]
    for kind in STAGES:
        single, seen_single = _calibrate(kind)
        (s0, seen0), (s1, seen1) = ranks[0][kind], ranks[1][kind]
        # each rank ran the model on half of the batches one process runs on (PTQ adds a first-call
        # capture and a trace on one batch on every rank)
        assert seen0 == seen1 and (2 * seen0 == seen_single if kind != "smoothquant" else seen0 < seen_single), (
            kind, seen0, seen1, seen_single)
        for k, v in single.items():
            assert torch.equal(s0[k], s1[k]), (kind, k)  # every rank quantized alike
            # and as one process did on all batches: float sums in another order may move a
            # rounding decision, never more than a few weights
            close = torch.isclose(s0[k], v, rtol=1e-4, atol=1e-6)
            assert close.float().mean() > 0.995, (kind, k, float(close.float().mean()))
