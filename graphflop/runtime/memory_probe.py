"""Measured memory of real eager PyTorch runs: what graphflop's memory figures are checked against.

Four measurements of one model at one batch, on real tensors (CPU here; any device PyTorch's
profiler reports allocations for):

* :func:`measure_saved` — the bytes autograd saves for backward, from
  ``torch.autograd.graph.saved_tensors_hooks``: the storage of every packed tensor the autograd
  graph still holds after the forward and loss counted once (deduplicated by storage pointer;
  a tensor saved by a part of the graph freed during the forward is not), storages of
  parameters and buffers left out, inputs and targets counted. :class:`SavedBytes` is that count as a context, for runs the function does not
  make (a checkpointed region, autocast, a loss of one's own).
* :func:`measure_train_peak` — the peak of one training step (forward, loss, ``backward()``,
  ``optimizer.step()``, gradients set to ``None`` beforehand as ``zero_grad()`` does by default),
  from the profiler's allocator events (``torch.profiler.profile(profile_memory=True)``: each
  ``[memory]`` event is one allocation (+bytes) or free (−bytes); the running sum's maximum is the
  peak above what was live when profiling began). The figure returned adds the bytes live at the
  start: parameters, buffers, inputs, targets and optimizer state.
* :func:`measure_forward_peak` — the peak of one forward and loss with grad mode off, measured
  the same way, plus parameters, buffers, inputs and targets.
* :func:`measure_jvp_peak` — the peak of ``torch.func.jvp`` of the loss with respect to the
  parameters (tangents like the parameters), measured the same way, plus parameters, buffers,
  inputs, targets and tangents; attention runs its math form
  (``torch.nn.attention.sdpa_kernel(SDPBackend.MATH)``: the fused CPU kernel has no forward
  derivative).

All figures in bytes. The loss is graphflop's own (:func:`graphflop.frontend.loss.loss_value`), so
the eager run computes what the analysed graph computes. The optimizer is the one torch.optim
factory the runtime uses (:func:`graphflop.runtime.optim.torch_optimizer`).
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from graphflop.frontend.loss import (
    class_target_shape,
    default_loss,
    loss_output,
    loss_value,
    token_vocabularies,
)
from graphflop.runtime.attention import math_attention

__all__ = [
    "Measured",
    "SavedBytes",
    "measure",
    "measure_forward_peak",
    "measure_jvp_peak",
    "measure_saved",
    "measure_train_peak",
]


@dataclass(frozen=True)
class Measured:
    """Measured eager figures, bytes. ``loss``: the loss kind used."""

    loss: str
    saved_for_backward_bytes: int
    train_peak_bytes: int
    jvp_peak_bytes: int | None


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


class _Packed:
    """What the pack hook hands autograd for one saved tensor: the tensor, detached (a saved
    output held by its own ``grad_fn`` would make a reference cycle). Autograd's graph holds
    it; it goes, and the weak reference :class:`SavedBytes` keeps to it dies, when the part of
    the graph that saved it is freed."""

    __slots__ = ("__weakref__", "t")

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class SavedBytes:
    """The bytes autograd saves for backward while the context is open: the storages of the
    tensors ``torch.autograd.graph.saved_tensors_hooks`` packs, each counted once (by its data
    pointer), empty storages and those of ``model``'s parameters and buffers and of ``exclude``
    left out. :meth:`keep` counts a tensor the same way: the arguments a
    ``torch.utils.checkpoint`` call keeps for its recompute, which no hook sees.

    ``nbytes``: every storage packed so far (and kept), whether or not the graph that saved it
    is still alive. :meth:`live_nbytes`: those still held by the autograd graph when it is
    called (and kept): a tensor saved in a part of the graph freed during the forward (a block
    run on ``x.detach()`` whose output only a non-differentiable use reads) no longer
    counts."""

    def __init__(
        self, model: nn.Module | None = None, exclude: Iterable[torch.Tensor] = ()
    ) -> None:
        state = [*model.parameters(), *model.buffers()] if model is not None else []
        self._excluded = {_storage(t)[0] for t in [*state, *exclude]}
        self._seen: dict[int, int] = {}
        self._kept: dict[int, int] = {}
        #: (weak reference to what autograd holds, storage pointer, storage bytes) per packed
        #: tensor counted
        self._packed: list[tuple[weakref.ref, int, int]] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, t: torch.Tensor) -> _Packed:
        packed = _Packed(t.detach())
        ptr, nbytes = _storage(t)
        if ptr not in self._excluded and nbytes:
            self._seen[ptr] = nbytes
            self._packed.append((weakref.ref(packed), ptr, nbytes))
        return packed

    def keep(self, t: torch.Tensor) -> torch.Tensor:
        """Count ``t``'s storage (once, unless excluded or empty), as alive until the count is
        read; returns ``t``."""
        ptr, nbytes = _storage(t)
        if ptr not in self._excluded and nbytes:
            self._seen[ptr] = nbytes
            self._kept[ptr] = nbytes
        return t

    @property
    def nbytes(self) -> int:
        return sum(self._seen.values())

    def live_nbytes(self) -> int:
        """The bytes of the distinct storages of the packed tensors autograd still holds now
        (after a garbage collection: a freed graph part in a reference cycle is gone too), and
        of those :meth:`keep` counted."""
        gc.collect()
        live = dict(self._kept)
        for ref, ptr, nbytes in self._packed:
            if ref() is not None:
                live[ptr] = nbytes
        return sum(live.values())

    def __enter__(self) -> SavedBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


def _unpack(packed: _Packed) -> torch.Tensor:
    return packed.t


def _loss_fn(model: nn.Module, inputs: tuple, loss: str) -> tuple[str, Callable[[], torch.Tensor]]:
    """(loss kind, a function computing the scalar loss of ``model(*inputs)``), with targets as
    graphflop makes them (zeros for cross-entropy, zeros like the output for MSE)."""
    with torch.no_grad(), token_vocabularies(model, inputs) as vocab:
        out = model(*inputs)
    first = loss_output(out)
    kind = default_loss(out, inputs, vocab) if loss == "auto" else loss
    if kind == "cross_entropy":
        shape = class_target_shape(first)
        targets: tuple = (torch.zeros(shape, dtype=torch.long, device=first.device),)
    elif kind == "mse":
        targets = (torch.zeros_like(first),)
    else:
        targets = ()
    del out, first

    def run() -> torch.Tensor:
        o = model(*inputs)
        f = loss_output(o)
        return loss_value(kind, f, targets)

    run.targets = targets  # type: ignore[attr-defined]
    return kind, run


def measure_saved(model: nn.Module, inputs: tuple, loss: str = "auto") -> int:
    """Bytes autograd saves for backward in one forward of ``model`` plus the loss: the union of
    the storages of the tensors packed by ``saved_tensors_hooks`` that the autograd graph still
    holds once the loss is computed (:meth:`SavedBytes.live_nbytes`; a part of the graph freed
    during the forward, e.g. a block run on ``x.detach()`` whose output is read only by
    non-differentiable code, saves nothing a backward would use), parameters and buffers
    excluded, inputs included."""
    _, run = _loss_fn(model, inputs, loss)
    with SavedBytes(model) as saved:
        lossv = run()
    nbytes = saved.live_nbytes()
    del lossv
    return nbytes


def _profiled_peak(fn: Callable[[], None]) -> int:
    """Largest running sum of the allocator's ``[memory]`` events while ``fn`` runs, bytes."""
    import gc

    from torch.profiler import ProfilerActivity, profile

    gc.collect()  # garbage from earlier work freed inside the window would count as frees
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    # the raw events: FunctionEvent folds allocations made inside an op into that op
    raw = prof.profiler.kineto_results.events()
    events = sorted((e.start_ns(), e.nbytes()) for e in raw if e.name() == "[memory]")
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


