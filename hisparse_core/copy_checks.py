"""Checks of a runtime's copy commands (docs/resolver-contract.md §Copies).

Each returns the plain integers a backend needs to move the bytes, so backends share the rules
and messages and only differ in how they copy. All raise `InvalidInputError` before anything
is copied.
"""

from __future__ import annotations

from collections.abc import Sequence

from hisparse_core.checks import check_int, check_sequence, check_span, span_fits
from hisparse_core.errors import InvalidInputError
from hisparse_core.types import HostBlockCopy, PageTransfer, RowMirror


def check_mirrors(mirrors: Sequence[RowMirror], *, resident_group: int, block_size: int, device_rows: int,
                  host_rows: int) -> list[tuple[int, int, int]]:
    """Row mirrors read for `resident_group`; returns `(device_row, host_row, num_rows)` per mirror."""
    g, bs = resident_group, block_size
    out: list[tuple[int, int, int]] = []
    for i, m in enumerate(check_sequence("mirrors", mirrors, RowMirror)):
        if len(m.source_starts) <= g:
            raise InvalidInputError(
                f"mirrors[{i}].source_starts has {len(m.source_starts)} entries; expected one for "
                f"resident group {g}")
        src, dst, n = m.source_starts[g], m.destination_start, m.num_rows
        # the message (an f-string a mirror) is built only for a bad span: every step's mirrors pass here
        if not span_fits(src, n, device_rows, bs):
            check_span(f"mirrors[{i}] source", src, n, device_rows, bs)
        if not span_fits(dst, n, host_rows, bs):
            check_span(f"mirrors[{i}] destination", dst, n, host_rows, bs)
        out.append((src, dst, n))
    return out


def check_pages(transfers: Sequence[PageTransfer], *, restore: bool | None, resident_group: int,
                device_blocks: int, host_blocks: int) -> list[tuple[int, int]]:
    """Page transfers read for `resident_group`; returns `(device_block, host_block)` per transfer.

    `restore` is the direction every transfer must have (None: either)."""
    g = resident_group
    out: list[tuple[int, int]] = []
    for i, t in enumerate(check_sequence("transfers", transfers, PageTransfer)):
        if restore is not None and t.restore != restore:
            want = "restore_pages" if t.restore else "spill_pages"
            raise InvalidInputError(
                f"transfers[{i}] (id {t.transfer_id}) has restore={t.restore}; pass it to {want}")
        if len(t.resident_block_ids) <= g:
            raise InvalidInputError(
                f"transfers[{i}].resident_block_ids has {len(t.resident_block_ids)} entries; expected one "
                f"for resident group {g}")
        dev = check_int(f"transfers[{i}].resident_block_ids[{g}]", t.resident_block_ids[g], 0, device_blocks)
        host = check_int(f"transfers[{i}].host_block_id", t.host_block_id, 0, host_blocks)
        out.append((dev, host))
    return out


def check_host_copies(copies: Sequence[HostBlockCopy], *, host_blocks: int) -> list[tuple[int, int]]:
    """Host block copies; returns `(src_block, dst_block)` per copy."""
    return [(check_int(f"copies[{i}].src_block_id", c.src_block_id, 0, host_blocks),
             check_int(f"copies[{i}].dst_block_id", c.dst_block_id, 0, host_blocks))
            for i, c in enumerate(check_sequence("copies", copies, HostBlockCopy))]
