"""Analysis time and peak memory: graphflop against FlopCounterMode under FakeTensorMode.

Both run on the same model spec, each in its own child process (so that each peak RSS is its
own), one after the other in one invocation:

* graphflop: load the model on the meta device, then ``analyze`` (trace; backward, update, JVP
  and forward-gradient graphs; FLOPs and memory annotations; summary), timed per stage;
* FlopCounterMode: build the model under ``FakeTensorMode`` (no memory), run forward, the loss
  graphflop uses, and ``backward()`` under ``FlopCounterMode``, timed.

Writes a Markdown report (default ``docs/analysis_scale.md``) with the figures, the machine and
the software versions, and prints the same table.

    python tools/bench_analysis.py models/gpt2.py:gpt2_xl --batch 8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def child_graphflop(spec: str, batch: int | None) -> dict:
    """Load on the meta device and analyse; returns seconds per stage, totals and peak RSS."""
    t0 = time.perf_counter()
    import torch  # noqa: F401  (import time is reported separately)

    from graphflop.analysis import analyze
    from graphflop.load import load, make_inputs

    t_import = time.perf_counter() - t0
    t1 = time.perf_counter()
    loaded = load(spec, meta=True)
    loaded.model.train()
    inputs = make_inputs(loaded, batch=batch)
    t_load = time.perf_counter() - t1
    marks: list[tuple[str, float]] = []
    t2 = time.perf_counter()
    a = analyze(
        loaded.model,
        inputs,
        name=loaded.name,
        progress=lambda msg: marks.append((msg, time.perf_counter())),
    )
    t_end = time.perf_counter()
    stages = {}
    for (msg, t), nxt in zip(marks, marks[1:] + [("", t_end)]):
        stages[msg] = nxt[1] - t
    r = a.report
    t = r.totals
    return {
        "import_s": t_import,
        "load_s": t_load,
        "analysis_s": t_end - t2,
        "stages_s": stages,
        "peak_rss_mb": _peak_rss_mb(),
        "params": r.params,
        "inputs": [i.to_dict() for i in r.inputs],
        "loss": r.loss,
        "nodes": {
            "forward": len(a.forward.graph.nodes),
            "backward": len(a.backward.graph.nodes),
            "jvp": len(a.jvp.graph.nodes),
        },
        "flops": {
            "forward": t.forward.flops,
            "backward": t.backward.flops,
            "update": t.update.flops,
            "jvp": t.jvp.flops,
        },
        "mm_flops": {
            "forward": t.forward.mm_flops,
            "backward": t.backward.mm_flops,
            "jvp": t.jvp.mm_flops,
        },
    }


def child_flop_counter(spec: str, batch: int | None) -> dict:
    """FlopCounterMode over forward + loss + backward of the model built under FakeTensorMode."""
    t0 = time.perf_counter()
    import torch
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    from graphflop.frontend.trace import default_loss
    from graphflop.load import load

    t_import = time.perf_counter() - t0
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    t1 = time.perf_counter()
    with mode:
        loaded = load(spec)  # parameters are FakeTensors: no memory
        model = loaded.model.train()
        inputs = []
        for x in loaded.example_inputs:
            shape = ((batch,) + tuple(x.shape[1:])) if batch else tuple(x.shape)
            inputs.append(
                torch.empty(shape, dtype=x.dtype)
                if x.is_floating_point()
                else torch.zeros(shape, dtype=x.dtype)
            )
    t_build = time.perf_counter() - t1
    with mode, FlopCounterMode(display=False) as counter:
        t2 = time.perf_counter()
        out = model(*inputs)
        kind = default_loss(out)
        first = out if isinstance(out, torch.Tensor) else out[0]
        if kind == "cross_entropy":
            loss = F.cross_entropy(first, torch.zeros(first.shape[0], dtype=torch.long))
        else:
            loss = first.sum()
        t3 = time.perf_counter()
        loss.backward()
        t4 = time.perf_counter()
    return {
        "import_s": t_import,
        "build_s": t_build,
        "forward_s": t3 - t2,
        "backward_s": t4 - t3,
        "forward_backward_s": t4 - t2,
        "total_flops": counter.get_total_flops(),
        "peak_rss_mb": _peak_rss_mb(),
        "loss": kind,
    }


def _run_child(kind: str, spec: str, batch: int | None) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, spec]
    if batch:
        cmd += ["--batch", str(batch)]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{kind} run failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _runs(r: dict) -> str:
    return ", ".join(f"{t:.2f}" for t in r["runs_s"])


def _versions() -> dict:
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
    }


def _agreement(ours: int, theirs: int) -> str:
    if ours == theirs:
        return (
            "FlopCounterMode counts matrix products only; its total equals graphflop's "
            "forward + backward matrix FLOPs for this model."
        )
    return (
        f"FlopCounterMode counts matrix products only; its total differs from graphflop's "
        f"forward + backward matrix FLOPs by {theirs - ours:+,} (it has no formula for "
        "some kernels, e.g. scaled dot-product attention's fused CPU and fake-tensor "
        "kernels, and drops grouped convolutions' 1/G in weight gradients)."
    )


def _median(runs: list[dict], key: str) -> dict:
    """The run whose ``key`` is the median (the lower middle one for an even count)."""
    return dict(sorted(runs, key=lambda r: r[key])[(len(runs) - 1) // 2])


def report(spec: str, batch: int | None, gf: dict, fc: dict) -> str:
    ratio = gf["analysis_s"] / fc["forward_backward_s"]
    ratio_all = (gf["load_s"] + gf["analysis_s"]) / (fc["build_s"] + fc["forward_backward_s"])
    v = _versions()
    shape = ", ".join(f"{i['name']} {tuple(i['shape'])} {i['dtype']}" for i in gf["inputs"])
    lines = [
        "# Analysis time and memory at scale",
        "",
        f"Written by `tools/bench_analysis.py {spec}{f' --batch {batch}' if batch else ''}`: "
        "graphflop's analysis against PyTorch's `FlopCounterMode` run under `FakeTensorMode` "
        "(forward, loss and backward), each in its own process, alternately, "
        f"{len(gf['runs_s'])} times each; the figures are the median runs'. Neither allocates "
        "parameter or activation memory.",
        "",
        f"- model: `{spec}`, {gf['params']:,} parameters; inputs {shape}; loss {gf['loss']}",
        f"- machine: {v['machine']}; Python {v['python']}, torch {v['torch']}",
        f"- graph sizes (nodes): forward {gf['nodes']['forward']:,}, backward "
        f"{gf['nodes']['backward']:,}, JVP {gf['nodes']['jvp']:,}",
        "",
        "| | graphflop | FlopCounterMode + FakeTensorMode |",
        "|---|---:|---:|",
        f"| model construction (meta / fake) | {gf['load_s']:.2f} s | {fc['build_s']:.2f} s |",
        f"| analysis (graphflop: every graph; FlopCounterMode: forward + backward) | "
        f"{gf['analysis_s']:.2f} s | {fc['forward_backward_s']:.2f} s |",
        f"| peak RSS of the process | {gf['peak_rss_mb']:.0f} MB | {fc['peak_rss_mb']:.0f} MB |",
        f"| analysis, every run (s) | {_runs(gf)} | {_runs(fc)} |",
        f"| time ratio, analysis only | {ratio:.1f}x | 1x |",
        f"| time ratio, slowest graphflop run over fastest FlopCounterMode run | "
        f"{max(gf['runs_s']) / min(fc['runs_s']):.1f}x | |",
        f"| time ratio, with model construction | {ratio_all:.1f}x | 1x |",
        "",
        "graphflop traces in one `make_fx` pass with the decompositions applied as it goes, "
        "traces each set of identical repeated modules (the transformer blocks) once and copies "
        "the graph (`graphflop/frontend/outline.py`), builds the JVP graph once for the JVP report, the "
        "backward (its transpose) and the forward-gradient step, and reuses the fake-tensor "
        "shapes of repeated calls while building.",
        "",
        "graphflop's analysis by stage:",
        "",
        "| stage | seconds |",
        "|---|---:|",
    ]
    lines += [f"| {k} | {s:.2f} |" for k, s in gf["stages_s"].items()]
    lines += [
        "",
        "What each counts (FLOPs, 2 per multiply-add):",
        "",
        "| | graphflop | FlopCounterMode |",
        "|---|---:|---:|",
        f"| forward (all ops) | {gf['flops']['forward']:,} | |",
        f"| forward, matrix ops | {gf['mm_flops']['forward']:,} | |",
        f"| backward (all ops) | {gf['flops']['backward']:,} | |",
        f"| backward, matrix ops | {gf['mm_flops']['backward']:,} | |",
        f"| forward + backward, matrix ops | "
        f"{gf['mm_flops']['forward'] + gf['mm_flops']['backward']:,} | "
        f"{fc['total_flops']:,} |",
        f"| optimizer update (SGD) | {gf['flops']['update']:,} | |",
        f"| JVP tangent (all ops) | {gf['flops']['jvp']:,} | |",
        "",
        _agreement(gf["mm_flops"]["forward"] + gf["mm_flops"]["backward"], fc["total_flops"]),
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("spec", nargs="?", default="models/gpt2.py:gpt2_xl")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--out", default=str(ROOT / "docs" / "analysis_scale.md"))
    p.add_argument("--json", default=None, help="also write the raw figures as JSON")
    p.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="runs of each, alternating; the report gives the medians (default 3)",
    )
    p.add_argument("--child", choices=["graphflop", "flop_counter"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        import warnings

        warnings.simplefilter("ignore")
        fn = child_graphflop if args.child == "graphflop" else child_flop_counter
        print(json.dumps(fn(args.spec, args.batch)))
        return 0
    fcs, gfs = [], []
    for i in range(args.repeat):  # alternate, so that machine noise hits both alike
        print(f"run {i + 1}/{args.repeat}", file=sys.stderr, flush=True)
        fcs.append(_run_child("flop_counter", args.spec, args.batch))
        gfs.append(_run_child("graphflop", args.spec, args.batch))
    fc = _median(fcs, "forward_backward_s")
    gf = _median(gfs, "analysis_s")
    gf["runs_s"] = sorted(g["analysis_s"] for g in gfs)
    fc["runs_s"] = sorted(f["forward_backward_s"] for f in fcs)
    text = report(args.spec, args.batch, gf, fc)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"graphflop": gf, "flop_counter": fc}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
