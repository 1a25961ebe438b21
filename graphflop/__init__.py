"""graphflop: FLOP- and memory-annotated forward, backward and JVP graphs of PyTorch models.

Public API (see ``docs/api.md``). Graph passes take and return ``torch.fx.GraphModule``s and
check their prerequisites (:mod:`graphflop.passes.manager`); node annotations are documented in
:mod:`graphflop.meta`.

* :func:`trace`, :func:`from_exported` — a model, or a ``torch.export`` program, → forward graph
  of core ATen ops on fake tensors (with its loss);
* :func:`build_vjp`, :func:`build_jvp`, :func:`add_optimizer_update`,
  :func:`build_forward_gradient_step` — the backward, JVP, update and forward-gradient graphs;
* :func:`annotate_flops`, :func:`annotate_memory` — FLOP/byte and peak-memory annotations;
* :func:`analyze` — all of the above with a summary (:class:`Analysis`);
* :func:`register_rule` — cost/JVP/transpose rules for your own ops;
* :func:`render` — Graphviz pictures; :func:`export_onnx` — ONNX models and a manifest;
* :func:`compile_backend` — a ``torch.compile`` backend that reports every compiled graph.
"""

from graphflop import ops  # noqa: F401  (fills the rule table)
from graphflop.analysis import Analysis, analyze
from graphflop.api import (
    add_optimizer_update,
    annotate_flops,
    annotate_memory,
    build_jvp,
    build_vjp,
    register_rule,
)
from graphflop.compile import CompileReport, compile_backend
from graphflop.export.graphviz import render
from graphflop.export.onnx import export_all as export_onnx
from graphflop.frontend.trace import TraceError, from_exported, trace
from graphflop.ops.registry import MissingRuleError
from graphflop.passes.forward_gradient import build_forward_gradient_step
from graphflop.passes.manager import PassManager, PassOrderError

__version__ = "0.1.0"
__all__ = [
    "Analysis",
    "CompileReport",
    "MissingRuleError",
    "PassManager",
    "PassOrderError",
    "TraceError",
    "add_optimizer_update",
    "analyze",
    "annotate_flops",
    "annotate_memory",
    "build_forward_gradient_step",
    "build_jvp",
    "build_vjp",
    "compile_backend",
    "from_exported",
    "register_rule",
    "render",
    "export_onnx",
    "trace",
]
