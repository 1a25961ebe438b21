"""The losses a traced graph can end in, and the one place their values are computed.

:func:`loss_value` is used both while tracing (:func:`graphflop.frontend.trace.trace`) and by
``--verify``'s eager reference, so the two always compute the same loss. Writes no meta key
(tracing records the chosen kind in ``gm.meta[LOSS_KIND]``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten

#: the loss kinds :func:`graphflop.frontend.trace.trace` accepts (besides ``auto``)
LOSSES = ("cross_entropy", "mse", "sum", "output", "none")


def loss_value(
    kind: str, first: torch.Tensor, targets: Sequence[torch.Tensor] = ()
) -> torch.Tensor:
    """The scalar loss of kind ``kind`` (one of :data:`LOSSES` but ``none``) of the model's
    first output: cross-entropy or MSE against ``targets[0]``, the sum, or the output itself
    (``output``: the model computes its own loss).

    The sum of a complex output is the sum of its real and imaginary parts
    (``view_as_real(first).sum()``): a loss must be a real scalar to have a gradient (PyTorch's
    ``backward`` refuses a complex one), and this one reaches every part of the output.

    Cross-entropy of 3-D logits ``(B, T, V)`` is token-level, as transformers' language-model
    losses compute it: the logits flattened to ``(B·T, V)``, the ``(B, T)`` targets to ``(B·T,)``,
    the mean over the ``B·T`` tokens of ``-log_softmax`` at the target. Other shapes follow
    ``F.cross_entropy``: ``(N, C)`` against ``(N,)``, ``(N, C, d1, ...)`` against
    ``(N, d1, ...)``."""
    if kind == "cross_entropy":
        if first.dim() == 3:
            return F.cross_entropy(first.reshape(-1, first.shape[-1]), targets[0].reshape(-1))
        return F.cross_entropy(first, targets[0])
    if kind == "mse":
        return F.mse_loss(first, targets[0])
    if kind == "sum":
        return torch.view_as_real(first).sum() if first.is_complex() else first.sum()
    return first


def output_tensors(out: Any) -> list[torch.Tensor]:
    """The tensors of a model's output: a tensor, or tuples, lists, dicts and namedtuples of
    them in ``torch.utils._pytree`` order (transformers' ``ModelOutput`` included), with a
    plain ``@dataclass`` read field by field, in declaration order."""
    tensors: list[torch.Tensor] = []
    for leaf in tree_flatten(out)[0]:
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            for f in dataclasses.fields(leaf):
                tensors += output_tensors(getattr(leaf, f.name))
    return tensors


def loss_output(out: Any) -> Any:
    """The output the loss is computed from: the first floating-point (or complex) tensor of
    a model's output (:func:`output_tensors`), else its first tensor (a model may return its
    predicted classes first, then the logits); None when it holds no tensor."""
    tensors = output_tensors(out)
    return next(filter(differentiable, tensors), tensors[0] if tensors else None)


def default_loss(out: Any, inputs: Sequence[Any] = (), vocabularies: Sequence[int] = ()) -> str:
    """The loss ``auto`` stands for, from the shapes of the model's output and inputs.

    Cross-entropy for ``(N, C)`` floating logits of ``C > 1`` classes (:func:`loss_output`),
    and for token logits (:func:`token_logits`: ``(B, T, V)`` logits of ``(B, T)`` integer ids
    over a token embedding of ``V > 1`` rows, a language model's); ``none`` when the output
    holds no floating-point or complex tensor (nothing to differentiate, e.g. a model ending in
    argmax); ``sum`` otherwise (hidden states, images, scores, and a single-class output such as
    a one-output regressor's ``(N, 1)``: cross-entropy over one class is identically 0,
    :func:`single_class_line`).

    Args:
        out: the model's output.
        inputs: the model's input tensors (others are ignored).
        vocabularies: the row counts of the model's token embeddings
            (:func:`token_vocabularies`)."""
    first = loss_output(out)
    if not differentiable(first):
        return "none"
    if first.dim() == 2 and first.is_floating_point() and first.shape[1] > 1:
        return "cross_entropy"
    if token_logits(first, inputs, vocabularies):
        return "cross_entropy"
    return "sum"


def token_logits(first: Any, inputs: Sequence[Any], vocabularies: Sequence[int]) -> bool:
    """Whether ``first`` is a language model's logits: floating, of shape ``(B, T, V)``, with
    an integer input of shape ``(B, T)`` (the token ids) and a token embedding of ``V > 1``
    rows (the vocabulary: ``vocabularies``, :func:`token_vocabularies`). The last condition
    tells logits from hidden states ``(B, T, D)``, which a base model returns from the same
    ids; a position, relative-position or bucket table of ``D`` rows is not a token
    embedding."""
    if not (isinstance(first, torch.Tensor) and first.is_floating_point() and first.dim() == 3):
        return False
    ids = any(_integer(t) and tuple(t.shape) == tuple(first.shape[:2]) for t in inputs)
    return ids and first.shape[-1] > 1 and first.shape[-1] in set(vocabularies)


def _integer(t: Any) -> bool:
    """Whether ``t`` is an integer tensor (token ids, indices; not bool)."""
    return isinstance(t, torch.Tensor) and not (
        t.is_floating_point() or t.is_complex() or t.dtype == torch.bool
    )


def _storage_key(t: torch.Tensor) -> int | None:
    """An identity of ``t``'s storage, shared by its views (real, meta, fake and functional
    tensors alike); None for a tensor without one (sparse, some subclasses)."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return None


