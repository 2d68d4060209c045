"""Checks of `ResolveInputs` per docs/resolver-contract.md §Validation.

`check_resolve_shapes` reads tensor metadata only, so it is cheap enough for every call (also
inside CUDA graph capture). `check_resolve_values` is the `validate=True` part and reads values:
it takes inputs whose tensors are already on the CPU, so a device backend pays one explicit
device-to-host copy and then shares these exact rules and messages with the reference.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hisparse_core.checks import check_range, check_tensor
from hisparse_core.errors import InvalidInputError
from hisparse_core.geometry import RuntimeConfig
from hisparse_core.row_groups import groups_of
from hisparse_core.runtime import ResolveInputs

#: Signature of `hisparse_core.checks.check_tensor`; a backend with stricter layout needs
#: (contiguity, alignment) passes a wrapper that adds its own checks.
TensorCheck = Callable[[str, object, tuple[int | None, ...], torch.dtype, torch.device], torch.Tensor]


def check_resolve_shapes(inputs: object, config: RuntimeConfig, device: torch.device, *,
                         tensor_check: TensorCheck = check_tensor) -> int:
    """Dtype, rank, shape and device of every input tensor; returns B (1 <= B <= max_batch_rows)."""
    if not isinstance(inputs, ResolveInputs):
        raise InvalidInputError(f"inputs must be a ResolveInputs, got {type(inputs).__name__}")
    i32 = torch.int32
    topk = tensor_check("topk", inputs.topk, (None, config.top_k), i32, device)
    b = topk.shape[0]
    if not 1 <= b <= config.max_batch_rows:
        raise InvalidInputError(f"topk has {b} rows; expected 1 <= B <= max_batch_rows={config.max_batch_rows}")
    tensor_check("row_state", inputs.row_state, (b,), i32, device)
    tensor_check("seq_lens", inputs.seq_lens, (b,), i32, device)
    tables = (config.max_requests, config.max_pages)
    tensor_check("source_table", inputs.source_table, tables, i32, device)
    tensor_check("resident_table", inputs.resident_table, tables, i32, device)
    tensor_check("hot_table", inputs.hot_table, (config.max_requests, config.hot_blocks), i32, device)
    return b


def check_resolve_values(inputs: ResolveInputs, config: RuntimeConfig, *, num_device_blocks: int,
                         host_blocks: int) -> None:
    """Every value check of `validate=True` on shape-checked CPU inputs.

    Padding rows' `topk` and `seq_lens` are not read: graph padding carries garbage.
    """
    row_state = inputs.row_state
    check_range("row_state", row_state, -1, config.max_requests)
    seen: dict[int, int] = {}
    for grp in groups_of(row_state):
        if grp.state in seen:
            raise InvalidInputError(
                f"row_state: state row {grp.state} appears in two groups (batch rows {seen[grp.state]} and "
                f"{grp.start}); expected the rows of one request to be consecutive")
        seen[grp.state] = grp.start
        if grp.stop - grp.start > config.rows_per_request:
            raise InvalidInputError(
                f"row_state: state row {grp.state} has a group of {grp.stop - grp.start} rows at batch row "
                f"{grp.start}; expected at most rows_per_request={config.rows_per_request}")

    live = row_state >= 0
    seq = inputs.seq_lens.long()
    bad_len = live & ((seq < 0) | (seq > config.max_context))
    if bool(bad_len.any()):
        r = int(bad_len.nonzero()[0, 0])
        raise InvalidInputError(
            f"seq_lens[{r}]={int(seq[r])} is out of range; expected [0, max_pages*block_size={config.max_context}]")

    topk = inputs.topk.long()
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
    res = inputs.resident_table.long()[states, pages]
    _check_read("resident_table", res, states, pages, num_device_blocks)
    not_res = res == -1
    src = inputs.source_table.long()[states[not_res], pages[not_res]]
    _check_read("source_table", src, states[not_res], pages[not_res], host_blocks)
    for q in sorted(set(states[not_res][src >= 0].tolist())):
        row = inputs.hot_table[q].long()
        bad = (row < 0) | (row >= num_device_blocks)
        if bool(bad.any()):
            j = int(bad.nonzero()[0, 0])
            raise InvalidInputError(
                f"hot_table[{q}, {j}]={int(row[j])} is out of range; expected a device block in "
                f"[0, {num_device_blocks}) (state row {q} has host entries, so its whole hot buffer is read)")


def _check_read(name: str, values: torch.Tensor, states: torch.Tensor, pages: torch.Tensor, hi: int) -> None:
    """Table entries read at `(states[n], pages[n])`: -1 or in `[0, hi)`."""
    bad = (values < -1) | (values >= hi)
    if bool(bad.any()):
        n = int(bad.nonzero()[0, 0])
        raise InvalidInputError(
            f"{name}[{int(states[n])}, {int(pages[n])}]={int(values[n])} is out of range; expected -1 or "
            f"a block in [0, {hi})")
