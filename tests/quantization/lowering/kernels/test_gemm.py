"""W8A8 GEMM: int32 accumulation bit-exact on ragged shapes; fused epilogue against the same math."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from compress.quantization.lowering.kernels import GemmConfig, int8_gemm

from compress.core.errors import CompressError

# M, N, K chosen so that none is a multiple of the tiles below: every mask is exercised
RAGGED = [(37, 45, 70), (1, 33, 100), (16, 16, 64), (70, 19, 33)]
TILES = [GemmConfig(32, 32, 32, group_m=2), GemmConfig(16, 64, 64, group_m=4)]


def _ints(*shape: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)


@pytest.mark.parametrize("tile", TILES, ids=["32x32x32", "16x64x64"])
@pytest.mark.parametrize("mnk", RAGGED, ids=lambda s: "x".join(map(str, s)))
def test_int32_accumulation_is_exact(mnk: tuple[int, int, int], tile: GemmConfig, device: str) -> None:
    m, n, k = mnk
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    a, b = _ints(m, k, g=g), _ints(n, k, g=g)
    # unit scales in float32: |acc| < 2**24, so the output holds the int32 accumulator exactly
    y = int8_gemm(
        a.to(device), b.to(device), a_scale=torch.ones(1), b_scale=torch.ones(n),
        out_dtype=torch.float32, config=tile,
    )
    ref = (a.long() @ b.long().T).to(torch.int32)
    torch.testing.assert_close(y.cpu().to(torch.int32), ref, atol=0, rtol=0)


@pytest.mark.parametrize("split", [2, 3, 8])
def test_split_k_is_exact_and_leaves_its_workspace_zeroed(split: int, device: str) -> None:
    # K-tiles 3 (70 / 32; int8 MMA needs K-tiles of 32): splits of 2 tiles and 1, 3 of one tile, and
    # 8 of which five are empty; M > one row tile; run twice, as a replayed decode step would, with
    # the bias and per-token epilogue
    from compress.quantization.lowering.kernels import load

    gemm = load("gemm")
    m, n, k = 21, 45, 70
    g = torch.Generator().manual_seed(split)
    a, b = _ints(m, k, g=g), _ints(n, k, g=g)
    sa, sb, bias = torch.rand(m, generator=g) + 0.5, torch.rand(n, generator=g) + 0.5, torch.randn(n, generator=g)
    whole = int8_gemm(a.to(device), b.to(device), a_scale=sa, b_scale=sb, bias=bias, out_dtype=torch.float32,
                      config=GemmConfig(16, 16, 32, group_m=2))
    for _ in range(2):
        y = int8_gemm(a.to(device), b.to(device), a_scale=sa, b_scale=sb, bias=bias, out_dtype=torch.float32,
                      config=GemmConfig(16, 16, 32, group_m=2, split_k=split))
        torch.testing.assert_close(y, whole, atol=0, rtol=0)
        ws = gemm.split_workspace(torch.device(device), m * n + 4 * 3)
        assert int(ws.abs().sum()) == 0
    torch.testing.assert_close(y.cpu().double(), ((a.double() @ b.double().T) * sa[:, None] * sb + bias).double(),
                               atol=1e-3, rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_split_k_graphs_each_own_their_workspace() -> None:
    # two graphs captured on one capture stream, the second replayed first and then both on two
    # streams at once: each owns its zeroed workspace, so every replay equals the eager product
    g = torch.Generator().manual_seed(4)
    shapes = [(1, 96, 512), (4, 160, 768)]
    cases = []
    for m, n, k in shapes:
        a, b = _ints(m, k, g=g).cuda(), _ints(n, k, g=g).cuda()
        sa, sb = torch.ones(1, device="cuda"), torch.ones(n, device="cuda")
        cfg = GemmConfig(16, 32, 64, group_m=2, split_k=4)
        ref = int8_gemm(a, b, a_scale=sa, b_scale=sb, out_dtype=torch.float32, config=cfg)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = int8_gemm(a, b, a_scale=sa, b_scale=sb, out_dtype=torch.float32, config=cfg)
        # a graph replays the addresses it captured: its inputs must outlive it (the loop rebinds
        # a, b, sa, sb, which freed the first graph's inputs and failed this test on an H200)
        cases.append((graph, out, ref, (a, b, sa, sb)))
    for graph, out, ref, _inputs in reversed(cases):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for _ in range(20):
        for (graph, _out, _ref, _inputs), st in zip(cases, streams, strict=True):
            with torch.cuda.stream(st):
                graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(out, ref) for _, out, ref, _inputs in cases)


def test_strided_activation_and_saturated_values(device: str) -> None:
    g = torch.Generator().manual_seed(3)
    base = _ints(40, 90, g=g)
    base[0, :] = -128  # extremes: -128 * -128 sums stress the accumulator's sign handling
    a = base[:, 5:75]  # a row-strided view, never copied
    b = torch.full((21, 70), -128, dtype=torch.int8)
    y = int8_gemm(a.to(device), b.to(device), a_scale=torch.ones(1), b_scale=torch.ones(21), out_dtype=torch.float32)
    torch.testing.assert_close(y.cpu().to(torch.int32), (a.long() @ b.long().T).int(), atol=0, rtol=0)


@pytest.mark.parametrize("activation", ["none", "relu", "gelu"])
@pytest.mark.parametrize("per_row", [True, False], ids=["per-token", "per-tensor"])
def test_fused_epilogue_matches_torch(activation: str, per_row: bool, device: str) -> None:
    m, n, k = 37, 45, 70
    g = torch.Generator().manual_seed(7)
    a, b = _ints(m, k, g=g), _ints(n, k, g=g)
    sa = torch.rand(m if per_row else 1, generator=g) * 0.05 + 1e-3
    sb = torch.rand(n, generator=g) * 0.01 + 1e-4
    bias = torch.randn(n, generator=g)
    y = int8_gemm(a.to(device), b.to(device), a_scale=sa, b_scale=sb, bias=bias, activation=activation,
                  out_dtype=torch.float32, config=TILES[0])
    acc = (a.long() @ b.long().T).float()
    ref = acc * (sa[:, None] if per_row else sa) * sb[None, :] + bias
    ref = {"none": ref, "relu": F.relu(ref), "gelu": F.gelu(ref)}[activation]
    assert ref.abs().max() > 1  # not a degenerate all-zero comparison
    torch.testing.assert_close(y.cpu(), ref, atol=1e-5, rtol=1e-6)


def test_zero_point_correction_is_exact(device: str) -> None:
    # uint8 activations live in int8 code space shifted by 128; the epilogue removes zp * colsum(b)
    m, n, k = 23, 29, 47
    g = torch.Generator().manual_seed(11)
    a, b = _ints(m, k, g=g), _ints(n, k, g=g)
    zp = -37
    colsum = b.int().sum(1)
    y = int8_gemm(a.to(device), b.to(device), a_scale=torch.ones(1), b_scale=torch.ones(n), a_zero_point=zp,
                  b_colsum=colsum, out_dtype=torch.float32, config=TILES[0])
    ref = ((a.long() - zp) @ b.long().T).int()
    torch.testing.assert_close(y.cpu().to(torch.int32), ref, atol=0, rtol=0)


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
def test_half_outputs(out_dtype: torch.dtype, device: str) -> None:
    m, n, k = 19, 35, 66
    g = torch.Generator().manual_seed(5)
    a, b = _ints(m, k, g=g), _ints(n, k, g=g)
    sa, sb = torch.full((m,), 0.01), torch.rand(n, generator=g) * 0.01
    y = int8_gemm(a.to(device), b.to(device), a_scale=sa, b_scale=sb, out_dtype=out_dtype, config=TILES[0])
    assert y.dtype == out_dtype
    ref = ((a.long() @ b.long().T).float() * sa[:, None] * sb[None, :]).to(out_dtype)
    # fp16 rounds exactly like torch; the interpreter casts to bf16 by truncation (GPUs round to
    # nearest), so bf16 may differ by one unit in the last place
    rtol = 0.0 if out_dtype == torch.float16 else 2.0**-7
    torch.testing.assert_close(y.cpu().float(), ref.float(), atol=0, rtol=rtol)


def test_bad_inputs_raise(device: str) -> None:
    a = torch.zeros(4, 8, dtype=torch.int8, device=device)
    with pytest.raises(CompressError, match="int8"):
        int8_gemm(a.float(), a, a_scale=torch.ones(1), b_scale=torch.ones(4))
    with pytest.raises(CompressError, match="shapes"):
        int8_gemm(a, a[:, :4], a_scale=torch.ones(1), b_scale=torch.ones(4))
    with pytest.raises(CompressError, match="activation"):
        int8_gemm(a, a, a_scale=torch.ones(1), b_scale=torch.ones(4), activation="swish")
    with pytest.raises(CompressError, match="colsum"):
        int8_gemm(a, a, a_scale=torch.ones(1), b_scale=torch.ones(4), a_zero_point=3)
