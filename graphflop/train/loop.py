"""Training with graphflop's generated step graphs, and the plain-PyTorch baseline.

``train(spec_or_model, method=...)`` runs one of three methods on a :class:`Dataset`:

* ``backprop`` — graphflop's whole train-step graph (forward, backward, update;
  :func:`~graphflop.passes.train_step.build_train_step`);
* ``fgd`` — graphflop's forward-gradient step graph (Baydin et al. 2022;
  :func:`~graphflop.passes.forward_gradient.build_forward_gradient_step`) with ``K`` directions;
* ``torch`` — the baseline as a user writes it: autograd, ``loss.backward()``, ``torch.optim``.

The step graphs run either in PyTorch (the ``fx.GraphModule`` is called; parameters and
optimizer state are plain tensors fed back each step) or on ONNX Runtime (``runtime=
"onnxruntime"``: the step graph is exported once with graphflop's exporter and fed by input
name). ``lr`` (and Adam's ``step``, counted from 1 as in ``torch.optim``) are graph inputs, so the
learning-rate decay just changes the value fed: ``lr · lr_decay^epoch``, the same schedule as
``torch.optim.lr_scheduler.ExponentialLR`` stepped once per epoch in the baseline.

Determinism: for a given ``seed`` the three methods start from the same weights (the model is
constructed right after ``torch.manual_seed(seed)``), see the same batches (one permutation of
the training set per epoch from a generator seeded with ``seed``; the incomplete last batch is
dropped, since the graphs are traced for one batch size) and use the same optimizer constants
(:class:`~graphflop.passes.optimizer.OptimizerConfig`). The forward-gradient directions are
graph inputs drawn from their own generator (seeded from ``seed``), so both runtimes take the
same steps.

Validation runs the forward graph traced in eval mode (the model itself for ``torch``) over the
validation split; loss (cross-entropy) and accuracy come from the logits. Its time is not part
of ``wall_s``, the cumulative training time.
"""

from __future__ import annotations

import copy
import csv
import json
import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule

from graphflop.meta import FORWARD_GRADIENT, KIND, SIGNATURE, TRAIN_STEP, Signature
from graphflop.passes.optimizer import OPTIMIZERS, OptimizerConfig
from graphflop.train.data import Dataset, load_dataset

METHODS = ("fgd", "backprop", "torch")
RUNTIMES = ("torch", "onnxruntime")
CSV_COLUMNS = ("step", "wall_s", "train_loss", "val_loss", "val_accuracy")
#: default learning rates: (method family, optimizer) → lr. Backprop and torch share theirs.
#: (tuned on digits: backprop with momentum reaches ≥ 95 % validation accuracy with the MLP and
#: the CNN in 4-5 epochs; forward gradients need ~500× smaller steps with these models.)
DEFAULT_LR = {
    ("backprop", "sgd"): 0.1,
    ("backprop", "momentum"): 0.05,
    ("backprop", "adam"): 1e-3,
    ("backprop", "adamw"): 1e-3,
    ("fgd", "sgd"): 1e-3,
    ("fgd", "momentum"): 1e-4,
    ("fgd", "adam"): 1e-4,
    ("fgd", "adamw"): 1e-4,
}
DEFAULT_OPTIMIZER = "momentum"
DEFAULT_EPOCHS = 10


class TrainError(ValueError):
    """Options or a model that cannot be trained; the message says what to change."""


@dataclass
class TrainResult:
    """What :func:`train` did.

    Attributes:
        history: one row per step (``step``, ``wall_s``, ``train_loss``, ``val_loss``,
            ``val_accuracy``; the validation fields are None between evaluations), after a
            step-0 row with the initial validation loss.
        summary: final validation loss and accuracy, timings and the settings (JSON-ready).
        params: the trained parameters, by qualified name.
    """

    history: list[dict[str, Any]]
    summary: dict[str, Any]
    params: dict[str, torch.Tensor] = field(default_factory=dict)


# --- the model -----------------------------------------------------------------------------------


