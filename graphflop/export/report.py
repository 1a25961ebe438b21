"""Tables (rich), JSON and CSV from an analysis report (:class:`~graphflop.report.Report`).

Reads the typed report only; the JSON document is :meth:`Report.to_dict` (schema version 1).
Tables count FLOPs (1 multiply-add = 2) or, with ``units="macs"``, the multiply-adds of the
matrix-class ops (``mm_flops / 2``); :func:`warning_lines` gives one line per uncounted op.
"""

from __future__ import annotations

import csv
import io
import json
from typing import Any

from rich.console import Console
from rich.table import Table

from graphflop.meta import FUNCTION_LABEL
from graphflop.report import OP_PHASES, LayerRow, LayerTime, OpRow, Report, TimeReport, Uncounted

UNITS = ("flops", "macs")


def _g3(v: float) -> str:
    """Three significant digits, never in exponent form: 1020 MiB, not '1.02e+03 MiB' (a
    value between 1,000 and 1,024 of a binary unit, or one that rounds up to 1,000)."""
    text = f"{v:.3g}"
    return f"{v:.0f}" if "e" in text else text


def human(n: float | int | None, unit: str = "") -> str:
    """1234567 → '1.23 M' (decimal prefixes)."""
    if n is None:
        return "–"
    n = float(n)
    for div, p in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{_g3(n / div)} {p}{unit}"
    return f"{n:.4g} {unit}".rstrip()


def human_bytes(n: int | None) -> str:
    """1536 → '1.5 KiB' (binary prefixes); None → '–'."""
    if n is None:
        return "–"
    x = float(n)
    for div, p in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if x >= div:
            return f"{_g3(x / div)} {p}"
    return f"{int(x)} B"


