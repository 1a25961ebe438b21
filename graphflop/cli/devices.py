"""``graphflop devices``: the data-sheet devices ``--device`` accepts (:mod:`graphflop.devices`),
with their dense peaks per dtype, memory, bandwidth and interconnect."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console
from rich.table import Table

from graphflop.cli.common import stdout_console

#: the peak columns of the table (dtype, header), in the order a reader compares them
_PEAKS = (
    ("float64", "fp64"),
    ("float32", "fp32"),
    ("tf32", "tf32"),
    ("bfloat16", "bf16"),
    ("float16", "fp16"),
    ("float8", "fp8"),
    ("int8", "int8"),
)


def add_parser(sub) -> argparse.ArgumentParser:
    """Add the ``devices`` subcommand to ``graphflop``'s subparsers."""
    p = sub.add_parser(
        "devices",
        help="list the devices --device accepts (data sheets: peaks, memory, bandwidth)",
        description="List the data-sheet devices that 'inspect --device', 'sweep --device' "
        "and 'plan' accept by name or alias: dense peak FLOP/s per dtype, device memory, "
        "memory bandwidth and interconnect bandwidth per GPU, each figure from the vendor's "
        "data sheet (docs/devices.md cites every source). A profile measured by 'graphflop "
        "calibrate' is passed to --device as its file instead.",
    )
    p.add_argument(
        "--format",
        default="table",
        choices=["table", "json"],
        help="a table (default) or a JSON list on standard output (every figure in base "
        "units: FLOP/s, bytes, bytes/s; each with its source)",
    )
    return p


def rows() -> list[dict[str, Any]]:
    """One dict per device of :data:`graphflop.devices.DEVICES`: name, aliases, title,
    vendor, ``peak_flops`` (dtype -> FLOP/s), ``memory_bytes``, ``memory_bandwidth``
    (bytes/s), ``interconnect`` (link -> bytes/s, one direction), sources and notes."""
    from graphflop.devices import ALIASES, DEVICES

    return [
        {
            "name": s.name,
            "aliases": sorted(a for a, n in ALIASES.items() if n == s.name),
            "title": s.title,
            "vendor": s.vendor,
            "peak_flops": dict(s.peak_flops),
            "memory_bytes": s.memory_bytes,
            "memory_bandwidth": s.memory_bandwidth,
            "interconnect": dict(s.interconnect),
            "sources": dict(s.sources),
            "notes": list(s.notes),
        }
        for s in DEVICES.values()
    ]


def run(args: argparse.Namespace, err: Console) -> int:
    """Print the devices as a table or JSON; returns 0."""
    table = rows()
    if args.format == "json":
        print(json.dumps(table, indent=2))
        return 0
    t = Table(
        title="devices --device accepts: dense peak TFLOP/s per dtype (int8: tera-ops/s), "
        "memory and bandwidth, from the vendors' data sheets"
    )
    t.add_column("name", justify="left")
    t.add_column("device", justify="left")
    for _, head in _PEAKS:
        t.add_column(head, justify="right")
    t.add_column("GiB", justify="right")
    t.add_column("TB/s", justify="right")
    t.add_column("links GB/s", justify="left")
    for r in table:
        peak = r["peak_flops"]
        peaks = [f"{peak[d] / 1e12:,.1f}" if d in peak else "–" for d, _ in _PEAKS]
        links = ", ".join(f"{k} {v / 1e9:,.0f}" for k, v in r["interconnect"].items())
        name = r["name"] + (f" ({', '.join(r['aliases'])})" if r["aliases"] else "")
        t.add_row(
            name,
            r["title"],
            *peaks,
            f"{r['memory_bytes'] / 2**30:,.0f}",
            f"{r['memory_bandwidth'] / 1e12:,.2f}",
            links,
        )
    console = stdout_console()
    console.print(t)
    console.print(
        "GiB: device memory; TB/s: its bandwidth; links: per GPU, one direction; sources: "
        "docs/devices.md or --format json. A measured profile: graphflop calibrate, then "
        "--device FILE.json.",
        highlight=False,
    )
    return 0
