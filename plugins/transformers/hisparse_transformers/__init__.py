"""hisparse for Hugging Face transformers: DeepSeek-V3.2 and GLM-5 (DSA) models decode through
hisparse's host pool, coordinator, worker and backend.

    import hisparse_transformers
    with hisparse_transformers.enable(model, host_pool_gib=8, gpu_kv_gib=1) as hs:
        out = model.generate(input_ids, attention_mask=mask, max_new_tokens=64)
        print(hs.stats())

Importing this package is light: transformers and torch load when `enable` (or a name below) is
first used.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "enable": "hisparse_transformers.handle",
    "disable": "hisparse_transformers.handle",
    "HiSparseHandle": "hisparse_transformers.handle",
    "HiSparseCache": "hisparse_transformers.cache",
    "HiSparseStats": "hisparse_transformers.stats",
    "RowMismatch": "hisparse_transformers.check",
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
