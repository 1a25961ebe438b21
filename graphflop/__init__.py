"""graphflop: FLOP- and memory-annotated forward, backward and JVP graphs of PyTorch models.

Public API (see ``docs/api.md``). Graph passes take and return ``torch.fx.GraphModule``s and
check their prerequisites; each is also a torch.fx ``PassBase`` (:class:`BuildVjp`, ...) for
torch.fx's :class:`PassManager` (:mod:`graphflop.passes.infra`). Node annotations are
documented in :mod:`graphflop.meta`.

* :func:`trace`, :func:`from_exported` — a model, or a ``torch.export`` program, → forward graph
  of core ATen ops on fake tensors (with its loss);
* :func:`build_vjp`, :func:`build_jvp`, :func:`add_optimizer_update`,
  :func:`build_forward_gradient_step` — the backward, JVP, update and forward-gradient graphs;
* :func:`annotate_flops`, :func:`annotate_memory` — FLOP/byte and peak-memory annotations;
* :func:`build_train_step` — forward, backward and update as one graph;
* :func:`analyze` — all of the above with a typed :class:`Report` (:class:`Analysis`);
* :func:`register_rule` — cost/JVP/transpose rules for your own ops;
* :func:`render` — Graphviz pictures; :func:`export_onnx` — ONNX models and a manifest;
* :func:`compile_backend` — a ``torch.compile`` backend that reports every compiled graph.
"""

from graphflop._gc import paused_gc

with paused_gc():  # PyTorch's and graphflop's imports: nothing to collect yet
    from graphflop import ops  # noqa: F401  (fills the rule table)
    from graphflop.analysis import Analysis, AnalyzeOptions, analyze
    from graphflop.api import (
        AddOptimizerUpdate,
        AnnotateFlops,
        AnnotateMemory,
        BuildForwardGradientStep,
        BuildJvp,
        BuildTrainStep,
        BuildVjp,
        add_optimizer_update,
        annotate_flops,
        annotate_memory,
        build_forward_gradient_step,
        build_jvp,
        build_train_step,
        build_vjp,
        register_rule,
    )
    from graphflop.frontend.trace import TraceError, from_exported, trace
    from graphflop.ops.registry import MissingRuleError
    from graphflop.passes.infra import PassManager, PassOrderError
    from graphflop.report import Report

__version__ = "0.1.0"

#: names whose modules load on first use (so that ``import graphflop`` loads neither
#: graphviz, onnx nor torch.compile's machinery): name -> (module, attribute)
_LAZY = {
    "render": ("graphflop.export.graphviz", "render"),
    "export_onnx": ("graphflop.export.onnx", "export_all"),
    "compile_backend": ("graphflop.compile", "compile_backend"),
    "CompileReport": ("graphflop.compile", "CompileReport"),
}


def __getattr__(name: str):
    """Load :data:`_LAZY`'s names on first access (PEP 562)."""
    if name not in _LAZY:
        raise AttributeError(f"module 'graphflop' has no attribute {name!r}")
    import importlib

    module, attr = _LAZY[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "AddOptimizerUpdate",
    "Analysis",
    "AnalyzeOptions",
    "AnnotateFlops",
    "AnnotateMemory",
    "BuildForwardGradientStep",
    "BuildJvp",
    "BuildTrainStep",
    "BuildVjp",
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
    "Report",
    "build_train_step",
    "export_onnx",
    "trace",
]
