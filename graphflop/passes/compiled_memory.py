"""The compiled memory model: what ``torch.compile``'s AOTAutograd partitioner saves for backward.

``torch.compile`` traces the forward and the backward of a model into one joint graph
(AOTAutograd) and cuts it in two: the forward graph returns, beside its outputs, the values the
backward graph reads (the saved tensors), and a value that is cheap to recompute from other saved
values may be recomputed in the backward instead of saved. The cut is
``torch._functorch.partitioners.min_cut_rematerialization_partition`` (a min-cut over the joint
graph; its recomputation is extra work no FLOP counter reports); ``default_partition`` saves every
forward value the backward reads and recomputes nothing.

:func:`compiled_memory` builds the joint graph of the model plus graphflop's loss exactly as the
``aot_eager_decomp_partition`` backend of ``torch.compile`` does (Inductor's decomposition table,
the min-cut partitioner with ``compiler="inductor"``, nothing compiled), on FakeTensors (no
memory is allocated, no kernel runs), runs both partitioners on it and reports for each
(:class:`Partition`): the saved bytes, the forward nodes recomputed in the backward and their
FLOPs under graphflop's cost rules (:func:`graphflop.ops.cost.op_cost`), and the peak of the
compiled forward followed by the compiled backward. Inductor itself is not run: its fusion and
buffer reuse would change the peak, not what is saved.

Conventions (those of :func:`graphflop.runtime.memory_probe.measure_saved`): saved bytes count each
storage once (views and ``_unsafe_view`` share their base's storage), leave out parameters and
buffers and count inputs and targets.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import operator
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Node

from graphflop.frontend.errors import TraceError
from graphflop.ops import has_rule
from graphflop.passes.eager_memory import DESCRIBES as EAGER_DESCRIBES
from graphflop.passes.flops import op_cost
from graphflop.report import CompiledPartition, CompiledWhatIf, Memory

__all__ = [
    "DESCRIBES",
    "EXECUTION",
    "CompiledMemory",
    "Partition",
    "compiled_memory",
    "compiled_report_memory",
]

#: the execution the compiled figures describe
EXECUTION = "torch.compile AOTAutograd min-cut partition, inductor not run"

_ALIASING_EXTRA = {torch.ops.aten._unsafe_view.default}  # returns a view, schema says not


@dataclass(frozen=True)
class Partition:
    """One partitioner's cut of the joint graph.

    Attributes:
        partitioner: ``min_cut`` or ``default``.
        saved: names of the forward graph's outputs the backward reads, parameters and buffers
            (and views of them) left out, in the forward graph's output order.
        saved_bytes: their bytes, once per storage, bytes.
        recomputed: names of the backward graph's nodes that recompute forward nodes.
        recompute_flops: FLOPs of those nodes under graphflop's rules.
        uncounted_ops: the recomputed ops without a rule in graphflop's table (counted 0).
        peak_bytes: largest sum of live storages while the forward graph then the backward
            graph run in node order, each storage freed after its last reader, gradients kept
            to the end; parameters, buffers, inputs and targets not included.
    """

    partitioner: str
    saved: tuple[str, ...]
    saved_bytes: int
    recomputed: tuple[str, ...]
    recompute_flops: int
    uncounted_ops: tuple[str, ...]
    peak_bytes: int

    def to_report(self) -> CompiledPartition:
        """Its figures in the report (``memory.compiled.min_cut``, ``.default``)."""
        return CompiledPartition(
            saved_for_backward_bytes=self.saved_bytes,
            saved_tensors=len(self.saved),
            recomputed_nodes=len(self.recomputed),
            recompute_flops=self.recompute_flops,
            uncounted_ops=tuple(self.uncounted_ops),
            forward_backward_peak_bytes=self.peak_bytes,
        )


@dataclass(frozen=True)
class CompiledMemory:
    """Both partitions of one model's joint graph.

    Attributes:
        min_cut: ``min_cut_rematerialization_partition``'s (what ``torch.compile`` runs).
        default: ``default_partition``'s (save what the backward reads, recompute nothing).
        state_bytes: parameters and buffers, bytes.
        input_bytes: inputs and loss targets, bytes.
    """

    min_cut: Partition
    default: Partition
    state_bytes: int
    input_bytes: int

    def to_report(self) -> CompiledWhatIf:
        """The report's section ``memory.compiled``."""
        return CompiledWhatIf(EXECUTION, self.min_cut.to_report(), self.default.to_report())


