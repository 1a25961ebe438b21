"""Model → forward graph of core ATen ops on FakeTensors, with the loss at its end.

``make_fx`` over ``torch.func.functionalize`` (Python control flow on shapes traces; in-place
ops become functional, buffer writes become outputs) turns the model and a loss into a graph
whose placeholders are the parameters, buffers, inputs and loss targets, in one pass: PyTorch's
core-ATen decomposition table, extended to batch norm and the softmax/NLL losses, breaks
composite ops into the parts FLOPS.md counts as they are traced. Module paths come from forward
hooks (:class:`_ModuleScopes`); identical repeated modules are traced once
(:mod:`graphflop.frontend.outline`). Tracing runs on FakeTensors: no activation memory.
:func:`from_exported` takes a ``torch.export`` program instead.

Writes on each node: ``val`` (PyTorch), ``KIND="primal"``, ``ROLE`` (``forward`` or
``loss``), ``SOURCE``, ``MODULE`` (the ``nn.Module`` path), ``PARAM_DERIVED``; on
parameter placeholders ``PARAM``. Writes ``gm.meta[SIGNATURE]``.
"""

from __future__ import annotations

import contextlib
import math
import operator
import re
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._decomp import core_aten_decompositions, get_decompositions
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule
from torch.fx.experimental.proxy_tensor import make_fx
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from graphflop.frontend import outline as repeats
from graphflop.meta import (
    CONSTANTS,
    FACTS,
    KIND,
    LOSS_KIND,
    MODULE,
    OUTLINED,
    PARAM,
    PARAM_DERIVED,
    ROLE,
    SIGNATURE,
    SOURCE,
    OutlineInfo,
    Signature,
    fake_mode_of,
    graph_module,
)

aten = torch.ops.aten
LOSSES = ("cross_entropy", "mse", "sum", "output", "none")


class TraceError(RuntimeError):
    """The model could not be traced; the message says why."""


def decomposition_table() -> dict:
    """PyTorch's core-ATen decompositions, extended so that composite ops are counted as the sum
    of their parts (FLOPS.md) and every part has a rule:

    * batch norm, layer norm, softmax, the NLL and MSE losses, hardtanh, GELU, SiLU, ELU,
      dropout, vector norms and adaptive average pooling: PyTorch's own decompositions;
    * nearest and (bi/tri)linear upsampling: PyTorch's decompositions into index ops and
      elementwise arithmetic;
    * group norm: :func:`_group_norm` (views and ``var_mean``; PyTorch's decomposition goes
      through ``as_strided``, which has no rule);
    * adaptive average pooling to a size dividing the input: a mean or ``avg_pool2d``
      (:func:`_adaptive_avg_pool2d`; PyTorch's restrides a channels-last result with
      ``as_strided``); uneven windows use PyTorch's decomposition;
    * scaled dot-product attention: :func:`_sdpa`, the math form with one scaling, the causal
      mask or ``attn_mask``, a softmax and the two products (PyTorch's scales q and k, and
      builds a guard for fully masked rows even where no mask can make one);
    * ``mv`` and ``dot``: matrix products (:func:`_mv`, :func:`_dot`), so that they are counted
      in ``mm_flops`` like every other product (PyTorch's decompositions make them a multiply and a
      sum).
    """
    table = core_aten_decompositions()
    table.update(
        get_decompositions(
            [
                aten._native_batch_norm_legit_functional,
                aten._native_batch_norm_legit.no_stats,
                aten.native_layer_norm,
                aten._log_softmax,
                aten._softmax,
                aten.nll_loss_forward,
                aten.mse_loss,
                aten.hardtanh,
                aten.gelu,
                aten.silu,
                aten.elu,
                aten.native_dropout,
                aten.linalg_vector_norm,
                aten.upsample_nearest1d,
                aten.upsample_nearest2d,
                aten.upsample_nearest3d,
                aten.upsample_linear1d,
                aten.upsample_bilinear2d,
                aten.upsample_trilinear3d,
            ]
        )
    )
    # lean versions of PyTorch's decompositions (the same ops, without the reference
    # implementations' type-promotion wrappers: tracing GPT-2 XL spends half its time in those)
    for op, lean in (
        (aten._softmax.default, _softmax),
        (aten._log_softmax.default, _log_softmax),
        (aten.native_layer_norm.default, _layer_norm),
        (aten.gelu.default, _gelu),
    ):
        _FALLBACKS[op] = table[op]
        table[op] = _lean(lean, table[op])
    table[aten.native_group_norm.default] = _group_norm
    table[aten.native_batch_norm.default] = _batch_norm
    table[aten._native_batch_norm_legit.default] = _batch_norm
    table[aten._adaptive_avg_pool2d.default] = _adaptive_avg_pool2d
    table[aten.adaptive_avg_pool2d.default] = _adaptive_avg_pool2d
    global _SDPA_FALLBACK
    _SDPA_FALLBACK = table.get(aten.scaled_dot_product_attention.default)
    table[aten.scaled_dot_product_attention.default] = _sdpa
    table[aten.mv.default] = _mv
    # in-place view ops that composite kernels apply to fresh temporaries (matmul's
    # vector-matrix case squeezes its product in place) reach the tracer unfunctionalised
    table[aten.squeeze_.dim] = aten.squeeze.dim
    table[aten.squeeze_.dims] = aten.squeeze.dims
    table[aten.squeeze_.default] = aten.squeeze.default
    table[aten.unsqueeze_.default] = aten.unsqueeze.default
    table[aten.transpose_.default] = aten.transpose.int
    table[aten.t_.default] = aten.t.default
    table[aten.as_strided_.default] = _restride
    table[aten.dot.default] = _dot
    return table


