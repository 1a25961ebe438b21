"""Who reads the flat forward in a default ``analyze``, and what each reader costs per block.

The forward hierarchy is built straight from the trace (``direct_hierarchy.build_direct``) and
the flat forward then made from it (``flat_forward``); issue 33's design step makes the flat
forward on demand, which pays only once no reader on the default path reads it. This tool
measures that path's readers:

* ``sites``: every read of the flat forward's ``graph`` in one default analysis of a 4-block
  GPT-2 (the flat forward's class swapped for one whose ``graph`` property notes its caller),
  printed as ``count  reader <- caller <- caller``;
* ``time`` (default): per reader, its CPU time per block on the flat forward (the calls given
  it or its graph; the calls on other graphs listed apart), inclusive of what it calls (nested
  readers are counted in each), GPT-2 small's width at 1x256 tokens, 12 against 96 blocks,
  ``(t96 - t12) / 84``, medians of ``--repeat`` analyses (each reader wrapped with a
  ``time.process_time`` accumulator: about 1 µs per call added, a few calls per analysis);
  then the gc-tracked objects a flat forward keeps per block (the collector's pass when
  ``analyze`` returns scans each, about 0.4 µs).

Run from a checkout (``nice`` on a shared machine)::

    PYTHONPATH=$PWD:$PWD/tools python tools/flat_readers.py [sites|time] [--repeat 3]
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import importlib
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # graphflop from this checkout

import bench_analysis as B  # noqa: E402
import torch  # noqa: E402

#: the readers of the flat forward on the default path (``sites`` finds them), by stage:
#: (module, function or Class.method)
READERS = [
    # trace: the flat forward made, then checked
    ("graphflop.frontend.direct_hierarchy", "build_direct"),
    ("graphflop.frontend.direct_hierarchy", "flat_forward"),
    ("graphflop.frontend.trace", "_check_matmul_dtypes"),
    ("graphflop.frontend.trace", "_detached_only"),
    ("graphflop.frontend.trace", "_no_grad_only"),
    # the forward's FLOPs
    ("graphflop.passes.flops", "annotate_flops"),
    ("graphflop.passes.infra", "_has_values"),
    ("graphflop.passes.infra", "_has_costs"),
    ("graphflop.ad.jvp", "has_leaves"),
    # JVP
    ("graphflop.ad.jvp", "_differentiated"),
    ("graphflop.ad.jvp", "_needed"),
    ("graphflop.ad.jvp", "hidden_writes"),
    ("graphflop.ad.jvp", "_Linearizer.__init__"),
    ("graphflop.ad.jvp", "_Linearizer.placeholders"),
    ("graphflop.ad.jvp", "_Linearizer.propagate"),
    ("graphflop.ad.blocks", "_call_keys"),
    ("graphflop.ad.blocks", "_checkpointed_sites"),
    ("graphflop.passes.calls", "forward_facts"),
    ("graphflop.passes.calls", "_describer_facts"),
    # VJP
    ("graphflop.ad.vjp", "_check_linearizes"),
    ("graphflop.ad.vjp", "_build_vjp"),
    ("graphflop.passes.flops", "backward_kernel_map"),
    # update, steps
    ("graphflop.passes.step_calls", "_tables"),
    ("graphflop.passes.activity_gradient", "_find_layers"),
    # summary and memory
    ("graphflop.passes.summary", "_ops"),
    ("graphflop.passes.summary", "_saved_by_layer"),
    ("graphflop.passes.eager_attention", "fused_score_products"),
    ("graphflop.passes.eager_memory", "eager_forward"),
    ("graphflop.passes.eager_memory", "_regions"),
    ("graphflop.passes.eager_memory", "embedding_indices"),
    ("graphflop.passes.eager_memory", "plain_ops"),
    ("graphflop.passes.eager_memory", "forward_kernels"),
    ("graphflop.passes.eager_memory", "_replayed_draws"),
    ("graphflop.passes.memory_calls", "forward_runs"),
    ("graphflop.passes.memory_calls", "ComposedSchedule.add_graph"),
    ("graphflop.passes.step_calls", "forget_tables"),
    # the stages around them, for scale
    ("graphflop.frontend.trace", "trace"),
    ("graphflop.passes.summary", "summarize"),
]

SPEC = "models/gpt2.py:gpt2_small"


def _setups(depths: tuple[int, ...]) -> dict:
    return {n: B._setup(SPEC, {"n_layer": n}, [(1, 256)], None) for n in depths}


def sites() -> None:
    """Print every read of the flat forward's ``graph`` in one default analysis."""
    from torch.fx import GraphModule

    import graphflop.frontend.trace as T

    hits: collections.Counter[str] = collections.Counter()

    class Noted(GraphModule):
        @property
        def graph(self):  # type: ignore[override]
            frames = traceback.extract_stack(limit=5)[:-1]
            hits[
                " <- ".join(
                    f"{f.filename.split('graphflop/')[-1]}:{f.name}:{f.lineno}"
                    for f in reversed(frames)
                )
            ] += 1
            return GraphModule.graph.fget(self)

        @graph.setter
        def graph(self, g):
            GraphModule.graph.fset(self, g)

    made = T.flat_forward

    def noted(h):
        out = made(h)
        if out is not None:
            out.__class__ = type("Noted", (Noted,), {})
        return out

    T.flat_forward = noted
    ((loaded, inputs),) = _setups((4,)).values()
    B._graphflop(loaded.model, inputs, True)  # warm
    hits.clear()
    B._graphflop(loaded.model, inputs, True)
    for where, count in sorted(hits.items()):
        print(f"{count:3d}  {where}")
    print(f"{sum(hits.values())} reads, {len(hits)} sites")


