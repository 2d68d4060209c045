"""Argument checks of the NVIDIA runtime and transfer engine.

Shape, dtype and device checks read tensor metadata only and run on every call (also inside CUDA
graph capture). Value checks (`validate=True`) copy the inputs to the host, a synchronization that
never belongs on the decode path; they implement exactly the rules of docs/resolver-contract.md
§Validation, and every message names the tensor, the bad value and what was expected. All checks
run before anything is enqueued, so a raising call changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hisparse_core.errors import InvalidInputError
from hisparse_core.geometry import RuntimeConfig
from hisparse_core.runtime import ResolveInputs


def check_int(name: str, value: object, lo: int, hi: int) -> int:
    """`value` must be a plain int in `[lo, hi)`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInputError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if not lo <= value < hi:
        raise InvalidInputError(f"{name}={value} is out of range; expected [{lo}, {hi})")
    return value


def check_ints(name: str, values: object, lo: int, hi: int) -> list[int]:
    """A sequence (not a string or tensor) of ints, each in `[lo, hi)`."""
    if isinstance(values, (str, bytes, torch.Tensor)) or not isinstance(values, Sequence):
        raise InvalidInputError(f"{name} must be a sequence of ints, got {type(values).__name__}")
    return [check_int(f"{name}[{i}]", v, lo, hi) for i, v in enumerate(values)]


def check_sequence(name: str, items: object, kind: type) -> list:
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise InvalidInputError(f"{name} must be a sequence of {kind.__name__}, got {type(items).__name__}")
    for i, x in enumerate(items):
        if not isinstance(x, kind):
            raise InvalidInputError(f"{name}[{i}] must be a {kind.__name__}, got {type(x).__name__}")
    return list(items)


def check_tensor(name: str, t: object, shape: tuple[int | None, ...], dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
    """`t` must be a contiguous tensor of `dtype` on `device` with `shape` (None: any extent)."""
    if not isinstance(t, torch.Tensor):
        raise InvalidInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise InvalidInputError(f"{name} has dtype {t.dtype}; expected {dtype}")
    if t.device != device:
        raise InvalidInputError(f"{name} is on {t.device}; expected {device}")
    if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape)):
        want_s = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
        raise InvalidInputError(f"{name} has shape {list(t.shape)}; expected {want_s}")
    if not t.is_contiguous():
        raise InvalidInputError(f"{name} is not contiguous; expected a contiguous tensor (the kernels index it flat)")
    return t


def check_range(name: str, values: torch.Tensor, lo: int, hi: int) -> None:
    """Every element of `values` in `[lo, hi)`; the message names the first offender and its index."""
    bad = (values < lo) | (values >= hi)
    if bool(bad.any()):
        first = tuple(int(i) for i in bad.nonzero()[0])
        index = first[0] if len(first) == 1 else first
        raise InvalidInputError(f"{name}[{index}]={int(values[first])} is out of range; expected [{lo}, {hi})")


def check_shapes(inputs: object, config: RuntimeConfig, device: torch.device) -> int:
    """Dtype, rank, shape, device and contiguity of every input; returns B (1 <= B <= Bmax)."""
    if not isinstance(inputs, ResolveInputs):
        raise InvalidInputError(f"inputs must be a ResolveInputs, got {type(inputs).__name__}")
    i32 = torch.int32
    topk = check_tensor("topk", inputs.topk, (None, config.top_k), i32, device)
    b = topk.shape[0]
    if not 1 <= b <= config.max_batch_rows:
        raise InvalidInputError(f"topk has {b} rows; expected 1 <= B <= max_batch_rows={config.max_batch_rows}")
    check_tensor("row_state", inputs.row_state, (b,), i32, device)
    check_tensor("seq_lens", inputs.seq_lens, (b,), i32, device)
    tables = (config.max_requests, config.max_pages)
    check_tensor("source_table", inputs.source_table, tables, i32, device)
    check_tensor("resident_table", inputs.resident_table, tables, i32, device)
    check_tensor("hot_table", inputs.hot_table, (config.max_requests, config.hot_blocks), i32, device)
    return b


