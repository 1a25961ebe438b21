"""The model a training run trains, and the graphs it runs.

:func:`build_model` constructs the model for a data set's image size right after
``torch.manual_seed(seed)``, so every method starts from the same weights. :func:`step_graph`
returns graphflop's train-step graph (read from :func:`graphflop.analysis.analyze`'s analysis)
or forward-gradient step graph (directions as inputs, :mod:`graphflop.runtime.graphs`) for one
batch size; :func:`trace_forward` the forward graph with its cross-entropy loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule

from graphflop.meta import COST
from graphflop.runtime.verify import copy_model
from graphflop.train.config import TrainError
from graphflop.train.data import Dataset


def _size_kwargs(image_shape: tuple[int, int, int]) -> list[dict[str, int]]:
    c, h, w = image_shape
    return [{"in_features": c * h * w}, {"in_channels": c, "image_size": h}, {"image_size": h}]


def _maker(spec_or_model: str | Callable[..., nn.Module]):
    """``(make(kwargs, meta) -> object with .model and .name, label)`` for a spec or a
    class/factory."""
    from graphflop.load import SpecError, load

    if isinstance(spec_or_model, str):
        return (lambda kw, meta: load(spec_or_model, ctor_kwargs=kw, meta=meta)), spec_or_model
    label = getattr(spec_or_model, "__name__", repr(spec_or_model))

    def make(kw, meta):
        try:
            if meta:
                with torch.device("meta"):
                    m = spec_or_model(**kw)
            else:
                m = spec_or_model(**kw)
        except TypeError as e:
            raise SpecError(f"cannot construct {label}: {e}") from e
        return type("Loaded", (), {"model": m, "name": label})

    return make, label


def _size_for(make, label: str, data: Dataset, user: dict) -> dict:
    """The first of the size keyword sets (plus ``user``'s) the constructor accepts."""
    from graphflop.load import SpecError

    errors = []
    for cand in _size_kwargs(data.image_shape):
        kw = {**cand, **user}
        try:
            make(kw, True)  # meta device: no memory, no RNG use
        except SpecError as e:
            if "unexpected keyword argument" not in str(e):
                raise
            errors.append(str(e).split(": ", 1)[-1])
            continue
        return kw
    raise TrainError(_unsized(label, data, errors))


def _unsized(label: str, data: Dataset, errors: list[str]) -> str:
    c, h, w = data.image_shape
    return (
        f"cannot size {label} for {data.name} images ({c}×{h}×{w}): its constructor "
        f"takes none of in_features=, in_channels=/image_size=, image_size= "
        f"({'; '.join(errors)}), and its defaults do not fit them; add one of them to its "
        "__init__"
    )


def build_model(
    spec_or_model: str | nn.Module | Callable[..., nn.Module],
    data: Dataset,
    *,
    seed: int = 0,
    ctor_kwargs: dict | None = None,
) -> tuple[nn.Module, str, dict]:
    """Construct the model for ``data``'s image size, right after ``torch.manual_seed(seed)``.

    A spec or a class/factory is called with the size keywords its constructor takes, tried in
    order: ``in_features=C·H·W`` (logreg, MLP), ``in_channels=C, image_size=H`` (CNN),
    ``image_size=H``; ``ctor_kwargs`` are added (and win); a constructor that takes none of
    them is called with its defaults (and ``ctor_kwargs``), which must then fit the images. A
    module instance is deep-copied as is.

    Returns:
        (model in train mode, display name, the constructor keywords used).

    Raises:
        TrainError: the constructor takes none of the size keywords and its defaults do not
            fit the images, or the model does not map a batch of these images to
            ``(N, num_classes)`` logits.
        SpecError: the spec cannot be loaded.
    """
    unsized = None
    if isinstance(spec_or_model, nn.Module):
        model, name, used = copy_model(spec_or_model), type(spec_or_model).__name__, {}
    else:
        make, label = _maker(spec_or_model)
        used = dict(ctor_kwargs or {})
        try:
            used = _size_for(make, label, data, used)
        except TrainError as e:  # no size keyword: its defaults, if they fit the images
            unsized = e
        torch.manual_seed(seed)
        loaded = make(used, False)
        model, name = loaded.model, loaded.name
    model.train()
    try:
        picks = _check_model(model, data, name)
    except TrainError:
        if unsized is None:
            raise
        raise unsized from None
    if picks:
        model.register_forward_hook(_logits_of)
    return model, name, used


def _logits_of(module: nn.Module, args: Any, out: Any) -> Any:
    """Forward hook: the logits (:func:`~graphflop.frontend.loss.loss_output`, the first
    floating-point tensor) of a model that returns them among other values, ``(argmax,
    logits)`` or a dict; the training loop, its runners and the traced step read them alone."""
    from graphflop.frontend.loss import loss_output

    return loss_output(out)


def _check_model(model: nn.Module, data: Dataset, name: str) -> bool:
    """Check that ``model`` maps 2 images of ``data`` to ``(2, num_classes)`` logits, alone or
    as the first floating-point tensor of its output; True in the second case (the logits must
    be picked out: :func:`_logits_of`).

    Raises:
        TrainError: the model fails on the images, or returns no such logits.
    """
    from graphflop.frontend.loss import loss_output

    probe = copy_model(model).eval()
    x = data.x_train[:2]
    try:
        with torch.no_grad():
            out = probe(x)
    except Exception as e:
        c, h, w = data.image_shape
        raise TrainError(
            f"{name} fails on a batch of {data.name} images ({c}×{h}×{w}): "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from e
    logits = out if isinstance(out, torch.Tensor) else loss_output(out)
    if not isinstance(logits, torch.Tensor) or tuple(logits.shape) != (2, data.num_classes):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise TrainError(
            f"{name} returns {shape} for 2 images; training needs (N, {data.num_classes}) "
            "logits (alone, or as the first floating-point tensor of its output)"
        )
    return logits is not out


def _fake_batch(batch: int, image_shape) -> tuple[torch.Tensor, ...]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        return (torch.empty((batch, *image_shape), dtype=torch.float32),)


def trace_forward(model: nn.Module, batch: int, image_shape, *, train_mode: bool) -> GraphModule:
    """The forward graph (model + cross-entropy) for ``batch`` images of ``image_shape``
    (C, H, W), traced on fake tensors in train or eval mode."""
    from graphflop.frontend.trace import trace

    m = copy_model(model).train(train_mode)
    return trace(m, _fake_batch(batch, image_shape), loss="cross_entropy")


def step_graph(
    model: nn.Module,
    method: str,
    optimizer: str,
    batch: int,
    image_shape,
    *,
    directions: int = 1,
    distribution: str = "normal",
    gradient_mean: bool = False,
) -> GraphModule:
    """The FLOP-annotated step graph that ``method`` runs for ``batch`` images.

    ``backprop``: the train step (forward, backward, update) of the model's analysis (traced in
    train mode with cross-entropy; :func:`graphflop.runtime.graphs.train_step_graph`).
    ``fgd``: the forward-gradient step with ``directions`` direction inputs
    (:func:`graphflop.runtime.graphs.forward_gradient_graph`).
    ``gradient_mean``: the update's gradient inputs are first averaged over the ranks of a
    distributed run (:func:`graphflop.train.distributed.with_gradient_mean`).
    """
    from graphflop.passes.optimizer import build_update_for
    from graphflop.runtime.graphs import forward_gradient_graph, train_step_graph
    from graphflop.train.distributed import with_gradient_mean

    if method == "fgd":
        fwd = trace_forward(model, batch, image_shape, train_mode=True)
        update = None
        if gradient_mean:
            update = with_gradient_mean(build_update_for(fwd, optimizer))
        return forward_gradient_graph(
            fwd, optimizer, directions=directions, distribution=distribution, update=update
        )
    from graphflop.analysis import AnalyzeOptions, analyze

    m = copy_model(model).train(True)
    options = AnalyzeOptions(loss="cross_entropy", optimizer=optimizer, jvp=False)
    analysis = analyze(m, _fake_batch(batch, image_shape), options)
    if not gradient_mean:
        step = train_step_graph(analysis)
        assert step is not None, "a cross-entropy analysis has a backward"
        return step
    from graphflop.passes.flops import AnnotateFlops
    from graphflop.passes.infra import run_passes
    from graphflop.passes.train_step import BuildTrainStep

    assert analysis.backward is not None and analysis.update is not None
    update = with_gradient_mean(analysis.update)
    return run_passes(
        analysis.forward, [BuildTrainStep(analysis.backward, update), AnnotateFlops()]
    )


def graph_flops(gm: GraphModule) -> int:
    """FLOPs of one run of a FLOP-annotated graph (the sum of its nodes' ``COST``)."""
    return sum(n.meta[COST].flops for n in gm.graph.nodes if COST in n.meta)
