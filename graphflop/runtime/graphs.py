"""The step graphs that are run and exported, taken from an :class:`~graphflop.analysis.Analysis`.

This is the one place outside ``passes/`` that assembles them, so the exporter
(:mod:`graphflop.export.onnx`), ``graphflop bench`` and ``graphflop train`` convert and run the
same graphs and build none themselves:

* ``train_step`` — the analysis's own (:attr:`~graphflop.analysis.Analysis.train_step`: forward,
  backward and update inlined, built once on first use);
* ``forward_gradient_step`` — with its directions as inputs (``direction_inputs=True``: ONNX
  Runtime and the training loop feed them, so both runtimes take the same steps); the
  analysis's ``forward_gradient`` graph samples them inside instead.

Every graph returned is FLOP-annotated (``COST``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch.fx import GraphModule

from graphflop.export.onnx import GRAPH_KINDS
from graphflop.passes.optimizer import OptimizerConfig

if TYPE_CHECKING:
    from graphflop.analysis import Analysis

__all__ = ["GRAPH_KINDS", "forward_gradient_graph", "step_graphs", "train_step_graph"]


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


def step_graphs(
    analysis: Analysis,
    *,
    kinds: tuple[str, ...] = GRAPH_KINDS,
    directions: int = 1,
    distribution: str = "normal",
) -> dict[str, GraphModule]:
    """The graphs of ``kinds`` that ``analysis`` supports, by kind (see :data:`GRAPH_KINDS`).

    ``backward`` and ``train_step`` need the analysis's backward graph; ``forward_gradient_step``
    its JVP graph (it uses the analysis's optimizer, ``sgd`` when it has none).
    """
    out: dict[str, GraphModule] = {}
    if "forward" in kinds:
        out["forward"] = analysis.forward
    if analysis.backward is not None:
        if "backward" in kinds:
            out["backward"] = analysis.backward
        if "train_step" in kinds:
            ts = train_step_graph(analysis)
            if ts is not None:
                out["train_step"] = ts
    if analysis.jvp is not None and "forward_gradient_step" in kinds:
        out["forward_gradient_step"] = forward_gradient_graph(
            analysis.forward,
            analysis.report.optimizer or "sgd",
            directions=directions,
            distribution=distribution,
            update=analysis.update,
        )
    return out
