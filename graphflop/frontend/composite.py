"""Composite ops routed to graphflop's decompositions while :func:`~graphflop.frontend.trace.trace`
runs (a ``TorchFunctionMode`` plus, while it is on, ``torch.nn.functional``'s names pointed at the
same functions: a process-wide patch, undone on leaving), and the tags that say which nodes a
composite op was decomposed into (:func:`tagged_decompositions`).

Writes :data:`~graphflop.meta.COMPOSITE` on the nodes of the decompositions of the ops in
:data:`EAGER_SAVES`, and on the nodes of an attention call PyTorch would run with its fused CPU
kernel (:data:`FUSED_SDPA`, :func:`fused_on_cpu`); :data:`~graphflop.meta.INPLACE` on the node
of each in-place call the model makes (:func:`in_place_call`; ``selu_`` and ``rrelu_``, which
functionalization refuses, traced as the in-place ops eager runs for them); an in-place call, a setitem or a call with ``out=``
made with grad mode off (or into a view of a ``detach()``, :func:`graphflop.frontend.regions.detached_write`)
goes through :func:`graphflop.frontend.regions.no_grad_write`, which writes
:data:`~graphflop.meta.NO_GRAD_WRITE`. A write through ``t.data`` (:func:`data_write`) goes
there too where no op can have saved ``t``'s old value, and is refused otherwise.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import operator
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from graphflop.frontend import recording
from graphflop.frontend.errors import TraceError
from graphflop.frontend.regions import (
    TRACED_GRAD_FN,
    detached_write,
    eager_flags,
    no_grad_write,
    requires_grad_in_trace,
)
from graphflop.meta import COMPOSITE, INPLACE, CompositeTag
from graphflop.ops import has_rule, lookup
from graphflop.ops.attention import sdpa

aten = torch.ops.aten

_F_DROPOUT = F.dropout
#: ``h[i] = v``: an in-place write (functionalization makes it a scatter into ``h``)
_SETITEM = torch.Tensor.__setitem__
_F_SDPA = F.scaled_dot_product_attention
#: ``F.cosine_similarity`` is this builtin
_COSINE_SIMILARITY = torch.cosine_similarity


def dropout(input: Any, p: float = 0.5, training: bool = True, inplace: bool = False) -> Any:
    """``F.dropout`` whose training mode is ``native_dropout`` on every device."""
    if training and 0 < p < 1:
        out = aten.native_dropout.default(input, p, True)[0]
        # in place: the same mask and scaling written back (as F.dropout(inplace=True) does;
        # its own path traced as bernoulli_ and counted differently: tester's finding)
        return input.copy_(out) if inplace else out
    return _F_DROPOUT(input, p, training, inplace)


def cosine_similarity(x1: Any, x2: Any, dim: int = 1, eps: float = 1e-8) -> Any:
    """``F.cosine_similarity`` (``nn.CosineSimilarity``) as ATen's composite computes it
    (``aten/src/ATen/native/Distance.cpp``), step for step: the two inputs broadcast to one
    shape, each one's norm along ``dim`` (``linalg_vector_norm``, kept dim) cloned and clamped
    to at least ``eps`` in place with grad mode off, then ``sum((x1 / n1) * (x2 / n2), dim)``.

    ATen clamps under a C++ ``NoGradGuard``, inside the op, where the tracer would tag the
    clamps grad-mode-off nodes (no derivative: a norm treated as a constant); eager autograd
    records the clone and not the clamp, so the derivative goes through the norm as if the
    clamp were not there (with its value). Made here as a write with grad mode off
    (:meth:`CompositeOps._in_place`), the clamp is traced as the model's own
    ``with torch.no_grad(): n.clamp_min_(eps)`` would be, with eager's derivative. Inputs that
    are not both floating point of one dtype go to PyTorch's own op (which casts them first)."""
    if not (
        isinstance(x1, torch.Tensor)
        and isinstance(x2, torch.Tensor)
        and x1.is_floating_point()
        and x1.dtype == x2.dtype
    ):
        return _COSINE_SIMILARITY(x1, x2, dim, eps)
    x1, x2 = torch.broadcast_tensors(x1, x2)
    n1 = torch.linalg.vector_norm(x1, 2, dim=dim, keepdim=True).clone()
    n2 = torch.linalg.vector_norm(x2, 2, dim=dim, keepdim=True).clone()
    with torch.no_grad():
        CompositeOps._in_place(torch.Tensor.clamp_min_, (n1, eps), {})
        CompositeOps._in_place(torch.Tensor.clamp_min_, (n2, eps), {})
    return ((x1 / n1) * (x2 / n2)).sum(dim)


