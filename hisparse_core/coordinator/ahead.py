"""Planning the next step while the device runs this one.

Between two forwards an engine runs its offload bookkeeping: its GPU allocations for the pages
the next step writes, `schedule_step`, the table writes and `worker.start_step`. Done there, the
device waits for it. When the next step is predictable (every running request decodes one more
token, nobody arrives or leaves), that work can run as soon as this step's forward is launched
and its acknowledgements are applied, while the device is still busy: `StepAhead` runs it then
and keeps the started step until the engine's next step claims it.

The coordinator sees the same calls in the same order either way (this step's acknowledgements,
then the next step's allocations and `schedule_step`), so its commands, and with them every row
the device reads, are the same; only the moment the host does the work moves. The scheduler-side
contract is untouched: releases still wait for enqueue acknowledgements and publication for
completions, and nothing here waits on the device.

- `plan(key, prepare)` runs at once: `prepare()` makes the engine's allocations, runs
  `schedule_step` and writes the table deltas (the engine's own code, the same its unplanned steps
  run) and returns the command; then the worker's `start_step`. `key` says which step this is
  (say the batch and its padded length).
- `claim(key)` at the next step: True when the planned step is this one (it has started: run the
  forward). A different key cancels the planned step (False: plan this one as usual).
- `cancel()`: the planned step will not run (the batch ended, a forward of another shape came).
  The worker's step is closed with nothing written. The coordinator mirrored rows that no forward
  wrote; they lie at or beyond each request's `num_computed_tokens`, so they are never sealed,
  and the step that does write them mirrors them again (the coordinator re-mirrors any row that a
  step recomputes below what it mirrored, as for rejected speculative tokens).

An exception while planning is kept, not raised, and `claim` raises it at the next step (the same
exception, with a note naming the planned step; the coordinator's and the engine's messages name
the request). `schedule_step` changes nothing when it raises, so the only state a failed plan can
leave is the engine's allocations: `prepare` records them where the engine finds them (its block
tables), so the next step reuses them or closing the batch returns them, as after a step of its
own that failed. A `prepare` that fails after its `schedule_step` returned has a scheduled step
the coordinator counts on (its spills, its acknowledgements): `prepare` must start and close that
worker step itself, with nothing written, as `cancel` does, before it raises (the transformers
engine's `_plan_next` does); the exception is then kept and raised at `claim` as above.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable

from hisparse_core.types import OffloadCommand

logger = logging.getLogger(__name__)

#: Makes a step's allocations, runs `schedule_step` and writes the table deltas; returns the command.
PrepareStep = Callable[[], OffloadCommand | None]
#: Starts the worker's step with its command (`HiSparseWorker.start_step`).
StartStep = Callable[[OffloadCommand | None], None]
#: Closes a started worker step after its forward (`HiSparseWorker.after_forward`).
CloseStep = Callable[[], None]


class StepAhead:
    """One planned-ahead step of an engine built on `HiSparseCoordinator` (see the module docstring)."""

    def __init__(self, *, start_step: StartStep, close_step: CloseStep) -> None:
        self._start_step = start_step
        self._close_step = close_step
        self._key: Hashable | None = None
        self._started = False
        self._error: Exception | None = None
        self._command: OffloadCommand | None = None
        self.planned = 0        # steps planned ahead
        self.claimed = 0        # of them, run as planned
        self.cancelled = 0      # of them, dropped (closed with nothing written)
        self.failed = 0         # of them, failed while planning

    @property
    def pending(self) -> bool:
        """A planned step (or its failure) waits for the next step."""
        return self._key is not None

    @property
    def command(self) -> OffloadCommand | None:
        """The command of the step last claimed (None: a step without offload work)."""
        return self._command

    def plan(self, key: Hashable, prepare: PrepareStep) -> None:
        """Plan and start the step `key` now (see the module docstring). A failure of `prepare` or
        of the worker's `start_step` is not raised here but by the next `claim`."""
        if key is None:
            raise ValueError("a planned step needs a key other than None")
        self.cancel()
        self.planned += 1
        try:
            command = prepare()
            self._start_step(command)
        except Exception as exc:  # noqa: BLE001 - kept for the next step, which raises it
            exc.add_note(f"hisparse: raised while planning step {key!r} ahead, as the device ran the step before")
            self._key, self._error = key, exc
            self.failed += 1
            logger.debug("hisparse: planning step %r ahead failed: %s: %s", key, type(exc).__name__, exc)
            return
        self._key, self._started, self._command = key, True, command

    def claim(self, key: Hashable) -> bool:
        """At the start of a step: True if the planned step is this one (already started). Raises
        the failure of a step planned ahead; a planned step of another key is cancelled."""
        if self._key is None:
            return False
        error, self._error = self._error, None
        if error is not None:
            self._key = None
            raise error
        if self._key == key:
            self._key, self._started = None, False
            self.claimed += 1
            return True
        self.cancel()
        return False

    def cancel(self) -> None:
        """Drop the planned step: close the worker's started step with nothing written. A
        planning failure kept for it is logged and dropped (no step of its own will run)."""
        if self._key is None:
            return
        key, self._key = self._key, None
        error, self._error = self._error, None
        if error is not None:
            logger.warning("hisparse: step %r was planned ahead and failed, but never ran: %s: %s", key,
                           type(error).__name__, error)
            return
        if self._started:
            self._started = False
            self.cancelled += 1
            self._close_step()