def _size_kwargs(image_shape: tuple[int, int, int]) -> list[dict[str, int]]:
    c, h, w = image_shape
    return [{"in_features": c * h * w}, {"in_channels": c, "image_size": h}, {"image_size": h}]


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
    ``image_size=H``; ``ctor_kwargs`` are added (and win). A module instance is deep-copied as is.

    Returns:
        (model in train mode, display name, the constructor keywords used).

    Raises:
        TrainError: the constructor takes none of the size keywords, or the model does not map
            a batch of these images to ``(N, num_classes)`` logits.
        SpecError: the spec cannot be loaded.
    """
    from graphflop.load import SpecError, load

    user = dict(ctor_kwargs or {})
    if isinstance(spec_or_model, nn.Module):
        model, name, used = copy.deepcopy(spec_or_model), type(spec_or_model).__name__, {}
    else:
        if isinstance(spec_or_model, str):

            def make(kw, meta):
                return load(spec_or_model, ctor_kwargs=kw, meta=meta)

            label = spec_or_model
        else:

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

            label = getattr(spec_or_model, "__name__", repr(spec_or_model))
        used, errors = None, []
        for cand in _size_kwargs(data.image_shape):
            kw = {**cand, **user}
            try:
                make(kw, True)  # meta device: no memory, no RNG use
            except SpecError as e:
                if "unexpected keyword argument" not in str(e):
                    raise
                errors.append(str(e).split(": ", 1)[-1])
                continue
            used = kw
            break
        if used is None:
            c, h, w = data.image_shape
            raise TrainError(
                f"cannot size {label} for {data.name} images ({c}×{h}×{w}): its constructor "
                f"takes none of in_features=, in_channels=/image_size=, image_size= "
                f"({'; '.join(errors)}); add one of them to its __init__"
            )
        torch.manual_seed(seed)
        loaded = make(used, False)
        model, name = loaded.model, loaded.name
    model.train()
    _check_model(model, data, name)
    return model, name, used


def _check_model(model: nn.Module, data: Dataset, name: str) -> None:
    probe = copy.deepcopy(model).eval()
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
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, data.num_classes):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise TrainError(
            f"{name} returns {shape} for 2 images; training needs (N, {data.num_classes}) logits"
        )


# --- graphs --------------------------------------------------------------------------------------


def _fake_batch(batch: int, image_shape) -> tuple[torch.Tensor, ...]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        return (torch.empty((batch, *image_shape), dtype=torch.float32),)


def trace_forward(model: nn.Module, batch: int, image_shape, *, train_mode: bool) -> GraphModule:
    """The forward graph (model + cross-entropy) for ``batch`` images, traced on fake tensors."""
    from graphflop.frontend.trace import trace

    m = copy.deepcopy(model).train(train_mode)
    return trace(m, _fake_batch(batch, image_shape), loss="cross_entropy")


def build_step_graph(
    forward: GraphModule,
    method: str,
    optimizer: str | OptimizerConfig,
    *,
    directions: int = 1,
    distribution: str = "normal",
) -> GraphModule:
    """The train-step graph (``backprop``) or the forward-gradient step graph with direction
    inputs (``fgd``) of a traced forward graph, FLOP-annotated."""
    from graphflop.ad.vjp import build_vjp
    from graphflop.meta import fake_mode_of
    from graphflop.passes.flops import annotate_flops
    from graphflop.passes.forward_gradient import build_forward_gradient_step
    from graphflop.passes.optimizer import build_update
    from graphflop.passes.train_step import build_train_step

    if method == "fgd":
        return annotate_flops(
            build_forward_gradient_step(
                forward,
                optimizer,
                directions=directions,
                distribution=distribution,
                direction_inputs=True,
            )
        )
    sig: Signature = forward.meta[SIGNATURE]
    phs = {n.name: n for n in forward.graph.nodes if n.op == "placeholder"}
    fake = fake_mode_of([n.meta["val"] for n in forward.graph.nodes if "val" in n.meta])
    update = build_update(
        [(q, phs[p].meta["val"]) for p, q in sig.params],
        optimizer,
        fake_mode=fake,
        modules={q: q.rpartition(".")[0] for _, q in sig.params},
    )
    return annotate_flops(build_train_step(forward, build_vjp(forward), update))


def _graph_flops(gm: GraphModule) -> int:
    from graphflop.meta import COST

    return sum(n.meta[COST].flops for n in gm.graph.nodes if COST in n.meta)


class _FxRunner:
    """Calls the GraphModule with its placeholders in order."""

    def __init__(self, gm: GraphModule):
        self.gm = gm
        self.order = [n.name for n in gm.graph.nodes if n.op == "placeholder"]

    def __call__(self, values: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        with torch.no_grad():
            return list(self.gm(*[values[n] for n in self.order]))


class _OrtRunner:
    """The same graph exported to ONNX once and run on ONNX Runtime, fed by input name."""

    def __init__(self, gm: GraphModule, kind: str, provider: str, save_to: Path | None = None):
        import onnx

        from graphflop.export.onnx import export_graph, graph_io_names
        from graphflop.runtime.onnxrt import session

        ins, outs = graph_io_names(kind, gm)
        exported = export_graph(gm, kind, ins, outs)
        if save_to is not None:
            save_to.mkdir(parents=True, exist_ok=True)
            onnx.save(exported.model, save_to / f"{kind}.onnx")
        phs = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        self.feed_names = list(zip(ins, phs))  # ONNX input name ← placeholder
        self.sess = session(exported.model, provider, threads=torch.get_num_threads())
        self.provider = self.sess.get_providers()[0]

    def __call__(self, values: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        feeds = {o: values[p].detach().numpy() for o, p in self.feed_names}
        return [torch.from_numpy(a) for a in self.sess.run(None, feeds)]


def _output_index(gm: GraphModule, name: str) -> int:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return next(i for i, a in enumerate(out.args[0]) if getattr(a, "name", None) == name)


def _ce_and_correct(logits: torch.Tensor, y: torch.Tensor) -> tuple[float, int]:
    logits = logits.float()
    return (float(F.cross_entropy(logits, y, reduction="sum")), int((logits.argmax(1) == y).sum()))


class _GraphEvaluator:
    """Validation with the eval-mode forward graph, in chunks of ``batch`` (last one padded)."""

    def __init__(
        self,
        model,
        data: Dataset,
        batch: int,
        runtime: str,
        provider: str | None,
        save_to: Path | None,
    ):
        self.batch = min(batch, len(data.y_val))
        self.gm = trace_forward(model, self.batch, data.image_shape, train_mode=False)
        sig: Signature = self.gm.meta[SIGNATURE]
        self.sig = sig
        self.logits_at = _output_index(self.gm, sig.outputs[0])
        self.run = (
            _OrtRunner(self.gm, "forward", provider, save_to)
            if runtime == "onnxruntime"
            else _FxRunner(self.gm)
        )
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


# --- steppers: one training step each ------------------------------------------------------------


class _GraphStepper:
    """Runs graphflop's train-step or forward-gradient-step graph, feeding its outputs back."""

    def __init__(
        self,
        model: nn.Module,
        method: str,
        optimizer: str,
        batch: int,
        data: Dataset,
        *,
        directions: int,
        distribution: str,
        seed: int,
        runtime: str,
        provider: str | None,
        save_to: Path | None,
    ):
        fwd = trace_forward(model, batch, data.image_shape, train_mode=True)
        self.gm = build_step_graph(
            fwd, method, optimizer, directions=directions, distribution=distribution
        )
        self.flops_per_step = _graph_flops(self.gm)
        sig: Signature = self.gm.meta[SIGNATURE]
        self.sig = sig
        kind = "forward_gradient_step" if method == "fgd" else "train_step"
        info = self.gm.meta[FORWARD_GRADIENT if method == "fgd" else TRAIN_STEP]
        self.method = method
        self.run = (
            _OrtRunner(self.gm, kind, provider, save_to)
            if runtime == "onnxruntime"
            else _FxRunner(self.gm)
        )
        self.provider = getattr(self.run, "provider", None)
        phs = {n.name: n for n in self.gm.graph.nodes if n.op == "placeholder"}
        qual_to_ph = {q: p for p, q in sig.params}
        buf_to_ph = {q: p for p, q in sig.buffers}
        self.values: dict[str, torch.Tensor] = {}
        for p, q in sig.params:
            self.values[p] = model.get_parameter(q).detach().clone().float()
        for p, q in sig.buffers:
            self.values[p] = model.get_buffer(q).detach().clone()
        for s in info.state:
            v = phs[s].meta["val"]
            self.values[s] = torch.zeros(tuple(v.shape), dtype=v.dtype)
        self.has_step = "step" in phs
        self.new_param_ph = [qual_to_ph[q] for q in info.params]
        self.new_state_ph = list(info.state)
        if method == "fgd":
            self.dirs = [
                (n.name, tuple(n.meta["val"].shape))
                for n in phs.values()
                if n.meta.get(KIND) == "direction"
            ]
            self.gen = torch.Generator().manual_seed(seed + 0x5EED)
            self.rademacher = distribution == "rademacher"
            self.tail = []
        else:
            self.dirs = []
            self.tail = [buf_to_ph[q] for q in info.buffer_updates]

    def step(self, x: torch.Tensor, y: torch.Tensor, lr: float, t: int) -> float:
        v = self.values
        v[self.sig.inputs[0]] = x
        v[self.sig.targets[0]] = y
        v["lr"] = torch.tensor(lr, dtype=torch.float32)
        if self.has_step:
            v["step"] = torch.tensor(float(t), dtype=torch.float32)
        for name, shape in self.dirs:
            d = torch.randn(shape, generator=self.gen)
            v[name] = d.sign() if self.rademacher else d
        outs = self.run(v)
        i = 1
        for names in (self.new_param_ph, self.new_state_ph, self.tail):
            for n in names:
                v[n] = outs[i]
                i += 1
        return float(outs[0])

    def end_epoch(self) -> None:
        pass

    def state_by_qual(self) -> dict[str, torch.Tensor]:
        return {q: self.values[p] for p, q in self.sig.params + self.sig.buffers}


