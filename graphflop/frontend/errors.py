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


#: model libraries whose info and warning logs a model's build or trace would print on stderr
#: (transformers' configuration checks: ``[transformers] Model config: ...``); graphflop's
#: errors and warnings say what matters in one line each, and the model's Python warnings are
#: ``warnings`` (re-emitted once each by the trace), not logs
LIBRARY_LOGGERS = ("transformers",)


def library_logs_quiet() -> contextlib.AbstractContextManager:
    """:data:`LIBRARY_LOGGERS` at ERROR for the block (as ``transformers.logging.
    set_verbosity_error``), their levels restored after."""
    return quiet_loggers(*LIBRARY_LOGGERS, level=logging.ERROR)


@contextlib.contextmanager
def quiet_loggers(*names: str, level: int = logging.CRITICAL) -> Iterator[None]:
    """The loggers ``names`` raised to ``level`` (kept where already higher) for the block
    (levels restored after): PyTorch logs tracebacks or advice before raising errors that
    graphflop reports in one line. A library that sets its logger's level when first imported
    (transformers) must be imported before the block."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(max(level, lg.getEffectiveLevel()))
    try:
        yield
    finally:
        for lg, was in zip(loggers, levels):
            lg.setLevel(was)
