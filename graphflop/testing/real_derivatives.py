"""A function's derivatives from graphflop's generated graphs run on real tensors, beside eager
PyTorch's, element by element (the op tests of selects and zeros: tests/test_ops_select.py,
tests/test_ops_zeros.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.fx import GraphModule

from graphflop.ad.jvp import build_jvp
from graphflop.ad.vjp import build_vjp
from graphflop.frontend.trace import trace
from graphflop.meta import JVP, SIGNATURE, VJP
from graphflop.runtime.verify import run_backward, run_forward
from graphflop.runtime.verify_tangent import run_jvp
from graphflop.testing.opdb.core import Fn

__all__ = ["eager_derivatives", "graphs", "graphflop_derivatives"]


def graphs(
    f: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor]
) -> tuple[GraphModule, GraphModule, GraphModule]:
    """(forward, JVP with every output's tangent, backward with input gradients) of ``f``
    traced with the sum loss."""
    fwd = trace(Fn(lambda s, *xs: f(*xs)), tuple(inputs), loss="sum")
    return fwd, build_jvp(fwd, "all", wrt_outputs="outputs"), build_vjp(fwd, input_grads=True)


def graphflop_derivatives(
    f: Callable[..., torch.Tensor],
    inputs: Sequence[torch.Tensor],
    tangents: Sequence[torch.Tensor],
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """graphflop's (tangent of ``f``'s output along ``tangents``, gradients of its sum per
    input), its generated graphs run on ``inputs``."""
    fwd, jvp, bwd = graphs(f, inputs)
    sig = fwd.meta[SIGNATURE]
    values = dict(zip(sig.inputs, inputs))
    info = jvp.meta[JVP]
    outs = run_jvp(jvp, values, dict(zip(sig.inputs, tangents)))
    out_tangent = dict(zip(info.tangent_outputs, outs[info.primal_outputs :]))[sig.outputs[0]]
    grads = run_backward(bwd, run_forward(fwd, values))
    by_name = {n: grads[pos] for pos, n in bwd.meta[VJP].input_grads}
    return out_tangent, tuple(by_name[n] for n in sig.inputs)


def eager_derivatives(
    f: Callable[..., torch.Tensor],
    inputs: Sequence[torch.Tensor],
    tangents: Sequence[torch.Tensor],
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Eager PyTorch's (``torch.func.jvp`` tangent, ``torch.autograd.grad`` of the sum)."""
    leaves = [x.clone().requires_grad_() for x in inputs]
    grads = torch.autograd.grad(f(*leaves).sum(), leaves)
    return torch.func.jvp(f, tuple(inputs), tuple(tangents))[1], grads