def torch_optimizer(
    name: str, params, lr: float, cfg: OptimizerConfig | None = None
) -> torch.optim.Optimizer:
    """``torch.optim`` with the constants graphflop's update graphs use."""
    cfg = cfg or OptimizerConfig(name)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, betas=cfg.betas, eps=cfg.eps)
    if name == "adamw":
        return torch.optim.AdamW(
            params, lr=lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
        )
    raise TrainError(f"unknown optimizer {name!r}; one of {', '.join(OPTIMIZERS)}")


class _TorchStepper:
    """The baseline: autograd and torch.optim, with ExponentialLR stepped per epoch."""

    def __init__(self, model: nn.Module, optimizer: str, lr: float, lr_decay: float):
        self.model = model
        self.opt = torch_optimizer(optimizer, model.parameters(), lr)
        self.sched = (
            torch.optim.lr_scheduler.ExponentialLR(self.opt, gamma=lr_decay)
            if lr_decay != 1.0
            else None
        )

    def step(self, x, y, lr, t) -> float:
        self.opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        self.opt.step()
        return float(loss.detach())

    def end_epoch(self) -> None:
        if self.sched is not None:
            self.sched.step()

    def state_by_qual(self) -> dict[str, torch.Tensor]:
        return {
            **{q: p.detach() for q, p in self.model.named_parameters()},
            **{q: b for q, b in self.model.named_buffers()},
        }