_FULL = (torch.float32, torch.float64)
#: PyTorch's decompositions of the ops that have lean versions here
_FALLBACKS: dict = {}


def _lean(fn, fallback):
    """``fn`` for float32/float64 inputs, PyTorch's decomposition ``fallback`` otherwise (it
    computes half-precision inputs in float32)."""

    def op(x, *args, **kwargs):
        if x.dtype in _FULL:
            return fn(x, *args, **kwargs)
        return fallback(x, *args, **kwargs)

    op.__name__ = fn.__name__
    op.__doc__ = fn.__doc__
    return op


def _softmax(x, dim: int, half_to_float: bool):
    """``exp(x - max) / Σ exp(x - max)`` along ``dim``."""
    if half_to_float:
        return _FALLBACKS[aten._softmax.default](x, dim, half_to_float)
    e = aten.exp.default(aten.sub.Tensor(x, aten.amax.default(x, [dim], True)))
    return aten.div.Tensor(e, aten.sum.dim_IntList(e, [dim], True))


def _log_softmax(x, dim: int, half_to_float: bool):
    """``(x - max) - log Σ exp(x - max)`` along ``dim``."""
    if half_to_float:
        return _FALLBACKS[aten._log_softmax.default](x, dim, half_to_float)
    shifted = aten.sub.Tensor(x, aten.amax.default(x, [dim], True))
    total = aten.sum.dim_IntList(aten.exp.default(shifted), [dim], True)
    return aten.sub.Tensor(shifted, aten.log.default(total))


def _layer_norm(x, normalized_shape, weight, bias, eps: float):
    """``(x - mean)·rsqrt(var + eps)·weight + bias`` over the trailing ``normalized_shape``
    dims; returns ``(out, mean, rstd)`` with mean and rstd kept as reduced dims."""
    dims = list(range(x.dim() - len(normalized_shape), x.dim()))
    var, mean = aten.var_mean.correction(x, dims, correction=0, keepdim=True)
    rstd = aten.rsqrt.default(aten.add.Tensor(var, eps))
    out = aten.mul.Tensor(aten.sub.Tensor(x, mean), rstd)
    if weight is not None:
        out = aten.mul.Tensor(out, weight)
    if bias is not None:
        out = aten.add.Tensor(out, bias)
    return out, mean, rstd


def _gelu(x, approximate: str = "none"):
    """``x/2·(1 + erf(x/√2))``, or with ``approximate="tanh"``
    ``x/2·(1 + tanh(√(2/π)·(x + 0.044715·x³)))``."""
    if approximate == "tanh":
        inner = aten.mul.Tensor(aten.mul.Tensor(aten.mul.Tensor(x, x), x), 0.044715)
        inner = aten.mul.Tensor(aten.add.Tensor(x, inner), math.sqrt(2 / math.pi))
        half = aten.mul.Tensor(x, 0.5)
        return aten.mul.Tensor(half, aten.add.Tensor(aten.tanh.default(inner), 1))
    half = aten.mul.Tensor(x, 0.5)
    return aten.mul.Tensor(
        half, aten.add.Tensor(aten.erf.default(aten.mul.Tensor(x, math.sqrt(0.5))), 1)
    )