def _groups(states: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs (start, stop, state) of equal non-padding state rows."""
    out: list[tuple[int, int, int]] = []
    start = 0
    while start < len(states):
        stop = start + 1
        while stop < len(states) and states[stop] == states[start]:
            stop += 1
        if states[start] != -1:
            out.append((start, stop, states[start]))
        start = stop
    return out


def check_values(inputs: ResolveInputs, config: RuntimeConfig, *, num_device_blocks: int,
                 host_blocks: int) -> None:
    """The value checks of `validate=True`, on host copies of the inputs (a synchronization)."""
    row_state = inputs.row_state.cpu()
    check_range("row_state", row_state, -1, config.max_requests)
    seen: dict[int, int] = {}
    for start, stop, q in _groups(row_state.tolist()):
        if q in seen:
            raise InvalidInputError(
                f"row_state: state row {q} appears in two groups (batch rows {seen[q]} and {start}); "
                f"expected the rows of one request to be consecutive")
        seen[q] = start
        if stop - start > config.rows_per_request:
            raise InvalidInputError(
                f"row_state: state row {q} has a group of {stop - start} rows at batch row {start}; "
                f"expected at most rows_per_request={config.rows_per_request}")

    live = row_state >= 0
    seq = inputs.seq_lens.cpu().long()
    bad_len = live & ((seq < 0) | (seq > config.max_context))
    if bool(bad_len.any()):
        r = int(bad_len.nonzero()[0, 0])
        raise InvalidInputError(
            f"seq_lens[{r}]={int(seq[r])} is out of range; expected [0, max_pages*block_size={config.max_context}]")

    topk = inputs.topk.cpu().long()
    bad_pos = live[:, None] & ((topk < -1) | (topk >= seq[:, None]))
    if bool(bad_pos.any()):
        r, i = (int(x) for x in bad_pos.nonzero()[0])
        raise InvalidInputError(
            f"topk[{r}, {i}]={int(topk[r, i])} is out of range; expected -1 (masked) or a position in "
            f"[0, seq_lens[{r}]={int(seq[r])})")

    # Only the table entries the call reads: the page of every unmasked entry, its source entry
    # when the page is not resident, and the whole hot buffer of a state row with host entries.
    entry = live[:, None] & (topk >= 0)
    r_idx, i_idx = entry.nonzero(as_tuple=True)
    states = row_state.long()[r_idx]
    pages = topk[r_idx, i_idx] // config.block_size
    res = inputs.resident_table.cpu().long()[states, pages]
    _check_read("resident_table", res, states, pages, num_device_blocks)
    not_res = res == -1
    src = inputs.source_table.cpu().long()[states[not_res], pages[not_res]]
    _check_read("source_table", src, states[not_res], pages[not_res], host_blocks)
    hot_table = inputs.hot_table.cpu().long()
    for q in sorted(set(states[not_res][src >= 0].tolist())):
        row = hot_table[q]
        bad = (row < 0) | (row >= num_device_blocks)
        if bool(bad.any()):
            j = int(bad.nonzero()[0, 0])
            raise InvalidInputError(
                f"hot_table[{q}, {j}]={int(row[j])} is out of range; expected a device block in "
                f"[0, {num_device_blocks}) (state row {q} has host entries, so its whole hot buffer is read)")


def _check_read(name: str, values: torch.Tensor, states: torch.Tensor, pages: torch.Tensor, hi: int) -> None:
    bad = (values < -1) | (values >= hi)
    if bool(bad.any()):
        n = int(bad.nonzero()[0, 0])
        raise InvalidInputError(
            f"{name}[{int(states[n])}, {int(pages[n])}]={int(values[n])} is out of range; expected -1 or "
            f"a block in [0, {hi})")


def check_span(name: str, start: int, n: int, limit: int, bs: int) -> None:
    """Rows `[start, start + n)` lie inside `limit` rows and inside one block."""
    if start + n > limit:
        raise InvalidInputError(f"{name} rows [{start}, {start + n}) exceed the {limit} rows bound; expected "
                                f"a span inside the buffer")
    if start // bs != (start + n - 1) // bs:
        raise InvalidInputError(f"{name} rows [{start}, {start + n}) cross a block boundary (block_size={bs}); "
                                f"expected the coordinator to split spans at page edges")
