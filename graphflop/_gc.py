"""The cyclic garbage collector paused where it only costs time (docs/analysis_scale.md)."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def paused_gc() -> Iterator[Callable[[], None]]:
    """No cyclic garbage collection inside the block (as it was, after it).

    Used where millions of objects are made and none is garbage yet: the imports of PyTorch and
    graphflop (the collector's passes over them took about 0.3 s of a 2.5 s import on a 2-core
    machine: ``import torch; import graphflop.cli`` 2.31-2.49 s + 0.45-0.54 s with it, 1.93-2.24
    s + 0.32-0.39 s without), and an analysis (its passes over the growing graphs cost about 15%
    of one). Nothing is lost: what became garbage meanwhile is collected by the next pass after
    the block.

    Yields a function for the block to call between its stages: a pass over the objects made
    since the last (the young generation: each object is looked at there once, so the passes
    together cost what the one pass after the block would), which frees what a stage left as
    garbage before the next one grows the process (the 405B Llama configuration's analysis,
    six stages: peak 501 -> 488 MiB, docs/analysis_scale.md); nothing where the collector was
    off before the block (the caller's choice).
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield _young if was else _nothing
    finally:
        if was:
            gc.enable()


def _young() -> None:
    gc.collect(0)


def _nothing() -> None:
    pass