def _bytes(ts) -> int:
    seen: dict[int, int] = {}
    for t in ts:
        ptr, nbytes = _storage(t)
        seen[ptr] = nbytes
    return sum(seen.values())


def measure_train_peak(
    model: nn.Module,
    inputs: tuple,
    loss: str = "auto",
    optimizer: str = "sgd",
    keep_grads: bool = False,
) -> int:
    """Peak bytes of one eager training step (see the module docstring). A first step runs
    unprofiled so optimizer state exists, as in every step but the first. ``keep_grads``:
    ``zero_grad(set_to_none=False)``, the gradients live from the start (counted in it)."""
    from graphflop.runtime.optim import torch_optimizer

    _, run = _loss_fn(model, inputs, loss)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch_optimizer(optimizer, params, lr=1e-6)

    def step() -> None:
        opt.zero_grad(set_to_none=not keep_grads)
        run().backward()
        opt.step()

    step()
    opt.zero_grad(set_to_none=not keep_grads)
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    grads = [p.grad for p in params if p.grad is not None]
    base = _bytes(
        [*model.parameters(), *model.buffers(), *inputs, *run.targets, *state, *grads]  # type: ignore[attr-defined]
    )
    return base + _profiled_peak(step)


def measure_forward_peak(model: nn.Module, inputs: tuple, loss: str = "auto") -> int:
    """Peak bytes of one forward and loss with grad mode off (an inference run: nothing saved
    for backward), from the profiler's allocator events, plus the bytes live at the start:
    parameters, buffers, inputs and targets (the caller holds the inputs throughout)."""
    _, run = _loss_fn(model, inputs, loss)

    def forward() -> None:
        with torch.no_grad():
            run()

    base = _bytes([*model.parameters(), *model.buffers(), *inputs, *run.targets])  # type: ignore[attr-defined]
    return base + _profiled_peak(forward)


