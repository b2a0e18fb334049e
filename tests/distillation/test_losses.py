"""Distillation losses against hand-computed references, and the loss-weight schedule."""

from __future__ import annotations

import math

import pytest
import torch
from compress.distillation.losses import (
    attention_kl,
    cosine_loss,
    divergence,
    feature_mse,
    kd_kl,
    mean_pool,
    soft_target_ce,
)
from compress.distillation.spec import FeatureLoss, KDLoss, LossTerm


def _softmax(row: list[float], t: float) -> list[float]:
    e = [math.exp(v / t) for v in row]
    z = sum(e)
    return [v / z for v in e]


def test_kd_kl_matches_hand_computed_value_with_t_squared_scaling() -> None:
    s = [[1.0, 2.0, 0.5], [0.0, -1.0, 3.0]]
    t = [[2.0, 0.0, 1.0], [1.0, 1.0, 1.0]]
    temp = 2.0
    ref = 0.0
    for rs, rt in zip(s, t):
        ps, pt = _softmax(rs, temp), _softmax(rt, temp)
        ref += sum(b * (math.log(b) - math.log(a)) for a, b in zip(ps, pt))
    ref = ref / 2 * temp**2
    got = kd_kl(torch.tensor(s), torch.tensor(t), temperature=temp)
    assert got.item() == pytest.approx(ref, rel=1e-6)


def test_kd_kl_is_zero_for_equal_logits_and_flattens_sequence_logits() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 7, generator=g)
    assert kd_kl(x, x.clone()).item() == pytest.approx(0.0, abs=1e-6)
    y = torch.randn(3, 5, 7, generator=g)
    assert kd_kl(x, y).item() == pytest.approx(kd_kl(x.reshape(15, 7), y.reshape(15, 7)).item(), rel=1e-6)


def test_soft_target_ce_is_kd_plus_teacher_entropy() -> None:
    s = [[0.3, -0.2, 1.5]]
    t = [[1.0, 0.0, -1.0]]
    temp = 3.0
    ps, pt = _softmax(s[0], temp), _softmax(t[0], temp)
    ref = -sum(b * math.log(a) for a, b in zip(ps, pt)) * temp**2
    got = soft_target_ce(torch.tensor(s), torch.tensor(t), temperature=temp)
    assert got.item() == pytest.approx(ref, rel=1e-6)
    entropy = -sum(b * math.log(b) for b in pt) * temp**2
    kd = kd_kl(torch.tensor(s), torch.tensor(t), temperature=temp)
    assert got.item() == pytest.approx(kd.item() + entropy, rel=1e-6)


def test_feature_mse_plain_normalized_and_masked() -> None:
    s = torch.tensor([[[1.0, 2.0], [3.0, 4.0]]])  # [B=1, L=2, D=2]
    t = torch.tensor([[[0.0, 2.0], [3.0, 0.0]]])
    assert feature_mse(s, t).item() == pytest.approx((1 + 0 + 0 + 16) / 4)
    mask = torch.tensor([[1, 0]])
    assert feature_mse(s, t, mask=mask).item() == pytest.approx((1 + 0) / 2)
    n = 1 / math.sqrt(5)
    # normalized per token along D: token 0 (1,2)/sqrt5 vs (0,1); token 1 (0.6,0.8) vs (1,0)
    ref = ((n - 0) ** 2 + (2 * n - 1) ** 2 + (0.6 - 1) ** 2 + 0.8**2) / 4
    assert feature_mse(s, t, normalize=True).item() == pytest.approx(ref, rel=1e-6)


def test_feature_mse_normalizes_conv_maps_over_channels() -> None:
    g = torch.Generator().manual_seed(1)
    s, t = torch.randn(2, 3, 4, 4, generator=g), torch.randn(2, 3, 4, 4, generator=g)
    ref = ((s / s.norm(dim=1, keepdim=True) - t / t.norm(dim=1, keepdim=True)) ** 2).mean()
    assert feature_mse(s, t, normalize=True).item() == pytest.approx(ref.item(), rel=1e-5)


