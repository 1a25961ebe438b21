"""The ``node.meta`` keys graphflop reads and writes, and their frozen dataclass values.

Every analysis result lives on the graph (ARCHITECTURE.md, principle 1). Passes write the keys
below; exporters and reports only read them, with ``.get()``, and tolerate absence.

Node keys
    ``val``          (PyTorch's own) the output as a FakeTensor, or a tuple of them.
    ``gf_kind``      ``"primal"`` (a value of the forward computation), ``"coef"`` (a primal-only
                     value a derivative rule needs, e.g. ReLU's mask), ``"tangent"`` (linear in the
                     tangent inputs), ``"cotangent"`` (a backward value) or ``"update"``.
    ``gf_role``      what the node is for, see :data:`ROLES`.
    ``gf_source``    name of the forward node this node was derived from (itself for forward nodes).
    ``gf_module``    ``nn.Module`` path of that forward node (``""`` for the model's own forward).
    ``gf_cost``      :class:`NodeCost` written by :mod:`graphflop.passes.flops`.
    ``gf_param``     on parameter placeholders and gradient outputs: the parameter's qualified name.
    ``gf_param_derived``  on forward nodes: True when every floating input is a parameter or
                     derived from parameters only (``permute(W)``), so its cotangent is a weight
                     gradient.

Graph keys (``gm.meta``)
    ``gf_signature`` :class:`Signature` of a traced forward graph.
    ``gf_ghosts``    list of :class:`Ghost`: work that was not emitted (symbolic zeros, pruned
                     cotangents), with what it would have cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

KIND = "gf_kind"
ROLE = "gf_role"
SOURCE = "gf_source"
MODULE = "gf_module"
COST = "gf_cost"
PARAM = "gf_param"
PARAM_DERIVED = "gf_param_derived"
SIGNATURE = "gf_signature"
GHOSTS = "gf_ghosts"

#: Roles a node can carry (FLOPS.md, "Backward, update and forward-mode attribution").
ROLES = (
    "forward",
    "loss",
    "grad_input",
    "grad_weight",
    "grad_accum",
    "tangent_from_input",
    "tangent_from_param",
    "direction",
    "update",
)


@dataclass(frozen=True)
class NodeCost:
    """Cost of one node, per FLOPS.md.

    Attributes:
        flops: floating-point operations, one multiply-add = 2.
        mm_flops: the part of ``flops`` done by matrix-class ops (mm, bmm, conv, attention).
        transcendentals: elements of exp/log/tanh/sqrt/... (also counted in ``flops``).
        random_elements: random numbers drawn (0 FLOPs).
        bytes_read: bytes of the tensor inputs the node reads (0 for views).
        bytes_written: bytes of the tensors the node writes (0 for views).
    """

    flops: int = 0
    mm_flops: int = 0
    transcendentals: int = 0
    random_elements: int = 0
    bytes_read: int = 0
    bytes_written: int = 0

    def __add__(self, other: NodeCost) -> NodeCost:
        return NodeCost(
            self.flops + other.flops,
            self.mm_flops + other.mm_flops,
            self.transcendentals + other.transcendentals,
            self.random_elements + other.random_elements,
            self.bytes_read + other.bytes_read,
            self.bytes_written + other.bytes_written,
        )


ZERO_COST = NodeCost()


@dataclass(frozen=True)
class Signature:
    """What the placeholders and outputs of a traced forward graph are.

    Attributes:
        params: (placeholder name, parameter qualified name) pairs, in placeholder order.
        buffers: (placeholder name, buffer qualified name) pairs.
        inputs: placeholder names of the model's tensor inputs.
        targets: placeholder names of the loss targets (may be empty).
        loss: name of the node holding the scalar loss, or None when no loss was traced.
        outputs: names of the model's output nodes.
        buffer_updates: (node name, buffer qualified name) pairs for mutated buffers.
    """

    params: tuple[tuple[str, str], ...]
    buffers: tuple[tuple[str, str], ...]
    inputs: tuple[str, ...]
    targets: tuple[str, ...]
    loss: str | None
    outputs: tuple[str, ...]
    buffer_updates: tuple[tuple[str, str], ...] = field(default=())


@dataclass(frozen=True)
class Ghost:
    """Work graphflop decided not to emit, recorded with what it would have cost.

    Attributes:
        name: a unique name (``ghost_<n>``).
        op: the op overload that would have run.
        shape: its output shape.
        source: the forward node it came from.
        module: that node's module path.
        role: the role it would have had (``grad_input``, ``tangent_from_input``, ...).
        cost: its cost, counted with the same rule as an emitted node.
        inputs: names of real nodes or other ghosts it would have read.
    """

    name: str
    op: str
    shape: tuple[int, ...]
    source: str
    module: str
    role: str
    cost: NodeCost
    inputs: tuple[str, ...] = ()


def fake_mode_of(values) -> object | None:
    """The FakeTensorMode of the first FakeTensor among ``values`` (nested tuples allowed).

    Unlike ``torch._guards.detect_fake_mode`` this ignores any ambient tracing context (inside a
    ``torch.compile`` backend that would be Dynamo's mode, with symbolic shapes).
    """
    from torch._subclasses.fake_tensor import FakeTensor

    stack = list(values)
    while stack:
        v = stack.pop(0)
        if isinstance(v, FakeTensor):
            return v.fake_mode
        if isinstance(v, (tuple, list)):
            stack.extend(v)
    return None


def graph_module(root: torch.nn.Module, graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """A GraphModule whose Python code is generated when first needed (called, or ``.code``
    read), not when it is made: code generation costs about 0.2 s per 5,000 nodes and most
    graphs the passes build are only analysed (PyTorch's ``_LazyGraphModule``; a plain
    GraphModule where that is missing)."""
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:  # pragma: no cover - older or newer PyTorch without it
        return torch.fx.GraphModule(root, graph)
    return _LazyGraphModule(root, graph)
