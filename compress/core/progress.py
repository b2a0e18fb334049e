"""How long things take, told to a person: rounded figures and ETAs for the log lines a run prints
once per epoch, per stage or per layer (progress bars cover the steps in between on a terminal),
and the one mechanism every long loop reports its progress through (:func:`bar`, :func:`report`,
:func:`scope`), from the CLI and from a plain Python caller alike."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ParamSpec, TypeVar

T = TypeVar("T")
P = ParamSpec("P")
R = TypeVar("R")

#: the toolkit's top-level loggers (a run sends them to run.log; the CLI to the console)
LOGGERS = ("compress",)  # every package is compress.<name>: one parent logger


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


# ---- one progress mechanism for every long loop -----------------------------------------------------
#
# Calibration batches, GPTQ/AWQ's decoder layers, SmoothQuant's groups, pruning steps and training
# epochs report through :func:`bar` (a tqdm bar, on a terminal only) and :func:`report` (a log line per
# layer, step or epoch). The lines are ordinary ``logging`` records of the toolkit's loggers: where
# nobody configured logging (a plain Python caller: neither those loggers nor the root logger has a
# handler), :func:`ensure_console` gives them one stderr handler at INFO, as loguru does for
# llm-compressor; once the caller (or the CLI) configures logging, theirs is used alone.
# ``progress=False`` on a one-shot call, or ``with scope(False):`` around any code, silences both.

_ON: contextvars.ContextVar[bool] = contextvars.ContextVar("compress_progress", default=True)
_BARS = {"on": True}  # process-wide: the CLI's --quiet turns the bars off, its log lines stay in run.log


def main_rank() -> bool:
    """Whether this process speaks: rank 0 under torchrun (``RANK``), or no torchrun."""
    try:
        return int(os.environ.get("RANK", "0") or 0) == 0
    except ValueError:
        return True


def enabled() -> bool:
    """Whether progress is on here (no ``progress=False`` / ``scope(False)`` around this code)."""
    return _ON.get()


@contextlib.contextmanager
def scope(on: bool = True) -> Iterator[None]:
    """Progress on (``on=True``, the default) or off inside the block; off stays off in nested
    scopes (a ``progress=True`` call inside ``scope(False)`` is silent). Makes the console handler
    ready (:func:`ensure_console`): every public long-running call enters one."""
    token = _ON.set(_ON.get() and bool(on))
    try:
        ensure_console()
        yield
    finally:
        _ON.reset(token)


def with_progress(fn: Callable[P, R]) -> Callable[P, R]:
    """Run each call of ``fn`` inside :func:`scope` of its ``progress`` keyword (default True): what
    a public long-running call (``compress.gptq(..., progress=False)``) declares it with."""

    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        with scope(bool(kwargs.get("progress", True))):
            return fn(*args, **kwargs)

    return call


def show_bars(on: bool) -> None:
    """Process-wide: draw progress bars (on a terminal) or not; the CLI's ``--quiet`` turns them off."""
    _BARS["on"] = bool(on)


@contextlib.contextmanager
def bars_off(off: bool = True) -> Iterator[None]:
    """No progress bars inside the block when ``off`` (``compress.apply(quiet=True)``); the lines stay."""
    before = _BARS["on"]
    _BARS["on"] = before and not off
    try:
        yield
    finally:
        _BARS["on"] = before


def bar(items: Iterable[T], *, desc: str, total: int | None = None, cap: int | None = None,
        unit: str = "it") -> Iterable[T]:
    """``items`` under a tqdm bar on a terminal (rank 0, progress on); ``items`` as they are otherwise
    (redirected, every bar update would be a line in the file: :func:`report`'s lines stand in).
    ``total``: the count when ``items`` has no ``len``; ``cap``: the loop stops after that many."""
    if not (_ON.get() and _BARS["on"] and main_rank() and _isatty()):
        return items
    from tqdm import tqdm

    if isinstance(items, tqdm) or isinstance(getattr(items, "data", None), tqdm):
        return items  # under a bar already (compress apply's calibration batches, which --quiet turns off)
    if total is None:
        try:
            total = len(items)  # type: ignore[arg-type]
        except TypeError:
            total = None
    total = min(total, cap) if total is not None and cap is not None else (total if total is not None else cap)
    return tqdm(items, desc=desc, total=total, leave=False, unit=unit, dynamic_ncols=True)


