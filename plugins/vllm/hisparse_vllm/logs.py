"""Make hisparse's log lines visible in vLLM processes, once each.

vLLM configures only its own `vllm` logger, so INFO lines of `hisparse_*` loggers (backend
selected and why, pool size, capacity, which implementation serves vLLM's HiSparse ops) would
vanish. `route_to_vllm_handlers()` gives those loggers one `VllmOutput` handler, once, unless the
application configured them itself.

`VllmOutput` looks vLLM's handlers up when a record is emitted, not when it is attached: vLLM
0.32 configures its logging lazily (`LLM()` and `vllm serve` load the general plugins, and so
register the ops, before they apply their logging config; `configure_logging` may replace the
handlers later). So a line logged before vLLM's logging exists still prints, and one logged after
a reconfiguration goes through the new handlers:

- vLLM's `vllm` logger has handlers: through those, at its level;
- else the root logger has handlers (the application configured logging, or vLLM runs with
  `VLLM_CONFIGURE_LOGGING=0`): through those;
- else: one plain line on stderr.

Until vLLM has handlers, a line below the level `VLLM_LOGGING_LEVEL` names (the level vLLM will
apply) is dropped, as vLLM's own lines are, unless `VLLM_CONFIGURE_LOGGING=0` leaves the levels
to the application.

A routed logger stops propagating to the root logger: another library that installs a root
handler (vLLM's own zentorch helpers call `logging.debug`, which does) would otherwise print
every hisparse line a second time.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import sys

#: Top-level loggers of the hisparse packages a connector process runs; `_loggers()` adds every
#: installed backend's package (triton's, a vendor's).
HISPARSE_LOGGERS = ("hisparse_core", "hisparse_vllm", "hisparse_reference_cpu", "hisparse_nvidia")

_FALLBACK = logging.StreamHandler(sys.stderr)
_FALLBACK.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))


class VllmOutput(logging.Handler):
    """Hands each record to the handlers in charge when it is emitted (module docstring)."""

    def emit(self, record: logging.LogRecord) -> None:
        vllm = logging.getLogger("vllm")
        if vllm.handlers:
            if record.levelno < vllm.getEffectiveLevel():
                return
            handlers = vllm.handlers
        else:
            if record.levelno < _named_level() and os.environ.get("VLLM_CONFIGURE_LOGGING", "1").strip() != "0":
                return  # the level vLLM applies when it configures its logging, as its own lines will have
            handlers = logging.getLogger().handlers or [_FALLBACK]
        own = _handlers_reached(record.name)  # already handled there (pytest attaches its own to both)
        for handler in handlers:
            if record.levelno >= handler.level and handler not in own:
                handler.handle(record)


def _handlers_reached(name: str) -> set[logging.Handler]:
    """The handlers a record of logger `name` reaches without `VllmOutput`."""
    out: set[logging.Handler] = set()
    logger: logging.Logger | None = logging.getLogger(name)
    while logger is not None:
        out.update(logger.handlers)
        if not logger.propagate:
            break
        logger = logger.parent
    return out


_OUTPUT = VllmOutput()


def _named_level() -> int:
    """The level `VLLM_LOGGING_LEVEL` names (INFO when unset or not a level name)."""
    named = logging.getLevelName(os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper())
    return named if isinstance(named, int) else logging.INFO


def _level() -> int:
    """INFO, or vLLM's level where that is lower (`VLLM_LOGGING_LEVEL=DEBUG`)."""
    vllm = logging.getLogger("vllm")
    return min(logging.INFO, vllm.level or logging.INFO, _named_level())


def _loggers() -> tuple[str, ...]:
    """`HISPARSE_LOGGERS` and the top-level package of each `hisparse.backends` entry point."""
    from hisparse_core.discovery import ENTRY_POINT_GROUP

    backends = {ep.value.split(":")[0].split(".")[0] for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    return (*HISPARSE_LOGGERS, *sorted(backends - set(HISPARSE_LOGGERS)))


def route_to_vllm_handlers() -> None:
    """Attach `VllmOutput` to every hisparse logger the application left unconfigured; idempotent
    (a later call only lowers the level to vLLM's, if vLLM was configured more verbose since)."""
    level = _level()
    for name in _loggers():
        logger = logging.getLogger(name)
        if _OUTPUT in logger.handlers:
            logger.setLevel(min(logger.level, level))
            continue
        if logger.handlers:
            continue  # configured by the application
        logger.addHandler(_OUTPUT)
        logger.propagate = False
        if logger.level == logging.NOTSET:
            logger.setLevel(level)
