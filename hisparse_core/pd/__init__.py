"""P/D import: a decoder reads a prefill instance's KV pages into the hisparse host pool.

Platform-neutral pieces (handshake and job wire types, the import plan, the import ledger, the
decoder worker's receiver and scheduler-side manager) plus a NIXL transport
(`hisparse_core.pd.nixl_transport`) that imports NIXL only when an agent is created. Names are
resolved lazily, so the scheduler process can read the wire types without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "PD_PROTOCOL_VERSION": "hisparse_core.pd.handshake",
    "KvRegion": "hisparse_core.pd.handshake",
    "PrefillHandshake": "hisparse_core.pd.handshake",
    "RemotePrefill": "hisparse_core.pd.handshake",
    "StaleHandshakeError": "hisparse_core.pd.errors",
    "DescriptorRangeError": "hisparse_core.pd.errors",
    "ImportTransferError": "hisparse_core.pd.errors",
    "HostImportJob": "hisparse_core.pd.messages",
    "FailedRecv": "hisparse_core.pd.messages",
    "RecvReport": "hisparse_core.pd.messages",
    "ReadNotice": "hisparse_core.pd.messages",
    "ImportPlan": "hisparse_core.pd.plan",
    "PageRun": "hisparse_core.pd.plan",
    "HostLayout": "hisparse_core.pd.plan",
    "build_import_plan": "hisparse_core.pd.plan",
    "ImportTransport": "hisparse_core.pd.transport",
    "StagingBuffer": "hisparse_core.pd.staging",
    "HostImportReceiver": "hisparse_core.pd.receiver",
    "ReceiverConfig": "hisparse_core.pd.receiver",
    "HostImportScheduler": "hisparse_core.pd.importer",
    "NixlConfig": "hisparse_core.pd.nixl_transport",
    "NixlPrefillServer": "hisparse_core.pd.nixl_transport",
    "NixlDecoderTransport": "hisparse_core.pd.nixl_transport",
    "nixl_available": "hisparse_core.pd.nixl_transport",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hisparse_core.pd' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
