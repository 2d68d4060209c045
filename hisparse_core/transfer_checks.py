"""Argument checks of a transfer engine: its pool and runtimes, and the ids it must acknowledge.

Torch-free. Every failure raises before the engine is built or work is submitted.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar

from hisparse_core.errors import InvalidInputError, ProtocolError, a_or_an

if TYPE_CHECKING:  # it loads torch; the checks themselves do not need it
    from hisparse_core.host_pool import HostPool


class _Bindable(Protocol):
    # `bound` is not part of CacheRuntime's interface, but every backend's runtime has it.
    @property
    def bound(self) -> bool: ...


_P = TypeVar("_P", bound="HostPool")
_R = TypeVar("_R", bound=_Bindable)


def check_engine_pool(host_pool: object, kind: type[_P], expected: str) -> _P:
    """A live host pool of `kind`; `expected` names it with its article ("an NvidiaHostPool")."""
    if not isinstance(host_pool, kind):
        raise InvalidInputError(f"host_pool must be {expected}, got {type(host_pool).__name__}")
    if host_pool.released:
        raise InvalidInputError("host_pool was released; expected a live pool")
    return host_pool


def check_engine_runtimes(runtimes: object, kind: type[_R], expected: str,
                          each: Callable[[int, _R], None] | None = None) -> tuple[_R, ...]:
    """A non-empty sequence of bound runtimes of `kind` (`expected`: "a ReferenceRuntime").

    `each(i, runtime)` adds a backend's own checks of a runtime, run right after the shared ones
    for that runtime so the first bad runtime is the one reported.
    """
    if isinstance(runtimes, (str, bytes)) or not isinstance(runtimes, Sequence) or not runtimes:
        raise InvalidInputError(f"runtimes must be a non-empty sequence of runtimes, got {runtimes!r}")
    for i, rt in enumerate(runtimes):
        if not isinstance(rt, kind):
            raise InvalidInputError(f"runtimes[{i}] is {a_or_an(type(rt).__name__)}; expected {expected}")
        if not rt.bound:
            raise InvalidInputError(f"runtimes[{i}] is not bound; bind it before building the engine")
        if each is not None:
            each(i, rt)
    return tuple(runtimes)


def check_unique_ids(what: str, ids: Iterable[int], in_flight: Collection[int]) -> None:
    """Each acknowledgement names one piece of work: ids are unique among everything unacknowledged."""
    seen: set[int] = set()
    for i in ids:
        if i in in_flight or i in seen:
            raise ProtocolError(f"{what} {i} is submitted while another with that id is still unacknowledged; "
                                f"expected unique ids until completion is reported")
        seen.add(i)
