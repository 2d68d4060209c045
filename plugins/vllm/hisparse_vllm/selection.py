"""What chose the connector's backend, in the user's words, and the device check of that backend.

`check_engine_device` refuses, in one line, a connector backend that runs on another device type
than the engine's KV cache (`nvidia` on vLLM's CPU platform; `reference_cpu`, or `triton` under
`TRITON_INTERPRET=1`, on CUDA). A backend's device is known once it is built, and building a GPU
backend initialises CUDA, which vLLM's front end and engine core must not do (they fork or spawn
the processes that use the GPU), so the check runs where the backend is built: when vLLM builds
the connector's worker role, before vLLM allocates its KV cache and before any host pool or
/dev/shm file exists.
"""

from __future__ import annotations

from typing import Any

from hisparse_core.errors import InvalidInputError
from hisparse_core.registry import ENV_BACKEND, Selection


def chosen_by(selection: Selection, key: str) -> str:
    """What chose the backend, as the user set it: the `key` (the connector's `backend`), the
    variable, or automatic selection."""
    if selection.source == "automatic":
        return f"the automatic choice ({key} and {ENV_BACKEND} unset or \"auto\")"
    if selection.source == ENV_BACKEND:
        return f"{ENV_BACKEND}={selection.name}"
    return f"{key}={selection.name!r}"


def check_engine_device(backend: Any, engine_device_type: str, selection: Selection, key: str) -> None:
    """Refuse a built `backend` whose device type is not the engine's (`InvalidInputError`, one line
    naming the setting that chose it, its device and what is expected)."""
    got = backend.device.type
    if got == engine_device_type:
        return
    fix = (f"set {key} to one that runs on {engine_device_type}" if selection.source == "automatic" else
           f"expected a backend that runs on {engine_device_type}")
    raise InvalidInputError(
        f"{chosen_by(selection, key)}: hisparse backend {backend.name!r} runs on {got}, but this engine's KV cache "
        f"is on {engine_device_type} (vLLM's device); {fix}")
