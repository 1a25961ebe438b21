"""Predicted against measured step time: graphflop's time pass (:mod:`graphflop.passes.step_time`)
checked against eager PyTorch under ``torch.profiler`` on this machine, per op, per phase and per
train step, before calibration (the data-sheet-like CPU guess, ``--device cpu``) and after
(``graphflop calibrate``'s measured profile).

Usage (one command; about 10 minutes on a quiet 2-core CPU):

    python tools/bench_time.py --calibrate --repeat 5            # calibrate, measure, write
    python tools/bench_time.py --profile cpu.json --repeat 5     # an existing profile
    python tools/bench_time.py --device cuda --calibrate         # the same on a GPU

Writes the results between the ``bench_time`` markers of ``docs/time.md`` (``--doc``; the rest
of the file is kept) and every figure as JSON (``--json``).

Method. Each model runs one train step at a time in eager PyTorch (forward with the loss,
``loss.backward()``, ``torch.optim.SGD.step`` + ``zero_grad``), with ``torch.set_num_threads``
set to ``--threads`` for calibration and measurement alike. Phase times are wall-clock medians
of ``--repeat`` unprofiled steps after two warm-up steps (spread: the interquartile range over
the median). Per-op times come from ``--repeat`` more steps, each under its own
``torch.profiler`` (CPU activity; on CUDA, CUDA activity too): an eager op event whose name is
a kernel graphflop predicts for that phase (``aten::addmm`` for ``aten.addmm.default``; in the
backward also ``X_backward``, ``X_backward_data``) counts with its whole time, children
included, less the profiler's own cost in it (measured first: once per event and once per
event recorded under it; ``--raw-profiler-times`` keeps the raw figure), and events under it
are not counted again; wrapper events (``aten::linear``,
autograd nodes) are looked through. The optimizer's update is measured whole: the update
phase's event (``step()`` and ``zero_grad()``, the Python around the per-parameter loop
included), as the time pass predicts the step. The per-op error of one (model, batch, phase, op) is
``|predicted − measured| / measured`` on the sums over the phase; ``FLOP-weighted`` weighs it
by the op's FLOPs.

On CUDA an op is measured by its kernels' device time (events on the autograd engine's own
thread, which runs the backward there, join the phase whose range holds their start) and
compared with its predicted work (its time less the host's overhead; an op with no work, a
view, runs no kernel and is compared by its host time); the update, whole, by
the host's time over its range; phases and steps by the wall clock, as on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from graphflop.analysis import analyze  # noqa: E402
from graphflop.frontend.loss import loss_output, loss_value  # noqa: E402
from graphflop.io import atomic_write  # noqa: E402
from graphflop.load import load  # noqa: E402
from graphflop.meta import LOSS_KIND, SIGNATURE  # noqa: E402
from graphflop.passes.step_time import UPDATE_KERNEL, time_report  # noqa: E402
from graphflop.passes.summary import Graphs  # noqa: E402
from graphflop.passes.time_profile import (  # noqa: E402
    TimeProfile,
    default_cpu_profile,
    from_device,
    load_profile,
    save_profile,
)
from graphflop.runtime.optim import torch_optimizer  # noqa: E402
from graphflop.runtime.verify import real_arguments  # noqa: E402

#: (label, spec, the first input's shape at each of the two batch sizes)
CASES = (
    ("MLP", "models/mlp.py", ((64, 1, 28, 28), (256, 1, 28, 28))),
    ("CNN", "models/cnn.py", ((64, 1, 28, 28), (256, 1, 28, 28))),
    ("ResNet-18", "models/resnet.py:resnet18", ((8, 3, 224, 224), (16, 3, 224, 224))),
    ("GPT-2 small", "models/gpt2.py:gpt2_small", ((1, 128), (2, 128))),
)
PHASES = ("forward", "backward", "update")
#: a phase's kernel map entry whose op is measured as the whole phase (the update: torch.optim's
#: step() and zero_grad(), the Python around its per-parameter loop included, as the time pass
#: predicts it)
WHOLE_PHASE = "*"
MARK_BEGIN = "<!-- bench_time:begin -->"
MARK_END = "<!-- bench_time:end -->"

#: graphflop kernel base name -> the eager op names that run it, beyond its own (forward)
FORWARD_ALIASES = {
    "_native_batch_norm_legit_functional": ("native_batch_norm",),
    "_native_batch_norm_legit": ("native_batch_norm",),
    "_native_batch_norm_legit_no_training": ("native_batch_norm",),
    "native_dropout": ("dropout", "native_dropout"),
    "nll_loss_forward": ("nll_loss_forward",),
}
#: graphflop kernel base name -> eager backward op names, beyond X_backward and X_backward_data
BACKWARD_ALIASES = {
    "_native_batch_norm_legit_functional": ("native_batch_norm_backward",),
    "_native_batch_norm_legit": ("native_batch_norm_backward",),
    "nll_loss_forward": ("nll_loss_backward",),
    "native_dropout": ("native_dropout_backward",),
    "max_pool2d_with_indices": ("max_pool2d_with_indices_backward",),
    "relu": ("threshold_backward",),
}


def base(op: str) -> str:
    """``aten.addmm.default`` -> ``addmm``."""
    parts = op.split(".")
    return parts[1] if len(parts) >= 2 else op


def eager_names(kernel_op: str, phase: str) -> tuple[str, ...]:
    """The eager profiler names (``aten::X``) that run graphflop kernel ``kernel_op``."""
    b = base(kernel_op)
    # and its in-place form (nn.ReLU(inplace=True)'s relu_, batch norm's num_batches_tracked
    # add_), which the trace makes functional
    names = [b, f"{b}_", *FORWARD_ALIASES.get(b, ())]
    if phase == "backward":
        names += [f"{b}_backward", f"{b}_backward_data", *BACKWARD_ALIASES.get(b, ())]
    return tuple(f"aten::{n}" for n in names)


@dataclass
class Measured:
    """Eager times of one model at one batch size."""

    phase_s: dict[str, list[float]] = field(default_factory=dict)
    op_s: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    #: eager events matched per (phase, op) in each profiled step
    op_n: dict[tuple[str, str], list[int]] = field(default_factory=dict)


def _inputs(spec: str, shape: tuple[int, ...], model: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    if len(shape) == 2:  # token ids
        return (torch.randint(0, 50257, shape),)
    return (torch.randn(*shape),)


def measure(
    model: torch.nn.Module,
    analysis: Any,
    xs: tuple[torch.Tensor, ...],
    repeat: int,
    kernels: dict[str, dict[str, str]],
    device: str,
) -> Measured:
    """Time ``repeat`` eager train steps unprofiled (phase walls) and ``repeat`` profiled (per
    op: eager names -> graphflop kernel op, per phase, in ``kernels``)."""
    fwd = analysis.forward
    sig = fwd.meta[SIGNATURE]
    kind = fwd.meta.get(LOSS_KIND, "sum")
    kind = kind if kind in ("cross_entropy", "mse") else "sum"
    args = real_arguments(fwd, model, seed=0)
    targets = tuple(args[n].to(device) for n in sig.targets[:1])
    xs = tuple(x.to(device) for x in xs)
    opt = torch_optimizer("sgd", model.parameters(), 1e-3)
    cuda = device == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def step(label: bool) -> tuple[float, float, float]:
        from torch.profiler import record_function

        t0 = time.perf_counter()
        with record_function("phase:forward") if label else _null():
            loss = loss_value(kind, loss_output(model(*xs)), targets)
            sync()
        t1 = time.perf_counter()
        with record_function("phase:backward") if label else _null():
            loss.backward()
            sync()
        t2 = time.perf_counter()
        with record_function("phase:update") if label else _null():
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
        t3 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2

    m = Measured()
    for _ in range(2):
        step(False)
    for _ in range(repeat):
        for p, s in zip(PHASES, step(False), strict=True):
            m.phase_s.setdefault(p, []).append(s)
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for _ in range(repeat):
        with profile(activities=acts) as prof:
            step(True)
        counts: dict[tuple[str, str], int] = {}
        sums = _op_sums(prof.events(), kernels, cuda, counts)
        for key in {k for ph in kernels for k in ((ph, op) for op in set(kernels[ph].values()))}:
            m.op_s.setdefault(key, []).append(sums.get(key, 0.0))
            m.op_n.setdefault(key, []).append(counts.get(key, 0))
    return m


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None


#: seconds the profiler adds (inside one leaf event, per event recorded), set by main()
PROFILER_COST = [0.0, 0.0]


def profiler_cost(n: int = 2000, repeat: int = 5) -> tuple[float, float]:
    """What ``torch.profiler`` adds to the times it records, from ``n`` views (no work of
    their own) unprofiled and profiled, the least of ``repeat`` runs each: (seconds inside one
    leaf op's event beyond the op's unprofiled time, seconds of wall time per event recorded).
    A profiled op's time includes the first once and the second once per event recorded
    under it (its children's records)."""
    from torch.profiler import ProfilerActivity, profile

    v = torch.ones(64)

    def run() -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            v.view(8, 8)
        return time.perf_counter() - t0

    run()
    plains, walls, events = [], [], []
    for _ in range(repeat):  # interleaved, so that both see the same load
        plains.append(run() / n)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            walls.append(run() / n)
        us = [e.cpu_time_total for e in prof.events() if e.name == "aten::view"]
        events.append(statistics.median(us) * 1e-6 if us else 0.0)
    plain = min(plains)
    return max(0.0, min(events) - plain), max(0.0, min(walls) - plain)


def _descendants(e: Any) -> int:
    return sum(1 + _descendants(c) for c in e.cpu_children)


def _op_sums(
    events: Any,
    kernels: dict[str, dict[str, str]],
    cuda: bool,
    counts: dict[tuple[str, str], int] | None = None,
) -> dict:
    """(phase, graphflop kernel op) -> measured seconds in one profiled step, each event's
    time less the profiler's own cost in it (:data:`PROFILER_COST`: once for the event, once
    per event under it; at most half the event's time); ``counts`` gets the number of events
    matched per key."""
    counts = {} if counts is None else counts
    out: dict[tuple[str, str], float] = {}
    roots = [e for e in events if e.name.startswith("phase:") and e.cpu_parent is None]

    def seconds(e: Any, wall: bool = False) -> float:
        if cuda and wall:  # the host's time over the range, the phase's synchronize included
            return e.cpu_time_total * 1e-6
        if cuda and e.device_time_total:
            return e.device_time_total * 1e-6
        s = e.cpu_time_total * 1e-6
        own = PROFILER_COST[0] + _descendants(e) * PROFILER_COST[1]
        return max(s - own, s / 2)

    def visit(e: Any, phase: str) -> None:
        op = kernels[phase].get(e.name)
        if op is not None:
            out[(phase, op)] = out.get((phase, op), 0.0) + seconds(e)
            counts[(phase, op)] = counts.get((phase, op), 0) + 1
            return
        for c in e.cpu_children:
            visit(c, phase)

    for r in roots:
        phase = r.name.removeprefix("phase:")
        whole = kernels.get(phase, {}).get(WHOLE_PHASE)
        if whole is not None:  # the optimizer's step and zero_grad, Python included
            out[(phase, whole)] = out.get((phase, whole), 0.0) + seconds(r, wall=True)
            counts[(phase, whole)] = counts.get((phase, whole), 0) + 1
            continue
        for c in r.cpu_children:
            visit(c, phase)
    # events of another thread, under no phase: on CUDA the autograd engine runs the backward
    # on its device's own thread; each belongs to the phase whose range holds its start
    spans = [
        (r.time_range.start, r.time_range.end, r.name.removeprefix("phase:"))
        for r in roots
        if getattr(r, "time_range", None) is not None
    ]
    for e in events:
        if e.cpu_parent is not None or e.name.startswith("phase:"):
            continue
        start = getattr(getattr(e, "time_range", None), "start", None)
        phase = next((ph for a, b, ph in spans if start is not None and a <= start <= b), None)
        if phase is not None and WHOLE_PHASE not in kernels.get(phase, {}):
            visit(e, phase)
    return out


def reference_s(repeat: int = 5) -> float:
    """Seconds of a fixed reference (a 256³ float32 ``mm`` and a 4 MB ``add``), timed before
    calibrating and before each model: their ratio says how much the machine's speed drifted
    between calibration and measurement (other processes sharing the cores)."""
    a = torch.randn(256, 256)
    x = torch.randn(1 << 20)
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(20):
            torch.mm(a, a)
            torch.add(x, x)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def predicted(analysis: Any, profile: TimeProfile) -> Any:
    g = Graphs(analysis.forward, analysis.backward, analysis.update, None, None)
    report = analysis.report
    return time_report(g, report, profile)


def _rel(p: float, m: float) -> float:
    return abs(p - m) / m if m else float("nan")


def _spread(xs: list[float]) -> float:
    if len(xs) < 2:
        return 0.0
    q = statistics.quantiles(xs, n=4)
    return (q[2] - q[0]) / statistics.median(xs)


def compare(tr: Any, m: Measured, device_work: bool = False) -> dict[str, Any]:
    """Per-op rows, per-phase and per-step errors of one prediction against one measurement.
    ``device_work`` (a GPU, whose ops are measured by their kernels' device time): an op's
    prediction is its work, its time less the host's overhead."""
    rows = []
    for o in tr.ops:
        if o.phase not in PHASES:
            continue
        meas = m.op_s.get((o.phase, o.op))
        if not meas or statistics.median(meas) <= 0:
            continue
        med = statistics.median(meas)
        # the kernels' own time, before their share of the phase's host costs and overlap
        # (``OpTime.seconds`` is that share: the rows add up to the phase)
        seconds = o.compute_s + o.memory_s + o.overhead_s
        if device_work and o.op != UPDATE_KERNEL and seconds > o.overhead_s:
            seconds -= o.overhead_s  # a view has no kernel: its host time is measured
        rows.append(
            {
                "phase": o.phase,
                "op": o.op,
                "kernels": o.kernels,
                "measured_kernels": (
                    statistics.median(m.op_n[(o.phase, o.op)])
                    if m.op_n.get((o.phase, o.op))
                    else None
                ),
                "flops": o.flops,
                "bytes": o.bytes,
                "bound": o.bound,
                "predicted_s": seconds,
                "measured_s": med,
                "spread": _spread(meas),
                "error": (seconds - med) / med,
            }
        )
    phases = {}
    for p in PHASES:
        ph = tr.phase(p)
        med = statistics.median(m.phase_s[p])
        phases[p] = {
            "predicted_s": ph.seconds if ph else 0.0,
            "measured_s": med,
            "spread": _spread(m.phase_s[p]),
            "error": ((ph.seconds if ph else 0.0) - med) / med,
        }
    steps = [sum(x) for x in zip(*(m.phase_s[p] for p in PHASES), strict=True)]
    step_pred = sum(phases[p]["predicted_s"] for p in PHASES)
    step_med = statistics.median(steps)
    errs = [abs(r["error"]) for r in rows]
    wsum = sum(r["flops"] for r in rows)
    return {
        "ops": rows,
        "phases": phases,
        "step": {
            "predicted_s": step_pred,
            "measured_s": step_med,
            "spread": _spread(steps),
            "error": (step_pred - step_med) / step_med,
        },
        "op_median_abs_error": statistics.median(errs) if errs else None,
        "op_flop_weighted_abs_error": (
            sum(abs(r["error"]) * r["flops"] for r in rows) / wsum if wsum else None
        ),
    }


def run_case(
    label: str, spec: str, shape: tuple[int, ...], profiles: dict[str, TimeProfile], args: Any
) -> dict[str, Any]:
    loaded = load(spec)
    model = loaded.model.train()
    xs = _inputs(spec, shape, model)
    t0 = time.perf_counter()
    analysis = analyze(model, xs, jvp=False)
    analysed = time.perf_counter() - t0
    preds = {k: predicted(analysis, p) for k, p in profiles.items()}
    kernels: dict[str, dict[str, str]] = {p: {} for p in PHASES}
    for tr in preds.values():
        for o in tr.ops:
            if o.op == UPDATE_KERNEL:  # torch.optim's step() + zero_grad(), as a whole
                kernels[o.phase][WHOLE_PHASE] = o.op
            elif o.phase in kernels:
                for name in eager_names(o.op, o.phase):
                    kernels[o.phase].setdefault(name, o.op)
    model = model.to(args.device)
    drift = reference_s() / args.reference_s if args.reference_s else None
    m = measure(model, analysis, xs, args.repeat, kernels, args.device)
    out = {
        "model": label,
        "spec": spec,
        "input_shape": list(shape),
        "analysis_s": analysed,
        "drift": drift,
        "results": {k: compare(tr, m, args.device == "cuda") for k, tr in preds.items()},
    }
    after = out["results"].get("after") or next(iter(out["results"].values()))
    print(
        f"{label} {'×'.join(map(str, shape))}: step measured {after['step']['measured_s'] * 1e3:.1f} ms, "
        + ", ".join(
            f"{k} {r['step']['predicted_s'] * 1e3:.1f} ms ({100 * r['step']['error']:+.0f}%)"
            for k, r in out["results"].items()
        ),
        flush=True,
    )
    return out


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.0f}%"


