"""Chained block hashes: the identity of a token prefix, one hash per full page.

Page p's hash covers its own tokens and, through its parent, every token before it, so equal
hashes mean equal prefixes. 128-bit BLAKE2b keeps accidental collisions out of reach; an
`extra_key` (adapter, salt, multimodal digest) seeds the chain so different contexts never
share pages.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from hashlib import blake2b

DIGEST_BYTES = 16
ROOT = bytes(DIGEST_BYTES)


def root_hash(extra_key: bytes | None) -> bytes:
    """The parent of page 0's hash."""
    if extra_key is None:
        return ROOT
    return blake2b(b"hisparse-root" + bytes(extra_key), digest_size=DIGEST_BYTES).digest()


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Hash of one full page given its parent's hash."""
    h = blake2b(parent, digest_size=DIGEST_BYTES)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def chain_hashes(token_ids: Sequence[int], block_size: int, parent: bytes, start_page: int,
                 end_page: int) -> list[bytes]:
    """Hashes of pages `[start_page, end_page)`; `parent` is page `start_page - 1`'s hash (or the root)."""
    out: list[bytes] = []
    for p in range(start_page, end_page):
        parent = block_hash(parent, token_ids[p * block_size:(p + 1) * block_size])
        out.append(parent)
    return out
