"""The cyclic garbage collector paused where it only costs time (docs/analysis_scale.md)."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """No cyclic garbage collection inside the block (as it was, after it).

    Used where millions of objects are made and none is garbage yet: the imports of PyTorch and
    graphflop (the collector's passes over them took about 0.3 s of a 2.5 s import on a 2-core
    machine: ``import torch; import graphflop.cli`` 2.31-2.49 s + 0.45-0.54 s with it, 1.93-2.24
    s + 0.32-0.39 s without), and an analysis (its passes over the growing graphs cost about 15%
    of one). Nothing is lost: what became garbage meanwhile is collected by the next pass after
    the block.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
