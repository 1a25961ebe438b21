"""How to draw: a :class:`~.scene.Scene` as a ``graphviz.Digraph``.

The only module that imports the ``graphviz`` library, and the only one that writes markup:
HTML-like labels are generated here from the scene's structured labels, and every piece of text
in them goes through :func:`esc`. Plain-text labels are quoted by the library.
"""

from __future__ import annotations

import html
from typing import Any

import graphviz

from graphflop.export.graphviz.palette import GHOST_COLOUR, PARAM_COLOUR, RESIDUAL_COLOUR, WHITE
from graphflop.export.graphviz.scene import (
    Box,
    Card,
    Cluster,
    Edge,
    Fold,
    GhostCard,
    Legend,
    Scene,
    StatCard,
)
from graphflop.export.report import human, human_bytes
from graphflop.io import sanitize_name

FONT = "Helvetica,Arial,sans-serif"
CLUSTER_FILL = "#F4F4F4"
#: the fill of a cluster standing for repeated modules
FOLD_FILL = "#E8EEF6"
#: attributes of a "loose" edge (between the forward and the backward/update/tangent nodes): its
#: head ranks level with or below its tail, with no pull. (``constraint=false`` would say "no
#: ranking at all", but Graphviz 2.43 fails on it inside clusters: "trouble in init_rank".)
LOOSE = {"minlen": "0", "weight": "0"}

#: box kind → its Graphviz attributes besides label, id and tooltip
_BOX = {
    "op": {"shape": "plain"},
    "module": {"shape": "plain"},
    "value": {
        "fillcolor": WHITE,
        "fontcolor": "#333333",
        "fontsize": "8",
        "margin": "0.04,0.02",
        "height": "0.2",
    },
    "input": {
        "shape": "ellipse",
        "style": "filled",
        "fillcolor": WHITE,
        "color": PARAM_COLOUR,
        "fontsize": "9",
    },
    "ghost": {
        "shape": "box",
        "style": "dashed,rounded,filled",
        "fillcolor": WHITE,
        "penwidth": "1.6",
        "fontsize": "11",
        "color": GHOST_COLOUR,
        "fontcolor": GHOST_COLOUR,
        "margin": "0.08,0.04",
    },
    "ghost_note": {
        "shape": "box",
        "style": "dashed,rounded",
        "color": GHOST_COLOUR,
        "fontcolor": GHOST_COLOUR,
        "fontsize": "9",
    },
    "zero": {
        "shape": "box",
        "style": "dashed,rounded",
        "color": GHOST_COLOUR,
        "fontcolor": GHOST_COLOUR,
        "fontsize": "8",
        "margin": "0.04,0.02",
    },
}

#: edge style → its Graphviz attributes
_EDGE = {
    "data": {},
    "residual": {"color": RESIDUAL_COLOUR, "fontcolor": RESIDUAL_COLOUR, "class": "residual"},
    "param_residual": {
        "color": PARAM_COLOUR,
        "penwidth": "0.6",
        "style": "dotted",
        "arrowhead": "none",
    },
    "read": {"color": PARAM_COLOUR, "style": "dotted", "penwidth": "0.6"},
    "seed": {"penwidth": "1.5"},
    "ghost_input": {"style": "dashed", "color": GHOST_COLOUR},
    "ghost_source": {"style": "dotted", "color": GHOST_COLOUR, "arrowhead": "none"},
    "dropped": {"style": "dashed", "color": GHOST_COLOUR, "fontcolor": GHOST_COLOUR},
    "ghost_link": {"style": "dashed", "color": GHOST_COLOUR, "arrowhead": "none"},
    "align": {"style": "invis", "minlen": "0", "weight": "4", "arrowhead": "none"},
    "order": {"style": "invis", "weight": "50"},
}


def to_digraph(scene: Scene, newrank: bool = False) -> graphviz.Digraph:
    """``scene`` as a Graphviz digraph; ``newrank``: use Graphviz's newer ranker (it honours
    ``minlen=0`` edges across clusters)."""
    g = graphviz.Digraph(
        "graphflop",
        graph_attr={
            "rankdir": "TB",
            "label": scene.title,
            "labelloc": "t",
            "labeljust": "l",
            "fontname": FONT,
            "fontsize": "16",
            "nodesep": "0.18",
            "ranksep": "0.28",
            "bgcolor": "white",
            "outputorder": "edgesfirst",
        },
        node_attr={"fontname": FONT, "fontsize": "10", "shape": "plain"},
        edge_attr={"fontname": FONT, "fontsize": "8", "arrowsize": "0.6", "color": "#555555"},
    )
    if newrank:  # Graphviz 2.43 reads any value, even "false", as on: set it only when on
        g.attr(newrank="true")
    if scene.legend is not None:
        g.node("legend", label=legend_html(scene.legend), id="legend", shape="plain")
    if not scene.clustered:
        for box in scene.boxes:
            g.node(box.id, **box_attrs(box))
    for phase in scene.phases:
        if phase.name == "":
            _emit(g, phase.name, phase.top)
            continue
        with g.subgraph(name=f"cluster_phase_{phase.name}") as pc:
            pc.attr(
                label=phase.label,
                style="dashed",
                color="#777777",
                fontname=FONT,
                fontsize="14",
                labeljust="l",
                margin="10",
            )
            _emit(pc, phase.name, phase.top)
    for e in scene.edges:
        g.edge(e.src, e.dst, **edge_attrs(e))
    return g


