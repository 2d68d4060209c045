"""Offline `LLM`: the hisparse gauges follow `reset_prefix_cache(reset_connector=True)` at once.

vLLM sends statistics to the front end only with an engine step's outputs. After a connector
reset the scheduler-role connector asks for one more step (`has_pending_push_work`), whose stats
bring the gauges down. The API server's output loop reads that step at once; the offline
`LLMEngine` reads outputs only inside `step()`, so its gauges stayed stale until the next
`generate` (issue 41, item 3), whether the engine core runs in-process or in a child process.

`install()` (run by the general plugin) wraps `LLMEngine.reset_prefix_cache`: when hisparse's
connector is configured, stats are logged (hisparse's Prometheus metrics exist in this
process), the reset succeeded and no request of the caller is
unfinished, it runs `step()` until the stats of the step after the reset reached the stat loggers
(Prometheus and the periodic log). In-process that is one step. With the engine core in a child
process, the outputs of its idle steps before the reset (the last spills' acknowledgements) may
still be queued unread, so it steps through them too, until the metrics observe the connector's
new `reset_epoch` (`stats.reset_epochs_observed`); the reset succeeds only on an idle connector,
so the step after it is the engine's last and every one of these steps returns no request
output. With unfinished requests it does nothing: their own steps carry the stats, and a step
here could take outputs the caller expects from its own `step()`.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

_MARK = "_hisparse_steps_after_reset"


def _uses_hisparse(engine: Any) -> bool:
    from hisparse_vllm import CONNECTOR_NAME

    transfer = getattr(getattr(engine, "vllm_config", None), "kv_transfer_config", None)
    return transfer is not None and transfer.kv_connector == CONNECTOR_NAME


def install() -> None:
    """Wrap `LLMEngine.reset_prefix_cache` once per process (idempotent), where `LLMEngine` is
    imported: an offline front end imports it before it loads the general plugins (`LLM` and
    `EngineArgs` do), and engine-core and worker processes, which never run it, are spared the import."""
    module = sys.modules.get("vllm.v1.engine.llm_engine")
    if module is None:
        return
    LLMEngine = module.LLMEngine  # noqa: N806 (vLLM's class)
    reset = LLMEngine.reset_prefix_cache
    if getattr(reset, _MARK, False):
        return

    @functools.wraps(reset)
    def reset_prefix_cache(self: Any, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        from hisparse_vllm.stats import prom_metrics_built, reset_epochs_observed

        seen = reset_epochs_observed()
        done = reset(self, reset_running_requests, reset_connector)
        if (done and reset_connector and getattr(self, "log_stats", False) and prom_metrics_built()
                and _uses_hisparse(self) and not self.has_unfinished_requests()):
            while reset_epochs_observed() <= seen:
                self.step()  # up to the step the connector asked for: its stats update the gauges
        return done

    setattr(reset_prefix_cache, _MARK, True)
    LLMEngine.reset_prefix_cache = reset_prefix_cache  # type: ignore[method-assign]
