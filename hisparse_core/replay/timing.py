"""Where a replay step's time goes: wall time per phase, accumulated over one step."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

#: The phases of a step, in the order the report lists them. `decode` is the resolve, gather and
#: follower replay of every index group (a CUDA graph replay where one is captured), timed on the
#: device; the others are host wall time (on a GPU, what the host spends issuing the work).
PHASES = ("coordinator", "worker", "forward", "indexer", "decode", "check")


class PhaseTimer:
    """`with timer.phase("worker"): ...` adds the block's wall time to that phase of this step."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - t0

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] += seconds

    def take(self) -> dict[str, float]:
        """This step's seconds per phase; starts the next step at zero."""
        out, self.seconds = self.seconds, dict.fromkeys(PHASES, 0.0)
        return out
