"""`kv_connector_extra_config` of the connector: parsed and checked once, at start-up.

Keys:

- `host_pool_gib` (required, number > 0 and below 2**64): usable host-cache capacity per data-parallel replica,
  rounded down to whole host blocks.
- `backend` (optional): hisparse backend name; absent, null or "auto" defers to `$HISPARSE_BACKEND`,
  else (unset or "auto" too) selects automatically: the highest-priority available backend. The
  backend must run on the engine's device (checked when the worker role is built).
- `hot_buffer_size` (optional, int >= 0, default 0): hot-buffer rows (tokens) per request. Only
  attention that reads host-backed pages through a hot buffer (sparse attention) uses one. vLLM's
  attention backends read resident GPU pages only, so the connector takes no hot buffer and any
  value other than 0 fails at start-up (it would lease GPU blocks nothing reads).
- `share_host_pool` (optional, bool, default true): tensor-parallel ranks of one node map one
  physical pool where the backend can.

An optional key set to null takes its default. Any other key is rejected, so a typo fails at
start-up instead of being ignored.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from hisparse_core.errors import InvalidInputError
from hisparse_core.registry import is_auto

KEYS = ("host_pool_gib", "backend", "hot_buffer_size", "share_host_pool")
#: The one `kv_role` the connector serves (`connector.check_kv_role` says why).
KV_ROLE = "kv_both"
#: Past this, the pool's bytes overflow a float in its sizing; the RAM check refuses far less anyway.
_MAX_GIB = 2.0**64
_PREFIX = "kv_connector_extra_config"


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    host_pool_gib: float
    backend: str | None = None
    hot_buffer_size: int = 0
    share_host_pool: bool = True

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, object] | None) -> ConnectorConfig:
        """Parse `kv_connector_extra_config`; raises `InvalidInputError` (a `ValueError`) naming
        the key, the bad value and what was expected."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(KEYS))
        if unknown:
            raise InvalidInputError(f"{_PREFIX} has unknown key(s) {unknown}; expected only {list(KEYS)}")
        if "host_pool_gib" not in extra:
            raise InvalidInputError(
                f"{_PREFIX}['host_pool_gib'] is required: the host cache capacity in GiB per data-parallel "
                "replica, e.g. {\"host_pool_gib\": 32}")
        gib = extra["host_pool_gib"]
        if isinstance(gib, bool) or not isinstance(gib, int | float) or gib <= 0 \
                or isinstance(gib, float) and math.isnan(gib):
            raise InvalidInputError(f"{_PREFIX}['host_pool_gib'] must be a number > 0 (GiB), got {gib!r}")
        if gib >= _MAX_GIB:  # compared exactly, an int past float's range included
            raise InvalidInputError(f"{_PREFIX}['host_pool_gib']={gib!r} GiB is more than hisparse sizes; expected a "
                                    "number > 0 and below 2**64 (the engine then checks it against this node's RAM)")
        backend = extra.get("backend")
        if backend is not None and (not isinstance(backend, str) or not backend.strip()):
            raise InvalidInputError(f"{_PREFIX}['backend'] must be a backend name or \"auto\", got {backend!r}")
        if is_auto(backend):
            backend = None
        hot = extra.get("hot_buffer_size")
        if hot is None:
            hot = 0
        if isinstance(hot, bool) or not isinstance(hot, int) or hot < 0:
            raise InvalidInputError(f"{_PREFIX}['hot_buffer_size'] must be an int >= 0 (rows per request), "
                                    f"got {hot!r}")
        share = extra.get("share_host_pool")
        if share is None:  # null is the default, as for the other optional keys
            share = True
        if not isinstance(share, bool):
            raise InvalidInputError(f"{_PREFIX}['share_host_pool'] must be true or false, got {share!r}")
        return cls(float(gib), backend.strip() if isinstance(backend, str) else None, hot, share)

    def check_stock_attention(self) -> None:
        """Every attention backend of vLLM reads resident GPU pages only; refuse a hot buffer there."""
        if self.hot_buffer_size:
            raise InvalidInputError(
                f"{_PREFIX}['hot_buffer_size']={self.hot_buffer_size}: this engine's attention reads only resident "
                "GPU pages, never a hot buffer, so those rows would lease GPU blocks nothing reads; expected 0 "
                "(the default)")
