"""The render's one error type and its "no ``dot``" message."""

from __future__ import annotations

NO_DOT = (
    "Graphviz's `dot` program is not installed: apt-get install graphviz (Debian/Ubuntu) or "
    "brew install graphviz (macOS); .dot output works without it"
)


class RenderError(ValueError):
    """A bad ``graph``/``level``/suffix, a missing ``dot`` program, or a failed render."""
