"""Composite ops routed to graphflop's decompositions while :func:`~graphflop.frontend.trace.trace`
runs (a ``TorchFunctionMode`` plus, while it is on, ``torch.nn.functional``'s names pointed at the
same functions: a process-wide patch, undone on leaving), and the tags that say which nodes a
composite op was decomposed into (:func:`tagged_decompositions`).

Writes :data:`~graphflop.meta.COMPOSITE` on the nodes of the decompositions of the ops in
:data:`EAGER_SAVES`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from graphflop.meta import COMPOSITE, CompositeTag
from graphflop.ops.attention import sdpa

aten = torch.ops.aten

_F_DROPOUT = F.dropout
_F_SDPA = F.scaled_dot_product_attention


def dropout(input: Any, p: float = 0.5, training: bool = True, inplace: bool = False) -> Any:
    """``F.dropout`` whose training mode is ``native_dropout`` on every device."""
    if training and 0 < p < 1 and not inplace:
        return aten.native_dropout.default(input, p, True)[0]
    return _F_DROPOUT(input, p, training, inplace)


class CompositeOps(TorchFunctionMode):
    """Routes composite ops that :func:`~graphflop.frontend.trace.trace` must see whole to
    graphflop's decompositions.

    ``torch.func.functionalize`` (which tracing uses) lets composite ops decompose in C++ before
    the tracer sees them, skipping the decomposition table:

    * scaled dot-product attention would become the CPU kernel's math form (PyTorch scales q and
      k and guards fully masked rows); it goes to :func:`graphflop.ops.attention.sdpa`;
    * training-mode dropout would become ``bernoulli_`` and a division on CPU and meta tensors;
      it goes to ``native_dropout`` (:func:`dropout`), as ``torch.export`` and CUDA have it.

    So a model counts the same on every device. Calls made directly are caught by this mode;
    calls from inside other ``torch.nn.functional`` functions (multi-head attention), which run
    with the mode switched off, by pointing ``torch.nn.functional``'s names at the same
    functions while the mode is on.
    """

    def __enter__(self) -> CompositeOps:
        F.scaled_dot_product_attention, F.dropout = sdpa, dropout
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        F.scaled_dot_product_attention, F.dropout = _F_SDPA, _F_DROPOUT
        return super().__exit__(*exc)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is _F_SDPA:
            return sdpa(*args, **kwargs)
        if func is _F_DROPOUT:
            return dropout(*args, **kwargs)
        if func is torch.dropout:
            return dropout(
                *args, **{"training" if k == "train" else k: v for k, v in kwargs.items()}
            )
        return func(*args, **kwargs)


#: What PyTorch autograd saves for backward for the composite ops graphflop decomposes while
#: tracing: op name -> (indices of the op's inputs saved, indices of its outputs saved), from
#: ATen's derivative formulas (tools/autograd/derivatives.yaml; parameters, buffers and running
#: statistics among them are not activations and are left out). Batch, layer and group norm
#: save the input and the per-group mean and inverse std (not ``x - mean`` and ``x̂``);
#: softmax and log-softmax their output; GELU, SiLU, Hardswish, ELU, Softplus their input; dropout
#: its mask (bool on CUDA; a float tensor of the input's dtype on CPU, where ``F.dropout``
#: multiplies by a scaled Bernoulli tensor: see :data:`FLOAT_MASK_ON_CPU`); NLL its input, target
#: and total weight; MSE its input and target.
EAGER_SAVES: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "aten.native_batch_norm.default": ((0,), (1, 2)),
    "aten._native_batch_norm_legit_functional.default": ((0,), (1, 2)),
    "aten._native_batch_norm_legit.default": ((0,), (1, 2)),
    "aten._native_batch_norm_legit.no_stats": ((0,), (1, 2)),
    "aten.native_layer_norm.default": ((0,), (1, 2)),
    "aten.native_group_norm.default": ((0,), (1, 2)),
    "aten.gelu.default": ((0,), ()),
    "aten.silu.default": ((0,), ()),
    "aten.hardswish.default": ((0,), ()),
    "aten.hardtanh.default": ((0,), ()),
    "aten.elu.default": ((), (0,)),
    "aten.softplus.default": ((0,), ()),
    "aten._softmax.default": ((), (0,)),
    "aten._log_softmax.default": ((), (0,)),
    "aten.native_dropout.default": ((), (1,)),
    "aten.nll_loss_forward.default": ((0, 1), (1,)),
    "aten.nll_loss2d_forward.default": ((0, 1), (1,)),
    "aten.mse_loss.default": ((0, 1), ()),
}

#: composite ops whose saved mask is, on CPU, a tensor of the input's dtype (output 0's)
FLOAT_MASK_ON_CPU = frozenset({"aten.native_dropout.default"})


_SAME_BYTES_VIEWS = frozenset(
    {aten.squeeze.dims, aten.squeeze.dim, aten.squeeze.default, aten.unsqueeze.default}
    | {aten.view.default, aten._unsafe_view.default, aten.alias.default}
)


def tagged_decompositions(table: dict[Any, Callable[..., Any]]) -> dict[Any, Callable[..., Any]]:
    """``table`` with the decompositions of the ops in :data:`EAGER_SAVES` wrapped so that the
    nodes each one adds to the graph being traced get a :class:`~graphflop.meta.CompositeTag`
    (an outer composite op's tags replace those of the ones it decomposes into). The graph is
    unchanged. Returns a new dict."""
    counter = itertools.count()
    out = dict(table)
    for op, fn in table.items():
        name = str(op)
        if name in EAGER_SAVES:
            out[op] = _tagging(name, fn, counter)
    return out


def _tagging(name: str, fn: Callable[..., Any], counter: Iterator[int]) -> Callable[..., Any]:
    def decomposed(*args: Any, **kwargs: Any) -> Any:
        mode = get_proxy_mode()
        if mode is None:
            return fn(*args, **kwargs)
        graph = mode.tracer.graph
        last = next(iter(reversed(graph.nodes)), None)
        result = fn(*args, **kwargs)
        new = []
        for n in reversed(graph.nodes):
            if n is last:
                break
            new.append(n)
        _tag(name, next(counter), new, args, result, mode.tracer)
        return result

    decomposed.__name__ = getattr(fn, "__name__", "decomposed")
    decomposed.__doc__ = fn.__doc__
    return decomposed


def _node_of(t: Any, tracer: Any) -> Any:
    if not isinstance(t, torch.Tensor):
        return None
    slot = get_proxy_slot(t, tracer, None)
    return getattr(getattr(slot, "proxy", None), "node", None)


def _tag(name: str, region: int, new: list, args: tuple, result: Any, tracer: Any) -> None:
    inputs = {}
    for k, a in enumerate(args):
        node = _node_of(a, tracer)
        if node is not None:
            inputs.setdefault(node, k)
    outputs: dict = {}
    inner = set(new)
    for k, t in enumerate(tree_flatten(result)[0]):
        node = _node_of(t, tracer)
        # an output that is a view of an inner node (batch norm's squeezed mean) names that
        # node too: unused outputs are removed from the graph, their bases stay
        while node is not None:
            outputs.setdefault(node, k)
            base = node.all_input_nodes[0] if len(node.all_input_nodes) == 1 else None
            node = base if node.target in _SAME_BYTES_VIEWS and base in inner else None
    for n in new:
        reads = tuple((i, inputs[a]) for i, a in enumerate(n.all_input_nodes) if a in inputs)
        n.meta[COMPOSITE] = CompositeTag(name, region, outputs.get(n), reads)
