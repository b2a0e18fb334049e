"""The autotuned launch path (config pruning, EVEN_K heuristic, grid from the chosen tile) on the
interpreter, with a stand-in timer: the production launcher code, not only fixed tiles."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from compress.quantization.lowering.kernels import load


def _fake_bench(times: dict[int, float]) -> Callable[..., list[float]]:
    # runs the candidate once (so a wrong config would crash here) and ranks configs by BLOCK_N
    calls = iter(range(10**6))

    def bench(kernel_call: Callable[[], object], quantiles: tuple[float, ...] | None = None) -> list[float]:
        kernel_call()
        i = next(calls)
        return [times.get(i, 1.0)] * (len(quantiles) if quantiles else 1)

    return bench


@pytest.fixture
def interpret_only() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("on CUDA the real autotuner runs in every other test")


@pytest.mark.parametrize("m", [1, 40])
def test_autotuned_gemm_path(m: int, interpret_only: None, monkeypatch: pytest.MonkeyPatch) -> None:
    gemm = load("gemm")
    configs = [gemm.tile_config(16, 32, 32, 1, 4, group=2), gemm.tile_config(32, 16, 64, 1, 4, group=2)]
    tuned = gemm.tuned_gemm(configs, do_bench=_fake_bench({0: 2.0, 1: 1.0}))
    monkeypatch.setattr(gemm, "_gemm_tuned", tuned)
    g = torch.Generator().manual_seed(m)
    n, k = 45, 70  # K ragged for the 64-deep tile, even for neither: both heuristic branches run
    a = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
    b = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    y = gemm.int8_gemm(a, b, a_scale=torch.ones(1), b_scale=torch.ones(n), out_dtype=torch.float32)
    torch.testing.assert_close(y.to(torch.int32), (a.long() @ b.long().T).int(), atol=0, rtol=0)
    # M=1 prunes the 32-row tile away (padding rows would waste the MMA); M=40 benchmarks both
    pruned = gemm._prune(configs, {"M_BUCKET": gemm.m_bucket(m)})
    assert [c.kwargs["BLOCK_M"] for c in pruned] == ([16] if m == 1 else [16, 32])
    assert len(tuned.cache) == 1


def test_every_tuning_config_names_only_its_kernels_parameters() -> None:
    # the interpreter ignores unknown launch keywords; the GPU's launcher refuses them (a GEMM-only
    # SPLIT_K in the conv kernel's configs failed every int8 conv on the device, not here)
    gemm, conv = load("gemm"), load("conv")
    for kernel, configs in ((gemm._gemm_kernel, gemm.HOPPER_CONFIGS + gemm.AMPERE_CONFIGS),
                            (conv._conv_kernel, conv.CONV_CONFIGS)):
        params = set(kernel.arg_names)
        for c in configs:
            assert set(c.kwargs) <= params, (kernel.__name__, sorted(set(c.kwargs) - params))


def test_tuned_split_reads_the_tuners_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    # what decides, under graph capture, whether a split-K workspace (and its memset) is needed
    gemm = load("gemm")

    class Tuned:
        cache = {(16, 96, 512, "torch.int8"): gemm.tile_config(16, 32, 64, 3, 4, split=4),
                 (1, 96, 512, "torch.int8"): gemm.tile_config(16, 32, 64, 3, 4)}

    monkeypatch.setattr(gemm, "_gemm_tuned", Tuned())
    assert gemm.tuned_split(9, 96, 512) == 4 and gemm.tuned_split(1, 96, 512) == 1
    assert gemm.tuned_split(1, 96, 1024) is None


def test_autotuned_conv_path(interpret_only: None, monkeypatch: pytest.MonkeyPatch) -> None:
    conv = load("conv")
    configs = [conv.tile_config(32, 16, 32, 1, 4, group=2), conv.tile_config(16, 32, 32, 1, 4, group=2)]
    monkeypatch.setattr(conv, "_conv_tuned", conv.tuned_conv(configs, do_bench=_fake_bench({})))
    g = torch.Generator().manual_seed(5)
    x = torch.randint(-128, 128, (1, 6, 7, 5), generator=g, dtype=torch.int8)
    w = torch.randint(-128, 128, (9, 6, 3, 3), generator=g, dtype=torch.int8)
    y = conv.int8_conv2d(x, w.permute(0, 2, 3, 1).contiguous(), a_scale=torch.ones(1), w_scale=torch.ones(9),
                         a_zero_point=-3, w_colsum=w.int().sum((1, 2, 3)), stride=2, padding=1,
                         out_dtype=torch.float32)
    ref = F.conv2d(F.pad(x.double() + 3, (1, 1, 1, 1)), w.double(), stride=2)
    torch.testing.assert_close(y.double(), ref, atol=0, rtol=0)


@pytest.mark.parametrize("m", [1, 3, 40])
def test_tuned_w4a16_path(m: int, interpret_only: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # the CUDA tuner's own code (candidates, timing loop, cache) with an SM count and a timer stood in
    from compress.quantization.lowering.int4 import Int4Weight, dequantize_int4, pack_nibbles

    w4 = load("w4a16")
    monkeypatch.setattr(w4, "_sm_count", lambda: 4)
    timed: list[object] = []

    def bench(fn: Callable[[], object], **_: object) -> float:
        fn()  # a candidate that cannot run fails here, as it would on the GPU
        timed.append(fn)
        return 1.0 if len(timed) != 3 else 0.5  # the third candidate wins

    monkeypatch.setattr(w4, "_TUNED", {})
    g = torch.Generator().manual_seed(m)
    n, k, gs = 40, 256, 64
    w = Int4Weight(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8),
                   2.0 ** -torch.randint(2, 6, (n, k // gs), generator=g).float(),
                   torch.randint(0, 16, (n, k // gs), generator=g, dtype=torch.uint8), gs, False)
    x = torch.randint(-4, 5, (m, k), generator=g).float()  # exact sums: any tile and split agree bit for bit
    wt = w4._weight(pack_nibbles(w.codes), w.scale, w.zero_point, None, gs, x.device)
    out = torch.empty(m, n)
    cands = w4._candidates(m, n, k, gs, True, x.dtype)
    # 1..4 rows also try CUDA-core tiles; a K-tile lies inside a group or, for decode, spans whole
    # groups (one scale load per row and group); splits keep >= 2 tiles (the gemv kernel's, which
    # hold their weight in flight by program count, >= 1)
    assert any(c.block_m < 16 for c in cands) == (m <= 4)
    assert any(c.gemv for c in cands) == (m <= 4)
    assert all((gs % c.block_k == 0 or w4.multi_group_tile(c.block_k, gs) > 1)
               and (c.split_k == 1 or k // c.block_k >= (1 if c.gemv else 2) * c.split_k) for c in cands)
    assert any(w4.multi_group_tile(c.block_k, gs) > 1 for c in cands) == (m <= 16)
    chosen = w4._pick(x, wt, None, 0, out, timer=bench)
    assert chosen == cands[2] and len(timed) == len(cands)
    assert w4._pick(x, wt, None, 0, out, timer=bench) == chosen and len(timed) == len(cands)  # cached
    for c in cands:  # every candidate computes the product exactly
        y = w4.w4a16_gemm(x, pack_nibbles(w.codes), scale=w.scale, group_size=gs, zero_point=w.zero_point, config=c)
        torch.testing.assert_close(y, x @ dequantize_int4(w).T, atol=0, rtol=0)


def test_tuner_says_why_when_no_candidate_runs(interpret_only: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from compress.core.errors import CompressError

    w4 = load("w4a16")
    monkeypatch.setattr(w4, "_sm_count", lambda: 4)
    monkeypatch.setattr(w4, "_TUNED", {})

    def broken(fn: Callable[[], object]) -> float:
        raise RuntimeError("out of shared memory")

    x = torch.zeros(1, 64)
    wt = w4._weight(torch.zeros(8, 32, dtype=torch.uint8), torch.ones(8, 1), None, None, 64, x.device)
    with pytest.raises(CompressError, match=r"no kernel configuration ran .* out of shared memory"):
        w4._pick(x, wt, None, 0, torch.empty(1, 8), timer=broken)
