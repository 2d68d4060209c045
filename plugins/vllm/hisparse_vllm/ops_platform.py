"""What a platform plugin must patch for vLLM's built-in HiSparse to run off NVIDIA CUDA.

vLLM 0.32 has no platform hook for HiSparse. Besides the four ops (`hisparse_vllm.ops`), its
`vllm/v1/hisparse/runtime.py` and `vllm/config/vllm.py` assume CUDA in these places:

1. `VllmConfig.__post_init__` rejects HiSparse unless `current_platform.is_cuda()` ("HiSparse
   currently requires NVIDIA CUDA."). `allow_hisparse_config()` makes the platform's `is_cuda()`
   answer True to exactly that one call (its line located by the message in the installed source);
   every other caller still gets the platform's own answer.
2. `allocate_pinned_host_pool` pins the host pool with `cudaHostRegister` (`pin_tensor`): the
   platform passes its own registration as `pin_host` (default: leave host memory as it is, right
   for a host-only device).
3. On a device without streams and events (the CPU), the runtime's copy stream
   (`torch.Stream`), its per-layer ready events (`torch.Event`), `current_stream()`, the pinned
   stats buffer (`torch.empty(..., pin_memory=True)`), `torch.accelerator` (the current device
   index, a synchronize at teardown) and the sparse-MLA index group's side stream
   and events (`vllm/v1/attention/backends/mla/index_group.py`) do not exist. There, work is ordered by
   program order, so `patch_runtime()` gives the runtime module a stream and an event that order
   nothing and drops `pin_memory`. On an accelerator with streams nothing of this is patched.
4. `use_shared_hisparse_host_pool` shares the TP host pool only where `is_cuda_alike()`: other
   platforms fall back to one private pool per rank (correct, more host memory); not patched.
5. `_check_residency_shared_memory` runs only for `device.type == "cuda"`; a backend checks its own
   limits when it builds its kernels; not patched.

`enable_vllm_hisparse(device_type)` applies 1-3; each step is idempotent and logged. It takes a torch
device type (`cpu`, `xpu`, ...; a typo such as `gpu` is refused, not taken for a device without
streams), once a process: a later call with another device type or `pin_host` is refused, naming
what was applied, since the patches are not undone.
"""

from __future__ import annotations

import linecache
import logging
import sys
import types
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

CONFIG_GATE_MESSAGE = "HiSparse currently requires NVIDIA CUDA."
_patched: set[str] = set()
#: What the first `enable_vllm_hisparse` applied: its device type and `pin_host`.
_applied: dict[str, Any] = {}


