"""Argument checks shared by the reference runtime and transfer engine.

Every helper raises `InvalidInputError` naming the argument, the bad value and what was expected,
and never mutates anything, so callers run all checks before touching state.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hisparse_core.errors import InvalidInputError


def check_int(name: str, value: object, lo: int, hi: int) -> int:
    """`value` must be a plain int in `[lo, hi)`."""
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


def check_tensor(name: str, t: object, shape: tuple[int | None, ...], dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
    """`t` must be a tensor of `dtype` on `device` with `shape` (None matches any extent)."""
    if not isinstance(t, torch.Tensor):
        raise InvalidInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise InvalidInputError(f"{name} has dtype {t.dtype}; expected {dtype}")
    if t.device != device:
        raise InvalidInputError(f"{name} is on {t.device}; expected {device}")
    if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape)):
        want_s = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
        raise InvalidInputError(f"{name} has shape {list(t.shape)}; expected {want_s}")
    return t


def check_range(name: str, values: torch.Tensor, lo: int, hi: int) -> None:
    """Every element of `values` in `[lo, hi)`; the message names the first offender and its index."""
    bad = (values < lo) | (values >= hi)
    if bool(bad.any()):
        first = tuple(int(i) for i in bad.nonzero()[0])
        index = first[0] if len(first) == 1 else first
        raise InvalidInputError(
            f"{name}[{index}]={int(values[first])} is out of range; expected [{lo}, {hi})")
