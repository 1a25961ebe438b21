"""The JVP and VJP builders (:mod:`graphflop.ad`) as torch.fx passes.

:class:`BuildJvp` and :class:`BuildVjp` take a traced forward graph and return a new graph: the
JVP graph (``gm.meta[JVP]``) or the backward graph (``gm.meta[VJP]``). Their options are the
builders' keyword arguments. Where the forward graph has a hierarchy of repeated blocks, the
new graph keeps its blocks' derivatives as calls too (``gm.meta[DERIVED_HIERARCHY]``,
:mod:`graphflop.passes.calls`).
"""

from __future__ import annotations

from torch.fx import GraphModule
from torch.fx.passes.infra.pass_base import PassResult

from graphflop.ad import jvp as _jvp
from graphflop.ad import vjp as _vjp
from graphflop.meta import BACKWARD_KERNELS, DERIVED_HIERARCHY, HIERARCHY
from graphflop.passes.calls import DirectRecorder, attach
from graphflop.passes.flops import backward_kernel_map
from graphflop.passes.infra import FLAT, GraphPass


def _flags(**flags: object) -> None:
    """Raise ``TypeError`` for a switch that is not a bool (``direct="yes"`` was taken as
    true, ``direct="no"`` too)."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, not {value!r}")


class BuildJvp(GraphPass):
    """Forward graph → its JVP graph (:func:`graphflop.ad.jvp.build_jvp`).

    Args:
        tangents: which placeholders carry tangents: ``params``, ``inputs`` or ``all``.
        wrt_outputs: ``loss`` or ``outputs`` (tangents of the model's outputs too).
        per_template: build each repeated block's JVP nodes once per variant and expand them
            at its other calls (:mod:`graphflop.ad.blocks`); False runs the rules at every
            call (the same graph, node for node).
        direct: with ``per_template``, record each expanded call as a call of its template
            derivative instead of copying its nodes (:class:`~graphflop.passes.calls.DirectRecorder`):
            the graph returned is the top level of ``gm.meta[DERIVED_HIERARCHY]``, and
            ``calls.expand`` of it the flat JVP graph, names included. Off by default here;
            ``analyze`` turns it on (``record_derivatives``) and reads the flat view.

    Requires ``traced``; provides ``jvp``. Raises ``MissingRuleError``, ``ValueError`` (see the
    builder).
    """

    #: runs on the flat graph; each repeated block's JVP is built once per variant there
    scope = FLAT
    name = "build_jvp"
    required = ("traced",)
    provided = ("jvp",)

    def __init__(
        self,
        tangents: str = "params",
        *,
        wrt_outputs: str = "loss",
        per_template: bool = True,
        direct: bool = False,
    ) -> None:
        _flags(per_template=per_template, direct=direct)
        self.tangents = tangents
        self.wrt_outputs = wrt_outputs
        self.per_template = per_template
        self.direct = direct

    def call(self, graph_module: GraphModule) -> PassResult:
        recorder = _recorder(graph_module) if self.direct and self.per_template else None
        gm = _jvp.build_jvp(
            graph_module,
            self.tangents,
            wrt_outputs=self.wrt_outputs,
            per_template=self.per_template,
            recorder=recorder,
        )
        if self.per_template and DERIVED_HIERARCHY not in gm.meta:
            attach(gm, graph_module)
        return PassResult(gm, True)


def _recorder(forward: GraphModule) -> DirectRecorder | None:
    """A recorder of the derivative graphs' calls, where ``forward`` has call sites."""
    return DirectRecorder(forward) if forward.meta.get(HIERARCHY) is not None else None


class BuildVjp(GraphPass):
    """Forward graph (with a loss) → its backward graph (:func:`graphflop.ad.vjp.build_vjp`).

    Args:
        input_grads: also return the cotangents of the model's inputs.
        linearized: the forward's JVP graph to transpose, when already built.
        per_template: transpose each repeated block once per variant and expand it at its
            other calls (:mod:`graphflop.ad.blocks`); False runs the rules at every call (the
            same graph, node for node).
        direct: with ``per_template``, record each expanded call as a call of its template
            derivative instead of copying its nodes, and run the clean-ups per template
            derivative (:class:`~graphflop.passes.calls.DirectRecorder`): the graph returned
            is the top level of ``gm.meta[DERIVED_HIERARCHY]``, and ``calls.expand`` of it the
            flat backward; where that cannot be shown equal the flat graph is built (and its
            hierarchy read off it, as without the option). Off by default here; ``analyze``
            turns it on (``record_derivatives``) and reads the flat view.

    Requires ``traced``; provides ``vjp``. Raises ``MissingRuleError``, ``ValueError`` (no
    loss).
    """

    #: runs on the flat graph; each repeated block's transpose is built once per variant there
    scope = FLAT
    name = "build_vjp"
    required = ("traced",)
    provided = ("vjp",)

    def __init__(
        self,
        *,
        input_grads: bool = False,
        linearized: GraphModule | None = None,
        per_template: bool = True,
        direct: bool = False,
    ) -> None:
        _flags(input_grads=input_grads, per_template=per_template, direct=direct)
        self.input_grads = input_grads
        self.linearized = linearized
        self.per_template = per_template
        self.direct = direct

    def call(self, graph_module: GraphModule) -> PassResult:
        recorder = _recorder(graph_module) if self.direct and self.per_template else None
        gm = _vjp.build_vjp(
            graph_module,
            input_grads=self.input_grads,
            linearized=self.linearized,
            per_template=self.per_template,
            recorder=recorder,
        )
        if self.per_template and DERIVED_HIERARCHY not in gm.meta:
            attach(gm, graph_module)
        # the backward nodes of a composite op eager runs as one kernel move its bytes
        gm.meta[BACKWARD_KERNELS] = backward_kernel_map(graph_module)
        return PassResult(gm, True)
