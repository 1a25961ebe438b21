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
#: op nodes from which the first layout gets the whole ``DOT_TIMEOUT_S`` and a timeout ends the
#: render: measured with dot 2.43 on GPT-2's train graph at op level, the first layout took 1.7 s
#: at 1,143 call nodes where the last (no clusters) took 40.6 s, and 74 s at 3,215, so on a
#: large graph the fallbacks only add their timeouts to a failure
LARGE_OP_NODES = 1_500
#: op nodes above which no layout is tried at all: the first layout of GPT-2's train graph at
#: 6,323 call nodes ran past 300 s (dot grows about quadratically: 74 s at 3,215)
MAX_DOT_OP_NODES = 5_000


def write(
    variants: Sequence[Callable[[], str]], path: Path, fmt: str, op_nodes: int | None = None
) -> str:
    """Render the first of ``variants`` (callables returning DOT sources) that ``dot`` accepts
    to ``fmt`` (``"dot"``: the first source itself; ``"html"``: the SVG in a page with a search
    box, :func:`.page.page`) and write it to ``path`` atomically; return its source.

    ``op_nodes``: the number of op nodes drawn (op level), or None. From
    :data:`LARGE_OP_NODES` on, the first layout gets the whole :data:`DOT_TIMEOUT_S` and a
    timeout ends the render; above :data:`MAX_DOT_OP_NODES` no layout is tried (a ``.dot``
    source is still written).

    Raises:
        RenderError: ``dot`` missing, failing or timing out on the last variant (on any, for a
            large graph); more than :data:`MAX_DOT_OP_NODES` op nodes to lay out; ``path``
            cannot be written (nothing is left behind).
    """
    if fmt != "dot" and op_nodes is not None and op_nodes > MAX_DOT_OP_NODES:
        raise RenderError(
            f"{op_nodes:,} op nodes are more than dot can lay out in {DOT_TIMEOUT_S} s (at most "
            f"{MAX_DOT_OP_NODES:,}): draw the module level (--level module), one module's ops "
            "(--module PATH) or a .dot file"
        )
    large = op_nodes is not None and op_nodes >= LARGE_OP_NODES
    src = variants[0]()
    if fmt == "dot":
        data = src.encode()
    elif fmt == "html":
        src, svg = _render(variants, src, "svg", large)
        data = page(svg, path.stem)
    else:
        src, data = _render(variants, src, fmt, large)
    try:
        atomic_write(path, data)
    except OSError as e:
        raise RenderError(f"cannot write {path}: {e.strerror or e}") from None
    return src


def _render(
    variants: Sequence[Callable[[], str]], src: str, fmt: str, large: bool = False
) -> tuple[str, bytes]:
    if shutil.which("dot") is None:
        raise RenderError(NO_DOT)
    for i, make in enumerate(variants):
        src = src if i == 0 else make()
        last = large or i == len(variants) - 1  # a timeout ends it
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
