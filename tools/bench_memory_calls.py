"""The memory stage of an analysis, flat against composed per call of each repeated block.

For each model named (those of ``tools/bench_analysis.py``), one full ``graphflop.analyze`` on
the meta device, then, alternated in this process after a warm-up round, CPU time
(``time.process_time``) of:

- ``flat``: the memory figures as the summary made them before they were composed: the saved
  storages (their own ``eager_residuals``), the forward peak, the eager train peak and the
  eager JVP peak, every schedule over the flat graphs;
- ``composed``: ``summary._memory`` with ``composed=True`` (what ``analyze`` runs where the
  graphs keep their blocks as calls: :mod:`graphflop.passes.memory_calls`).

Both give the same bytes (checked before timing). A full garbage collection runs before each
timed call (outside the timing), so that one side does not pay for the other's garbage.
Prints the medians and the single rounds. Usage::

    python tools/bench_memory_calls.py gpt2_small_4x512 gpt2_xl_b8 --repeat 5
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_analysis import XL, ZOO, _setup  # noqa: E402  (graphflop from this checkout)

import graphflop  # noqa: E402
from graphflop.meta import SIGNATURE  # noqa: E402
from graphflop.passes import summary  # noqa: E402
from graphflop.passes.eager_memory import (  # noqa: E402
    eager_jvp_schedule,
    eager_saved_storages,
    eager_train_schedule,
)
from graphflop.passes.flops import tensor_bytes  # noqa: E402
from graphflop.passes.memory import forward_schedule  # noqa: E402


def _one(name: str, repeat: int) -> None:
    loaded, inputs = _setup(*{**ZOO, **XL}[name])
    a = graphflop.analyze(loaded.model, inputs)
    g = summary.Graphs(a.forward, a.backward, a.update, a.jvp)
    fwd, bwd, jvp = a.forward, a.backward, a.jvp
    sig = fwd.meta[SIGNATURE]
    phs = {n.name: n for n in fwd.graph.nodes if n.op == "placeholder"}
    params = sum(tensor_bytes(phs[p].meta["val"]) for p, _ in sig.params)
    buffers = sum(tensor_bytes(phs[b].meta["val"]) for b, _ in sig.buffers)
    trainable = sum(tensor_bytes(phs[p].meta["val"]) for p, _ in sig.trainable())

    def flat() -> tuple[int, int, int, int]:
        saved = eager_saved_storages(fwd, bwd, "cpu")
        return (
            sum(saved.values()),
            forward_schedule(fwd).peak()[0],
            eager_train_schedule(fwd, bwd, "sgd", "cpu").peak()[0],
            eager_jvp_schedule(jvp, "cpu").peak()[0],
        )

    def composed() -> tuple:
        return summary._memory(g, params, buffers, "sgd", trainable, "eager", "cpu", False, True)

    ref = flat()
    mem, _ = composed()
    resident = params + buffers
    assert ref[0] == mem.saved_for_backward_bytes
    assert ref[1] + resident == mem.forward_peak_bytes
    assert ref[2] + resident == mem.train_peak_bytes
    times: dict[str, list[float]] = {"flat": [], "composed": []}
    for r in range(repeat + 1):
        for key, fn in (("flat", flat), ("composed", composed)):
            gc.collect()
            t = time.process_time()
            fn()
            dt = time.process_time() - t
            if r:  # round 0: the warm-up
                times[key].append(dt)
    for key, v in times.items():
        rounds = ", ".join(f"{x:.3f}" for x in v)
        print(f"{name}  {key:9s} median {statistics.median(v):.3f} s  [{rounds}]")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="+", help="model names of tools/bench_analysis.py")
    p.add_argument("--repeat", type=int, default=5, help="timed rounds of each (default 5)")
    args = p.parse_args()
    unknown = [m for m in args.models if m not in {**ZOO, **XL}]
    if unknown:
        p.error(f"unknown model {unknown[0]!r}: one of {', '.join({**ZOO, **XL})}")
    for name in args.models:
        _one(name, args.repeat)


if __name__ == "__main__":
    main()
