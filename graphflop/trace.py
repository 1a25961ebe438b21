"""Model → forward graph of core ATen ops on FakeTensors, with the loss at its end.

``torch.export`` (non-strict, so Python control flow on shapes traces) turns the model and a loss
into a graph whose placeholders are the parameters, buffers, inputs and loss targets; PyTorch's
core-ATen decomposition table, extended to batch norm and the softmax/NLL losses, breaks
composite ops into the parts FLOPS.md counts. Tracing runs on FakeTensors: no activation memory.

Writes on each node: ``val`` (PyTorch), ``gf_kind="primal"``, ``gf_role`` (``forward`` or
``loss``), ``gf_source``, ``gf_module`` (the ``nn.Module`` path), ``gf_param_derived``; on
parameter placeholders ``gf_param``. Writes ``gm.meta["gf_signature"]``.
"""

from __future__ import annotations

import math
import operator
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._decomp import core_aten_decompositions, get_decompositions
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule
from torch.utils._pytree import tree_flatten

from graphflop.meta import (
    KIND,
    MODULE,
    PARAM,
    PARAM_DERIVED,
    ROLE,
    SIGNATURE,
    SOURCE,
    Signature,
    fake_mode_of,
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
    table[aten.native_group_norm.default] = _group_norm
    table[aten._adaptive_avg_pool2d.default] = _adaptive_avg_pool2d
    table[aten.adaptive_avg_pool2d.default] = _adaptive_avg_pool2d
    global _SDPA_FALLBACK
    _SDPA_FALLBACK = table.get(aten.scaled_dot_product_attention.default)
    table[aten.scaled_dot_product_attention.default] = _sdpa
    table[aten.mv.default] = _mv
    table[aten.dot.default] = _dot
    return table


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


def _sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
          enable_gqa=False):
    """``scaled_dot_product_attention`` in its math form: ``softmax(q·kᵀ·scale + mask)·v``.

    The two batched products are counted in ``mm_flops`` whatever the mask (FLOPS.md: the dense
    kernel computes the full matrix); the causal mask is a ``where`` over the scores built from
    two ``arange``; a given ``attn_mask`` is added (float) or applied with ``where`` (bool), and
    rows it masks entirely give zeros, as PyTorch's kernels do. Grouped-query attention goes
    to PyTorch's decomposition.
    """
    if enable_gqa and q.shape[-3] != k.shape[-3]:
        return _SDPA_FALLBACK(q, k, v, attn_mask, dropout_p, is_causal, scale=scale,
                              enable_gqa=enable_gqa)
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


def _mv(a, v):
    """(M×K)·(K) as an (M×K)·(K×1) matrix product."""
    return aten.squeeze.dims(aten.mm.default(a, aten.unsqueeze.default(v, 1)), [1])


def _dot(a, v):
    """(K)·(K) as a (1×K)·(K×1) matrix product."""
    prod = aten.mm.default(aten.unsqueeze.default(a, 0), aten.unsqueeze.default(v, 1))
    return aten.squeeze.dims(prod, [0, 1])


class Objective(nn.Module):
    """The model followed by its loss: ``forward(*inputs, *targets) -> (loss, *outputs)``."""

    def __init__(self, model: nn.Module, loss: str):
        super().__init__()
        self.model = model
        self.loss = loss

    def forward(self, *args: torch.Tensor):
        n_targets = 1 if self.loss in ("cross_entropy", "mse") else 0
        inputs = args[: len(args) - n_targets]
        out = self.model(*inputs)
        flat, _ = tree_flatten(out)
        first = flat[0]
        if self.loss == "cross_entropy":
            loss = F.cross_entropy(first, args[-1])
        elif self.loss == "mse":
            loss = F.mse_loss(first, args[-1])
        elif self.loss == "sum":
            loss = first.sum()
        elif self.loss == "output":  # the model computes its own scalar loss
            loss = first
        else:
            return tuple(flat)
        return (loss, *flat)


