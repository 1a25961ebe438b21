"""Timing forward, backprop train step and forward-gradient step, on ONNX Runtime (graphflop's
exported graphs) and in eager PyTorch (autograd and ``torch.func.jvp``, as a user writes them).

Method: for each phase, ``warmup`` untimed runs, then ``repeat`` timed runs cycling through
``rotate`` different input sets (so caches don't flatter); the median and the spread
(interquartile range) of wall time are reported. CUDA work is synchronised before each clock
read. ``Rf`` = forward-gradient step / forward, ``Rb`` = train step / forward (seed B's
definitions); achieved FLOP/s use graphflop's own FLOP counts of the same phase.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from graphflop.meta import LOSS_KIND, SIGNATURE, UPDATE

PHASES = ("forward", "train_step", "forward_gradient_step")


@dataclass
class Timing:
    """Wall-clock statistics of one phase, in seconds."""

    median_s: float
    q1_s: float
    q3_s: float
    runs: int

    def to_dict(self) -> dict[str, float]:
        return {"median_s": self.median_s, "q1_s": self.q1_s, "q3_s": self.q3_s, "runs": self.runs}


def time_fn(
    fn: Callable[[int], Any], *, warmup: int, repeat: int, sync: Callable[[], None]
) -> Timing:
    """Time ``fn(i)`` (``i`` selects the input set) ``repeat`` times after ``warmup`` runs."""
    for i in range(warmup):
        fn(i)
    sync()
    times = []
    for i in range(repeat):
        t0 = time.perf_counter()
        fn(i)
        sync()
        times.append(time.perf_counter() - t0)
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return Timing(statistics.median(times), q[0], q[2], len(times))


def _loss(kind: str, out: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
    if kind == "cross_entropy":
        return F.cross_entropy(out, target)
    if kind == "mse":
        return F.mse_loss(out, target)
    return out.sum()


def _input_sets(forward, model, rotate: int, device) -> list[dict[str, torch.Tensor]]:
    from graphflop.runtime.verify import real_arguments

    sets = []
    for k in range(rotate):
        v = real_arguments(forward, model, seed=k)
        sets.append({n: t.to(device) for n, t in v.items()})
    return sets


def bench_torch(
    analysis,
    model: torch.nn.Module,
    *,
    device: str,
    warmup: int,
    repeat: int,
    rotate: int,
    lr: float = 1e-3,
    optimizer: str = "sgd",
) -> dict[str, Timing]:
    """Eager PyTorch: ``model(x)`` under no_grad; loss.backward() + ``torch.optim`` step;
    ``torch.func.jvp`` with a Gaussian direction, ``g = d·v`` and an SGD update."""
    fwd = analysis.forward
    sig = fwd.meta[SIGNATURE]
    kind = fwd.meta.get(LOSS_KIND, "sum")
    model = model.to(device)
    sets = _input_sets(fwd, model, rotate, device)
    xs = [[s[n] for n in sig.inputs] for s in sets]
    ts = [s[sig.targets[0]] if sig.targets else None for s in sets]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    opt = {
        "sgd": lambda p: torch.optim.SGD(p, lr=lr),
        "momentum": lambda p: torch.optim.SGD(p, lr=lr, momentum=0.9),
        "adam": lambda p: torch.optim.Adam(p, lr=lr),
        "adamw": lambda p: torch.optim.AdamW(p, lr=lr),
    }[optimizer](model.parameters())

    def forward(i):
        with torch.no_grad():
            model(*xs[i % rotate])

    def train_step(i):
        opt.zero_grad(set_to_none=True)
        _loss(kind, model(*xs[i % rotate]), ts[i % rotate]).backward()
        opt.step()

    params = {k: p.detach() for k, p in model.named_parameters()}
    buffers = dict(model.named_buffers())

    def fg_step(i):
        x, t = xs[i % rotate], ts[i % rotate]

        def f(p):
            return _loss(kind, torch.func.functional_call(model, (p, buffers), tuple(x)), t)

        v = {k: torch.randn_like(p) for k, p in params.items()}
        _, d = torch.func.jvp(f, (params,), (v,))
        with torch.no_grad():
            for k, p in params.items():
                p.sub_(lr * d * v[k])

    return {
        "forward": time_fn(forward, warmup=warmup, repeat=repeat, sync=sync),
        "train_step": time_fn(train_step, warmup=warmup, repeat=repeat, sync=sync),
        "forward_gradient_step": time_fn(fg_step, warmup=warmup, repeat=repeat, sync=sync),
    }


def bench_onnxruntime(
    analysis,
    model: torch.nn.Module,
    *,
    provider: str,
    warmup: int,
    repeat: int,
    rotate: int,
    lr: float = 1e-3,
    profile: bool = False,
    export_dir: str | Path | None = None,
) -> tuple[dict[str, Timing], dict]:
    """graphflop's exported forward, train-step and forward-gradient-step graphs on ONNX
    Runtime. Returns the timings and, with ``profile``, per-node times mapped through the
    manifest."""
    from graphflop.export.onnx import export_all
    from graphflop.runtime.onnxrt import session

    fwd = analysis.forward
    sig = fwd.meta[SIGNATURE]
    tmp = None
    if export_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="graphflop-bench-")
        export_dir = tmp.name
    manifest = export_all(analysis, Path(export_dir) / "onnx")
    root = Path(export_dir) / "onnx"
    sets = _input_sets(fwd, model, rotate, "cpu")
    qual = dict(sig.params)
    upd = analysis.update.meta[UPDATE] if analysis.update is not None else None
    state_labels = set(upd.state_labels) if upd else set()

    def feeds_for(kind: str, i: int) -> dict[str, Any]:
        s = sets[i % rotate]
        by_label = {qual.get(n, n): v for n, v in s.items()}
        for j, n in enumerate(sig.inputs):
            by_label[f"input_{j}"] = s[n]
        for j, n in enumerate(sig.targets):
            by_label["target" if len(sig.targets) == 1 else f"target_{j}"] = s[n]
        out = {}
        for name in manifest["graphs"][kind]["inputs"]:
            if name in by_label:
                out[name] = by_label[name]
            elif name == "lr":
                out[name] = torch.tensor(lr)
            elif name == "step":
                out[name] = torch.tensor(1.0)
            elif name in state_labels:
                out[name] = torch.zeros_like(by_label[name.split(".", 1)[1]])
            elif name.startswith("direction."):
                out[name] = torch.randn_like(by_label[name.split(".", 1)[1]])
            else:
                for b_name, q in sig.buffers:
                    if name == q:
                        out[name] = s[b_name]
        return {k: v.numpy() for k, v in out.items()}

    timings, prof = {}, {}
    for kind in PHASES:
        if kind not in manifest["graphs"]:
            continue
        sess = session(root / f"{kind}.onnx", provider, profile=profile)
        feeds = [feeds_for(kind, i) for i in range(rotate)]
        timings[kind] = time_fn(
            lambda i, s=sess, f=feeds: s.run(None, f[i % rotate]),
            warmup=warmup,
            repeat=repeat,
            sync=lambda: None,
        )
        if profile:
            prof[kind] = _node_times(
                sess.end_profiling(), manifest["graphs"][kind]["nodes"], repeat + warmup
            )
        del sess
    if tmp is not None:
        tmp.cleanup()
    return timings, prof


def _node_times(trace_file: str, nodes: list[dict], runs: int) -> dict[str, Any]:
    """Per-node and per-module kernel time from an ONNX Runtime profile (mean per run, s)."""
    events = json.loads(Path(trace_file).read_text())
    Path(trace_file).unlink(missing_ok=True)
    by_node = {n["onnx_node"]: n for n in nodes}
    node_s: dict[str, float] = {}
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        name = e["name"][: -len("_kernel_time")]
        if name.startswith("fused "):  # "fused node_addmm/GemmTransposeFusion/": first node
            name = name[len("fused ") :].split("/", 1)[0]
        name = name.split("/", 1)[0]
        node_s[name] = node_s.get(name, 0.0) + e.get("dur", 0) * 1e-6 / runs
    top = sorted(node_s.items(), key=lambda kv: -kv[1])[:15]
    modules: dict[str, float] = {}
    for name, s in node_s.items():
        m = (by_node.get(name) or {}).get("module") or "(model)"
        modules[m] = modules.get(m, 0.0) + s
    return {
        "top_nodes": [
            {
                "onnx_node": n,
                "seconds": s,
                **{
                    k: (by_node.get(n) or {}).get(k)
                    for k in ("op_type", "graphflop_node", "module", "role", "flops", "bytes")
                },
            }
            for n, s in top
        ],
        "modules": dict(sorted(modules.items(), key=lambda kv: -kv[1])),
    }


def ratios(t: dict[str, Timing]) -> dict[str, float | None]:
    """Rf, Rb and Rf/Rb from phase timings."""
    f = t.get("forward")
    if f is None or not f.median_s:
        return {"Rf": None, "Rb": None, "Rf_over_Rb": None}
    rf = t["forward_gradient_step"].median_s / f.median_s if "forward_gradient_step" in t else None
    rb = t["train_step"].median_s / f.median_s if "train_step" in t else None
    return {"Rf": rf, "Rb": rb, "Rf_over_Rb": rf / rb if rf and rb else None}