#: the flat forward of the analysis running (the last ``flat_forward`` made)
_CURRENT: list = [None]


def _on_forward(args: tuple) -> bool:
    """Whether a reader's call reads the flat forward: it, or its graph, is an argument (or
    the ``forward`` of the method's object)."""
    fwd = _CURRENT[0]
    if fwd is None:
        return False
    graph = fwd.__dict__.get("_graph")
    return any(a is fwd or a is graph for a in args) or (
        bool(args) and getattr(args[0], "forward", None) is fwd
    )


def _wrap(acc: dict, key: str, f):
    made = key == "flat_forward"

    @functools.wraps(f)
    def timed(*a, **k):
        on = made or key in ("build_direct", "trace") or _on_forward(a)
        t = time.process_time()
        try:
            out = f(*a, **k)
            if made:
                _CURRENT[0] = out
            return out
        finally:
            name = key if on else f"{key} (other graphs)"
            acc[name] = acc.get(name, 0.0) + time.process_time() - t

    return timed


def _instrument(acc: dict) -> None:
    import graphflop.passes.infra as infra

    for modname, qual in READERS:
        m = importlib.import_module(modname)
        if "." in qual:
            cls, name = qual.split(".")
            c = getattr(m, cls)
            setattr(c, name, _wrap(acc, qual, getattr(c, name)))
            continue
        f = getattr(m, qual)
        w = _wrap(acc, qual, f)
        for mod in list(sys.modules.values()):
            if getattr(mod, "__name__", "").startswith("graphflop") and vars(mod).get(qual) is f:
                setattr(mod, qual, w)
        for k, v in list(infra._PREDICATES.items()):  # (held in a table, not by name)
            if v is f:
                infra._PREDICATES[k] = w


def times(repeat: int) -> None:
    """Print each reader's CPU ms per block (12 against 96 blocks, medians)."""
    acc: dict[str, float] = {}
    _instrument(acc)
    setups = _setups((12, 96))
    for loaded, inputs in setups.values():
        B._graphflop(loaded.model, inputs, True)  # warm
    got: dict[int, list[dict[str, float]]] = {12: [], 96: []}
    for _ in range(repeat):
        for n, (loaded, inputs) in setups.items():
            acc.clear()
            t = time.process_time()
            B._graphflop(loaded.model, inputs, True)
            got[n].append({**acc, "analyze (all)": time.process_time() - t})
    print(f"{'ms/block':>8s}  reader (inclusive; GPT-2 width, 1x256, 12 vs 96 blocks)")
    keys = [q for _, q in READERS]
    for key in ["analyze (all)", *keys, *(f"{q} (other graphs)" for q in keys)]:
        if all(key not in d for d in got[12] + got[96]):
            continue
        a = statistics.median(d.get(key, 0.0) for d in got[12])
        b = statistics.median(d.get(key, 0.0) for d in got[96])
        print(f"{(b - a) / 84 * 1e3:8.3f}  {key}")
    _kept_objects()


def _kept_objects() -> None:
    """The gc-tracked objects a flat forward keeps, per block (made again from the
    hierarchy's record, 12 against 96 blocks)."""
    import graphflop.frontend.direct_hierarchy as D
    import graphflop.frontend.trace as T
    from graphflop.meta import HIERARCHY

    forget, T.forget = T.forget, lambda h: None  # (the record kept, to make it again)
    try:
        kept = {}
        for n, (loaded, inputs) in _setups((12, 96)).items():
            h = T.trace(loaded.model, inputs).meta[HIERARCHY]
            gc.collect()
            gc.disable()
            before = len(gc.get_objects())
            flat = D._flat_forward(h, D._RECORDS[h.graph])
            kept[n] = (len(gc.get_objects()) - before, len(flat.graph.nodes))
            gc.enable()
            D.forget(h)
    finally:
        T.forget = forget
    objects = (kept[96][0] - kept[12][0]) / 84
    nodes = (kept[96][1] - kept[12][1]) / 84
    print(f"flat forward per block: {nodes:.0f} nodes, {objects:.0f} gc-tracked objects kept")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", nargs="?", default="time", choices=("time", "sites"))
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.what == "sites":
        sites()
    else:
        times(args.repeat)


if __name__ == "__main__":
    main()