def _emit(g: graphviz.Digraph, phase: str, cl: Cluster) -> None:
    if cl.row:
        with g.subgraph() as s:
            s.attr(rank="same")
            for box in cl.boxes:
                s.node(box.id, **box_attrs(box))
    else:
        for box in cl.boxes:
            g.node(box.id, **box_attrs(box))
    for child in cl.children:
        path = sanitize_name(child.path)
        name = f"cluster_{sanitize_name(phase)}_{path}" if phase else f"cluster_{path}"
        with g.subgraph(name=name) as c:
            c.attr(
                label=child.label,
                style="rounded,filled",
                fillcolor=CLUSTER_FILL,
                color="#B0B0B0",
                fontname=FONT,
                fontsize="11",
                labeljust="l",
                margin="6",
                # a cluster's attributes pass to the clusters inside it: reset the fold's
                id=name,
                penwidth="1",
                tooltip=child.label,
            )
            if child.fold is not None:
                c.attr(
                    label=fold_html(child.fold),
                    fillcolor=FOLD_FILL,
                    color="#333333",
                    penwidth="2.5",
                    id=f"fold_{path}",
                    tooltip=fold_tooltip(child.fold),
                )
            _emit(c, phase, child)


def box_attrs(box: Box) -> dict[str, str]:
    """Graphviz attributes of ``box`` (its label as HTML where it is structured)."""
    attrs: dict[str, str] = {"label": label_text(box.label), "id": box.id, **_BOX[box.kind]}
    if box.kind == "value":
        attrs["shape"] = box.shape
        attrs["style"] = "filled" if box.shape == "ellipse" else "rounded,filled"
        attrs["style"] += ",bold" if box.bold else ""
        attrs["color"] = box.colour or PARAM_COLOUR
    if box.kind == "op":
        attrs["class"] = f"role-{box.role}"
    elif box.kind in ("ghost", "ghost_note"):
        attrs["class"] = f"ghost role-{box.role}"
    if box.tooltip is not None:
        attrs["tooltip"] = box.tooltip
    return attrs


def edge_attrs(e: Edge) -> dict[str, str]:
    """Graphviz attributes of edge ``e``."""
    attrs = dict(_EDGE[e.style])
    if e.colour:
        attrs["color"] = e.colour
    if e.width is not None:
        attrs["penwidth"] = f"{e.width:.2f}"
    if e.label is not None:
        attrs["label"] = e.label
    if e.tooltip is not None:
        attrs["tooltip"] = e.tooltip
    if e.reverse:
        attrs["dir"] = "back"
    if e.loose:
        attrs.update(LOOSE)
    if e.free:
        attrs["constraint"] = "false"

    return attrs


# -- labels ------------------------------------------------------------------------------------


def esc(s: Any) -> str:
    """``s`` as text inside an HTML-like label (the one escaping of label text)."""
    return html.escape(str(s), quote=True)


def _luminance(hex_colour: str) -> float:
    r, g, b = (int(hex_colour[i : i + 2], 16) / 255 for i in (1, 3, 5))
    lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in (r, g, b)]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]


def text_on(hex_colour: str) -> str:
    """White or black, whichever reads on ``hex_colour`` (relative luminance below 0.2: white)."""
    return "#FFFFFF" if _luminance(hex_colour) < 0.2 else "#000000"


def label_text(label: Any) -> str:
    """A box label for Graphviz: plain text as is, structured labels as HTML-like markup."""
    if isinstance(label, Card):
        return card_html(label)
    if isinstance(label, StatCard):
        return stat_card_html(label)
    if isinstance(label, GhostCard):
        return ghost_html(label)
    return label


def _table(rows: list[str], border: int, spacing: int, padding: int, colour: str, bg: str) -> str:
    return (
        f'<<TABLE BORDER="{border}" CELLBORDER="0" CELLSPACING="{spacing}" '
        f'CELLPADDING="{padding}" COLOR="{colour}" BGCOLOR="{bg}">{"".join(rows)}</TABLE>>'
    )


def card_html(c: Card) -> str:
    """An op box: the header strip in the accent colour, then each line at 9 pt."""
    fc = text_on(c.fill)
    rows = [
        f'<TR><TD BGCOLOR="{c.accent}"><FONT COLOR="{text_on(c.accent)}"><B>{esc(c.title)}'
        f"</B>{esc(c.note)}</FONT></TD></TR>"
    ]
    rows += [
        f'<TR><TD><FONT COLOR="{fc}" POINT-SIZE="9">{esc(t)}</FONT></TD></TR>' for t in c.lines
    ]
    return _table(rows, 2, 0, 2, c.accent, c.fill)


