"""The front end's error type and helpers for reporting a failed trace in one line.

Writes no meta key.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any


class TraceError(RuntimeError):
    """The model could not be traced; the message says why."""


def first_line(e: BaseException) -> str:
    """The first line of ``e``'s message (its type's name when the message is empty)."""
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def find_cause(e: BaseException | None, kind: type) -> Any:
    """``e`` or the first exception of ``kind`` in its cause/context chain, else ``None``."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, kind):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


@contextlib.contextmanager
def quiet_loggers(*names: str) -> Iterator[None]:
    """The loggers ``names`` raised to CRITICAL for the block (levels restored after): PyTorch
    logs tracebacks or advice before raising errors that graphflop reports in one line."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
