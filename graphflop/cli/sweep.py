"""``graphflop sweep``: the backward/forward FLOP ratio across batch sizes or depths."""

from __future__ import annotations

import argparse

from rich.console import Console

from graphflop.analysis import AMP_DTYPES
from graphflop.cli.common import (
    OPTIMIZER_CHOICES,
    add_model_args,
    check_backward_possible,
    check_distinct_outputs,
    check_output_file,
    check_seq_used,
    parse_ctor_kwargs,
    stdout_console,
)

#: the ``--plot`` suffixes (matplotlib's formats the help names)
PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def add_parser(sub) -> argparse.ArgumentParser:
    """Add the ``sweep`` subcommand to ``graphflop``'s subparsers."""
    p = sub.add_parser(
        "sweep",
        help="backward/forward ratio across batch sizes or depths",
        description="The backward/forward FLOP ratio (with and without the update) per batch "
        "size or per depth, as a table, CSV and PNG plot. Each point is traced from the "
        "model file's example_inputs() in train mode with the default loss (use inspect for "
        "--input-shape, --dtype, --eval or --loss).",
    )
    add_model_args(p, inputs_and_loss=False)
    p.add_argument(
        "--batches",
        "--batch-sizes",
        dest="batches",
        metavar="1,2,4,...",
        help="comma-separated batch sizes (each rescales the inputs whose first dimension is "
        "the example's batch, as --batch does)",
    )
    p.add_argument(
        "--depth",
        metavar="0,10,100",
        help="comma-separated depths (for models whose constructor takes one)",
    )
    p.add_argument(
        "--depth-arg",
        metavar="NAME",
        help="the constructor argument that sets the depth (default: found by name)",
    )
    p.add_argument(
        "--optimizer",
        default="sgd",
        choices=OPTIMIZER_CHOICES,
        help="optimizer whose update graph is built (default sgd)",
    )
    p.add_argument(
        "--device",
        action="append",
        default=None,
        metavar="NAME|FILE.json",
        help="also give the ratio in predicted time on this device (repeatable: --device h100 "
        "--device cpu.json); a data-sheet device, cpu or a 'graphflop calibrate' file",
    )
    p.add_argument(
        "--amp",
        choices=AMP_DTYPES,
        help="time each point under autocast to this dtype on every --device (matrix products "
        "and convolutions at that dtype's peak, values at the dtype autocast gives them); the "
        "FLOP ratios do not change, so it needs --device",
    )
    p.add_argument("--csv", metavar="PATH", help="write the table as CSV")
    p.add_argument("--plot", metavar="PATH", help="write a plot (.png, .svg or .pdf)")
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    return p


def int_list(text: str | None, what: str) -> list[int]:
    """``"1,2,4"`` → ``[1, 2, 4]`` (empty for no text).

    Raises:
        SpecError: anything but comma-separated integers (an empty item included), a negative
            value, a zero batch, or a value given twice.
    """
    from graphflop.load import SpecError

    if not text:
        return []
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise SpecError(
            f"bad {what} list {text!r}: write comma-separated integers, e.g. 1,2,4,8"
        ) from None
    if what == "batch" and any(v <= 0 for v in values):
        raise SpecError(f"bad {what} list {text!r}: values must be positive")
    if any(v < 0 for v in values):  # (a depth may be 0: the model without its repeated part)
        raise SpecError(f"bad {what} list {text!r}: values must be 0 or more")
    twice = sorted({v for v in values if values.count(v) > 1})
    if twice:
        raise SpecError(f"bad {what} list {text!r}: {twice[0]} is given twice; give each once")
    return values


