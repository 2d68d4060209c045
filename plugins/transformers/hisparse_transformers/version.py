"""Which transformers releases hisparse_transformers supports, checked before anything is patched."""

from __future__ import annotations

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
