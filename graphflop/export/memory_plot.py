"""``graphflop inspect --plot-memory FILE``: live bytes over the step, as PNG, SVG or PDF.

One panel per :class:`~graphflop.export.memory_timeline.Timeline` of the analysis: the training
step (forward, backward and update shaded as phases), or the forward alone where no backward was
built, and the JVP where one was. Each panel draws the always-live baseline (parameters, and
gradients, optimizer state or parameter tangents where the memory model holds them throughout)
under the bytes the schedule holds at each step, marks the peak (which equals the report's
``train_peak_bytes``/``forward_peak_bytes``/``jvp_peak_bytes``) and labels the largest tensors
live there (node, module, shape, dtype, bytes). The what-if peaks of ``--checkpoint``,
``--amp`` and ``--recompute`` are drawn as dashed lines on the training panel. Units: MiB (2^20 bytes), or B, KiB or
GiB for a figure whose largest peak is under 1 KiB, under 1 MiB or at least 1 GiB. matplotlib is
imported when a plot is drawn, not with this module.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from graphflop.analysis import Analysis
    from graphflop.export.memory_timeline import LiveTensor, Timeline
    from graphflop.report import AmpWhatIf, CheckpointWhatIf, RecomputeWhatIf

__all__ = ["PLOT_SUFFIXES", "plot_memory"]

#: the file formats :func:`plot_memory` writes, by the path's suffix
PLOT_SUFFIXES = (".png", ".svg", ".pdf")
#: tensors labelled at each peak
TOP_TENSORS = 4

_UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("B", 1))
_TITLES = {
    "train": "training step (train_peak_bytes)",
    "forward": "forward only: no backward built (forward_peak_bytes)",
    "jvp": "JVP, forward-mode (jvp_peak_bytes)",
}
_PHASE_COLOURS = {
    "forward": "#dbe9f6",
    "backward": "#fbe3d6",
    "update": "#e2f0d9",
    "jvp": "#ece2f0",
}


def plot_memory(analysis: Analysis, path: str | Path) -> Path:
    """Draw the live bytes of ``analysis``'s memory schedules and write them to ``path``.

    Args:
        analysis: an analysis in the ``eager`` or ``graph`` memory model.
        path: the file; its suffix (``.png``, ``.svg``, ``.pdf``) picks the format. Written
            atomically (:func:`graphflop.io.atomic_write`): nothing is left on a failure.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        ValueError: an unsupported suffix, or the ``compiled`` memory model
            (:func:`~graphflop.export.memory_timeline.memory_timeline`).
        OSError: the file cannot be written.
    """
    from graphflop.export.memory_timeline import memory_timeline
    from graphflop.io import atomic_write

    suffix = Path(path).suffix.lower()
    if suffix not in PLOT_SUFFIXES:
        raise ValueError(f"{path}: unsupported suffix; use one of {', '.join(PLOT_SUFFIXES)}")
    timelines = memory_timeline(analysis)
    fig = _figure(analysis, timelines)
    return atomic_write(path, lambda p: fig.savefig(p, format=suffix[1:], dpi=110))


def _figure(analysis: Analysis, timelines: list[Timeline]):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    mem = analysis.report.memory
    fig = Figure(figsize=(11, 0.6 + 4.4 * len(timelines)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(timelines), 1, squeeze=False)[:, 0]
    top = max(tl.peak_bytes for tl in timelines)
    unit = next((u for u in _UNITS if top >= u[1]), _UNITS[-1])
    for ax, tl in zip(axes, timelines):
        _panel(ax, tl, unit)
        if tl.kind == "train":
            _what_ifs(ax, mem.checkpoint, mem.amp, unit, mem.recompute)
        ax.legend(loc="upper left", fontsize=7, framealpha=0.85)
    grads = "; gradients kept (--keep-grads)" if mem.keep_grads else ""
    fig.suptitle(
        f"{analysis.report.model}: live memory over one step, memory model "
        f"{mem.memory_model or 'graph'} on {mem.device or 'cpu'}{grads}",
        fontsize=11,
    )
    return fig


def _panel(ax, tl: Timeline, unit: tuple[str, int]) -> None:
    name, div = unit
    xs = range(len(tl.live_bytes))
    base = tl.baseline_bytes / div
    total = [base + b / div for b in tl.live_bytes]
    n = max(len(tl.live_bytes), 1)
    for phase, start, end in tl.phases:
        ax.axvspan(start - 0.5, end - 0.5, color=_PHASE_COLOURS.get(phase, "#eeeeee"), lw=0)
        narrow = (end - start) / n < 0.04  # a one-step phase (the eager update): label its edge
        ax.text(
            end - 0.5 if narrow else (start + end - 1) / 2,
            1.0,
            phase,
            transform=ax.get_xaxis_transform(),
            ha="right" if narrow else "center",
            va="bottom",
            fontsize=8,
        )
    parts = ", ".join(f"{k} {v / div:.2f}" for k, v in tl.baseline.items() if v)
    ax.fill_between(
        xs, 0, base, step="mid", color="#9e9e9e", alpha=0.6, label=f"always live: {parts} {name}"
    )
    ax.fill_between(xs, base, total, step="mid", color="#1f77b4", alpha=0.35)
    ax.plot(xs, total, drawstyle="steps-mid", color="#1f77b4", lw=1.0, label="live bytes")
    peak = tl.peak_bytes / div
    phase = next((p for p, s, e in tl.phases if s <= tl.peak_step < e), "")
    ax.plot([tl.peak_step], [peak], "v", color="#d62728", ms=8, label=f"peak {peak:.2f} {name}")
    ax.annotate(
        _peak_label(tl, phase, unit),
        xy=(tl.peak_step, peak),
        xytext=(0.99, 0.97),
        textcoords="axes fraction",
        ha="right",
        va="top",
        fontsize=7,
        family="monospace",
        bbox={"boxstyle": "round", "fc": "white", "ec": "#d62728", "alpha": 0.9},
        arrowprops={"arrowstyle": "->", "color": "#d62728", "lw": 0.8},
    )
    ax.set_ylim(0, peak * 1.55 if peak else 1)
    ax.set_xlim(-0.5, n - 0.5)
    ax.set_xlabel("step (one per graph node, in the memory model's order)")
    ax.set_ylabel(name)
    what = "\n".join(textwrap.wrap(tl.describes, 150)) if tl.describes else ""
    ax.set_title(f"{_TITLES[tl.kind]}\n{what}", fontsize=8, loc="left", pad=14)
    ax.grid(True, axis="y", alpha=0.3)


def _peak_label(tl: Timeline, phase: str, unit: tuple[str, int]) -> str:
    name, div = unit
    lines = [f"peak {tl.peak_bytes / div:.2f} {name} at step {tl.peak_step} ({phase})"]
    lines += [_tensor_label(t, unit) for t in tl.peak_tensors[:TOP_TENSORS]]
    rest = tl.peak_tensors[TOP_TENSORS:]
    if rest:
        lines.append(f"+ {len(rest)} more: {sum(t.nbytes for t in rest) / div:.2f} {name}")
    return "\n".join(lines)


def _tensor_label(t: LiveTensor, unit: tuple[str, int]) -> str:
    shape = "×".join(map(str, t.shape)) if t.shape is not None else ""
    where = f" [{t.module}]" if t.module else ""
    what = f" {shape} {t.dtype}" if shape else ""
    return f"{t.nbytes / unit[1]:8.2f} {unit[0]}  {t.phase[0]}:{t.name}{where}{what}"


def _what_ifs(
    ax,
    checkpoint: CheckpointWhatIf | None,
    amp: AmpWhatIf | None,
    unit: tuple[str, int],
    recompute: RecomputeWhatIf | None = None,
) -> None:
    """Dashed lines at the train peaks of the checkpointing, autocast and selective-recompute
    what-ifs."""
    for label, peak, colour in (
        (
            f"--checkpoint {checkpoint.pattern if checkpoint else ''}",
            checkpoint.train_peak_bytes if checkpoint else None,
            "#2ca02c",
        ),
        (f"--amp {amp.dtype if amp else ''}", amp.train_peak_bytes if amp else None, "#9467bd"),
        (
            f"--recompute {recompute.policy if recompute else ''}",
            recompute.train_peak_bytes if recompute else None,
            "#8c564b",
        ),
    ):
        if peak:
            y = peak / unit[1]
            ax.axhline(
                y, ls="--", lw=1.0, color=colour, label=f"what-if {label}: peak {y:.2f} {unit[0]}"
            )
