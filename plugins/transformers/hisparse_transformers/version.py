"""Which transformers releases hisparse_transformers supports, checked before anything is patched.

What differs inside the range, and how the adapters cope:

- 5.17/5.18 cache the expanded K/V (`cache.update(key_states, value_states)` after `expand_kv`);
  5.19+ cache the latent (`cache.update(k_pass, k_rot)`). The patched attention writes the latent
  itself and never calls `cache.update`, so both work.
- 5.24 renames the cache argument of `generate`, the model, the decoder layers, the attention and
  the indexer from `past_key_values` to `cache` (`deprecate_kwarg`, the old name still accepted).
  The hooks and the patched attention read either name; hisparse's own calls (the patched
  generate, the demo's reference generate) pass the name the model's `forward` declares
  (`cache_kwarg`), so no release prints its deprecation FutureWarning; the indexer is called
  positionally. (`generate` itself declares neither name in 5.24: it takes them through
  `**kwargs` behind `deprecate_kwarg`, so its signature cannot tell.)
- Mask keys (`deepseek_sparse_attention` -> `indexed_attention`), layer types and output classes
  (`MoeModelOutputWithPast` from 5.19) changed; none of them is read here.
- GLM-5's attention returns `(out, weights, topk)` in every release of the range.
"""

from __future__ import annotations

import inspect
from typing import Any

from hisparse_core.errors import HiSparseError

#: Tested range: 5.17 is the oldest release whose DeepSeek-V3.2 and GLM-5 (DSA) modules have the
#: layout the adapters read (q_lora projections, `indexer(..., cache)`, `expand_kv`); 5.24 the newest
#: on the package index. 5.17/5.18 cache the expanded K/V and 5.19+ the latent, which does not
#: matter here: hisparse's attention writes the latent itself and never calls `cache.update`.
MIN_VERSION = (5, 17)
MAX_VERSION_EXCLUSIVE = (5, 25)
SUPPORTED = ">=5.17,<5.25"


class UnsupportedVersionError(HiSparseError, RuntimeError):
    """The installed transformers is outside the tested range (or missing)."""


def _release(version: str) -> tuple[int, int]:
    parts = version.split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or "0")
    except (IndexError, ValueError):
        raise UnsupportedVersionError(f"transformers version {version!r} is not a release number; expected "
                                      f"transformers{SUPPORTED}") from None


def check_version(version: str | None = None) -> str:
    """Return the installed (or given) transformers version; `UnsupportedVersionError` outside the range."""
    if version is None:
        try:
            from importlib.metadata import PackageNotFoundError
            from importlib.metadata import version as dist_version

            version = dist_version("transformers")
        except PackageNotFoundError:
            raise UnsupportedVersionError(f"transformers is not installed; expected transformers{SUPPORTED} "
                                          "(pip install 'hisparse[transformers]')") from None
    if not MIN_VERSION <= _release(version) < MAX_VERSION_EXCLUSIVE:
        raise UnsupportedVersionError(f"transformers {version} is not supported; expected transformers{SUPPORTED} "
                                      "(the range hisparse_transformers is tested against)")
    return version


def cache_kwarg(model: Any) -> str:
    """The name this transformers release gives the cache argument: "cache" where the model's
    `forward` declares it (5.24+), else "past_key_values" (5.17-5.23)."""
    forward = getattr(type(model), "forward", None)
    try:
        params = inspect.signature(forward).parameters if forward is not None else {}
    except (TypeError, ValueError):
        params = {}
    return "cache" if "cache" in params else "past_key_values"