def _fake_like(t: torch.Tensor, grad: bool = False) -> torch.Tensor:
    """A CPU tensor with ``t``'s shape, strides and dtype (call under a FakeTensorMode)."""
    out = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="cpu")
    return out.requires_grad_(grad)


class _Recorded(Exception):
    """Raised once the joint graph is recorded: AOTAutograd stops there."""


def _joint(
    model: nn.Module, example_inputs: tuple, loss: str, targets: Callable[[torch.Tensor], tuple]
) -> tuple[GraphModule, list, int, int]:
    """(the joint graph, its inputs, the number of forward outputs, the number of parameter
    and buffer inputs), recorded from AOTAutograd under a fresh FakeTensorMode."""
    from torch._functorch import config as functorch_config
    from torch._functorch.aot_autograd import aot_function
    from torch._inductor.compile_fx import select_decomp_table
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call

    from graphflop.frontend.dispatch import RoutedDispatch, routed_nonzero
    from graphflop.frontend.libraries import traced_by_libraries
    from graphflop.frontend.loss import loss_output, loss_value

    rec: dict[str, Any] = {}

    def record(joint: GraphModule, joint_inputs: Any, *, num_fwd_outputs: int, **kw: Any):

        rec.update(joint=_copy(joint), inputs=joint_inputs, n=num_fwd_outputs)
        # the compiled function is not run: its forward graph on FakeTensors would meet a
        # routed ``nonzero`` outside the routing's sizing
        raise _Recorded

    def nop(gm: GraphModule, example_inputs: Any) -> GraphModule:
        return gm

    mode = FakeTensorMode()
    # a mixture of experts' dispatch (``torch.where(idx == e)``) sized by the routing
    # assumption, as graphflop's trace sizes it: the ``nonzero`` stays in the joint graph with
    # static rows (:mod:`graphflop.frontend.dispatch`)
    dispatch = RoutedDispatch()
    # libraries' traceable paths, as graphflop's trace takes them: transformers' packed-sequence
    # check reads position ids' values (``.all()``), which AOTAutograd's functional tensors
    # cannot give (DataDependentOutputException on every decoder)
    with mode, traced_by_libraries(), routed_nonzero():
        params = {k: _fake_like(p, p.requires_grad) for k, p in model.named_parameters()}
        buffers = {k: _fake_like(b) for k, b in model.named_buffers()}
        inputs = tuple(_fake_like(t) for t in example_inputs)
        with torch.no_grad(), dispatch:
            probe = functional_call(model, {**params, **buffers}, inputs)
        first = loss_output(probe)
        tgt = targets(first)

        def f(params: dict, buffers: dict, inputs: tuple, tgt: tuple) -> torch.Tensor:
            with dispatch:
                out = functional_call(model, {**params, **buffers}, inputs)
            return loss_value(loss, loss_output(out), tgt)

        n_state = len(params) + len(buffers)
        g = aot_function(
            f,
            fw_compiler=nop,
            bw_compiler=nop,
            partition_fn=record,
            decompositions=select_decomp_table(),
            num_params_buffers=n_state,
        )
        with functorch_config.patch(unlift_effect_tokens=True), contextlib.suppress(_Recorded):
            g(params, buffers, inputs, tgt)
    return rec["joint"], rec["inputs"], rec["n"], n_state


def _is_view(n: Node) -> bool:
    """Whether ``n``'s op returns a view of its first input (``_unsafe_view`` too; an in-place
    op's output is its input, not a view)."""
    t = n.target
    if t in _ALIASING_EXTRA:
        return True
    schema = getattr(t, "_schema", None)
    if schema is None or not schema.returns or schema.returns[0].alias_info is None:
        return False
    return not schema.returns[0].alias_info.is_write


def _root(n: Node) -> Node:
    """The node whose storage ``n`` lives in (``n`` itself unless a view). A ``getitem`` of a
    multi-output view op (``unbind``, ``split``: the rows and columns of a routed
    ``nonzero``) lives in that op's input's storage."""
    while n.op == "call_function" and n.all_input_nodes:
        if n.target is operator.getitem:
            src = n.args[0]
            if not (isinstance(src, Node) and src.op == "call_function" and _is_view(src)):
                break
            n = src
        if not _is_view(n):
            break
        n = n.all_input_nodes[0]
    return n


