"""Text shared by both levels: the title (from the report's totals), the legend, times."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from graphflop.export.graphviz import facts
from graphflop.export.graphviz.palette import (
    COLORMAP,
    GHOST_COLOUR,
    PARAM_COLOUR,
    RESIDUAL_COLOUR,
    FlopScale,
    role_colour,
)
from graphflop.export.graphviz.scene import Legend, LegendItem
from graphflop.export.report import human, human_bytes
from graphflop.report import BackwardTotals, Report


def time_text(s: float | None) -> str:
    """Seconds as ``1.23 s`` / ``4.56 ms`` / ``789 µs`` (``–`` for None)."""
    if s is None:
        return "–"
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} µs"


def legend(
    scale: FlopScale,
    what: str,
    roles: list[str],
    items: list[LegendItem],
    tick: Callable[[int], str] = human,
) -> Legend:
    """The legend: ``what`` the fill measures on ``scale`` (its stops written by ``tick``), the
    ``roles`` drawn, ``items``."""
    return Legend(
        what=what,
        colormap=COLORMAP,
        ticks=tuple((c, tick(v)) for c, v in scale.ticks()),
        roles=tuple((r, role_colour(r)) for r in roles),
        items=tuple(items),
    )


def nanoseconds_text(ns: int) -> str:
    """A time scale's stop, given in nanoseconds: ``1.5 µs``."""
    return time_text(ns * 1e-9)


def legend_items(ghost_words: list[str], residuals: bool, params: bool) -> list[LegendItem]:
    """Legend lines for the ghosts (``pruned``, ``skipped``), residual edges and parameters."""
    out = [
        LegendItem(f"dashed grey: {w} work (not emitted) with the FLOPs it saved", GHOST_COLOUR)
        for w in ghost_words
    ]
    if residuals:
        out.append(
            LegendItem(
                ": labelled with the bytes saved for backward (what forward mode does not keep)",
                RESIDUAL_COLOUR,
                lead="wine edge",
            )
        )
    if params:
        out.append(LegendItem("grey rounded: parameter / input", PARAM_COLOUR))
    return out


#: edge style → (sample stroke, colour, what it means); the sample imitates the drawn line
EDGE_MEANINGS = {
    "data": ("━━", "#555555", "data flow, width growing with the bytes carried (labelled)"),
    "residual": ("━━", RESIDUAL_COLOUR, "residual: a forward value the backward reads"),
    "param_residual": ("┈┈", PARAM_COLOUR, "parameter read by the backward"),
    "read": ("┈┈", PARAM_COLOUR, "value read by an update or tangent node"),
    "seed": ("━━", "#000000", "loss → its gradient seed ∂loss = 1"),
    "ghost_input": ("╌╌", GHOST_COLOUR, "what pruned / skipped work would have read"),
    "ghost_source": ("┈┈", GHOST_COLOUR, "pruned work → the forward node it belongs to"),
    "dropped": ("╌╌", GHOST_COLOUR, "skipped tangent → the sum it was dropped from"),
    "ghost_link": ("╌╌", GHOST_COLOUR, "module → its pruned / skipped work"),
}


def edge_items(styles: set[str], module_level: bool = False) -> list[LegendItem]:
    """Legend lines for the edge ``styles`` drawn (invisible layout edges have none)."""
    out = []
    for style, (stroke, colour, text) in EDGE_MEANINGS.items():
        if style not in styles:
            continue
        if module_level and style == "data":
            text = "forward data flow between modules, width growing with the bytes carried"
        out.append(LegendItem(f" {text}", colour, lead=stroke))
    return out


