"""Timing forward, backprop train step and forward-gradient step on three runtimes:

* ``torch`` — eager PyTorch as a user writes it: ``model(x)`` under ``no_grad``;
  ``loss.backward()`` and a ``torch.optim`` step; ``torch.func.jvp`` with a Gaussian direction
  drawn by ``torch.randn_like`` inside the step, ``g = d·v`` and an SGD update;
* ``graph_torch`` — graphflop's own forward, train-step and forward-gradient-step graphs (the
  fx GraphModules) run eagerly in PyTorch on real tensors;
* ``onnxruntime`` — the same graphs exported to ONNX (:mod:`graphflop.export.onnx`) and run on
  ONNX Runtime, the train step's weight-gradient convolutions written as matrix products
  (:func:`graphflop.passes.conv_wgrad.conv_weight_grads_as_mm`: same FLOPs; see
  :data:`ORT_REWRITE`).

On every runtime the forward-gradient step samples its direction inside the timed call
(``sampling_in_step``): eagerly with ``torch.randn_like``; in graphflop's graph with its
``aten.randn`` nodes, which export as ONNX ``RandomNormalLike`` nodes, so ONNX Runtime draws
them inside its run. The graph runtimes return the new parameters (no copy back); eager
PyTorch updates them in place.

Method: ``warmup`` untimed rounds, then ``repeat`` timed rounds; each round runs every phase
once (alternating, :func:`graphflop.runtime.timing.time_phases`), cycling through ``rotate``
input sets (so caches don't flatter). Each phase reports the median and quartiles of wall time;
a phase whose interquartile range exceeds 20% of its median is flagged ``noisy``. CUDA work is
synchronised before each clock read. ``Rf`` = forward-gradient step / forward, ``Rb`` = train
step / forward (seed B's definitions); achieved FLOP/s use graphflop's own FLOP counts of the
same phase.
"""

from __future__ import annotations

import contextlib
import functools
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from graphflop.frontend.loss import loss_output, loss_value
from graphflop.meta import LOSS_KIND, SIGNATURE, UPDATE
from graphflop.runtime.attention import eager_jvp, has_fused_rnn
from graphflop.runtime.timing import Timing, time_fn, time_phases

__all__ = [
    "PHASES",
    "RUNTIMES",
    "BenchError",
    "Timing",
    "bench_graph_torch",
    "bench_onnxruntime",
    "bench_torch",
    "time_fn",
]

if TYPE_CHECKING:
    from graphflop.analysis import Analysis