def track(items: Sequence[T], *, logger: logging.Logger, desc: str, unit: str, lines: int = 10) -> Iterator[T]:
    """``items`` under :func:`bar`, with a :func:`report` line after each tenth (``lines``) of them is
    done (``smoothquant: 12/120 groups, 3.1 s, ETA 28 s``): for loops of many short units, where a
    line per unit would flood the log."""
    n = len(items)
    eta = Eta(n)
    for k, item in enumerate(bar(items, desc=desc, unit=unit), 1):
        yield item  # the loop's body runs here; the line follows it
        if k * lines // n != (k - 1) * lines // n:
            report(logger, "%s: %d/%d %ss, %s", desc, k, n, unit, eta.line(k))


def report(logger: logging.Logger, msg: str, *args: Any) -> None:
    """One progress line (a layer, a step, an epoch done) on ``logger``: INFO while progress is on,
    DEBUG when it is off. Drawn above any open bar, not through it, whichever handler writes it."""
    if not _ON.get():
        logger.debug(msg, *args)
        return
    ensure_console()
    with _around_bars():
        logger.info(msg, *args)


@contextlib.contextmanager
def _around_bars() -> Iterator[None]:
    """Clear the open tqdm bars for a write to the console, and draw them again after it."""
    tqdm_mod = sys.modules.get("tqdm")
    if tqdm_mod is None or not getattr(tqdm_mod.tqdm, "_instances", None):
        yield
        return
    with tqdm_mod.tqdm.external_write_mode(file=sys.stderr):
        yield


class ConsoleHandler(logging.StreamHandler):
    """A stderr handler whose lines go above the open progress bars instead of into them (the CLI's
    console and the default one below)."""

    def emit(self, record: logging.LogRecord) -> None:
        with _around_bars():
            super().emit(record)


def _isatty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced by an object without isatty, or closed
        return False


class _Console(ConsoleHandler):
    """The toolkit loggers' stderr handler where nobody configured logging: INFO and up from rank 0
    (errors from every rank), nothing below WARNING while progress is off, nothing at all once a
    handler of the caller's exists (they configured logging after it was installed)."""

    #: as the CLI's console prints: redirected to a file, each line starts with the time
    _FORMATS = {tty: logging.Formatter(("" if tty else "%(asctime)s ") + "%(levelname)s %(name)s: %(message)s",
                                       datefmt="%H:%M:%S") for tty in (True, False)}

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr  # the stderr of now (tests and notebooks replace it)
        self.setFormatter(self._FORMATS[_isatty()])
        super().emit(record)

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "file_only", False) or _configured():
            return False
        if record.levelno < logging.ERROR and not main_rank():
            return False
        if record.levelno < logging.WARNING and not _ON.get():
            return False
        return bool(super().filter(record))


_CONSOLE = _Console()
_RAISED: list[str] = []  # the toolkit loggers whose level ensure_console set to INFO (they had none)


def _configured() -> bool:
    """Whether the caller (or the CLI) configured logging: the root logger or a toolkit logger has a
    handler other than ours (a run's run.log file handler does not count: it is no console)."""
    if logging.getLogger().handlers:
        return True
    return any(h is not _CONSOLE and type(h) is not logging.FileHandler
               for name in LOGGERS for h in logging.getLogger(name).handlers)


def ensure_console() -> None:
    """Make the toolkit's INFO lines visible where nobody configured logging: one stderr handler on
    its loggers, and INFO on those of them without a level of their own (while the root logger keeps
    its default level). Where logging is configured, ours is taken off again, and levels it set are
    put back, so no line is printed twice and the caller's levels and handlers decide."""
    root = logging.getLogger()
    installed = _CONSOLE in logging.getLogger(LOGGERS[0]).handlers
    if _configured():
        if installed:
            for name in LOGGERS:
                logging.getLogger(name).removeHandler(_CONSOLE)
            for name in _RAISED:
                lg = logging.getLogger(name)
                if lg.level == logging.INFO:
                    lg.setLevel(logging.NOTSET)
            _RAISED.clear()
        return
    if installed:
        return
    for name in LOGGERS:
        lg = logging.getLogger(name)
        lg.addHandler(_CONSOLE)
        if lg.level == logging.NOTSET and root.level == logging.WARNING:
            lg.setLevel(logging.INFO)
            _RAISED.append(name)