def _count(n: float | None) -> str:
    return "–" if n is None else f"{n:g}"


def _ms(s: float) -> str:
    return f"{s * 1e3:.3g}"


def markdown(doc: dict[str, Any]) -> str:
    """The results section of docs/time.md."""
    lines = [
        MARK_BEGIN,
        "",
        f"Measured {doc['date']} on {doc['machine']} with torch {doc['torch']}, "
        f"{doc['threads']} thread(s), device {doc['device']}, {doc['repeat']} runs per figure"
        f"{'; **taken under load** (other processes shared the cores)' if doc['under_load'] else ''}. "
        f"Profiles: before = `{doc['profiles'].get('before', '–')}`, after = "
        f"`{doc['profiles'].get('after', '–')}`. Command: `{doc['command']}`. Per-op times "
        f"are the profiler's less its own cost, measured before the models: "
        f"{doc['profiler_cost_s'][0] * 1e6:.2f} µs inside each event and "
        f"{doc['profiler_cost_s'][1] * 1e6:.2f} µs per event recorded under it.",
        "",
        "### Whole step and per-op error",
        "",
        "Spread: half the interquartile range over the median. Drift: a fixed reference "
        "(256³ `mm` + 4 MB `add`) timed before this model over the same timed at the start "
        "of the run, just before calibrating; 1.00 means the machine ran at the speed it was "
        "calibrated at, 2.00 that it was twice as slow (load). After × drift: the calibrated "
        "prediction scaled by the drift, a rough correction for the machine's speed having "
        "changed since calibration (not a prediction: it uses a measurement).",
        "",
        "| model | input | step measured ms (spread) | drift | before: step ms (err) | op median "
        "| op FLOP-w. | after: step ms (err) | op median | op FLOP-w. | after × drift (err) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in doc["cases"]:
        r = c["results"]
        b, a = r.get("before"), r.get("after")
        ref = a or b
        cells = [
            c["model"],
            "×".join(map(str, c["input_shape"])),
            f"{_ms(ref['step']['measured_s'])} (±{_pct(ref['step']['spread'] / 2)})",
            "–" if c.get("drift") is None else f"{c['drift']:.2f}",
        ]
        for x in (b, a):
            if x is None:
                cells += ["–", "–", "–"]
            else:
                cells += [
                    f"{_ms(x['step']['predicted_s'])} ({100 * x['step']['error']:+.0f}%)",
                    _pct(x["op_median_abs_error"]),
                    _pct(x["op_flop_weighted_abs_error"]),
                ]
        drift = c.get("drift")
        if a is not None and drift:
            scaled = a["step"]["predicted_s"] * drift
            err = (scaled - a["step"]["measured_s"]) / a["step"]["measured_s"]
            cells.append(f"{_ms(scaled)} ({100 * err:+.0f}%)")
        else:
            cells.append("–")
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "### Per phase (after calibration)",
        "",
        "| model | input | phase | measured ms (spread) | predicted ms | error |",
        "|---|---|---|---|---|---|",
    ]
    key = "after" if any("after" in c["results"] for c in doc["cases"]) else "before"
    for c in doc["cases"]:
        x = c["results"].get(key)
        if x is None:
            continue
        for p, v in x["phases"].items():
            lines.append(
                f"| {c['model']} | {'×'.join(map(str, c['input_shape']))} | {p} | "
                f"{_ms(v['measured_s'])} (±{_pct(v['spread'] / 2)}) | {_ms(v['predicted_s'])} | "
                f"{100 * v['error']:+.0f}% |"
            )
    worst = []
    for c in doc["cases"]:
        x = c["results"].get(key)
        if x is None:
            continue
        for r in x["ops"]:
            worst.append((abs(r["error"]) * r["measured_s"], c, r))
    worst.sort(key=lambda t: -t[0])
    lines += [
        "",
        "### The ten ops with the largest absolute time error (after calibration)",
        "",
        "Kernels: predicted / eager events matched (a difference: graphflop's graph runs the "
        "op more or less often than eager PyTorch does, views and reshapes above all).",
        "",
        "| model | input | phase | op | kernels | FLOPs | bound | measured ms | predicted ms | error |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for _, c, r in worst[:10]:
        lines.append(
            f"| {c['model']} | {'×'.join(map(str, c['input_shape']))} | {r['phase']} | "
            f"`{r['op']}` | {r['kernels']} / {_count(r.get('measured_kernels'))} | "
            f"{r['flops']:.3g} | {r['bound']} | "
            f"{_ms(r['measured_s'])} | {_ms(r['predicted_s'])} | {100 * r['error']:+.0f}% |"
        )
    lines += ["", MARK_END]
    return "\n".join(lines) + "\n"


#: (words in ``torch.cuda.get_device_name``, lower case, ``-`` as space) -> data-sheet device;
#: the first rule whose words all occur wins
_GPU_NAMES = (
    (("h200",), "h200"),
    (("h100", "pcie"), "h100-pcie"),
    (("h100",), "h100-sxm"),
    (("a100", "40gb"), "a100-40gb"),
    (("a100",), "a100-80gb"),
    (("b200",), "b200"),
    (("l4",), "l4"),
    (("4090",), "rtx-4090"),
    (("mi300x",), "mi300x"),
)


def gpu_spec_for(device_name: str) -> str | None:
    """The data-sheet device of a GPU called ``device_name`` (``NVIDIA H100 80GB HBM3`` ->
    ``h100-sxm``), or None."""
    words = device_name.lower().replace("-", " ").split()
    for needed, spec in _GPU_NAMES:
        if all(w in words for w in needed):
            return spec
    return None


def write_doc(path: Path, section: str) -> None:
    text = path.read_text() if path.exists() else ""
    if MARK_BEGIN in text and MARK_END in text:
        head, _, rest = text.partition(MARK_BEGIN)
        _, _, tail = rest.partition(MARK_END)
        text = head + section.rstrip("\n") + tail
    else:
        text = text + "\n" + section
    atomic_write(str(path), text)


def _before(device: str, gpu_spec: str | None, threads: int) -> tuple[str, TimeProfile] | None:
    """The 'before' profile and its name: the CPU guess, or the GPU's data sheet."""
    if device == "cpu":
        return "cpu (data-sheet-like guess)", default_cpu_profile(threads)
    spec = gpu_spec_for(torch.cuda.get_device_name()) if gpu_spec == "auto" else gpu_spec
    if not spec:
        return None
    from graphflop.devices import device_spec

    return spec, from_device(device_spec(spec))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calibrate", action="store_true", help="run graphflop calibrate first")
    ap.add_argument("--profile", help="a profile file from graphflop calibrate (the 'after')")
    ap.add_argument("--save-profile", default=None, help="where --calibrate writes its profile")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument(
        "--gpu-spec",
        default="auto",
        help="a data-sheet device for 'before' on cuda (graphflop devices lists them; default "
        "auto: the one whose name torch.cuda.get_device_name matches, none if no match)",
    )
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="default: PyTorch's own count")
    ap.add_argument("--models", default=None, help="comma-separated labels (default: all)")
    ap.add_argument(
        "--first-only",
        action="store_true",
        help="each model at its first input shape only (the acceptance sizes)",
    )
    ap.add_argument("--doc", default=str(ROOT / "docs" / "time.md"))
    ap.add_argument("--json", default=None, help="write every figure as JSON here")
    ap.add_argument("--no-doc", action="store_true", help="print, write no doc")
    ap.add_argument("--under-load", action="store_true", help="say so in the doc")
    ap.add_argument(
        "--raw-profiler-times",
        action="store_true",
        help="per-op times as the profiler records them (default: less its own cost)",
    )
    args = ap.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    profiles: dict[str, TimeProfile] = {}
    names: dict[str, str] = {}
    before = _before(args.device, args.gpu_spec, threads)
    if before is not None:
        names["before"], profiles["before"] = before
    args.reference_s = reference_s() if args.device == "cpu" else None
    if args.device == "cpu" and not args.raw_profiler_times:
        PROFILER_COST[:] = profiler_cost()
        print(
            f"profiler cost: {PROFILER_COST[0] * 1e6:.2f} µs inside an event, "
            f"{PROFILER_COST[1] * 1e6:.2f} µs per event",
            flush=True,
        )
    if args.calibrate:
        from graphflop.runtime.calibrate import calibrate

        print(f"calibrating {args.device} with {threads} thread(s) ...", flush=True)
        prof = calibrate(args.device, threads=threads)
        if args.save_profile:
            atomic_write(args.save_profile, save_profile(prof))
        profiles["after"] = prof
        names["after"] = f"graphflop calibrate --device {args.device} --threads {threads}"
    elif args.profile:
        prof = load_profile(args.profile)
        if prof.threads is not None and prof.threads != threads:
            print(
                f"warning: {args.profile} was measured with {prof.threads} threads, this run "
                f"uses {threads}",
                file=sys.stderr,
            )
        profiles["after"] = prof
        names["after"] = os.path.basename(args.profile)
    wanted = set(args.models.split(",")) if args.models else None
    cases: list[dict[str, Any]] = []
    doc = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()} {platform.processor() or ''}, {os.cpu_count()} CPUs",
        "torch": torch.__version__,
        "threads": threads,
        "device": args.device,
        "repeat": args.repeat,
        "under_load": args.under_load,
        "profiler_cost_s": list(PROFILER_COST),
        "profiles": names,
        "command": "python tools/bench_time.py " + " ".join(argv or sys.argv[1:]),
        "cases": cases,
    }
    for label, spec, shapes in CASES:
        if wanted is not None and label not in wanted:
            continue
        for shape in shapes[:1] if args.first_only else shapes:
            cases.append(run_case(label, spec, shape, profiles, args))
            if args.json:  # after each model: a run cut short keeps what it measured
                atomic_write(args.json, json.dumps(doc, indent=1) + "\n")
    section = markdown(doc)
    if args.json and not cases:  # each case wrote it already
        atomic_write(args.json, json.dumps(doc, indent=1) + "\n")
    if args.no_doc:
        print(section)
    else:
        write_doc(Path(args.doc), section)
        print(f"wrote {args.doc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
