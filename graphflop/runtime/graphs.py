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
from graphflop.passes.optimizer import OptimizerConfig

if TYPE_CHECKING:
    from graphflop.analysis import Analysis

__all__ = [
    "GRAPH_KINDS",
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
    on the ``meta`` device (``device=`` arguments of factory ops such as ``aten.full``,
    ``aten.scalar_tensor``, ``aten.randn``), so it runs on real tensors; ``gm`` itself is left
    as it is (graph meta shared)."""
    import copy

    target = torch.device(device)

    def swap(a):
        return target if isinstance(a, torch.device) and a.type == "meta" else a

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
            products (:func:`conv_weight_grads_as_mm`; same FLOPs, faster on ONNX Runtime's
            CPU provider).
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
                update=analysis.update,
            )
    return out


#: a convolution whose output has at most this many positions per channel and a kernel with at
#: least as many is weight-gradient shaped (the backward's ``dW = conv(xᵀ, gᵀ)``)
_WGRAD_MAX_OUT = 64


def conv_weight_grads_as_mm(gm: GraphModule) -> tuple[GraphModule, int]:
    """A copy of ``gm`` in which every weight-gradient-shaped 2-D convolution (stride 1,
    dilation 1, one group, no bias, not transposed; at most 64 output positions and a kernel of
    at least as many) is written as one matrix product per output position, FLOP-annotated;
    and how many were rewritten. ``gm`` is left as it is.

    The backward's weight gradient ``dW = conv(x.permute(1, 0, 2, 3), g.permute(1, 0, 2, 3))``
    has a kernel as large as the feature map and a k×k output; ONNX Runtime's CPU ``Conv``
    computes it as one skinny GEMM per (output position) column block and runs it several times
    slower than the forward convolution of the same FLOPs (see ``docs/seed-b/bench.md``). Here
    each output position (i, j) becomes ``pad(x)[:, :, i:i+Hk, j:j+Wk]`` flattened to
    ``(B, Cin·Hk·Wk)`` times the flattened kernel's transpose ``(Cin·Hk·Wk, Cout)``: the same
    multiply-adds (graphflop's count is unchanged: 2·B·Cout·Cin·Hk·Wk per position), as
    well-shaped GEMMs, at the price of copying each shifted window (B·Cin·Hk·Wk values per
    position). New nodes inherit the convolution's role, module and source.
    """
    import copy

    from graphflop.passes.flops import annotate_flops

    g = copy.deepcopy(gm.graph)
    count = 0
    for n in list(g.nodes):
        if _wgrad_shaped(n):
            n.replace_all_uses_with(_as_mm(g, n))
            g.erase_node(n)
            count += 1
    out = GraphModule(gm, g)
    out.meta.update(gm.meta)
    if count:  # the copied nodes keep their COST; the new ones need theirs
        annotate_flops(out)
    return out, count


def _wgrad_shaped(n: torch.fx.Node) -> bool:
    if n.op != "call_function" or n.target is not torch.ops.aten.convolution.default:
        return False
    _, wt, bias, stride, _, dilation, transposed, _, groups = n.args
    if bias is not None or transposed or groups != 1 or len(stride) != 2:
        return False
    if any(s != 1 for s in stride) or any(d != 1 for d in dilation):
        return False
    oh, ow = n.meta["val"].shape[2:]
    hk, wk = wt.meta["val"].shape[2:]
    return oh * ow <= _WGRAD_MAX_OUT and hk * wk >= oh * ow


def _as_mm(g: torch.fx.Graph, n: torch.fx.Node) -> torch.fx.Node:
    """The nodes computing convolution ``n`` as one ``mm`` per output position."""
    aten = torch.ops.aten
    inp, wt, _, _, padding, *_ = n.args
    b, cout, oh, ow = n.meta["val"].shape
    hk, wk = wt.meta["val"].shape[2:]
    keep = {k: v for k, v in n.meta.items() if k not in ("val", "tensor_meta")}

    def add(target, *args, **kwargs):
        node = g.call_function(target, args, kwargs)
        node.meta.update(keep)
        node.meta["val"] = target(*_meta_args(args), **kwargs)
        return node

    with g.inserting_before(n):
        ph, pw = padding
        x = add(aten.constant_pad_nd.default, inp, [pw, pw, ph, ph], 0.0) if ph or pw else inp
        w = add(aten.clone.default, wt, memory_format=torch.contiguous_format)
        wt_t = add(aten.permute.default, add(aten.view.default, w, [cout, -1]), [1, 0])
        cols = []
        for i in range(oh):
            for j in range(ow):
                s = add(aten.slice.Tensor, add(aten.slice.Tensor, x, 2, i, i + hk), 3, j, j + wk)
                s = add(aten.view.default, add(aten.clone.default, s), [b, -1])
                cols.append(add(aten.unsqueeze.default, add(aten.mm.default, s, wt_t), 2))
        out = add(aten.cat.default, cols, 2)
        return add(aten.view.default, out, [b, cout, oh, ow])


def _meta_args(args):
    """``args`` with every node replaced by an empty meta tensor of its value's shape and
    dtype (to compute a new node's ``val``)."""

    def one(a):
        if isinstance(a, torch.fx.Node):
            v = a.meta["val"]
            return torch.empty(tuple(v.shape), dtype=v.dtype, device="meta")
        return a

    return torch.fx.node.map_aggregate(args, one)
