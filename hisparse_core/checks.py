"""Primitive argument checks shared by every backend.

Each helper raises `InvalidInputError` naming the argument, the bad value and what was expected,
and mutates nothing, so a runtime can run all of its checks before touching any state (a raising
call is then a no-op).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import TypeVar

import torch

from hisparse_core.errors import InvalidInputError

_T = TypeVar("_T")


def as_index(value: object) -> int | None:
    """`value` as the plain int `operator.index` makes of it (an int, a numpy integer, a
    one-element integer tensor), else None: a bool (an int subclass, but never meant as a count;
    a bool tensor too), a float (even a whole one), anything else. For the user-facing counts of
    an API (sizes, token counts), which a caller may well hold as numpy or torch integers."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        return None
    try:
        return operator.index(value)   # type: ignore[arg-type]
    except TypeError:
        return None


def check_int(name: str, value: object, lo: int, hi: int) -> int:
    """`value` must be a plain int in `[lo, hi)`."""
    # bool is an int subclass, but True as an index is always a caller's bug.
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInputError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if not lo <= value < hi:
        raise InvalidInputError(f"{name}={value} is out of range; expected [{lo}, {hi})")
    return value


def check_ints(name: str, values: object, lo: int, hi: int) -> list[int]:
    """A sequence (not a string or tensor) of ints, each in `[lo, hi)`."""
    if isinstance(values, (str, bytes, torch.Tensor)) or not isinstance(values, Sequence):
        raise InvalidInputError(f"{name} must be a sequence of ints, got {type(values).__name__}")
    return [check_int(f"{name}[{i}]", v, lo, hi) for i, v in enumerate(values)]


def check_sequence(name: str, items: object, kind: type[_T]) -> list[_T]:
    """A sequence (not a string) whose every item is a `kind`."""
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise InvalidInputError(f"{name} must be a sequence of {kind.__name__}, got {type(items).__name__}")
    for i, x in enumerate(items):
        if not isinstance(x, kind):
            raise InvalidInputError(f"{name}[{i}] must be a {kind.__name__}, got {type(x).__name__}")
    return list(items)


def check_tensor(name: str, t: object, shape: tuple[int | None, ...], dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
    """`t` must be a tensor of `dtype` on `device` with `shape` (None matches any extent)."""
    if not isinstance(t, torch.Tensor):
        raise InvalidInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise InvalidInputError(f"{name} has dtype {t.dtype}; expected {dtype}")
    if t.device != device:
        raise InvalidInputError(f"{name} is on {t.device}; expected {device}")
    if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape, strict=False)):
        want_s = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
        raise InvalidInputError(f"{name} has shape {list(t.shape)}; expected {want_s}")
    return t


def check_range(name: str, values: torch.Tensor, lo: int, hi: int) -> None:
    """Every element of `values` in `[lo, hi)`; the message names the first offender and its index."""
    bad = (values < lo) | (values >= hi)
    if bool(bad.any()):
        first = tuple(int(i) for i in bad.nonzero()[0])
        index = first[0] if len(first) == 1 else first
        raise InvalidInputError(f"{name}[{index}]={int(values[first])} is out of range; expected [{lo}, {hi})")


def span_fits(start: int, n: int, limit: int, bs: int) -> bool:
    """Whether rows `[start, start + n)` lie inside `limit` rows and inside one block of `bs` rows
    (`check_span`'s test, with no message built: callers on the decode path test first)."""
    return start + n <= limit and start // bs == (start + n - 1) // bs


def check_span(name: str, start: int, n: int, limit: int, bs: int) -> None:
    """Rows `[start, start + n)` lie inside `limit` rows and inside one block of `bs` rows."""
    if start + n > limit:
        raise InvalidInputError(f"{name} rows [{start}, {start + n}) exceed the {limit} rows bound; expected "
                                f"a span inside the buffer")
    if start // bs != (start + n - 1) // bs:
        raise InvalidInputError(f"{name} rows [{start}, {start + n}) cross a block boundary (block_size={bs}); "
                                f"expected the coordinator to split spans at page edges")


def check_bind_arguments(host_layers: object, device_layers: object, num_layers: int, resident_group: object, *,
                         bound: bool) -> None:
    """The arguments of `CacheRuntime.bind` that every backend checks alike: not bound yet, one
    host view and one device cache per layer, and `resident_group` in `[0, 2^31)`. The tensors
    themselves are the backend's to check (devices, layouts and registration differ)."""
    if bound:
        raise InvalidInputError("runtime is already bound; bind is called once")
    for name, layers in (("host_layers", host_layers), ("device_layers", device_layers)):
        if not isinstance(layers, Sequence) or len(layers) != num_layers:
            got = len(layers) if isinstance(layers, Sequence) else type(layers).__name__
            raise InvalidInputError(f"{name} has {got} entries; expected num_layers={num_layers}")
    check_int("resident_group", resident_group, 0, 1 << 31)
