"""How long things take, told to a person: rounded figures and ETAs for the log lines a run prints
once per epoch, per stage or per layer (progress bars cover the steps in between on a terminal)."""

from __future__ import annotations

import time

#: the toolkit's top-level loggers (a run sends them to run.log; the CLI to the console)
LOGGERS = ("compress", "quantization", "pruning", "distillation", "export")


def fig(x: float | None) -> str:
    """A figure as a person reads it: 4 significant digits, ``-`` for none."""
    return "-" if x is None else f"{x:.4g}"


def seconds(s: float) -> str:
    """A duration: ``42 s``, ``3 min 05 s``, ``1 h 02 min``."""
    s = max(0.0, s)
    if s < 60:
        return f"{s:.0f} s" if s >= 10 else f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60):02d} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min"


class Eta:
    """Elapsed time and the time left after ``done`` of ``total`` equal units of work."""

    def __init__(self, total: int) -> None:
        self.total = max(int(total), 1)
        self.t0 = time.perf_counter()

    def line(self, done: int) -> str:
        """``12 s, ETA 36 s`` (``12 s`` alone when done)."""
        elapsed = time.perf_counter() - self.t0
        if done >= self.total or done <= 0:
            return seconds(elapsed)
        return f"{seconds(elapsed)}, ETA {seconds(elapsed / done * (self.total - done))}"
