"""Check the connector's configuration in vLLM's front end, before any engine process starts.

vLLM 0.32 builds `VllmConfig` in the front end (the `LLM` constructor, `vllm serve`) and hands
the `KVTransferConfig` to no connector hook there, except `requires_piecewise_for_cudagraph`
when CUDA graphs are on (never on the CPU or with `enforce_eager`). It does resolve the connector
class from that config while it builds `VllmConfig`, on every platform: `supports_hma_config`
calls `KVConnectorFactory.get_connector_class(kv_transfer_config)`. `install()` (run by the
general plugin, `hisparse_vllm.register`) wraps that classmethod so that, when the class it
resolves is hisparse's connector, `check_kv_transfer_config(kv_transfer_config)` runs first: a
bad key or value then fails in the front end, in well under a second of building the config,
instead of in the engine core after the weights load. Any other connector resolves unchanged.

In vLLM's own server program (`python -m vllm.entrypoints.openai.api_server`, `vllm serve`) a
refused configuration is a usage error: its one ERROR line, then exit status 2, without the
traceback an uncaught error prints through vLLM's config and asyncio frames. In any other
program (the `LLM` constructor) it raises, so the caller can catch it.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

from hisparse_core.errors import HiSparseError

_MARK = "_hisparse_checks_config"


def in_vllms_own_program() -> bool:
    """Whether this process runs one of vLLM's programs (its `__main__` is a `vllm` module, or the
    `vllm` console script), not a Python program of the user's that imports vLLM."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    module = str(getattr(spec, "name", "") or "")
    return module.split(".")[0] == "vllm" or os.path.basename(sys.argv[0] if sys.argv else "") == "vllm"


def install() -> None:
    """Wrap `KVConnectorFactory.get_connector_class` once per process (idempotent)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    resolve = KVConnectorFactory.__dict__["get_connector_class"].__func__
    if getattr(resolve, _MARK, False):
        return

    @functools.wraps(resolve)
    def get_connector_class(cls: type, kv_transfer_config: Any) -> Any:
        connector_cls = resolve(cls, kv_transfer_config)
        check = getattr(connector_cls, "check_kv_transfer_config", None)
        if check is not None and getattr(connector_cls, "__module__", "").startswith("hisparse_vllm"):
            try:
                check(kv_transfer_config)
            except HiSparseError:  # its one line is logged already
                if in_vllms_own_program():
                    raise SystemExit(2) from None
                raise
        return connector_cls

    setattr(get_connector_class, _MARK, True)
    KVConnectorFactory.get_connector_class = classmethod(get_connector_class)  # type: ignore[method-assign,assignment]
