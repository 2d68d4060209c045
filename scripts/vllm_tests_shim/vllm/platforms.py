"""`vllm.platforms.current_platform` as vLLM's kernel tests read it: the device they allocate on."""

import os

#: What `HISPARSE_SHIM_DEVICE` may name (default cuda); the package refuses anything else.
DEVICES = ("cuda", "cpu")


class _Platform:
    device_type = os.environ.get("HISPARSE_SHIM_DEVICE", "").strip().lower() or "cuda"


current_platform = _Platform()
