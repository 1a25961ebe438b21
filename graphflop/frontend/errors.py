"""The front end's error type and helpers for reporting a failed trace in one line.

Writes no meta key.
"""

from __future__ import annotations

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