def run(args: argparse.Namespace, err: Console) -> int:
    """Sweep, print the table and write ``--csv``, ``--json`` and ``--plot``."""
    from graphflop.load import SpecError
    from graphflop.sweep import sweep

    batches = int_list(args.batches, "batch")
    depths = int_list(args.depth, "depth")
    if not batches and not depths:
        raise SpecError("give --batches 1,2,4,... or --depth 0,10,100")
    if batches and depths:
        raise SpecError(
            "give --batches or --depth, not both (a sweep varies one of them; set the batch of "
            "a depth sweep with --batch)"
        )
    _check(args, batches)
    from graphflop.passes.time_profile import resolve_profile

    profiles = [resolve_profile(d) for d in args.device or ()]
    names = [p.name for p in profiles]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise SpecError(
            f"--device gives {', '.join(twice)} twice (a profile's name, shown in the plot's "
            "legend): give each device once, or name calibrated profiles apart with "
            "graphflop calibrate --name"
        )
    if args.amp and not profiles:
        raise SpecError(
            f"--amp {args.amp} changes the predicted time only (the FLOP ratios do not depend "
            "on it): give --device too"
        )
    _check_differentiable(args)
    with err.status("sweeping", spinner="dots") as status:
        rows = sweep(
            args.spec,
            batches=batches,
            depths=depths,
            depth_name=args.depth_arg,
            optimizer=args.optimizer,
            ctor_kwargs=parse_ctor_kwargs(args.arg),
            batch=args.batch,
            seq=args.seq,
            progress=lambda m: status.update(f"sweeping: {m}"),
            devices=profiles,
            amp=args.amp,
            outline=args.outline,
        )
    _print_table(args, rows, "batch" if batches else "depth")
    _write(args, rows)
    return 0


def _check(args: argparse.Namespace, batches: list[int]) -> None:
    """Reject the model options sweep cannot honour, and bad output paths, before any work."""
    from graphflop.load import SpecError

    if args.batch is not None and batches:
        raise SpecError("--batch and --batches contradict each other: give the sizes in --batches")
    if args.batch is not None and args.batch < 1:
        raise SpecError(f"bad --batch {args.batch}: must be positive")
    check_output_file(args.csv, "--csv")
    check_output_file(args.json, "--json")
    check_output_file(args.plot, "--plot", PLOT_SUFFIXES)
    check_distinct_outputs({"--csv": args.csv, "--json": args.json, "--plot": args.plot}, args.spec)


def _check_differentiable(args: argparse.Namespace) -> None:
    """An integer-only output has no backward, so no backward/forward ratio: exit 2."""
    from graphflop.load import SpecError, load, make_inputs, set_training_mode

    loaded = load(args.spec, ctor_kwargs=parse_ctor_kwargs(args.arg), meta=True, seq=args.seq)
    check_seq_used(args, loaded)
    if loaded.example_inputs is None:  # make_inputs's advice is inspect's --input-shape
        raise SpecError(
            f"{loaded.name}: no example_inputs() in its file, and sweep traces each point "
            "from it: add a function example_inputs() returning the inputs to the file"
        )
    set_training_mode(loaded.model)
    check_backward_possible(args, loaded, make_inputs(loaded), why="sweep")


def _print_table(args: argparse.Namespace, rows: list[dict], kind: str) -> None:
    from rich.table import Table

    from graphflop.export.report import human, human_seconds

    amp = f"; times under autocast {args.amp}" if args.amp else ""
    table = Table(title=f"{args.spec}: backward/forward FLOP ratio ({args.optimizer}{amp})")
    timed = [k.partition("@")[2] for k in rows[0] if k.startswith("time_ratio@")]
    for col in (kind, "forward", "backward", "update", "(bwd+upd)/fwd", "bwd/fwd"):
        table.add_column(col, justify="right")
    for name in timed:
        table.add_column(f"step time {name}", justify="right")
        table.add_column(f"(bwd+upd)/fwd time {name}", justify="right")
    for r in rows:
        table.add_row(
            str(r.get(kind, r.get("depth"))),
            human(r["forward_flops"]),
            human(r["backward_flops"]),
            human(r["update_flops"]),
            f"{r['ratio']:.3f}",
            f"{r['ratio_no_update']:.3f}",
            *(
                cell
                for name in timed
                for cell in (
                    human_seconds(r[f"train_step_s@{name}"]),
                    f"{r[f'time_ratio@{name}']:.3f}",
                )
            ),
        )
    stdout_console().print(table)


def _write(args: argparse.Namespace, rows: list[dict]) -> None:
    import csv
    import io
    import json

    from graphflop.io import atomic_group, atomic_write
    from graphflop.sweep import plot

    with atomic_group():  # all the files or none of them
        if args.plot:
            title = f"{args.spec.split('/')[-1]} ({args.optimizer})"
            atomic_write(args.plot, lambda p: plot(rows, str(p), title=title))
        if args.csv:
            buf = io.StringIO()
            w = csv.DictWriter(buf, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
            atomic_write(args.csv, buf.getvalue())
        if args.json:
            atomic_write(args.json, json.dumps(rows, indent=1))
