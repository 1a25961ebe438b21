"""Timing forward, backprop train step and forward-gradient step, on ONNX Runtime (graphflop's
exported graphs) and in eager PyTorch (autograd and ``torch.func.jvp``, as a user writes them).

Method: for each phase, ``warmup`` untimed runs, then ``repeat`` timed runs cycling through
``rotate`` different input sets (so caches don't flatter); the median and the spread
(interquartile range) of wall time are reported. CUDA work is synchronised before each clock
read. ``Rf`` = forward-gradient step / forward, ``Rb`` = train step / forward (seed B's
definitions); achieved FLOP/s use graphflop's own FLOP counts of the same phase.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from graphflop.frontend.trace import loss_value
from graphflop.meta import LOSS_KIND, SIGNATURE, UPDATE

if TYPE_CHECKING:
    from graphflop.analysis import Analysis

PHASES = ("forward", "train_step", "forward_gradient_step")


class BenchError(ValueError):
    """A benchmark that cannot run as asked (no trainable parameters, more memory than there
    is); the message says what to change."""


def available_memory(device: str = "cpu") -> int | None:
    """Bytes available for new allocations on ``device``: ``MemAvailable`` of
    ``/proc/meminfo`` (else ``os.sysconf``'s available pages) for the CPU, free memory for
    CUDA; None when unknown."""
    import os

    if device == "cuda":
        try:
            return int(torch.cuda.mem_get_info()[0])
        except Exception:
            return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def bench_memory_bytes(analysis: Analysis, rotate: int) -> int:
    """Estimated peak bytes of one runtime's benchmark: the largest phase peak of the
    analysis's memory report (forward, train step, JVP; parameters, gradients and optimizer
    state included) plus ``rotate`` input sets, each a copy of the inputs, targets and
    parameters (:func:`_input_sets`)."""
    m = analysis.report.memory
    peak = max(
        v for v in (m.forward_peak_bytes, m.train_peak_bytes, m.jvp_peak_bytes) if v is not None
    )
    sig = analysis.forward.meta[SIGNATURE]
    wanted = set(sig.inputs) | set(sig.targets)
    data = sum(
        n.meta["val"].numel() * n.meta["val"].element_size()
        for n in analysis.forward.graph.nodes
        if n.op == "placeholder" and n.name in wanted and "val" in n.meta
    )
    return peak + rotate * (data + m.params_bytes)


def check_memory(analysis: Analysis, rotate: int, device: str) -> None:
    """Refuse, before anything is allocated, a benchmark whose estimated memory
    (:func:`bench_memory_bytes`) exceeds what ``device`` has available.

    Raises:
        BenchError: with both figures in bytes and what to change.
    """
    need = bench_memory_bytes(analysis, rotate)
    have = available_memory(device)
    if have is not None and need > have:
        raise BenchError(
            f"the benchmark needs about {need:,} bytes ({need / 2**30:,.1f} GiB: the largest "
            f"phase peak plus {rotate} input sets), more than the {have:,} bytes "
            f"({have / 2**30:,.1f} GiB) available on {device}; lower --batch or --rotate"
        )


def trainable(model: torch.nn.Module) -> None:
    """Refuse to time a train step of a model without trainable parameters.

    Raises:
        BenchError: no parameters, or all of them frozen.
    """
    from graphflop.load import untrainable

    why = untrainable(model)
    if why is not None:
        raise BenchError(
            f"the model has {why}: bench times a train step and a forward-gradient step, which "
            "update trainable parameters; use graphflop inspect --no-backward for its forward"
        )


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


def _input_sets(forward, model, rotate: int, device) -> list[dict[str, torch.Tensor]]:
    from graphflop.runtime.verify import real_arguments

    sets = []
    for k in range(rotate):
        v = real_arguments(forward, model, seed=k)
        sets.append({n: t.to(device) for n, t in v.items()})
    return sets


def bench_torch(
    analysis: Analysis,
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
    ``torch.func.jvp`` with a Gaussian direction, ``g = d·v`` and an SGD update.

    The loss is the analysis's (cross-entropy or MSE against random valid targets, else the
    sum of the first output); the optimizer is :func:`~graphflop.runtime.optim.torch_optimizer`
    with graphflop's constants. Returns the :class:`Timing` of each of :data:`PHASES`.
    """
    from graphflop.runtime.optim import torch_optimizer

    fwd = analysis.forward
    sig = fwd.meta[SIGNATURE]
    kind = fwd.meta.get(LOSS_KIND, "sum")
    kind = kind if kind in ("cross_entropy", "mse") else "sum"
    model = model.to(device)
    sets = _input_sets(fwd, model, rotate, device)
    xs = [[s[n] for n in sig.inputs] for s in sets]
    ts = [tuple(s[n] for n in sig.targets[:1]) for s in sets]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    opt = torch_optimizer(optimizer, model.parameters(), lr)

    def forward(i):
        with torch.no_grad():
            model(*xs[i % rotate])

    def train_step(i):
        opt.zero_grad(set_to_none=True)
        loss_value(kind, first_output(model(*xs[i % rotate])), ts[i % rotate]).backward()
        opt.step()

    params = {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}
    buffers = dict(model.named_buffers())

    def fg_step(i):
        x, t = xs[i % rotate], ts[i % rotate]

        def f(p):
            out = torch.func.functional_call(model, (p, buffers), tuple(x))
            return loss_value(kind, first_output(out), t)

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