def _nbytes(v: Any) -> int:
    if not isinstance(v, torch.Tensor):
        return 0
    try:
        return int(v.untyped_storage().nbytes())
    except (NotImplementedError, RuntimeError):
        return v.numel() * v.element_size()


def _forward_nodes(joint: GraphModule) -> set[str]:
    """Names of the joint graph's nodes that do not depend on a tangent."""
    back: set[Node] = set()
    for n in joint.graph.nodes:
        if (n.op == "placeholder" and "tangents" in n.name) or any(
            a in back for a in n.all_input_nodes
        ):
            back.add(n)
    return {n.name for n in joint.graph.nodes if n not in back and n.op != "output"}


_Step = tuple[str, int, "str | None", list[str]]  # (key, bytes, the key it aliases, reads)


def _steps(gm: GraphModule, prefix: str, ext: dict[str, str | None], key_of: dict) -> tuple:
    """(the steps of ``gm``'s nodes, the keys its output reads). ``ext``: backward placeholder
    -> the forward key it stands for (None: always live); forward placeholders always live."""
    steps: list[_Step] = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            key_of[n] = ext.get(n.name, f"{prefix}:{n.name}" if prefix == "b" else None)
            if prefix == "b" and n.name not in ext:  # a tangent
                steps.append((f"b:{n.name}", _nbytes(n.meta.get("val")), None, []))
            continue
        reads = [k for a in n.all_input_nodes if (k := key_of.get(a)) is not None]
        if n.op == "output":
            return steps, reads
        root = _root(n)
        key = f"{prefix}:{n.name}"
        if root is not n:  # a view: lives in its base's storage
            key_of[n] = key_of.get(root)
            if key_of[n] is not None:
                steps.append((key, 0, key_of[n], reads))
            continue
        key_of[n] = key
        steps.append((key, _nbytes(n.meta.get("val")), None, reads))
    return steps, []


def _live_peak(steps: list[_Step], keep: set[str]) -> int:
    """Largest sum of live storages: each from its step to its last reader (``keep``: to the
    end)."""
    storage: dict[str, str] = {}
    size: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, (key, nb, alias, reads) in enumerate(steps):
        storage[key] = storage.get(alias, key) if alias else key
        if storage[key] == key:
            size[key] = nb
        for k in [key, *reads]:
            if k in storage:
                last[storage[k]] = i
    for k in keep:
        if k in storage:
            last[storage[k]] = len(steps)
    frees: dict[int, list[str]] = {}
    for st, i in last.items():
        frees.setdefault(i, []).append(st)
    live = peak = 0
    for i, (key, *_rest) in enumerate(steps):
        if storage[key] == key:
            live += size[key]
        peak = max(peak, live)
        live -= sum(size.get(st, 0) for st in frees.get(i, []))
    return peak


def _peak(fw: GraphModule, bw: GraphModule, n_saved_start: int, state: set[str]) -> int:
    """The forward then the backward in node order; a storage lives from its writer to its
    last reader; the forward's non-saved outputs and the backward's outputs live to the end;
    placeholders of the forward (parameters, buffers, inputs) are not counted."""
    key_of: dict[Node, str | None] = {}
    fsteps, fw_out = _steps(fw, "f", {}, key_of)
    fw_nodes = next(n for n in fw.graph.nodes if n.op == "output").args[0]
    saved_keys = {n.name: key_of.get(n) for n in fw_nodes[n_saved_start:] if isinstance(n, Node)}
    keep = set(fw_out) - {k for k in saved_keys.values() if k}
    bw_ph = [n.name for n in bw.graph.nodes if n.op == "placeholder"]
    ext = {p: saved_keys.get(p) for p in bw_ph if p in saved_keys or p in state}
    bsteps, bw_out = _steps(bw, "b", ext, key_of)
    return _live_peak(fsteps + bsteps, keep | set(bw_out))