class CompositeOps(TorchFunctionMode):
    """Routes composite ops that :func:`~graphflop.frontend.trace.trace` must see whole to
    graphflop's decompositions.

    ``torch.func.functionalize`` (which tracing uses) lets composite ops decompose in C++ before
    the tracer sees them, skipping the decomposition table:

    * scaled dot-product attention would become the CPU kernel's math form (PyTorch scales q and
      k and guards fully masked rows); it goes to :func:`graphflop.ops.attention.sdpa`;
    * training-mode dropout would become ``bernoulli_`` and a division on CPU and meta tensors;
      it goes to ``native_dropout`` (:func:`dropout`), as ``torch.export`` and CUDA have it;
    * cosine similarity would clamp its norms under a C++ ``NoGradGuard`` the tracer sees as the
      model's grad mode (the derivative through the norms dropped); it goes to
      :func:`cosine_similarity`, the same ops with the clamps traced as writes with grad mode
      off, which eager autograd does not record.

    So a model counts the same on every device. Calls made directly are caught by this mode;
    calls from inside other ``torch.nn.functional`` functions (multi-head attention), which run
    with the mode switched off, by pointing ``torch.nn.functional``'s names at the same
    functions while the mode is on.

    The model's reads of a traced value's ``requires_grad``, ``is_leaf`` and ``grad_fn`` are
    answered here as eager training would (:func:`_grad_flag`; the fake tensors' own flags say
    nothing of it).
    """

    def __enter__(self) -> CompositeOps:
        # attention takes F.scaled_dot_product_attention's arguments as *args, **kwargs
        F.scaled_dot_product_attention, F.dropout = attention, dropout  # type: ignore[assignment]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        F.scaled_dot_product_attention, F.dropout = _F_SDPA, _F_DROPOUT
        return super().__exit__(*exc)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is _F_SDPA:
            return attention(*args, **kwargs)
        if func is _F_DROPOUT:
            return dropout(*args, **kwargs)
        if func is _COSINE_SIMILARITY and recording.recording():
            return cosine_similarity(*args, **kwargs)
        if func is torch.dropout:
            return dropout(
                *args, **{"training" if k == "train" else k: v for k, v in kwargs.items()}
            )
        owner = getattr(func, "__self__", None)
        if owner is _REQUIRES_GRAD or owner is _IS_LEAF or owner is _GRAD_FN:
            return _grad_flag(func, owner, args)
        if owner is _DATA and recording.recording():
            out = func(*args, **kwargs)
            if len(_DATA_ALIASES) > 4096:  # forget the tensors gone
                for k in [k for k, r in _DATA_ALIASES.items() if r() is None]:
                    del _DATA_ALIASES[k]
            _DATA_ALIASES[id(out)] = weakref.ref(out)
            return out
        if func is _SETITEM and recording.recording():
            with data_write(args[0]), detached_write(args[0]), no_grad_write(args[0]):
                return func(*args, **kwargs)
        if func in _MAX_NORM and recording.recording():
            call = inspect.signature(func).bind(*args, **kwargs)
            if call.arguments.get("max_norm") is not None:
                # F.embedding's renormalization of the rows it reads, a write into the weight
                # (torch.embedding_renorm_ on weight.detach()), made here where this mode sees
                # it (inside F.embedding the modes are off)
                a = call.arguments
                ids = a["input"].contiguous()
                self._in_place(
                    torch.embedding_renorm_,
                    (a["weight"].detach(), ids, a["max_norm"], a.get("norm_type", 2.0)),
                    {},
                )
                a["input"], a["max_norm"] = ids, None
                return func(*call.args, **call.kwargs)
        if in_place_call(func, kwargs) and recording.recording():
            return self._in_place(func, args, kwargs)
        out = kwargs.get("out")
        if isinstance(out, torch.Tensor) and recording.recording():
            # ``torch.mul(y, 3, out=y)``: a write into ``out`` (under no_grad, as eager refuses
            # out= on inputs that require grad), traced as the in-place writes are
            with data_write(out), detached_write(out), no_grad_write(out):
                return func(*args, **kwargs)
        return func(*args, **kwargs)

    @staticmethod
    def _in_place(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        func, args, kwargs = _traceable_in_place(func, args, kwargs)
        target = args[0] if args else None
        with (
            data_write(target),
            detached_write(target),
            no_grad_write(target),
            recording.nodes_added() as made,
        ):
            out = func(*args, **kwargs)
        node = recording.node_of(out)
        # on a view, functionalization computes the op out of place, writes the result into
        # the base and takes the view again (view nodes after the op's): the op's node is the
        # one those views start from (an in-place view op, ``t_``, keeps its own node)
        op = node
        while op in made and _is_view(op) and op.args and isinstance(op.args[0], torch.fx.Node):
            op = op.args[0]
        if op is not node and op in made and not _is_view(op):
            node = op
        if node is not None and node.op == "call_function" and node in made:
            node.meta[INPLACE] = True
        return out


#: ``t.data``'s descriptor (a torch-function mode sees its ``__get__``, made anew each read)
_DATA = torch._C.TensorBase.__dict__["data"]
#: the descriptors of ``t.requires_grad``, ``t.is_leaf`` and ``t.grad_fn``, read by the model's
#: code as eager training reads them (:func:`~graphflop.frontend.regions.eager_flags`)
_REQUIRES_GRAD = torch._C.TensorBase.__dict__["requires_grad"]
_IS_LEAF = torch._C.TensorBase.__dict__["is_leaf"]
_GRAD_FN = torch._C.TensorBase.__dict__["grad_fn"]


def _grad_flag(func: Any, owner: Any, args: tuple) -> Any:
    """``t.requires_grad``, ``t.is_leaf`` or ``t.grad_fn`` (``func``, the ``__get__`` of
    ``owner``, called with ``args``: ``t`` first) read by the model's code: for a traced value (a functional wrapper), as eager
    training reads it (:func:`~graphflop.frontend.regions.eager_flags`)."""
    t = args[0]
    if not (recording.recording() and torch._is_functional_tensor(t)):
        return func(*args)
    requires, leaf = eager_flags(t)
    if owner is _REQUIRES_GRAD:
        return requires
    if owner is _IS_LEAF:
        return leaf
    return None if leaf else TRACED_GRAD_FN


#: the tensors ``t.data`` gave while tracing, by ``id``: aliases autograd does not see
_DATA_ALIASES: dict[int, weakref.ref] = {}


@contextlib.contextmanager
def data_write(target: Any) -> Iterator[None]:
    """Around an in-place write into ``target``: where ``target`` is a ``t.data`` (not a view
    of one), grad mode off, as eager autograd sees neither the write nor a version change,
    so ``t`` keeps its derivative (:func:`~graphflop.frontend.regions.no_grad_write`), when
    nothing can have saved ``t``'s old value for the backward: its value is a placeholder's
    (a parameter, an input) no op read yet. Otherwise eager's backward of an op that saved
    the value (``torch.tanh`` its output) would read the written one, silently, which
    graphflop's functional graphs do not model.

    Raises:
        TraceError: the written tensor's old value may be saved for the backward."""
    ref = _DATA_ALIASES.get(id(target)) if isinstance(target, torch.Tensor) else None
    if ref is None or ref() is not target or not torch.is_grad_enabled():
        yield
        return
    node = recording.node_of(target, sync=True)
    if node is not None and (node.op == "call_function" or node.users):
        what = f"the value of {node.name}" if node.op == "call_function" else node.name
        raise TraceError(
            f"the model writes in place through .data into {what}, which autograd may have "
            "saved for the backward (eager's backward then reads the written values, "
            "silently; graphflop's graphs cannot): write out of place (y = y * 2 for "
            "y.data.mul_(2)), or under torch.no_grad() on y itself, where eager autograd "
            "checks the saved values"
        )
    with torch.no_grad():
        yield


def _is_view(n: torch.fx.Node) -> bool:
    """Whether ``n`` calls an op whose rule says its output is a view of its input."""
    return n.op == "call_function" and has_rule(n.target) and lookup(n.target).bytes == "view"


#: ``selu_`` as eager runs it (a CompositeImplicitAutograd op, ``elu_(self, alpha, scale)``,
#: which functionalization refuses whole): SELU's constants
_SELU_ALPHA, _SELU_SCALE = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946


def _selu_(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.ops.aten.elu_.default(x, _SELU_ALPHA, _SELU_SCALE)


def _rrelu_(
    x: torch.Tensor,
    lower: float = 1.0 / 8,
    upper: float = 1.0 / 3,
    training: bool = False,
    *args: Any,
    **kwargs: Any,
) -> torch.Tensor:
    """``rrelu_`` as eager runs it: ``rrelu_with_noise_`` with a new noise tensor."""
    lower, upper = kwargs.get("lower", lower), kwargs.get("upper", upper)
    training = kwargs.get("training", training)
    noise = torch.empty_like(x)
    return torch.ops.aten.rrelu_with_noise_(x, noise, lower, upper, training)


#: in-place functions functionalization cannot trace (CompositeImplicitAutograd in-place ops
#: whose output aliases the input) -> the in-place op eager's decomposition runs
_IN_PLACE_AS: dict[Any, Callable[..., Any]] = {
    F.selu: _selu_,
    torch.selu_: _selu_,
    F.rrelu: _rrelu_,
    torch.rrelu_: _rrelu_,
}


def _traceable_in_place(
    func: Any, args: Any, kwargs: dict[str, Any]
) -> tuple[Any, Any, dict[str, Any]]:
    """``(func, args, kwargs)``, or the in-place op eager's decomposition of ``func`` runs
    (:data:`_IN_PLACE_AS`) with the same arguments."""
    as_run = _IN_PLACE_AS.get(func)
    return (func, args, kwargs) if as_run is None else (as_run, args, kwargs)


#: the functions whose ``max_norm`` renormalizes the weight rows they read, in place
_MAX_NORM = (F.embedding, F.embedding_bag)


def in_place_call(func: Any, kwargs: dict[str, Any]) -> bool:
    """Whether a torch-function call writes into its first argument in eager PyTorch: a
    trailing-underscore function or method (``torch.relu_``, ``Tensor.add_``; not a dunder), an
    augmented assignment (``Tensor.__iadd__``), or one called with ``inplace=True``
    (``F.relu(x, inplace=True)``, as ``nn.ReLU(inplace=True)`` calls it)."""
    name = getattr(func, "__name__", "")
    return (
        (name.endswith("_") and not name.endswith("__"))
        or name in _AUGMENTED
        or kwargs.get("inplace") is True
    )


#: augmented assignments on tensors (``out += identity``, as ResNet's blocks add their shortcut)
_AUGMENTED = frozenset(
    f"__i{op}__"
    for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul")
    + ("and", "or", "xor", "lshift", "rshift")
)


#: What PyTorch autograd saves for backward for the composite ops graphflop decomposes while
#: tracing: op name -> (indices of the op's inputs saved, indices of its outputs saved), from
#: ATen's derivative formulas (tools/autograd/derivatives.yaml; parameters, buffers and running
#: statistics among them are not activations and are left out). Batch, layer and group norm
#: save the input and the per-group mean and inverse std (not ``x - mean`` and ``x̂``);
#: softmax and log-softmax their output; GELU, SiLU, Hardswish, ELU, Softplus their input; dropout
#: its mask (bool on CUDA; a float tensor of the input's dtype on CPU, where ``F.dropout``
#: multiplies by a scaled Bernoulli tensor: see :data:`FLOAT_MASK_ON_CPU`); NLL its input, target
#: and total weight; MSE its input and target; nan_to_num its input (``grad · isfinite(x)``);
#: weight norm's fused kernel v, g and the norms (not the quotient ``g / ‖v‖``).
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
    "aten.elu.default": ((0,), ()),
    "aten.softplus.default": ((0,), ()),
    "aten._softmax.default": ((), (0,)),
    "aten._log_softmax.default": ((), (0,)),
    # the softmax of masked attention scores on the math path (graphflop.ops.attention)
    "aten._safe_softmax.default": ((), (0,)),
    "aten.native_dropout.default": ((), (1,)),
    "aten.nll_loss_forward.default": ((0, 1), (1,)),
    "aten.nll_loss2d_forward.default": ((0, 1), (1,)),
    "aten.mse_loss.default": ((0, 1), ()),
    "aten.nan_to_num.default": ((0,), ()),
    # threshold_backward(grad, self, threshold), hardshrink_backward(grad, self, lambd),
    # softshrink_backward(grad, self, lambd), hardsigmoid_backward(grad, self)
    "aten.threshold.default": ((0,), ()),
    "aten.hardshrink.default": ((0,), ()),
    "aten.softshrink.default": ((0,), ()),
    "aten.hardsigmoid.default": ((0,), ()),
    # reflection_pad2d_backward(grad, self, padding): self, whole, though the kernel reads only
    # its sizes (1d and 3d, and replication padding, alike)
    "aten.reflection_pad1d.default": ((0,), ()),
    "aten.reflection_pad2d.default": ((0,), ()),
    "aten.reflection_pad3d.default": ((0,), ()),
    "aten.replication_pad1d.default": ((0,), ()),
    "aten.replication_pad2d.default": ((0,), ()),
    "aten.replication_pad3d.default": ((0,), ()),
    # _adaptive_avg_pool2d_backward(grad, self): self, whole (adaptive_avg_pool1d runs it on
    # its input unsqueezed); tagged only where the decomposition is index arithmetic
    # (:data:`TAGGED_WHEN`)
    "aten._adaptive_avg_pool2d.default": ((0,), ()),
    # mish_backward(grad, self), celu's elu_backward(grad, alpha, 1, 1/alpha, false, self),
    # glu_backward(grad, self, dim), logit_backward(grad, self, eps)
    "aten.mish.default": ((0,), ()),
    "aten.celu.default": ((0,), ()),
    "aten.glu.default": ((0,), ()),
    "aten.logit.default": ((0,), ()),
    # logsumexp_backward(grad, self, result, dim, keepdim),
    # linalg_vector_norm_backward(grad, self, ord, result, dim, keepdim)
    "aten.logsumexp.default": ((0,), (0,)),
    "aten.linalg_vector_norm.default": ((0,), (0,)),
    # mkldnn_rnn_layer_backward(input, weight0..3, hx_, cx_, result0, result1, result2, ...,
    # result3): an LSTM layer on CPU saves its input, initial states, output, final states
    # and oneDNN's workspace (result3, uint8: graphflop.ops.recurrent); CPU
    # float32 (:data:`CPU_FLOAT32_ONLY`), the weights are parameters
    "aten.mkldnn_rnn_layer.default": ((0, 5, 6), (0, 1, 2, 3)),
    # _weight_norm_interface_backward(grad.contiguous(), v, g, result1, dim): v, g (parameters,
    # as weight norm is used) and the norms, result1 (g's shape; float32 for a bfloat16 or
    # float16 g: graphflop.ops.norm's decomposition). What ``torch._weight_norm`` runs where
    # ``dim`` is 0 or the last, whatever the dtype (aten/src/ATen/native/WeightNorm.cpp,
    # PyTorch 2.13: float16 on CPU too); elsewhere (``dim=None``) it is
    # ``v * (g / norm_except_dim(v))``, made of plain ops before tracing sees it, and no region
    # is tagged
    "aten._weight_norm_interface.default": ((0, 1), (1,)),
    # addcmul: tensor1's gradient grad·tensor2·value, tensor2's grad·tensor1·value: tensor1
    # and tensor2 (not the decomposition's value·tensor1); addcdiv: grad·value/tensor2 and
    # -grad·value·tensor1/tensor2²: tensor1 and tensor2 (not value·tensor1); lerp.Tensor:
    # self's grad·(1 - weight), end's grad·weight, weight's grad·(end - self): all three (not
    # the decomposition's mask and end - self); lerp.Scalar: nothing (weight is a number)
    "aten.addcmul.default": ((1, 2), ()),
    "aten.addcdiv.default": ((1, 2), ()),
    "aten.lerp.Tensor": ((0, 1, 2), ()),
    "aten.lerp.Scalar": ((), ()),
}

#: ops of :data:`EAGER_SAVES` whose saves are modelled for CPU float32 inputs only: elsewhere
#: (cuDNN's LSTM on CUDA; oneDNN's bfloat16 workspace, laid out otherwise) graphflop's residuals
#: stand
CPU_FLOAT32_ONLY = frozenset({"aten.mkldnn_rnn_layer.default"})


def _uneven_adaptive_pool(x: Any, output_size: Any, *args: Any, **kwargs: Any) -> bool:
    """Whether an adaptive pooling's output size does not divide its input's (each window
    computed by index arithmetic in the decomposition)."""
    sizes = tuple(x.shape[-len(output_size) :])
    return any(o and n % o for n, o in zip(sizes, output_size))


#: ops of :data:`EAGER_SAVES` whose decomposition is tagged only for some arguments: op name
#: -> a predicate of the op's arguments. Adaptive average pooling's decomposition
#: (graphflop.ops.pool) is a mean for a 1×1 output (eager's ``adaptive_avg_pool2d`` runs
#: ``mean`` there, which saves no activation) and an ``avg_pool2d`` where the output divides
#: the input (kept whole: eager_memory's ATEN_SAVES); only the uneven windows' index
#: arithmetic stands for the op
TAGGED_WHEN: dict[str, Callable[..., bool]] = {
    "aten._adaptive_avg_pool2d.default": _uneven_adaptive_pool,
}

#: What autograd saves for the in-place form of an op of :data:`EAGER_SAVES` where it differs
#: (a region with a node tagged :data:`~graphflop.meta.INPLACE`): ``elu_``'s and ``celu_``'s
#: ``elu_backward(..., /* is_result */ true, result)`` save the output, the out-of-place forms
#: the input (EluBackward1 and CeluBackward1 against EluBackward0 and CeluBackward0); ``selu_``
#: runs ``elu_`` (traced so, :data:`_IN_PLACE_AS`)
EAGER_SAVES_IN_PLACE: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "aten.elu.default": ((), (0,)),
    "aten.celu.default": ((), (0,)),
}

