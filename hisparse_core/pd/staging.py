"""A bounded staging buffer for backends whose transport cannot land reads in the host pool.

Fixed slots of `slot_bytes` each, in one tensor on any device (decoder GPU memory on NVIDIA, host
memory in tests). A host import reads one chunk of at most `slot_bytes` into a slot, then copies
it from the slot into the request's host blocks and frees the slot. Memory use is therefore
bounded by `num_slots * slot_bytes` however many imports run.
"""

from __future__ import annotations

import ctypes
from collections import deque
from collections.abc import Sequence

import torch

from hisparse_core.errors import InvalidInputError, ProtocolError
from hisparse_core.host_pool import HostPool
from hisparse_core.pd.plan import PageRun


class StagingBuffer:
    """Slots of a contiguous uint8 `[num_slots, slot_bytes]` tensor (owned by the caller)."""

    def __init__(self, slots: torch.Tensor) -> None:
        if not isinstance(slots, torch.Tensor) or slots.dtype != torch.uint8 or slots.dim() != 2:
            raise InvalidInputError(f"staging slots must be a uint8 [num_slots, slot_bytes] tensor, got "
                                    f"{getattr(slots, 'dtype', type(slots).__name__)} of shape "
                                    f"{tuple(getattr(slots, 'shape', ()))}")
        if not slots.is_contiguous() or slots.shape[0] < 1 or slots.shape[1] < 1:
            raise InvalidInputError(f"staging slots must be contiguous and non-empty, got shape {tuple(slots.shape)}")
        self._slots = slots
        self._free: deque[int] = deque(range(slots.shape[0]))
        self._busy: set[int] = set()

    @classmethod
    def allocate(cls, num_slots: int, slot_bytes: int, device: torch.device | str = "cpu") -> StagingBuffer:
        for name, v in (("num_slots", num_slots), ("slot_bytes", slot_bytes)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidInputError(f"staging {name} must be a positive int, got {v!r}")
        slots = torch.empty((num_slots, slot_bytes), dtype=torch.uint8, device=device)
        slots.fill_(0)  # commit the memory now, not on the first read into it
        return cls(slots)

    @property
    def tensor(self) -> torch.Tensor:
        return self._slots

    @property
    def num_slots(self) -> int:
        return self._slots.shape[0]

    @property
    def slot_bytes(self) -> int:
        return self._slots.shape[1]

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.slot_bytes

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def mem_type(self) -> str:
        return "DRAM" if self._slots.device.type == "cpu" else "VRAM"

    @property
    def device_id(self) -> int:
        return self._slots.device.index or 0

    def acquire(self) -> int | None:
        """A free slot, or None when every slot is in use."""
        if not self._free:
            return None
        slot = self._free.popleft()
        self._busy.add(slot)
        return slot

    def release(self, slot: int) -> None:
        if slot not in self._busy:
            raise ProtocolError(f"staging slot {slot} is not in use; expected one of {sorted(self._busy)}")
        self._busy.remove(slot)
        self._free.append(slot)

    def slot_address(self, slot: int) -> int:
        return self._slots[slot].data_ptr()

    def copy_out(self, slot: int, runs: Sequence[PageRun], pool: HostPool, page_bytes: int) -> int:
        """Copy a chunk read into `slot` (runs packed back to back) into its host blocks. Returns bytes.

        A host-memory slot is copied with one `memmove` per run (torch's per-call overhead
        dominates page-sized copies on CPU); an accelerator slot with one device-to-host copy per run.
        """
        if slot not in self._busy:
            raise ProtocolError(f"staging slot {slot} is not in use; nothing was read into it")
        spec = pool.spec
        block_bytes = spec.block_size * spec.row_format.row_bytes
        if block_bytes != page_bytes:
            raise InvalidInputError(f"page of {page_bytes} B does not match the host block of {block_bytes} B")
        total = sum(r.num_pages for r in runs) * page_bytes
        if total > self.slot_bytes:
            raise InvalidInputError(f"chunk of {total} B exceeds the {self.slot_bytes} B staging slot")
        for run in runs:
            if run.host_block + run.num_pages > spec.num_blocks or run.layer >= spec.num_layers:
                raise InvalidInputError(f"run of host blocks [{run.host_block}, {run.host_block + run.num_pages}) "
                                        f"in layer {run.layer} exceeds the host pool ({spec.num_layers} layers x "
                                        f"{spec.num_blocks} blocks)")
        src = self._slots[slot]
        views = [pool.layer_view(layer) for layer in sorted({r.layer for r in runs})]
        if src.device.type == "cpu" and all(v.device.type == "cpu" and v.is_contiguous() for v in views):
            base = {r.layer: pool.layer_view(r.layer).data_ptr() for r in runs}
            at = src.data_ptr()
            for run in runs:
                n = run.num_pages * page_bytes
                ctypes.memmove(base[run.layer] + run.host_block * block_bytes, at, n)
                at += n
            return total
        offset = 0
        for run in runs:
            n = run.num_pages * page_bytes
            blocks = pool.layer_view(run.layer).view(torch.uint8).view(spec.num_blocks, block_bytes)
            blocks[run.host_block:run.host_block + run.num_pages].copy_(
                src[offset:offset + n].view(run.num_pages, block_bytes))
            offset += n
        return total
