"""Log records held while something is tried: logged as usual if it succeeds, dropped if it fails,
where the caller's one error line then says what they would (a backend that cannot be selected:
discovery's or the registry's WARNING above the line naming the same reason)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager


class _Held(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def held_unless_it_fails(name: str) -> Iterator[None]:
    """Hold what logger `name` and its children log while the block runs: logged, in order, once the
    block returns; dropped if it raises."""
    logger = logging.getLogger(name)
    held, propagate = _Held(), logger.propagate
    logger.addHandler(held)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(held)
        logger.propagate = propagate
    for record in held.records:
        logging.getLogger(record.name).handle(record)
