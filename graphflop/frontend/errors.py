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


class MixedDtypes(TraceError):
    """A matrix-class op of the trace meets operands of two dtypes, which PyTorch's kernels
    refuse. ``found`` says which op, module and dtypes; the message adds what to do (a caller
    with other advice, verify's, composes its own from ``found``)."""

    def __init__(self, found: str, advice: str) -> None:
        super().__init__(f"{found}: {advice}")
        self.found = found


def first_line(e: BaseException, *, continued: bool = False) -> str:
    """The first line of ``e``'s message (its type's name when the message is empty).

    ``continued``: when that line only introduces the next (ends in ``:``, as
    huggingface_hub's validation errors do), the next non-blank line is appended."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    if continued and lines[0].endswith(":") and len(lines) > 1:
        return f"{lines[0]} {lines[1]}"
    return lines[0]


def exception_chain(e: BaseException | None) -> list[BaseException]:
    """``e`` and the exceptions it was raised from or while handling (``__cause__``, else
    ``__context__``), outermost first, each once."""
    chain: list[BaseException] = []
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        chain.append(e)
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return chain


def find_cause(e: BaseException | None, kind: type | tuple[type, ...]) -> Any:
    """``e`` or the first exception of ``kind`` in its cause/context chain, else ``None``."""
    return next((c for c in exception_chain(e) if isinstance(c, kind)), None)


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
