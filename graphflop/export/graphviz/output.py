"""Running ``dot`` and writing the picture: the first layout ``dot`` accepts, written atomically."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

from graphflop.export.graphviz.errors import NO_DOT, RenderError
from graphflop.export.graphviz.page import page
from graphflop.io import atomic_write

#: render timeouts for ``dot``, seconds: each layout but the last (then the next is tried), the last
DOT_FIRST_TRY_S = 20
DOT_TIMEOUT_S = 90


def write(variants: Sequence[Callable[[], str]], path: Path, fmt: str) -> str:
    """Render the first of ``variants`` (callables returning DOT sources) that ``dot`` accepts
    to ``fmt`` (``"dot"``: the first source itself; ``"html"``: the SVG in a page with a search
    box, :func:`.page.page`) and write it to ``path`` atomically; return its source.

    Raises:
        RenderError: ``dot`` missing, failing or timing out on the last variant; ``path``
            cannot be written (nothing is left behind).
    """
    src = variants[0]()
    if fmt == "dot":
        data = src.encode()
    elif fmt == "html":
        src, svg = _render(variants, src, "svg")
        data = page(svg, path.stem)
    else:
        src, data = _render(variants, src, fmt)
    try:
        atomic_write(path, data)
    except OSError as e:
        raise RenderError(f"cannot write {path}: {e.strerror or e}") from None
    return src


def _render(variants: Sequence[Callable[[], str]], src: str, fmt: str) -> tuple[str, bytes]:
    if shutil.which("dot") is None:
        raise RenderError(NO_DOT)
    for i, make in enumerate(variants):
        src = src if i == 0 else make()
        last = i == len(variants) - 1
        proc = run_dot(src, fmt, DOT_TIMEOUT_S if last else DOT_FIRST_TRY_S, last)
        if proc is not None and proc.returncode == 0 and proc.stdout:
            return src, proc.stdout
    err = proc.stderr.decode(errors="replace").strip().splitlines() if proc else []
    msg = next((e for e in err if "rror" in e), err[0] if err else "no output")
    raise RenderError(f"dot failed: {msg.strip()}")


def run_dot(src: str, fmt: str, timeout_s: float, last: bool) -> subprocess.CompletedProcess | None:
    """Run ``dot -T<fmt>`` on ``src``; None when it timed out and ``last`` is false (another
    layout to try).

    Raises:
        RenderError: ``dot`` missing, or timing out on the ``last`` layout.
    """
    cmd = ["dot", f"-T{fmt}"] + (["-Gdpi=96"] if fmt == "png" else [])
    try:
        return subprocess.run(
            cmd, input=src.encode(), capture_output=True, timeout=timeout_s, check=False
        )
    except FileNotFoundError:
        raise RenderError(NO_DOT) from None
    except subprocess.TimeoutExpired:
        if last:
            raise RenderError(f"dot took more than {timeout_s:g} s: try the module level") from None
        return None
