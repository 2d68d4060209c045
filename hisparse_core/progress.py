"""A tiny progress bar on stderr for long CLI work (no third-party dependency).

It redraws one line in place when stderr is a terminal and prints a few plain milestone lines
otherwise (CI logs stay short). `enabled=False` makes every call a no-op.

The ETA is the rate since the first unit finished (the first carries the warm-up: allocation,
compilation, caches), and is shown only once `ETA_AFTER` units have been timed that way: an ETA
from one step is a guess, often off by orders of magnitude. Work whose units differ in cost (the
steps of several runs, one several times slower) passes `eta=False`: a rate from the first units
would be off by that factor.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any, TextIO

#: Units timed after the first one before an ETA is shown.
ETA_AFTER = 3


#: Whether Python swallowed a KeyboardInterrupt while `interrupts_kept` is active (cleared when it exits).
_INTERRUPT = {"pending": False}


def raise_pending_interrupt() -> None:
    """Raise KeyboardInterrupt, once, if Python swallowed one under `interrupts_kept`."""
    if _INTERRUPT["pending"]:
        _INTERRUPT["pending"] = False
        raise KeyboardInterrupt


@contextmanager
def interrupts_kept() -> Iterator[None]:
    """Ctrl-C is never lost while this is active. Python raises the KeyboardInterrupt wherever the
    main thread is; where that is a weakref callback or a `__del__` (an import's module-lock
    callback, a tensor's finalizer) it cannot propagate: Python hands it to `sys.unraisablehook`,
    which printed "Exception ignored in ... KeyboardInterrupt" with a traceback, and the run went on
    to its end and exit status 0. Here that hook records it instead (printing nothing), and
    `ProgressBar.update` (each step) and `raise_pending_interrupt` raise it again."""
    previous_hook = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            _INTERRUPT["pending"] = True   # raised again at the next step
            return
        previous_hook(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous_hook
        _INTERRUPT["pending"] = False


class ProgressBar:
    """`with ProgressBar(total, "decode") as bar: ... bar.update(1, note="hit 87%")`."""

    def __init__(self, total: int, label: str, *, enabled: bool = True, stream: TextIO | None = None,
                 width: int = 30, min_interval_s: float = 0.1, eta: bool = True) -> None:
        if total < 0:
            raise ValueError(f"ProgressBar total must be >= 0, got {total}")
        self.total = total
        self.label = label
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.min_interval_s = min_interval_s
        self.shows_eta = eta
        self.done = 0
        self.note = ""
        self._start = time.perf_counter()
        self._first: tuple[float, int] | None = None  # (when, done) once the first unit finished
        self._last_draw = 0.0
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._next_milestone = 0  # quarter marks printed when not a terminal

    def update(self, n: int = 1, *, note: str | None = None) -> None:
        raise_pending_interrupt()   # a Ctrl-C Python swallowed since the last step (`interrupts_kept`)
        self.done = min(self.total, self.done + n)
        if note is not None:
            self.note = note
        if not self.enabled:
            return
        now = time.perf_counter()
        if self._first is None and self.done > 0:
            self._first = (now, self.done)
        if self._tty:
            if now - self._last_draw >= self.min_interval_s or self.done == self.total:
                self._draw(now, end="")
        else:
            quarter = (4 * self.done) // self.total if self.total else 4
            if quarter >= self._next_milestone:
                self._draw(now, end="\n")
                self._next_milestone = quarter + 1

    def _draw(self, now: float, end: str) -> None:
        self._last_draw = now
        frac = self.done / self.total if self.total else 1.0
        filled = int(frac * self.width)
        elapsed = now - self._start
        eta = self.eta(now)
        bar = "#" * filled + "-" * (self.width - filled)
        text = (f"{self.label} [{bar}] {self.done}/{self.total} {elapsed:5.1f}s"
                + (f" eta {eta:4.1f}s" if eta is not None else "")
                + (f"  {self.note}" if self.note else ""))
        prefix = "\r\x1b[2K" if self._tty else ""
        self.stream.write(prefix + text + end)
        self.stream.flush()

    def eta(self, now: float | None = None) -> float | None:
        """Seconds left at the rate since the first unit, or None until `ETA_AFTER` units after
        it were timed (and once everything is done, and always where made with `eta=False`)."""
        if not self.shows_eta or self._first is None or self.done >= self.total:
            return None
        since, at = self._first
        timed = self.done - at
        if timed < ETA_AFTER:
            return None
        now = time.perf_counter() if now is None else now
        return (now - since) / timed * (self.total - self.done)

    def close(self) -> None:
        if self.enabled and self._tty:
            self._draw(time.perf_counter(), end="\n")
            self._tty = False  # drawn for the last time

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
