"""A strict accelerator emulated on the CPU, and a backend whose tables and caches live on it.

CUDA refuses an operation that mixes a CUDA tensor with a CPU tensor ("Expected all tensors to be
on the same device"); PyTorch's CPU wheel has no device that does the same with real data (`meta`
holds no data and accepts a CPU value written into it by index; `lazy` accepts it too). This
module builds one on PyTorch's PrivateUse1 key, as an out-of-tree accelerator would register:

- `STRICT` (`privateuseone:0`) is the device, and `strict(i)` its `i`-th index (`DEVICES` of
  them, as a node has several GPUs); `torch.empty/zeros/full/tensor(..., device=strict(i))`
  and `cpu_tensor.to(strict(i))` create `StrictTensor`s, wrappers around CPU memory (`memory_of`).
- Every operation on them runs on that memory, except that any operation given a `StrictTensor`
  and a CPU tensor of one or more dimensions raises the CUDA error above, and so does one given
  `StrictTensor`s of two device indices (whatever their dimensions, as CUDA refuses `cuda:0` with
  `cuda:1`). Copies between the two, and between two indices (`copy_`, `.to`, `.cpu()`), are
  allowed, as on CUDA, and so are 0-dim CPU tensors (scalars).
  Stricter than CUDA in one way: index tensors must be on the device too (CUDA copies CPU
  indices implicitly, a hidden host-to-device transfer on the decode path).
- `data_ptr()` gives the address of the memory behind it (a device with unified addressing), so
  transports that move bytes by address work on it.

`StrictDeviceBackend` is `reference_cpu` with `device = STRICT` (or `StrictDeviceBackend(i)` on
`strict(i)`): the engine-side tensors built for it (source, hot and residency tables, device
caches, resolve inputs) are on that device, its runtimes
refuse inputs that are not and run the reference resolver on the memory behind them. A CPU-built
tensor written into any of its tables therefore fails, exactly as on a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch.utils._pytree import tree_flatten, tree_map

from hisparse_core.checks import check_tensor
from hisparse_core.errors import InvalidInputError
from hisparse_core.geometry import RuntimeConfig
from hisparse_core.host_pool import HostPool
from hisparse_core.resolve_checks import check_resolve_shapes
from hisparse_core.runtime import CacheRuntime, ResolveInputs, ResolveResult, RuntimeStats
from hisparse_core.transfer import TransferEngine
from hisparse_core.types import HostBlockCopy, PageTransfer, RowMirror
from hisparse_reference_cpu.backend import ReferenceCpuBackend
from hisparse_reference_cpu.runtime import ReferenceRuntime

STRICT = torch.device("privateuseone", 0)
#: Device indices the emulated accelerator has (`strict(0)` .. `strict(DEVICES - 1)`).
DEVICES = 4
_aten = torch.ops.aten
#: Operations that move data between devices, which CUDA allows across CPU and device.
_TRANSFERS = frozenset({_aten.copy_.default, _aten._to_copy.default, _aten._copy_from.default,
                        _aten._copy_from_and_resize.default})


def strict(index: int = 0) -> torch.device:
    """Index `index` of the emulated accelerator (`privateuseone:<index>`), registered (`enable`)."""
    if not 0 <= index < DEVICES:
        raise InvalidInputError(f"the strict device has indices 0..{DEVICES - 1}, got {index}")
    if _library is None:
        enable()
    return torch.device("privateuseone", index)


def _index(device: Any) -> int:
    """The strict device index a factory or `.to` names (no index: the current one, 0)."""
    index = torch.device(device).index if device is not None else None
    return 0 if index is None else index


def memory_of(t: torch.Tensor) -> torch.Tensor:
    """The CPU memory behind a `StrictTensor` (shared, not copied)."""
    if not isinstance(t, StrictTensor):
        raise InvalidInputError(f"expected a tensor on {STRICT}, got one on {t.device}")
    return t.memory


class StrictTensor(torch.Tensor):
    """A tensor on `strict(index)`, backed by the CPU tensor `memory` of the same shape and strides."""

    memory: torch.Tensor

    @staticmethod
    def __new__(cls, memory: torch.Tensor, index: int = 0) -> StrictTensor:
        out = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, memory.shape, strides=memory.stride(), storage_offset=memory.storage_offset(), dtype=memory.dtype,
            device=strict(index), requires_grad=False)
        out.memory = memory
        return out

    def __repr__(self) -> str:  # type: ignore[override]
        return f"StrictTensor({self.memory!r})"

    def data_ptr(self) -> int:  # type: ignore[override]
        return self.memory.data_ptr()

    def tolist(self) -> Any:  # type: ignore[override]
        return self.memory.tolist()  # a device-to-host read, as CUDA does it

    def numpy(self, *, force: bool = False) -> Any:  # type: ignore[override]
        raise TypeError(f"can't convert {STRICT} device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
                        "to host memory first.")

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        ours = [t for t in flat if isinstance(t, StrictTensor)]
        index = ours[0].device.index if ours else 0
        if func not in _TRANSFERS:
            cpu = [t for t in flat if isinstance(t, torch.Tensor) and not isinstance(t, StrictTensor) and t.dim()]
            if cpu:
                raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                                   f"{strict(index)} and cpu! (in {func}: a CPU tensor of shape {list(cpu[0].shape)})")
            other = next((t for t in ours if t.device.index != index), None)
            if other is not None:
                raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                                   f"{strict(index)} and {other.device}! (in {func})")

        def unwrap(x: Any) -> Any:
            return x.memory if isinstance(x, StrictTensor) else x

        if func is _aten._to_copy.default:
            target = kwargs.get("device")
            rest = {k: v for k, v in kwargs.items() if k != "device"}
            out = func(*tree_map(unwrap, args), **rest)
            if target is not None and torch.device(target).type == "cpu":
                return out
            return StrictTensor(out, index if target is None else _index(target))
        if func is _aten.copy_.default:
            args[0].memory.copy_(unwrap(args[1])) if isinstance(args[0], StrictTensor) else args[0].copy_(unwrap(args[1]))
            return args[0]
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        by_memory = {id(t.memory): t for t in ours}

        def wrap(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and not isinstance(x, StrictTensor):
                held = by_memory.get(id(x))
                return StrictTensor(x, index) if held is None else held
            return x

        return tree_map(wrap, out)


def _empty(size: Sequence[int], dtype: torch.dtype | None = None, layout: Any = None, device: Any = None,
           pin_memory: Any = None, memory_format: Any = None) -> StrictTensor:
    return StrictTensor(torch.empty(size, dtype=dtype), _index(device))


def _empty_strided(size: Sequence[int], stride: Sequence[int], dtype: torch.dtype | None = None, layout: Any = None,
                   device: Any = None, pin_memory: Any = None) -> StrictTensor:
    return StrictTensor(torch.empty_strided(size, stride, dtype=dtype), _index(device))


def _copy_from(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    source = src.memory if isinstance(src, StrictTensor) else src
    (dst.memory if isinstance(dst, StrictTensor) else dst).copy_(source)
    return dst


class _Devices:
    """The device module PyTorch consults for `privateuseone`: `DEVICES` indices, current 0."""

    def is_initialized(self) -> bool:
        return True

    def is_available(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def _is_in_bad_fork(self) -> bool:
        return False

    def manual_seed_all(self, seed: int) -> None:
        pass

    def device_count(self) -> int:
        return DEVICES


_library: torch.library.Library | None = None


def enable() -> torch.device:
    """Register the device once per process (PyTorch's Python-backend hooks for PrivateUse1)."""
    global _library
    if _library is None:
        from torch.utils import backend_registration

        if torch._C._get_privateuse1_backend_name() != "privateuseone" or hasattr(torch, "privateuseone"):
            raise RuntimeError("PrivateUse1 is already registered by something else in this process")
        backend_registration._setup_privateuseone_for_python_backend(backend_module=_Devices())
        lib = torch.library.Library("aten", "IMPL")
        lib.impl("empty.memory_format", _empty, "PrivateUse1")
        lib.impl("empty_strided", _empty_strided, "PrivateUse1")
        lib.impl("_copy_from", _copy_from, "PrivateUse1")
        _library = lib
    return STRICT


def _on_strict(name: str, t: object, device: torch.device = STRICT) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.device != device:
        where = t.device if isinstance(t, torch.Tensor) else type(t).__name__
        raise InvalidInputError(f"{name} is on {where}; expected a tensor on {device}")
    return memory_of(t)


class StrictDeviceRuntime(CacheRuntime):
    """A reference runtime whose device-side tensors (caches, inputs, results) are on `device`
    (one index of the strict device)."""

    def __init__(self, inner: ReferenceRuntime, device: torch.device = STRICT) -> None:
        self.inner = inner
        self.config: RuntimeConfig = inner.config
        self._device = device
        r = inner.result
        self._result = ResolveResult(*(StrictTensor(t, device.index or 0)
                                       for t in (r.rows, r.valid_counts, r.plan_host, r.plan_device, r.plan_counts)))

    @property
    def device(self) -> torch.device:
        return self._device

    def bind(self, host_layers: Sequence[torch.Tensor], device_layers: Sequence[torch.Tensor],
             *, resident_group: int = 0) -> None:
        for i, h in enumerate(host_layers):
            check_tensor(f"host_layers[{i}]", h, (None, None), self.config.row_format.dtype, torch.device("cpu"))
        memory = [_on_strict(f"device_layers[{i}]", d, self._device) for i, d in enumerate(device_layers)]
        self.inner.bind(host_layers, memory, resident_group=resident_group)

    def resolve(self, inputs: ResolveInputs, *, gather: bool = True, validate: bool = True) -> ResolveResult:
        check_resolve_shapes(inputs, self.config, self._device)
        self.inner.resolve(ResolveInputs(*(memory_of(t) for t in (inputs.topk, inputs.row_state, inputs.seq_lens,
                                                                  inputs.source_table, inputs.resident_table,
                                                                  inputs.hot_table))),
                           gather=gather, validate=validate)
        return self._result

    @property
    def result(self) -> ResolveResult:
        return self._result

    def gather_misses(self, layer: int = 0) -> None:
        self.inner.gather_misses(layer)

    def replay_plan(self, layers: Sequence[int] | None = None) -> None:
        self.inner.replay_plan(layers)

    def mirror_rows(self, mirrors: Sequence[RowMirror]) -> None:
        self.inner.mirror_rows(mirrors)

    def spill_pages(self, transfers: Sequence[PageTransfer]) -> None:
        self.inner.spill_pages(transfers)

    def restore_pages(self, transfers: Sequence[PageTransfer]) -> None:
        self.inner.restore_pages(transfers)

    def copy_host_blocks(self, copies: Sequence[HostBlockCopy]) -> None:
        self.inner.copy_host_blocks(copies)

    def invalidate_written_slots(self, state_rows: torch.Tensor, host_rows: torch.Tensor) -> None:
        self.inner.invalidate_written_slots(_on_strict("state_rows", state_rows, self._device),
                                            _on_strict("host_rows", host_rows, self._device))

    def invalidate_host_blocks(self, block_ids: Sequence[int]) -> None:
        self.inner.invalidate_host_blocks(block_ids)

    def reset_state(self, state_rows: Sequence[int] | None = None) -> None:
        self.inner.reset_state(state_rows)

    def hot_state(self, state_row: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.hot_state(state_row)

    def stats(self) -> RuntimeStats:
        return self.inner.stats()

    def reset_stats(self) -> None:
        self.inner.reset_stats()


class StrictDeviceBackend(ReferenceCpuBackend):
    """`reference_cpu` on one index of the strict device (host pool in CPU memory, as on a GPU);
    `device`: an index, or a `privateuseone` device (default `STRICT`), as `NvidiaBackend(device)`."""

    name: ClassVar[str] = "strict_device"

    def __init__(self, device: torch.device | int | None = None, *, completion_lag: int = 1) -> None:
        super().__init__(completion_lag=completion_lag)
        enable()
        if isinstance(device, int):
            device = strict(device)
        device = torch.device(device) if device is not None else STRICT
        if device.type != "privateuseone":
            raise InvalidInputError(f"strict_device runs on the strict device, not {device}")
        self._device = strict(device.index or 0)

    @property
    def device(self) -> torch.device:
        return self._device

    def create_runtime(self, config: RuntimeConfig) -> CacheRuntime:
        inner = super().create_runtime(config)
        assert isinstance(inner, ReferenceRuntime)
        return StrictDeviceRuntime(inner, self._device)

    def create_transfer_engine(self, host_pool: HostPool, runtimes: Sequence[CacheRuntime]) -> TransferEngine:
        inner = []
        for i, rt in enumerate(runtimes):
            if not isinstance(rt, StrictDeviceRuntime):
                raise InvalidInputError(f"runtimes[{i}] must be a StrictDeviceRuntime, got {type(rt).__name__}")
            inner.append(rt.inner)
        return super().create_transfer_engine(host_pool, inner)
