"""``analyze`` with the flat derivative graphs against ``record_derivatives=True`` (the JVP and
backward recorded per block variant), alternated in one process, CPU time.

Per model (the specs of ``tools/bench_analysis.py``): the model on the meta device and its
inputs made as there, one warm-up analysis each way (their reports checked equal), then
``--repeat`` rounds alternating the two (order swapped each round), a full garbage collection
before each; medians of the whole analysis and of its stages (the progress messages' spans;
``memory`` is the summary's memory schedules, taken out of ``summary``)::

    python tools/bench_recorded.py gpt2_small_4x512 gpt2_xl_b8 --repeat 3
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # graphflop from this checkout
import bench_analysis as B  # noqa: E402


def _timed(model, inputs, recorded: bool) -> tuple[float, dict[str, float], object]:
    import graphflop.passes.summary as summary
    from graphflop.analysis import analyze

    marks: list[tuple[str, float]] = []
    memory_s = [0.0]
    inner = summary._memory

    def timed_memory(*a, **k):
        t = time.process_time()
        try:
            return inner(*a, **k)
        finally:
            memory_s[0] += time.process_time() - t

    summary._memory = timed_memory
    gc.collect()
    try:
        t0 = time.process_time()
        a = analyze(
            model,
            inputs,
            record_derivatives=recorded,
            progress=lambda m: marks.append((m, time.process_time())),
        )
        t1 = time.process_time()
    finally:
        summary._memory = inner
    stages = {}
    for (msg, t), nxt in zip(marks, marks[1:] + [("", t1)]):
        stages[B.STAGES.get(msg, msg)] = nxt[1] - t
    stages["memory"] = memory_s[0]
    stages["summary"] = stages.get("summary", 0.0) - memory_s[0]
    return t1 - t0, stages, a


def bench(name: str, repeat: int) -> None:
    spec, kwargs, shapes, batch = {**B.ZOO, **B.XL, **B.LLAMA}[name]
    loaded, inputs = B._setup(spec, kwargs, shapes, batch)
    model = loaded.model
    flat, rec = _timed(model, inputs, False)[2], _timed(model, inputs, True)[2]
    assert flat.report == rec.report, name  # type: ignore[attr-defined]
    del flat, rec
    runs: dict[bool, list[float]] = {False: [], True: []}
    stages: dict[bool, dict[str, list[float]]] = {False: {}, True: {}}
    for i in range(repeat):
        for recorded in (False, True) if i % 2 == 0 else (True, False):
            dt, st, _ = _timed(model, inputs, recorded)
            runs[recorded].append(dt)
            for k, v in st.items():
                stages[recorded].setdefault(k, []).append(v)
    for recorded in (False, True):
        rounds = " ".join(f"{x:.3f}" for x in runs[recorded])
        print(
            f"{name} {'recorded' if recorded else 'flat'}: "
            f"{statistics.median(runs[recorded]):.3f} s (rounds {rounds})"
        )
        print(
            "   "
            + " / ".join(f"{k} {statistics.median(v):.3f}" for k, v in stages[recorded].items())
        )
    print(f"   load average {os.getloadavg()[0]:.2f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="+", help="names from tools/bench_analysis.py")
    p.add_argument("--repeat", type=int, default=3, help="rounds (default 3)")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")
    import torch

    torch.set_num_threads(1)  # meta tensors: one thread's CPU time
    for name in args.models:
        bench(name, args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
