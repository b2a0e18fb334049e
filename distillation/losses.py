"""Distillation losses as plain functions of student and teacher tensors.

Every function returns a scalar mean over samples (and tokens / positions where that applies), so
that weights mean the same thing whatever the batch size. Teacher tensors are treated as targets:
callers pass them without grad.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from compress.core.lm_loss import checkpointed, row_chunks


def _rows(x: torch.Tensor) -> torch.Tensor:
    # logits of any rank ([B, C], [B, L, V]) become rows of a class distribution
    return x.reshape(-1, x.shape[-1])


def _row_mean(fn: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor], student: torch.Tensor,
              teacher: torch.Tensor, t: float) -> torch.Tensor:
    # an LM's [B, L, V] logits in chunks of bounded float32 size, each recomputed in backward: no
    # full-vocabulary float32 copies, softmaxes or their products of every token at once
    s, p = _rows(student), _rows(teacher)
    total = sum(checkpointed(fn, s[c], p[c], t) for c in row_chunks(s.shape[0], s.shape[-1]))
    return torch.as_tensor(total) / max(s.shape[0], 1)


def _kl_sum(s: torch.Tensor, p: torch.Tensor, t: float) -> torch.Tensor:
    log_ps = F.log_softmax(s.float() / t, dim=-1)
    log_pt = F.log_softmax(p.float() / t, dim=-1)
    return (log_pt.exp() * (log_pt - log_ps)).sum()


def _ce_sum(s: torch.Tensor, p: torch.Tensor, t: float) -> torch.Tensor:
    return -(F.softmax(p.float() / t, dim=-1) * F.log_softmax(s.float() / t, dim=-1)).sum()


def kd_kl(student: torch.Tensor, teacher: torch.Tensor, *, temperature: float = 4.0) -> torch.Tensor:
    """Hinton et al. logit distillation: ``T^2 * KL(softmax(t/T) || softmax(s/T))``, mean over rows.

    The ``T^2`` factor keeps the gradient scale independent of the temperature. Rows are taken in
    chunks of bounded float32 size (compress.core.lm_loss), so an LM's logits cost no full copies.
    """
    t = temperature
    return _row_mean(_kl_sum, student, teacher, t) * (t * t)


def soft_target_ce(student: torch.Tensor, teacher: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """Cross entropy against the teacher's softened distribution: ``-T^2 * sum p_t log p_s``, mean over rows.

    Equal to :func:`kd_kl` plus the teacher's entropy (a constant for the student). Chunked as :func:`kd_kl`.
    """
    t = temperature
    return _row_mean(_ce_sum, student, teacher, t) * (t * t)


def _channel_dim(x: torch.Tensor) -> int:
    # NCHW conv maps carry channels in dim 1; token and vector features in the last dim
    return 1 if x.dim() == 4 else -1


def feature_mse(
    student: torch.Tensor,
    teacher: torch.Tensor,
    *,
    normalize: bool = False,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean squared error between (adapted) student and teacher features of the same shape.

    ``normalize`` L2-normalizes each feature vector along the channel dimension first (scale-free
    hint loss). ``mask`` ([B, L] for token features [B, L, D]) leaves padding positions out.
    """
    s, t = student.float(), teacher.float()
    if normalize:
        s = F.normalize(s, dim=_channel_dim(s))
        t = F.normalize(t, dim=_channel_dim(t))
    sq = (s - t).pow(2)
    if mask is None:
        return sq.mean()
    m = mask.to(sq.dtype).unsqueeze(-1)
    return (sq * m).sum() / (m.sum() * sq.shape[-1]).clamp_min(1.0)


def attention_kl(
    student: torch.Tensor, teacher: torch.Tensor, *, mask: torch.Tensor | None = None, eps: float = 1e-12
) -> torch.Tensor:
    """MiniLM-style attention transfer: ``KL(teacher || student)`` of the attention distributions.

    Both are probabilities [B, H, Lq, Lk]; the KL is summed over keys and averaged over heads and
    the query positions ``mask`` ([B, L]) keeps.
    """
    s, t = student.float(), teacher.float()
    kl = (t * (t.clamp_min(eps).log() - s.clamp_min(eps).log())).sum(-1)  # [B, H, Lq]
    if mask is None:
        return kl.mean()
    m = mask.to(kl.dtype)[:, None, :].expand_as(kl)
    return (kl * m).sum() / m.sum().clamp_min(1.0)


def cosine_loss(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """``1 - cos(student, teacher)`` per embedding row, mean over rows (sentence-embedding distillation)."""
    return (1.0 - F.cosine_similarity(student.float(), teacher.float(), dim=-1)).mean()


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean of token states [B, L, D] over the positions ``mask`` keeps (sentence-transformers pooling)."""
    if mask is None:
        return hidden.mean(1)
    m = mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * m).sum(1) / m.sum(1).clamp_min(1e-9)


@torch.no_grad()
def divergence(student: torch.Tensor, teacher: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(KL(teacher || student) at T=1, top-1 agreement)`` over rows, for monitoring (no grad)."""
    kl = kd_kl(student, teacher, temperature=1.0)
    agree = (_rows(student).argmax(-1) == _rows(teacher).argmax(-1)).float().mean()
    return kl, agree
