"""What to draw: a small, Graphviz-free model of a picture.

A :class:`Scene` is boxes, edges, nested module clusters (one tree per phase column), a title and
a legend. The builders (:mod:`.op_level`, :mod:`.module_level`) fill a :class:`Canvas` from an
analysis and freeze it into a Scene; :mod:`.draw` turns a Scene into Graphviz. Labels are
structured (:class:`Card`, :class:`StatCard`, :class:`GhostCard`, :class:`Legend`, or plain text
with newlines); markup and escaping happen only in :mod:`.draw`.

Box kinds (:attr:`Box.kind`):
    ``op`` one graph node (a :class:`Card`); ``module`` one module path (a :class:`StatCard`);
    ``value`` a small parameter / input / state / residual node; ``input`` a model input at
    module level; ``ghost`` work not emitted (a :class:`GhostCard`); ``ghost_note`` a module's
    ghost work at module level; ``zero`` a tangent that is zero.

Edge styles (:attr:`Edge.style`):
    ``data`` a value flowing; ``residual`` / ``param_residual`` a forward value / parameter read
    by the backward; ``read`` a forward value read by an update or tangent node; ``seed`` loss →
    its cotangent seed; ``ghost_input`` / ``ghost_source`` / ``dropped`` / ``ghost_link`` edges
    of ghosts; ``align`` / ``order`` invisible layout hints.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

BOX_KINDS = ("op", "module", "value", "input", "ghost", "ghost_note", "zero")
EDGE_STYLES = (
    "data",
    "residual",
    "param_residual",
    "read",
    "seed",
    "ghost_input",
    "ghost_source",
    "dropped",
    "ghost_link",
    "align",
    "order",
)


@dataclass(frozen=True)
class Card:
    """An op box: a header strip in the ``accent`` (role) colour, then small lines on ``fill``."""

    title: str
    note: str  # plain text after the bold title ("" or " · <module path>")
    accent: str
    fill: str
    lines: tuple[str, ...]


@dataclass(frozen=True)
class Stat:
    """One key/value cell of a :class:`StatCard`, with an optional colour swatch."""

    swatch: str | None
    key: str
    value: str


@dataclass(frozen=True)
class StatCard:
    """A module box: a bold title (and class name) on ``fill``, then stats two per row."""

    title: str
    kind: str  # module class name, or ""
    fill: str
    stats: tuple[Stat, ...]


@dataclass(frozen=True)
class GhostCard:
    """A ghost's label: headline (bold), detail, note (italic), all in the ghost colour."""

    headline: str
    detail: str
    note: str


@dataclass(frozen=True)
class LegendItem:
    """One legend line: ``lead`` (bold) then ``text``, in ``colour`` (None: the default)."""

    text: str
    colour: str | None = None
    lead: str = ""


@dataclass(frozen=True)
class Legend:
    """The legend: what the fill measures, the fill scale's stops, role colours, other items."""

    what: str
    colormap: str
    ticks: tuple[tuple[str, str], ...]  # (colour, value shown)
    roles: tuple[tuple[str, str], ...]  # (role, colour)
    items: tuple[LegendItem, ...]


@dataclass(frozen=True)
class FoldRow:
    """One row of a :class:`Fold`'s table: a figure per block and for all blocks together."""

    swatch: str | None
    key: str
    per_block: int
    total: int
    unit: str = "FLOPs"  # or "B" (bytes)


@dataclass(frozen=True)
class Fold:
    """Repeated identical modules drawn once: ``members`` (module paths, in call order; the
    first is drawn), their class ``kind``, per-block and total figures, ratios (text)."""

    members: tuple[str, ...]
    kind: str
    rows: tuple[FoldRow, ...]
    ratios: tuple[tuple[str, str], ...] = ()
    #: the figures column: one block's; "per block" when the members' figures are equal, else
    #: the first member's (members differ in saved bytes only: FLOPs split folds)
    per_block: str = "per block"

    @property
    def count(self) -> int:
        return len(self.members)

    @property
    def mark(self) -> str:
        """The fold's mark, "× 12"."""
        return fold_mark(self.count)

    @property
    def total_column(self) -> str:
        """The header of the column of the members' sums: "× 12 = total" when every member has
        the per-block figures, else "all 12 = total"."""
        return (
            f"{self.mark} = total" if self.per_block == "per block" else f"all {self.count} = total"
        )

    def row(self, key: str) -> FoldRow:
        """The row named ``key`` (``fwd``, ``bwd∂x``, ...); KeyError when absent."""
        for r in self.rows:
            if r.key == key:
                return r
        raise KeyError(key)


Label = str | Card | StatCard | GhostCard


@dataclass(frozen=True)
class Box:
    """One node of the picture. ``module`` is its cluster (module path), ``phase`` its column."""

    id: str
    kind: str  # one of BOX_KINDS
    label: Label
    module: str = ""
    phase: str = ""
    colour: str | None = None  # outline (value boxes)
    shape: str = "box"  # value boxes: box or ellipse
    bold: bool = False  # value boxes: a bold outline
    role: str | None = None  # op and ghost boxes: the role (also an SVG class)
    tooltip: str | None = None