class _TorchEvaluator:
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


# --- the loop ------------------------------------------------------------------------------------


def default_lr(method: str, optimizer: str) -> float:
    """The learning rate used when none is given (tuned on digits)."""
    return DEFAULT_LR[("fgd" if method == "fgd" else "backprop", optimizer)]


def train(
    spec_or_model: str | nn.Module | Callable[..., nn.Module],
    *,
    method: str = "backprop",
    runtime: str = "torch",
    dataset: str = "digits",
    data_dir: str | Path | None = None,
    data: Dataset | None = None,
    optimizer: str = DEFAULT_OPTIMIZER,
    lr: float | None = None,
    lr_decay: float = 1.0,
    batch: int = 64,
    steps: int | None = None,
    epochs: float | None = None,
    directions: int = 1,
    distribution: str = "normal",
    seed: int = 0,
    eval_every: int | None = None,
    eval_batch: int = 500,
    ctor_kwargs: dict | None = None,
    device: str = "cpu",
    threads: int | None = None,
    out: str | Path | None = None,
    callback: Callable[[dict[str, Any], dict[str, Any]], None] | None = None,
) -> TrainResult:
    """Train ``spec_or_model`` on ``dataset`` with ``method`` (see the module docstring).

    Args:
        spec_or_model: a model spec (``models/mlp.py``), a class or factory, or a module.
        method: ``backprop``, ``fgd`` or ``torch``.
        runtime: where the step graph runs: ``torch`` (call the GraphModule) or
            ``onnxruntime``. ``method="torch"`` runs in PyTorch only.
        dataset, data_dir: ``digits`` or ``mnist`` (with its folder); or pass ``data``.
        optimizer: ``sgd``, ``momentum``, ``adam``, ``adamw`` (PyTorch's algorithms).
        lr: learning rate (default :func:`default_lr`); ``lr_decay``: factor per epoch.
        batch: training batch size (incomplete batches are dropped).
        steps, epochs: length of training (at most one; default 10 epochs).
        directions, distribution: forward-gradient directions per step and their law.
        seed: model initialisation, batch order and directions.
        eval_every: validate every N steps (default: once per epoch) and at the end; 0: never
            (not even at step 0 or at the end, and no eval graph is built).
        eval_batch: validation chunk size.
        ctor_kwargs: extra constructor keywords for the model.
        device: ONNX Runtime execution provider (``cpu`` or ``cuda``); PyTorch runs on the CPU.
        threads: ``torch.set_num_threads`` (and ONNX Runtime's intra-op threads) for this run,
            restored afterwards; None leaves PyTorch's setting. On a loaded machine 1 thread
            avoids spin-waiting between oversubscribed threads (often several times faster).
        out: folder for ``train.csv``, ``train.png``, ``summary.json`` (and the ONNX graphs).
        callback: called after every logged row with ``(row, info)``; ``info`` has
            ``total_steps``.

    Raises:
        TrainError, DataError, SpecError, TraceError, OnnxExportError.
    """
    if method not in METHODS:
        raise TrainError(f"unknown method {method!r}; one of {', '.join(METHODS)}")
    if runtime not in RUNTIMES:
        raise TrainError(f"unknown runtime {runtime!r}; one of {', '.join(RUNTIMES)}")
    if method == "torch" and runtime != "torch":
        raise TrainError(
            "--method torch is PyTorch autograd; --runtime onnxruntime runs "
            "graphflop's graphs (--method backprop or fgd)"
        )
    if optimizer not in OPTIMIZERS:
        raise TrainError(f"unknown optimizer {optimizer!r}; one of {', '.join(OPTIMIZERS)}")
    if steps is not None and epochs is not None:
        raise TrainError("give --steps or --epochs, not both")
    if (
        batch < 1
        or directions < 1
        or (steps is not None and steps < 1)
        or (epochs is not None and epochs <= 0)
    ):
        raise TrainError("--batch, --directions, --steps and --epochs must be positive")
    if lr is not None and not lr > 0 or not lr_decay > 0:
        raise TrainError("--lr and --lr-decay must be positive")
    if distribution not in ("normal", "rademacher"):
        raise TrainError(f"unknown distribution {distribution!r}; normal or rademacher")
    if eval_every is not None and eval_every < 0:
        raise TrainError("--eval-every must be 0 (never) or positive")
    if threads is not None and threads < 1:
        raise TrainError("--threads must be positive")
    if device not in ("cpu", "cuda"):
        raise TrainError(f"unknown device {device!r}; cpu or cuda")
    lr = default_lr(method, optimizer) if lr is None else float(lr)
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        setup_t0 = time.perf_counter()
        data = data if data is not None else load_dataset(dataset, data_dir)
        n_train = len(data.y_train)
        if n_train < batch:
            raise TrainError(f"--batch {batch} is larger than the {n_train} training images")
        spe = n_train // batch
        total = steps if steps is not None else max(1, round((epochs or DEFAULT_EPOCHS) * spe))
        eval_every = spe if eval_every is None else eval_every

        model, name, used_kwargs = build_model(
            spec_or_model, data, seed=seed, ctor_kwargs=ctor_kwargs
        )
        n_params = sum(p.numel() for p in model.parameters())
        provider = None
        if runtime == "onnxruntime":
            from graphflop.runtime.onnxrt import pick_provider

            try:
                provider = pick_provider(device)
            except RuntimeError as e:
                raise TrainError(str(e)) from e
        save_onnx = Path(out) / "onnx" if out is not None and runtime == "onnxruntime" else None
        if method == "torch":
            stepper = _TorchStepper(model, optimizer, lr, lr_decay)
            evaluator = _TorchEvaluator(model, data, eval_batch) if eval_every else None
            flops_per_step = None
        else:
            stepper = _GraphStepper(
                model,
                method,
                optimizer,
                batch,
                data,
                directions=directions,
                distribution=distribution,
                seed=seed,
                runtime=runtime,
                provider=provider,
                save_to=save_onnx,
            )
            evaluator = (
                _GraphEvaluator(model, data, eval_batch, runtime, provider, save_onnx)
                if eval_every
                else None
            )
            flops_per_step = stepper.flops_per_step
            provider = stepper.provider or provider
        setup_s = time.perf_counter() - setup_t0

        info = {"total_steps": total, "steps_per_epoch": spe}
        history: list[dict[str, Any]] = []
        eval_s = 0.0

        def evaluate() -> tuple[float | None, float | None]:
            nonlocal eval_s
            if evaluator is None:
                return None, None
            t0 = time.perf_counter()
            res = evaluator(stepper.state_by_qual())
            eval_s += time.perf_counter() - t0
            return res

        def log(row):
            history.append(row)
            if callback is not None:
                callback(row, info)

        vl, va = evaluate()
        log({"step": 0, "wall_s": 0.0, "train_loss": None, "val_loss": vl, "val_accuracy": va})
        gen = torch.Generator().manual_seed(seed)
        wall = 0.0
        perm = None
        diverged = False
        x_all, y_all = data.x_train, data.y_train
        t = 0
        for t in range(1, total + 1):
            i, epoch = (t - 1) % spe, (t - 1) // spe
            t0 = time.perf_counter()
            if i == 0:
                perm = torch.randperm(n_train, generator=gen)
            idx = perm[i * batch : (i + 1) * batch]
            loss = stepper.step(x_all[idx], y_all[idx], lr * lr_decay**epoch, t)
            if i == spe - 1:
                stepper.end_epoch()
            wall += time.perf_counter() - t0
            diverged = not math.isfinite(loss)
            row = {
                "step": t,
                "wall_s": wall,
                "train_loss": loss,
                "val_loss": None,
                "val_accuracy": None,
            }
            if eval_every and (t % eval_every == 0 or t == total or diverged):
                row["val_loss"], row["val_accuracy"] = evaluate()
            log(row)
            if diverged:
                break
        evals = [r for r in history if r["val_loss"] is not None]
        c, h, w = data.image_shape
        summary = {
            "model": name,
            "method": method,
            "runtime": runtime if method != "torch" else "torch",
            "provider": provider,
            "optimizer": optimizer,
            "lr": lr,
            "lr_decay": lr_decay,
            "batch": batch,
            "steps": t,
            "epochs": t / spe,
            "steps_per_epoch": spe,
            "directions": directions if method == "fgd" else None,
            "distribution": distribution if method == "fgd" else None,
            "seed": seed,
            "dataset": data.name,
            "train_size": n_train,
            "val_size": len(data.y_val),
            "image_shape": [c, h, w],
            "ctor_kwargs": used_kwargs,
            "params": n_params,
            "initial_val_loss": evals[0]["val_loss"] if evals else None,
            "initial_val_accuracy": evals[0]["val_accuracy"] if evals else None,
            "final_val_loss": evals[-1]["val_loss"] if len(evals) > 1 else None,
            "final_val_accuracy": evals[-1]["val_accuracy"] if len(evals) > 1 else None,
            "best_val_accuracy": max((r["val_accuracy"] for r in evals[1:]), default=None),
            "final_train_loss": history[-1]["train_loss"],
            "diverged": diverged,
            "train_wall_s": wall,
            "seconds_per_step": wall / t if t else None,
            "steps_per_s": t / wall if wall else None,
            "setup_s": setup_s,
            "eval_s": eval_s,
            "flops_per_step": flops_per_step,
            "torch_threads": torch.get_num_threads(),
        }
        result = TrainResult(
            history, summary, {q: v.detach().clone() for q, v in stepper.state_by_qual().items()}
        )
        if out is not None:
            write_outputs(result, out)
        return result
    finally:
        torch.set_num_threads(old_threads)