def _stored_weight(m: torch.nn.Module) -> torch.Tensor | None:
    """The tensor ``m`` stores its ``weight`` in, read without computing anything: the
    parameter itself, or a parametrized weight's original (``parametrizations.weight.original``,
    ``original0``); None for a weight computed elsewhere (the old ``nn.utils.weight_norm``'s).
    Reading ``m.weight`` of a parametrized module would run its parametrization (a
    spectral norm's power iteration, writing its ``u``, ``v`` buffers) on the module's own
    tensors, outside a trace's functional call: constants of the trace."""
    stored = m._parameters.get("weight")
    if stored is not None:
        return stored
    plist = getattr(m, "parametrizations", None)
    if isinstance(plist, torch.nn.ModuleDict) and "weight" in plist:
        originals = plist["weight"]._parameters
        return originals.get("original", originals.get("original0"))
    return None


def tied_vocabularies(
    model: torch.nn.Module, modules: list[torch.nn.Module] | None = None
) -> list[int]:
    """The row counts of ``model``'s ``nn.Embedding`` tables whose weight is also an
    ``nn.Linear``'s (an output projection tied to the token embedding); ``modules``:
    ``list(model.modules())``, where the caller has it. The weights are compared as stored
    (:func:`_stored_weight`), not computed."""
    if modules is None:
        modules = list(model.modules())
    heads = {
        id(w)
        for m in modules
        if isinstance(m, torch.nn.Linear) and (w := _stored_weight(m)) is not None
    }
    return [
        m.num_embeddings
        for m in modules
        if isinstance(m, torch.nn.Embedding) and id(_stored_weight(m)) in heads
    ]


