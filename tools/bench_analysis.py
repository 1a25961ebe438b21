"""Analysis time: graphflop's stages against FlopCounterMode on the same meta model and inputs.

For each model (one child process per model, so that one model's caches and memory do not
help or hurt the next), the child loads the model on the meta device, makes meta inputs, runs
everything once to warm up (imports, decomposition tables; not counted), then ``--repeat``
rounds, each running, one after the other (alternating, so that machine noise hits all alike):

* FlopCounterMode, forward only (the model's forward on the meta inputs);
* FlopCounterMode, forward + loss + ``backward()`` (the loss graphflop's ``auto`` picks);
* ``graphflop.analyze`` in full (trace; JVP, backward, optimizer update and forward-gradient
  graphs; FLOPs and memory annotations; summary), timed per stage;
* ``graphflop.analyze(backward=False, jvp=False)``: the forward only.

The figures are medians over the rounds. ``--zoo`` runs the model list :data:`ZOO`;
``--depth`` adds the linearity series (GPT-2 small with 12 to 96 blocks, ResNet-18 to -152);
the report goes to ``--out`` (default ``docs/analysis_scale.md``): a new file, or the part of
an existing one between the tool's markers (:data:`BEGIN`, :data:`END`), the rest of it (the
rounds' notes, by hand) kept. ``--json`` keeps the figures with the run's description (rounds,
clock, machine, versions), from which ``--render`` writes the report again. ``--profile
OUT.txt`` runs one model's full analysis under pyinstrument (the dev extra; wall clock)
instead. Bad input is one line and exit status 2, before any model runs.

    python tools/bench_analysis.py --zoo --depth --repeat 3
    python tools/bench_analysis.py --only resnet50_b8 --repeat 5 --out /tmp/r.md
    python tools/bench_analysis.py --profile /tmp/prof.txt --only gpt2_small_4x512
    python tools/bench_analysis.py --floor --only resnet50_b8 gpt2_small_4x512 --repeat 5
    python tools/bench_analysis.py --cli --repeat 15

``--floor`` prints the tracing floor instead (:func:`floor`; the models one after another in
this process, each one's variants alternating); ``--cli`` the wall-clock time of the command
line against ``import torch`` (:func:`cli_times`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # graphflop from this checkout
from graphflop.io import atomic_write, unwritable  # noqa: E402  (imports torch, via graphflop)

ROOT = Path(__file__).resolve().parents[1]

#: name -> (spec, constructor keyword arguments, input shapes or None, batch or None)
ZOO: dict[str, tuple[str, dict, list[tuple[int, ...]] | None, int | None]] = {
    "mlp": ("models/mlp.py", {}, None, None),
    "cnn": ("models/cnn.py", {}, None, None),
    "convnet": ("models/convnet.py", {}, None, None),
    "deeper_convnet": ("models/deeper_convnet.py", {}, None, None),
    "lora": ("models/lora.py", {}, None, None),
    "resnet18_b8": ("models/resnet.py:resnet18", {}, None, 8),
    "resnet50_b8": ("models/resnet.py:resnet50", {}, None, 8),
    "vit_b_16": ("models/vit.py:vit_b_16", {}, None, None),
    "gpt2_small_4x512": ("models/gpt2.py:gpt2_small", {}, [(4, 512)], None),
}
#: GPT-2 XL at batch 8 (its full 1024 context): reported on its own
XL = {"gpt2_xl_b8": ("models/gpt2.py:gpt2_xl", {}, None, 8)}
#: Llama configurations from the published ones (``hf:`` presets, transformers'
#: ``LlamaForCausalLM`` on the meta device, SDPA attention), batch 1 × 4,096 tokens; the 405B
#: one also cut to 12 layers (``--rss`` compares the two analyses' peak memory)
LLAMA = {
    "llama3_70b_1x4096": ("hf:llama-3.1-70b", {}, [(1, 4096)], None),
    "llama31_405b_1x4096": ("hf:llama-3.1-405b", {}, [(1, 4096)], None),
    "llama31_405b_12_layers": ("hf:llama-3.1-405b", {"num_hidden_layers": 12}, [(1, 4096)], None),
}
#: the linearity series: GPT-2 small's width with more blocks, and the ResNets
DEPTH = {
    **{
        f"gpt2_{n}_blocks": ("models/gpt2.py:gpt2_small", {"n_layer": n}, [(1, 256)], None)
        for n in (12, 24, 48, 96)
    },
    **{f"resnet{n}": (f"models/resnet.py:resnet{n}", {}, None, 1) for n in (18, 34, 50, 101, 152)},
}
#: the clock: the process's CPU time (``--wall``: wall-clock time). On a shared machine the
#: wall-clock time of a single-threaded run includes the time other processes had the CPU.
CLOCK = time.process_time
STAGES = {
    "tracing": "trace",
    "building the JVP graph": "JVP",
    "building the backward graph": "VJP",
    "building the optimizer update": "update",
    "building the forward-gradient step": "forward-gradient step",
    "summarising": "summary",
}


# --- child: one model ------------------------------------------------------------------------


def _setup(spec: str, kwargs: dict, shapes, batch):
    from graphflop.load import load, make_inputs

    if spec.startswith("hf:") and shapes:  # token inputs: batch × sequence
        (batch, seq), shapes = shapes[0], None
        loaded = load(spec, ctor_kwargs=kwargs, meta=True, seq=seq)
        _no_packed_sequences()
    else:
        loaded = load(spec, ctor_kwargs=kwargs, meta=True)
    loaded.model.train()
    return loaded, make_inputs(loaded, shapes=shapes, batch=batch)


def _no_packed_sequences() -> None:
    """transformers' ``masking_utils.find_packed_sequence_indices`` reads position ids with
    ``.item()``, which FlopCounterMode on meta tensors cannot: replaced by a function
    returning None (no packed sequences, which is what the inputs here are). graphflop's own
    trace has its own workaround (``graphflop/frontend/libraries.py``)."""
    try:
        from transformers import masking_utils
    except ImportError:  # pragma: no cover - transformers missing
        return
    if hasattr(masking_utils, "find_packed_sequence_indices"):
        masking_utils.find_packed_sequence_indices = lambda *a, **k: None


def _flop_counter(model, inputs, backward: bool) -> tuple[float, int]:
    """Seconds and total FLOPs of FlopCounterMode over forward (+ loss + backward)."""
    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    from graphflop.frontend.trace import default_loss

    t0 = CLOCK()
    with FlopCounterMode(display=False) as counter:
        out = model(*inputs)
        if backward:
            first = out if isinstance(out, torch.Tensor) else out[0]
            if default_loss(out) == "cross_entropy":
                target = torch.zeros(first.shape[0], dtype=torch.long, device=first.device)
                loss = F.cross_entropy(first, target)
            else:
                loss = first.sum()
            loss.backward()
    dt = CLOCK() - t0
    for p in model.parameters():
        p.grad = None
    return dt, counter.get_total_flops()


def _graphflop(model, inputs, full: bool) -> tuple[float, dict[str, float], object]:
    """Seconds, seconds per stage and the analysis of ``graphflop.analyze``."""
    import graphflop.passes.summary as summary
    from graphflop.analysis import AnalyzeOptions, analyze

    marks: list[tuple[str, float]] = []
    memory_s = [0.0]
    inner = summary._memory

    def timed_memory(*a, **k):  # the memory schedules run inside the summary
        t = CLOCK()
        try:
            return inner(*a, **k)
        finally:
            memory_s[0] += CLOCK() - t

    summary._memory = timed_memory
    try:
        t0 = CLOCK()
        a = analyze(
            model,
            inputs,
            AnalyzeOptions(backward=full, jvp=full),
            progress=lambda m: marks.append((m, CLOCK())),
        )
        t1 = CLOCK()
    finally:
        summary._memory = inner
    stages = {}
    for (msg, t), nxt in zip(marks, marks[1:] + [("", t1)]):
        stages[STAGES.get(msg, msg)] = nxt[1] - t
    if "summary" in stages:
        stages["summary"] -= memory_s[0]
        stages["memory"] = memory_s[0]
    return t1 - t0, stages, a


def child(name: str, spec: str, kwargs: dict, shapes, batch, repeat: int) -> dict:
    import warnings

    warnings.simplefilter("ignore")
    import torch

    torch.set_num_threads(1)  # meta tensors: nothing to compute; CPU time is one thread's
    loaded, inputs = _setup(spec, kwargs, shapes, batch)
    model = loaded.model
    # warm-up (not counted): first-call imports and tables on both sides
    t0 = time.perf_counter()
    _flop_counter(model, inputs, True)
    _, _, a = _graphflop(model, inputs, True)
    warm = time.perf_counter() - t0
    runs: dict[str, list[float]] = {"fc_fwd": [], "fc_fwd_bwd": [], "ours_full": [], "ours_fwd": []}
    stage_runs: dict[str, list[float]] = {}
    fc_flops = 0
    for _ in range(repeat):
        runs["fc_fwd"].append(_flop_counter(model, inputs, False)[0])
        dt, fc_flops = _flop_counter(model, inputs, True)
        runs["fc_fwd_bwd"].append(dt)
        dt, stages, a = _graphflop(model, inputs, True)
        runs["ours_full"].append(dt)
        for k, v in stages.items():
            stage_runs.setdefault(k, []).append(v)
        runs["ours_fwd"].append(_graphflop(model, inputs, False)[0])
    t = a.report.totals
    return {
        "name": name,
        "spec": spec,
        "kwargs": kwargs,
        "inputs": [tuple(x.shape) for x in inputs],
        "params": a.report.params,
        "warmup_s": warm,
        "runs_s": runs,
        "median_s": {k: statistics.median(v) for k, v in runs.items()},
        "stages_s": {k: statistics.median(v) for k, v in stage_runs.items()},
        "nodes": {
            "forward": len(a.forward.graph.nodes),
            "backward": len(a.backward.graph.nodes) if a.backward is not None else 0,
            "jvp": len(a.jvp.graph.nodes) if a.jvp is not None else 0,
            "forward_gradient": len(a.forward_gradient.graph.nodes)
            if a.forward_gradient is not None
            else 0,
        },
        "mm_flops": t.forward.mm_flops + t.backward.mm_flops,
        "fc_flops": fc_flops,
    }


def rss_child(name: str, spec: str, kwargs: dict, shapes, batch) -> dict:
    """Peak resident memory of one full analysis in this (fresh) process:
    ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` after loading the model and making its
    inputs, and after ``analyze`` (kilobytes on Linux)."""
    import resource
    import warnings

    warnings.simplefilter("ignore")
    import torch

    torch.set_num_threads(1)
    loaded, inputs = _setup(spec, kwargs, shapes, batch)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = CLOCK()
    _, _, a = _graphflop(loaded.model, inputs, True)
    dt = CLOCK() - t0
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "name": name,
        "loaded_maxrss_kb": before,
        "maxrss_kb": after,
        "analysis_s": dt,
        "forward_nodes": len(a.forward.graph.nodes),
    }


def profile(spec: str, kwargs: dict, shapes, batch, out: str) -> None:
    """The full analysis (after a warm-up) under pyinstrument, as text in ``out``."""
    from pyinstrument import Profiler

    loaded, inputs = _setup(spec, kwargs, shapes, batch)
    _graphflop(loaded.model, inputs, True)
    prof = Profiler(interval=0.001)
    prof.start()
    _graphflop(loaded.model, inputs, True)
    prof.stop()
    Path(out).write_text(prof.output_text(unicode=False, show_all=False))


def floor(spec: str, kwargs: dict, shapes, batch, repeat: int) -> dict[str, float]:
    """The tracing floor: median seconds of FlopCounterMode over the
    forward and over forward + backward, graphflop's whole trace, and plain ``make_fx`` of the
    forward (fake tensors; no decomposition table, functionalization or outlining: the least a
    make_fx-based tracer does), and a dispatch-mode recorder of the forward (:func:`_record`:
    the least a tracer of graphflop's own would do), alternating in this process after one
    warm-up round."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    import graphflop.frontend.nodynamo as nodynamo
    from graphflop.frontend.trace import trace

    loaded, inputs = _setup(spec, kwargs, shapes, batch)
    model = loaded.model
    state = (dict(model.named_parameters()), dict(model.named_buffers()))

    def plain():
        def f(params, buffers, *x):
            return torch.func.functional_call(model, (params, buffers), x)

        return make_fx(f, tracing_mode="fake", _allow_fake_constant=True)(*state, *inputs)

    runs = {
        "FC fwd": lambda: _flop_counter(model, inputs, False),
        "FC fwd+bwd": lambda: _flop_counter(model, inputs, True),
        "graphflop trace": lambda: nodynamo.run(lambda: trace(model, inputs)),
        "plain make_fx fwd": lambda: nodynamo.run(plain),
        "dispatch recorder fwd": lambda: nodynamo.run(lambda: _record(model, inputs)),
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(repeat + 1):
        for k, fn in runs.items():
            t0 = CLOCK()
            fn()
            if r:
                times[k].append(CLOCK() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def _record(model, inputs) -> int:  # noqa: C901  (a tracer in one function, on purpose)
    """The forward recorded by the least tracer that is not ``make_fx``: a
    ``TorchDispatchMode`` over FakeTensors that applies graphflop's decomposition table and
    appends one fx node per ATen op, taking output metadata from a cache keyed by the op and
    its arguments' metadata. No functionalization, module paths, outlining, constants or
    dead-code removal: what a tracer of graphflop's own would cost at the least. Returns the
    number of nodes recorded."""
    import operator

    import torch
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
    from torch.fx.node import map_aggregate
    from torch.utils._python_dispatch import TorchDispatchMode

    from graphflop.frontend.trace import as_fake
    from graphflop.ops import decomposition_table
    from graphflop.ops.tree import meta_key

    table = decomposition_table()

    def fresh(v):
        with unset_fake_temporarily():
            m = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
        return FakeTensor(v.fake_mode, m, v.device)

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.graph = torch.fx.Graph()
            self.nodes: dict[int, torch.fx.Node] = {}
            self.cache: dict = {}

        def node_of(self, t):
            n = self.nodes.get(id(t))
            if n is None:
                n = self.nodes[id(t)] = self.graph.placeholder(f"input_{len(self.nodes)}")
            return n

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in table:
                with self:
                    out = table[func](*args, **kwargs)
                if out is not NotImplemented:
                    return out
            out = self.output(func, args, kwargs)
            if any(isinstance(o, torch.Tensor) for o in (out if isinstance(out, tuple) else [out])):
                self.record(func, args, kwargs, out)  # not queries (prim.device): no node
            return out

        def output(self, func, args, kwargs):
            key = hit = None
            if not func.is_view and not func._schema.is_mutable:
                try:
                    key = (func, meta_key(args), meta_key(kwargs))
                    hit = self.cache.get(key)
                except TypeError:
                    key = None
            if hit is not None:
                return type(hit)(map(fresh, hit)) if isinstance(hit, tuple) else fresh(hit)
            out = func(*args, **kwargs)
            fakes = out if isinstance(out, tuple) else (out,)
            if key is not None and all(isinstance(o, FakeTensor) for o in fakes):
                self.cache[key] = out
            return out

        def record(self, func, args, kwargs, out):
            def arg(a):
                return self.node_of(a) if isinstance(a, torch.Tensor) else a

            node = self.graph.call_function(
                func, map_aggregate(args, arg), map_aggregate(kwargs, arg)
            )
            node.meta["val"] = out
            many = isinstance(out, (tuple, list))
            for i, o in enumerate(out if many else [out]):
                if isinstance(o, torch.Tensor):
                    item = self.graph.call_function(operator.getitem, (node, i)) if many else node
                    self.nodes[id(o)] = item

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    state = {k: as_fake(mode, v) for k, v in [*model.named_parameters(), *model.named_buffers()]}
    xs = tuple(as_fake(mode, x) for x in inputs)
    with mode, Recorder() as rec:
        torch.func.functional_call(model, state, xs)
    return len(rec.graph.nodes)


# --- parent: one child per model, then the report --------------------------------------------


def _run_child(name: str, entry, repeat: int) -> dict:
    cmd = [sys.executable, __file__, "--child", json.dumps([name, *entry, repeat])]
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if proc.returncode != 0:
        return {"name": name, "error": proc.stderr.strip().splitlines()[-1:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _ratio(r: dict, ours: str, theirs: str) -> float:
    return r["median_s"][ours] / r["median_s"][theirs]


def _table(rows: list[dict], median_of: list[dict]) -> list[str]:
    """The FlopCounterMode table of ``rows``, with the median ratios of ``median_of`` (the
    zoo's rows: GPT-2 XL has its own bound)."""
    lines = [
        "| model | nodes fwd / bwd / JVP | FC fwd | FC fwd+bwd | graphflop fwd | graphflop full"
        " | full / FC fwd+bwd | fwd / FC fwd |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | failed: {' '.join(r['error'])} | | | | | | |")
            continue
        m, n = r["median_s"], r["nodes"]
        lines.append(
            f"| {r['name']} | {n['forward']:,} / {n['backward']:,} / {n['jvp']:,} | "
            f"{m['fc_fwd']:.3f} | {m['fc_fwd_bwd']:.3f} | {m['ours_fwd']:.3f} | "
            f"{m['ours_full']:.3f} | {_ratio(r, 'ours_full', 'fc_fwd_bwd'):.2f}x | "
            f"{_ratio(r, 'ours_fwd', 'fc_fwd'):.2f}x |"
        )
    ok = [r for r in median_of if "error" not in r]
    if len(ok) > 1:
        full = statistics.median(_ratio(r, "ours_full", "fc_fwd_bwd") for r in ok)
        fwd = statistics.median(_ratio(r, "ours_fwd", "fc_fwd") for r in ok)
        lines.append(f"| **median of the zoo** | | | | | | **{full:.2f}x** | **{fwd:.2f}x** |")
    return lines


def _stage_table(rows: list[dict]) -> list[str]:
    names = ["trace", "JVP", "VJP", "update", "forward-gradient step", "memory", "summary"]
    lines = ["| model | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for r in rows:
        if "error" not in r:
            s = r["stages_s"]
            lines.append(
                f"| {r['name']} | " + " | ".join(f"{s.get(k, 0):.3f}" for k in names) + " |"
            )
    return lines


def _depth_table(rows: list[dict]) -> list[str]:
    lines = [
        "| model | forward nodes | all nodes built | graphflop full (s) | µs per node "
        "| FC fwd+bwd (s) | full / FC |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | failed: {' '.join(r['error'])} | | | | | |")
            continue
        total = sum(r["nodes"].values())
        full = r["median_s"]["ours_full"]
        lines.append(
            f"| {r['name']} | {r['nodes']['forward']:,} | {total:,} | {full:.3f} | "
            f"{1e6 * full / total:.0f} | {r['median_s']['fc_fwd_bwd']:.3f} | "
            f"{_ratio(r, 'ours_full', 'fc_fwd_bwd'):.2f}x |"
        )
    return lines


#: the generated part of ``--out``: the rest of the file (the rounds' notes, profiles) is kept
BEGIN = "<!-- generated by tools/bench_analysis.py: begin (the rest of the file is kept) -->"
END = "<!-- generated by tools/bench_analysis.py: end -->"


class UsageError(Exception):
    """Bad input to the tool: one line, exit status 2."""


def run_description(repeat: int) -> dict:
    """What the figures of this run were measured with, stored in ``--json`` for ``--render``."""
    import torch

    return {
        "repeat": repeat,
        "clock": "wall" if CLOCK is time.perf_counter else "cpu",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def report(zoo: list[dict], xl: list[dict], depth: list[dict], run: dict) -> str:
    """The generated part of the report (between :data:`BEGIN` and :data:`END`): what was
    measured and how (``run``, :func:`run_description`), the FlopCounterMode and stage tables
    and, with depth rows, the linearity table."""
    clock = (
        "wall-clock seconds"
        if run["clock"] == "wall"
        else "CPU seconds of the process (`time.process_time`; both sides run on one thread, "
        "and on this shared machine wall-clock time also counts the time other processes "
        "held the CPU, about 2-3x more here)"
    )
    repeat = run["repeat"]
    lines = [
        "# Analysis time at scale",
        "",
        "Written by `tools/bench_analysis.py`. Per model, one child process loads "
        "the model on the meta device, warms up, then runs alternately, "
        f"{repeat} times each: PyTorch's `FlopCounterMode` over the forward (FC fwd) and over "
        "forward + loss + `backward()` (FC fwd+bwd) on the meta model and inputs, "
        "`graphflop.analyze` in full (trace; JVP, backward, SGD update and forward-gradient "
        "graphs; FLOP and memory annotations; summary) and `analyze(backward=False, jvp=False)` "
        f"(graphflop fwd). Times are {clock}, medians. The machine is shared (2 cores, several "
        "processes), so single figures are noisy: ratios within about ±20% are not "
        "significant.",
        "",
        f"- machine: {run['machine']}; Python {run['python']}, torch {run['torch']}",
        "",
    ]
    if zoo or xl:
        lines += ["## Against FlopCounterMode", "", *_table(zoo + xl, zoo), ""]
        lines += ["## graphflop's full analysis by stage (seconds)", "", *_stage_table(zoo + xl)]
        lines += [""]
    if depth:
        lines += [
            "## Linearity: analysis time against depth",
            "",
            "GPT-2 small's width (768, 12 heads) at 1×256 tokens with 12 to 96 blocks, and the "
            "ResNets at batch 1. 'All nodes built' counts the forward, backward, JVP and "
            "forward-gradient graphs' nodes.",
            "",
            *_depth_table(depth),
            "",
        ]
    return "\n".join([BEGIN, *lines, END])


def splice(path: Path, generated: str) -> str:
    """The text of ``path`` with its generated part replaced by ``generated`` (which holds the
    markers); ``generated`` alone for a new file.

    Raises:
        UsageError: ``path`` exists without both markers (it would be overwritten).
    """
    if not path.exists():
        return generated + "\n"
    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise UsageError(
            f"{path} exists and has no generated part to replace (no bench_analysis markers): "
            "give a new --out file"
        )
    head, rest = text.split(BEGIN, 1)
    return head + generated + rest.split(END, 1)[1]


def _select(args) -> tuple[dict, dict, dict]:
    """The models to run, as (zoo, xl, depth) groups: ``--only`` names them (and overrides
    ``--zoo``, ``--xl`` and ``--depth``), each in its own group.

    Raises:
        UsageError: an unknown name.
    """
    xl_group = {**XL, **LLAMA}
    if args.only:
        every = {**ZOO, **xl_group, **DEPTH}
        unknown = [n for n in args.only if n not in every]
        if unknown:
            raise UsageError(f"unknown model {unknown[0]!r}: give one of {', '.join(every)}")
        names = dict.fromkeys(args.only)  # in order, once each
        return tuple({n: group[n] for n in names if n in group} for group in (ZOO, xl_group, DEPTH))
    return (
        dict(ZOO) if args.zoo else {},
        {**(XL if args.xl else {}), **(LLAMA if getattr(args, "llama", False) else {})},
        dict(DEPTH) if args.depth else {},
    )


def _read_results(paths: list[str]) -> tuple[dict[str, list[dict]], dict]:
    """The rows and run description of ``--json`` files, merged (``--render``).

    Raises:
        UsageError: a file missing or not a report of this tool, or files measured with
            different clocks.
    """
    results: dict[str, list[dict]] = {"zoo": [], "xl": [], "depth": []}
    runs: list[dict] = []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except OSError as e:
            raise UsageError(f"cannot read {path}: {e.strerror or e}") from None
        except (UnicodeDecodeError, ValueError) as e:
            raise UsageError(f"{path} is not JSON ({e}): give a file --json wrote") from None
        ok = isinstance(data, dict) and isinstance(data.get("run"), dict)
        ok = ok and all(
            isinstance(data.get(part), list)
            and all(
                isinstance(r, dict) and "name" in r and ("median_s" in r or "error" in r)
                for r in data[part]
            )
            for part in results
        )
        if not ok:
            raise UsageError(
                f"{path} is not a report of this tool (rows under zoo, xl and depth and its "
                "run description; files written by older versions of this tool have none): run it again with --json"
            )
        for part in results:
            results[part] += data[part]
        runs.append(data["run"])
    if len({r.get("clock") for r in runs}) > 1:
        raise UsageError(
            "the files were timed with different clocks (CPU and wall): render them apart"
        )
    merged = {
        k: " / ".join(dict.fromkeys(str(r.get(k)) for r in runs))
        for k in ("repeat", "clock", "machine", "python", "torch")
    }
    return results, merged


def _check_output(path: str | None, what: str) -> None:
    if path is not None:
        why = "an empty name" if path == "" else unwritable(path)
        if why:
            raise UsageError(f"cannot write {what} {path!r}: {why}")


#: the command lines ``--cli`` times, alternating: graphflop's command line on the smallest
#: shipped model, and the interpreter with PyTorch imported (the floor under any command)
CLI_RUNS = {
    "graphflop inspect models/mlp.py": ["-m", "graphflop", "inspect", "models/mlp.py"],
    "python -c 'import torch'": ["-c", "import torch"],
}


def cli_times(repeat: int) -> dict[str, list[float]]:
    """Wall-clock seconds of each of :data:`CLI_RUNS` (a fresh process each, output
    discarded), ``repeat`` rounds alternating between them, after one unmeasured round (the
    file cache)."""
    import subprocess

    times: dict[str, list[float]] = {k: [] for k in CLI_RUNS}
    for i in range(repeat + 1):
        for name, argv in CLI_RUNS.items():
            t0 = time.perf_counter()
            subprocess.run(
                [sys.executable, *argv],
                cwd=ROOT,
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            if i:
                times[name].append(time.perf_counter() - t0)
    return times


def main(argv=None) -> int:
    """The command line; bad input is one line on standard error and exit status 2, checked
    before any model runs (nothing is written then)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--zoo", action="store_true", help="the model list ZOO")
    p.add_argument("--xl", action="store_true", help="GPT-2 XL at batch 8")
    p.add_argument(
        "--llama",
        action="store_true",
        help="the Llama-3-70B and 3.1-405B configurations (XL group)",
    )
    p.add_argument("--depth", action="store_true", help="the linearity series")
    p.add_argument(
        "--only",
        nargs="+",
        help="these models (names from ZOO, XL or DEPTH), instead of --zoo, --xl and --depth",
    )
    p.add_argument("--repeat", type=int, default=3, help="rounds per model (default 3, at least 1)")
    p.add_argument(
        "--out",
        default=str(ROOT / "docs" / "analysis_scale.md"),
        help="the report (default docs/analysis_scale.md): a new file, or one whose generated "
        "part (between the tool's markers) is replaced, the rest kept",
    )
    p.add_argument("--json", default=None, help="also write the raw figures as JSON (for --render)")
    p.add_argument(
        "--profile",
        default=None,
        metavar="OUT.txt",
        help="profile the first selected model's full analysis with pyinstrument (wall clock) "
        "into this file, instead of the report",
    )
    p.add_argument(
        "--floor",
        action="store_true",
        help="print, per selected model, FlopCounterMode against graphflop's trace, plain "
        "make_fx of the forward and a dispatch-mode recorder of the forward (the tracing floor; "
        "the models run one after another in this process; no report written)",
    )
    p.add_argument(
        "--render",
        nargs="+",
        metavar="JSON",
        help="write the report from the --json files of earlier runs (merged), with the run "
        "description they hold, instead of running",
    )
    p.add_argument("--wall", action="store_true", help="time with the wall clock, not CPU time")
    p.add_argument(
        "--rss",
        action="store_true",
        help="print, per selected model, the peak resident memory (ru_maxrss) of one full "
        "analysis in a fresh child process (no report written)",
    )
    p.add_argument(
        "--cli",
        action="store_true",
        help="print the wall-clock time of `graphflop inspect models/mlp.py` against `import "
        "torch` alone, --repeat fresh processes each, alternating (no report written)",
    )
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        return _main(args)
    except UsageError as e:
        print(f"bench_analysis: error: {e}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace) -> int:
    global CLOCK
    if args.wall or os.environ.get("GRAPHFLOP_BENCH_WALL"):
        CLOCK = time.perf_counter
        os.environ["GRAPHFLOP_BENCH_WALL"] = "1"
    if args.child:
        name, spec, kwargs, shapes, batch, repeat = json.loads(args.child)
        shapes = [tuple(s) for s in shapes] if shapes else None
        if repeat == 0:  # --rss: one analysis, its peak memory
            print(json.dumps(rss_child(name, spec, kwargs, shapes, batch)))
        else:
            print(json.dumps(child(name, spec, kwargs, shapes, batch, repeat)))
        return 0
    if args.repeat < 1:
        raise UsageError(f"--repeat {args.repeat}: give 1 or more rounds")
    if args.render:
        _check_output(args.out, "the report")
        results, run = _read_results(args.render)
        out = Path(args.out)
        atomic_write(out, splice(out, report(results["zoo"], results["xl"], results["depth"], run)))
        return 0
    if args.cli:
        for name, ts in cli_times(args.repeat).items():
            print(
                f"{name}: median {statistics.median(ts):.2f} s, min {min(ts):.2f}, "
                f"max {max(ts):.2f} (wall, {len(ts)} runs)",
                flush=True,
            )
        return 0
    zoo, xl, depth = _select(args)
    selected = {**zoo, **xl, **depth}
    if not selected:
        raise UsageError("no model selected: give --zoo, --xl, --llama, --depth or --only NAME ...")
    if args.rss:
        for name, entry in selected.items():
            r = _run_child(name, entry, 0)
            if "error" in r:
                print(f"{name}: failed: {' '.join(r['error'])}", flush=True)
                continue
            print(
                f"{name}: peak RSS {r['maxrss_kb'] / 1024:,.0f} MiB after the analysis "
                f"({r['loaded_maxrss_kb'] / 1024:,.0f} MiB after loading), "
                f"{r['forward_nodes']:,} forward nodes, {r['analysis_s']:.2f} s "
                "(ru_maxrss of a fresh child process)",
                flush=True,
            )
        return 0
    if args.floor or args.profile:
        import torch

        torch.set_num_threads(1)  # as in the children: meta tensors, one thread's CPU time
    if args.floor:
        _print_floor(selected, args.repeat)
        return 0
    if args.profile:
        _check_output(args.profile, "the profile")
        spec, kwargs, shapes, batch = next(iter(selected.values()))
        profile(spec, kwargs, shapes, batch, args.profile)
        return 0
    return _run_report(args, zoo, xl, depth)


def _print_floor(selected: dict, repeat: int) -> None:
    for name, (spec, kwargs, shapes, batch) in selected.items():
        med = floor(spec, kwargs, shapes, batch, repeat)
        cells = ", ".join(f"{k} {v:.3f} s" for k, v in med.items())
        print(
            f"{name}: {cells}; trace / FC fwd+bwd "
            f"{med['graphflop trace'] / med['FC fwd+bwd']:.2f}x, plain make_fx / FC fwd "
            f"{med['plain make_fx fwd'] / med['FC fwd']:.2f}x, dispatch recorder / FC fwd "
            f"{med['dispatch recorder fwd'] / med['FC fwd']:.2f}x",
            flush=True,
        )


def _run_report(args: argparse.Namespace, zoo: dict, xl: dict, depth: dict) -> int:
    """One child per model, then the report (and ``--json``); status 1 when a model failed."""
    out = Path(args.out)
    _check_output(args.out, "the report")
    _check_output(args.json, "the JSON")
    if out.exists():
        splice(out, "")  # refuses a file without the markers before the work
    results: dict[str, list[dict]] = {"zoo": [], "xl": [], "depth": []}
    for part, models in (("zoo", zoo), ("xl", xl), ("depth", depth)):
        for name, entry in models.items():
            print(f"{name} ...", file=sys.stderr, flush=True)
            results[part].append(_run_child(name, entry, args.repeat))
    run = run_description(args.repeat)
    text = report(results["zoo"], results["xl"], results["depth"], run)
    atomic_write(out, splice(out, text))
    if args.json:
        atomic_write(Path(args.json), json.dumps({**results, "run": run}, indent=1))
    print(text)
    failed = [r["name"] for rows in results.values() for r in rows if "error" in r]
    if failed:
        print(
            f"bench_analysis: {len(failed)} model(s) failed: {', '.join(failed)}", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
