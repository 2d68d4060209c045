"""A session's requests and the step in progress: the tables the engine fills and the attention
layers read.

A `Session` is one batch of requests (one generate call): each batch row is a `Request` with its own
state row and its own logical positions (left padding stripped). `StepState` is what one forward's
attention layers need, computed once per step by `HiSparseEngine.begin_step`. Plain data: this
module imports nothing above `rows.py` and `tokens.py`, so the engine, the attention layers and the
checker all build on it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from hisparse_transformers.tokens import LazyTokens

if TYPE_CHECKING:
    from hisparse_transformers.rows import RowMap


@dataclass(slots=True)
class Request:
    """One batch row of a session: a hisparse request."""

    request_id: str
    state_index: int
    pad: int                       # left padding of the row in the padded layout
    tokens: LazyTokens             # logical token ids (prompt, then generated)
    prompt_len: int
    hit: int                       # prefix-hit tokens taken from the host pool
    first_resident: int            # pages below are host-backed
    blocks: list[int]              # resident GPU block per page (-1: host-backed)
    computed: int                  # tokens whose KV is final
    limit: int = 0                 # tokens of KV admission reserved host blocks for (prompt + max_new_tokens - 1)
    sealed: int = 0                # tokens of the pages a scheduled step sealed (final: no rollback below)


@dataclass(slots=True)
class StepState:
    """What the attention layers of one forward need, computed once per step (device tensors)."""

    past: int                      # padded length before this step
    num_new: int                   # S: padded positions this step
    pad: torch.Tensor              # [B] int64
    pad32: torch.Tensor            # [R, 1] int32 per resolver row (the decode path's subtraction stays int32)
    qpos: torch.Tensor             # [B, S] int64 logical position of each query (-1: padding)
    row_state: torch.Tensor        # [R] int32 state row, -1 where the row has no query this step
    seq_lens: torch.Tensor         # [R] int32 logical context length of each resolver row
    write_src: torch.Tensor        # [N] int64 flat index into [B * S] of each row written this step
    write_dst: torch.Tensor        # [N] int64 flat device row of each
    started: float = 0.0
    prefill: bool = False
    # A verification step (assisted generation): R = B * S resolver rows, b-major; else R = B (one
    # row per batch row: decode, or the last query of a prefill chunk).
    verify: bool = False
    group_cache: dict[int, RowMap] = field(default_factory=dict)  # per index group: the leader's row map
    state_rows: torch.Tensor | None = None  # [B] int32 the session's state rows (on this step's device)
    local: dict[int, StepState] = field(default_factory=dict)  # per further device (device_map): this step there
    write_res: torch.Tensor | None = None  # [N] int64 each written row's place in a resident layer's store
    #: per index group: the top-k its prefetch (prefetch.py) read on a side stream, until the group's own resolve
    prefetched: dict[int, torch.Tensor] = field(default_factory=dict)


class Session:
    """The requests of one batch (one generate call) and their per-step bookkeeping."""

    def __init__(self, device: torch.device, requests: list[Request]) -> None:
        self.requests = requests
        self.padded_len = 0
        self.step: StepState | None = None
        self.closed = False
        self.speculative = False       # assisted generation: the next forward's length is not predictable
        self.last_num_new = 0          # padded positions the last forward added (what a rollback may drop)
        self.max_new_tokens: int | None = None   # what admission reserved for (None: up to max_context)
        # Direct forwards (not a patched generate): a crop may follow any forward, even one decode
        # token, so no step is planned ahead that would seal the page such a token completed.
        self.direct = False
        #: the cache running this batch, weakly (None: none); a batch whose cache is gone is finished
        #: by the next one (`HiSparseEngine.open_session`)
        self.owner: Callable[[], object | None] | None = None
        dev = device
        self.state_rows = torch.tensor([r.state_index for r in requests], dtype=torch.int32, device=dev)
        self.pads = torch.tensor([r.pad for r in requests], dtype=torch.int64, device=dev)
        self.pads32 = self.pads.to(torch.int32).view(-1, 1)

    @property
    def batch_size(self) -> int:
        return len(self.requests)
