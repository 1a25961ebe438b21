"""Wall-clock timing of benchmark phases: runs alternate between the phases, so that a busy
machine slows every phase alike, and each phase reports the median and quartiles of its runs.

Used by :mod:`graphflop.runtime.bench`; no timing is asserted anywhere (tests check the
bookkeeping only).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: a phase whose interquartile range exceeds this fraction of its median is reported as noisy
NOISY_SPREAD = 0.20


def threads_problem(threads: int | None) -> str | None:
    """What is wrong with a ``--threads`` count, or None when it is none or 1 to this machine's
    cores. More threads than cores times the operating system's scheduler, not the kernels,
    and OpenMP aborts the process when it cannot create them (``--threads 99999``: exit
    139)."""
    cores = os.cpu_count() or 1
    if threads is None or 1 <= threads <= cores:
        return None
    return f"bad --threads {threads}: give 1 to {cores} (this machine's cores)"


@dataclass
class Timing:
    """Wall-clock statistics of one phase, in seconds (``runs`` timed runs)."""

    median_s: float
    q1_s: float
    q3_s: float
    runs: int
    times: tuple[float, ...] = field(default=(), repr=False)

    @property
    def spread(self) -> float:
        """The interquartile range over the median (0 for a zero median)."""
        return (self.q3_s - self.q1_s) / self.median_s if self.median_s else 0.0

    @property
    def noisy(self) -> bool:
        """The spread exceeds :data:`NOISY_SPREAD`."""
        return self.spread > NOISY_SPREAD

    def to_dict(self) -> dict[str, Any]:
        return {
            "median_s": self.median_s,
            "q1_s": self.q1_s,
            "q3_s": self.q3_s,
            "runs": self.runs,
            "iqr_over_median": self.spread,
            "noisy": self.noisy,
        }


def summarize(times: list[float]) -> Timing:
    """Median and quartiles (``statistics.quantiles``, exclusive method) of ``times``."""
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return Timing(statistics.median(times), q[0], q[2], len(times), tuple(times))


def time_phases(
    fns: Mapping[str, Callable[[int], Any]],
    *,
    warmup: int,
    repeat: int,
    sync: Callable[[], None],
) -> dict[str, Timing]:
    """Time each of ``fns`` (``fn(i)``, ``i`` selecting the input set) ``repeat`` times after
    ``warmup`` untimed rounds, alternating: round ``i`` runs every phase once, in order.

    ``sync`` is called after each run before the clock is read (CUDA synchronisation).
    """
    for i in range(warmup):
        for fn in fns.values():
            fn(i)
    sync()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(repeat):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn(i)
            sync()
            times[k].append(time.perf_counter() - t0)
    return {k: summarize(v) for k, v in times.items()}


def time_fn(
    fn: Callable[[int], Any], *, warmup: int, repeat: int, sync: Callable[[], None]
) -> Timing:
    """Time ``fn(i)`` alone ``repeat`` times after ``warmup`` runs (see :func:`time_phases`)."""
    return time_phases({"fn": fn}, warmup=warmup, repeat=repeat, sync=sync)["fn"]


def round_ratio(num: Timing, den: Timing) -> Timing | None:
    """Statistics of ``num``'s time over ``den``'s, round by round (the phases alternate, so
    round ``i``'s two runs saw the same machine), or None without per-run times."""
    if not num.times or len(num.times) != len(den.times) or not all(den.times):
        return None
    return summarize([a / b for a, b in zip(num.times, den.times)])


def noisy_phases(runtimes: Mapping[str, Mapping[str, Timing]]) -> list[str]:
    """One line per noisy phase (:attr:`Timing.noisy`): runtime, phase, spread and what to do."""
    return [
        f"{rt} {phase}: the quartiles span {t.spread:.0%} of the median "
        f"({t.q1_s * 1e3:.3g}–{t.q3_s * 1e3:.3g} ms around {t.median_s * 1e3:.3g} ms), more "
        f"than {NOISY_SPREAD:.0%}; the machine is busy: rerun on a quiet one or raise --repeat"
        for rt, phases in runtimes.items()
        for phase, t in phases.items()
        if t.noisy
    ]
