"""Running ``dot`` and writing the picture: the first layout ``dot`` accepts, written atomically
(a train or all picture mirrored, where needed, to keep the backward left of the forward)."""

from __future__ import annotations

import re
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
        timeout_s = DOT_TIMEOUT_S if last else DOT_FIRST_TRY_S
        if LEFT_PHASE in src and RIGHT_PHASE in src:
            proc = _run_sided(src, fmt, timeout_s, last)
        else:
            proc = run_dot(src, fmt, timeout_s, last)
        if proc is not None and proc.returncode == 0 and proc.stdout:
            return src, proc.stdout
    err = proc.stderr.decode(errors="replace").strip().splitlines() if proc else []
    msg = next((e for e in err if "rror" in e), err[0] if err else "no output")
    raise RenderError(f"dot failed: {msg.strip()}")


def run_dot(
    src: str, fmt: str, timeout_s: float, last: bool, laid_out: bool = False
) -> subprocess.CompletedProcess | None:
    """Run ``dot -T<fmt>`` on ``src`` (``laid_out``: ``neato -n2``, drawing the positions
    ``src`` holds); None when it timed out and ``last`` is false (another layout to try).

    Raises:
        RenderError: ``dot`` missing, or timing out on the ``last`` layout.
    """
    engine = ["neato", "-n2"] if laid_out else ["dot"]
    cmd = [*engine, f"-T{fmt}"] + (["-Gdpi=96"] if fmt == "png" else [])
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


#: the phase clusters of an op-level train or all picture: the backward is drawn on the left of
#: the forward for every model (and the tangents, beside the forward, on its right)
LEFT_PHASE, RIGHT_PHASE = "cluster_phase_backward", "cluster_phase_forward"
_BB = re.compile(r'\bbb="([-\d.e+]+),([-\d.e+]+),([-\d.e+]+),([-\d.e+]+)"')
_POSITION = re.compile(r'\b(pos|lp|xlp|head_lp|tail_lp|bb)="([^"]*)"')


def _run_sided(
    src: str, fmt: str, timeout_s: float, last: bool
) -> subprocess.CompletedProcess | None:
    """Lay ``src`` out (``dot -Tdot``), mirror the layout left to right when ``dot`` put the
    backward on the right of the forward (which of the two mirror images ``dot`` picks depends
    on the model), then draw it (``neato -n2``, which keeps the positions)."""
    proc = run_dot(src, "dot", timeout_s, last)
    if proc is None or proc.returncode != 0 or not proc.stdout:
        return proc
    laid = proc.stdout.decode().replace("\\\n", "")  # dot continues long lines with "\"
    boxes = {}
    for name in (LEFT_PHASE, RIGHT_PHASE):
        at = laid.find(f"subgraph {name} ")
        m = _BB.search(laid, at) if at >= 0 else None
        if m is not None:
            boxes[name] = float(m[1])
    if len(boxes) == 2 and boxes[LEFT_PHASE] > boxes[RIGHT_PHASE]:
        laid = mirror(laid)
    return run_dot(laid, fmt, timeout_s, last, laid_out=True)


def mirror(laid: str) -> str:
    """The laid-out DOT source ``laid`` (``dot -Tdot``) mirrored left to right: every x of a
    node, edge point, label and bounding box becomes width − x; a graph's or cluster's label
    keeps its place from its box's left edge (labels are left-justified)."""
    m = _BB.search(laid)
    if m is None:
        return laid
    width = float(m[3])
    last_bb: tuple[float, float] | None = None  # a cluster's box (old, new left x), until a pos

    def flip(x: str) -> str:
        return f"{width - float(x):.2f}"

    def one(m: re.Match) -> str:
        nonlocal last_bb
        key, val = m[1], m[2]
        if key == "bb":
            x1, y1, x2, y2 = val.split(",")
            last_bb = (float(x1), width - float(x2))
            return f'bb="{flip(x2)},{y1},{flip(x1)},{y2}"'
        if key == "lp" and last_bb is not None:  # the label of the graph or cluster just boxed
            x, y = val.split(",")
            return f'lp="{last_bb[1] + float(x) - last_bb[0]:.2f},{y}"'
        last_bb = None
        points = []
        for p in val.split():
            parts = p.split(",")
            if parts[0] in ("e", "s"):
                points.append(f"{parts[0]},{flip(parts[1])},{parts[2]}")
            else:
                points.append(f"{flip(parts[0])},{','.join(parts[1:])}")
        return f'{key}="{" ".join(points)}"'

    return _POSITION.sub(one, laid)
