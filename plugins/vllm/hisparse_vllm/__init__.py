"""hisparse for vLLM: an out-of-tree KV connector (`HiSparseOffloadConnector`).

Two ways to load it:

- installed (`pip install hisparse`), the `vllm.general_plugins` entry point calls `register()`
  in every vLLM process, and `--kv-transfer-config '{"kv_connector":"HiSparseOffloadConnector",
  "kv_role":"kv_both","kv_connector_extra_config":{"host_pool_gib":32}}'` selects it;
- without the entry point, name the module: `"kv_connector_module_path":"hisparse_vllm"` (or
  `"hisparse_vllm.connector"`) with the same `kv_connector` name.

The name differs from vLLM's built-in `HiSparseConnector` on purpose: both can be installed.
Importing this package imports neither vLLM nor torch; the connector class is resolved lazily.
"""

from __future__ import annotations

import importlib
import logging
import threading
from typing import Any

#: The name `kv_connector` selects; not vLLM's built-in "HiSparseConnector".
CONNECTOR_NAME = "HiSparseOffloadConnector"
CONNECTOR_MODULE = "hisparse_vllm.connector"
CONNECTOR_CLASS = "HiSparseOffloadConnector"

__all__ = ["CONNECTOR_CLASS", "CONNECTOR_MODULE", "CONNECTOR_NAME", "HiSparseOffloadConnector", "register"]

logger = logging.getLogger(__name__)
_lock = threading.Lock()


def register() -> None:
    """Register the connector with vLLM's `KVConnectorFactory` (the `vllm.general_plugins` hook).

    vLLM calls general plugins once per process, but several entry points (or a test) may call
    this again: a second call is a no-op.
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from hisparse_vllm.logs import route_to_vllm_handlers

    # vLLM's logger is configured by now (importing vLLM does it): connect hisparse's loggers to
    # it before the ops are registered, so their one line (which implementation, and why) shows.
    route_to_vllm_handlers()
    with _lock:
        if CONNECTOR_NAME in KVConnectorFactory._registry:
            return
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_CLASS)
    importlib.import_module("hisparse_vllm.frontend_check").install()  # config errors before any engine starts
    importlib.import_module("hisparse_vllm.offline_stats").install()  # gauges follow an offline connector reset
    importlib.import_module("hisparse_vllm.ops").register_from_plugin()  # vLLM's own HiSparse ops, where absent
    logger.debug("registered KV connector %r -> %s:%s", CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_CLASS)


def __getattr__(name: str) -> Any:
    # Lets `kv_connector_module_path="hisparse_vllm"` resolve the class without an eager import.
    if name == CONNECTOR_CLASS:
        return getattr(importlib.import_module(CONNECTOR_MODULE), CONNECTOR_CLASS)
    raise AttributeError(f"module 'hisparse_vllm' has no attribute {name!r}")
