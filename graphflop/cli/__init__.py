"""``graphflop`` command line: a thin front end over the library (no logic of its own).

One module per subcommand (``inspect``, ``export``, ``bench``, ``render``, ``train``, ``sweep``),
each with ``add_parser(subparsers)`` and ``run(args, err) -> exit status``; what they share is in
:mod:`graphflop.cli.common`. Errors the user can fix (bad spec, bad shape, untraceable model, op
without a rule, an output path that cannot be written) print one line to stderr and exit with
status 2, leaving no partial output file; an unexpected error (a bug) prints one line and exits
with status 1 (``--debug``, on every subcommand, adds the traceback). A malformed command line is
one line too (:class:`graphflop.cli.common.OneLineParser`, status 2), not argparse's usage.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import os
import sys
from collections.abc import Sequence
from types import ModuleType

from graphflop.cli.common import (
    EXIT_USAGE,
    EXIT_VERIFY_FAILED,
    OneLineParser,
    add_debug_arg,
    run_command,
)

__all__ = ["COMMANDS", "EXIT_USAGE", "EXIT_VERIFY_FAILED", "build_parser", "entry", "main"]

#: the subcommands (each the module ``graphflop.cli.<name>``), in the order ``--help`` lists
#: them; imported when the parser is built, so ``python -m graphflop.cli.train`` runs cleanly
COMMANDS = ("inspect", "export", "bench", "render", "train", "sweep")


def _command(name: str) -> ModuleType:
    return importlib.import_module(f"graphflop.cli.{name}")


def build_parser() -> argparse.ArgumentParser:
    """The ``graphflop`` argument parser with every subcommand."""
    parser = OneLineParser(
        prog="graphflop",
        description="Trace a PyTorch model into a core-ATen graph, build its backward and JVP "
        "graphs from one table of per-op rules, and report FLOPs and memory per "
        "node, per layer and in total.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        add_debug_arg(_command(name).add_parser(sub))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``graphflop`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    args = build_parser().parse_args(argv)
    return run_command(_command(args.command).run, args)


def entry() -> None:
    """The ``graphflop`` console script and ``python -m graphflop``: :func:`main`, then a fast
    exit.

    Tearing down an interpreter that has imported PyTorch takes about 0.6 s on a 2-core machine
    (module and C++ static destructors; issue 19 measured ``python -c "import torch"`` at
    2.85 s against 2.2 s with this exit). The command's work is done and its files are closed by
    then, so this flushes standard output and error, runs the ``atexit`` handlers (which include
    ``weakref.finalize`` callbacks, ``logging.shutdown`` and multiprocessing's clean-up), and
    ends the process with the command's status without the teardown. A closed pipe on standard
    output (``graphflop inspect m.py | head``) is not an error of the command.
    """
    status = main()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing left to deliver
            pass
    atexit._run_exitfuncs()
    os._exit(status)


if __name__ == "__main__":  # pragma: no cover
    entry()