def _partition(
    name: str, fw: GraphModule, bw: GraphModule, n_fwd_outputs: int, n_state: int, joint_fwd: set
) -> Partition:
    phs = [n for n in fw.graph.nodes if n.op == "placeholder"]
    state = {n.name for n in phs[:n_state]}
    out = next(n for n in fw.graph.nodes if n.op == "output").args[0]
    bw_reads = {n.name for n in bw.graph.nodes if n.op == "placeholder"}
    # the forward returns (mutated inputs' new values, outputs, saved values...): the first
    # n_fwd_outputs are the joint graph's forward outputs
    saved_nodes = [n for n in out[n_fwd_outputs:] if isinstance(n, Node) and n.name in bw_reads]
    storages: dict[str, int] = {}
    saved = []
    for n in saved_nodes:
        r = _root(n)
        if r.op == "placeholder" and r.name in state:
            continue
        saved.append(n.name)
        storages[r.name] = _nbytes(r.meta.get("val"))
    # a forward node in both graphs runs twice; one only in the backward (a value only the
    # backward needs, moved there) runs once, as it would in the forward
    in_fw = {n.name for n in fw.graph.nodes}
    recomputed, flops, uncounted = [], 0, []
    for n in bw.graph.nodes:
        if n.op == "call_function" and n.name in joint_fwd and n.name in in_fw:
            recomputed.append(n.name)
            if n.target is not operator.getitem and not has_rule(n.target):
                uncounted.append(str(n.target))
            flops += op_cost(n.target, n.args, n.kwargs, n, node=n.name).flops
    return Partition(
        partitioner=name,
        saved=tuple(saved),
        saved_bytes=sum(storages.values()),
        recomputed=tuple(recomputed),
        recompute_flops=flops,
        uncounted_ops=tuple(sorted(set(uncounted))),
        peak_bytes=_peak(fw, bw, n_fwd_outputs, state),
    )


def _targets(loss: str) -> Callable[[torch.Tensor], tuple]:
    """graphflop's loss targets for a first output (zeros: class 0, or zeros like it)."""
    from graphflop.frontend.loss import class_target_shape

    def make(first: torch.Tensor) -> tuple:
        if loss == "cross_entropy":
            return (torch.zeros(class_target_shape(first), dtype=torch.long),)
        if loss == "mse":
            return (torch.zeros_like(first),)
        return ()

    return make


def _copy(gm: GraphModule) -> GraphModule:
    """A deep copy of ``gm``'s graph, its tensor attributes shared (a constant the model makes
    in its forward, ``torch.tensor([...])``, is a FakeTensor attribute of the joint graph that
    ``deepcopy`` cannot clone; the partitioners read attributes, never write them), without the
    FutureWarning PyTorch 2.13 raises while copying the graph's pytree specs
    (``isinstance(treespec, LeafSpec)`` inside ``deepcopy``)."""
    shared: dict[int, Any] = {}
    for mod in gm.modules():
        for v in [*vars(mod).values(), *mod._parameters.values(), *mod._buffers.values()]:
            if isinstance(v, torch.Tensor):
                shared[id(v)] = v
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r".*LeafSpec.* is deprecated", FutureWarning)
        return copy.deepcopy(gm, shared)


#: the exceptions of an op whose output (its size or value) depends on tensor values
_DATA_DEPENDENT = {
    "DynamicOutputShapeException",
    "DataDependentOutputException",
    "GuardOnDataDependentSymNode",
}


def _data_dependent_refusal(e: BaseException) -> str | None:
    """The one-line refusal for a joint graph AOTAutograd could not record because an op's
    output depends on tensor values graphflop cannot size here; None for another failure."""
    from graphflop.frontend.errors import exception_chain, first_line

    cause = next((c for c in exception_chain(e) if type(c).__name__ in _DATA_DEPENDENT), None)
    if cause is None:
        return None
    return (
        "--memory-model compiled cannot record torch.compile's joint graph of this model: "
        f"{type(cause).__name__}: {first_line(cause)} (an op whose output size depends on "
        "tensor values, not tied to a router's top-k indices); use --memory-model eager or graph"
    )


