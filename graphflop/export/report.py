"""Tables (rich), JSON and CSV from an analysis summary. Reads the summary only."""

from __future__ import annotations

import csv
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def human(n: float | int | None, unit: str = "") -> str:
    """1234567 → '1.23 M' (decimal prefixes)."""
    if n is None:
        return "–"
    n = float(n)
    for div, p in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.3g} {p}{unit}"
    return f"{n:.4g} {unit}".rstrip()


def human_bytes(n: int | None) -> str:
    if n is None:
        return "–"
    n = float(n)
    for div, p in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= div:
            return f"{n / div:.3g} {p}"
    return f"{int(n)} B"


def _r(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def print_report(
    summary: dict[str, Any], console: Console | None = None, max_layers: int = 60
) -> None:
    """Per-layer table, then totals, ratios and memory."""
    console = console or Console()
    t = summary["totals"]
    has_b = "backward" in t
    has_j = "jvp" in t
    table = Table(
        title=f"{summary['model']} — per layer (FLOPs: 1 multiply-add = 2)",
        show_lines=False,
        header_style="bold",
    )
    table.add_column("layer")
    table.add_column("params", justify="right")
    table.add_column("output", justify="right")
    table.add_column("fwd FLOPs", justify="right")
    table.add_column("share", justify="right")
    if has_b:
        table.add_column("bwd in", justify="right")
        table.add_column("bwd weight", justify="right")
        table.add_column("pruned", justify="right", style="dim")
        table.add_column("update", justify="right")
        table.add_column("(bwd+upd)/fwd", justify="right", style="bold")
    if has_j:
        table.add_column("jvp", justify="right")
        table.add_column("jvp/fwd", justify="right", style="bold")
    rows = summary["layers"]
    shown = (
        rows
        if len(rows) <= max_layers
        else sorted(rows, key=lambda r: -(r["forward_flops"] + r.get("backward_flops", 0)))[
            :max_layers
        ]
    )
    for L in rows:
        if L not in shown or not (
            L["params"] or L["forward_flops"] or L.get("backward_flops") or L.get("jvp_flops")
        ):
            continue
        cells = [
            L["name"],
            human(L["params"]) if L["params"] else "",
            "×".join(map(str, L["output_shape"] or [])),
            human(L["forward_flops"]),
            f"{100 * L['share']:.1f}%",
        ]
        if has_b:
            cells += [
                human(L["grad_input_flops"]),
                human(L["grad_weight_flops"]),
                human(L["pruned_flops"]) if L["pruned_flops"] else "",
                human(L["update_flops"]) if L["update_flops"] else "",
                _r(L.get("ratio")),
            ]
        if has_j:
            cells += [human(L["jvp_flops"]), _r(L.get("jvp_ratio"))]
        table.add_row(*cells)
    console.print(table)
    if len(rows) > len(shown):
        console.print(
            f"[dim]{len(rows) - len(shown)} smaller layers not shown (--json has all)[/dim]"
        )
    tot = Table(title="totals", header_style="bold")
    for col in ("phase", "FLOPs", "mm FLOPs", "bytes read", "bytes written", "notes"):
        tot.add_column(col, justify="right" if col != "notes" and col != "phase" else "left")
    f = t["forward"]
    tot.add_row(
        "forward",
        human(f["flops"]),
        human(f["mm_flops"]),
        human_bytes(f["bytes_read"]),
        human_bytes(f["bytes_written"]),
        f"loss: {human(t['loss']['flops'])}",
    )
    if has_b:
        b = t["backward"]
        tot.add_row(
            "backward",
            human(b["flops"]),
            human(b["mm_flops"]),
            human_bytes(b["bytes_read"]),
            human_bytes(b["bytes_written"]),
            f"input grads {human(b['grad_input_flops'])}, weight grads "
            f"{human(b['grad_weight_flops'])}, pruned {human(b['pruned_flops'])}",
        )
        u = t["update"]
        tot.add_row(
            f"update ({u['optimizer']})",
            human(u["flops"]),
            "0",
            human_bytes(u["bytes_read"]),
            human_bytes(u["bytes_written"]),
            f"{_r(u['flops_per_param'])} FLOPs per parameter",
        )
    if has_j:
        j = t["jvp"]
        tot.add_row(
            f"jvp (tangents: {j['tangents']})",
            human(j["flops"]),
            human(j["mm_flops"]),
            human_bytes(j["bytes_read"]),
            human_bytes(j["bytes_written"]),
            f"skipped (zero tangents) {human(j['skipped_flops'])}",
        )
        tot.add_row(
            "forward-gradient step",
            human(t["forward_gradient_step"]["flops"]),
            "",
            "",
            "",
            "primal + tangent + g=d·v + update",
        )
    console.print(tot)
    r = summary["ratios"]
    m = summary["memory"]
    lines = [f"parameters: {summary['params']:,}   loss: {summary['loss']}"]
    if has_b:
        lines.append(
            f"backward/forward: [bold]{_r(r['backward_forward'])}[/bold] with update, "
            f"{_r(r['backward_forward_no_update'])} without; train step/forward "
            f"{_r(r['train_step_forward'])}"
        )
    if has_j:
        lines.append(
            f"jvp/forward: [bold]{_r(r['jvp_forward'])}[/bold]; forward-gradient "
            f"step/forward {_r(r['forward_gradient_step_forward'])}"
        )
    mem = [
        f"params {human_bytes(m['params_bytes'])}",
        f"forward peak {human_bytes(m['forward_peak_bytes'])}",
    ]
    if has_b:
        mem += [
            f"saved for backward {human_bytes(m['saved_for_backward_bytes'])}",
            f"train peak {human_bytes(m['train_peak_bytes'])}",
        ]
    if has_j:
        mem.append(f"jvp peak {human_bytes(m['jvp_peak_bytes'])}")
    lines.append("memory: " + ", ".join(mem))
    for line in lines:
        console.print(line)


def write_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file, so a failure leaves no partial file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def to_json(summary: dict[str, Any]) -> str:
    return json.dumps(summary, indent=2)


def layers_csv(summary: dict[str, Any]) -> str:
    import io

    rows = summary["layers"]
    buf = io.StringIO()
    cols = [k for k in rows[0] if k != "output_shape"] + ["output_shape"] if rows else []
    w = csv.DictWriter(buf, fieldnames=cols)
    w.writeheader()
    for r in rows:
        w.writerow({**r, "output_shape": "x".join(map(str, r["output_shape"] or []))})
    return buf.getvalue()