def stat_card_html(c: StatCard) -> str:
    """A module box: the title row on the fill colour, then two stats per row."""
    fc = text_on(c.fill)
    kind = f' <FONT POINT-SIZE="8">{esc(c.kind)}</FONT>' if c.kind else ""
    head = f"<B>{esc(c.title)}</B>{kind}"
    rows = [f'<TR><TD COLSPAN="6" BGCOLOR="{c.fill}"><FONT COLOR="{fc}">{head}</FONT></TD></TR>']
    for i in range(0, len(c.stats), 2):
        tds = []
        for st in c.stats[i : i + 2]:
            swatch = (
                f'<TD BGCOLOR="{st.swatch}" WIDTH="4" FIXEDSIZE="FALSE"></TD>'
                if st.swatch
                else '<TD WIDTH="4"></TD>'
            )
            tds.append(
                f'{swatch}<TD ALIGN="LEFT"><FONT POINT-SIZE="8">{esc(st.key)}</FONT></TD>'
                f'<TD ALIGN="RIGHT">{esc(st.value)}</TD>'
            )
        if len(tds) == 1:
            tds.append('<TD COLSPAN="3"></TD>')
        rows.append(f"<TR>{''.join(tds)}</TR>")
    return _table(rows, 1, 0, 1, "#444444", WHITE)


def _count(v: int, unit: str) -> str:
    return human_bytes(v) if unit == "B" else human(v)


def fold_tooltip(f: Fold) -> str:
    """A fold cluster's tooltip, which the HTML page's search reads (the members after the
    last ": ", comma-separated; the first is the block drawn)."""
    return (
        f"{f.mark}: {f.count} identical blocks drawn once as {f.members[0]}, figures per block "
        f"and {f.mark} = total: " + ", ".join(f.members)
    )


def fold_html(f: Fold) -> str:
    """A fold's cluster label: "× N", the members and class, then the figures per block and
    "× N = total"."""
    first, last = f.members[0], f.members[-1]
    kind = f" {esc(f.kind)}" if f.kind else ""
    rows = [
        f'<TR><TD COLSPAN="4" ALIGN="LEFT"><FONT POINT-SIZE="20"><B>{esc(f.mark)}</B></FONT>'
        f"  <B>{esc(first)} … {esc(last)}</B>{kind}</TD></TR>",
        f'<TR><TD></TD><TD></TD><TD ALIGN="RIGHT"><I>{esc(f.per_block)}</I></TD>'
        f'<TD ALIGN="RIGHT"><I>{esc(f.total_column)}</I></TD></TR>',
    ]
    for r in f.rows:
        swatch = f'<TD BGCOLOR="{r.swatch}" WIDTH="6"></TD>' if r.swatch else "<TD></TD>"
        rows.append(
            f'<TR>{swatch}<TD ALIGN="LEFT">{esc(r.key)}</TD>'
            f'<TD ALIGN="RIGHT">{esc(_count(r.per_block, r.unit))}</TD>'
            f'<TD ALIGN="RIGHT"><B>{esc(_count(r.total, r.unit))}</B></TD></TR>'
        )
    if f.ratios:
        text = " · ".join(f"{k} {v}" for k, v in f.ratios)
        rows.append(f'<TR><TD COLSPAN="4" ALIGN="LEFT">{esc(text)}</TD></TR>')
    return (
        '<<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="0" CELLPADDING="1">'
        f"{''.join(rows)}</TABLE>>"
    )


def ghost_html(c: GhostCard) -> str:
    """A ghost: bold headline, detail, italic note, in the ghost colour."""
    return (
        f'<<FONT COLOR="{GHOST_COLOUR}"><B>{esc(c.headline)}</B><BR/>{esc(c.detail)}<BR/>'
        f"<I>{esc(c.note)}</I></FONT>>"
    )


def legend_html(lg: Legend) -> str:
    """The legend: title, what the fill measures, the scale's stops, roles, other items."""
    span = max(2, len(lg.ticks))
    rows = [
        f'<TR><TD COLSPAN="{span}"><B>legend</B></TD></TR>',
        f'<TR><TD COLSPAN="{span}" ALIGN="LEFT">'
        f"fill: {esc(lg.what)} (log scale, {esc(lg.colormap)}; white: none)</TD></TR>",
    ]
    cells = "".join(
        f'<TD BGCOLOR="{c}"><FONT COLOR="{text_on(c)}" POINT-SIZE="9">{esc(v)}</FONT></TD>'
        for c, v in lg.ticks
    )
    rows.append(f"<TR>{cells}</TR>")
    for role, c in lg.roles:
        rows.append(
            f'<TR><TD COLSPAN="{span}" ALIGN="LEFT" BGCOLOR="{c}">'
            f'<FONT COLOR="{text_on(c)}">role: {esc(role)}</FONT></TD></TR>'
        )
    for item in lg.items:
        text = (f"<B>{esc(item.lead)}</B>" if item.lead else "") + esc(item.text)
        if item.colour:
            text = f'<FONT COLOR="{item.colour}">{text}</FONT>'
        rows.append(f'<TR><TD COLSPAN="{span}" ALIGN="LEFT">{text}</TD></TR>')
    return _table(rows, 1, 1, 3, "#444444", WHITE)
