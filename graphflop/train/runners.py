"""Running one training step and one validation pass: graphflop's step graphs (called as a
GraphModule or on ONNX Runtime) and the plain-PyTorch baseline.

A *runner* maps ``{placeholder name: tensor}`` to the graph's outputs; a *stepper* owns the
parameters and optimizer state and takes one step per batch; an *evaluator* returns the
validation loss (mean cross-entropy) and accuracy for the current parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule

from graphflop.frontend.trace import loss_value
from graphflop.meta import FORWARD_GRADIENT, KIND, SIGNATURE, TRAIN_STEP, Signature
from graphflop.train.data import Dataset

Runner = Callable[[dict[str, torch.Tensor]], list[torch.Tensor]]


class FxRunner:
    """Calls the GraphModule with its placeholders in order (no autograd)."""

    def __init__(self, gm: GraphModule):
        self.gm = gm
        self.order = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        self.provider = None

    def __call__(self, values: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        with torch.no_grad():
            return list(self.gm(*[values[n] for n in self.order]))


class OrtRunner:
    """The same graph exported to ONNX once and run on ONNX Runtime, fed by input name; the
    model is saved as ``save_to/<kind>.onnx`` when ``save_to`` is given."""

    def __init__(self, gm: GraphModule, kind: str, provider: str, save_to: Path | None = None):
        import onnx

        from graphflop.export.onnx import export_graph, graph_io_names
        from graphflop.io import atomic_write
        from graphflop.runtime.onnxrt import session

        ins, outs = graph_io_names(kind, gm)
        exported = export_graph(gm, kind, ins, outs)
        if save_to is not None:
            atomic_write(save_to / f"{kind}.onnx", lambda p: onnx.save(exported.model, p))
        phs = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        # ONNX input name ← placeholder (a constant written into the file is no input)
        self.feed_names = [(o, p) for o, p in zip(ins, phs) if o in exported.inputs]
        self.sess = session(exported.model, provider, threads=torch.get_num_threads())
        self.provider = self.sess.get_providers()[0]

    def __call__(self, values: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        feeds = {o: values[p].detach().numpy() for o, p in self.feed_names}
        return [torch.from_numpy(a) for a in self.sess.run(None, feeds)]


def make_runner(
    gm: GraphModule, kind: str, provider: str | None, save_to: Path | None
) -> FxRunner | OrtRunner:
    """An :class:`OrtRunner` with an execution ``provider``, else an :class:`FxRunner`."""
    return OrtRunner(gm, kind, provider, save_to) if provider else FxRunner(gm)


def _output_index(gm: GraphModule, name: str) -> int:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return next(i for i, a in enumerate(out.args[0]) if getattr(a, "name", None) == name)


def _ce_and_correct(logits: torch.Tensor, y: torch.Tensor) -> tuple[float, int]:
    logits = logits.float()
    return (float(F.cross_entropy(logits, y, reduction="sum")), int((logits.argmax(1) == y).sum()))


class GraphEvaluator:
    """Validation with an eval-mode forward graph for chunks of its batch size (the last
    chunk padded; only its real rows count)."""

    def __init__(self, gm: GraphModule, run: Runner, data: Dataset):
        self.sig: Signature = gm.meta[SIGNATURE]
        self.batch = _input_batch(gm)
        self.logits_at = _output_index(gm, self.sig.outputs[0])
        self.run = run
        self.x, self.y = data.x_val, data.y_val

    def __call__(self, by_qual: dict[str, torch.Tensor]) -> tuple[float, float]:
        sig, b = self.sig, self.batch
        values = {p: by_qual[q] for p, q in sig.params + sig.buffers}
        total, correct = 0.0, 0
        n = len(self.y)
        for start in range(0, n, b):
            x, y = self.x[start : start + b], self.y[start : start + b]
            m = len(y)
            if m < b:  # pad the last chunk; only its first m logits are read
                x = torch.cat([x, x.new_zeros((b - m, *x.shape[1:]))])
            values[sig.inputs[0]] = x
            values[sig.targets[0]] = torch.cat([y, y.new_zeros(b - m)]) if m < b else y
            logits = self.run(values)[self.logits_at][:m]
            lsum, c = _ce_and_correct(logits, y)
            total += lsum
            correct += c
        return total / n, correct / n


def _input_batch(gm: GraphModule) -> int:
    first = gm.meta[SIGNATURE].inputs[0]
    return next(n for n in gm.graph.nodes if n.name == first).meta["val"].shape[0]


def direction_index(name: str) -> int:
    """``k`` of a direction placeholder ``v<k>_<param>``."""
    return int(name[1:].split("_", 1)[0])


def draw_directions(
    dirs: list[tuple[str, tuple[int, ...]]],
    gen: torch.Generator,
    *,
    distribution: str = "normal",
    orthogonal: bool = False,
) -> dict[str, torch.Tensor]:
    """Values for the direction placeholders ``dirs`` (``(name, shape)``, names
    ``v<k>_<param>``) of one forward-gradient step.

    Independent directions: each entry N(0, 1), or its sign (Rademacher). ``orthogonal``: the
    ``K`` directions, each the concatenation of its per-parameter pieces (``n`` elements in
    all), are the columns of ``√n·Q`` with ``Q`` the orthonormal factor of the QR decomposition
    of an ``n × K`` Gaussian matrix, a uniformly random orthonormal ``K``-frame; so
    ``E[v vᵀ] = I`` (the estimate stays unbiased) and ``E‖ĝ − ∇L‖² = (n/K − 1)‖∇L‖²`` instead of
    ``(n + 1)‖∇L‖²/K`` for independent Gaussian directions.

    Raises:
        ValueError: ``orthogonal`` with ``K > n`` directions.
    """
    if not orthogonal:
        out = {}
        for name, shape in dirs:
            d = torch.randn(shape, generator=gen)
            out[name] = d.sign() if distribution == "rademacher" else d
        return out
    by_k: dict[int, list[tuple[str, tuple[int, ...]]]] = {}
    for name, shape in dirs:
        by_k.setdefault(direction_index(name), []).append((name, shape))
    ks = sorted(by_k)
    sizes = [math.prod(shape) for _, shape in by_k[ks[0]]]
    n = sum(sizes)
    if len(ks) > n:
        raise ValueError(f"{len(ks)} orthogonal directions need at least as many parameters ({n})")
    q, _ = torch.linalg.qr(torch.randn(n, len(ks), generator=gen, dtype=torch.float64))
    q = (q * math.sqrt(n)).float()
    out = {}
    for j, k in enumerate(ks):
        for (name, shape), piece in zip(by_k[k], q[:, j].split(sizes)):
            out[name] = piece.reshape(shape)
    return out


class GraphStepper:
    """Runs graphflop's train-step or forward-gradient-step graph, feeding its outputs (new
    parameters, optimizer state, buffers) back as the next step's inputs.

    Parameters start as ``model``'s (float32), optimizer state as zeros; a forward-gradient
    step's directions are drawn from a generator seeded with ``seed + 0x5EED``
    (:func:`draw_directions`; ``orthogonal``: the step's ``K`` directions orthogonal).
    """

    def __init__(
        self,
        gm: GraphModule,
        run: Runner,
        model: nn.Module,
        *,
        seed: int = 0,
        distribution: str = "normal",
        orthogonal: bool = False,
    ):
        self.gm, self.run = gm, run
        sig: Signature = gm.meta[SIGNATURE]
        self.sig = sig
        fgd = FORWARD_GRADIENT in gm.meta
        info = gm.meta[FORWARD_GRADIENT if fgd else TRAIN_STEP]
        phs = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
        self.values: dict[str, torch.Tensor] = {}
        for p, q in sig.params:
            self.values[p] = model.get_parameter(q).detach().clone().float()
        for p, q in sig.buffers:
            self.values[p] = model.get_buffer(q).detach().clone()
        for s in info.state:
            v = phs[s].meta["val"]
            self.values[s] = torch.zeros(tuple(v.shape), dtype=v.dtype)
        self.has_step = "step" in phs
        qual_to_ph = {q: p for p, q in sig.params}
        self.new_param_ph = [qual_to_ph[q] for q in info.params]
        self.new_state_ph = list(info.state)
        buf_to_ph = {q: p for p, q in sig.buffers}
        self.tail = [buf_to_ph[q] for q in info.buffer_updates]
        # a forward-gradient step outputs its directional derivatives before the buffers
        self.skip = info.directions if fgd else 0
        self.dirs = [
            (n.name, tuple(n.meta["val"].shape))
            for n in phs.values()
            if n.meta.get(KIND) == "direction"
        ]
        self.gen = torch.Generator().manual_seed(seed + 0x5EED)
        self.distribution, self.orthogonal = distribution, orthogonal

    def step(self, x: torch.Tensor, y: torch.Tensor, lr: float, t: int) -> float:
        """One step on batch ``(x, y)`` with learning rate ``lr`` (step ``t``, from 1);
        returns the batch loss before the update."""
        v = self.values
        v[self.sig.inputs[0]] = x
        v[self.sig.targets[0]] = y
        v["lr"] = torch.tensor(lr, dtype=torch.float32)
        if self.has_step:
            v["step"] = torch.tensor(float(t), dtype=torch.float32)
        if self.dirs:
            v.update(
                draw_directions(
                    self.dirs, self.gen, distribution=self.distribution, orthogonal=self.orthogonal
                )
            )
        outs = self.run(v)
        i = 1
        for names in (self.new_param_ph, self.new_state_ph):
            for n in names:
                v[n] = outs[i]
                i += 1
        for j, n in enumerate(self.tail):
            v[n] = outs[i + self.skip + j]
        return float(outs[0])

    def end_epoch(self) -> None:
        """Nothing: the learning-rate decay is the ``lr`` fed."""

    def state_by_qual(self) -> dict[str, torch.Tensor]:
        """The current parameters and buffers by qualified name."""
        return {q: self.values[p] for p, q in self.sig.params + self.sig.buffers}


class TorchStepper:
    """The baseline: autograd and ``torch.optim`` (graphflop's optimizer constants), with
    ``ExponentialLR(gamma=lr_decay)`` stepped per epoch; ``ddp``: the model wrapped in
    ``DistributedDataParallel`` (an initialised process group)."""

    def __init__(
        self, model: nn.Module, optimizer: str, lr: float, lr_decay: float, *, ddp: bool = False
    ):
        from graphflop.runtime.optim import torch_optimizer

        self.model = model
        # in a distributed run the forward goes through DistributedDataParallel, which
        # averages the gradients over the ranks during backward
        self.forward: nn.Module = torch.nn.parallel.DistributedDataParallel(model) if ddp else model
        self.opt = torch_optimizer(optimizer, model.parameters(), lr)
        self.sched = (
            torch.optim.lr_scheduler.ExponentialLR(self.opt, gamma=lr_decay)
            if lr_decay != 1.0
            else None
        )

    def step(self, x, y, lr, t) -> float:
        """One ``loss.backward(); opt.step()`` on ``(x, y)``; returns the loss before it."""
        self.opt.zero_grad(set_to_none=True)
        loss = loss_value("cross_entropy", self.forward(x), (y,))
        try:
            loss.backward()
        except RuntimeError as e:
            from graphflop.runtime.inplace import OUT_OF_PLACE, inplace_reason, inplace_refusal
            from graphflop.train.config import TrainError

            if not inplace_refusal(e):
                raise
            raise TrainError(
                f"--method torch: eager PyTorch's backward refuses the model: {inplace_reason(e)}; "
                f"{OUT_OF_PLACE}, or train with --method backprop (graphflop's functional "
                "train-step graph differentiates it)"
            ) from e
        self.opt.step()
        return float(loss.detach())

    def end_epoch(self) -> None:
        """Step the learning-rate schedule."""
        if self.sched is not None:
            self.sched.step()

    def state_by_qual(self) -> dict[str, torch.Tensor]:
        """The model's parameters and buffers by qualified name."""
        return {
            **{q: p.detach() for q, p in self.model.named_parameters()},
            **{q: b for q, b in self.model.named_buffers()},
        }


class TorchEvaluator:
    """Validation with the model itself in eval mode, in chunks of ``batch``."""

    def __init__(self, model: nn.Module, data: Dataset, batch: int):
        self.model, self.x, self.y, self.batch = model, data.x_val, data.y_val, batch

    def __call__(self, _state) -> tuple[float, float]:
        was = self.model.training
        self.model.eval()
        total, correct = 0.0, 0
        with torch.no_grad():
            for s in range(0, len(self.y), self.batch):
                lsum, c = _ce_and_correct(
                    self.model(self.x[s : s + self.batch]), self.y[s : s + self.batch]
                )
                total += lsum
                correct += c
        self.model.train(was)
        return total / len(self.y), correct / len(self.y)