def title(analysis: Any, graph: str, level: str, module: str | None = None) -> str:
    """Two lines: model, input shapes, picture; then the totals of the phases drawn, of the
    whole model or, given ``module`` (a path such as ``h.0``), of that module's subtree."""
    r = facts.report(analysis)
    t = r.totals
    name = r.model or getattr(analysis, "name", "model")
    inputs = ", ".join("×".join(map(str, i.shape)) for i in r.inputs)
    if module is not None:
        head = f"{name}  [{inputs}]  — module {module}, {graph} graph, {level} level"
        return "\n".join([head, *wrap(_module_totals(analysis, graph, module))])
    line = [f"forward {human(t.forward.flops)} FLOPs"]
    if graph in ("backward", "train", "all") and t.backward is not None:
        line += _backward_totals(r, t.backward, graph)
    if graph in ("jvp", "all") and t.jvp is not None:
        j = t.jvp
        line.append(
            f"JVP tangent {human(j.flops)} (skipped {human(j.skipped_flops)}, "
            f"tangents on {j.tangents})"
        )
        if r.ratios.jvp_forward is not None:
            line.append(f"jvp/fwd {r.ratios.jvp_forward:.2f}")
    head = f"{name}  [{inputs}]  — {graph} graph, {level} level"
    return "\n".join([head, *wrap(line)])


#: the most characters in one line of the title: at the title's 16 pt (about 9 px a character in
#: Helvetica) a line stays under 900 px, inside a 1,200 px window beside the page's margins
TITLE_WIDTH = 96


def wrap(parts: list[str], width: int = TITLE_WIDTH) -> list[str]:
    """``parts`` joined with " · " into lines of at most ``width`` characters (a part longer
    than that alone on its line); never split inside a part."""
    lines: list[str] = []
    for p in parts:
        if lines and len(lines[-1]) + 3 + len(p) <= width:
            lines[-1] += " · " + p
        else:
            lines.append(p)
    return lines


def _backward_totals(r: Report, b: BackwardTotals, graph: str) -> list[str]:
    line = [
        f"backward {human(b.flops)} (input {human(b.grad_input_flops)}, "
        f"weight {human(b.grad_weight_flops)}, pruned {human(b.pruned_flops)})"
    ]
    u = r.totals.update
    if graph != "backward" and u is not None:
        line.append(f"update {human(u.flops)} ({u.optimizer})")
    if r.ratios.backward_forward is not None:
        line.append(f"(bwd+upd)/fwd {r.ratios.backward_forward:.2f}")
    saved = r.memory.saved_for_backward_bytes
    if saved is not None:
        line.append(f"saved for backward {human_bytes(saved)}")
    return line


def _module_totals(analysis: Any, graph: str, module: str) -> list[str]:
    """The title's totals for ``module``'s subtree: the sums of its layer rows, the gradient
    accumulations split as the boxes split them (:func:`.facts.weight_accum_flops`)."""
    rows = [
        row
        for path, row in facts.layer_rows(analysis).items()
        if path == module or path.startswith(module + ".")
    ]
    inside = {row.name for row in rows}
    fwd = sum(row.forward_flops for row in rows)
    kind = facts.module_types(analysis.forward).get(module)
    line = [f"{module}{f' ({kind})' if kind else ''}: forward {human(fwd)} FLOPs"]
    backward = graph in ("backward", "train", "all") and analysis.backward is not None
    update = 0
    if backward:
        w_acc = sum(v for m, v in facts.weight_accum_flops(analysis).items() if m in inside)
        g_in = sum(facts.grad_input_flops(row) for row in rows) - w_acc
        g_w = sum(row.grad_weight_flops for row in rows) + w_acc
        pruned = sum(row.pruned_flops for row in rows)
        line.append(
            f"backward {human(sum(row.backward_flops for row in rows))} (input {human(g_in)}, "
            f"weight {human(g_w)}, pruned {human(pruned)})"
        )
        if graph != "backward":
            update = sum(row.update_flops for row in rows)
            line.append(f"update {human(update)}")
        if fwd:
            num = sum(row.backward_flops for row in rows) + update
            line.append(f"{'(bwd+upd)' if graph != 'backward' else 'bwd'}/fwd {num / fwd:.2f}")
        saved = sum(v for m, v in facts.saved_bytes(analysis).items() if m in inside)
        line.append(f"saved for backward {human_bytes(saved)}")
    if graph in ("jvp", "all") and analysis.jvp is not None:
        jvp = sum(row.jvp_flops for row in rows)
        skipped = sum(row.jvp_skipped_flops for row in rows)
        line.append(f"JVP tangent {human(jvp)} (skipped {human(skipped)})")
        if fwd:
            line.append(f"jvp/fwd {jvp / fwd:.2f}")
    return line