def compiled_memory(model: nn.Module, example_inputs: tuple, loss: str) -> CompiledMemory:
    """What ``torch.compile``'s AOTAutograd partitioner saves for ``model`` plus its loss.

    Args:
        model: the module, in its current train/eval mode (real, fake or meta parameters: only
            shapes and dtypes are read).
        example_inputs: one tensor per input (only shapes, strides and dtypes are read).
        loss: graphflop's loss kind (``cross_entropy``, ``mse``, ``sum``, ``output``), with
            graphflop's targets (zeros).

    Returns:
        :class:`CompiledMemory`, bytes and FLOPs (1 multiply-add = 2 FLOPs).

    Raises:
        TraceError: an op whose output size depends on tensor values (a ``nonzero`` not tied
            to a router's top-k indices) in the joint graph: one line.
        RuntimeError: AOTAutograd cannot trace the model (its message).
    """
    from torch._functorch.partitioners import (
        default_partition,
        min_cut_rematerialization_partition,
    )

    try:
        joint, joint_inputs, n_out, n_state = _joint(model, example_inputs, loss, _targets(loss))
    except Exception as e:
        refusal = _data_dependent_refusal(e)
        if refusal is None:
            raise
        raise TraceError(refusal) from e
    joint_fwd = _forward_nodes(joint)
    cuts: dict[str, Callable[..., tuple[GraphModule, GraphModule]]] = {
        "min_cut": functools.partial(min_cut_rematerialization_partition, compiler="inductor"),
        "default": default_partition,
    }
    parts = {}
    for name, cut in cuts.items():
        fw, bw = cut(_copy(joint), joint_inputs, num_fwd_outputs=n_out)
        parts[name] = _partition(name, fw, bw, n_out, n_state, joint_fwd)
    phs = [n for n in joint.graph.nodes if n.op == "placeholder" and "tangents" not in n.name]
    sizes = [_nbytes(n.meta.get("val")) for n in phs]
    return CompiledMemory(
        parts["min_cut"], parts["default"], sum(sizes[:n_state]), sum(sizes[n_state:])
    )


#: the execution each memory figure describes under ``--memory-model compiled``
DESCRIBES = {
    "saved_for_backward_bytes": "tensors the forward graph of torch.compile's AOTAutograd "
    "min-cut partition (Inductor decompositions, as backend aot_eager_decomp_partition) saves "
    "for the backward, once per storage; parameters and buffers excluded; inductor not run",
    "train_peak_bytes": "parameters, buffers, inputs and optimizer state, plus the peak of the "
    "compiled forward then the compiled backward in node order (gradients kept), or of the "
    "in-place torch.optim update on {device}; inductor not run",
    "forward_peak_bytes": "graphflop's forward graph in its own node order",
    # the JVP is not compiled: its figure is the eager model's (torch.func.jvp)
    "jvp_peak_bytes": EAGER_DESCRIBES["eager"]["jvp_peak_bytes"],
}


def compiled_report_memory(
    mem: Memory, model: nn.Module, example_inputs: tuple, loss: str, optimizer: str, device: str
) -> Memory:
    """``mem`` (a report's memory, with its gradient and optimizer-state bytes) with the
    saved-for-backward and train-step figures of the compiled model and its details
    (``compiled``: :meth:`CompiledMemory.to_report`); unchanged figures but the naming when
    no backward was built.

    Raises:
        RuntimeError: AOTAutograd cannot trace the model.
    """
    from graphflop.passes.eager_memory import optimizer_temporaries

    describes = {k: v.format(device=device) for k, v in DESCRIBES.items()}
    if mem.saved_for_backward_bytes is None or loss == "none":
        keep = {k: v for k, v in describes.items() if getattr(mem, k) is not None}
        return replace(mem, memory_model="compiled", device=device, describes=keep)
    cm = compiled_memory(model, example_inputs, loss)
    sizes = [p.numel() * p.element_size() for p in model.parameters() if p.requires_grad]
    update = sum(sizes) + optimizer_temporaries(optimizer, sizes, device)
    base = cm.state_bytes + cm.input_bytes + (mem.optimizer_state_bytes or 0)
    return replace(
        mem,
        saved_for_backward_bytes=cm.min_cut.saved_bytes,
        train_peak_bytes=base + max(cm.min_cut.peak_bytes, update),
        memory_model="compiled",
        device=device,
        describes={k: v for k, v in describes.items() if getattr(mem, k) is not None},
        compiled=cm.to_report(),
    )
