"""Range observers with bounded memory: minmax, ema, percentile, entropy (KL) and mse.

An observer sees ``[groups, elements]`` rows (see ``primitives.to_rows``) and returns a clipping
range per row. State is O(groups) for minmax/ema and a fixed-size histogram for the histogram
observers, whatever the number of calibration samples. Histograms cover ``[0, R]`` separately for
positive and negative values; when a value exceeds R, R doubles and adjacent bins merge, which is
exact, so no sample is ever re-binned approximately. ``all_reduce`` merges state across DDP ranks.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from compress.quantization.numerics.primitives import fake_quantize, qparams_from_range
from compress.quantization.numerics.spec import QuantSpec
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from compress.core.errors import CalibrationError, RecipeError
from compress.core.registry import Registry


class NoParams(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Observer:
    """Base observer. Subclasses set ``Params`` and implement ``_update``, ``_compute``, ``_reduce``."""

    Params: ClassVar[type[BaseModel]] = NoParams
    per_tensor_only: ClassVar[bool] = False

    def __init__(self, spec: QuantSpec, params: BaseModel, *, where: str = "quantizer") -> None:
        self.spec = spec
        self.params = params
        self.where = where
        self.num_updates = 0
        self.min_val: torch.Tensor | None = None
        self.max_val: torch.Tensor | None = None

    def reset(self) -> None:
        self.num_updates = 0
        self.min_val = self.max_val = None

    def state_bytes(self) -> int:
        """Bytes held in tensors by this observer (its memory, whatever the samples seen)."""
        return sum(v.numel() * v.element_size() for v in vars(self).values() if isinstance(v, torch.Tensor))

    def update(self, rows: torch.Tensor) -> None:
        """Fold one batch of rows into the statistics (non-finite values are a CalibrationError)."""
        rows = rows.detach()
        if rows.numel() == 0:
            return
        rows = rows.float()
        mn, mx = rows.amin(dim=1), rows.amax(dim=1)
        # NaN and inf propagate into the extremes: checking them avoids a full isfinite pass
        if not bool(torch.isfinite(mn).all() and torch.isfinite(mx).all()):
            raise CalibrationError(f"{self.where}: calibration saw NaN or inf values")
        if self.min_val is None or self.max_val is None or self.min_val.shape != mn.shape:
            self.min_val, self.max_val = mn, mx
        else:
            self.min_val, self.max_val = torch.minimum(self.min_val, mn), torch.maximum(self.max_val, mx)
        self._update(rows, mn, mx)
        self.num_updates += 1

    def compute(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The clipping range ``(min, max)`` per row; CalibrationError when nothing was observed."""
        if self.num_updates == 0 or self.min_val is None:
            raise CalibrationError(f"{self.where}: observed no data (was the module called during calibration?)")
        return self._compute()

    def all_reduce(self) -> None:
        """Merge statistics across ranks of the default process group (no-op without one)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        if self.min_val is None or self.max_val is None:
            raise CalibrationError(f"{self.where}: observed no data on rank {dist.get_rank()}")
        dist.all_reduce(self.min_val, op=dist.ReduceOp.MIN)
        dist.all_reduce(self.max_val, op=dist.ReduceOp.MAX)
        self._reduce()

    # ---- subclass hooks ------------------------------------------------------------------------
    def _update(self, rows: torch.Tensor, mn: torch.Tensor, mx: torch.Tensor) -> None:
        pass

    def _compute(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.min_val is not None and self.max_val is not None  # checked by compute()
        return self.min_val, self.max_val

    def _reduce(self) -> None:
        pass


OBSERVERS: Registry[type[Observer]] = Registry("observer")


def build_observer(spec: QuantSpec, *, where: str = "quantizer") -> Observer:
    """The observer ``spec.observer`` with its validated ``observer_params``."""
    cls, params = check_observer(spec, where=where)
    return cls(spec, params, where=where)


def check_observer(spec: QuantSpec, *, where: str = "quantizer") -> tuple[type[Observer], BaseModel]:
    """The observer class ``spec`` names and its validated params, without building it: RecipeError
    for an unknown name, a bad ``observer_params`` value or a per-tensor observer on another
    granularity (the modifier specs call it when a recipe loads, not when the stage starts)."""
    cls = OBSERVERS.get(spec.observer)
    try:
        params = cls.Params.model_validate(spec.observer_params)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        raise RecipeError(f"{where}: observer '{spec.observer}' param '{field}': {err['msg']}") from None
    if cls.per_tensor_only and spec.granularity != "tensor":
        raise RecipeError(
            f"{where}: observer '{spec.observer}' supports granularity 'tensor' only (got '{spec.granularity}')"
        )
    return cls, params


@OBSERVERS.register("minmax")
class MinMaxObserver(Observer):
    """Running min and max."""


class EmaParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    momentum: float = Field(0.9, ge=0, lt=1)


@OBSERVERS.register("ema")
class EmaObserver(Observer):
    """Moving average of per-batch min and max (``momentum`` weights the past); for QAT."""

    Params = EmaParams

    def __init__(self, spec: QuantSpec, params: BaseModel, *, where: str = "quantizer") -> None:
        super().__init__(spec, params, where=where)
        self.ema_min: torch.Tensor | None = None
        self.ema_max: torch.Tensor | None = None

    def reset(self) -> None:
        super().reset()
        self.ema_min = self.ema_max = None

    def _update(self, rows: torch.Tensor, mn: torch.Tensor, mx: torch.Tensor) -> None:
        m = float(getattr(self.params, "momentum", 0.9))
        if self.ema_min is None or self.ema_max is None or self.ema_min.shape != mn.shape:
            self.ema_min, self.ema_max = mn.clone(), mx.clone()
        else:
            self.ema_min = m * self.ema_min + (1 - m) * mn
            self.ema_max = m * self.ema_max + (1 - m) * mx

    def _compute(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.ema_min is not None and self.ema_max is not None  # set by the first update
        return self.ema_min, self.ema_max

    def _reduce(self) -> None:
        assert self.ema_min is not None and self.ema_max is not None
        world = dist.get_world_size()
        for t in (self.ema_min, self.ema_max):
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
            t.div_(world)


# ---- histogram observers ---------------------------------------------------------------------------


class HistParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    bins: int = Field(2048, ge=64)


class HistogramObserver(Observer):
    """Fixed-size histograms of positive values and of negated negative values over ``[0, R]``."""

    Params = HistParams
    per_tensor_only = True

    def __init__(self, spec: QuantSpec, params: BaseModel, *, where: str = "quantizer") -> None:
        super().__init__(spec, params, where=where)
        self.bins = int(getattr(params, "bins", 2048))
        if self.bins % 2:
            raise RecipeError(f"{where}: observer '{spec.observer}' needs an even number of bins")
        self._clear()

    def _clear(self) -> None:
        self.edge = 0.0
        self.pos = torch.zeros(self.bins, dtype=torch.float64)
        self.neg = torch.zeros(self.bins, dtype=torch.float64)

    def reset(self) -> None:
        super().reset()
        self._clear()

    def _grow(self, amax: float) -> None:
        if self.edge == 0.0:
            self.edge = amax
            return
        while amax > self.edge:
            # doubling R merges bin pairs exactly
            self.pos = torch.cat([self.pos.view(-1, 2).sum(1), torch.zeros(self.bins // 2, dtype=torch.float64)])
            self.neg = torch.cat([self.neg.view(-1, 2).sum(1), torch.zeros(self.bins // 2, dtype=torch.float64)])
            self.edge *= 2.0

    def _update(self, rows: torch.Tensor, mn: torch.Tensor, mx: torch.Tensor) -> None:
        x = rows.reshape(-1)
        amax = float(max(-float(mn.min()), float(mx.max())))
        if amax == 0.0:
            self.pos[0] += x.numel()
            return
        self._grow(amax)
        pos = x[x >= 0]
        neg = -x[x < 0]
        self.pos += torch.histc(pos, bins=self.bins, min=0.0, max=self.edge).to(torch.float64).cpu()
        self.neg += torch.histc(neg, bins=self.bins, min=0.0, max=self.edge).to(torch.float64).cpu()

    def _reduce(self) -> None:
        edge = torch.tensor([self.edge], dtype=torch.float64, device=self._device())
        dist.all_reduce(edge, op=dist.ReduceOp.MAX)
        if float(edge) != self.edge:
            self._rebin(float(edge))
        for h in (self.pos, self.neg):
            t = h.to(self._device())
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
            h.copy_(t.cpu())

    def _rebin(self, edge: float) -> None:
        """Move counts onto a wider common range (ranks saw different ranges); bin resolution."""
        if self.edge > 0.0:
            idx = (self.centers() / (edge / self.bins)).floor().long().clamp(max=self.bins - 1)
            self.pos = torch.zeros_like(self.pos).index_add_(0, idx, self.pos)
            self.neg = torch.zeros_like(self.neg).index_add_(0, idx, self.neg)
        self.edge = edge

    def _device(self) -> torch.device:
        return self.min_val.device if self.min_val is not None else torch.device("cpu")

    def centers(self) -> torch.Tensor:
        width = self.edge / self.bins
        return (torch.arange(self.bins, dtype=torch.float64) + 0.5) * width

    def _clip(self, lo: float, hi: float) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.min_val is not None and self.max_val is not None
        lo = max(lo, float(self.min_val.min()))
        hi = min(hi, float(self.max_val.max()))
        dev = self.min_val.device
        return torch.tensor([lo], device=dev), torch.tensor([hi], device=dev)

    def _threshold_of(self, hist: torch.Tensor, fraction: float) -> float:
        """Upper edge of the first bin where the cumulative mass of ``hist`` reaches ``fraction``."""
        total = float(hist.sum())
        if total == 0.0:
            return 0.0
        cdf = torch.cumsum(hist, 0) / total
        idx = int(torch.searchsorted(cdf, torch.tensor([fraction], dtype=torch.float64)).clamp(max=self.bins - 1))
        return (idx + 1) * self.edge / self.bins


class PercentileParams(HistParams):
    percentile: float = Field(99.99, gt=50, le=100)


@OBSERVERS.register("percentile")
class PercentileObserver(HistogramObserver):
    """Clips each side at the given percentile of its magnitude distribution."""

    Params = PercentileParams

    def _compute(self) -> tuple[torch.Tensor, torch.Tensor]:
        frac = float(getattr(self.params, "percentile", 99.99)) / 100.0
        if self.spec.symmetric:
            t = self._threshold_of(self.pos + self.neg, frac)
            return self._clip(-t, t)
        return self._clip(-self._threshold_of(self.neg, frac), self._threshold_of(self.pos, frac))


class EntropyParams(HistParams):
    stride: int = Field(8, ge=1)


@OBSERVERS.register("entropy")
class EntropyObserver(HistogramObserver):
    """TensorRT's KL-divergence calibration on the magnitude histogram: the threshold whose
    quantized distribution diverges least from the observed one."""

    Params = EntropyParams

    def _compute(self) -> tuple[torch.Tensor, torch.Tensor]:
        hist = (self.pos + self.neg).numpy()
        has_neg = float(self.neg.sum()) > 0
        levels = (self.spec.qmax - self.spec.qmin + 1) // (2 if (self.spec.symmetric or has_neg) else 1)
        t = _kl_threshold(hist, self.edge, levels, int(getattr(self.params, "stride", 8)))
        return self._clip(-t, t)


def _kl_threshold(hist: Any, edge: float, levels: int, stride: int) -> float:
    import numpy as np

    bins = len(hist)
    hist = np.array(hist, dtype=np.float64)
    # the spike of exact zeros (ReLU outputs, padding) would dominate the divergence and pull the
    # threshold far down; like TensorRT's calibrator, give bin 0 its neighbour's count
    hist[0] = hist[1]
    nz = np.nonzero(hist)[0]
    if len(nz) == 0:
        return 0.0
    last = int(nz[-1]) + 1
    if last <= levels:
        return last * edge / bins
    best_i, best_kl = last, math.inf
    for i in range(levels, last + 1, stride):
        p = hist[:i].astype(np.float64).copy()
        p[i - 1] += hist[i:].sum()
        # merge i bins into `levels` quantized bins, then expand back over the non-empty bins
        idx = (np.arange(i) * levels) // i
        nonzero = (hist[:i] != 0).astype(np.float64)
        qsum = np.bincount(idx, weights=hist[:i], minlength=levels)
        qcnt = np.bincount(idx, weights=nonzero, minlength=levels)
        q = np.where(nonzero > 0, qsum[idx] / np.maximum(qcnt[idx], 1), 0.0)
        ps, qs = p.sum(), q.sum()
        if qs == 0:
            continue
        pn, qn = p / ps, q / qs
        mask = pn > 0
        # bins where p > 0 but q == 0 (only the clipped last bin can be) get a tiny q
        kl = float(np.sum(pn[mask] * np.log(pn[mask] / np.maximum(qn[mask], 1e-12))))
        if kl < best_kl:
            best_kl, best_i = kl, i
    return (best_i + 0.5) * edge / bins


class MseParams(HistParams):
    candidates: int = Field(100, ge=2)
    min_ratio: float = Field(0.3, gt=0, le=1)


@OBSERVERS.register("mse")
class MseObserver(HistogramObserver):
    """Searches clipping ranges (a shrink factor of the observed range) for the least mean-squared
    quantization error. Per tensor it searches the histogram; per channel or group (weights) it
    searches the latest tensor row by row, so memory stays that of one tensor."""

    Params = MseParams
    per_tensor_only = False

    def __init__(self, spec: QuantSpec, params: BaseModel, *, where: str = "quantizer") -> None:
        super().__init__(spec, params, where=where)
        self.last: torch.Tensor | None = None

    def reset(self) -> None:
        super().reset()
        self.last = None

    def _update(self, rows: torch.Tensor, mn: torch.Tensor, mx: torch.Tensor) -> None:
        if self.spec.granularity == "tensor":
            super()._update(rows, mn, mx)
        else:
            self.last = rows

    def _ratios(self) -> torch.Tensor:
        n = int(getattr(self.params, "candidates", 100))
        lo = float(getattr(self.params, "min_ratio", 0.3))
        return torch.linspace(lo, 1.0, n)

    def _compute(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.min_val is not None and self.max_val is not None
        s = self.spec
        ratios = self._ratios()
        if s.granularity != "tensor":
            if self.last is None:
                return self.min_val, self.max_val
            x = self.last
            best_err = torch.full_like(self.min_val, math.inf)
            best = torch.ones_like(self.min_val)
            for r in ratios.tolist():
                scale, zp = qparams_from_range(
                    self.min_val * r, self.max_val * r, qmin=s.qmin, qmax=s.qmax, symmetric=s.symmetric
                )
                err = (fake_quantize(x, scale[:, None], zp[:, None], s.qmin, s.qmax) - x).pow(2).sum(1)
                better = err < best_err
                best_err = torch.where(better, err, best_err)
                best = torch.where(better, torch.full_like(best, r), best)
            return self.min_val * best, self.max_val * best
        c = self.centers()
        xs = torch.cat([-c.flip(0), c])
        w = torch.cat([self.neg.flip(0), self.pos])
        mn, mx = float(self.min_val.min()), float(self.max_val.max())
        best_r, best_sse = 1.0, math.inf
        for r in ratios.tolist():
            scale, zp = qparams_from_range(
                torch.tensor(mn * r), torch.tensor(mx * r), qmin=s.qmin, qmax=s.qmax, symmetric=s.symmetric
            )
            xq = fake_quantize(xs.float(), scale, zp, s.qmin, s.qmax).double()
            sse = float((w * (xq - xs).pow(2)).sum())
            if sse < best_sse:
                best_r, best_sse = r, sse
        return self._clip(mn * best_r, mx * best_r)