def _group_norm(x, weight, bias, n: int, c: int, hxw: int, groups: int, eps: float):
    """``native_group_norm`` as views, ``var_mean`` and elementwise ops: returns
    ``(out, mean, rstd)`` with mean and rstd of shape (N, groups), as PyTorch does."""
    shape = list(x.shape)
    xg = x.reshape(n, groups, -1)
    var, mean = aten.var_mean.correction(xg, [2], correction=0, keepdim=True)
    rstd = aten.rsqrt.default(aten.add.Tensor(var, eps))
    out = aten.mul.Tensor(aten.sub.Tensor(xg, mean), rstd).reshape(shape)
    chan = [1, c] + [1] * (len(shape) - 2)
    if weight is not None:
        out = aten.mul.Tensor(out, aten.view.default(weight, chan))
    if bias is not None:
        out = aten.add.Tensor(out, aten.view.default(bias, chan))
    return out, aten.view.default(mean, [n, groups]), aten.view.default(rstd, [n, groups])


def _batch_norm(
    x, weight, bias, running_mean, running_var, training: bool, momentum: float, eps: float
):
    """``native_batch_norm`` with its running-statistics update made visible: the functional
    form, then ``copy_`` of the new statistics into the buffers (which tracing turns into buffer
    updates). Functionalisation cannot see this update: the op's schema does not mark the
    running statistics as written."""
    if not training:
        return aten._native_batch_norm_legit_no_training.default(
            x, weight, bias, running_mean, running_var, momentum, eps
        )
    if running_mean is None:
        return aten._native_batch_norm_legit.no_stats(x, weight, bias, True, momentum, eps)
    out, mean, rstd, new_mean, new_var = aten._native_batch_norm_legit_functional.default(
        x, weight, bias, running_mean, running_var, True, momentum, eps
    )
    running_mean.copy_(new_mean)
    running_var.copy_(new_var)
    return out, mean, rstd