def default_loss(out: Any) -> str:
    """Cross-entropy for ``(N, C)`` floating logits, ``sum`` otherwise."""
    flat, _ = tree_flatten(out)
    first = flat[0] if flat else None
    if isinstance(first, torch.Tensor) and first.dim() == 2 and first.is_floating_point():
        return "cross_entropy"
    return "sum"


def make_targets(loss: str, out: torch.Tensor, fake_mode: FakeTensorMode) -> tuple:
    with fake_mode:
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
) -> GraphModule:
    """Trace ``model`` on ``inputs`` (FakeTensors or real tensors) followed by ``loss``.

    Args:
        model: the module; its mode (train/eval) is used as is.
        inputs: one tensor per positional input.
        loss: ``cross_entropy`` (against integer targets), ``mse``, ``sum``, ``output`` (the
            model's first output is already the scalar loss), ``none`` or ``auto``
            (cross-entropy for (N, C) logits, else sum).

    Returns:
        An ``fx.GraphModule`` of core ATen ops. Its placeholders are the parameters, buffers,
        inputs and targets (see ``gm.meta["gf_signature"]``); its outputs are the buffer updates,
        then the loss, then the model's outputs.

    Raises:
        TraceError: when ``torch.export`` cannot trace the model (the cause is chained).
    """
    if loss not in LOSSES + ("auto",):
        raise ValueError(f"unknown loss {loss!r}; one of {', '.join(LOSSES)} or auto")
    fake_mode = fake_mode or fake_mode_of(inputs) or FakeTensorMode(allow_non_fake_inputs=True)
    inputs = tuple(fake_mode.from_tensor(t) if not _is_fake(t) else t for t in inputs)
    try:
        with fake_mode:
            out = model(*inputs)
    except Exception as e:
        raise TraceError(
            f"running the model on the example inputs failed: {type(e).__name__}: {_first_line(e)}"
        ) from e
    if loss == "auto":
        loss = default_loss(out)
    flat_out, _ = tree_flatten(out)
    targets = make_targets(loss, flat_out[0], fake_mode)
    wrapper = Objective(model, loss)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ep = torch.export.export(wrapper, inputs + targets, strict=False)
            ep = ep.run_decompositions(decomposition_table())
    except Exception as e:
        raise TraceError(
            f"torch.export could not trace the model: {type(e).__name__}: {_first_line(e)}"
        ) from e
    return _to_graph(ep, n_inputs=len(inputs), loss_index=None if loss == "none" else 0,
                     loss_kind=loss, wrapped=True)


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
    gm = _to_graph(ep, n_inputs=n_user, loss_index=loss_output, loss_kind=loss_kind,
                   wrapped=False)
    sig = gm.meta[SIGNATURE]
    if sig.loss is not None:
        val = next(n for n in gm.graph.nodes if n.name == sig.loss).meta["val"]
        if val.numel() != 1:
            raise TraceError(f"output {loss_output} is not a scalar loss (shape "
                             f"{tuple(val.shape)}); pass loss_output=None or the loss's index")
    return gm


def _to_graph(ep, *, n_inputs: int, loss_index: int | None, loss_kind: str,
              wrapped: bool) -> GraphModule:
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
    gm.meta[SIGNATURE] = signature
    gm.meta["gf_constants"] = constants
    gm.meta["gf_loss_kind"] = loss_kind
    gm.meta["gf_facts"] = {"traced"}
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
            deps = [a for a in n.all_input_nodes if _has_float(a.meta.get("val"))]
            n.meta[PARAM_DERIVED] = all(a.meta.get(PARAM_DERIVED, False) for a in deps)
        else:
            n.meta[PARAM_DERIVED] = False


def _has_float(v: Any) -> bool:
    if isinstance(v, (tuple, list)):
        return any(_has_float(x) for x in v)
    return isinstance(v, torch.Tensor) and v.is_floating_point()


def _is_fake(t: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