#: composite ops traced as one node with rules of their own (graphflop.ops) rather than as their
#: parts: output ``i`` of such a node is the composite op's output ``i``
KEPT_WHOLE = frozenset({"aten._native_batch_norm_legit_functional.default"})


def getitem_tag(multi: torch.fx.Node, i: int) -> CompositeTag | None:
    """The tag of a ``getitem`` of output ``i`` added to a traced graph after tracing (outputs
    nothing read were dropped): the composite op's output ``i`` when ``multi`` is a composite op
    kept whole (:data:`KEPT_WHOLE`), an inner value of its decomposition otherwise; None when
    ``multi`` is not part of a composite op."""
    tag = multi.meta.get(COMPOSITE)
    if tag is None:
        return None
    whole = str(multi.target) in KEPT_WHOLE
    return CompositeTag(tag.op, tag.region, i if whole else None, (), None)


#: composite ops whose saved mask is, on CPU, a tensor of the input's dtype (output 0's)
FLOAT_MASK_ON_CPU = frozenset({"aten.native_dropout.default"})


#: the op an attention call's nodes are tagged with when PyTorch would run it with its fused
#: CPU kernel (:func:`fused_on_cpu`): inputs q, k, v and the mask (3) as ``sdpa``'s arguments,
#: output 0 the attention output. The kernel saves q, k, v, its output, the float mask and a
#: logsumexp of q's leading three dimensions (tools/autograd/derivatives.yaml); it never makes
#: the scores or the probabilities (graphflop.passes.eager_memory)
FUSED_SDPA = "aten._scaled_dot_product_flash_attention_for_cpu.default"

