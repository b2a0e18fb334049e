"""benchmarks/_results.py's interval for a median, which decides whether a benchmarked file is
slower than fp32 (benchmarks/real_models.py)."""

from __future__ import annotations

import random

import pytest

from benchmarks._results import median_interval
from benchmarks.real_models import _verdict, _versus


@pytest.mark.parametrize("n", [7, 21, 60])
def test_median_interval_covers_the_true_median_at_its_level(n: int) -> None:
    rng = random.Random(n)
    trials, hits, widths = 2000, 0, []
    for _ in range(trials):
        xs = [rng.lognormvariate(0.0, 0.1) for _ in range(n)]  # median exp(0) = 1
        lo, hi = median_interval(xs)
        hits += lo <= 1.0 <= hi
        widths.append(hi - lo)
    cover = hits / trials
    # order statistics give at least the level asked for, and not the whole range once n allows less
    assert 0.95 <= cover <= (0.995 if n > 7 else 1.0)
    assert sum(widths) / trials < (0.2 if n >= 21 else 0.5)


def test_median_interval_order_statistics() -> None:
    assert median_interval([5.0, 1.0, 3.0, 2.0, 4.0, 7.0, 6.0]) == (1.0, 7.0)  # n=7: the range (98.4%)
    assert median_interval([float(x) for x in range(21)]) == (5.0, 15.0)  # P(Bin(21, 1/2) <= 5) = 1.3%
    assert median_interval([2.0]) == (2.0, 2.0)
    with pytest.raises(ValueError):
        median_interval([])


def test_verdict_needs_the_interval_off_one() -> None:
    assert _verdict([0.9, 0.95, 0.97, 0.96, 0.93, 0.94, 0.98]) == "slower"
    assert _verdict([0.9, 0.95, 0.97, 0.96, 0.93, 0.94, 1.02]) == "level"  # one round above 1 at n=7
    assert _verdict([1.1, 1.2, 1.05, 1.3, 1.15, 1.12, 1.01]) == "faster"


def test_versus_pairs_two_files_round_by_round() -> None:
    # each round's fp32/file ratios: compress 1.5x and quantize_static 1.0x while the machine's speed
    # shifts between rounds (both ratios move together); round by round compress is 1.5x ahead
    ours = [1.5 * f for f in (1.0, 0.8, 1.2, 0.9, 1.1, 1.05, 0.95)]
    theirs = [1.0 * f for f in (1.0, 0.8, 1.2, 0.9, 1.1, 1.05, 0.95)]
    v = _versus(ours, theirs)
    assert v["ratio"] == 1.5 and v["interval"] == [1.5, 1.5] and v["verdict"] == "faster"
    assert _versus(theirs, ours)["verdict"] == "slower"
    assert _versus(ours, [o * r for o, r in zip(ours, (0.9, 1.1, 0.95, 1.05, 1.0, 0.98, 1.02))])["verdict"] == "level"