class HostOrderedStream:
    """A stream for a device that runs work in program order: waits and records order nothing."""

    def wait_stream(self, other: object) -> None:
        pass

    def wait_event(self, event: object) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event: object = None) -> HostOrderedEvent:
        return event if isinstance(event, HostOrderedEvent) else HostOrderedEvent()

    def __enter__(self) -> HostOrderedStream:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class HostOrderedEvent:
    """An event that is complete when recorded (program order)."""

    def record(self, stream: object = None) -> None:
        pass

    def wait(self, stream: object = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class _HostTorch(types.ModuleType):
    """`torch` as the runtime module sees it on a host-only device: the same module except for the
    stream and event classes, and `empty` without `pin_memory` (no pinned allocator exists)."""

    def __init__(self, real: types.ModuleType) -> None:
        super().__init__("torch")
        self._real = real
        self.Stream = lambda *a, **k: HostOrderedStream()  # noqa: N815 -- torch's names
        self.Event = lambda *a, **k: HostOrderedEvent()  # noqa: N815
        # `create_hisparse_cache_handle` asks for the current accelerator's index: the host is device 0.
        self.accelerator = types.SimpleNamespace(current_device_index=lambda: 0,
                                                 synchronize=lambda *a, **k: None)

    def empty(self, *args: Any, pin_memory: bool = False, **kwargs: Any) -> Any:
        return self._real.empty(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _config_gate_line(source_file: str) -> int:
    """Line number of the `is_cuda()` test guarding CONFIG_GATE_MESSAGE in `source_file`."""
    lines = linecache.getlines(source_file)
    for i, text in enumerate(lines):
        if CONFIG_GATE_MESSAGE in text:
            for j in range(i - 1, max(-1, i - 4), -1):
                if "is_cuda()" in lines[j]:
                    return j + 1
    from hisparse_vllm.ops import vllm_version

    raise RuntimeError(f"{vllm_version()}: {source_file} has no `is_cuda()` gate raising {CONFIG_GATE_MESSAGE!r}; "
                       "hisparse_vllm.ops_platform knows the vLLM 0.32 layout only")


def allow_hisparse_config() -> None:
    """Let `VllmConfig` accept a HiSparse config on this platform (patch 1 of the module docstring)."""
    if "config" in _patched:
        return
    import vllm.config.vllm as config_module
    from vllm.platforms import current_platform

    gate_file = config_module.__file__
    gate_line = _config_gate_line(gate_file)
    real_is_cuda = current_platform.is_cuda

    def is_cuda() -> bool:
        # True for the HiSparse gate's call only; every other caller sees the platform's answer.
        caller = sys._getframe(1)
        if caller.f_code.co_filename == gate_file and caller.f_lineno == gate_line:
            return True
        return bool(real_is_cuda())

    current_platform.is_cuda = is_cuda  # type: ignore[method-assign]
    _patched.add("config")
    logger.info("vLLM HiSparse: VllmConfig's CUDA-only gate (%s:%d) admits platform %r", gate_file, gate_line,
                getattr(current_platform, "device_type", "?"))


def patch_runtime(device_type: str, *, pin_host: Callable[[Any], None] | None = None) -> None:
    """Patches 2 and 3 of the module docstring on vLLM's runtime module."""
    import torch
    import vllm.v1.hisparse.runtime as runtime

    if "pin" not in _patched:
        runtime.pin_tensor = pin_host if pin_host is not None else (lambda tensor: None)  # type: ignore[assignment]
        _patched.add("pin")
        logger.info("vLLM HiSparse: host pool registration is %s",
                    getattr(pin_host, "__name__", "the platform's") if pin_host else "skipped (host-only device)")
    has_streams = device_type != "cpu" and getattr(torch, device_type, None) is not None and \
        hasattr(getattr(torch, device_type), "Stream")
    if not has_streams and "streams" not in _patched:
        runtime.torch = _HostTorch(torch)  # type: ignore[assignment]
        stream = HostOrderedStream()
        runtime.current_stream = lambda: stream  # type: ignore[assignment,return-value]
        # The sparse-MLA index group hands the runtime its side stream and topk-ready event.
        import vllm.v1.attention.backends.mla.index_group as index_group

        index_group._create_side_stream = lambda device: HostOrderedStream()  # type: ignore[assignment,return-value]
        index_group._create_event = HostOrderedEvent  # type: ignore[assignment]
        index_group.current_stream = lambda: stream  # type: ignore[assignment,return-value]
        _patched.add("streams")
        logger.info("vLLM HiSparse: %s has no streams or events; the runtime orders work by program order",
                    device_type)


def enable_vllm_hisparse(device_type: str, *, pin_host: Callable[[Any], None] | None = None,
                         backend: str | None = None) -> str:
    """Everything vLLM's HiSparse needs on `device_type`: the ops (`hisparse_vllm.ops.register_ops`) and
    patches 1-3. Returns which implementation serves the ops. A vLLM whose layout the patches do not know
    is refused before the ops are registered or anything is patched."""
    import vllm.config.vllm as config_module
    import vllm.v1.attention.backends.mla.index_group  # noqa: F401 - patch 3 rewrites it
    import vllm.v1.hisparse.runtime  # noqa: F401 - patches 2 and 3 rewrite it

    from hisparse_vllm.ops import register_ops

    _check_device_type(device_type)
    if _applied:  # once a process: the patches are not undone, so a call asking for others is refused
        if _applied["device_type"] != device_type or not _same_callable(_applied["pin_host"], pin_host):
            raise ValueError(
                f"enable_vllm_hisparse({device_type!r}, pin_host={_name(pin_host)}): vLLM's HiSparse is already "
                f"enabled in this process for {_applied['device_type']!r} with pin_host={_name(_applied['pin_host'])}; "
                "expected the same device type and pin_host (one platform a process)")
    if "config" not in _patched:
        _config_gate_line(config_module.__file__)  # raises for another layout, before anything is applied
    served = register_ops(backend)
    allow_hisparse_config()
    patch_runtime(device_type, pin_host=pin_host)
    _applied.update(device_type=device_type, pin_host=pin_host)
    return served


def _check_device_type(device_type: object) -> None:
    """A torch device type (`cpu`, `cuda`, `xpu`, ...), not a device (`cuda:0`) or a typo: any other
    string would be taken for a device without streams, and its work left unordered."""
    import torch

    try:
        ok = isinstance(device_type, str) and torch.device(device_type).type == device_type
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"enable_vllm_hisparse(device_type={device_type!r}): expected a torch device type such as "
                         "'cpu', 'cuda' or 'xpu' (what torch.device() takes, without an index)")


def _same_callable(a: Callable[[Any], None] | None, b: Callable[[Any], None] | None) -> bool:
    """The same function, or two made by the same definition (a lambda written once, called twice)."""
    return a is b or a is not None and b is not None and getattr(a, "__code__", a) is getattr(b, "__code__", b)


def _name(fn: Callable[[Any], None] | None) -> str:
    return "None" if fn is None else getattr(fn, "__qualname__", repr(fn))
