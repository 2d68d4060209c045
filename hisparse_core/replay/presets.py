"""Named workloads of `hisparse run --preset NAME`: overrides of `RunConfig`'s defaults.

- `default`: the embedded default workload (16 requests of 16K tokens, 2 layers in one index
  group, about a minute on a CPU).
- `large`: the main job at scale. 64 requests of 32K+16 tokens arriving at once, in 4 families
  sharing half their prompt; 4 layers in 2 index groups of a leader and a follower; 2 decode rows
  per request and step (a speculative token, `rows_per_request` 2); a 1 GiB GPU KV budget that
  holds 11 such requests all-resident and a 1.5 GiB host pool that holds 18, so pages spill, are
  released under GPU pressure and read back from host, and host blocks of finished requests'
  prefixes are evicted. Every request is admitted and finishes within the steps given (the run
  stops early once all have): 22 s with `reference_cpu` on 16 CPU cores, 8 s with nvidia on an
  H200.

Flags given on the command line override a preset's values.
"""

from __future__ import annotations

from collections.abc import Mapping

from hisparse_core.errors import InvalidInputError

PRESETS: Mapping[str, Mapping[str, object]] = {
    "default": {},
    "large": {
        "requests": 64, "context": 32768, "decode_tokens": 16, "steps": 64, "arrival_every": 0,
        "prefix_groups": 4, "shared_fraction": 0.5, "layers": 4, "index_share": 2, "rows_per_request": 2,
        "gpu_kv_bytes": 1 << 30, "host_bytes": 3 << 29,
    },
}


def preset(name: str) -> Mapping[str, object]:
    """The `RunConfig` overrides of a preset; `InvalidInputError` naming the known ones."""
    if name not in PRESETS:
        raise InvalidInputError(f"unknown run preset {name!r}; expected one of {sorted(PRESETS)}")
    return PRESETS[name]