def _r(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def human_seconds(s: float | None) -> str:
    """0.00123 → '1.23 ms'; None → '–'."""
    if s is None:
        return "–"
    for div, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if abs(s) >= div:
            return f"{_g3(s / div)} {unit}"
    return f"{_g3(s * 1e9)} ns" if s else "0"


def counted(n: int, noun: str) -> str:
    """1, 'thread' → '1 thread'; 2 → '2 threads' (English plural by a trailing s)."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def print_report(
    r: Report,
    console: Console | None = None,
    max_layers: int = 60,
    *,
    by: str = "layer",
    depth: int | None = None,
    units: str = "flops",
) -> None:
    """Per-layer table (the ``max_layers`` layers with the most forward + backward FLOPs when
    there are more; rolled up to ``depth`` dotted path parts when given), or with
    ``by="op"`` one table of ops per phase, then totals, ratios and memory. ``units``:
    ``flops`` or ``macs`` (multiply-adds of matrix-class ops, ``mm_flops / 2``).

    Raises:
        ValueError: an unknown ``by`` or ``units``, or ``depth`` below 1.
    """
    if by not in ("layer", "op") or units not in UNITS:
        raise ValueError(f"bad by={by!r} or units={units!r}: by layer|op, units flops|macs")
    console = console or Console()
    if by == "op":
        for phase in OP_PHASES:
            rows = [o for o in r.ops if o.phase == phase]
            if rows:
                console.print(_op_table(r, phase, rows, units))
            if r.time is not None and any(o.phase == phase for o in r.time.ops):
                console.print(_kernel_table(r, r.time, phase))
    else:
        layers = r.layers_at_depth(depth) if depth is not None else r.layers
        console.print(_layer_table(r, layers, max_layers, units))
        hidden = _hidden_line(layers, max_layers)
        if hidden:
            console.print(f"[dim]{hidden}[/dim]")
    console.print(_totals_table(r, units))
    if r.time is not None:
        console.print(_time_table(r.time))
    for line in _summary_lines(r):
        console.print(line)


def _layer_table(r: Report, layers: tuple[LayerRow, ...], max_layers: int, units: str) -> Table:
    if units == "macs":
        return _layer_macs_table(r, layers, max_layers)
    table = Table(
        title=f"{r.model} — per layer (FLOPs: 1 multiply-add = 2)",
        show_lines=False,
        header_style="bold",
    )
    for col in ("layer", "params", "output", "fwd FLOPs", "share"):
        table.add_column(col, justify="left" if col == "layer" else "right")
    if r.has_backward:
        table.add_column("bwd in", justify="right")
        table.add_column("bwd weight", justify="right")
        table.add_column("pruned", justify="right", style="dim")
        table.add_column("update", justify="right")
        table.add_column("(bwd+upd)/fwd", justify="right", style="bold")
        table.add_column("saved", justify="right")
    if r.has_jvp:
        table.add_column("jvp", justify="right")
        table.add_column("jvp/fwd", justify="right", style="bold")
    times = _layer_times(r.time, layers) if r.time is not None else None
    if times is not None:
        table.add_column("fwd time", justify="right")
        if r.has_backward:
            table.add_column("bwd+upd time", justify="right")
        table.add_column("bound", justify="left")
    shown = _shown_layers(layers, max_layers)
    for L in layers:
        if id(L) in shown and (L.params or L.forward_flops or L.backward_flops or L.jvp_flops):
            cells = _layer_cells(r, L)
            if times is not None:
                t = times.get(L.name)
                cells.append(human_seconds(t.forward_s) if t else "")
                if r.has_backward:
                    cells.append(human_seconds(t.backward_s + t.update_s) if t else "")
                cells.append(t.bound if t else "")
            table.add_row(*cells)
    return table


def _layer_times(tr: TimeReport, layers: tuple[LayerRow, ...]) -> dict[str, LayerTime]:
    """Each shown row's predicted times: its module's, or, for a row rolled up to a shorter
    path, the sum of the modules under it (the bound of the one with the most forward
    time)."""
    by = {t.name: t for t in tr.layers}
    out: dict[str, LayerTime] = {}
    for L in layers:
        if L.name in by and not any(o.name.startswith(L.name + ".") for o in layers):
            under = [by[L.name]]
        else:
            under = [t for n, t in by.items() if n == L.name or n.startswith(L.name + ".")]
        if not under:
            continue
        top = max(under, key=lambda t: t.forward_s)
        out[L.name] = LayerTime(
            name=L.name,
            forward_s=sum(t.forward_s for t in under),
            backward_s=sum(t.backward_s for t in under),
            update_s=sum(t.update_s for t in under),
            jvp_s=sum(t.jvp_s for t in under),
            bound=top.bound,
        )
    return out


#: what the predicted-time tables' columns hold
_TIME_CAPTION = (
    "time = max(compute, memory) + overhead per kernel; compute and memory columns: the work "
    "of the kernels bound by each; overhead: launch and dispatch, and on a calibrated CPU the "
    "page faults of outputs above 32 MiB; host: nn.Module calls and the autograd engine's "
    "per-node work (a calibrated profile); overlap (a GPU): host and device work run at the "
    "same time, taken off the phase's sum; an op's row is its share of the phase (its host and "
    "overlap in proportion to its kernels' time), so the rows add up to it; incomplete: an op "
    "without a rule, timed at its tensors' bytes only (docs/time.md)"
)


#: how a kernel timed without a cost rule is marked in the tables
NO_COST_RULE = "no cost rule: bytes only"


def _kernel_table(r: Report, tr: TimeReport, phase: str) -> Table:
    """One phase's predicted time by eager kernel, most time first: each op's share of the
    phase (the rows add up to the phase's time; on a GPU its share of the overlap comes off,
    with host costs its share of them goes on, in their own columns)."""
    rows = sorted((o for o in tr.ops if o.phase == phase), key=lambda o: -o.seconds)
    total = sum(o.seconds for o in rows)
    p = tr.phase(phase)
    incomplete = p is not None and not p.complete
    table = Table(
        title=f"{r.model} — {phase} predicted time by eager kernel on {tr.device}"
        + (" (incomplete)" if incomplete else ""),
        caption=_TIME_CAPTION,
        header_style="bold",
    )
    host = any(o.host_s for o in rows)
    overlap = any(o.overlap_s for o in rows)
    shown = {"host": host, "overlap": overlap}
    cols = ("kernel", "count", "time", "compute", "memory", "overhead", "host", "overlap")
    for col in (*cols, "bound", "share"):
        if shown.get(col, True):
            table.add_column(col, justify="left" if col in ("kernel", "bound") else "right")
    for o in rows:
        table.add_row(
            o.op + (f" [yellow]({NO_COST_RULE})[/yellow]" if o.no_cost_rule else ""),
            str(o.kernels),
            human_seconds(o.seconds),
            human_seconds(o.compute_s),
            human_seconds(o.memory_s),
            human_seconds(o.overhead_s),
            *([human_seconds(o.host_s)] if host else []),
            *([human_seconds(-o.overlap_s)] if overlap else []),
            o.bound,
            f"{100 * o.seconds / total:.1f}%" if total else "–",
        )
    return table


def _time_table(tr: TimeReport) -> Table:
    """Predicted time per phase: compute, memory and overhead parts, kernels, FLOP/s."""
    what = (
        "measured rates"
        if tr.source == "calibrated"
        else "a guess: clock × FMA width × efficiency"
        if tr.device == "cpu"
        else "data sheet × efficiency"
    )
    amp = f", autocast {tr.amp}" if tr.amp else ""
    table = Table(
        title=f"predicted time on {tr.title} ({what}{amp})",
        caption=_TIME_CAPTION,
        header_style="bold",
    )
    overlap = any(p.overlap_s for _, p in tr.phases)  # an asynchronous device (a GPU)
    host = any(p.host_s for _, p in tr.phases)  # a calibrated profile's module/autograd costs
    shown = {"overlap": overlap, "host": host}
    cols = ("phase", "time", "compute", "memory", "overhead", "host", "overlap", "kernels")
    for col in (*cols, "FLOP/s"):
        if shown.get(col, True):
            table.add_column(col, justify="left" if col == "phase" else "right")
    for name, p in tr.phases:
        cells = [
            name.replace("_", " ") + ("" if p.complete else " [yellow](incomplete)[/yellow]"),
            human_seconds(p.seconds),
            human_seconds(p.compute_s),
            human_seconds(p.memory_s),
            human_seconds(p.overhead_s),
            *([human_seconds(p.host_s)] if host else []),
            *([human_seconds(-p.overlap_s)] if overlap else []),
            str(p.kernels),
            human(p.flops / p.seconds if p.seconds else None),
        ]
        table.add_row(*cells)
    return table


def time_lines(tr: TimeReport) -> list[str]:
    """The ratios in predicted time beside the same ratios in FLOPs."""
    t, f = dict(tr.ratios), dict(tr.flop_ratios)
    parts = [
        f"{k} [bold]{_r(t[k])}[/bold] (FLOPs {_r(f.get(k))})"
        for k in ("Rb", "Rf", "Rf_over_Rb", "jvp_forward")
        if t.get(k) is not None
    ]
    lines = [f"in predicted time on {tr.device}: " + ", ".join(parts)] if parts else []
    step = tr.phase("train_step")
    for what, s in tr.recompute:  # --checkpoint / --recompute: the forward it reruns
        if step is not None:
            lines.append(
                f"with --{what}: train step [bold]{human_seconds(step.seconds + s)}[/bold] "
                f"(+{human_seconds(s) if s else '0 s'} rerunning the forward in the backward)"
            )
    return lines


def _layer_macs_table(r: Report, layers: tuple[LayerRow, ...], max_layers: int) -> Table:
    """The per-layer table in MACs: multiply-adds of the matrix-class ops (``mm_flops / 2``)."""
    table = Table(
        title=f"{r.model} — per layer (MACs: multiply-adds of matrix-class ops)",
        header_style="bold",
    )
    cols = ["layer", "params", "output", "fwd MACs"]
    cols += ["bwd MACs"] if r.has_backward else []
    cols += ["jvp MACs"] if r.has_jvp else []
    for col in cols:
        table.add_column(col, justify="left" if col == "layer" else "right")
    shown = _shown_layers(layers, max_layers)
    for L in layers:
        if id(L) not in shown or not (L.params or L.forward_mm_flops or L.backward_mm_flops):
            continue
        cells = [
            L.name,
            human(L.params) if L.params else "",
            "×".join(map(str, L.output_shape or ())),
        ]
        cells.append(human(L.forward_mm_flops // 2))
        cells += [human(L.backward_mm_flops // 2)] if r.has_backward else []
        cells += [human(L.jvp_mm_flops // 2)] if r.has_jvp else []
        table.add_row(*cells)
    return table


def _op_table(r: Report, phase: str, rows: list[OpRow], units: str) -> Table:
    """One phase's ops, most work first: count, FLOPs (or MACs), matrix FLOPs, bytes, share."""
    total = sum(o.flops for o in rows)
    macs = units == "macs"
    table = Table(title=f"{r.model} — {phase} by op", header_style="bold")
    cols = ["op", "count", "MACs" if macs else "FLOPs"]
    cols += [] if macs else ["mm FLOPs"]
    cols += ["bytes read", "bytes written", "share"]
    for col in cols:
        table.add_column(col, justify="left" if col == "op" else "right")
    for o in sorted(rows, key=lambda o: (-o.flops, -o.bytes_written, o.op)):
        work = [human(o.mm_flops // 2)] if macs else [human(o.flops), human(o.mm_flops)]
        share = f"{100 * o.flops / total:.1f}%" if total else "–"
        table.add_row(
            o.op,
            str(o.count),
            *work,
            human_bytes(o.bytes_read),
            human_bytes(o.bytes_written),
            share,
        )
    return table


def _over_memory(r: Report) -> list[str]:
    """A warning when the train step's predicted peak exceeds the memory of the device it is
    timed on (a data sheet's, or a calibrated GPU's), naming the what-ifs whose peaks fit."""
    t, m = r.time, r.memory
    peak = m.train_peak_bytes
    if t is None or not t.memory_bytes or not peak or peak <= t.memory_bytes:
        return []
    fits = [
        f"--{what} {human_bytes(w.train_peak_bytes)}"
        for what, w in (("checkpoint", m.checkpoint), ("amp", m.amp), ("recompute", m.recompute))
        if w is not None and w.train_peak_bytes and w.train_peak_bytes <= t.memory_bytes
    ]
    return [
        f"warning: the train step's predicted peak, {human_bytes(peak)}, exceeds the "
        f"{human_bytes(t.memory_bytes)} of one {t.device}: the step does not fit on one device"
        + (f" (it fits with {', '.join(fits)})" if fits else "")
        + "; graphflop plan shards it over several"
    ]


def warning_lines(r: Report) -> list[str]:
    """One line when the train step's predicted peak exceeds the memory of the device it is
    timed on, one per op the analysis could not count or differentiate
    (``Report.uncounted``), and one when the model has no trainable parameter (the training
    figures are all zero); then one ``assumption:`` line per :attr:`Report.assumptions`."""
    lines = _over_memory(r)
    jvp = r.totals.jvp
    weight_jvp = jvp is not None and jvp.tangents == "params"
    if r.trainable_params == 0 and (r.totals.backward is not None or weight_jvp):
        frozen = f" ({r.frozen_params:,} frozen)" if r.frozen_params else ""
        lines.append(
            f"warning: the model has no trainable parameters{frozen}: its gradient, update and "
            "weight-tangent figures are zero; --no-backward --no-jvp reports the forward alone "
            "(--tangents inputs differentiates with respect to the inputs)"
        )
    for u in r.uncounted:
        where = ", ".join(m or "(model)" for m in u.modules[:3])
        where += ", …" if len(u.modules) > 3 else ""
        if u.op.startswith(FUNCTION_LABEL):  # a custom Function: its own derivative is missing
            lines.append(_function_warning(u, where))
            continue
        if u.missing == ("recompute",):
            lines.append(
                f"warning: {u.op} ({u.count} call{'s' if u.count != 1 else ''} in {where}): "
                "not modelled, the backward is incomplete"
            )
            continue
        effects = []
        if "cost" in u.missing:
            effects.append("counted as 0 FLOPs")
            if r.time is not None:
                effects.append(
                    f"timed on {r.time.device} at its tensors' bytes (inputs read, output "
                    "written) on the memory roofline, no compute"
                )
        if "jvp" in u.missing or "transpose" in u.missing:
            effects.append("the JVP/backward stops at its nodes")
        lines.append(
            f"warning: {u.op} has no {'/'.join(u.missing)} rule ({u.count} node"
            f"{'s' if u.count != 1 else ''} in {where}): {'; '.join(effects)}; "
            "these phases are incomplete (--strict makes this an error)"
        )
    lines.extend(f"assumption: {a}" for a in r.assumptions)
    return lines


def _function_warning(u: Uncounted, where: str) -> str:
    """The warning for a custom ``autograd.Function`` whose own derivative is missing."""
    calls = f"{u.count} call{'s' if u.count != 1 else ''} in {where}"
    if u.missing == ("jvp",):
        return (
            f"warning: {u.op} has no jvp ({calls}): the JVP and the forward gradient stop at "
            "it, as PyTorch's forward-mode AD refuses it; give the class a jvp staticmethod"
        )
    return (
        f"warning: {u.op}: its own backward could not be traced ({calls}): the backward and "
        "JVP stop at it; see the trace's warning for why"
    )


def _work(L: LayerRow) -> float:
    """What the per-layer table ranks layers by: forward + backward FLOPs."""
    return L.forward_flops + L.backward_flops


def _hidden_line(rows: tuple[LayerRow, ...], max_layers: int) -> str | None:
    """The line under a table that leaves rows out: how many, and "smaller" only when each
    of them has less work than every row shown (layers of equal size tie at the cut)."""
    shown = _shown_layers(rows, max_layers)
    # a row with no parameters and no work is never printed, shown or not
    hidden = [
        L
        for L in rows
        if id(L) not in shown and (L.params or L.forward_flops or L.backward_flops or L.jvp_flops)
    ]
    if not hidden:
        return None
    least = min(_work(L) for L in rows if id(L) in shown)
    n = len(hidden)
    layers = "layer" if n == 1 else "layers"
    if all(_work(L) < least for L in hidden):
        return f"{n} smaller {layers} not shown (--json has all)"
    return f"{n} other {layers} not shown, none larger than those shown (--json has all)"


def _shown_layers(rows: tuple[LayerRow, ...], max_layers: int) -> set[int]:
    """ids of the rows shown: all of them, or the ``max_layers`` with the most work."""
    if len(rows) <= max_layers:
        return {id(L) for L in rows}
    ranked = sorted(rows, key=lambda L: -_work(L))
    return {id(L) for L in ranked[:max_layers]}


def _layer_cells(r: Report, L: LayerRow) -> list[str]:
    cells = [
        L.name,
        human(L.params) if L.params else "",
        "×".join(map(str, L.output_shape or ())),
        human(L.forward_flops),
        f"{100 * L.share:.1f}%",
    ]
    if r.has_backward:
        cells += [
            human(L.grad_input_flops),
            human(L.grad_weight_flops),
            human(L.pruned_flops) if L.pruned_flops else "",
            human(L.update_flops) if L.update_flops else "",
            _r(L.ratio),
            human_bytes(L.saved_bytes) if L.saved_bytes else "",
        ]
    if r.has_jvp:
        cells += [human(L.jvp_flops), _r(L.jvp_ratio)]
    return cells


def _totals_table(r: Report, units: str = "flops") -> Table:
    t = r.totals
    tot = Table(title="totals", header_style="bold")
    mm_col = "MACs" if units == "macs" else "mm FLOPs"
    for col in ("phase", "FLOPs", mm_col, "bytes read", "bytes written", "notes"):
        tot.add_column(col, justify="left" if col in ("phase", "notes") else "right")

    def row(phase, c, notes, mm=None):
        mm = human(c.macs if units == "macs" else c.mm_flops) if mm is None else mm
        notes += "" if c.complete else " [yellow](incomplete)[/yellow]"
        tot.add_row(
            phase,
            human(c.flops),
            mm,
            human_bytes(c.bytes_read),
            human_bytes(c.bytes_written),
            notes,
        )

    row("forward", t.forward, f"loss: {human(t.loss.flops)}")
    if t.backward is not None:
        b, u = t.backward, t.update
        row(
            "backward",
            b,
            f"input grads {human(b.grad_input_flops)}, weight grads "
            f"{human(b.grad_weight_flops)}, pruned {human(b.pruned_flops)}"
            + (f", recompute {human(b.recompute_flops)}" if b.recompute_flops else ""),
        )
        if u is not None:  # built with the backward graph
            row(f"update ({u.optimizer})", u, f"{_r(u.flops_per_param)} FLOPs per parameter", "0")
    if t.jvp is not None:
        j = t.jvp
        row(f"jvp (tangents: {j.tangents})", j, f"skipped (zero tangents) {human(j.skipped_flops)}")
        fg = t.forward_gradient_step
        tot.add_row(
            "forward-gradient step",
            human(fg.flops if fg is not None else None),
            "",
            "",
            "",
            "primal + tangent + g=d·v + update",
        )
        a = t.activity_gradient_step
        if a is not None:
            wp = a.weight_perturbation_peak_bytes
            row(
                "activity-gradient step",
                a,
                f"random {human(a.random_elements)}"
                + (f" (weights: {human(fg.random_elements)})" if fg is not None else "")
                + f", peak {human_bytes(a.peak_bytes)}"
                + (f" (weights: {human_bytes(wp)})" if wp is not None else ""),
            )
    return tot


def _summary_lines(r: Report) -> list[str]:
    q, m = r.ratios, r.memory
    lines = [f"parameters: {r.params:,}   loss: {r.loss}"]
    if r.frozen_params:  # trainable/frozen line
        lines[0] = (
            f"parameters: {r.params:,} ({r.trainable_params:,} trainable, {r.frozen_params:,} frozen)   loss: {r.loss}"
        )
    mem = [
        f"params {human_bytes(m.params_bytes)}",
        f"forward peak {human_bytes(m.forward_peak_bytes)}",
    ]
    if m.buffers_bytes:
        mem.insert(1, f"buffers {human_bytes(m.buffers_bytes)}")
    if r.has_backward:
        lines.append(
            f"backward/forward: [bold]{_r(q.backward_forward)}[/bold] with update, "
            f"{_r(q.backward_forward_no_update)} without; train step/forward "
            f"{_r(q.train_step_forward)}"
        )
        mem += [
            f"saved for backward {human_bytes(m.saved_for_backward_bytes)}",
            f"train peak {human_bytes(m.train_peak_bytes)}",
        ]
    if r.has_jvp:
        lines.append(
            f"jvp/forward: [bold]{_r(q.jvp_forward)}[/bold]; forward-gradient "
            f"step/forward {_r(q.forward_gradient_step_forward)}"
        )
        mem.append(f"jvp peak {human_bytes(m.jvp_peak_bytes)}")
    lines.append("memory: " + ", ".join(mem))
    if r.time is not None:
        lines += time_lines(r.time)
    ck, amp = m.checkpoint, m.amp
    if ck:  # the what-ifs of --checkpoint and --amp (their JSON: memory.checkpoint, .amp)
        lines.append(
            f"checkpoint {ck.pattern} ({counted(len(ck.modules), 'module')}): saved for backward "
            f"{human_bytes(ck.saved_for_backward_bytes)}, train peak "
            f"{human_bytes(ck.train_peak_bytes)}, recompute {human(ck.recompute_flops)} "
            "FLOPs"
        )
    if amp:
        lines.append(
            f"amp {amp.dtype}: saved for backward {human_bytes(amp.saved_for_backward_bytes)}"
            f", train peak {human_bytes(amp.train_peak_bytes)}"
            + (" (FLOPs unchanged)" if amp.flops_unchanged else "")
        )
    ea = r.eager_attention
    if ea is not None:  # its JSON: eager_attention
        b = r.totals.backward
        eager_mm = "" if b is None else f" = {b.mm_flops + ea.backward_recompute_mm_flops:,}"
        lines.append(
            f"attention: FLOPs count graphflop's graph, attention in its math form (backward "
            f"2× the forward's products); eager PyTorch runs its {ea.calls} {'call' if ea.calls == 1 else 'calls'} on the fused "
            f"kernel ({ea.kernel}), whose backward recomputes q·kᵀ: backward mm FLOPs "
            f"+{ea.backward_recompute_mm_flops:,}{eager_mm} as eager runs it (what plan counts)"
        )
    rc = m.recompute
    if rc:  # the what-if of --recompute (its JSON: memory.recompute)
        lines.append(
            f"recompute {rc.policy} ({len(rc.cores)} cores"
            + (f", {rc.fused_cores} fused left alone" if rc.fused_cores else "")
            + f"): saved for backward {human_bytes(rc.saved_for_backward_bytes)} (eager "
            f"{human_bytes(rc.eager_saved_for_backward_bytes)}), train peak "
            f"{human_bytes(rc.train_peak_bytes)}, recompute {human(rc.recompute_flops)} FLOPs"
        )
    return lines


def to_json(report: Report, extra: dict[str, Any] | None = None) -> str:
    """The JSON document :meth:`Report.to_dict` (indented), followed by the top-level keys of
    ``extra`` (e.g. ``verify``), which must be JSON-ready."""
    return json.dumps({**report.to_dict(), **(extra or {})}, indent=2)


def layers_csv(report: Report) -> str:
    """The per-layer rows as CSV: the JSON row keys as columns, ``output_shape`` last as
    ``AxBxC``; with predicted times (``--device``), each row's :class:`LayerTime` as
    ``time_forward_s``, ``time_backward_s``, ``time_update_s``, ``time_jvp_s`` (seconds) and
    ``time_bound`` before it."""
    rows = report.layer_dicts()
    times = {t.name: t for t in report.time.layers} if report.time is not None else {}
    timed = ("forward_s", "backward_s", "update_s", "jvp_s", "bound")
    buf = io.StringIO()
    cols = [k for k in rows[0] if k != "output_shape"] if rows else []
    cols += [f"time_{k}" for k in timed] if times and rows else []
    cols += ["output_shape"] if rows else []
    w = csv.DictWriter(buf, fieldnames=cols)
    w.writeheader()
    for r in rows:
        t = times.get(r["name"])
        cells = {f"time_{k}": getattr(t, k) for k in timed} if t is not None else {}
        w.writerow({**r, **cells, "output_shape": "x".join(map(str, r["output_shape"] or []))})
    return buf.getvalue()
