"""Errors of the P/D import path. Each names the bad value and what was expected."""

from __future__ import annotations

from hisparse_core.errors import HiSparseError, InvalidCommandError, ProtocolError


class StaleHandshakeError(ProtocolError):
    """A handshake or request names another protocol version or another prefill generation."""


class DescriptorRangeError(InvalidCommandError):
    """An import names a page or block outside what the peer registered (caught before posting)."""


class ImportTransferError(HiSparseError, RuntimeError):
    """The transport reported a failed, disconnected or timed-out read for one request."""
