"""The logical host block pool: ids, lease counts, the prefix map and LRU eviction of cached blocks.

Only ids and bookkeeping live here; the bytes are the worker's. Block 0 is the null block and is
never handed out. A block is in exactly one of three places:

- leased (lease count > 0): held by requests and in-flight transfers;
- cached (count 0, published): its hash maps to it, so a prefix hit can lease it again; it is
  evicted least-recently-released first when the free list runs dry;
- free (count 0, unpublished).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

from hisparse_core.errors import CapacityError, InvalidInputError

NULL_BLOCK = 0


class HostBlockPool:
    """`num_blocks` host blocks (the null block included)."""

    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 2:
            raise InvalidInputError(f"HostBlockPool needs at least 2 blocks (null + one), got {num_blocks!r}")
        self._num_blocks = num_blocks
        self._leases = [0] * num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._hash_of: dict[int, bytes] = {}
        self._by_hash: dict[bytes, int] = {}
        self._held_contents = bytearray(num_blocks)
        self._recycled: list[int] = []
        self.evictions = 0

    # -- sizes -------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def capacity(self) -> int:
        """Usable blocks: everything but the null block."""
        return self._num_blocks - 1

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: free plus evictable cached ones."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_leased(self) -> int:
        return self.capacity - self.num_free

    @property
    def num_published(self) -> int:
        return len(self._by_hash)

    def lease_count(self, block_id: int) -> int:
        return self._leases[block_id]

    # -- leases ------------------------------------------------------------------------

    def allocate(self, count: int) -> list[int]:
        """Lease `count` blocks with no contents, evicting cached blocks LRU-first if needed."""
        if count > self.num_free:
            raise CapacityError(f"host pool has {self.num_free} allocatable blocks (free + cached) of "
                                f"{self.capacity}; asked for {count}")
        out: list[int] = []
        free, cached, leases, held = self._free, self._cached, self._leases, self._held_contents
        for _ in range(count):
            if free:
                b = free.popleft()
            else:
                b, _ = cached.popitem(last=False)
                del self._by_hash[self._hash_of.pop(b)]
                self.evictions += 1
            if held[b]:
                self._recycled.append(b)
            held[b] = 1
            leases[b] = 1
            out.append(b)
        return out

    def touch(self, block_ids: Sequence[int]) -> None:
        """Add a lease to each block (a cached block leaves the evictable list)."""
        leases, cached = self._leases, self._cached
        for b in block_ids:
            if leases[b] == 0:
                if b not in cached:
                    raise InvalidInputError(f"touch of host block {b}, which is free and unpublished")
                del cached[b]
            leases[b] += 1

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop a lease from each block; at zero a published block is cached, any other is freed."""
        leases = self._leases
        for b in block_ids:
            n = leases[b] - 1
            if n < 0:
                raise InvalidInputError(f"release of host block {b}, which holds no lease")
            leases[b] = n
            if n == 0:
                if b in self._hash_of:
                    self._cached[b] = None
                else:
                    self._free.append(b)

    # -- prefix identity ---------------------------------------------------------------

    def publish(self, block_id: int, block_hash: bytes) -> bool:
        """Map `block_hash` to this (leased, durable) block. False if the hash already has a block
        or the block is already published; the first publisher wins."""
        if block_hash in self._by_hash or block_id in self._hash_of:
            return False
        self._by_hash[block_hash] = block_id
        self._hash_of[block_id] = block_hash
        return True

    def published_block(self, block_hash: bytes) -> int | None:
        return self._by_hash.get(block_hash)

    def hash_of(self, block_id: int) -> bytes | None:
        return self._hash_of.get(block_id)

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """Blocks of the longest run of `hashes` that are all published, from the first."""
        out: list[int] = []
        by_hash = self._by_hash
        for h in hashes:
            b = by_hash.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def take_recycled(self) -> list[int]:
        """Blocks handed out since the last call that had held other contents before."""
        out, self._recycled = self._recycled, []
        return out

    def check_invariants(self) -> None:
        """Every block is in exactly one place and the prefix map is consistent (tests, debugging)."""
        seen = set(self._free)
        if len(seen) != len(self._free) or NULL_BLOCK in seen:
            raise AssertionError("host free list repeats a block or holds the null block")
        for b in self._cached:
            if b in seen or self._leases[b] or b not in self._hash_of:
                raise AssertionError(f"cached host block {b} is also free, leased or unpublished")
            seen.add(b)
        for b in range(1, self._num_blocks):
            if (self._leases[b] > 0) == (b in seen):
                raise AssertionError(f"host block {b}: leases={self._leases[b]}, free/cached={b in seen}")
        for h, b in self._by_hash.items():
            if self._hash_of.get(b) != h:
                raise AssertionError(f"prefix map and block map disagree on host block {b}")
