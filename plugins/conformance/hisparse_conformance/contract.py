"""Failure messages that state the contract clause a backend broke.

`must_raise` is `pytest.raises` whose failure says what the backend is required to do instead of
only "DID NOT RAISE"; asserts in the suite carry their clause as the assertion message.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest


@contextmanager
def must_raise(exc_type: type[BaseException], requirement: str) -> Iterator[pytest.ExceptionInfo[BaseException]]:
    """Expect `exc_type`; if the block returns normally, fail with `requirement` (the clause)."""
    try:
        with pytest.raises(exc_type) as info:
            yield info
    except pytest.fail.Exception:
        pytest.fail(f"contract: {requirement} (the call returned instead of raising {exc_type.__name__})",
                    pytrace=False)