_FLASH_CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _mask_fits(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> bool:
    """The fused CPU kernel's mask shapes: 2-D (L or 1, S or 1) or 4-D (B or 1, H or 1, L or 1,
    S or 1)."""
    if mask.dim() not in (2, 4) or mask.shape[-2] not in (q.shape[2], 1):
        return False
    if mask.shape[-1] not in (k.shape[2], 1):
        return False
    return mask.dim() == 2 or (
        mask.shape[0] in (q.shape[0], 1) and mask.shape[1] in (q.shape[1], 1)
    )


def fused_on_cpu(
    q: Any,
    k: Any,
    v: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> bool:
    """Whether ``F.scaled_dot_product_attention`` on CPU runs the fused kernel
    (``_scaled_dot_product_flash_attention_for_cpu``) rather than the math path: PyTorch 2.13's
    ``use_flash_attention_cpp`` (aten/src/ATen/native/transformers/sdp_utils_cpp.cpp) — the
    flash backend enabled (``torch.nn.attention.sdpa_kernel``), dense (not nested) 4-D q, k, v
    of one batch size, equal head counts (or, with ``enable_gqa``, k and v with equal head
    counts dividing q's), ``dropout_p == 0``, equal last dimensions, nonzero sequence lengths,
    last-dimension stride 1, one dtype among float32, float64, bfloat16, float16, and a mask
    (if any) of a shape :func:`_mask_fits` accepts that does not require grad. A mask that
    requires grad (a learned bias: a parameter, or a value computed from one, whatever the grad
    mode) sends the call to the math path (measured, PyTorch 2.13 CPU: ``UnsafeViewBackward0``
    over ``BmmBackward0``, no flash node); tracing tells it from what the mask depends on
    (:func:`~graphflop.frontend.regions.requires_grad_in_trace`)."""
    del is_causal, scale
    if not torch.backends.cuda.flash_sdp_enabled() or dropout_p > 0.0:
        return False
    ts = (q, k, v)
    if not all(isinstance(t, torch.Tensor) and not t.is_nested and t.dim() == 4 for t in ts):
        return False
    if len({t.dtype for t in ts}) != 1 or q.dtype not in _FLASH_CPU_DTYPES:
        return False
    if q.shape[0] != k.shape[0] or q.shape[0] != v.shape[0]:
        return False
    heads_ok = q.shape[1] == k.shape[1] == v.shape[1] or (
        enable_gqa and k.shape[1] == v.shape[1] and q.shape[1] % k.shape[1] == 0
    )
    if not heads_ok or not q.shape[-1] == k.shape[-1] == v.shape[-1]:
        return False
    if 0 in (q.shape[2], k.shape[2]) or any(t.stride(-1) != 1 for t in ts):
        return False
    if attn_mask is None:
        return True
    return _mask_fits(attn_mask, q, k) and not requires_grad_in_trace(attn_mask)


_ATTENTION_ARGS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_attention_regions = itertools.count(-1, -1)  # negative: never a decomposition's number


def attention(q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> Any:
    """``F.scaled_dot_product_attention`` while tracing: graphflop's math form
    (:func:`graphflop.ops.attention.sdpa`, the same graph on every path), its nodes tagged
    :data:`FUSED_SDPA` when PyTorch on CPU would run the fused kernel (:func:`fused_on_cpu`)."""
    named = dict(zip(_ATTENTION_ARGS, args)) | kwargs
    if not fused_on_cpu(q, k, v, **named):
        return sdpa(q, k, v, *args, **kwargs)
    mask = named.pop("attn_mask", None)
    return _tagging(FUSED_SDPA, sdpa, _attention_regions)(q, k, v, mask, **named)


_SAME_BYTES_VIEWS = frozenset(
    {aten.squeeze.dims, aten.squeeze.dim, aten.squeeze.default, aten.unsqueeze.default}
    | {aten.view.default, aten._unsafe_view.default, aten.alias.default}
)


def tagged_decompositions(
    table: dict[Any, Callable[..., Any]], counter: Iterator[int] | None = None
) -> dict[Any, Callable[..., Any]]:
    """``table`` with the decompositions of the ops in :data:`EAGER_SAVES` wrapped so that the
    nodes each one adds to the graph being traced get a :class:`~graphflop.meta.CompositeTag`
    (an outer composite op's tags replace those of the ones it decomposes into), numbered from
    ``counter`` (default: a new one from 0). The graph is unchanged. Returns a new dict."""
    counter = itertools.count() if counter is None else counter
    out = dict(table)
    for op in _eager_saves_ops().intersection(table):
        out[op] = _tagging(str(op), table[op], counter)
    return out


def _eager_saves_ops() -> set[Any]:
    """The op overloads :data:`EAGER_SAVES` names (resolved once: naming every op of a
    decomposition table on each trace cost a few milliseconds)."""
    if not _EAGER_OPS:
        for name in EAGER_SAVES:
            _, packet, overload = name.split(".")
            _EAGER_OPS.add(getattr(getattr(aten, packet), overload))
    return _EAGER_OPS


_EAGER_OPS: set[Any] = set()


def _tagging(name: str, fn: Callable[..., Any], counter: Iterator[int]) -> Callable[..., Any]:
    when = TAGGED_WHEN.get(name)

    def decomposed(*args: Any, **kwargs: Any) -> Any:
        rec = recording.current()
        if rec is None or (when is not None and not when(*args, **kwargs)):
            return fn(*args, **kwargs)
        graph = rec.graph
        last = next(iter(reversed(graph.nodes)), None)
        result = fn(*args, **kwargs)
        new = []
        for n in reversed(graph.nodes):
            if n is last:
                break
            new.append(n)
        _tag(name, next(counter), new, args, result, rec)
        return result

    decomposed.__name__ = getattr(fn, "__name__", "decomposed")
    decomposed.__doc__ = fn.__doc__
    return decomposed


def _tag(
    name: str, region: int, new: list, args: tuple, result: Any, rec: recording.Recording
) -> None:
    inputs: dict[torch.fx.Node, int] = {}
    for k, a in enumerate(args):
        node = rec.node_of(a)
        if node is not None:
            inputs.setdefault(node, k)
    outputs: dict = {}
    inner = set(new)
    # (numel, dtype) of each output, for an output the graph may drop (CompositeTag.outputs)
    made = tuple(
        (t.numel(), t.dtype)
        if isinstance(t, torch.Tensor) and isinstance(t.numel(), int)
        else (0, torch.float32)
        for t in tree_flatten(result)[0]
    )
    for k, t in enumerate(tree_flatten(result)[0]):
        node = rec.node_of(t)
        # an output that is a view of an inner node (batch norm's squeezed mean) names that
        # node too: unused outputs are removed from the graph, their bases stay
        while node is not None:
            outputs.setdefault(node, k)
            base = node.all_input_nodes[0] if len(node.all_input_nodes) == 1 else None
            node = base if node.target in _SAME_BYTES_VIEWS and base in inner else None
    for n in new:
        reads = tuple((i, inputs[a]) for i, a in enumerate(n.all_input_nodes) if a in inputs)
        inner = n.meta.get(COMPOSITE)
        n.meta[COMPOSITE] = CompositeTag(name, region, outputs.get(n), reads, inner, made)


def tag_of(n: torch.fx.Node, inner: bool = False) -> CompositeTag:
    """``n``'s :class:`~graphflop.meta.CompositeTag`; with ``inner``, a fused attention node's
    tag as the composite op it decomposes into (its softmax's), where it has one."""
    tag: CompositeTag = n.meta[COMPOSITE]
    if inner and tag.op == FUSED_SDPA and tag.inner is not None:
        return tag.inner
    return tag


def composite_regions(
    nodes: Iterable[torch.fx.Node], inner: bool = False
) -> list[list[torch.fx.Node]]:
    """Each decomposed composite op's nodes among ``nodes`` (those with a
    :data:`~graphflop.meta.COMPOSITE` tag): nodes with one region number, connected (the copies
    of an outlined call share the number, and are apart), in ``nodes``' order. ``inner``: fused
    attention's nodes as the composite ops it decomposes into (:func:`tag_of`)."""
    tags = {n: tag_of(n, inner) for n in nodes if COMPOSITE in n.meta}
    got = _regions_in_order(tags)
    if got is not None:
        return got
    parent: dict[torch.fx.Node, torch.fx.Node] = {}

    def find(n: torch.fx.Node) -> torch.fx.Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in tags:
        parent[n] = n
    for n, t in tags.items():
        for a in n.all_input_nodes:
            if a in tags and tags[a].region == t.region:
                parent[find(a)] = find(n)
    groups: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for n in tags:
        groups.setdefault(find(n), []).append(n)
    return list(groups.values())


def _regions_in_order(
    tags: dict[torch.fx.Node, CompositeTag],
) -> list[list[torch.fx.Node]] | None:
    """:func:`composite_regions` of the nodes ``tags`` tags in one pass, where they are in
    graph order (each node's inputs met before it; else None, for the union-find): a node
    joins the groups of its inputs of its region (the smaller merged into the larger), or
    starts one where it reads none; then the groups in the order of their first node, each
    in ``tags``' order. (A union-find's two ``find`` calls per edge cost more than the walk,
    per node of the flat forward.)"""
    group_of: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for n, t in tags.items():
        g = None
        for a in n._input_nodes:
            ta = tags.get(a)
            if ta is None or ta.region != t.region:
                continue
            h = group_of.get(a)
            if h is None:  # an input not met yet
                return None
            if g is None:
                g = h
            elif h is not g:
                if len(h) > len(g):
                    g, h = h, g
                g += h
                for x in h:
                    group_of[x] = g
        if g is None:
            g = []
        g.append(n)
        group_of[n] = g
    ordered: dict[int, list[torch.fx.Node]] = {}
    for n, g in group_of.items():  # (the nodes in ``tags``' order: first entered)
        ordered.setdefault(id(g), []).append(n)
    return list(ordered.values())


def decompose_kept_whole(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm``, or a copy (same names for the nodes it keeps) in which each composite op kept
    whole (:data:`KEPT_WHOLE`) is replaced by PyTorch's decomposition of it (``torch._decomp``),
    for consumers that need the parts: ONNX Runtime's ``BatchNormalization`` normalises with
    the running statistics whatever its ``training_mode``. The new nodes carry the op node's
    graphflop keys, their own ``val`` and their own cost from the rule table (which sum to the
    op's, the cost rule's contract); its ``getitem`` users are replaced by the parts' outputs."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from graphflop.meta import COST, graphflop_meta
    from graphflop.ops.cost import op_cost
    from graphflop.ops.registry import torch_decomposition

    if not any(n.op == "call_function" and str(n.target) in KEPT_WHOLE for n in gm.graph.nodes):
        return gm
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    for n in list(graph.nodes):
        if n.op != "call_function" or str(n.target) not in KEPT_WHOLE:
            continue
        decomposition = torch_decomposition(n.target)
        assert decomposition is not None, n.format_node()
        flat, spec = tree_flatten((n.args, n.kwargs))
        where = [i for i, a in enumerate(flat) if isinstance(a, torch.fx.Node)]

        def run(*tensors: Any, flat: list = flat, where: list = where, spec: Any = spec) -> Any:
            values = list(flat)
            for i, t in zip(where, tensors):
                values[i] = t
            args, kwargs = tree_unflatten(values, spec)
            return decomposition(*args, **kwargs)  # noqa: B023 (called at once, below)

        metas = [_meta_like(flat[i].meta["val"]) for i in where]
        parts = make_fx(run)(*metas)
        env: dict[torch.fx.Node, Any] = {}
        inputs = iter(flat[i] for i in where)
        keys = graphflop_meta(n.meta)
        results: Any = None
        with graph.inserting_before(n):
            for p in parts.graph.nodes:
                if p.op == "placeholder":
                    env[p] = next(inputs)
                elif p.op == "output":
                    results = torch.fx.node.map_arg(p.args[0], env.__getitem__)
                else:
                    new = graph.node_copy(p, env.__getitem__)
                    new.meta = {**keys, "val": p.meta.get("val")}
                    new.meta[COST] = op_cost(new.target, new.args, new.kwargs, new)
                    env[p] = new
        for u in list(n.users):
            assert u.target is operator.getitem, u.format_node()
            u.replace_all_uses_with(results[u.args[1]])
            graph.erase_node(u)
        graph.erase_node(n)
    copy = torch.fx.GraphModule(gm, graph)
    copy.meta.update(gm.meta)
    return copy


def _meta_like(v: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