@contextlib.contextmanager
def token_vocabularies(
    model: torch.nn.Module, inputs: Sequence[Any], modules: list[torch.nn.Module] | None = None
) -> Iterator[list[int]]:
    """The row counts of ``model``'s token embeddings, filled while the model runs inside the
    block (eagerly, on meta or fake tensors, or under a trace): the ``nn.Embedding`` tables
    looked up with one of the integer ``inputs`` directly (the tensor or a view of it: the
    same storage), and those tied to an output projection (:func:`tied_vocabularies`). A
    table looked up with computed indices (positions made with ``arange``, relative-position
    buckets, ids shifted or clamped) is not one: its rows are no vocabulary of the model's
    output. ``modules``: ``list(model.modules())``, where the caller has it."""
    if modules is None:
        modules = list(model.modules())  # walked once (a deep model has thousands)
    found = tied_vocabularies(model, modules)
    model_tables = {id(m) for m in modules if isinstance(m, torch.nn.Embedding)}
    keys = {_storage_key(t) for t in inputs if _integer(t)} - {None}

    def lookup(m: torch.nn.Module, args: tuple) -> None:
        if not isinstance(m, torch.nn.Embedding) or id(m) not in model_tables or not args:
            return
        if isinstance(args[0], torch.Tensor) and _storage_key(args[0]) in keys:
            found.append(m.num_embeddings)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(lookup)
    try:
        yield found
    finally:
        handle.remove()


def classes(out: torch.Tensor) -> int | None:
    """The number of classes cross-entropy over ``out`` would take: the last dim of ``(B, T,
    V)`` token logits, else dim 1 (dim 0 of a 1-D output); None for a scalar."""
    if out.dim() == 0:
        return None
    if out.dim() == 1:
        return out.shape[0]
    return out.shape[-1] if out.dim() == 3 else out.shape[1]


def single_class(out: Any) -> bool:
    """Whether ``out`` is floating with one class (:func:`classes`), e.g. a one-output
    regressor's ``(N, 1)``: cross-entropy over it is identically 0."""
    return (
        isinstance(out, torch.Tensor)
        and out.is_floating_point()
        and out.dim() >= 2
        and classes(out) == 1
    )


def single_class_line(out: torch.Tensor) -> str:
    """The assumption line of ``auto`` choosing the sum for a single-class output."""
    return (
        f"loss: the sum of the model's {_shape(out)} output, not cross-entropy: over its one "
        "class cross-entropy is identically 0 (a zero gradient); --loss mse (a regressor's) "
        "or --loss sum chooses explicitly"
    )


def single_class_refusal(out: torch.Tensor) -> str:
    """Why ``--loss cross_entropy`` is refused for a single-class output, and what to use."""
    return (
        f"loss 'cross_entropy' over the model's {_shape(out)} output takes one class, and "
        "cross-entropy over one class is identically 0 (log_softmax of a single logit is 0), "
        "so its gradient is zero: use --loss mse (a regressor's) or --loss sum"
    )


def _shape(t: torch.Tensor) -> str:
    return "(" + ", ".join(map(str, t.shape)) + ")"


def class_target_shape(out: torch.Tensor) -> tuple[int, ...]:
    """The shape of cross-entropy's class-index targets for the logits ``out``: ``(N,)`` for
    ``(N, C)`` logits; ``(B, T)`` for ``(B, T, V)`` token logits; ``(N, d1, ...)`` for
    ``(N, C, d1, ...)``."""
    if out.dim() == 3:
        return tuple(out.shape[:2])
    return (out.shape[0], *out.shape[2:])


#: why a model's output gives no loss: the wording every refusal and note shares
NO_FLOAT_OUTPUT = (
    "the model's output has no floating-point tensor to differentiate (e.g. it ends in argmax)"
)


def differentiable(t: Any) -> bool:
    """Whether ``t`` is a floating-point or complex tensor (one a loss can be taken of)."""
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def make_targets(
    loss: str, out: torch.Tensor, fake_mode: FakeTensorMode, inside: bool = False
) -> tuple:
    """Loss targets for ``out``: class indices of :func:`class_target_shape` (cross-entropy) or a
    tensor like ``out`` (MSE); ``()`` for the other kinds. ``inside``: already under
    ``fake_mode`` (while tracing)."""
    with contextlib.nullcontext() if inside else fake_mode:
        if loss == "cross_entropy":
            shape = class_target_shape(out)
            return (torch.zeros(shape, dtype=torch.long, device=out.device),)
        if loss == "mse":
            return (torch.empty(out.shape, dtype=out.dtype, device=out.device),)
    return ()