# --- outputs -------------------------------------------------------------------------------------


def _atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_csv(history: list[dict[str, Any]], path: str | Path) -> None:
    """``train.csv``: one row per step; validation columns empty between evaluations."""
    path = Path(path)

    def write(p):
        with open(p, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(CSV_COLUMNS)
            for r in history:
                w.writerow(
                    [
                        "" if r[c] is None else (f"{r[c]:.6g}" if isinstance(r[c], float) else r[c])
                        for c in CSV_COLUMNS
                    ]
                )

    _atomic_write(path, write)


def plot(history: list[dict[str, Any]], path: str | Path, title: str = "") -> None:
    """``train.png``: loss against training wall time (left) and against steps (right)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    tr = [r for r in history if r["train_loss"] is not None and math.isfinite(r["train_loss"])]
    va = [r for r in history if r["val_loss"] is not None]
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    for ax, key, label in zip(
        fig.subplots(1, 2), ("wall_s", "step"), ("training wall time (s)", "step")
    ):
        if tr:
            ax.plot(
                [r[key] for r in tr],
                [r["train_loss"] for r in tr],
                lw=0.8,
                alpha=0.6,
                label="train loss (batch)",
            )
        if va:
            ax.plot(
                [r[key] for r in va],
                [r["val_loss"] for r in va],
                "o-",
                ms=3,
                label="validation loss",
            )
        ax.set_xlabel(label)
        ax.set_ylabel("cross-entropy")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    path = Path(path)
    _atomic_write(path, lambda p: fig.savefig(p, format="png", dpi=110))


def write_outputs(result: TrainResult, out: str | Path) -> dict[str, Path]:
    """Write ``train.csv``, ``train.png`` and ``summary.json`` into ``out`` (created)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    s = result.summary
    files = {"csv": out / "train.csv", "png": out / "train.png", "summary": out / "summary.json"}
    write_csv(result.history, files["csv"])
    acc = s.get("final_val_accuracy")
    title = (
        f"{s['model']} on {s['dataset']}: {s['method']}"
        f"{' (' + s['runtime'] + ')' if s['method'] != 'torch' else ''}, {s['optimizer']} "
        f"lr {s['lr']:g}"
        + (f", K={s['directions']}" if s["method"] == "fgd" else "")
        + (f" — val acc {acc:.1%}" if acc is not None else "")
    )
    plot(result.history, files["png"], title)
    _atomic_write(files["summary"], lambda p: p.write_text(json.dumps(s, indent=1) + "\n"))
    return files


# --- the estimator's variance --------------------------------------------------------------------


def estimator_variance(
    spec_or_model: str | nn.Module | Callable[..., nn.Module] = "models/logreg.py",
    *,
    directions: tuple[int, ...] = (1, 8),
    samples: int = 200,
    dataset: str = "digits",
    data: Dataset | None = None,
    batch: int = 64,
    distribution: str = "normal",
    seed: int = 0,
    ctor_kwargs: dict | None = None,
) -> dict[str, Any]:
    """Variance of the forward-gradient estimate around the true gradient, per ``K``.

    At the seed's initial parameters and one fixed batch, runs graphflop's forward-gradient step
    graph (``K`` directions as inputs) ``samples`` times per ``K`` and forms the estimate
    ``ĝ = (1/K) Σ d_k v_k`` from the directional derivatives it outputs; the true gradient is
    ``torch.func.grad`` of the model's own loss. For Gaussian directions
    ``E‖ĝ − ∇L‖² = (n + 1)‖∇L‖² / K`` (``n`` parameters), so it falls as ``1/K``.

    Returns:
        ``{"params": n, "grad_norm_sq": ‖∇L‖², "variance": {K: E‖ĝ−∇L‖²},
        "relative_variance": {K: variance / ‖∇L‖²}, "bias_rel": {K: ‖mean ĝ − ∇L‖/‖∇L‖},
        "theory_relative": {K: (n+1)/K}}`` (Gaussian theory), plus ``ratio`` = variance at
        the smallest K / at the largest.
    """
    data = data if data is not None else load_dataset(dataset)
    model, _, _ = build_model(spec_or_model, data, seed=seed, ctor_kwargs=ctor_kwargs)
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randperm(len(data.y_train), generator=gen)[:batch]
    x, y = data.x_train[idx], data.y_train[idx]
    params = {q: p.detach().clone() for q, p in model.named_parameters()}
    buffers = dict(model.named_buffers())

    def loss_fn(p):
        return F.cross_entropy(torch.func.functional_call(model, (p, buffers), (x,)), y)

    true = torch.func.grad(loss_fn)(params)
    true_flat = torch.cat([true[q].reshape(-1) for q in params]).double()
    gsq = float(true_flat @ true_flat)
    fwd = trace_forward(model, batch, data.image_shape, train_mode=True)
    sig: Signature = fwd.meta[SIGNATURE]
    out: dict[str, Any] = {
        "params": int(true_flat.numel()),
        "grad_norm_sq": gsq,
        "variance": {},
        "relative_variance": {},
        "bias_rel": {},
        "theory_relative": {},
        "samples": samples,
        "distribution": distribution,
    }
    dgen = torch.Generator().manual_seed(seed + 1)
    for k in directions:
        gm = build_step_graph(fwd, "fgd", "sgd", directions=k, distribution=distribution)
        run = _FxRunner(gm)
        phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        values = {p: params[q] for p, q in sig.params}
        values.update({p: buffers[q] for p, q in sig.buffers})
        values[sig.inputs[0]], values[sig.targets[0]] = x, y
        values["lr"] = torch.tensor(0.0)
        dir_phs = [n for n in phs if n.meta.get(KIND) == "direction"]
        for n in phs:  # optimizer state (none for SGD) and anything else: zeros
            if n.name not in values and n.meta.get(KIND) != "direction":
                values[n.name] = torch.zeros(tuple(n.meta["val"].shape))
        qual = dict(sig.params)
        err_sum, mean = 0.0, torch.zeros_like(true_flat)
        for _ in range(samples):
            for n in dir_phs:
                d = torch.randn(tuple(n.meta["val"].shape), generator=dgen)
                values[n.name] = d.sign() if distribution == "rademacher" else d
            ds = run(values)[-k:]
            est = {q: torch.zeros_like(params[q]) for q in params}
            for n in dir_phs:
                kk = int(n.name[1:].split("_", 1)[0])
                q = qual[n.name.split("_", 1)[1]]
                est[q] += ds[kk] * values[n.name] / k
            flat = torch.cat([est[q].reshape(-1) for q in params]).double()
            err_sum += float(((flat - true_flat) ** 2).sum())
            mean += flat / samples
        var = err_sum / samples
        out["variance"][k] = var
        out["relative_variance"][k] = var / gsq
        out["bias_rel"][k] = float((mean - true_flat).norm()) / math.sqrt(gsq)
        n_par = out["params"]
        out["theory_relative"][k] = (
            (n_par + 1) / k if distribution == "normal" else (n_par - 1) / k
        )  # Rademacher: E‖(g·v)v−g‖² = (n−1)…
    ks = sorted(directions)
    out["ratio"] = out["variance"][ks[0]] / out["variance"][ks[-1]]
    return out
