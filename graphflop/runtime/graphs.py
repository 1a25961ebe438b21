"""The step graphs that are run and exported, taken from an :class:`~graphflop.analysis.Analysis`.

This is the one place outside ``passes/`` that assembles them, so the exporter
(:mod:`graphflop.export.onnx`), ``graphflop bench`` and ``graphflop train`` convert and run the
same graphs and build none themselves:

* ``train_step`` — the analysis's own (:attr:`~graphflop.analysis.Analysis.train_step`: forward,
  backward and update inlined, built once on first use);
* ``forward_gradient_step`` — with its directions as inputs (``direction_inputs=True``: ONNX
  Runtime and the training loop feed them, so both runtimes take the same steps); with
  ``sampling=True`` the analysis's ``forward_gradient`` graph instead, which samples them inside
  (``aten.randn``; ONNX ``RandomNormalLike``), as ``graphflop bench`` times it;
* ``forward`` — with ``residuals=True`` a copy that also outputs the values the backward graph
  reads (:func:`forward_with_residuals`), so ``forward.onnx`` then ``backward.onnx`` chain.

Every graph returned is FLOP-annotated (``COST``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.fx
from torch.fx import GraphModule

from graphflop.export.onnx import GRAPH_KINDS
from graphflop.passes.conv_wgrad import conv_weight_grads_as_mm
from graphflop.passes.optimizer import OptimizerConfig, for_every_parameter

if TYPE_CHECKING:
    from graphflop.analysis import Analysis

__all__ = [
    "GRAPH_KINDS",
    "conv_weight_grads_as_mm",
    "forward_gradient_graph",
    "forward_with_residuals",
    "on_device",
    "step_graphs",
    "train_step_graph",
]


def train_step_graph(analysis: Analysis) -> GraphModule | None:
    """Forward, backward and update of ``analysis`` as one graph (its
    :attr:`~graphflop.analysis.Analysis.train_step`, built on first use), or None without a
    backward.

    Placeholders: the forward's, the optimizer state, ``lr`` (and ``step``); outputs: the loss,
    the new parameters, the new state, the buffer updates (``TRAIN_STEP`` info).
    """
    return analysis.train_step


def forward_gradient_graph(
    forward: GraphModule,
    optimizer: str | OptimizerConfig,
    *,
    directions: int = 1,
    distribution: str = "normal",
    update: GraphModule | None = None,
) -> GraphModule:
    """The forward-gradient step of a traced ``forward`` (with a loss) taking its ``directions``
    as inputs (placeholders ``v<k>_<param>``, ``KIND="direction"``), FLOP-annotated.

    ``update`` is the optimizer's update graph of ``forward`` when already built (an
    :attr:`~graphflop.analysis.Analysis.update`); it is built here otherwise.

    Raises:
        ValueError: bad ``directions`` or ``distribution``, no loss, or an ``update`` graph of
            another optimizer (see
            :func:`~graphflop.passes.forward_gradient.build_forward_gradient_step`).
    """
    from graphflop.passes.flops import annotate_flops
    from graphflop.passes.forward_gradient import build_forward_gradient_step

    return annotate_flops(
        build_forward_gradient_step(
            forward,
            optimizer,
            directions=directions,
            distribution=distribution,
            direction_inputs=True,
            update=update,
        )
    )


def forward_with_residuals(forward: GraphModule, backward: GraphModule) -> GraphModule:
    """A copy of ``forward`` whose outputs are followed by the forward values ``backward``
    reads that are not forward inputs (activations and values derived from parameters, in the
    backward's placeholder order), FLOP annotations kept.

    Exported, those outputs are named ``saved.<node>``, the names of ``backward.onnx``'s inputs;
    the backward's other inputs are ``ct_loss`` (the loss cotangent, 1) and ``saved.<input>``
    for a forward input ``<input>`` (a parameter, buffer or model input), fed as the forward
    was. The copy shares the forward's graph meta (``SIGNATURE``).
    """
    from graphflop.meta import RESIDUAL, SOURCE

    phs = {n.name for n in forward.graph.nodes if n.op == "placeholder"}
    wanted = [
        n.meta.get(SOURCE, n.name)
        for n in backward.graph.nodes
        if n.op == "placeholder" and n.meta.get(RESIDUAL) is not None
    ]
    g = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    outs = g.graph_copy(forward.graph, env)
    by_name = {n.name: env[n] for n in forward.graph.nodes if n in env}
    saved = [by_name[w] for w in dict.fromkeys(wanted) if w not in phs and w in by_name]
    g.output((*outs, *saved))  # type: ignore[misc]
    gm = GraphModule(forward, g)
    gm.meta.update(forward.meta)
    return gm


def on_device(gm: GraphModule, device: str | torch.device) -> GraphModule:
    """A copy of ``gm`` whose nodes make their tensors on ``device`` where the trace put them
    on the ``meta`` or CPU device (a model built on the meta device is traced as CPU
    FakeTensors; ``device=`` arguments of factory ops such as ``aten.full``,
    ``aten.scalar_tensor``, ``aten.randn``), so it runs on real tensors; ``gm`` itself is left
    as it is (graph meta shared)."""
    import copy

    target = torch.device(device)

    def swap(a):
        return target if isinstance(a, torch.device) and a.type in ("meta", "cpu") else a

    g = copy.deepcopy(gm.graph)
    for n in g.nodes:
        if n.op == "call_function":
            n.args = torch.fx.node.map_aggregate(n.args, swap)
            n.kwargs = torch.fx.node.map_aggregate(n.kwargs, swap)
    out = GraphModule(gm, g)
    out.meta.update(gm.meta)
    return out


def step_graphs(
    analysis: Analysis,
    *,
    kinds: tuple[str, ...] = GRAPH_KINDS,
    directions: int = 1,
    distribution: str = "normal",
    residuals: bool = False,
    sampling: bool = False,
    wgrad_mm: bool = False,
) -> dict[str, GraphModule]:
    """The graphs of ``kinds`` that ``analysis`` supports, by kind (see :data:`GRAPH_KINDS`).

    ``backward`` and ``train_step`` need the analysis's backward graph; ``forward_gradient_step``
    its JVP graph (it uses the analysis's optimizer, ``sgd`` when it has none).

    Args:
        residuals: the forward also outputs what the backward reads
            (:func:`forward_with_residuals`; only with a backward graph).
        sampling: the forward-gradient step samples its directions inside (the analysis's
            ``forward_gradient`` graph; ``directions`` and ``distribution`` are then the
            analysis's) instead of taking them as inputs.
        wgrad_mm: the backward's and train step's weight-gradient convolutions as matrix
            products (:func:`graphflop.passes.conv_wgrad.conv_weight_grads_as_mm`; same FLOPs,
            faster on ONNX Runtime's CPU provider).
    """
    out: dict[str, GraphModule] = {}
    if "forward" in kinds:
        out["forward"] = analysis.forward
        if residuals and analysis.backward is not None:
            out["forward"] = forward_with_residuals(analysis.forward, analysis.backward)
    if analysis.backward is not None:
        if "backward" in kinds:
            out["backward"] = analysis.backward
        if "train_step" in kinds:
            ts = train_step_graph(analysis)
            if ts is not None:
                out["train_step"] = ts
        if wgrad_mm:
            for k in ("backward", "train_step"):
                if k in out:
                    out[k] = conv_weight_grads_as_mm(out[k])[0]
    if analysis.jvp is not None and "forward_gradient_step" in kinds:
        if sampling and analysis.forward_gradient is not None:
            out["forward_gradient_step"] = analysis.forward_gradient
        else:
            out["forward_gradient_step"] = forward_gradient_graph(
                analysis.forward,
                analysis.report.optimizer or "sgd",
                directions=directions,
                distribution=distribution,
                update=for_every_parameter(analysis.update),
            )
    return out