PHASES = ("forward", "train_step", "forward_gradient_step")
#: the runtimes ``graphflop bench`` times, in the order reported
RUNTIMES = ("torch", "graph_torch", "onnxruntime")
#: what the onnxruntime runtime changes in graphflop's graphs before exporting them
ORT_REWRITE = (
    "the train step's weight-gradient convolutions, where it has any (kernel as large as the "
    "feature map, k×k output), as one matrix product per output position: the same FLOPs; ONNX Runtime's CPU "
    "Conv runs that shape several times slower than a forward convolution"
)
#: how each runtime draws the forward-gradient step's direction, inside the timed step
SAMPLING = {
    "torch": "torch.randn_like per parameter inside the timed step",
    "graph_torch": "the aten.randn nodes of graphflop's forward-gradient graph",
    "onnxruntime": "the exported graph's RandomNormalLike nodes, inside the timed run",
}


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
    ``torch.func.jvp`` with a Gaussian direction drawn inside the step, ``g = d·v`` and an SGD
    update (phases alternate, :func:`~graphflop.runtime.timing.time_phases`).

    The loss is the analysis's (cross-entropy or MSE against random valid targets, else the
    sum of the first output); the optimizer is :func:`~graphflop.runtime.optim.torch_optimizer`
    with graphflop's constants. Floating-point buffers (BatchNorm running statistics) enter
    ``torch.func.jvp`` as primals with zero tangents, so their in-place updates happen on the
    jvp's own inputs (``torch.func`` refuses to mutate captured tensors with dual values);
    integer ones (``num_batches_tracked``) are cloned inside and copied back. ``torch.func.jvp`` applies PyTorch's
    forward-AD formulas, which also multiply the model input's zero tangent in the first layer:
    work graphflop skips (its report's ``jvp.skipped_flops``). Returns the :class:`Timing` of
    each of :data:`PHASES`.
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
    sync = torch.cuda.synchronize if device == "cuda" else _nop
    opt = torch_optimizer(optimizer, model.parameters(), lr)

    def forward(i):
        with torch.no_grad():
            model(*xs[i % rotate])

    def train_step(i):
        opt.zero_grad(set_to_none=True)
        loss_value(kind, loss_output(model(*xs[i % rotate])), ts[i % rotate]).backward()
        opt.step()

    params = {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}
    buffers = {k: b for k, b in model.named_buffers() if b.is_floating_point()}
    counters = {k: b for k, b in model.named_buffers() if not b.is_floating_point()}
    zero_buffers = {k: torch.zeros_like(b) for k, b in buffers.items()}

    rnn = has_fused_rnn(model)

    def fg_step(i):
        x, t = xs[i % rotate], ts[i % rotate]

        def f(p, b):
            c = {k: n.clone() for k, n in counters.items()}  # made inside: may be mutated
            out = torch.func.functional_call(model, (p, b, c), tuple(x))
            return loss_value(kind, loss_output(out), t), c

        v = {k: torch.randn_like(p) for k, p in params.items()}
        with eager_jvp(device, rnn):  # fused attention and RNN kernels: no forward AD
            # torch.func.jvp's return type is a 2- or 3-tuple whatever has_aux says
            _, d, c = torch.func.jvp(f, (params, buffers), (v, zero_buffers), has_aux=True)  # type: ignore[misc]
        with torch.no_grad():
            for k, n in c.items():
                counters[k].copy_(n)
            for k, p in params.items():
                p.sub_(lr * d * v[k])

    try:
        return time_phases(
            {"forward": forward, "train_step": train_step, "forward_gradient_step": fg_step},
            warmup=warmup,
            repeat=repeat,
            sync=sync,
        )
    except RuntimeError as e:
        from graphflop.runtime.inplace import OUT_OF_PLACE, inplace_reason, inplace_refusal

        if not inplace_refusal(e):
            raise
        raise BenchError(
            f"the torch runtime's train step (eager PyTorch's backward) refuses the model: "
            f"{inplace_reason(e)}; {OUT_OF_PLACE}, or time graphflop's functional graphs "
            "alone with --runtime graph_torch or onnxruntime"
        ) from e


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


def _nop() -> None:
    pass


def _ort_call(kind: str, provider: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, with ONNX Runtime's "no kernel for this type" errors as :class:`BenchError`.

    ONNX Runtime's CPU provider lacks float16/bfloat16 kernels for ops the step graphs use
    (``Neg``, ``ScatterElements`` with ``add``): the message then says what to use instead.
    """
    from graphflop.runtime.onnxrt import no_kernel

    try:
        return fn()
    except Exception as e:
        text = " ".join(str(e).split())
        if no_kernel(e):
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


def _step_feeds(
    graphs: dict[str, Any], analysis: Analysis, model: torch.nn.Module, rotate: int, lr: float
) -> dict[str, list[list[torch.Tensor]]]:
    """For each graph (by kind), ``rotate`` argument lists in placeholder order, labelled as the
    exported inputs are (:func:`graphflop.export.onnx.graph_io_names`, :func:`_feed`).

    Raises:
        BenchError: a graph input with no known value.
    """
    from graphflop.export.onnx import graph_io_names

    sig = analysis.forward.meta[SIGNATURE]
    labelled = [_labelled(s, sig) for s in _input_sets(analysis.forward, model, rotate, "cpu")]
    upd = analysis.update.meta[UPDATE] if analysis.update is not None else None
    state_labels = set(upd.state_labels) if upd else set()
    out: dict[str, list[list[torch.Tensor]]] = {}
    for kind, gm in graphs.items():
        names = graph_io_names(kind, gm)[0]
        out[kind] = []
        for by_label in labelled:
            args = [_feed(n, by_label, state_labels, lr) for n in names]
            missing = [n for n, a in zip(names, args) if a is None]
            if missing:
                raise BenchError(f"no value for the {kind} graph's input {missing[0]!r}")
            out[kind].append([a for a in args if a is not None])
    return out


def bench_graph_torch(
    analysis: Analysis,
    model: torch.nn.Module,
    *,
    device: str,
    warmup: int,
    repeat: int,
    rotate: int,
    lr: float = 1e-3,
) -> dict[str, Timing]:
    """graphflop's forward, train-step and forward-gradient-step graphs
    (:func:`graphflop.runtime.graphs.step_graphs` with ``sampling=True``) run as fx
    GraphModules on real tensors on ``device`` under ``torch.no_grad`` (phases alternate).

    The same graphs and feeds as :func:`bench_onnxruntime`; the forward-gradient step samples
    its direction with its own ``aten.randn`` nodes. Returns the :class:`Timing` of each of
    :data:`PHASES`.
    """
    from graphflop.runtime.graphs import on_device, step_graphs

    graphs = step_graphs(analysis, kinds=PHASES, sampling=True)
    feeds = _step_feeds(graphs, analysis, model, rotate, lr)
    feeds = {k: [[a.to(device) for a in args] for args in v] for k, v in feeds.items()}
    graphs = {k: on_device(gm, device) for k, gm in graphs.items()}
    sync = torch.cuda.synchronize if device == "cuda" else _nop

    def runner(kind: str) -> Callable[[int], Any]:
        gm, args = graphs[kind], feeds[kind]

        def fn(i: int) -> Any:
            with torch.no_grad():
                return gm(*args[i % rotate])

        return fn

    return time_phases(
        {k: runner(k) for k in PHASES if k in graphs}, warmup=warmup, repeat=repeat, sync=sync
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
    wgrad_mm: bool = True,
    peaks: dict[str, Any] | None = None,
) -> tuple[dict[str, Timing], dict]:
    """graphflop's forward, train-step and forward-gradient-step graphs
    (:func:`graphflop.runtime.graphs.step_graphs` with ``sampling=True``: the step draws its
    direction inside, ONNX ``RandomNormalLike``), exported to ONNX and run on ONNX Runtime with
    ``provider`` (phases alternate).

    Args:
        analysis: the model's analysis; ``model``: the same model with real weights.
        warmup, repeat, rotate: see :func:`~graphflop.runtime.timing.time_phases` and the
            module docstring.
        lr: the learning rate fed to the step graphs.
        profile: also record ONNX Runtime's per-node profile.
        export_dir: keep the ONNX files in ``export_dir/onnx`` and, with ``profile``, ONNX
            Runtime's profile files in ``export_dir/profile`` (default: a temporary folder,
            removed afterwards; nothing is written into the current directory).
        wgrad_mm: the train step's weight-gradient convolutions as matrix products
            (:func:`graphflop.passes.conv_wgrad.conv_weight_grads_as_mm`: same FLOPs; ONNX
            Runtime's CPU ``Conv`` is slow on their feature-map-sized kernels).
        peaks: a dict to fill, on the CPU provider, with each phase's
            :class:`~graphflop.runtime.ort_memory.OrtPeak` (measured ONNX Runtime peak and
            graphflop's figure for the order ONNX Runtime ran; one extra untimed run per
            phase on the first input set, in a session of its own).

    Returns:
        The :class:`Timing` of each phase, and with ``profile`` per-node and per-module times
        mapped through the export manifest (see :func:`graphflop.runtime.onnxrt.profile_times`), else ``{}``.

    Raises:
        OnnxExportError: a graph cannot be exported.
        BenchError: ONNX Runtime has no kernel for an op of the graphs at this dtype.
    """
    from graphflop.export.onnx import export_all, graph_io_names
    from graphflop.runtime.graphs import step_graphs
    from graphflop.runtime.onnxrt import as_declared, profile_times, session

    with contextlib.ExitStack() as stack:
        keep = export_dir is not None
        if export_dir is None:
            export_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="graphflop-bench-"))
        root = Path(export_dir) / "onnx"
        graphs = step_graphs(analysis, kinds=PHASES, sampling=True, wgrad_mm=wgrad_mm)
        manifest = export_all(graphs, root, name=analysis.name)
        feeds = _step_feeds(graphs, analysis, model, rotate, lr)
        prof_dir = Path(export_dir) / "profile"
        if profile:
            prof_dir.mkdir(parents=True, exist_ok=True)
        sessions, arrays = {}, {}
        for kind, g in manifest["graphs"].items():
            sessions[kind] = sess = _ort_call(
                kind,
                provider,
                functools.partial(
                    session,
                    root / g["file"],
                    provider,
                    profile=str(prof_dir / kind) if profile else False,
                ),
            )
            # the feeds are labelled as graphflop's inputs; a constant the model made is in
            # the file (an initializer), not among the session's inputs
            names = graph_io_names(kind, graphs[kind])[0]
            declared = {i.name for i in sess.get_inputs()}
            arrays[kind] = [
                as_declared(sess, {n: a.numpy() for n, a in zip(names, args) if n in declared})
                for args in feeds[kind]
            ]

        def runner(kind: str) -> Callable[[int], Any]:
            sess, f = sessions[kind], arrays[kind]
            return lambda i: sess.run(None, f[i % rotate])

        timings = _ort_call(
            "step",
            provider,
            lambda: time_phases(
                {k: runner(k) for k in sessions}, warmup=warmup, repeat=repeat, sync=_nop
            ),
        )
        if peaks is not None and provider == "CPUExecutionProvider":
            import onnx

            from graphflop.runtime.ort_memory import measure

            for kind, g in manifest["graphs"].items():
                peaks[kind] = measure(onnx.load(str(root / g["file"])), arrays[kind][0])
        prof = {}
        if profile:
            for kind, sess in sessions.items():
                trace = sess.end_profiling()
                prof[kind] = profile_times(
                    trace, manifest["graphs"][kind]["nodes"], repeat + warmup, keep=keep
                )
        sessions.clear()
    return timings, prof


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


def round_ratios(t: dict[str, Timing]) -> dict[str, dict[str, float] | None]:
    """Median and quartiles of Rf, Rb and Rf/Rb taken round by round (the phases alternate:
    round ``i``'s forward, train step and forward-gradient step ran back to back)."""
    from graphflop.runtime.timing import round_ratio

    f, tr, fg = (t.get(k) for k in PHASES)
    pairs = {"Rf": (fg, f), "Rb": (tr, f), "Rf_over_Rb": (fg, tr)}
    out: dict[str, dict[str, float] | None] = {}
    for name, (num, den) in pairs.items():
        r = round_ratio(num, den) if num is not None and den is not None else None
        out[name] = {"median": r.median_s, "q1": r.q1_s, "q3": r.q3_s} if r else None
    return out


#: how ``bench`` measures and predicts the ONNX Runtime peaks it reports
ORT_MEMORY_METHOD = (
    "one untimed run per phase in a session with the same optimization level and execution "
    "order, memory patterns off: peak_bytes is the largest sum of tensor bytes ONNX Runtime's "
    "CPU arena holds after a kernel (profile counters, above what was held before the run; "
    "feeds and initializers excluded), arena_peak_bytes the arena's chunk peak (with its "
    "unsplit remainders); predicted_peak_bytes is graphflop's live-bytes peak over the node "
    "order ONNX Runtime ran (its profile) on its optimized graph, own_order_peak_bytes the "
    "same over the exported graph in graphflop's node order (docs/memory_ort.md)"
)


def timing_report(
    t: dict[str, Timing],
    flops: dict[str, int],
    runtime: str | None = None,
    peaks: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON form of one runtime's timings (``bench --json``'s ``runtimes.<name>``).

    Returns:
        ``{"phases": {phase: {median_s, q1_s, q3_s, runs, iqr_over_median, noisy,
        flops_per_s}}, "ratios": {Rf, Rb, Rf_over_Rb}, "round_ratios": {Rf: {median, q1, q3},
        …}}``, and for a runtime of :data:`SAMPLING` ``sampling_in_step: true`` and
        ``sampling`` (how the direction is drawn). ``flops_per_s`` is the phase's FLOPs
        (``flops``) over its median wall time (None for a zero time); ``ratios`` are ratios of
        medians, ``round_ratios`` the statistics of the per-round ratios. With ``peaks``
        (phase → :class:`~graphflop.runtime.ort_memory.OrtPeak`, from
        :func:`bench_onnxruntime`) each phase also has the peak's fields (``peak_bytes``
        measured, ``predicted_peak_bytes``, …, bytes) and the report ``memory_method``.
    """
    out: dict[str, Any] = {
        "phases": {
            k: {**v.to_dict(), "flops_per_s": flops[k] / v.median_s if v.median_s else None}
            for k, v in t.items()
        },
        "ratios": ratios(t),
        "round_ratios": round_ratios(t),
    }
    if runtime in SAMPLING:
        out |= {"sampling_in_step": True, "sampling": SAMPLING[runtime]}
    if runtime == "onnxruntime":
        out["graph_rewrite"] = ORT_REWRITE
    if peaks:
        for k, p in peaks.items():
            if k in out["phases"]:
                out["phases"][k] |= p.to_dict()
        out["memory_method"] = ORT_MEMORY_METHOD
    return out


def method_note(*, warmup: int, repeat: int, rotate: int) -> str:
    """One line saying how the phases were timed (``bench --json``'s ``method``)."""
    return (
        f"{warmup} warm-up rounds, then {repeat} timed rounds, each running every phase once "
        f"(alternating), over {rotate} rotating input sets; median and quartiles; a phase "
        "whose quartiles span more than 20% of its median is flagged noisy"
    )


def pick_devices(
    device: str | None, runtimes: tuple[str, ...] = ("torch", "graph_torch", "onnxruntime")
) -> tuple[str, str]:
    """The ONNX Runtime execution provider and the PyTorch device for ``device``.

    Args:
        device: ``cpu``, ``cuda`` or None (CUDA when ONNX Runtime's CUDA provider or PyTorch's
            CUDA works, else the CPU).
        runtimes: the runtimes that will run (``torch``, ``graph_torch``, ``onnxruntime``):
            ``cuda`` needs ONNX Runtime's CUDA provider for ``onnxruntime`` and PyTorch's CUDA
            for the other two; without ``onnxruntime`` the provider is the CPU's, unused.

    Returns:
        ``(provider, torch_device)``.

    Raises:
        DeviceError: ``device="cuda"`` and what a chosen runtime needs does not work, naming it.
    """
    from graphflop.runtime.onnxrt import DeviceError, pick_provider

    uses_torch = any(rt != "onnxruntime" for rt in runtimes)
    if device == "cuda" and uses_torch and not torch.cuda.is_available():
        raise DeviceError(
            "PyTorch has no CUDA device here (torch.cuda.is_available() is False: no GPU, or a "
            "CPU build of torch), which the torch and graph_torch runtimes need; use --device cpu"
        )
    if "onnxruntime" not in runtimes:
        return "CPUExecutionProvider", device or ("cuda" if torch.cuda.is_available() else "cpu")
    provider = pick_provider(device)
    torch_device = device or (
        "cuda" if provider == "CUDAExecutionProvider" or torch.cuda.is_available() else "cpu"
    )
    return provider, torch_device
