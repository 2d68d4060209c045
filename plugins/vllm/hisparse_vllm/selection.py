"""`auto` as a backend name in vLLM's processes, and the device check of the connector's backend.

`auto` means the registry's automatic choice wherever the vLLM plugin takes a backend name: the
connector's `backend` key, `register_ops(backend=...)` / `enable_vllm_hisparse(backend=...)` and
`HISPARSE_BACKEND`, as `hisparse_transformers.enable(backend="auto")` does. The registry itself
reads `HISPARSE_BACKEND` as a backend name, and would refuse `auto` ("no hisparse backend named
'auto'"). So `accept_auto_env()`, called where the plugin starts in a process (the general plugin's
`register()`) and before each choice it makes, removes `HISPARSE_BACKEND=auto` from the process's
environment, the meaning being the same (unset: automatic), and says so in one INFO line; the
processes vLLM starts afterwards inherit the environment without it and say nothing more. The
registry's own line (and the connector's, and the op set's) then names the backend and why.

`check_engine_device` refuses, in one line, a connector backend that runs on another device type
than the engine's KV cache (`nvidia` on vLLM's CPU platform; `reference_cpu`, or `triton` under
`TRITON_INTERPRET=1`, on CUDA). A backend's device is known once it is built, and building a GPU
backend initialises CUDA, which vLLM's front end and engine core must not do (they fork or spawn
the processes that use the GPU), so the check runs where the backend is built: when vLLM builds
the connector's worker role, before vLLM allocates its KV cache and before any host pool or
/dev/shm file exists.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from hisparse_core.errors import InvalidInputError
from hisparse_core.registry import ENV_BACKEND, Selection

logger = logging.getLogger(__name__)

AUTO = "auto"
_lock = threading.Lock()


def is_auto(value: object) -> bool:
    """Whether `value` asks for automatic selection (`auto`, any case, surrounding blanks ignored)."""
    return isinstance(value, str) and value.strip().lower() == AUTO


def backend_name(name: str | None) -> str | None:
    """A backend name as the registry takes it: `auto` is None (then `HISPARSE_BACKEND`, else automatic)."""
    return None if name is None or is_auto(name) else name


def accept_auto_env() -> None:
    """`HISPARSE_BACKEND=auto`: remove it from this process's environment (the registry's automatic
    choice, as when it is unset), with one INFO line. Anything else is left as it is: the registry
    refuses a name it does not know, naming the variable."""
    with _lock:
        value = os.environ.get(ENV_BACKEND)
        if value is None or not is_auto(value):
            return
        del os.environ[ENV_BACKEND]
    logger.info("%s=%r: hisparse backends are chosen automatically, as when it is unset (the highest-priority "
                "available backend; the line naming it says why)", ENV_BACKEND, value)


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