def first_output(out: Any) -> torch.Tensor:
    """The first tensor of a model's output (a tensor, or a tuple, list or dict of them, in
    ``torch.utils._pytree`` order: the output the traced loss starts from)."""
    from torch.utils._pytree import tree_leaves

    return next(t for t in tree_leaves(out) if isinstance(t, torch.Tensor))


def _labelled(values: dict[str, torch.Tensor], sig) -> dict[str, torch.Tensor]:
    """One input set by the exported graphs' input names: parameter and buffer qualified
    names, ``input_<j>``, ``target`` (``target_<j>``), and the placeholder names."""
    qual = dict(sig.params)
    out = {qual.get(n, n): v for n, v in values.items()}
    for j, n in enumerate(sig.inputs):
        out[f"input_{j}"] = values[n]
    for j, n in enumerate(sig.targets):
        out["target" if len(sig.targets) == 1 else f"target_{j}"] = values[n]
    for n, q in sig.buffers:
        out.setdefault(q, values[n])
    return out


def _feed(name: str, by_label, state_labels: set[str], lr: float) -> torch.Tensor | None:
    """The value fed to the exported input ``name``: the input set's, ``lr``, Adam's first
    ``step``, zero optimizer state, or a Gaussian direction (None: unknown input)."""
    if name in by_label:
        return by_label[name]
    if name == "lr":
        return torch.tensor(lr)
    if name == "step":
        return torch.tensor(1.0)
    if name in state_labels:
        return torch.zeros_like(by_label[name.split(".", 1)[1]])
    if name.startswith("direction"):
        return torch.randn_like(by_label[name.split(".", 1)[1]])
    return None


def _onnx_feeds(names: list[str], by_label, state_labels: set[str], lr: float) -> dict[str, Any]:
    feeds = {n: _feed(n, by_label, state_labels, lr) for n in names}
    return {k: v.numpy() for k, v in feeds.items() if v is not None}


#: ONNX Runtime's input type names → numpy dtypes, for the feeds made in float32
_ORT_TYPES = {
    "tensor(float16)": "float16",
    "tensor(float)": "float32",
    "tensor(double)": "float64",
}


def _as_declared(sess, feeds: dict[str, Any]) -> dict[str, Any]:
    """``feeds`` with floating arrays cast to the type each session input declares (the
    learning rate and Adam's step are made in float32 whatever the model's ``--dtype``)."""
    declared = {i.name: _ORT_TYPES.get(i.type) for i in sess.get_inputs()}
    return {
        k: v.astype(declared[k]) if declared.get(k) and v.dtype.kind == "f" else v
        for k, v in feeds.items()
    }


def _nop() -> None:
    pass


