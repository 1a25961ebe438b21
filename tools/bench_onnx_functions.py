"""GPT-2 at XL depth exported to ONNX flat and with its blocks folded into local functions:
node counts of forward.onnx and backward.onnx, the exporter's and the fold's CPU time, and
one ONNX Runtime run of the folded backward on random inputs (it loads and runs; the numbers
are checked against the flat export and torch in tests/test_onnx_functions.py).

    python tools/bench_onnx_functions.py            # GPT-2 XL: 48 blocks, width 1600, 25 heads
    python tools/bench_onnx_functions.py --narrow   # 48 blocks of width 64: the same node counts

Prints one JSON object; about 4 minutes of CPU for the exports, and the full-width ORT run
needs about 8 GB of memory for the random parameters.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--narrow", action="store_true", help="width 64, 4 heads, vocabulary 128")
    p.add_argument("--tokens", type=int, default=32, help="sequence length (batch 1)")
    args = p.parse_args(argv)

    import numpy as np
    import onnx
    import onnxruntime as ort

    from graphflop.analysis import analyze
    from graphflop.export.onnx import _fold, export_graph, graph_io_names
    from graphflop.load import load, make_inputs
    from graphflop.runtime.graphs import step_graphs

    kw: dict = dict(n_layer=48, n_embd=1600, n_head=25)
    if args.narrow:
        kw = dict(n_layer=48, n_embd=64, n_head=4, vocab_size=128, n_positions=64)
    loaded = load(str(ROOT / "models" / "gpt2.py"), ctor_kwargs=kw, meta=True)
    t0 = time.process_time()
    a = analyze(loaded.model, make_inputs(loaded, shapes=[(1, args.tokens)]))
    res: dict = {"config": kw, "tokens": args.tokens, "analysis_cpu_s": time.process_time() - t0}
    graphs = step_graphs(a, kinds=("forward", "backward"))
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("forward", "backward"):
            gm = graphs[kind]
            t0 = time.process_time()
            ex = export_graph(gm, kind, *graph_io_names(kind, gm))
            t_export = time.process_time() - t0
            flat = len(ex.model.graph.node)
            t0 = time.process_time()
            report = _fold(ex, gm, graphs["forward"])
            t_fold = time.process_time() - t0
            top, bodies = len(ex.model.graph.node), [len(f.node) for f in ex.model.functions]
            res[kind] = {
                "flat_nodes": flat,
                "graph_nodes": top,
                "function_nodes": bodies,
                "calls": {k: len(v["calls"]) for k, v in report["functions"].items()},
                "inline": report["inline"],
                "ratio": (top + sum(bodies)) / flat,
                "export_cpu_s": t_export,
                "fold_cpu_s": t_fold,
            }
            print(kind, json.dumps(res[kind]), file=sys.stderr, flush=True)
            onnx.save(ex.model, f"{tmp}/{kind}.onnx")
        sess = ort.InferenceSession(f"{tmp}/backward.onnx", providers=["CPUExecutionProvider"])
        rng = np.random.default_rng(0)
        feeds = {}
        for i in sess.get_inputs():
            shape = [d if isinstance(d, int) else 1 for d in i.shape]
            if "int64" in i.type:
                feeds[i.name] = rng.integers(0, 2, size=shape).astype(np.int64)
            elif "bool" in i.type:
                feeds[i.name] = np.ones(shape, bool)
            else:
                feeds[i.name] = np.asarray(rng.standard_normal(shape) * 0.02, dtype=np.float32)
        t0 = time.perf_counter()
        out = sess.run(None, feeds)
        res["ort_backward"] = {"outputs": len(out), "wall_s": time.perf_counter() - t0}
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
