"""ONNX Runtime peaks for seed B's models (logreg, MLP, CNN): measured against graphflop's
figure for the order ONNX Runtime ran, for its own (exported) order, and for its graph memory
model of the analysis's graphs (docs/memory_ort.md).

Usage: python tools/bench_ort_memory.py [--batch 64] [--models logreg mlp cnn]
Prints a Markdown table; every figure is bytes above the feeds and initializers
(:mod:`graphflop.runtime.ort_memory`). The graph-model column is graphflop's
``--memory-model graph`` schedule of the analysis's forward, forward+backward+update and JVP
graphs without the always-live parameters, gradients, optimizer state and tangents
(its inputs and targets counted, unlike ONNX Runtime's feeds).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import onnx

from graphflop.analysis import analyze
from graphflop.export.onnx import export_all
from graphflop.load import load, make_inputs
from graphflop.passes.memory import forward_schedule, jvp_schedule, train_schedule
from graphflop.runtime.bench import PHASES, _step_feeds
from graphflop.runtime.graphs import step_graphs
from graphflop.runtime.onnxrt import as_declared, session
from graphflop.runtime.ort_memory import measure

ROOT = Path(__file__).resolve().parents[1]


def rows(name: str, batch: int) -> list[str]:
    real = load(str(ROOT / "models" / f"{name}.py"))
    a = analyze(real.model, make_inputs(real, batch=batch), memory_model="graph")
    graph_model = {
        "forward": forward_schedule(a.forward).peak()[0],
        "train_step": train_schedule(a.forward, a.backward, a.update).peak()[0],
        "forward_gradient_step": jvp_schedule(a.jvp).peak()[0],
    }
    graphs = step_graphs(a, kinds=PHASES, sampling=True, wgrad_mm=True)
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        manifest = export_all(graphs, tmp, name=name)
        feeds = _step_feeds(graphs, a, real.model, 1, 1e-3)
        for kind in PHASES:
            g = manifest["graphs"][kind]
            m = onnx.load(str(Path(tmp) / g["file"]))
            sess = session(m, "CPUExecutionProvider")
            f = as_declared(sess, {n: x.numpy() for n, x in zip(g["inputs"], feeds[kind][0])})
            p = measure(m, f)
            meas = p.peak_bytes or 0
            gm = graph_model[kind]
            out.append(
                f"| {name} | {kind} | {meas:,} | {p.arena_peak_bytes:,} | "
                f"{p.predicted_peak_bytes:,} | {p.predicted_peak_bytes / meas:.3f} | "
                f"{p.own_order_peak_bytes:,} | {meas / p.own_order_peak_bytes:.2f} | "
                f"{gm:,} | {meas / gm:.2f} | {p.nodes_run} |"
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--models", nargs="+", default=["logreg", "mlp", "cnn"])
    args = ap.parse_args()
    print(
        "| model | phase | ORT measured | ORT arena chunks | predicted, ORT order | "
        "predicted / measured | exported, own order | measured / own order | "
        "graph model | measured / graph model | kernels |"
    )
    print("|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for name in args.models:
        for r in rows(name, args.batch):
            print(r, flush=True)


if __name__ == "__main__":
    main()
