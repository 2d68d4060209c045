"""One acknowledgement schedule for every backend, so a replay's figures do not depend on copy timing.

A transfer engine reports a copy completed when it observes it done: `reference_cpu` one poll
after its enqueue (`completion_lag`), a GPU backend whenever its event has fired, which may be the
same poll as the enqueue or a later one. The coordinator acts on completions (a spilled page
becomes releasable, a published prefix becomes a hit), so the schedule would change hit rates,
misses and bytes between backends and between runs.

The replay therefore drains the transfer engine every step (`build_metadata(wait=True)`: every
copy submitted so far is enqueued and done) and `StepAcks` holds back the completions of what was
submitted in the same step until the next one. Every backend then shows the coordinator the same
schedule: enqueued in the step that submitted it, completed one step later (what `reference_cpu`
reports with its default lag of one poll).
"""

from __future__ import annotations

from collections.abc import Collection

from hisparse_core.types import WorkerMetadata


class StepAcks:
    """Completions of the current step's submissions, held for one step."""

    def __init__(self) -> None:
        self._held = WorkerMetadata()

    def settle(self, drained: WorkerMetadata, transfers: Collection[int], host_copies: Collection[int]) -> WorkerMetadata:
        """What the coordinator sees this step, from a drained report and the transfer ids and host
        copy destinations submitted in this step."""
        now = {t: n for t, n in drained.completed.items() if t not in transfers}
        later = {t: n for t, n in drained.completed.items() if t in transfers}
        copies_now = [c for c in drained.completed_host_copies if c not in host_copies]
        copies_later = [c for c in drained.completed_host_copies if c in host_copies]
        out = WorkerMetadata(drained.enqueued, now, tuple(copies_now)).aggregate(self._held)
        self._held = WorkerMetadata({}, later, tuple(copies_later))
        return out