@dataclass(frozen=True)
class Edge:
    """One edge. ``reverse``: drawn against the data flow (arrow at the tail); ``loose``: the
    head ranks level with or below the tail, with no pull; ``free``: no effect on ranking."""

    src: str
    dst: str
    style: str = "data"  # one of EDGE_STYLES
    label: str | None = None
    colour: str | None = None
    width: float | None = None
    tooltip: str | None = None
    reverse: bool = False
    loose: bool = False
    free: bool = False
    bytes: int = field(default=0, compare=False)  # the bytes it carries (not drawn by itself)


@dataclass(frozen=True)
class Cluster:
    """A module path's cluster: its own boxes, then its child clusters (``path`` "" is the
    top level of a phase, not a cluster). ``row``: its own boxes side by side in one rank."""

    path: str
    label: str
    boxes: tuple[Box, ...]
    children: tuple[Cluster, ...]
    row: bool = False
    fold: Fold | None = None  # repeated modules drawn once: the label is their table


@dataclass(frozen=True)
class Phase:
    """A column of the picture (``name`` "": no column, the boxes sit at the top level)."""

    name: str
    label: str
    top: Cluster


@dataclass(frozen=True)
class Scene:
    """A whole picture. Without ``clustered``, ``phases`` is empty and ``boxes`` are drawn flat."""

    title: str
    legend: Legend | None
    boxes: tuple[Box, ...]  # every box, in drawing order
    edges: tuple[Edge, ...]  # in drawing order, no duplicates or self-loops
    phases: tuple[Phase, ...]
    clustered: bool

    def clusters(self) -> list[Cluster]:
        """Every module cluster, depth first (the phases' top levels left out)."""
        out: list[Cluster] = []

        def walk(c: Cluster) -> None:
            out.append(c)
            for k in c.children:
                walk(k)

        for ph in self.phases:
            for c in ph.top.children:
                walk(c)
        return out

    def folds(self) -> list[Fold]:
        """The folds (repeated modules drawn once), in drawing order."""
        return [c.fold for c in self.clusters() if c.fold is not None]


class Canvas:
    """Boxes collected per (phase, module path) and edges; frozen into a :class:`Scene`."""

    def __init__(self) -> None:
        self.groups: dict[tuple[str, str], list[Box]] = defaultdict(list)
        self.edges: list[Edge] = []
        self.cluster_label: dict[str, str] = {}
        self.phase_label: dict[str, str] = {}
        self.rows: set[str] = set()  # module paths whose own boxes go in one rank
        self.folds: dict[str, Fold] = {}  # module path → the repeats it stands for

    def add(self, box: Box) -> str:
        """Add ``box``; return its id."""
        self.groups[(box.phase, box.module)].append(box)
        return box.id

    def edge(self, edge: Edge) -> None:
        self.edges.append(edge)

    def paths(self) -> list[str]:
        """Module paths holding boxes, in order of their first box (one per phase)."""
        return [path for _, path in self.groups]

    def scene(self, title: str, legend: Legend | None, clustered: bool = True) -> Scene:
        """The frozen picture: clusters nested along module paths, children in order of their
        first box, duplicate edges and self-loops dropped."""
        boxes = tuple(b for own in self.groups.values() for b in own)
        phases: tuple[Phase, ...] = ()
        if clustered:
            names = list(dict.fromkeys(ph for ph, _ in self.groups))
            phases = tuple(Phase(ph, self.phase_label.get(ph, ph), self._tree(ph)) for ph in names)
        edges = tuple(e for e in dict.fromkeys(self.edges) if e.src != e.dst)
        return Scene(title, legend, boxes, edges, phases, clustered)

    def _tree(self, phase: str) -> Cluster:
        children: dict[str, set[str]] = defaultdict(set)
        first: dict[str, int] = {}
        for k, (ph, p) in enumerate(self.groups):
            if ph != phase or p == "":
                continue
            parts = p.split(".")
            for i in range(1, len(parts) + 1):
                children[".".join(parts[: i - 1])].add(".".join(parts[:i]))
                first.setdefault(".".join(parts[:i]), k)

        def cluster(path: str) -> Cluster:
            own = tuple(self.groups.get((phase, path), ()))
            kids = sorted(children.get(path, ()), key=lambda c: (first.get(c, 0), c))
            return Cluster(
                path,
                self.cluster_label.get(path, path),
                own,
                tuple(cluster(c) for c in kids),
                row=path in self.rows and len(own) > 1,
                fold=self.folds.get(path),
            )

        return cluster("")


def fold_mark(count: int) -> str:
    """How a fold of ``count`` identical modules is marked everywhere: "× 12"."""
    return f"× {count}"


#: the legend line explaining a fold's header (module level): its mark and its two columns
FOLD_LEGEND = (
    ": N identical blocks drawn once, boxes inside: one block; table: per block, × N = total"
)
