"""Live bytes over a step: the schedules behind the reported memory peaks, step by step.

:func:`memory_timeline` rebuilds, from an :class:`~graphflop.analysis.Analysis`, the same
schedules :mod:`graphflop.passes.summary` takes the reported peaks from (the eager model's
:func:`~graphflop.passes.eager_memory.eager_train_schedule` and
:func:`~graphflop.passes.eager_memory.eager_jvp_schedule`, or the graph model's
:func:`~graphflop.passes.memory.train_schedule` and :func:`~graphflop.passes.memory.jvp_schedule`;
:func:`~graphflop.passes.memory.forward_schedule` where no backward was built) and returns the
bytes live at each of their steps, the phase each step belongs to and the tensors live at the
peak. The always-live part (parameters; gradients where they are live from the start; optimizer
state; JVP tangents of the parameters) is a constant baseline worked out from the report's own
figures, so the largest entry of a timeline equals the reported peak only if the schedule and
the baseline agree with the summary (``tests/test_memory_plot.py`` checks that they do).
``graphflop inspect --plot-memory`` draws these timelines (:mod:`graphflop.export.memory_plot`).
Reads ``val``, ``MODULE``, ``SOURCE``, ``KIND`` and ``SIGNATURE``; writes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.fx import GraphModule, Node

from graphflop.meta import KIND, MODULE, SOURCE
from graphflop.passes.flops import tensor_bytes
from graphflop.passes.memory import Schedule, forward_schedule, jvp_schedule, train_schedule

if TYPE_CHECKING:
    from graphflop.analysis import Analysis

__all__ = ["LiveTensor", "Timeline", "memory_timeline"]

#: schedule key prefix -> phase name
PHASES = {"f": "forward", "b": "backward", "u": "update", "j": "jvp"}


@dataclass(frozen=True)
class LiveTensor:
    """One storage live at a timeline's peak (or one kernel's temporaries).

    Attributes:
        name: the node that allocated it (``optimizer`` for the update's temporaries), with
            `` (temporaries)`` appended for the kernel temporaries of the peak step.
        phase: ``forward``, ``backward``, ``update`` or ``jvp``: the graph that allocated it.
        module: the ``nn.Module`` path the node belongs to (``""``: the model's own code, or
            unknown).
        shape: the node's value's shape, or None (temporaries, multi-output nodes).
        dtype: the node's value's dtype (``float32``), or ``""``.
        nbytes: bytes the memory model counts for it (may differ from shape × itemsize: eager
            CPU dropout keeps a float mask where the graph has a bool one).
    """

    name: str
    phase: str
    module: str
    shape: tuple[int, ...] | None
    dtype: str
    nbytes: int


@dataclass(frozen=True)
class Timeline:
    """Bytes live over one schedule (the training step, a forward-only run or the JVP).

    Attributes:
        kind: ``train``, ``forward`` or ``jvp``: the figure it draws (``train_peak_bytes``,
            ``forward_peak_bytes``, ``jvp_peak_bytes``).
        baseline_bytes: bytes live throughout (not scheduled), the sum of ``baseline``.
        baseline: what the baseline holds, name -> bytes (``parameters``, ``gradients``,
            ``optimizer state``, ``parameter tangents``).
        live_bytes: bytes of the scheduled storages live at each step (activations, saved
            tensors, gradients as produced, temporaries), the baseline excluded; one entry per
            schedule step.
        phases: (phase, first step, last step + 1) for each phase in order, covering every
            step.
        peak_bytes: ``baseline_bytes + max(live_bytes)``: the reported figure.
        peak_step: index of the first step where ``live_bytes`` is largest.
        peak_tensors: every storage live at ``peak_step`` (and the step's kernel temporaries),
            largest first.
        describes: the execution the figure describes, in the report's words.
    """

    kind: str
    baseline_bytes: int
    baseline: dict[str, int]
    live_bytes: tuple[int, ...]
    phases: tuple[tuple[str, int, int], ...]
    peak_bytes: int
    peak_step: int
    peak_tensors: tuple[LiveTensor, ...]
    describes: str


def memory_timeline(analysis: Analysis) -> list[Timeline]:
    """The live bytes behind an analysis's reported memory peaks, step by step.

    Returns:
        One :class:`Timeline` per figure: the training step (``train``: forward, backward,
        update) where a backward was built, else the forward alone (``forward``); then the JVP
        (``jvp``) where a JVP graph was built. Bytes throughout; steps are the schedule's
        (one per graph node, in the order the memory model runs them).

    Raises:
        ValueError: the report's memory model is ``compiled``: its train peak comes from
            torch.compile's partitioned graphs, which the analysis does not keep.
    """
    mem = analysis.report.memory
    model = mem.memory_model or "graph"
    if model == "compiled":
        raise ValueError(
            "the compiled memory model's train peak comes from torch.compile's partitioned "
            "graphs, which the analysis does not keep: use memory_model eager or graph"
        )
    device = mem.device or "cpu"
    describes = mem.describes or {}
    params = {"parameters": mem.params_bytes}
    if mem.buffers_bytes:  # held for the module's life, as the parameters are
        params["buffers"] = mem.buffers_bytes
    out = []
    if analysis.backward is not None and mem.train_peak_bytes is not None:
        base = dict(params)
        if model == "graph" or mem.keep_grads:  # else gradients are scheduled as produced
            base["gradients"] = mem.grads_bytes or 0
        base["optimizer state"] = mem.optimizer_state_bytes or 0
        if model == "eager":
            from graphflop.passes.eager_memory import eager_train_schedule

            sched = eager_train_schedule(
                analysis.forward,
                analysis.backward,
                analysis.report.optimizer or "sgd",
                device,
                bool(mem.keep_grads),
            )
        else:
            sched = train_schedule(analysis.forward, analysis.backward, analysis.update)
        out.append(_timeline("train", sched, base, analysis, describes.get("train_peak_bytes")))
    else:
        sched = forward_schedule(analysis.forward)
        out.append(
            _timeline("forward", sched, params, analysis, describes.get("forward_peak_bytes"))
        )
    if analysis.jvp is not None and mem.jvp_peak_bytes is not None:
        tangents = sum(
            tensor_bytes(n.meta["val"])
            for n in analysis.jvp.graph.nodes
            if n.op == "placeholder" and n.meta.get(KIND) == "tangent"
        )
        if model == "eager":
            from graphflop.passes.eager_memory import eager_jvp_schedule

            sched = eager_jvp_schedule(analysis.jvp, device)
        else:
            sched = jvp_schedule(analysis.jvp)
        base = params | {"parameter tangents": tangents}
        out.append(_timeline("jvp", sched, base, analysis, describes.get("jvp_peak_bytes")))
    return out


def _timeline(
    kind: str, sched: Schedule, base: dict[str, int], analysis: Analysis, describes: str | None
) -> Timeline:
    live = sched.timeline()
    top = max(live, default=0)
    at = live.index(top) if live else 0
    phases: list[tuple[str, int, int]] = []
    for i, s in enumerate(sched.steps):
        ph = PHASES.get(s.key.split(":", 1)[0], "other")
        if phases and phases[-1][0] == ph:
            phases[-1] = (ph, phases[-1][1], i + 1)
        else:
            phases.append((ph, i, i + 1))
    tensors = []
    if live:
        graphs = _graphs(analysis)
        tensors = [_tensor(k, nb, graphs) for k, nb in sched.live_at(at).items()]
        step = sched.steps[at]
        if step.extra:
            t = _tensor(step.key, step.extra, graphs)
            tensors.append(
                LiveTensor(f"{t.name} (temporaries)", t.phase, t.module, None, "", step.extra)
            )
    tensors.sort(key=lambda t: (-t.nbytes, t.name))
    return Timeline(
        kind=kind,
        baseline_bytes=sum(base.values()),
        baseline=base,
        live_bytes=tuple(live),
        phases=tuple(phases),
        peak_bytes=sum(base.values()) + top,
        peak_step=at,
        peak_tensors=tuple(tensors),
        describes=describes or "",
    )


def _graphs(analysis: Analysis) -> dict[str, dict[str, Node]]:
    """Schedule key prefix -> node name -> node, for the analysis's graphs."""
    gms: dict[str, GraphModule | None] = {
        "f": analysis.forward,
        "b": analysis.backward,
        "u": analysis.update,
        "j": analysis.jvp,
    }
    return {p: {n.name: n for n in gm.graph.nodes} for p, gm in gms.items() if gm is not None}


def _tensor(key: str, nbytes: int, graphs: dict[str, dict[str, Node]]) -> LiveTensor:
    prefix, _, name = key.partition(":")
    phase = PHASES.get(prefix, "other")
    n = graphs.get(prefix, {}).get(name)
    if n is None:  # the update's temporaries, or a node the graphs do not hold
        return LiveTensor(name, phase, "", None, "", nbytes)
    module = n.meta.get(MODULE)
    if module is None and n.meta.get(SOURCE) in graphs.get("f", {}):
        module = graphs["f"][n.meta[SOURCE]].meta.get(MODULE)
    val = n.meta.get("val")
    if not isinstance(val, torch.Tensor):  # a multi-output node's tuple
        return LiveTensor(name, phase, module or "", None, "", nbytes)
    shape = tuple(int(d) for d in val.shape)
    return LiveTensor(
        name, phase, module or "", shape, str(val.dtype).removeprefix("torch."), nbytes
    )