def test_attention_kl_against_reference_with_query_mask() -> None:
    g = torch.Generator().manual_seed(2)
    a_s = torch.randn(2, 3, 4, 4, generator=g).softmax(-1)
    a_t = torch.randn(2, 3, 4, 4, generator=g).softmax(-1)
    per = (a_t * (a_t.log() - a_s.log())).sum(-1)  # [B, H, Lq]
    assert attention_kl(a_s, a_t).item() == pytest.approx(per.mean().item(), rel=1e-5)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    ref = (per[0, :, :2].sum() + per[1].sum()) / (3 * 2 + 3 * 4)
    assert attention_kl(a_s, a_t, mask=mask).item() == pytest.approx(ref.item(), rel=1e-5)


def test_cosine_loss_and_mean_pool() -> None:
    s = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    t = torch.tensor([[0.0, 1.0], [2.0, 2.0]])
    assert cosine_loss(s, t).item() == pytest.approx((1.0 + 0.0) / 2, abs=1e-6)
    h = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]]])
    assert mean_pool(h, torch.tensor([[1, 1, 0]])).tolist() == [[2.0, 3.0]]


def test_divergence_reports_kl_at_t1_and_agreement() -> None:
    s = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
    t = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    kl, agree = divergence(s, t)
    assert agree.item() == pytest.approx(0.5)
    assert kl.item() == pytest.approx(kd_kl(s, t, temperature=1.0).item())


def test_weight_schedules() -> None:
    assert KDLoss(weight=2.0).weight_at(0.7) == 2.0
    lin = KDLoss(weight=0.0, weight_end=1.0, weight_schedule="linear")
    assert [lin.weight_at(p) for p in (0.0, 0.25, 1.0, 2.0)] == [0.0, 0.25, 1.0, 1.0]
    cos = FeatureLoss(layers={"a": "a"}, weight=1.0, weight_end=0.0, weight_schedule="cosine")
    assert cos.weight_at(0.5) == pytest.approx(0.5)
    assert cos.weight_at(0.25) == pytest.approx(1 - 0.5 * (1 - math.cos(math.pi / 4)))
    with pytest.raises(ValueError, match="needs weight_end"):
        LossTerm(type="kd", weight_schedule="linear")
    with pytest.raises(ValueError, match="weight_end needs"):
        LossTerm(type="kd", weight_end=1.0)


def test_logit_losses_in_chunks_equal_the_whole_computation(monkeypatch) -> None:
    """An LM's [B, L, V] logits are distilled in row chunks (each recomputed in backward): the same
    loss and gradients as the loss over all rows at once."""
    import torch.nn.functional as F
    from compress.distillation.losses import kd_kl, soft_target_ce

    import compress.core.lm_loss as lm_loss

    torch.manual_seed(0)
    s = torch.randn(2, 9, 40, requires_grad=True)
    t = torch.randn(2, 9, 40)

    def whole_kl(x: torch.Tensor) -> torch.Tensor:
        log_ps, log_pt = F.log_softmax(x.reshape(-1, 40) / 2.0, -1), F.log_softmax(t.reshape(-1, 40) / 2.0, -1)
        return (log_pt.exp() * (log_pt - log_ps)).sum(-1).mean() * 4.0

    def whole_ce(x: torch.Tensor) -> torch.Tensor:
        return -(F.softmax(t.reshape(-1, 40) / 2.0, -1) * F.log_softmax(x.reshape(-1, 40) / 2.0, -1)).sum(-1).mean() * 4.0

    monkeypatch.setattr(lm_loss, "CHUNK_BYTES", 4 * 40 * 5)  # 5 rows a chunk: 18 rows in 4 chunks
    assert len(lm_loss.row_chunks(18, 40)) == 4
    for mine, want in ((kd_kl, whole_kl), (soft_target_ce, whole_ce)):
        got = mine(s, t, temperature=2.0)
        (g1,) = torch.autograd.grad(got, s)
        ref = want(s)
        (g2,) = torch.autograd.grad(ref, s)
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(g1, g2, rtol=1e-5, atol=1e-8)
