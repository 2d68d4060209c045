"""How a model's sparse layers split into index groups (one runtime per group)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from hisparse_core.errors import InvalidInputError

if TYPE_CHECKING:
    from hisparse_core.backend import Backend


def check_flag_capabilities(backend: Backend, group_layers: list[int], *, index_share: int, rows_per_request: int,
                            row_format_name: str) -> None:
    """Refuse, in the flags' words (`hisparse run` and `bench`) and before anything is built, index
    groups of `group_layers` that need a capability `backend` does not declare. The worker and
    `backend.check_capabilities` say the same in `RuntimeConfig`'s words (`num_layers=2`), later."""
    from hisparse_core.backend import Capability

    needs = []
    if any(n > 1 for n in group_layers):
        needs.append((Capability.INDEX_SHARING, f"--index-share {index_share} (layers sharing one top-k)",
                      "--index-share 1"))
    if rows_per_request > 1:
        needs.append((Capability.SPECULATIVE_UNION, f"--rows-per-request {rows_per_request}", "--rows-per-request 1"))
    if f"row_format:{row_format_name}" in Capability.ALL:
        needs.append((f"row_format:{row_format_name}", f"--row-format {row_format_name}", "another --row-format"))
    for cap, setting, instead in needs:
        if cap not in backend.capabilities:
            raise InvalidInputError(
                f"{setting} needs capability {cap!r}, which backend {backend.name!r} does not declare (it declares "
                f"{', '.join(sorted(backend.capabilities)) or 'none'}); expected {instead}, or a backend that "
                "declares it")


def index_groups(num_layers: int, index_share: int) -> list[int]:
    """Layers per index group: one indexer (a leader) per `index_share` consecutive layers, the
    last group taking the remainder. `index_share=1` gives every layer its own indexer
    (DeepSeek-V3.2); 4 is GLM-5.2's `index_topk_freq`."""
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers <= 0:
        raise InvalidInputError(f"num_layers must be a positive int, got {num_layers!r}")
    if isinstance(index_share, bool) or not isinstance(index_share, int) or index_share <= 0:
        raise InvalidInputError(f"index_share must be a positive int, got {index_share!r}")
    full, rest = divmod(num_layers, index_share)
    return [index_share] * full + ([rest] if rest else [])


def num_index_layers(num_layers: int, index_share: int) -> int:
    """Layers that run an indexer (and keep indexer keys on the GPU)."""
    return math.ceil(num_layers / index_share)


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def hot_rows_for(top_k: int, hot_multiple: float, block_size: int) -> int:
    """Hot-buffer rows for a buffer of `hot_multiple` x top-k, rounded up to whole blocks."""
    if not hot_multiple >= 1.0:
        raise InvalidInputError(f"the hot buffer must hold at least one top-k (multiple >= 1), got {hot_multiple}")
    return round_up(math.ceil(top_k * hot_multiple), block_size)


def hot_rows_limit_problem(top_k: int, hot_multiple: float, block_size: int) -> str | None:
    """Why a hot buffer of `hot_multiple` x `top_k` rows (whole blocks) is over a runtime's limit
    (`geometry.MAX_HOT_ROWS`), in the words of the `--top-k` and `--hot` flags, or None. Checked
    before a backend is selected: the runtime itself refuses it only once the caches are built."""
    from hisparse_core.geometry import MAX_HOT_ROWS

    hot = hot_rows_for(top_k, hot_multiple, block_size)
    if hot <= MAX_HOT_ROWS:
        return None
    return (f"--top-k {top_k} with --hot {hot_multiple:g} makes a hot buffer of {hot} rows per request, over the "
            f"{MAX_HOT_ROWS}-row limit of a runtime; expected --top-k x --hot <= {MAX_HOT_ROWS} (at --hot "
            f"{hot_multiple:g}: --top-k <= {_largest_top_k(hot_multiple, block_size, MAX_HOT_ROWS)})")


def _largest_top_k(hot_multiple: float, block_size: int, limit: int) -> int:
    """The largest top-k whose hot buffer at `hot_multiple` fits `limit` rows (0 if none does)."""
    k = int(limit // hot_multiple)
    while k > 0 and hot_rows_for(k, hot_multiple, block_size) > limit:
        k -= 1
    return k
