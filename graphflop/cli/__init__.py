"""``graphflop`` command line: a thin front end over the library (no logic of its own).

One module per subcommand (``inspect``, ``export``, ``bench``, ``render``, ``train``, ``sweep``,
``models``, ``plan``, ``calibrate``, ``devices``),
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
import contextlib
import ctypes
import gc
import importlib
import os
import sys
import threading
from collections.abc import Sequence
from types import ModuleType

from graphflop._gc import paused_gc

with paused_gc():  # rich's and the library's imports (graphflop/_gc.py)
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
COMMANDS = (
    "inspect",
    "export",
    "bench",
    "render",
    "train",
    "sweep",
    "models",
    "plan",
    "calibrate",
    "devices",
)


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
        parser.commands[name] = _command(name).add_parser(sub)
        add_debug_arg(parser.commands[name])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``graphflop`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    args = build_parser().parse_args(argv)
    return run_command(_command(args.command).run, args)


def entry() -> None:
    """The ``graphflop`` console script and ``python -m graphflop``: :func:`main`, then a fast
    exit (and, before it, the objects of the imports frozen out of the garbage collector's
    generations, :func:`gc.freeze`).

    Tearing down an interpreter that has imported PyTorch takes about 0.6 s on a 2-core machine
    (module and C++ static destructors; ``python -c "import torch"`` measured 2.85 s against
    2.2 s with this exit). So this does what Python's own exit does before that
    teardown, in the same order: joins the threads that are not daemons (and runs
    ``threading``'s exit hooks, which stop ``concurrent.futures`` executors), runs the
    ``atexit`` handlers (``weakref.finalize`` callbacks, ``logging.shutdown``,
    multiprocessing's clean-up), flushes Python's standard output and error and the C
    library's buffers, then ends the process with the command's status.

    A write to standard output that fails at that point (a full disk) makes the status 2 with
    one line on standard error, as Python's exit would make it non-zero; a reader that closed
    the pipe early (``| head``) does not. A closed standard stream (``2>&-``) is skipped.
    """
    # the imports' objects (PyTorch's, about a million) live as long as the process: moved out
    # of the collector's generations, no collection scans them again (0.2 s of a small
    # model's command here; graphflop/_gc.py)
    gc.freeze()
    status = main()
    shutdown = getattr(threading, "_shutdown", None)  # CPython's join of non-daemon threads
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    failed = _flush(sys.stdout)
    _flush(sys.stderr)
    if failed and status == 0:
        status = EXIT_USAGE
        if sys.stderr is not None:
            with contextlib.suppress(OSError, ValueError):
                print(f"graphflop: error: cannot write standard output: {failed}", file=sys.stderr)
                sys.stderr.flush()
    with contextlib.suppress(Exception):  # C-level output (printf) still in stdio's buffers
        ctypes.CDLL(None).fflush(None)
    os._exit(status)


def _flush(stream) -> str | None:
    """Flush ``stream`` (None when the process started with it closed); the reason a write
    failed, or None (also for a reader that closed the pipe)."""
    if stream is None:
        return None
    try:
        stream.flush()
    except BrokenPipeError:
        return None
    except (OSError, ValueError) as e:
        return getattr(e, "strerror", None) or str(e)
    return None


if __name__ == "__main__":  # pragma: no cover
    entry()
