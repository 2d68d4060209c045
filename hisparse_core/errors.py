"""Exception hierarchy. Every message names the bad value and what was expected."""

from __future__ import annotations


def a_or_an(noun: str) -> str:
    """`noun` with its indefinite article for a message: "an AcmeRuntime", "an int", "a ReferenceRuntime"
    (by its first letter: the names in these messages are type names, read as spelled)."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


class HiSparseError(Exception):
    """Base class of every hisparse error."""


class InvalidCommandError(HiSparseError, ValueError):
    """A wire object (transfer, mirror, update, metadata) failed validation."""


class InvalidInputError(HiSparseError, ValueError):
    """A runtime call got a tensor of the wrong shape, dtype or device, or a value out of range.

    Raised before any state changes: the call is a no-op when it raises.
    """


class CapacityError(HiSparseError, RuntimeError):
    """A pool or buffer cannot hold what was asked (the message says both numbers)."""


class ProtocolError(HiSparseError, RuntimeError):
    """A peer broke the scheduler/worker protocol (unknown transfer id, duplicate acknowledgement)."""


class BackendError(HiSparseError, RuntimeError):
    """Base of backend discovery and selection errors."""


class BackendNotFoundError(BackendError, LookupError):
    """No backend of that name is registered."""


class BackendUnavailableError(BackendError):
    """The named backend is registered but its probe, import or API version says no."""
