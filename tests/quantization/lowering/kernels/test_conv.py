"""int8 convolution: implicit GEMM and the 1x1 GEMM path, exact against float64 convolution."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from compress.quantization.lowering.kernels import GemmConfig, int8_conv2d

from compress.core.errors import CompressError

# (n, c, h, w, o, k, stride, padding, dilation, zero_point): ragged channels and pixels everywhere
CASES = [
    (2, 5, 7, 6, 9, 3, 1, 1, 1, 0),
    (1, 7, 9, 8, 11, 3, 2, 1, 1, -7),
    (2, 6, 5, 5, 10, 1, 1, 0, 1, 3),  # 1x1 -> GEMM path
    (1, 4, 9, 7, 6, 3, 1, 2, 2, 4),  # dilation
    (1, 40, 6, 5, 37, 1, 2, 0, 1, -2),  # strided 1x1 -> implicit GEMM, C spans two K-tiles
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "n{}c{}h{}w{}o{}k{}s{}p{}d{}z{}".format(*c))
def test_conv_accumulation_is_exact(case: tuple[int, ...], device: str) -> None:
    n, c, h, w, o, k, s, p, d, zp = case
    g = torch.Generator().manual_seed(sum(case) + 100)
    x = torch.randint(-128, 128, (n, c, h, w), generator=g, dtype=torch.int8)
    wt = torch.randint(-128, 128, (o, c, k, k), generator=g, dtype=torch.int8)
    y = int8_conv2d(
        x.to(device), wt.permute(0, 2, 3, 1).contiguous().to(device), a_scale=torch.ones(1), w_scale=torch.ones(o),
        a_zero_point=zp, w_colsum=wt.int().sum((1, 2, 3)), stride=s, padding=p, dilation=d,
        out_dtype=torch.float32, config=GemmConfig(32, 16, 32, group_m=2),
    )
    # padding holds real zeros, i.e. the code zp: pad the shifted input with 0
    ref = F.conv2d(F.pad(x.double() - zp, (p, p, p, p)), wt.double(), stride=s, dilation=d)
    assert y.shape == ref.shape and y.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(y.cpu().double(), ref, atol=0, rtol=0)


def test_conv_epilogue(device: str) -> None:
    g = torch.Generator().manual_seed(9)
    x = torch.randint(-128, 128, (2, 6, 6, 5), generator=g, dtype=torch.int8)
    wt = torch.randint(-128, 128, (7, 6, 3, 3), generator=g, dtype=torch.int8)
    sa, sw, bias = torch.tensor(0.02), torch.rand(7, generator=g) * 1e-3, torch.randn(7, generator=g)
    y = int8_conv2d(x.to(device), wt.permute(0, 2, 3, 1).contiguous().to(device), a_scale=sa, w_scale=sw,
                    bias=bias, padding=1, activation="relu", out_dtype=torch.float32)
    acc = F.conv2d(x.double(), wt.double(), padding=1).float()
    ref = F.relu(acc * sa * sw[None, :, None, None] + bias[None, :, None, None])
    assert (ref > 0).any() and (ref == 0).any()
    torch.testing.assert_close(y.cpu(), ref, atol=1e-5, rtol=1e-6)


def test_conv_bad_inputs(device: str) -> None:
    x = torch.zeros(1, 4, 5, 5, dtype=torch.int8, device=device)
    w = torch.zeros(3, 3, 3, 5, dtype=torch.int8, device=device)
    with pytest.raises(CompressError, match="channels"):
        int8_conv2d(x, w, a_scale=torch.ones(1), w_scale=torch.ones(3))
    with pytest.raises(CompressError, match="too small"):
        int8_conv2d(x, torch.zeros(3, 9, 9, 4, dtype=torch.int8, device=device), a_scale=torch.ones(1),
                    w_scale=torch.ones(3))
