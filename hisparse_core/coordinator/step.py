"""Step planning: the scheduled requests of one `schedule_step` become the step's `OffloadCommand`
and its source/hot table deltas.

Two phases, so that a bad step changes nothing:

1. `StepPlanner.validate` checks every scheduled request (admitted, counts that are ints >= 0,
   within `max_model_len`, no rewrite of a sealed page, engine block ids in range for the pages
   the coordinator takes over) and the step as a whole (no request or state row twice, no
   request both scheduled and leaving, enough host blocks for the new pages). It changes no
   state. Decode-like requests (rows inside one known page, nothing to seal, restore or resend)
   get their row mirror built right there; the rest become `RequestPlan`s.
2. `StepPlanner.apply`, after the leaving requests are gone, allocates the host blocks for new
   pages first, in one call (the only step of `apply` that can run out of host blocks, so a
   step is refused whole or applied whole), then mirrors the rows the host does not have, seals and spills the pages that
   `num_computed_tokens` covers, restores partial pages that came from host, runs the residency
   policy and assembles the command.

A sealed page whose hash is already published, or whose spill another request has in flight
(requests sharing an engine-side prefix seal the same pages), is not spilled again: the request
takes that host block (`_share_spilled_page`), so each distinct page is copied once. The swap
never costs an allocatable block: it is skipped (the page spills to its own block) when it would
take a cached block while its own block stays pinned. So a step takes exactly the host blocks its
validation counted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from itertools import islice
from operator import attrgetter

from hisparse_core.coordinator.acks import advance_publication
from hisparse_core.coordinator.config import CoordinatorConfig
from hisparse_core.coordinator.engine import GpuBlockAllocator, ScheduledRequest
from hisparse_core.coordinator.host_blocks import HostBlockPool
from hisparse_core.coordinator.outputs import TableUpdate
from hisparse_core.coordinator.pages import DIRTY, LOST, PENDING, PINNED, RequestPages, unknown_request
from hisparse_core.coordinator.policy import ResidencyPolicy
from hisparse_core.coordinator.prefix import chain_hashes
from hisparse_core.coordinator.spill import HostCopyLedger, TransferKind, TransferLedger
from hisparse_core.errors import CapacityError, InvalidInputError
from hisparse_core.types import OffloadCommand, PageTransfer, ResidencyUpdate, RowMirror

#: One scheduled request that needs more than a row mirror: (record, view, state index,
#: num_computed_tokens, tokens after the step, pages after the step).
RequestPlan = tuple[RequestPages, ScheduledRequest, int, int, int, int]
#: A validated step: (decode-like requests, their mirrored length after the step, their row
#: mirrors, the other requests' plans).
StepPlan = tuple[list[RequestPages], list[int], list[RowMirror], list[RequestPlan]]

_REQUEST_ID = attrgetter("request_id")
_STATE_INDEX = attrgetter("state_index")
_SET_NUM_MIRRORED = RequestPages.__dict__["num_mirrored"].__set__
# The decode fast path builds its mirrors as `RowMirror.trusted` does, inlined (a call per mirror
# is a third of its cost): these are the slot descriptors of the frozen dataclass.
_SET_SOURCE_STARTS = RowMirror.__dict__["source_starts"].__set__
_SET_DESTINATION_START = RowMirror.__dict__["destination_start"].__set__
_SET_NUM_ROWS = RowMirror.__dict__["num_rows"].__set__


class StepPlanner:
    """Validates a step and turns it into the workers' command; shares the coordinator's state."""

    def __init__(self, config: CoordinatorConfig, gpu: GpuBlockAllocator, host: HostBlockPool,
                 policy: ResidencyPolicy, transfers: TransferLedger, copies: HostCopyLedger,
                 requests: dict[str, RequestPages]) -> None:
        self._config = config
        self._gpu = gpu
        self._host = host
        self._policy = policy
        self._transfers = transfers
        self._copies = copies
        self._requests = requests
        self._bs = config.block_size
        self._groups = config.num_resident_groups
        self._max_tokens = config.max_pages_per_request * config.block_size
        self.spills = 0
        self.shared_spills = 0  # sealed pages another request's spill (done or in flight) covered
        self.restores = 0
        #: Check steps in bulk first (`_validate_bulk`); False checks each request (tests compare both).
        self.bulk = True

    # -- phase 1: validation -----------------------------------------------------------------

    def validate(self, scheduled: Sequence[ScheduledRequest], leaving: set[str]) -> StepPlan:
        """Check the step and split it (see the module docstring). Changes no state, so a bad
        request leaves everything as it was.

        A first pass (`_validate_bulk`) reads each request's decode cursor instead of its pages;
        a step it does not pass in full is checked again request by request (`_validate_each`),
        which names the first bad request. Both give the same plan for a good step."""
        if self.bulk:
            step = self._validate_bulk(scheduled, leaving)
            if step is not None:
                return step
        return self._validate_each(scheduled, leaving)

    def _validate_bulk(self, scheduled: Sequence[ScheduledRequest], leaving: set[str]) -> StepPlan | None:
        """The checks of `_validate_each` in one tight pass; None when any fails, so that
        `_validate_each` finds and names the bad value.

        A request is decode-like (`_validate_each`'s fast path) exactly when it starts at the row
        its decode cursor expects (`num_mirrored`), keeps its state row, and writes at least one
        row, all inside the cursor's page (`RequestPages.refresh_decode_cursor`); that also
        implies every range check of `_validate_each` but the token count. Its mirror comes from
        the cursor: the same values `_validate_each` reads from the request's pages."""
        get = self._requests.get
        new = object.__new__
        set_src, set_dst, set_rows = _SET_SOURCE_STARTS, _SET_DESTINATION_START, _SET_NUM_ROWS
        single_group = self._groups == 1
        fast_recs: list[RequestPages] = []
        fast_ends: list[int] = []
        mirrors: list[RowMirror] = []
        slow: list[tuple[ScheduledRequest, RequestPages]] = []
        for req in scheduled:
            rec = get(req.request_id)
            nc = req.num_computed_tokens
            nn = req.num_new_tokens
            si = req.state_index
            if rec is None or type(nc) is not int or type(nn) is not int or type(si) is not int:
                return None
            end = nc + nn
            if (nc == rec.num_mirrored and si == rec.state_index and nc < end <= rec.decode_end
                    and nc <= len(req.token_ids)):
                m = new(RowMirror)
                set_src(m, (rec.decode_src[0] + nc,) if single_group else tuple(d + nc for d in rec.decode_src))
                set_dst(m, rec.decode_dst + nc)
                set_rows(m, nn)
                mirrors.append(m)
                fast_recs.append(rec)
                fast_ends.append(end)
            else:
                slow.append((req, rec))
        n = len(scheduled)
        rids = set(map(_REQUEST_ID, scheduled))
        if len(rids) != n or len(set(map(_STATE_INDEX, scheduled))) != n or (leaving and not leaving.isdisjoint(rids)):
            return None
        bs, max_tokens = self._bs, self._max_tokens
        plans: list[RequestPlan] = []
        host_needed = 0
        for req, rec in slow:
            si, nc = req.state_index, req.num_computed_tokens
            end = nc + req.num_new_tokens
            if (si < 0 or nc < 0 or end < nc or end > max_tokens or nc < rec.num_sealed * bs
                    or nc > len(req.token_ids)):
                return None
            host_needed += self._plan_growth(plans, rec, req, si, nc, end)
        if host_needed > self._host.num_free:
            self._no_host_room(host_needed)
        return fast_recs, fast_ends, mirrors, plans

    def _validate_each(self, scheduled: Sequence[ScheduledRequest], leaving: set[str]) -> StepPlan:
        """The checks request by request, in order: the first bad value raises, named."""
        bs, groups = self._bs, self._groups
        single_group = groups == 1
        max_tokens = self._max_tokens
        requests = self._requests
        fast_recs: list[RequestPages] = []
        fast_ends: list[int] = []
        fast_mirrors: list[RowMirror] = []
        plans: list[RequestPlan] = []
        rids: list[str] = []
        states: list[int] = []
        host_needed = 0
        trusted_mirror = RowMirror.trusted
        for req in scheduled:
            rid = req.request_id
            rec = requests.get(rid)
            if rec is None:
                raise unknown_request(rid)
            si, nc, nn = req.state_index, req.num_computed_tokens, req.num_new_tokens
            if not (type(si) is int and type(nc) is int and type(nn) is int) or si < 0 or nc < 0 or nn < 0:
                raise InvalidInputError(f"request {rid!r}: state_index={si!r}, num_computed_tokens={nc!r}, "
                                        f"num_new_tokens={nn!r}; expected ints >= 0")
            end = nc + nn
            if end > max_tokens:
                raise InvalidInputError(f"request {rid!r}: {end} tokens exceed max_model_len "
                                        f"({self._config.max_model_len}, {max_tokens} in whole pages)")
            sealed = rec.num_sealed
            if nc < sealed * bs:
                raise InvalidInputError(f"request {rid!r}: num_computed_tokens={nc} would rewrite sealed page "
                                        f"{nc // bs}; {sealed * bs} tokens are final")
            if nc > len(req.token_ids):
                raise InvalidInputError(f"request {rid!r}: num_computed_tokens={nc} but only "
                                        f"{len(req.token_ids)} token ids")
            rids.append(rid)
            states.append(si)
            host = rec.host
            p, off = divmod(nc, bs)
            if (0 < nn <= bs - off and nc == rec.num_mirrored and p < len(host) and p <= sealed
                    and si == rec.state_index and rec.restore_page < 0):
                blocks = rec.gpu[p]
                assert blocks is not None
                # Runs per request per step: values from this request's validated pages.
                fast_mirrors.append(trusted_mirror(
                    (blocks[0] * bs + off,) if single_group else tuple(b * bs + off for b in blocks),
                    host[p] * bs + off, nn))
                fast_recs.append(rec)
                fast_ends.append(end)
                continue
            host_needed += self._plan_growth(plans, rec, req, si, nc, end)
        if len(set(rids)) != len(rids) or (leaving and not leaving.isdisjoint(rids)):
            dup = sorted({r for r in rids if rids.count(r) > 1} | (leaving & set(rids)))
            raise InvalidInputError(f"requests {dup} are scheduled twice, or scheduled and finished/preempted "
                                    f"in the same step")
        if len(set(states)) != len(states):
            dup_states = sorted({x for x in states if states.count(x) > 1})
            raise InvalidInputError(f"state_index {dup_states} used by more than one request this step")
        if host_needed > self._host.num_free:
            self._no_host_room(host_needed)
        return fast_recs, fast_ends, fast_mirrors, plans

    def _no_host_room(self, host_needed: int) -> None:
        raise CapacityError(f"this step writes {host_needed} new pages but the host pool has "
                            f"{self._host.num_free} allocatable blocks of {self._host.capacity}; the engine "
                            f"must not schedule more than num_free_host_blocks allows")

    def _plan_growth(self, plans: list[RequestPlan], rec: RequestPages, req: ScheduledRequest, si: int, nc: int,
                     end: int) -> int:
        """Append the plan of a request that grows to `end` tokens (its engine blocks checked from the
        first page it fills or restores); the host pages it adds."""
        pages_after = -(-end // self._bs)
        first_new = len(rec.host)
        first_engine = rec.restore_page if 0 <= rec.restore_page < pages_after else first_new
        if first_engine < pages_after:
            self._check_engine_blocks(req, first_engine, pages_after)
        plans.append((rec, req, si, nc, end, pages_after))
        return max(0, pages_after - first_new)

    def _check_engine_blocks(self, req: ScheduledRequest, first: int, pages_after: int) -> None:
        groups, num_gpu = self._groups, self._gpu.num_blocks
        rid = req.request_id
        table = req.resident_block_ids
        if len(table) != groups:
            raise InvalidInputError(f"request {rid!r}: resident_block_ids has {len(table)} groups; expected {groups}")
        for g, row in enumerate(table):
            if len(row) < pages_after:
                raise InvalidInputError(f"request {rid!r}: resident group {g} lists {len(row)} blocks; "
                                        f"{pages_after} pages hold tokens after this step")
            for p in range(first, pages_after):
                b = row[p]
                if type(b) is not int or not 0 <= b < num_gpu:
                    raise InvalidInputError(f"request {rid!r}: resident block {b!r} of page {p}, group {g} is "
                                            f"out of range; expected 0 <= id < {num_gpu}")

    # -- phase 2: the command ----------------------------------------------------------------

    def apply(self, step: StepPlan) -> tuple[OffloadCommand | None, tuple[TableUpdate, ...]]:
        """Carry out a validated step: returns the command (None when there is nothing for the
        workers) and the step's table deltas."""
        fast_recs, fast_ends, mirrors, plans = step
        # Every host block the step adds, in one call before anything changes: the allocation is
        # the step's only host-capacity failure, and it fails whole (validation counted the same
        # pages, so it does not fail at all unless the pool shrank since).
        fresh = iter(self._host.allocate(sum(max(0, pa - rec.num_pages) for rec, _, _, _, _, pa in plans)))
        deque(map(_SET_NUM_MIRRORED, fast_recs, fast_ends), 0)
        transfers: list[PageTransfer] = []
        residency: dict[int, dict[int, tuple[int, ...]]] = {}
        tables: list[TableUpdate] = []
        for plan in plans:
            self._apply_plan(plan, fresh, transfers, mirrors, residency, tables)
        self._policy.apply()
        return self._build_command(transfers, mirrors, residency, tables)

    def _engine_blocks(self, req: ScheduledRequest, page: int) -> tuple[int, ...]:
        table = req.resident_block_ids
        if self._groups == 1:
            return (table[0][page],)
        return tuple(row[page] for row in table)

    def _apply_plan(self, plan: RequestPlan, fresh: Iterator[int], transfers: list[PageTransfer],
                    mirrors: list[RowMirror], residency: dict[int, dict[int, tuple[int, ...]]],
                    tables: list[TableUpdate]) -> None:
        rec, req, si, nc, end, pages_after = plan
        bs = self._bs
        if si != rec.state_index:
            rec.state_index = si
            rec.resend = True
        old_pages = rec.num_pages
        new_resident: list[int] = []
        rp = rec.restore_page
        if 0 <= rp < pages_after:
            restored = self._engine_blocks(req, rp)
            rec.gpu[rp] = restored
            rec.restore_page = -1
            new_resident.append(rp)
            self._gpu.retain(restored)
            self._host.touch((rec.restore_source,))
            t = self._transfers.open(TransferKind.RESTORE, rec, rp, rec.restore_source, restored)
            transfers.append(t.wire())
            self.restores += 1
        if pages_after > old_pages:
            rec.host.extend(islice(fresh, pages_after - old_pages))
            for p in range(old_pages, pages_after):
                rec.gpu.append(self._engine_blocks(req, p))
                new_resident.append(p)
            rec.state.extend(bytes(pages_after - old_pages))   # DIRTY == 0
            if rec.promote_out_of_tail() and rec.alive:
                self._policy.note_releasable(rec)

        # Rows the host does not have yet: written this step, or loaded into resident pages by
        # someone else (num_computed beyond what was mirrored: a device-side import).
        start = nc if nc < rec.num_mirrored else rec.num_mirrored
        if start < end:
            host, gpu = rec.host, rec.gpu
            row = start
            while row < end:
                p, off = divmod(row, bs)
                n = min(bs - off, end - row)
                blocks = gpu[p]
                assert blocks is not None
                src = (blocks[0] * bs + off,) if len(blocks) == 1 else tuple(b * bs + off for b in blocks)
                mirrors.append(RowMirror.trusted(src, host[p] * bs + off, n))
                row += n
        rec.num_mirrored = end

        seal_to = nc // bs
        if seal_to > rec.num_sealed:
            first = rec.num_sealed
            rec.hashes.extend(chain_hashes(req.token_ids, bs, rec.parent_hash(first), first, seal_to))
            shared: list[int] = []
            for p in range(first, seal_to):
                blocks = rec.gpu[p]
                assert blocks is not None and rec.state[p] == DIRTY
                if p not in rec.cow_pages and self._share_spilled_page(rec, p):
                    shared.append(p)
                    continue
                self._gpu.retain(blocks)
                self._host.touch((rec.host[p],))
                rec.state[p] = PENDING
                rec.pending_spills += 1
                transfers.append(self._transfers.open(TransferKind.SPILL, rec, p, rec.host[p], blocks,
                                                      rec.hashes[p]).wire())
                self.spills += 1
            rec.num_sealed = seal_to
            if shared:
                self.shared_spills += len(shared)
                if rec.alive and rec.state_index >= 0 and not rec.resend:
                    tables.append(TableUpdate(si, tuple(shared), tuple(rec.host[p] for p in shared)))
                advance_publication(self._host, rec)

        if rec.resend:
            rec.resend = False
            rec.hot_changed = False
            null = (-1,) * self._groups
            rows = residency.setdefault(si, {})
            for p, blocks in enumerate(rec.gpu):
                rows[p] = blocks if blocks is not None else null
            tables.append(TableUpdate(si, tuple(range(rec.num_pages)), tuple(rec.host), rec.hot or ()))
        elif new_resident:
            rows = residency.setdefault(si, {})
            gpu = rec.gpu
            for p in new_resident:
                rows[p] = gpu[p]  # type: ignore[assignment]
            if pages_after > old_pages:
                tables.append(TableUpdate(si, tuple(range(old_pages, pages_after)), tuple(rec.host[old_pages:])))
        rec.refresh_decode_cursor(bs)

    def _share_spilled_page(self, rec: RequestPages, p: int) -> bool:
        """Page `p` of `rec` was just sealed. If a page with its hash is already published, or
        its spill is in flight, take that host block instead of spilling the page again (a
        shared prefix is copied once, whoever holds it): True. Else False (spill it)."""
        h = rec.hashes[p]
        host = self._host
        published = host.published_block(h)
        leader = None if published is not None else self._transfers.spilling(h)
        block = published if published is not None else (leader.host_block if leader is not None else None)
        if block is None or block == rec.host[p]:
            return False
        if host.lease_count(block) == 0 and host.lease_count(rec.host[p]) > 1:
            # Taking a cached block costs an allocatable one, and releasing our own gives none
            # back while something else pins it (a restore of this page still in flight): the
            # swap would take a host block validation did not count. Spill the page instead.
            return False
        host.touch((block,))
        host.release((rec.host[p],))
        rec.host[p] = block
        if leader is None:
            rec.state[p] = PINNED
            if rec.file_clean(p):
                self._policy.note_releasable(rec)
        else:
            rec.state[p] = PENDING
            rec.pending_spills += 1
            if leader.followers is None:
                leader.followers = []
            leader.followers.append((rec, p))
        return True

    def _build_command(self, transfers: list[PageTransfer], mirrors: list[RowMirror],
                       residency: dict[int, dict[int, tuple[int, ...]]],
                       tables: list[TableUpdate]) -> tuple[OffloadCommand | None, tuple[TableUpdate, ...]]:
        null = (-1,) * self._groups
        for rec, p in self._policy.take_lost():
            if rec.alive and rec.state_index >= 0 and rec.state[p] == LOST:
                residency.setdefault(rec.state_index, {})[p] = null
        for rec in self._policy.take_hot_leased():
            if rec.hot_changed and rec.alive and rec.state_index >= 0:
                rec.hot_changed = False
                tables.append(TableUpdate(rec.state_index, hot_block_ids=rec.hot or ()))
        updates = []
        groups = self._groups
        for si, rows in residency.items():
            pages = tuple(rows)
            if groups == 1:
                ids: tuple[tuple[int, ...], ...] = (tuple(v[0] for v in rows.values()),)
            else:
                ids = tuple(tuple(v[g] for v in rows.values()) for g in range(groups))
            updates.append(ResidencyUpdate(si, pages, ids))
        copies = self._copies.take_queued()
        recycled = tuple(self._host.take_recycled())
        if not (transfers or mirrors or updates or copies or recycled):
            return None, tuple(tables)
        return OffloadCommand(tuple(transfers), tuple(mirrors), tuple(updates), copies, recycled), tuple(tables)
