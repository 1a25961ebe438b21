"""Memory pass: live-tensor peaks over a topological schedule, and the memory summary.

A tensor is live from the node that writes it to its last reader (docs/flops_conventions.md,
Memory). Views share their base's storage (the op's byte policy says which ops are views), so a
storage is freed after the last reader of any of its views. Parameters (and, for training, gradients
and optimizer state) are always live and are added as a baseline rather than scheduled.

Reads ``val``, ``RESIDUAL``/``SOURCE`` (backward residuals alias forward values) and the
rule table's byte policies. Writes nothing on nodes; :func:`annotate_memory` (the pass
:class:`AnnotateMemory`) writes ``gm.meta[MEMORY]``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from graphflop.frontend.composite import KEPT_WHOLE
from graphflop.meta import JVP, MEMORY, RESIDUAL, SIGNATURE, SOURCE, VJP, MemoryInfo
from graphflop.ops import has_rule, lookup
from graphflop.passes.flops import tensor_bytes
from graphflop.passes.infra import FLAT, GraphPass


@dataclass
class Step:
    """One step of a :class:`Schedule`: a node run, the value it writes and what it reads.

    Attributes:
        key: the step's key (``PREFIX:NODE``).
        nbytes: bytes of the storage it writes (not counted when ``alias_of`` names a live
            step: a view shares that step's storage).
        alias_of: the key of the step whose storage it shares, or None.
        reads: keys of the steps it reads (a storage is freed after its last reader).
        extra: a kernel's temporaries, bytes: allocated and freed within this step.
    """

    key: str
    nbytes: int
    alias_of: str | None
    reads: list[str]
    extra: int = 0  # a kernel's temporaries: allocated and freed within this step


class _NodeSteps:
    """The :class:`Step` of each node of one graph, as :meth:`Schedule.add_graph` makes them
    (its arguments of the same names), for the whole graph or for one run of its nodes at a
    time (:mod:`graphflop.passes.memory_calls`)."""

    def __init__(
        self,
        gm: GraphModule,
        eager: bool,
        sizes: dict[str, int] | None,
        extra: dict[str, int] | None,
        also_reads: dict[str, list[str]] | None,
        inplace: set[str] | None,
        free_outputs: bool,
        released: set[str] | None = None,
    ) -> None:
        self.eager = eager
        self.sizes = sizes or {}
        self.extra = extra or {}
        self.also_reads = also_reads or {}
        self.inplace = inplace or set()
        self.free_outputs = free_outputs
        self.released = released or set()
        self.by_name = {n.name: n for n in gm.graph.nodes}
        out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        self.outputs = set(out_node.all_input_nodes)
        self.views: dict[Any, bool] = {}  # op -> its rule's byte policy is "view" (looked up once)

    def is_view(self, op: Any) -> bool:
        v = self.views.get(op)
        if v is None:
            v = self.views[op] = has_rule(op) and lookup(op).bytes == "view"
        return v

    @staticmethod
    def reads_of(n: Node, keys: dict[Node, list[str]]) -> list[str]:
        # (_input_nodes: all_input_nodes, in order, without the copy into a list)
        return [k for a in n._input_nodes for k in keys.get(a, ())]

    def output_step(
        self, n: Node, prefix: str, keys: dict[Node, list[str]], held: list[str], keep: set[str]
    ) -> Step:
        """The output node ``n``'s step, reading ``held`` too; the keys ``keep_outputs`` keeps
        (those not of :attr:`released` outputs) are added to ``keep``."""
        reads = self.reads_of(n, keys)
        keep.update(
            k for a in n.all_input_nodes if a.name not in self.released for k in keys.get(a, [])
        )
        return Step(f"{prefix}:__output__", 0, None, reads + held)

    def step(self, n: Node, key: str, keys: dict[Node, list[str]]) -> Step | None:
        """``n``'s step under ``key`` (``keys``: node -> the keys its value is read as; ``n``'s
        entry is written), or None for a view of an always-live tensor (no step)."""
        keys[n] = [key]
        reads = self.reads_of(n, keys) + [
            k
            for m in self.also_reads.get(n.name, [])
            for k in (keys.get(self.by_name[m], []) if m in self.by_name else [m])
        ]
        multi = n.args[0] if n.target is operator.getitem else None
        if isinstance(multi, Node) and _kept_whole(multi):
            # the kernel writes its outputs while it reads its inputs: they stay live until
            # each output's storage is allocated (this getitem's step)
            reads += self.reads_of(multi, keys)
        alias = None
        val = n.meta.get("val")
        own = self.eager or _kept_whole(n.args[0] if n.target is operator.getitem else n)
        if n.op == "call_function" and (
            (n.target is operator.getitem and (not own or _views_of_input(n, self.is_view)))
            or self.is_view(n.target)
            or n.name in self.inplace
        ):
            base = next(iter(n._input_nodes), None)
            if base is not None and not keys.get(base):
                keys[n] = []  # a view of an always-live tensor
                return None
            alias = keys[base][0] if base is not None else None
        if self.free_outputs and n in self.outputs and n.name not in self.released:
            nbytes = 0
        elif own and isinstance(val, (tuple, list)):
            nbytes = 0
        else:
            nbytes = self.sizes.get(n.name, tensor_bytes(val))
        return Step(key, nbytes, alias, reads, self.extra.get(n.name, 0))


class Schedule:
    """Steps of one or more graphs run one after another, with cross-graph aliases."""

    def __init__(self) -> None:
        self.steps: list[Step] = []
        self.keep: set[str] = set()
        self.ties: list[list[str]] = []  # keys whose storages are freed together

    def add_graph(
        self,
        gm: GraphModule,
        prefix: str,
        *,
        baseline: set[str],
        external: dict[str, str | list[str]] | None = None,
        free_outputs: bool = False,
        keep_outputs: bool = False,
        eager: bool = False,
        sizes: dict[str, int] | None = None,
        extra: dict[str, int] | None = None,
        also_reads: dict[str, list[str]] | None = None,
        inplace: set[str] | None = None,
        released: set[str] | None = None,
        held: list[str] | None = None,
    ) -> set[str]:
        """Append ``gm``'s nodes; returns the names of those whose value names no storage
        (read as no key: the ``baseline`` placeholders and the views of always-live tensors,
        which get no step).

        Args:
            prefix: key prefix for this graph's nodes.
            baseline: placeholder names that are always live (not scheduled).
            external: placeholder name -> key of an earlier graph's value it stands for, or
                the keys of the values that stand for it together (every reader reads all).
            free_outputs: the graph's outputs are written into baseline buffers (count 0).
            keep_outputs: the graph's outputs stay live to the end of the schedule.
            eager: storages as eager PyTorch allocates them: each output of a multi-output op
                (``getitem``) is a storage of its own, except the pieces of a view op
                (``split_with_sizes``), which share its input's; the tuple holds nothing.
            sizes: node name -> bytes, replacing the size of that node's value.
            extra: node name -> bytes of temporaries its kernel holds while it runs (live
                together with its inputs and outputs, freed when it returns).
            also_reads: node name -> names of earlier nodes of this graph that stay live until
                it has run (a kernel that holds them though the graph's edges do not say so),
                or keys of earlier graphs' values (``f:name``: what eager autograd saved).
            inplace: names of nodes whose output is written into their first argument's
                storage (an eager kernel updating a buffer it made).
            released: names of output nodes freed after the graph's last step whatever
                ``keep_outputs`` says, and allocated whatever ``free_outputs`` says (the
                gradients of leaves the model made, which eager autograd frees with the
                autograd graph).
            held: keys of earlier graphs' values that stay live until the graph's last step
                (the leaves the model made, which eager's autograd graph holds).
        """
        external = external or {}
        nodes = _NodeSteps(gm, eager, sizes, extra, also_reads, inplace, free_outputs, released)
        keys: dict[Node, list[str]] = {}
        unstored: set[str] = set()
        for n in gm.graph.nodes:
            if n.op == "output":
                kept: set[str] = set()
                self.steps.append(nodes.output_step(n, prefix, keys, held or [], kept))
                if keep_outputs:
                    self.keep.update(kept)
                continue
            if n.op == "placeholder":
                if n.name in baseline:
                    keys[n] = []
                    unstored.add(n.name)
                    continue
                if n.name in external:
                    ext = external[n.name]
                    keys[n] = [ext] if isinstance(ext, str) else list(ext)
                    if not keys[n]:
                        unstored.add(n.name)
                    continue
            step = nodes.step(n, f"{prefix}:{n.name}", keys)
            if step is not None:
                self.steps.append(step)
            else:
                unstored.add(n.name)
        return unstored

    def add_transient(self, key: str, nbytes: int) -> None:
        """A storage of ``nbytes`` allocated and freed at one step (a kernel's temporaries)."""
        self.steps.append(Step(key, nbytes, None, []))

    def _lifetimes(self) -> tuple[dict[str, str], dict[str, int], dict[str, int]]:
        """(step key -> the key of the storage it lives in, storage key -> bytes, storage key ->
        index of the last step it is live at), with ``keep`` and ``ties`` applied."""
        storage: dict[str, str] = {}
        size: dict[str, int] = {}
        last: dict[str, int] = {}
        for i, s in enumerate(self.steps):
            if s.alias_of is not None and s.alias_of in storage:
                storage[s.key] = storage[s.alias_of]
            else:
                storage[s.key] = s.key
                size[s.key] = s.nbytes
            last[storage[s.key]] = max(last.get(storage[s.key], i), i)
            for r in s.reads:
                if r in storage:
                    last[storage[r]] = max(last.get(storage[r], i), i)
        end = len(self.steps)
        for k in self.keep:
            if k in storage:
                last[storage[k]] = end
        for group in self.ties:
            sts = {storage[k] for k in group if k in storage}
            t = max((last[st] for st in sts), default=0)
            for st in sts:
                last[st] = t
        return storage, size, last

    def timeline(self) -> list[int]:
        """Bytes live at each step, one entry per step in order: the storages allocated at or
        before it and read at or after it (those ``keep`` holds to the end), plus the step's
        own kernel temporaries. A storage is counted from the step that writes it through its
        last reader (freed after that step runs). :meth:`peak` is the largest entry."""
        storage, size, last = self._lifetimes()
        frees: dict[int, list[str]] = {}
        for st, i in last.items():
            frees.setdefault(i, []).append(st)
        live = 0
        out: list[int] = []
        for i, s in enumerate(self.steps):
            if storage[s.key] == s.key:
                live += size[s.key]
            out.append(live + s.extra)
            for st in frees.get(i, []):
                live -= size.get(st, 0)
        return out

    def live_at(self, index: int) -> dict[str, int]:
        """The storages live at step ``index`` (as :meth:`timeline` counts them): the key of
        the step that allocated each -> its bytes (zero-byte storages left out). The step's
        kernel temporaries are not storages: ``steps[index].extra``.

        Raises:
            IndexError: ``index`` is not a step of this schedule.
        """
        if not -len(self.steps) <= index < len(self.steps):
            raise IndexError(f"step {index} of a schedule of {len(self.steps)} steps")
        index %= len(self.steps)
        storage, size, last = self._lifetimes()
        first: dict[str, int] = {}
        for i, s in enumerate(self.steps):
            first.setdefault(storage[s.key], i)
        return {st: nb for st, nb in size.items() if nb and first[st] <= index <= last.get(st, -1)}

    def peak(self) -> tuple[int, str]:
        """(largest sum of live storage bytes, the step where it first occurs; ``(0, "")``
        for a schedule that holds nothing)."""
        tl = self.timeline()
        peak = max(tl, default=0)
        if peak <= 0:
            return 0, ""
        return peak, self.steps[tl.index(peak)].key


@dataclass(frozen=True)
class MemoryReport:
    """Memory of one training/analysis configuration, in bytes.

    Attributes:
        params_bytes: all parameters.
        grads_bytes: one gradient per parameter.
        optimizer_state_bytes: momentum (1× params) or Adam/AdamW moments (2× params).
        saved_for_backward_bytes: forward values (activations and inputs, not parameters) the
            backward graph reads, counted once per storage.
        forward_peak_bytes: peak of a forward (inference) run, parameters included.
        train_peak_bytes: peak over forward, backward, update with parameters, gradients and
            optimizer state always live.
        jvp_peak_bytes: peak of the JVP graph with parameters and their tangents always live.
    """

    params_bytes: int
    grads_bytes: int
    optimizer_state_bytes: int
    saved_for_backward_bytes: int | None
    forward_peak_bytes: int
    train_peak_bytes: int | None
    jvp_peak_bytes: int | None


def forward_schedule(forward: GraphModule) -> Schedule:
    sig = forward.meta[SIGNATURE]
    s = Schedule()
    s.add_graph(forward, "f", baseline=sig.state(), keep_outputs=True)
    return s


def train_schedule(
    forward: GraphModule, backward: GraphModule, update: GraphModule | None
) -> Schedule:
    sig = forward.meta[SIGNATURE]
    state = sig.state()
    s = Schedule()
    s.add_graph(forward, "f", baseline=state)
    ext: dict[str, str | list[str]] = {}
    base_b = set()
    for n in backward.graph.nodes:
        if n.op == "placeholder" and n.meta.get(RESIDUAL) is not None:
            src = n.meta.get(SOURCE, n.name)
            if src in state or n.meta.get(RESIDUAL) == "param_derived":
                base_b.add(n.name)  # parameters and views of them are always live
            else:
                ext[n.name] = f"f:{src}"
    s.add_graph(backward, "b", baseline=base_b, external=ext, free_outputs=True)
    if update is not None:
        base_u = {n.name for n in update.graph.nodes if n.op == "placeholder"}
        s.add_graph(update, "u", baseline=base_u, free_outputs=True)
    return s


def jvp_schedule(jvp: GraphModule) -> Schedule:
    sig = jvp.meta[SIGNATURE]
    info = jvp.meta[JVP]
    base = sig.state() | {t for t, _ in info.tangent_inputs}
    s = Schedule()
    s.add_graph(jvp, "j", baseline=base, keep_outputs=True)
    return s


def saved_for_backward_bytes(forward: GraphModule, backward: GraphModule) -> int:
    """Bytes of the non-parameter forward values the backward graph reads, once per storage."""
    return sum(saved_storages(forward, backward).values())


def _kept_whole(n: Any) -> bool:
    """Whether ``n`` is a composite op traced as one node (batch norm): each of its outputs is
    a tensor of its own, as in its decomposition and in eager PyTorch, not a piece of one
    storage."""
    return isinstance(n, Node) and n.op == "call_function" and str(n.target) in KEPT_WHOLE


def _views_of_input(n: Node, is_view: Any) -> bool:
    """Whether getitem ``n`` takes a piece of a multi-output view op (``split_with_sizes``'s
    pieces are views of its input in eager PyTorch too, not storages of their own)."""
    src = n.args[0]
    return isinstance(src, Node) and src.op == "call_function" and bool(is_view(src.target))


def forward_storages(
    forward: GraphModule, sizes: dict[str, int]
) -> tuple[dict[str, str], dict[str, int]]:
    """(forward node name -> storage key, storage key -> bytes) as the eager schedule counts
    them (views share their base's key; ``sizes`` overrides node bytes as in
    :meth:`Schedule.add_graph`); parameters and buffers have no key. Used by the
    checkpoint and autocast what-ifs."""
    sig = forward.meta[SIGNATURE]
    state = sig.state()
    sched = Schedule()
    sched.add_graph(forward, "f", baseline=state, eager=True, sizes=sizes)
    storage, size = _storage_owners(sched)
    return {k.split(":", 1)[1]: v for k, v in storage.items()}, size


def _storage_owners(sched: Schedule) -> tuple[dict[str, str], dict[str, int]]:
    """(step key -> the key of the step that allocated its storage, owner key -> bytes)."""
    storage: dict[str, str] = {}
    size: dict[str, int] = {}
    for st in sched.steps:
        storage[st.key] = storage.get(st.alias_of, st.key) if st.alias_of else st.key
        if storage[st.key] == st.key:
            size[st.key] = st.nbytes
    return storage, size


def saved_storages(forward: GraphModule, backward: GraphModule) -> dict[str, int]:
    """The storages :func:`saved_for_backward_bytes` counts: owner node name -> bytes."""
    storage, size = _storage_owners(forward_schedule(forward))
    seen = set()
    for n in backward.graph.nodes:
        kind = n.meta.get(RESIDUAL)
        if n.op == "placeholder" and kind not in (None, "param", "buffer", "param_derived"):
            k = storage.get(f"f:{n.meta.get(SOURCE, n.name)}")
            if k is not None:
                seen.add(k)
    return {k.split(":", 1)[1]: size[k] for k in seen}


def annotate_memory(gm: GraphModule) -> GraphModule:
    """Write ``gm.meta[MEMORY]``, a :class:`~graphflop.meta.MemoryInfo`: the live-tensor peak of
    ``gm`` on its own in bytes (parameters excluded for traced forward and JVP graphs), in
    place; returns ``gm``."""
    if JVP in gm.meta:
        sched = jvp_schedule(gm)
    elif SIGNATURE in gm.meta and VJP not in gm.meta:
        sched = forward_schedule(gm)
    else:
        sched = Schedule()
        sched.add_graph(gm, "g", baseline=set(), keep_outputs=True)
    peak, where = sched.peak()
    gm.meta[MEMORY] = MemoryInfo(peak_bytes=peak, peak_at=where.split(":", 1)[-1])
    return gm


class AnnotateMemory(GraphPass):
    """:func:`annotate_memory` as a pass: requires ``val``, provides ``memory``."""

    #: runs on the flat graph: its schedule orders the nodes of every block together
    scope = FLAT
    name = "annotate_memory"
    required = ("val",)
    provided = ("memory",)

    def call(self, graph_module: GraphModule) -> PassResult:
        return PassResult(annotate_memory(graph_module), False)
