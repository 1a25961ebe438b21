"""Data-parallel training on ``torch.distributed`` (``torchrun --nproc_per_node N -m graphflop
train ...``).

Semantics are DistributedDataParallel's: every rank starts from the same weights (the model is
built after ``torch.manual_seed(seed)`` on each), draws the same permutation of the training
set, and takes its slice ``[rank·b, (rank+1)·b)`` of each global batch of ``B = N·b`` images;
the gradients are averaged over the ranks (one all-reduce per parameter) before the update, so
with equal slices every rank applies the gradient of the global batch's mean loss, and the loss
logged is the mean of the ranks' losses, the global batch's loss.

* ``torch``: the model is wrapped in :class:`torch.nn.parallel.DistributedDataParallel`.
* ``backprop``: graphflop's train-step graph, built with an update graph whose gradient inputs
  first pass through :func:`mean_over_ranks` (an all-reduce node in the graph).
* ``fgd``: every rank draws its own directions and forms its estimate ``(1/K) Σ d_k v_k`` on its
  slice; the estimates are averaged over the ranks in the same way, so one step uses
  ``ranks × K`` directions.

Buffers (batch-norm statistics) are broadcast from rank 0 after every step, as DDP does before
every forward. Backend: gloo (the graphs run on the CPU); with CUDA present,
``cpu:gloo,cuda:nccl``. Rank 0 alone validates and writes outputs. ONNX Runtime is not
supported in a distributed run (the all-reduce is a PyTorch call).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.fx import Graph, GraphModule

from graphflop.meta import graph_module
from graphflop.passes.optimizer import SLOT


@dataclass(frozen=True)
class Ranks:
    """This process's place in the run: ``rank`` of ``world`` (1 and 0 when not distributed)."""

    rank: int = 0
    world: int = 1

    @property
    def distributed(self) -> bool:
        """More than one process."""
        return self.world > 1

    @property
    def leader(self) -> bool:
        """Rank 0: validates, prints and writes the outputs."""
        return self.rank == 0


def env_ranks() -> Ranks:
    """The ranks torchrun describes in ``RANK``/``WORLD_SIZE`` (an initialised process group
    wins); ``Ranks()`` outside a distributed launch."""
    if dist.is_available() and dist.is_initialized():
        return Ranks(dist.get_rank(), dist.get_world_size())
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    return Ranks(int(os.environ.get("RANK", "0") or 0), world)


def init(ranks: Ranks) -> bool:
    """Initialise the default process group for a distributed run (from torchrun's environment)
    when none is; returns True when this call created it (and so must destroy it)."""
    if not ranks.distributed or dist.is_initialized():
        return False
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend)
    return True


def finish(created: bool) -> None:
    """Destroy the process group :func:`init` created."""
    if created and dist.is_initialized():
        dist.destroy_process_group()


def mean_over_ranks(t: torch.Tensor) -> torch.Tensor:
    """The element-wise mean of ``t`` over all ranks (a new tensor; ``t`` itself on one rank)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return t
    out = t.detach().clone()
    dist.all_reduce(out)
    return out.div_(dist.get_world_size())


def with_gradient_mean(update: GraphModule) -> GraphModule:
    """A copy of an optimizer update graph whose gradient inputs (``SLOT == "grad"``) pass
    through :func:`mean_over_ranks` before any use: inlined into a train step or a
    forward-gradient step, it all-reduces the gradient (or its estimate) before the update."""
    g = Graph()
    env = {}
    for n in update.graph.nodes:
        if n.op == "placeholder":
            env[n] = g.node_copy(n)
    for n in update.graph.nodes:
        if n.op == "placeholder" and n.meta.get(SLOT) == "grad":
            mean = g.call_function(mean_over_ranks, (env[n],))
            mean.meta["val"] = n.meta["val"]
            env[n] = mean
    for n in update.graph.nodes:
        if n.op != "placeholder":
            env[n] = g.node_copy(n, env.__getitem__)
    gm = graph_module(torch.nn.Module(), g)
    gm.meta.update(update.meta)
    return gm


def rank_slice(x: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """Rank ``ranks.rank``'s equal slice of a global batch (its first dimension)."""
    b = len(x) // ranks.world
    return x[ranks.rank * b : (ranks.rank + 1) * b]


class DistributedStepper:
    """Wraps a stepper: each step takes this rank's slice of the global batch, returns the mean
    of the ranks' losses and broadcasts rank 0's buffers (see the module docstring)."""

    def __init__(self, stepper, ranks: Ranks, buffer_names: list[str]):
        self.inner, self.ranks, self.buffer_names = stepper, ranks, buffer_names

    def step(self, x: torch.Tensor, y: torch.Tensor, lr: float, t: int) -> float:
        """One step of the global batch ``(x, y)``; returns its loss (mean over the ranks)."""
        loss = self.inner.step(rank_slice(x, self.ranks), rank_slice(y, self.ranks), lr, t)
        state = self.inner.state_by_qual()
        for q in self.buffer_names:
            dist.broadcast(state[q], 0)
        return float(mean_over_ranks(torch.tensor([loss], dtype=torch.float64))[0])

    def end_epoch(self) -> None:
        """The wrapped stepper's end of epoch."""
        self.inner.end_epoch()

    def state_by_qual(self) -> dict[str, torch.Tensor]:
        """The wrapped stepper's parameters and buffers."""
        return self.inner.state_by_qual()
