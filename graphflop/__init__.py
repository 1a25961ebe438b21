"""graphflop: FLOP- and memory-annotated forward, backward and JVP graphs of PyTorch models.

Public API (each takes and returns ``torch.fx.GraphModule``s or an :class:`Analysis`):

* :func:`analyze` — trace a model and build, annotate and summarise every graph;
* :func:`trace` — model → forward graph of core ATen ops on fake tensors (with its loss);
* :func:`build_vjp`, :func:`build_jvp`, :func:`build_update` — the backward, JVP and update graphs;
* :func:`annotate_flops` — FLOP and byte annotations on every node.
"""

from graphflop import ops  # noqa: F401  (fills the rule table)
from graphflop.ops.registry import register as register_rule
from graphflop.passes.flops import annotate_flops
from graphflop.passes.forward_gradient import build_forward_gradient_step
from graphflop.passes.jvp import build_jvp
from graphflop.passes.optimizer import build_update
from graphflop.passes.pipeline import Analysis, analyze
from graphflop.passes.vjp import build_vjp
from graphflop.trace import trace

__version__ = "0.1.0"
__all__ = [
    "Analysis",
    "analyze",
    "annotate_flops",
    "build_jvp",
    "build_update",
    "build_vjp",
    "register_rule",
    "trace",
    "build_forward_gradient_step",
]
