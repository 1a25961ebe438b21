"""``graphflop.compile_backend``: a ``torch.compile`` backend that annotates every graph Dynamo
hands it and then runs that graph unchanged.

For each graph (one per graph break), the inputs that require a gradient (parameters and
activations arriving from an earlier graph) become the graph's parameters; graphflop traces the
graph to core ATen, builds its backward graph and annotates FLOPs and memory. When the graph's
first output is a scalar it is the loss the backward starts from; otherwise graphflop seeds the
backward with the sum of the first output, and leaves that sum out of the reported FLOPs (it is
not the program's work). The compiled function is Dynamo's own graph, so outputs and gradients
are bit-identical to eager.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from graphflop.meta import COST, ROLE, ZERO_COST
from graphflop.report import Report


@dataclass
class GraphReport:
    """FLOPs and memory of one compiled graph.

    Attributes:
        index: position among the compiled graphs (graph breaks make several).
        forward_flops, forward_mm_flops: the graph's own forward work.
        backward_flops, backward_mm_flops: its backward graph (gradients of every input that
            requires one), without the seed of a loss graphflop added.
        report: the full ``graphflop inspect`` report for this graph.
    """

    index: int
    forward_flops: int
    forward_mm_flops: int
    backward_flops: int
    backward_mm_flops: int
    report: Report


@dataclass
class CompileReport:
    """Reports of every graph compiled with :func:`compile_backend`."""

    graphs: list[GraphReport] = field(default_factory=list)

    @property
    def forward_flops(self) -> int:
        return sum(g.forward_flops for g in self.graphs)

    @property
    def backward_flops(self) -> int:
        return sum(g.backward_flops for g in self.graphs)


class _Lifted(nn.Module):
    """A Dynamo graph as a module whose parameters are the inputs that require a gradient."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: list, grad_mask: list[bool]):
        super().__init__()
        self.gm = gm
        self.grad_mask = grad_mask
        self.lifted = nn.ParameterList(
            nn.Parameter(torch.empty(tuple(t.shape), dtype=t.dtype, device="meta"))
            for t, g in zip(example_inputs, grad_mask)
            if g
        )

    def forward(self, *rest: torch.Tensor):
        it_p, it_r = iter(self.lifted), iter(rest)
        args = [next(it_p) if g else next(it_r) for g in self.grad_mask]
        out = self.gm(*args)
        return tuple(out) if isinstance(out, (list, tuple)) else (out,)


def _sum_cost(nodes, skip_role: str | None):
    flops = mm = 0
    for n in nodes:
        if n.op != "call_function" or (skip_role and n.meta.get(ROLE) == skip_role):
            continue
        c = n.meta.get(COST, ZERO_COST)
        flops += c.flops
        mm += c.mm_flops
    return flops, mm


def compile_backend(
    report: CompileReport | None = None, *, optimizer: str = "sgd"
) -> Callable[..., Callable]:
    """A ``torch.compile`` backend recording per-graph FLOPs and memory into ``report``.

    Usage: ``torch.compile(model, backend=graphflop.compile_backend(report=r))``.
    """
    from graphflop.analysis import analyze

    report = report if report is not None else CompileReport()

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        tensors = [t for t in example_inputs if isinstance(t, torch.Tensor)]
        if len(tensors) != len(example_inputs):
            raise TypeError("graphflop.compile_backend supports tensor graph inputs only")
        grad_mask = [bool(t.requires_grad) for t in example_inputs]
        lifted = _Lifted(gm, example_inputs, grad_mask)
        rest = tuple(
            torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")
            for t, g in zip(example_inputs, grad_mask)
            if not g
        )
        with torch.device("meta"):
            out = lifted(*rest)
        first = out[0]
        scalar = first.numel() == 1 and first.is_floating_point()
        loss = "output" if scalar else "sum"
        a = analyze(
            lifted, rest, loss=loss, optimizer=optimizer, jvp=False, backward=any(grad_mask)
        )
        skip = None if scalar else "loss"
        ff, fm = _sum_cost(a.forward.graph.nodes, skip)
        bf, bm = _sum_cost(a.backward.graph.nodes, skip) if a.backward is not None else (0, 0)
        report.graphs.append(GraphReport(len(report.graphs), ff, fm, bf, bm, a.report))
        return gm.forward

    backend.report = report  # type: ignore[attr-defined]
    return backend
