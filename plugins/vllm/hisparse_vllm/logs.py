"""Make hisparse's log lines visible in vLLM processes, once each.

vLLM configures only its own `vllm` logger, so INFO lines of `hisparse_*` loggers (backend
selected and why, pool size, capacity) would vanish. `route_to_vllm_handlers()` gives those
loggers vLLM's handlers and level, once, unless the application configured them itself. A logger
routed this way stops propagating to the root logger: another library that installs a root
handler (vLLM's own zentorch helpers call `logging.debug`, which does) would otherwise print
every hisparse line a second time.
"""

from __future__ import annotations

import logging

#: Top-level loggers of the hisparse packages a connector process runs.
HISPARSE_LOGGERS = ("hisparse_core", "hisparse_vllm", "hisparse_reference_cpu", "hisparse_nvidia")


def route_to_vllm_handlers() -> None:
    vllm_logger = logging.getLogger("vllm")
    if not vllm_logger.handlers:
        return
    for name in HISPARSE_LOGGERS:
        logger = logging.getLogger(name)
        if logger.handlers:
            continue
        for handler in vllm_logger.handlers:
            logger.addHandler(handler)
        logger.propagate = False
        if logger.level == logging.NOTSET:
            logger.setLevel(vllm_logger.level or logging.INFO)
