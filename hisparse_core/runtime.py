"""The per-cache runtime: what a backend implements for one index group of sparse layers.

A runtime owns, for one leader layer and its index-sharing followers:

- views of the host pool (one `[host_rows, width]` tensor per layer) and of the device caches
  (one `[num_device_blocks, block_size, width]` tensor per layer, where resident and hot pages
  both live);
- per request state row: the hot map (which host row each hot slot holds) and the LRU order of
  the hot slots;
- a fixed-shape output workspace (`ResolveResult`) that every resolve call fills in place, so a
  captured CUDA graph stays valid;
- device-side counters (`RuntimeStats`).

The resolver's exact semantics are in docs/resolver-contract.md; every backend must match the
`reference_cpu` backend bit for bit on the conformance suite (`pytest --pyargs
hisparse_conformance --hisparse-backend NAME`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hisparse_core.geometry import RuntimeConfig
from hisparse_core.types import HostBlockCopy, PageTransfer, RowMirror


@dataclass(frozen=True, slots=True)
class ResolveInputs:
    """Inputs of one resolve call. All int32 tensors on the runtime's device.

    - `topk` `[B, top_k]`: logical token positions per batch row; -1 masks an entry.
    - `row_state` `[B]`: request state row of each batch row; -1 marks a padding row. Rows of one
      request (speculative verification rows) are consecutive and share the state row.
    - `seq_lens` `[B]`: context length of each batch row; a position must be < its row's length.
    - `source_table` `[max_requests, max_pages]`: host block of each page, -1 if none.
    - `resident_table` `[max_requests, max_pages]`: resident device block of each page, -1 if
      the page is not resident.
    - `hot_table` `[max_requests, hot_blocks]`: device blocks leased for each request's hot
      buffer; hot slot s lives at device row `hot_table[state, s // block_size] * block_size +
      s % block_size`.

    `B` is at most `RuntimeConfig.max_batch_rows`. The tables are the engine's persistent
    tensors: pass the same objects every step.
    """

    topk: torch.Tensor
    row_state: torch.Tensor
    seq_lens: torch.Tensor
    source_table: torch.Tensor
    resident_table: torch.Tensor
    hot_table: torch.Tensor


@dataclass(frozen=True, slots=True)
class ResolveResult:
    """Outputs of the last resolve call: runtime-owned tensors of fixed shape, rewritten in place.

    Rows `[0, B)` hold the call's results; rows `[B, max_batch_rows)` are written as padding.
    Callers read them and never write them: a backend may rely on what its last call left there
    (the NVIDIA one rewrites only the plan entries and padding rows that changed).

    - `rows` `[max_batch_rows, top_k]` int32: physical device row per entry (flat index into a
      layer's `[num_device_blocks * block_size, width]` view), -1 for masked, null and padding.
    - `valid_counts` `[max_batch_rows]` int32: entries of the row that are not -1.
    - `plan_host` / `plan_device` `[max_batch_rows, top_k]` int32: the miss plan, the host row
      and the destination device row of each miss first referenced by this batch row, packed at
      the front; -1 after `plan_counts`.
    - `plan_counts` `[max_batch_rows]` int32.
    """

    rows: torch.Tensor
    valid_counts: torch.Tensor
    plan_host: torch.Tensor
    plan_device: torch.Tensor
    plan_counts: torch.Tensor


@dataclass(frozen=True, slots=True)
class RuntimeStats:
    """Counters accumulated since construction or the last `reset_stats`, as Python ints (read back
    from the device: reports and `--json` output take them as they are).

    `resident` counts entries served from resident pages, `hits` entries found in the hot buffer,
    `misses` unique host rows copied into it (per resolve, once per layer group), `h2d_bytes` and
    `d2h_bytes` bytes moved over all layers by gathers, replays, mirrors, spills and restores.
    """

    resident: int = 0
    hits: int = 0
    misses: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0

    @property
    def hit_rate(self) -> float:
        looked_up = self.hits + self.misses
        return self.hits / looked_up if looked_up else 1.0


class CacheRuntime(ABC):
    """Host/hot data plane and GPU replacement state of one index group.

    Created by `Backend.create_runtime(config)` in the worker process, bound once with `bind`,
    then driven every decode step by the attention-facing cache handle (resolve, gather, replay)
    and by the transfer engine (mirror, spill, restore, invalidate). All methods are called from
    one thread; on accelerators they enqueue work on the runtime's stream and return without a
    host synchronization (except `stats`).

    Every method validates its arguments before touching state: a bad shape, dtype, device or
    value raises `InvalidInputError` naming the argument, and the runtime is unchanged.
    """

    config: RuntimeConfig

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Device holding the hot state and the device caches."""

    @abstractmethod
    def bind(self, host_layers: Sequence[torch.Tensor], device_layers: Sequence[torch.Tensor],
             *, resident_group: int = 0) -> None:
        """Attach storage. Called once, before the first resolve.

        `host_layers[l]` is layer l's `[host_blocks * block_size, width]` view of the host pool
        (owned by the `HostPool`; the runtime keeps a reference but never frees it).
        `device_layers[l]` is layer l's `[num_device_blocks, block_size, width]` device cache,
        owned by the engine's cache manager; resident and hot pages are blocks of it.
        `resident_group` selects which entry of `RowMirror.source_starts` and
        `PageTransfer.resident_block_ids` addresses this runtime's device caches.
        Both lists have `config.num_layers` entries of `config.row_format.dtype`.
        """

    @abstractmethod
    def resolve(self, inputs: ResolveInputs, *, gather: bool = True, validate: bool = True) -> ResolveResult:
        """Map each top-k position to a physical device row (docs/resolver-contract.md).

        Updates the hot maps and LRU orders of the touched state rows and writes the result
        workspace. With `gather=True` it also copies the misses of the leader layer (layer 0)
        from host into their hot rows before returning (fused on accelerators). With
        `validate=True` it checks values too (positions within `seq_lens`, state rows in range,
        table entries in range), which needs a device-to-host read on accelerators: pass
        `validate=False` on the decode path and inside graph capture, where out-of-range
        positions are treated as masked entries instead.

        Returns `result`, the workspace it wrote in place: the same tensors every call (readers and
        captured CUDA graphs keep them), never new ones.
        """

    @abstractmethod
    def gather_misses(self, layer: int = 0) -> None:
        """Copy the last resolve's miss plan for `layer` from host rows into hot rows."""

    @abstractmethod
    def replay_plan(self, layers: Sequence[int] | None = None) -> None:
        """Replay the last miss plan into follower layers (default: every layer but the leader; an
        empty `layers` copies nothing).

        Followers share the leader's top-k, hot map and LRU: they only copy the same rows.
        """

    def prefetch(self, inputs: ResolveInputs) -> None:
        """Resolve `inputs` and copy its misses into every layer, as background work.

        Who calls it: the transformers engine's cross-layer prefetch (`prefetch_next_group`), on a
        side stream, with the top-k of the group before this one, while that group's attention runs
        on the main stream; inside CUDA graph capture when decode steps are captured. Nothing on the
        critical path waits for these copies until this group's own resolve.

        Its effect on every buffer the contract fixes (result workspace, miss plan, hot map, LRU
        order, counters, device rows) is exactly that of `resolve(inputs, gather=True,
        validate=False)` followed, when `config.num_layers > 1`, by `replay_plan()`; that is the
        default implementation. A backend may override it to give these copies fewer resources
        than a resolve on the critical path takes (the nvidia backend runs its plan copy on a
        smaller grid, leaving SMs to the attention it overlaps). The conformance suite checks the
        effect against the default's.
        """
        self.resolve(inputs, gather=True, validate=False)
        if self.config.num_layers > 1:
            self.replay_plan()

    @abstractmethod
    def mirror_rows(self, mirrors: Sequence[RowMirror]) -> None:
        """Copy rows written this step from the resident pages to host, every layer."""

    @abstractmethod
    def spill_pages(self, transfers: Sequence[PageTransfer]) -> None:
        """Copy whole resident pages to their host blocks (device to host), every layer.

        Transfers with `restore=True` are rejected here; use `restore_pages`.
        """

    @abstractmethod
    def restore_pages(self, transfers: Sequence[PageTransfer]) -> None:
        """Copy host blocks back into resident pages (host to device), every layer."""

    @abstractmethod
    def copy_host_blocks(self, copies: Sequence[HostBlockCopy]) -> None:
        """Host-to-host block copies, every layer."""

    @abstractmethod
    def invalidate_written_slots(self, state_rows: torch.Tensor, host_rows: torch.Tensor) -> None:
        """Forget hot copies of rows written this step.

        For each pair `(state_rows[i], host_rows[i])` (int32 `[N]` tensors on the device), a hot
        slot of that state row holding that host row becomes empty (hot map -1); its LRU position
        is kept. Later lookups of the row miss and reload it.
        """

    @abstractmethod
    def invalidate_host_blocks(self, block_ids: Sequence[int]) -> None:
        """Forget hot copies of recycled host blocks, in every state row."""

    @abstractmethod
    def reset_state(self, state_rows: Sequence[int] | None = None) -> None:
        """Return state rows (default: all) to empty: hot map -1, LRU order 0..hot_rows-1."""

    @abstractmethod
    def hot_state(self, state_row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies (on CPU) of one state row's hot map and LRU order, for tests and debugging."""

    @abstractmethod
    def stats(self) -> RuntimeStats:
        """Read the counters (a host synchronization; never on the decode path)."""

    @abstractmethod
    def reset_stats(self) -> None:
        """Zero the counters."""

    @property
    @abstractmethod
    def result(self) -> ResolveResult:
        """The output workspace the resolve calls fill: allocated with the runtime, and the same
        tensors for its whole life (the conformance suite checks them after every resolve)."""
