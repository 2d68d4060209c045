"""`vllm.platforms.current_platform` as vLLM's kernel tests read it: the device they allocate on."""

import os


class _Platform:
    device_type = os.environ.get("HISPARSE_SHIM_DEVICE", "cuda")


current_platform = _Platform()
