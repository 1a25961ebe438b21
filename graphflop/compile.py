"""``graphflop.compile_backend``: a ``torch.compile`` backend that annotates every graph Dynamo
hands it and then runs that graph unchanged.

For each graph (one per graph break), the inputs that require a gradient (parameters and
activations arriving from an earlier graph) become the graph's parameters; graphflop traces the
graph to core ATen, builds its backward graph and annotates FLOPs and memory. When the graph's
first output is a scalar it is the loss the backward starts from; otherwise graphflop seeds the
backward with the sum of the first output, and leaves that sum out of the reported FLOPs (it is
not the program's work). The compiled function is Dynamo's own graph, so outputs and gradients
are bit-identical to eager.

Symbolic shapes (``torch.compile(..., dynamic=True)``, or PyTorch's automatic recompile with a
dynamic batch dimension when a second batch size comes): the graph is counted at the sizes
PyTorch hints for its symbols (the sizes of the call that compiled it), and the graph's
:attr:`GraphReport.note` says so. A graph graphflop cannot analyse still runs, uncounted, with a
warning, and its reason is listed in :attr:`CompileReport.skipped`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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
        note: how symbolic sizes were counted (``"symbolic sizes counted at their hints:
            s0=5"``), else empty.
    """

    index: int
    forward_flops: int
    forward_mm_flops: int
    backward_flops: int
    backward_mm_flops: int
    report: Report
    note: str = ""


@dataclass
class CompileReport:
    """Reports of every graph compiled with :func:`compile_backend`; ``skipped``: one line per
    graph that ran uncounted (why graphflop could not analyse it)."""

    graphs: list[GraphReport] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    @property
    def forward_flops(self) -> int:
        return sum(g.forward_flops for g in self.graphs)

    @property
    def backward_flops(self) -> int:
        return sum(g.backward_flops for g in self.graphs)


def _hint(v: Any) -> Any:
    """A concrete int for a ``SymInt`` (the size PyTorch hints for it), else ``v``."""
    if isinstance(v, torch.SymInt):
        from torch.fx.experimental import symbolic_shapes

        hint = getattr(symbolic_shapes, "optimization_hint", None)
        return int(hint(v)) if hint is not None else int(v.node.hint)
    return v


def _symbols(example_inputs: list) -> dict[str, int]:
    """The symbolic sizes among ``example_inputs`` (SymInt inputs and tensor sizes) and their
    hints, by symbol name."""
    found: dict[str, int] = {}
    for t in example_inputs:
        sizes = tuple(t.shape) if isinstance(t, torch.Tensor) else (t,)
        for s in sizes:
            if isinstance(s, torch.SymInt):
                found.setdefault(str(s), _hint(s))
    return found


class _Lifted(nn.Module):
    """A Dynamo graph as a module whose parameters are the inputs that require a gradient;
    non-tensor inputs (a symbolic size) are fixed at their hint."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: list, grad_mask: list[bool]):
        super().__init__()
        self.gm = gm
        self.grad_mask = grad_mask
        self.fixed = {
            i: _hint(t) for i, t in enumerate(example_inputs) if not isinstance(t, torch.Tensor)
        }
        self.lifted = nn.ParameterList(
            nn.Parameter(torch.empty(_shape(t), dtype=t.dtype, device="meta"))
            for t, g in zip(example_inputs, grad_mask)
            if g
        )

    def forward(self, *rest: torch.Tensor):
        it_p, it_r = iter(self.lifted), iter(rest)
        args = [
            self.fixed[i] if i in self.fixed else next(it_p) if g else next(it_r)
            for i, g in enumerate(self.grad_mask)
        ]
        out = self.gm(*args)
        return tuple(out) if isinstance(out, (list, tuple)) else (out,)


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(_hint(s) for s in t.shape)


def _sum_cost(nodes, skip_role: str | None):
    flops = mm = 0
    for n in nodes:
        if n.op != "call_function" or (skip_role and n.meta.get(ROLE) == skip_role):
            continue
        c = n.meta.get(COST, ZERO_COST)
        flops += c.flops
        mm += c.mm_flops
    return flops, mm


def _analyse(
    gm: torch.fx.GraphModule, example_inputs: list, index: int, optimizer: str
) -> GraphReport:
    """The :class:`GraphReport` of one Dynamo graph (symbolic sizes at their hints).

    Raises:
        TypeError: an input that is neither a tensor nor an int; anything analyze raises.
    """
    from graphflop.analysis import AnalyzeOptions, analyze

    for t in example_inputs:
        if not isinstance(t, (torch.Tensor, int, torch.SymInt)):
            raise TypeError(f"unsupported graph input {type(t).__name__} (tensors and sizes only)")
    symbols = _symbols(example_inputs)
    grad_mask = [isinstance(t, torch.Tensor) and bool(t.requires_grad) for t in example_inputs]
    lifted = _Lifted(gm, example_inputs, grad_mask)
    rest = tuple(
        torch.empty(_shape(t), dtype=t.dtype, device="meta")
        for t, g in zip(example_inputs, grad_mask)
        if isinstance(t, torch.Tensor) and not g
    )
    with torch.device("meta"):
        out = lifted(*rest)
    first = out[0]
    scalar = first.numel() == 1 and first.is_floating_point()
    loss = "output" if scalar else "sum"
    # compiled under torch.no_grad() (Dynamo guards on grad mode and compiles again when it
    # changes): no backward will run, so none is counted
    backward = any(grad_mask) and torch.is_grad_enabled()
    a = analyze(
        lifted, rest, AnalyzeOptions(loss=loss, optimizer=optimizer, jvp=False, backward=backward)
    )
    skip = None if scalar else "loss"
    ff, fm = _sum_cost(a.forward.graph.nodes, skip)
    bf, bm = _sum_cost(a.backward.graph.nodes, skip) if a.backward is not None else (0, 0)
    note = (
        "symbolic sizes counted at their hints: "
        + ", ".join(f"{k}={v}" for k, v in symbols.items())
        if symbols
        else ""
    )
    return GraphReport(index, ff, fm, bf, bm, a.report, note)


def compile_backend(
    report: CompileReport | None = None, *, optimizer: str = "sgd"
) -> Callable[..., Callable]:
    """A ``torch.compile`` backend recording per-graph FLOPs and memory into ``report``.

    Usage: ``torch.compile(model, backend=graphflop.compile_backend(report=r))``. Symbolic
    sizes are counted at their hints (see the module docstring); a graph that cannot be
    analysed runs uncounted with a ``UserWarning`` and a line in ``report.skipped``.

    Raises:
        TypeError: ``report`` is not a :class:`CompileReport` (checked here, not when
            ``torch.compile`` first calls the backend).
        ValueError: an unknown ``optimizer``.
    """
    if report is not None and not isinstance(report, CompileReport):
        raise TypeError(f"report must be a graphflop CompileReport, not {type(report).__name__}")
    from graphflop.passes.optimizer import OPTIMIZERS

    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; one of {', '.join(OPTIMIZERS)}")
    report = report if report is not None else CompileReport()

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        try:
            report.graphs.append(_analyse(gm, example_inputs, len(report.graphs), optimizer))
        except Exception as e:  # count what can be counted; never break the user's program
            why = f"graph {len(report.graphs) + len(report.skipped)}: {type(e).__name__}: {e}"
            report.skipped.append(why)
            warnings.warn(
                f"graphflop.compile_backend could not analyse {why}; it runs uncounted",
                stacklevel=2,
            )
        return gm.forward

    backend.report = report  # type: ignore[attr-defined]
    return backend