def _adaptive_avg_pool2d(x, output_size):
    """``_adaptive_avg_pool2d``: a mean over H, W for a 1×1 output, an ``avg_pool2d`` with
    kernel = stride = input/output when the output divides the input, else PyTorch's
    decomposition (index arithmetic for uneven windows)."""
    from torch._decomp import decomposition_table as torch_table

    h, w = x.shape[-2], x.shape[-1]
    oh, ow = output_size
    if oh == 1 and ow == 1:
        return aten.mean.dim(x, [-2, -1], True)
    if h % oh == 0 and w % ow == 0:
        k = [h // oh, w // ow]
        return aten.avg_pool2d.default(x, k, k)
    return torch_table[aten._adaptive_avg_pool2d.default](x, output_size)


_SDPA_FALLBACK = None


def _sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``scaled_dot_product_attention`` in its math form: ``softmax(q·kᵀ·scale + mask)·v``.

    The two batched products are counted in ``mm_flops`` whatever the mask (FLOPS.md: the dense
    kernel computes the full matrix); the causal mask is a ``where`` over the scores built from
    two ``arange``; a given ``attn_mask`` is added (float) or applied with ``where`` (bool), and
    rows it masks entirely give zeros, as PyTorch's kernels do. Grouped-query attention goes
    to PyTorch's decomposition.
    """
    if enable_gqa and q.shape[-3] != k.shape[-3]:
        return _SDPA_FALLBACK(
            q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )
    L, S, E = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    scores = torch.matmul(q * scale, k.transpose(-2, -1))
    neg_inf = float("-inf")
    if is_causal:
        rows = torch.arange(L, device=q.device).unsqueeze(1)
        cols = torch.arange(S, device=q.device).unsqueeze(0)
        scores = torch.where(rows >= cols, scores, neg_inf)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = torch.where(attn_mask, scores, neg_inf)
        else:
            scores = scores + attn_mask
    weights = torch.softmax(scores, dim=-1)
    if attn_mask is not None:  # a row the mask hides entirely: zeros, not NaN
        live = torch.any(scores != neg_inf, dim=-1, keepdim=True)
        weights = torch.where(live, weights, 0.0)
    if dropout_p > 0.0:
        weights = aten.native_dropout.default(weights, dropout_p, True)[0]
    return torch.matmul(weights, v)


def _restride(x, size, stride, storage_offset=None):
    """``as_strided_`` that only changes strides (adaptive average pooling to 1×1 restrides its
    fresh result to channels-last): the same values, so the tensor itself; any other use is
    traced as is (and has no rule)."""
    if list(x.shape) == list(size) and not storage_offset:
        return x
    return NotImplemented


def _mv(a, v):
    """(M×K)·(K) as an (M×K)·(K×1) matrix product."""
    return aten.squeeze.dims(aten.mm.default(a, aten.unsqueeze.default(v, 1)), [1])


def _dot(a, v):
    """(K)·(K) as a (1×K)·(K×1) matrix product."""
    prod = aten.mm.default(aten.unsqueeze.default(a, 0), aten.unsqueeze.default(v, 1))
    return aten.squeeze.dims(prod, [0, 1])


def loss_value(kind: str, first: torch.Tensor, targets: tuple = ()) -> torch.Tensor:
    """The scalar loss of kind ``kind`` (one of :data:`LOSSES` but ``none``) of the model's
    first output: cross-entropy or MSE against ``targets[0]``, the sum, or the output itself
    (``output``: the model computes its own loss)."""
    if kind == "cross_entropy":
        return F.cross_entropy(first, targets[0])
    if kind == "mse":
        return F.mse_loss(first, targets[0])
    if kind == "sum":
        return first.sum()
    return first


def default_loss(out: Any) -> str:
    """Cross-entropy for ``(N, C)`` floating logits, ``sum`` otherwise."""
    flat, _ = tree_flatten(out)
    first = flat[0] if flat else None
    if isinstance(first, torch.Tensor) and first.dim() == 2 and first.is_floating_point():
        return "cross_entropy"
    return "sum"


def make_targets(
    loss: str, out: torch.Tensor, fake_mode: FakeTensorMode, inside: bool = False
) -> tuple:
    """Loss targets for ``out``: class indices (cross-entropy) or a tensor like ``out`` (MSE).
    ``inside``: already under ``fake_mode`` (while tracing)."""
    with contextlib.nullcontext() if inside else fake_mode:
        if loss == "cross_entropy":
            return (torch.zeros(out.shape[0], dtype=torch.long, device=out.device),)
        if loss == "mse":
            return (torch.empty(out.shape, dtype=out.dtype, device=out.device),)
    return ()


def _module_path(node, wrapped: bool = True) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    if not wrapped:
        return path
    if path == "":
        return "loss"
    if path == "model":
        return ""
    return path[len("model.") :] if path.startswith("model.") else path


def trace(
    model: nn.Module,
    inputs: tuple[torch.Tensor, ...],
    *,
    loss: str = "auto",
    fake_mode: FakeTensorMode | None = None,
    reuse: bool = True,
) -> GraphModule:
    """Trace ``model`` on ``inputs`` (FakeTensors or real tensors) followed by ``loss``.

    Args:
        model: the module; its mode (train/eval) is used as is.
        inputs: one tensor per positional input.
        loss: ``cross_entropy`` (against integer targets), ``mse``, ``sum``, ``output`` (the
            model's first output is already the scalar loss), ``none`` or ``auto``
            (cross-entropy for (N, C) logits, else sum).
        fake_mode: the FakeTensorMode to trace in (default: the inputs', else a new one).
        reuse: trace each set of identical repeated modules (a transformer's blocks) once
            and copy the graph (:mod:`graphflop.frontend.outline`); the graph is the same either way.

    Returns:
        An ``fx.GraphModule`` of core ATen ops. Its placeholders are the parameters, buffers,
        inputs and targets (see ``gm.meta[SIGNATURE]``); its outputs are the buffer updates,
        then the loss, then the model's outputs.

    Raises:
        TraceError: when the model cannot be traced (the cause is chained).
    """
    if loss not in LOSSES + ("auto",):
        raise ValueError(f"unknown loss {loss!r}; one of {', '.join(LOSSES)} or auto")
    fake_mode = fake_mode or fake_mode_of(inputs) or FakeTensorMode(allow_non_fake_inputs=True)
    inputs = tuple(fake_mode.from_tensor(t) if not _is_fake(t) else t for t in inputs)
    with _state_kept(model), _quiet_fake_tensor_log():
        return _trace(model, inputs, loss, fake_mode, reuse)


@contextlib.contextmanager
def _state_kept(model: nn.Module):
    """Puts every module's parameters and buffers back afterwards: ``functional_call`` leaves
    a module reachable by two paths holding the traced tensors (a PyTorch bug)."""
    saved = [(m, dict(m._parameters), dict(m._buffers)) for m in model.modules()]
    try:
        yield
    finally:
        for m, params, buffers in saved:
            m._parameters.update(params)
            m._buffers.update(buffers)


@contextlib.contextmanager
def _quiet_fake_tensor_log():
    """FakeTensorMode logs a traceback before re-raising a kernel's error (a shape mismatch in
    the model); the error itself becomes graphflop's one-line TraceError."""
    import logging

    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def _trace(model, inputs, loss, fake_mode, reuse) -> GraphModule:
    excluded: set[int] = set()
    while True:
        outline = repeats.plan(model, excluded) if reuse else {}
        try:
            return _trace_once(model, inputs, loss, fake_mode, outline)
        except Exception as e:
            cause = _find(e, repeats.NotOutlinable)
            if cause is None or not outline:
                raise
            excluded.add(cause.structure)
            # a structure's own fault: leave it out; past two retries (or a fault of no
            # structure), trace everything in full rather than start again once more
            reuse = cause.structure >= 0 and len(excluded) <= 2


def _trace_once(
    model: nn.Module, inputs: tuple, loss: str, fake_mode: FakeTensorMode, outline: dict
) -> GraphModule:
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    flat_state = [
        fake_mode.from_tensor(t) if not _is_fake(t) else t
        for t in [*params.values(), *buffers.values()]
    ]
    n_p, n_b = len(params), len(buffers)
    chosen: dict[str, Any] = {}

    def objective(*flat):
        state = (dict(zip(params, flat[:n_p])), dict(zip(buffers, flat[n_p : n_p + n_b])))
        with _ModuleScopes(model) as scopes:
            out = torch.func.functional_call(model, state, tuple(flat[n_p + n_b :]))
            scopes.leave_model()
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            if not outs:
                raise TraceError(
                    f"no tensor in the model's output (a {type(out).__name__}): return a "
                    "tensor, or a tuple, list or dict of tensors"
                )
            kind = default_loss(out) if loss == "auto" else loss
            chosen["loss"] = kind
            if kind == "none":
                return tuple(outs)
            # the targets are made here, in the graph, and become placeholders afterwards
            targets = make_targets(kind, outs[0], fake_mode, inside=True)
            chosen["targets"] = [scopes.mark(t) for t in targets]
            return (loss_value(kind, outs[0], targets), *outs)

    table = decomposition_table()
    outliner = repeats.Outliner(outline)
    try:
        with warnings.catch_warnings(), _CompositeOps(), fake_mode:
            warnings.simplefilter("ignore")
            with outliner:
                gm = make_fx(
                    torch.func.functionalize(objective),
                    decomposition_table=table,
                    _allow_fake_constant=True,
                )(*flat_state, *inputs)
            templates = {}
            for key, call in enumerate(outliner.calls):
                templates[key] = _trace_template(outliner, key, call, table, fake_mode)
    except TraceError:
        raise
    except Exception as e:
        if _find(e, repeats.NotOutlinable) is not None:
            raise
        raise TraceError(
            f"tracing the model on the example inputs failed: {type(e).__name__}: {_first_line(e)}"
        ) from e
    copies = repeats.inline(gm.graph, templates, model)
    out = _from_make_fx(
        gm,
        params=list(params),
        buffers=list(buffers),
        n_inputs=len(inputs),
        loss_kind=chosen["loss"],
        target_nodes=chosen.get("targets", []),
    )
    out.meta[OUTLINED] = OutlineInfo(calls=copies, traced_once=len(templates))
    return out


def _trace_template(outliner, key: int, call, table, fake_mode) -> torch.fx.Graph:
    """The graph of one outlined module call, module paths relative to :data:`repeats.MARK`."""
    fn = outliner.template_fn(key)

    def scoped(*tensors):
        with _ModuleScopes(
            call.module, prefix=repeats.MARK, base=[(repeats.MARK, _qualname(call.module))]
        ):
            return fn(*tensors)

    gm = make_fx(torch.func.functionalize(scoped), decomposition_table=table)(
        *outliner.example_tensors(key, fake_mode)
    )
    for n in gm.graph.nodes:
        if n.op == "get_attr" or (n.op == "call_function" and n.target is aten.copy_.default):
            raise repeats.NotOutlinable(call.structure, "makes constants or writes in place")
    # the trace continued from the outputs' metadata as PyTorch's kernels give it; the
    # decomposed graph must give the same, or the rest of the trace could differ
    out = next(n for n in gm.graph.nodes if n.op == "output")
    got = [(tuple(a.meta["val"].shape), a.meta["val"].stride()) for a in out.args[0]]
    if got != [m[:2] for m in call.out_meta]:
        raise repeats.NotOutlinable(call.structure, "its graph's outputs are strided otherwise")
    return gm.graph


def _find(e: BaseException | None, kind: type) -> Any:
    """``e`` or the first exception of ``kind`` in its cause/context chain."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, kind):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _dropout(input, p: float = 0.5, training: bool = True, inplace: bool = False):
    """``F.dropout`` whose training mode is ``native_dropout`` on every device."""
    if training and 0 < p < 1 and not inplace:
        return aten.native_dropout.default(input, p, True)[0]
    return _F_DROPOUT(input, p, training, inplace)


_F_DROPOUT = F.dropout
_F_SDPA = F.scaled_dot_product_attention


class _CompositeOps(TorchFunctionMode):
    """Routes composite ops that :func:`trace` must see whole to graphflop's decompositions.

    ``torch.func.functionalize`` (which :func:`trace` uses) lets composite ops decompose in
    C++ before the tracer sees them, skipping the decomposition table:

    * scaled dot-product attention would become the CPU kernel's math form (PyTorch scales q and
      k and guards fully masked rows); it goes to :func:`_sdpa`;
    * training-mode dropout would become ``bernoulli_`` and a division on CPU and meta tensors;
      it goes to ``native_dropout``, as ``torch.export`` and CUDA have it.

    So a model counts the same on every device. Calls made directly are caught by this mode;
    calls from inside other ``torch.nn.functional`` functions (multi-head attention), which run
    with the mode switched off, by pointing ``torch.nn.functional``'s names at the same
    functions while the mode is on.
    """

    def __enter__(self):
        F.scaled_dot_product_attention, F.dropout = _sdpa, _dropout
        return super().__enter__()

    def __exit__(self, *exc):
        F.scaled_dot_product_attention, F.dropout = _F_SDPA, _F_DROPOUT
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _F_SDPA:
            return _sdpa(*args, **kwargs)
        if func is _F_DROPOUT:
            return _dropout(*args, **kwargs)
        if func is torch.dropout:
            return _dropout(
                *args, **{"training" if k == "train" else k: v for k, v in kwargs.items()}
            )
        return func(*args, **kwargs)


class _ModuleScopes:
    """Records, while ``make_fx`` traces, which module call each new graph node comes from.

    Global forward hooks keep a stack of the module paths being run; at every hook the nodes
    added since the last one are given the stack as PyTorch's ``nn_module_stack`` (paths
    prefixed ``model.``, the loss at the root ``""``), the format ``torch.export`` writes.
    """

    def __init__(self, model: nn.Module, prefix: str = "model", base: list | None = None):
        self.prefix = prefix
        self.paths = {}
        for name, m in model.named_modules(remove_duplicate=False):
            self.paths.setdefault(id(m), f"{prefix}.{name}" if name else prefix)
        # the root scope holds the loss ("Objective" in renders, as the model-plus-loss wrapper
        # torch.export traced was called)
        self.stack = (
            list(base)
            if base is not None
            else [("", "graphflop.trace.Objective"), (prefix, _qualname(model))]
        )
        self.graph = None
        self.cursor = None

    def __enter__(self):
        try:
            from torch.fx.experimental.proxy_tensor import get_proxy_mode

            mode = get_proxy_mode()
        except ImportError:  # pragma: no cover - a PyTorch without it: no module paths
            mode = None
        self.graph = mode.tracer.graph if mode is not None else None
        self.cursor = self._last()
        self.handles = [
            torch.nn.modules.module.register_module_forward_pre_hook(self._enter),
            torch.nn.modules.module.register_module_forward_hook(self._leave, always_call=True),
        ]
        return self

    def __exit__(self, *exc):
        self._flush()
        for h in self.handles:
            h.remove()
        return False

    def _last(self):
        if self.graph is None:
            return None
        return next(iter(reversed(self.graph.nodes)), None)

    def _flush(self) -> None:
        if self.graph is None:
            return
        n = self.cursor.next if self.cursor is not None else next(iter(self.graph.nodes), None)
        stack = {path: (path, cls) for path, cls in self.stack if path is not None}
        while n is not None and n.op != "root":
            n.meta.setdefault("nn_module_stack", stack)
            n = n.next
        self.cursor = self._last()

    def _enter(self, module, args):
        self._flush()
        path = self.paths.get(id(module))
        if path != self.prefix:  # the root itself is already on the stack
            self.stack.append((path, _qualname(module)))

    def _leave(self, module, args, out):
        if self.paths.get(id(module)) == self.prefix:
            return
        self._flush()
        self.stack.pop()

    def leave_model(self) -> None:
        self._flush()
        self.stack = self.stack[:1]

    def mark(self, t: torch.Tensor):
        """The graph node that made ``t`` (the last one added)."""
        self._flush()
        return self.cursor


def _qualname(m: nn.Module) -> str:
    return f"{type(m).__module__}.{type(m).__qualname__}"


def _from_make_fx(
    gm: GraphModule,
    *,
    params: list[str],
    buffers: list[str],
    n_inputs: int,
    loss_kind: str,
    target_nodes: list,
) -> GraphModule:
    """``make_fx``'s graph in graphflop's form: placeholders named and classified as
    ``torch.export`` does (``p_model_*``, ``b_model_*``, ``args_i``; constants made in forward
    become fixed buffers), the target nodes made inside the trace turned into placeholders, the
    functionalised buffer writes (``copy_`` into a placeholder) turned into outputs."""
    old = gm.graph
    phs = [n for n in old.nodes if n.op == "placeholder"]
    n_p, n_b = len(params), len(buffers)
    out_node = next(n for n in reversed(old.nodes) if n.op == "output")
    writes: dict = {}
    order = {n: i for i, n in enumerate(old.nodes)}
    for n in list(old.nodes):
        if n.op == "call_function" and n.target is aten.copy_.default and n.args[0] in phs:
            i = phs.index(n.args[0])
            if not n_p <= i < n_p + n_b:
                what = params[i] if i < n_p else f"input {i - n_p - n_b}"
                raise TraceError(
                    f"the model writes in place into {what}; only buffers may be updated in forward"
                )
            ph, value = n.args
            later = [u for u in ph.users if order[u] > order[n]]
            for u in later:  # reads after the write see the new value
                u.replace_input_with(ph, value)
            writes[buffers[i - n_p]] = value
            n.replace_all_uses_with(value)
            old.erase_node(n)
    g = torch.fx.Graph()
    env: dict = {}
    sig_params, sig_buffers, model_inputs, target_names = [], [], [], []
    constants: dict[str, torch.Tensor] = {}

    def placeholder(name: str, src):
        ph = g.placeholder(name)
        ph.meta.update(src.meta)
        ph.meta.pop("nn_module_stack", None)
        return ph

    for i, n in enumerate(phs):
        if i < n_p:
            env[n] = placeholder("p_model_" + _ident(params[i]), n)
            sig_params.append((env[n].name, params[i]))
        elif i < n_p + n_b:
            env[n] = placeholder("b_model_" + _ident(buffers[i - n_p]), n)
            sig_buffers.append((env[n].name, buffers[i - n_p]))
    for n in old.nodes:
        if n.op == "get_attr":  # torch.tensor(...) made in forward: a fixed buffer
            env[n] = placeholder("c_" + _ident(n.target), n)
            sig_buffers.append((env[n].name, n.target))
            constants[env[n].name] = getattr(gm, n.target)
    for i, n in enumerate(phs[n_p + n_b :]):
        env[n] = placeholder(f"args_{i}", n)
        model_inputs.append(env[n].name)
    for j, n in enumerate(target_nodes):
        env[n] = placeholder(f"args_{n_inputs + j}", n)
        target_names.append(env[n].name)
    for n in old.nodes:
        if n in env or n.op in ("placeholder", "get_attr", "output"):
            continue
        env[n] = g.node_copy(n, lambda a: env[a])
    results = [env[a] for a in out_node.args[0]]
    updates = [(env[v].name, b) for b, v in writes.items()]
    g.output(tuple([env[writes[b]] for b in writes] + results))
    g.eliminate_dead_code()
    new = graph_module(torch.nn.Module(), g)
    has_loss = loss_kind != "none"
    signature = Signature(
        params=tuple(sig_params),
        buffers=tuple(sig_buffers),
        inputs=tuple(model_inputs),
        targets=tuple(target_names),
        loss=results[0].name if has_loss else None,
        outputs=tuple(r.name for r in results[1 if has_loss else 0 :]),
        buffer_updates=tuple(updates),
    )
    return _finish(new, signature, constants, loss_kind, wrapped=True)


def _ident(name: str) -> str:
    return re.sub(r"[^0-9a-zA-Z_]", "_", name).lower()


def from_exported(
    ep: torch.export.ExportedProgram, *, loss_output: int | None = 0, loss_kind: str = "output"
) -> GraphModule:
    """A graphflop forward graph from a user's ``torch.export`` program.

    The program is decomposed to the same core-ATen set as :func:`trace` and its placeholders
    classified (parameters, buffers, inputs). ``loss_output`` names the user output that is the
    scalar loss the backward starts from (``None``: no loss; only forward and JVP graphs then).

    Raises:
        TraceError: when the program cannot be decomposed or the loss output is not a scalar.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ep = ep.run_decompositions(decomposition_table())
    except Exception as e:
        raise TraceError(f"decomposing the exported program failed: {_first_line(e)}") from e
    n_user = sum(1 for s_ in ep.graph_signature.input_specs if s_.kind.name == "USER_INPUT")
    gm = _to_graph(ep, n_inputs=n_user, loss_index=loss_output, loss_kind=loss_kind, wrapped=False)
    sig = gm.meta[SIGNATURE]
    if sig.loss is not None:
        val = next(n for n in gm.graph.nodes if n.name == sig.loss).meta["val"]
        if val.numel() != 1:
            raise TraceError(
                f"output {loss_output} is not a scalar loss (shape "
                f"{tuple(val.shape)}); pass loss_output=None or the loss's index"
            )
    return gm


def _to_graph(
    ep, *, n_inputs: int, loss_index: int | None, loss_kind: str, wrapped: bool
) -> GraphModule:
    prefix = "model." if wrapped else ""
    gm = ep.graph_module
    sig = ep.graph_signature
    params, buffers, user_inputs = [], [], []
    constants: dict[str, torch.Tensor] = {}
    for spec in sig.input_specs:
        kind = spec.kind.name
        name = spec.arg.name
        if kind == "PARAMETER":
            params.append((name, spec.target.removeprefix(prefix)))
        elif kind == "BUFFER":
            buffers.append((name, spec.target.removeprefix(prefix)))
        elif kind == "USER_INPUT":
            user_inputs.append(name)
        elif kind == "CONSTANT_TENSOR":  # torch.tensor(...) made in forward: a fixed buffer
            buffers.append((name, spec.target.removeprefix(prefix)))
            constants[name] = ep.constants[spec.target]
        else:
            raise TraceError(f"unsupported graph input kind {kind} for {name}")
    model_inputs, target_names = user_inputs[:n_inputs], user_inputs[n_inputs:]
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    out_args = list(out_node.args[0])
    buffer_updates, user_outs = [], []
    for spec, a in zip(sig.output_specs, out_args):
        if spec.kind.name == "BUFFER_MUTATION":
            buffer_updates.append((a.name, spec.target.removeprefix(prefix)))
        elif spec.kind.name == "USER_OUTPUT":
            user_outs.append(a)
        else:
            raise TraceError(f"unsupported graph output kind {spec.kind.name}")
    loss_name = user_outs[loss_index].name if loss_index is not None else None
    model_outs = [o for i, o in enumerate(user_outs) if i != loss_index]
    signature = Signature(
        params=tuple(params),
        buffers=tuple(buffers),
        inputs=tuple(model_inputs),
        targets=tuple(target_names),
        loss=loss_name,
        outputs=tuple(n.name for n in model_outs if hasattr(n, "name")),
        buffer_updates=tuple(buffer_updates),
    )
    return _finish(gm, signature, constants, loss_kind, wrapped)


def _finish(
    gm: GraphModule, signature: Signature, constants: dict, loss_kind: str, wrapped: bool
) -> GraphModule:
    gm.meta[SIGNATURE] = signature
    gm.meta[CONSTANTS] = constants
    gm.meta[LOSS_KIND] = loss_kind
    gm.meta[FACTS] = {"traced"}
    _complete_getitems(gm)
    _tag_nodes(gm, signature, wrapped)
    return gm


def _complete_getitems(gm: GraphModule) -> None:
    """Give every output of a multi-output op a ``getitem`` node, so derivative rules can read
    any of them (max pooling's indices) as an ordinary forward value."""
    for n in list(gm.graph.nodes):
        val = n.meta.get("val")
        if n.op != "call_function" or not isinstance(val, (tuple, list)):
            continue
        have = {u.args[1] for u in n.users if u.target is operator.getitem}
        last = n
        for i, v in enumerate(val):
            if i in have or not isinstance(v, torch.Tensor):
                continue
            with gm.graph.inserting_after(last):
                g = gm.graph.call_function(operator.getitem, (n, i))
            g.meta.update({k: v_ for k, v_ in n.meta.items() if k != "val"})
            g.meta["val"] = v
            last = g
    gm.recompile()


def _tag_nodes(gm: GraphModule, sig: Signature, wrapped: bool = True) -> None:
    param_names = dict(sig.params)
    constants = set(param_names) | {n for n, _ in sig.buffers}
    for n in gm.graph.nodes:
        n.meta[KIND] = "primal"
        n.meta[SOURCE] = n.name
        if n.op == "placeholder":
            n.meta[MODULE] = ""
            n.meta[ROLE] = "forward"
            n.meta[PARAM_DERIVED] = n.name in constants
            if n.name in param_names:
                n.meta[PARAM] = param_names[n.name]
            continue
        path = _module_path(n, wrapped)
        n.meta[MODULE] = path
        n.meta[ROLE] = "loss" if path == "loss" else "forward"
        if n.op == "call_function":
            # computed from parameters, buffers and constants only (an embedding lookup at the
            # model's token ids is not; one at arange positions is)
            n.meta[PARAM_DERIVED] = all(a.meta.get(PARAM_DERIVED, False) for a in n.all_input_nodes)
        else:
            n.meta[PARAM_DERIVED] = False


def _is_fake(t: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
