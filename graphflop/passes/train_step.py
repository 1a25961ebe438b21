"""The whole backprop training step as one graph: forward, backward, update.

``build_train_step(forward, backward, update)`` inlines the three graphs: the backward graph's
residual placeholders become the forward values they stand for, its loss cotangent a constant 1,
and the update reads the parameter gradients the backward produces. Placeholders: the forward's
(parameters, buffers, inputs, targets), then the optimizer state, then ``lr`` (and ``step``).
Outputs: the loss, the new parameters, the new optimizer state, then the buffer updates.
"""

from __future__ import annotations

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from graphflop.meta import (
    BACKWARD_KERNELS,
    CONSTANTS,
    KIND,
    MODULE,
    ROLE,
    SIGNATURE,
    SOURCE,
    TRAIN_STEP,
    UPDATE,
    VJP,
    Signature,
    TrainStepInfo,
    graph_module,
)
from graphflop.passes.infra import FLAT, GraphPass, check
from graphflop.passes.optimizer import SLOT, inline_update

aten = torch.ops.aten


def build_train_step(
    forward: GraphModule, backward: GraphModule, update: GraphModule
) -> GraphModule:
    """Inline ``forward``, ``backward`` and ``update`` into one graph (see module docstring)."""
    sig: Signature = forward.meta[SIGNATURE]
    if sig.loss is None:
        raise ValueError("the forward graph has no loss: trace with loss='sum' or another loss")
    g = Graph()
    fenv: dict[Node, Node] = {}
    by_name: dict[str, Node] = {}
    f_out = None
    for n in forward.graph.nodes:
        if n.op == "output":
            f_out = n
            continue
        fenv[n] = g.node_copy(n, lambda x: fenv[x])
        by_name[n.name] = fenv[n]
    state_phs = {}
    for n in update.graph.nodes:
        if n.op == "placeholder" and n.meta[SLOT] not in ("param", "grad"):
            state_phs[n.name] = g.node_copy(n)
    loss = by_name[sig.loss]
    benv: dict[Node, Node] = {}
    b_out = None
    for n in backward.graph.nodes:
        if n.op == "placeholder":
            if n.name == backward.meta[VJP].cotangent_input:
                one = g.call_function(aten.ones_like.default, (loss,))
                one.meta.update(
                    {
                        "val": loss.meta["val"],
                        KIND: "cotangent",
                        ROLE: "loss",
                        SOURCE: sig.loss,
                        MODULE: "loss",
                    }
                )
                benv[n] = one
            else:
                benv[n] = by_name[n.meta.get(SOURCE, n.name)]
        elif n.op == "output":
            b_out = n
        else:
            benv[n] = g.node_copy(n, lambda x: benv[x])
    assert f_out is not None and b_out is not None, "fx graphs end in their output node"
    grads = {}
    for pos, qual in backward.meta[VJP].grads:
        grads[qual] = benv[b_out.args[0][pos]]
    p_name = {q: p for p, q in sig.params}
    new = inline_update(g, update, {q: by_name[p_name[q]] for q in p_name}, grads, state_phs)
    buffers = [
        fenv[a]
        for a in f_out.args[0]
        if isinstance(a, Node) and a.name in {b for b, _ in sig.buffer_updates}
    ]
    g.output(tuple([loss] + new + buffers))
    gm = graph_module(torch.nn.Module(), g)
    gm.meta[SIGNATURE] = sig
    # the forward's constants (torch.tensor(...) made in forward) are this graph's inputs too
    gm.meta[CONSTANTS] = forward.meta.get(CONSTANTS, {})
    info = update.meta[UPDATE]
    gm.meta[UPDATE] = update.meta[UPDATE]
    if BACKWARD_KERNELS in backward.meta:  # its backward nodes: one kernel per composite op
        gm.meta[BACKWARD_KERNELS] = backward.meta[BACKWARD_KERNELS]
    gm.meta[TRAIN_STEP] = TrainStepInfo(
        tuple(n.name for n in g.nodes if n.op == "placeholder"),
        info.params,
        tuple(n for n in state_phs if n not in ("lr", "step")),
        tuple(q for _, q in sig.buffer_updates),
    )
    return gm


class BuildTrainStep(GraphPass):
    """Forward graph → the train-step graph (:func:`build_train_step`).

    Args:
        backward: the forward's backward graph (from ``build_vjp``).
        update: the update graph for its parameters (from ``add_optimizer_update``).

    Requires ``traced`` of the forward graph, ``vjp`` of ``backward`` and ``update`` of
    ``update``; provides ``train_step``.
    """

    #: runs on the flat graph: its derivative graph is not yet built per template
    scope = FLAT
    name = "build_train_step"
    required = ("traced",)
    provided = ("train_step",)

    def __init__(self, backward: GraphModule, update: GraphModule) -> None:
        self.backward = backward
        self.update = update

    def requires(self, graph_module: GraphModule) -> None:
        super().requires(graph_module)
        check(self.backward, ("vjp",), f"{self.name}'s backward graph")
        check(self.update, ("update",), f"{self.name}'s update graph")

    def call(self, graph_module: GraphModule) -> PassResult:
        return PassResult(build_train_step(graph_module, self.backward, self.update), True)
