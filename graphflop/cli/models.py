"""``graphflop models``: the published model configurations bundled with graphflop
(:mod:`graphflop.presets`), usable offline as ``hf:NAME`` or by their Hub names."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console
from rich.table import Table

from graphflop.cli.common import stdout_console


def add_parser(sub) -> argparse.ArgumentParser:
    """Add the ``models`` subcommand to ``graphflop``'s subparsers."""
    p = sub.add_parser(
        "models",
        help="list the bundled published model configurations (hf:NAME, offline)",
        description="List the published model configurations graphflop ships: each is "
        "analysed with 'graphflop inspect hf:NAME' (or its Hub name, which falls back to the "
        "preset when the Hub cannot be reached), with its source and published parameter "
        "counts.",
    )
    p.add_argument(
        "--format",
        default="table",
        choices=["table", "json"],
        help="a table (default) or a JSON list on standard output",
    )
    p.add_argument(
        "--count",
        action="store_true",
        help="also build each model on the meta device (needs transformers; seconds) and give "
        "its exact total and active parameters",
    )
    return p


def rows(count: bool = False) -> list[dict[str, Any]]:
    """One dict per preset: name, hub, model_type, context, params and active as published,
    their source and rounding, the configuration's source and note; with ``count``, also
    ``params_exact`` and ``active_exact`` from the model built on the meta device.

    Raises:
        SpecError: ``count`` without transformers installed.
    """
    from graphflop.presets import PRESETS

    out = []
    for p in PRESETS:
        row: dict[str, Any] = {
            "name": p.name,
            "hub": p.hub,
            "aliases": list(p.aliases),
            "model_type": p.model_type,
            "context": p.context,
            "params": p.params,
            "active": p.active,
            "params_source": p.params_source,
            "rounding": p.rounding,
            "source": p.source,
            "note": p.note,
        }
        if count:
            row.update(exact_counts(p.name))
        out.append(row)
    return out


def exact_counts(name: str) -> dict[str, int]:
    """``params_exact`` and ``active_exact`` of preset ``name``, built on the meta device."""
    from graphflop.load import load
    from graphflop.presets import active_parameters

    model = load(f"hf:{name}", meta=True, seq=1).model
    total = sum(t.numel() for t in model.parameters())
    return {"params_exact": total, "active_exact": active_parameters(model, model.config)}


def run(args: argparse.Namespace, err: Console) -> int:
    """Print the presets as a table or JSON; returns 0."""
    table = rows(count=args.count)
    if args.format == "json":
        print(json.dumps(table, indent=2))
        return 0
    t = Table(title="graphflop's published model configurations (graphflop inspect hf:NAME)")
    for col, just in [
        ("name", "left"),
        ("Hub name", "left"),
        ("type", "left"),
        ("params", "right"),
        ("active", "right"),
        ("context", "right"),
    ]:
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    if args.count:
        t.add_column("exact params", justify="right")
        t.add_column("exact active", justify="right")
    for r in table:
        cells = [
            r["name"],
            r["hub"],
            r["model_type"],
            r["params"],
            r["active"] or "",
            f"{r['context']:,}" if r["context"] else "",
        ]
        if args.count:
            cells += [f"{r['params_exact']:,}", f"{r['active_exact']:,}"]
        t.add_row(*cells)
    console = stdout_console()
    console.print(t)
    exact = (
        "exact params, exact active: the counts of the models built"
        if args.count
        else "--count gives the exact counts of the models built"
    )
    console.print(
        "params, active: as published (see graphflop/presets.py for each figure's source); "
        + exact,
        highlight=False,
    )
    return 0
