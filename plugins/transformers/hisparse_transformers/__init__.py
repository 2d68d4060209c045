"""hisparse for Hugging Face transformers: DeepSeek-V3.2 and GLM-5 (DSA) models decode through
hisparse's host pool, coordinator, worker and backend.

    import hisparse_transformers
    with hisparse_transformers.enable(model, host_pool_gib=8, gpu_kv_gib=1) as hs:
        out = model.generate(input_ids, attention_mask=mask, max_new_tokens=64)
        print(hs.stats())

Importing this package is light: transformers and torch load when `enable` (or a name below) is
first used.

The modules stand in one-way layers (`LAYERS`, bottom first): a module imports only modules of
layers below its own, `TYPE_CHECKING` imports included, never one beside or above it
(tests/transformers_plugin/test_layers.py holds every import to this).

1. leaves, importing nothing of the package: `rows` (RowMap), `tokens`, `families` (DSA layouts),
   `budgets`, `stats`, `version`, `tiny`, `shards` (the layers' devices under `device_map`),
   `ranks` (tensor-parallel ranks), `assisted` (what an assisted generate asks for), `model_topk`
   (benchmarks: decode top-k from the replay's locality model), `index_keys` (how the indexer keys
   are stored: the model's dtype or fp8);
2. `session`: a batch's requests and the step in progress (Request, Session, StepState), and
   `forced` (teacher-forced logits, for comparing runs that free-running decoding would let part
   ways; it takes the cache argument's name from `version`), and `kv_rows` (how the latent rows
   are stored: the model's dtype or DeepSeek-V3.2's fp8 bytes; its fp8 rounding is `index_keys`');
3. `prefetch`: the cross-layer prefetch (the next index group's resolve on this group's top-k);
4. `engine`: the engine role (GPU block pool, coordinator, a worker per device, device caches and tables); it
   knows nothing of the model's attention, the cache or the checker;
5. what the attention layers consult: `cache` (HiSparseCache) and `check` (the exactness checker,
   which takes the session, step and rows it checks as arguments);
6. the model's forward: `attention` (the patched layer) and `graphs` (the captured decode step);
7. `handle`: `enable` builds the engine and wires the attention layers, the graphs and the checker
   onto the model;
8. this package (`__init__`: the lazy names below);
9. `demo` (the tiny model run `hisparse generate` uses);
10. `cli` (the `hisparse generate` command).
"""

from __future__ import annotations

import importlib
from typing import Any

#: The import layers of this package, bottom first (see the module docstring).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("rows", "tokens", "families", "budgets", "stats", "version", "tiny", "shards", "ranks", "assisted",
     "model_topk", "index_keys"),
    ("session", "forced", "kv_rows"),
    ("prefetch",),
    ("engine",),
    ("cache", "check"),
    ("attention", "graphs"),
    ("handle",),
    ("__init__",),
    ("demo",),
    ("cli",),
)

_LAZY = {
    "enable": "hisparse_transformers.handle",
    "disable": "hisparse_transformers.handle",
    "HiSparseHandle": "hisparse_transformers.handle",
    "HiSparseCache": "hisparse_transformers.cache",
    "HiSparseStats": "hisparse_transformers.stats",
    "RowMismatch": "hisparse_transformers.check",
    "TopkMismatch": "hisparse_transformers.check",
    "UnsupportedCacheOperation": "hisparse_transformers.cache",
    "HiSparseError": "hisparse_transformers.handle",
    "NotADsaModelError": "hisparse_transformers.families",
    "UnsupportedVersionError": "hisparse_transformers.version",
    "SUPPORTED": "hisparse_transformers.version",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hisparse_transformers' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
