"""What ``graphflop train --out DIR`` writes: ``train.csv`` (one row per step), ``train.png``
(loss against wall time and steps) and ``summary.json``, each atomically
(:func:`graphflop.io.atomic_write`), from the :class:`TrainResult` a run returns."""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from graphflop.io import atomic_group, atomic_write

if TYPE_CHECKING:
    import torch

CSV_COLUMNS = ("step", "wall_s", "train_loss", "val_loss", "val_accuracy")
#: the names a run writes into ``--out`` (:func:`write_outputs`; ``onnx``: the folder of the
#: step graphs with ``runtime="onnxruntime"``)
OUT_NAMES = frozenset({"train.csv", "train.png", "summary.json", "onnx"})


def foreign_files(out: str | Path) -> list[str]:
    """The names in the folder ``out`` that no run writes (sorted; empty when the folder is
    missing): a run's folder holds its own files only, as an export's does
    (:func:`graphflop.export.onnx.foreign_files`), so a run's files never land among others."""
    d = Path(out)
    if not d.is_dir():
        return []
    return sorted(p.name for p in d.iterdir() if p.name not in OUT_NAMES)


@dataclass
class TrainResult:
    """What :func:`graphflop.train.loop.train` did.

    Attributes:
        history: one row per step (``step``, ``wall_s``, ``train_loss``, ``val_loss``,
            ``val_accuracy``; the validation fields are None between evaluations), after a
            step-0 row with the initial validation loss.
        summary: final validation loss and accuracy, timings and the settings (JSON-ready).
        params: the trained parameters, by qualified name.
    """

    history: list[dict[str, Any]]
    summary: dict[str, Any]
    params: dict[str, torch.Tensor] = field(default_factory=dict)


def _cell(value: Any) -> Any:
    if value is None:
        return ""
    return f"{value:.8g}" if isinstance(value, float) else value


def write_csv(history: list[dict[str, Any]], path: str | Path) -> None:
    """``train.csv``: one row per step (:data:`CSV_COLUMNS`); validation columns empty between
    evaluations, floats with 8 significant digits."""
    buf = io.StringIO(newline="")
    w = csv.writer(buf)
    w.writerow(CSV_COLUMNS)
    for r in history:
        w.writerow([_cell(r[c]) for c in CSV_COLUMNS])
    atomic_write(path, lambda p: p.write_text(buf.getvalue(), newline=""))


def plot(history: list[dict[str, Any]], path: str | Path, title: str = "") -> None:
    """``train.png``: loss against training wall time (left) and against steps (right)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    tr = [r for r in history if r["train_loss"] is not None and math.isfinite(r["train_loss"])]
    va = [r for r in history if r["val_loss"] is not None]
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    for ax, key, label in zip(
        fig.subplots(1, 2), ("wall_s", "step"), ("training wall time (s)", "step")
    ):
        if tr:
            ax.plot(
                [r[key] for r in tr],
                [r["train_loss"] for r in tr],
                lw=0.8,
                alpha=0.6,
                label="train loss (batch)",
            )
        if va:
            ax.plot(
                [r[key] for r in va],
                [r["val_loss"] for r in va],
                "o-",
                ms=3,
                label="validation loss",
            )
        ax.set_xlabel(label)
        ax.set_ylabel("cross-entropy")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    atomic_write(path, lambda p: fig.savefig(p, format="png", dpi=110))


def _title(s: dict[str, Any]) -> str:
    acc = s.get("final_val_accuracy")
    return (
        f"{s['model']} on {s['dataset']}: {s['method']}"
        f"{' (' + s['runtime'] + ')' if s['method'] != 'torch' else ''}, {s['optimizer']} "
        f"lr {s['lr']:g}"
        + (f", K={s['directions']}" if s["method"] == "fgd" else "")
        + (f" — val acc {acc:.1%}" if acc is not None else "")
    )


def write_outputs(result: TrainResult, out: str | Path) -> dict[str, Path]:
    """Write ``train.csv``, ``train.png`` and ``summary.json`` into ``out`` (created), all three
    or none (:func:`graphflop.io.atomic_group`: a failed write leaves no file and no folder it
    made).

    Returns:
        Their paths by ``csv``, ``png`` and ``summary``.
    """
    out = Path(out)
    files = {"csv": out / "train.csv", "png": out / "train.png", "summary": out / "summary.json"}
    with atomic_group():
        write_csv(result.history, files["csv"])
        plot(result.history, files["png"], _title(result.summary))
        atomic_write(files["summary"], json.dumps(result.summary, indent=1) + "\n")
    return files