def _ort_call(kind: str, provider: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, with ONNX Runtime's "no kernel for this type" errors as :class:`BenchError`.

    ONNX Runtime's CPU provider lacks float16/bfloat16 kernels for ops the step graphs use
    (``Neg``, ``ScatterElements`` with ``add``): the message then says what to use instead.
    """
    try:
        return fn()
    except Exception as e:
        text = " ".join(str(e).split())
        if type(e).__name__ == "NotImplemented" or "not supported" in text:
            raise BenchError(
                f"ONNX Runtime ({provider}) cannot run the {kind} graph: {text[:300]}; "
                "use --runtime torch, or --dtype float32"
            ) from e
        raise


def low_precision_on_cpu(dtype: torch.dtype | None, provider: str) -> None:
    """Refuse float16/bfloat16 on ONNX Runtime's CPU provider before any work: it has no
    kernels of those types for ops every step graph uses (``Neg``; ``ScatterElements`` with
    ``add`` in float16).

    Raises:
        BenchError: naming the dtype and what to use instead.
    """
    if dtype in (torch.float16, torch.bfloat16) and provider == "CPUExecutionProvider":
        raise BenchError(
            f"ONNX Runtime's CPU provider has no {str(dtype).removeprefix('torch.')} kernels "
            "for ops of the step graphs (Neg, ScatterElements add): use --runtime torch, "
            "--device cuda, or --dtype float32"
        )


def bench_onnxruntime(
    analysis: Analysis,
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
    """graphflop's forward, train-step and forward-gradient-step graphs
    (:func:`graphflop.runtime.graphs.step_graphs`), exported to ONNX and run on ONNX Runtime
    with ``provider``.

    Args:
        analysis: the model's analysis; ``model``: the same model with real weights.
        warmup, repeat, rotate: see :func:`time_fn` and the module docstring.
        lr: the learning rate fed to the step graphs.
        profile: also record ONNX Runtime's per-node profile.
        export_dir: keep the ONNX files in ``export_dir/onnx`` (default: a temporary folder).

    Returns:
        The :class:`Timing` of each phase, and with ``profile`` per-node and per-module times
        mapped through the export manifest (see :func:`_node_times`), else ``{}``.

    Raises:
        OnnxExportError: a graph cannot be exported.
    """
    from graphflop.export.onnx import export_all
    from graphflop.runtime.graphs import step_graphs
    from graphflop.runtime.onnxrt import session

    sig = analysis.forward.meta[SIGNATURE]
    with contextlib.ExitStack() as stack:
        if export_dir is None:
            export_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="graphflop-bench-"))
        root = Path(export_dir) / "onnx"
        manifest = export_all(step_graphs(analysis, kinds=PHASES), root, name=analysis.name)
        labelled = [_labelled(s, sig) for s in _input_sets(analysis.forward, model, rotate, "cpu")]
        upd = analysis.update.meta[UPDATE] if analysis.update is not None else None
        state_labels = set(upd.state_labels) if upd else set()
        timings, prof = {}, {}
        for kind, g in manifest["graphs"].items():
            sess = _ort_call(
                kind, provider, lambda f=g["file"]: session(root / f, provider, profile=profile)
            )
            feeds = [
                _as_declared(sess, _onnx_feeds(g["inputs"], b, state_labels, lr)) for b in labelled
            ]
            timings[kind] = _ort_call(
                kind,
                provider,
                lambda s=sess, f=feeds: time_fn(
                    lambda i: s.run(None, f[i % rotate]), warmup=warmup, repeat=repeat, sync=_nop
                ),
            )
            if profile:
                prof[kind] = _node_times(sess.end_profiling(), g["nodes"], repeat + warmup)
            del sess
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


def phase_flops(analysis: Analysis) -> dict[str, int]:
    """graphflop's FLOPs of each of :data:`PHASES`, from ``analysis``'s report totals.

    Raises:
        KeyError: the analysis has no backward or no forward-gradient step (the phase's name).
    """
    totals = analysis.report.totals
    out: dict[str, int] = {}
    for k in PHASES:
        phase = getattr(totals, k)
        if phase is None:
            raise KeyError(k)
        out[k] = phase.flops
    return out


def timing_report(t: dict[str, Timing], flops: dict[str, int]) -> dict[str, Any]:
    """The JSON form of one runtime's timings (``bench --json``'s ``runtimes.<name>``).

    Returns:
        ``{"phases": {phase: {median_s, q1_s, q3_s, runs, flops_per_s}}, "ratios": {Rf, Rb,
        Rf_over_Rb}}``; ``flops_per_s`` is the phase's FLOPs (``flops``) over its median
        wall time (None for a zero time).
    """
    return {
        "phases": {
            k: {**v.to_dict(), "flops_per_s": flops[k] / v.median_s if v.median_s else None}
            for k, v in t.items()
        },
        "ratios": ratios(t),
    }


def method_note(*, warmup: int, repeat: int, rotate: int) -> str:
    """One line saying how the phases were timed (``bench --json``'s ``method``)."""
    return (
        f"{warmup} warm-up runs, then {repeat} timed runs "
        f"over {rotate} rotating input sets; median and quartiles"
    )


def pick_devices(device: str | None) -> tuple[str, str]:
    """The ONNX Runtime execution provider and the PyTorch device for ``device``.

    Args:
        device: ``cpu``, ``cuda`` or None (CUDA when ONNX Runtime's CUDA provider or PyTorch's
            CUDA works, else the CPU).

    Returns:
        ``(provider, torch_device)``.

    Raises:
        DeviceError: ``device="cuda"`` and ONNX Runtime's CUDA provider does not work.
    """
    from graphflop.runtime.onnxrt import pick_provider

    provider = pick_provider(device)
    torch_device = device or (
        "cuda" if provider == "CUDAExecutionProvider" or torch.cuda.is_available() else "cpu"
    )
    return provider, torch_device