def measure_jvp_peak(model: nn.Module, inputs: tuple, loss: str = "auto") -> int | None:
    """Peak bytes of ``torch.func.jvp`` of the loss in the parameters (tangents: normal, like
    the parameters), parameters, buffers, inputs, targets and tangents included, with
    scaled dot-product attention on its math path (``sdpa_kernel(SDPBackend.MATH)``; the
    fused CPU kernel PyTorch picks for attention without dropout has no forward derivative);
    None where forward-mode AD cannot run the model (another op without a forward
    derivative)."""
    kind, run = _loss_fn(model, inputs, loss)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    primals = tuple(dict(model.named_parameters())[n].detach() for n in names)
    tangents = tuple(torch.randn_like(p) for p in primals)
    targets = run.targets  # type: ignore[attr-defined]

    buffers = dict(model.named_buffers())

    def f(*ps):
        # copies made inside the transform: a training step updates running statistics
        state = {**{n: b.clone() for n, b in buffers.items()}, **dict(zip(names, ps))}
        o = torch.func.functional_call(model, state, inputs)
        first = loss_output(o)
        return loss_value(kind, first, targets)

    def go() -> None:
        with math_attention():
            torch.func.jvp(f, primals, tangents)

    # the buffers are counted once: by their copies, which ``go`` makes first and holds to
    # the end (the module's own buffers stand idle meanwhile)
    base = _bytes([*model.parameters(), *inputs, *targets, *tangents])
    try:
        return base + _profiled_peak(go)
    except NotImplementedError:  # "Trying to use forward AD with ... not implemented yet"
        return None


def measure(
    model: nn.Module, inputs: tuple, loss: str = "auto", optimizer: str = "sgd", jvp: bool = True
) -> Measured:
    """All three measurements (the model in its current train/eval mode)."""
    kind, _ = _loss_fn(model, inputs, loss)
    return Measured(
        loss=kind,
        saved_for_backward_bytes=measure_saved(model, inputs, kind),
        train_peak_bytes=measure_train_peak(model, inputs, kind, optimizer),
        jvp_peak_bytes=measure_jvp_peak(model, inputs, kind) if jvp else None,
    )
