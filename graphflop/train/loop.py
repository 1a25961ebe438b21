"""Training with graphflop's generated step graphs, and the plain-PyTorch baseline.

``train(spec_or_model, data, TrainConfig(method=...))`` runs one of three methods on a
:class:`~graphflop.train.data.Dataset`:

* ``backprop`` — graphflop's whole train-step graph (forward, backward, update;
  :func:`graphflop.runtime.graphs.train_step_graph` of the model's analysis);
* ``fgd`` — graphflop's forward-gradient step graph (Baydin et al. 2022;
  :func:`graphflop.runtime.graphs.forward_gradient_graph`) with ``K`` directions;
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

The settings are a :class:`~graphflop.train.config.TrainConfig`; the model and its graphs come
from :mod:`graphflop.train.model`, the steppers and evaluators from :mod:`graphflop.train.runners`,
the files from :mod:`graphflop.train.outputs`.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from graphflop.frontend.errors import TraceError, exception_chain, first_line
from graphflop.train import distributed
from graphflop.train.config import (
    DEFAULT_EPOCHS,
    DEFAULT_LR,
    DEFAULT_OPTIMIZER,
    METHODS,
    RUNTIMES,
    TrainConfig,
    TrainError,
    default_lr,
)
from graphflop.train.data import Dataset, load_dataset
from graphflop.train.distributed import DistributedStepper, Ranks, env_ranks
from graphflop.train.model import build_model, graph_flops, step_graph, trace_forward
from graphflop.train.outputs import (
    CSV_COLUMNS,
    TrainResult,
    foreign_files,
    plot,
    write_csv,
    write_outputs,
)
from graphflop.train.runners import (
    GraphEvaluator,
    GraphStepper,
    TorchEvaluator,
    TorchStepper,
    make_runner,
)
from graphflop.train.variance import estimator_variance

if TYPE_CHECKING:
    from graphflop.train.activity import ActivityStepper

__all__ = [
    "CSV_COLUMNS",
    "DEFAULT_EPOCHS",
    "DEFAULT_LR",
    "DEFAULT_OPTIMIZER",
    "METHODS",
    "RUNTIMES",
    "TrainConfig",
    "TrainError",
    "TrainResult",
    "build_model",
    "default_lr",
    "estimator_variance",
    "plot",
    "train",
    "write_csv",
    "write_outputs",
]

#: ``progress(row, info)``: called after every logged row; ``info`` has ``total_steps`` and
#: ``steps_per_epoch``
Progress = Callable[[dict[str, Any], dict[str, Any]], None]


def train(
    spec_or_model: str | nn.Module | Callable[..., nn.Module],
    data: Dataset | None = None,
    config: TrainConfig | None = None,
    *,
    out: str | Path | None = None,
    progress: Progress | None = None,
) -> TrainResult:
    """Train ``spec_or_model`` on ``data`` as ``config`` says (see the module docstring).

    Args:
        spec_or_model: a model spec (``models/mlp.py``), a class or factory, or a module; a
            spec, class or factory is sized for the images (:func:`build_model`).
        data: the data set; None loads ``config.dataset`` (from ``config.data_dir``).
        config: the settings (default ``TrainConfig()``: backprop, momentum, 10 epochs).
        out: folder for ``train.csv``, ``train.png``, ``summary.json`` (and the ONNX graphs
            with ``runtime="onnxruntime"``); None writes nothing.
        progress: called after every logged row with ``(row, info)``; ``info`` has
            ``total_steps`` and ``steps_per_epoch``.

    Returns:
        The per-step history, the summary and the trained parameters.

    Raises:
        TrainError, DataError, SpecError, TraceError, OnnxExportError.
    """
    config = config or TrainConfig()
    ranks = env_ranks()
    _check_ranks(config, ranks)
    if not ranks.leader:
        out = None  # rank 0 alone writes
    check_out(out)
    old_threads = torch.get_num_threads()
    if config.threads:
        torch.set_num_threads(config.threads)
    # the ONNX graphs go to a temporary folder, moved to out/onnx with the other outputs at the
    # end: an error or Ctrl-C during training leaves nothing in out
    staging = (
        Path(tempfile.mkdtemp(prefix="graphflop-train-onnx-"))
        if out is not None and config.runtime == "onnxruntime" and config.method != "torch"
        else None
    )
    created = distributed.init(ranks)
    try:
        with _batch_norm_refused(config):
            run = _setup(spec_or_model, data, config, staging, ranks)
            result = _run(run, config, progress)
        if out is not None:
            write_outputs(result, out)
            if staging is not None:
                _publish(staging, Path(out) / "onnx")
        return result
    finally:
        torch.set_num_threads(old_threads)
        distributed.finish(created)
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)


#: the words of PyTorch's refusal of batch norm in training mode over one value per channel
_ONE_VALUE_PER_CHANNEL = "more than 1 value per channel when training"


@contextlib.contextmanager
def _batch_norm_refused(c: TrainConfig) -> Iterator[None]:
    """Raise :class:`TrainError` for batch norm in training mode over a batch that gives it one
    value per channel, whichever method met it: eager PyTorch's ``ValueError`` (``--method
    torch``, activity perturbation) or the trace's :class:`TraceError` caused by it (the step
    graphs), one line naming the option that helps."""
    try:
        yield
    except (ValueError, TraceError) as e:
        # the model's own error, innermost (a trace's TraceError quotes it with other advice)
        said = [x for x in exception_chain(e) if _ONE_VALUE_PER_CHANNEL in str(x)]
        if not said:
            raise
        cause = said[-1]
        raise TrainError(
            f"the model's batch norm in training mode failed at --batch {c.batch}: "
            f"{type(cause).__name__}: {first_line(cause)}; give a larger --batch"
        ) from e


def _check_ranks(c: TrainConfig, ranks: Ranks) -> None:
    """Raise :class:`TrainError` for a distributed run that cannot be split evenly."""
    if not ranks.distributed:
        return
    if c.runtime != "torch":
        raise TrainError(
            "a distributed run (torchrun) executes the step graphs in PyTorch; "
            "drop --runtime onnxruntime"
        )
    if c.batch % ranks.world:
        raise TrainError(
            f"--batch {c.batch} does not split evenly over {ranks.world} processes; "
            f"give a multiple of {ranks.world}"
        )


def check_out(out: str | Path | None) -> None:
    """Check that the output folder ``out`` can be created or written into, before training.

    Raises:
        TrainError: ``out`` is an existing file, its folder is not writable, or it holds
            files a run does not write (:func:`~graphflop.train.outputs.foreign_files`).
    """
    from graphflop.io import unwritable

    if out is not None and not str(out).strip():
        # "" would be the current folder: the run's files landed among the user's
        raise TrainError("--out needs a folder name, not an empty string: give a path")
    why = unwritable(out, folder=True) if out is not None else None
    if why:
        raise TrainError(f"cannot write --out {out}: {why}")
    other = foreign_files(out) if out is not None else []
    if other:
        shown = ", ".join(other[:5]) + (f" and {len(other) - 5} more" if len(other) > 5 else "")
        raise TrainError(
            f"--out {out} holds files a run does not write ({shown}): they would sit beside "
            "the new train.csv, train.png and summary.json; give an empty or new folder"
        )


def _publish(staging: Path, dest: Path) -> None:
    """Move the files of ``staging`` into ``dest`` (created), each by one rename or copy."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in sorted(staging.iterdir()):
        shutil.move(str(f), dest / f.name)


@dataclass
class _Run:
    """A training run ready to start."""

    data: Dataset
    name: str
    ctor_kwargs: dict
    params: int
    stepper: Any
    evaluator: Any
    flops_per_step: int | None
    provider: str | None
    steps_per_epoch: int
    total_steps: int
    eval_every: int
    setup_s: float
    ranks: Ranks = field(default_factory=Ranks)


def _setup(
    spec_or_model,
    data: Dataset | None,
    c: TrainConfig,
    save_onnx: Path | None,
    ranks: Ranks | None = None,
) -> _Run:
    t0 = time.perf_counter()
    ranks = ranks or Ranks()
    data = data if data is not None else load_dataset(c.dataset, c.data_dir)
    n_train = len(data.y_train)
    if n_train < c.batch:
        raise TrainError(f"--batch {c.batch} is larger than the {n_train} training images")
    spe = n_train // c.batch
    eval_every = spe if c.eval_every is None else c.eval_every
    validate = bool(eval_every) and ranks.leader
    model, name, used = build_model(spec_or_model, data, seed=c.seed, ctor_kwargs=c.ctor_kwargs)
    _check_trainable(model, name)
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if c.method == "fgd" and c.orthogonal and c.directions > n_params:
        raise TrainError(
            f"--orthogonal needs --directions at most the {n_params} parameters "
            f"(got {c.directions})"
        )
    provider = _provider(c)
    local_batch = c.batch // ranks.world
    stepper: ActivityStepper | TorchStepper | GraphStepper | DistributedStepper
    evaluator: TorchEvaluator | GraphEvaluator | None
    if c.perturb == "activations":
        from graphflop.train.activity import ActivityStepper

        stepper = ActivityStepper(
            model,
            c.optimizer,
            c.learning_rate,
            c.lr_decay,
            directions=c.directions,
            seed=c.seed + 0x10000 * ranks.rank,
            local_losses=c.local_losses,
            head_seed=c.seed,
        )
        evaluator = TorchEvaluator(model, data, c.eval_batch) if validate else None
        flops = None
    elif c.method == "torch":
        stepper = TorchStepper(
            model, c.optimizer, c.learning_rate, c.lr_decay, ddp=ranks.distributed
        )
        evaluator = TorchEvaluator(model, data, c.eval_batch) if validate else None
        flops = None
    else:
        gm = step_graph(
            model,
            c.method,
            c.optimizer,
            local_batch,
            data.image_shape,
            directions=c.directions,
            distribution=c.distribution,
            gradient_mean=ranks.distributed,
        )
        kind = "forward_gradient_step" if c.method == "fgd" else "train_step"
        run = make_runner(gm, kind, provider, save_onnx)
        # each rank draws its own directions
        stepper = GraphStepper(
            gm,
            run,
            model,
            seed=c.seed + 0x10000 * ranks.rank,
            distribution=c.distribution,
            orthogonal=c.orthogonal,
        )
        evaluator = _graph_evaluator(model, data, c, provider, save_onnx) if validate else None
        flops, provider = graph_flops(gm), run.provider or provider
    if ranks.distributed:
        buffers = [q for _, q in stepper.sig.buffers] if isinstance(stepper, GraphStepper) else []
        stepper = DistributedStepper(stepper, ranks, buffers)
    return _Run(
        data,
        name,
        used,
        sum(p.numel() for p in model.parameters()),
        stepper,
        evaluator,
        flops,
        provider,
        spe,
        c.total_steps(spe),
        eval_every if ranks.leader else 0,
        time.perf_counter() - t0,
        ranks,
    )


def _check_trainable(model: nn.Module, name: str) -> None:
    """Raise :class:`TrainError` for a model with no parameter to train."""
    from graphflop.load import untrainable

    why = untrainable(model)
    if why is not None:
        raise TrainError(
            f"{name} has {why}: there is nothing to train; give it a trainable parameter "
            "(requires_grad=True)"
        )


def _provider(c: TrainConfig) -> str | None:
    """ONNX Runtime's execution provider for ``c.device`` (None: the graphs run in PyTorch)."""
    if c.runtime != "onnxruntime":
        return None
    from graphflop.runtime.onnxrt import pick_provider

    try:
        return pick_provider(c.device)
    except RuntimeError as e:
        raise TrainError(str(e)) from e


def _graph_evaluator(model, data: Dataset, c: TrainConfig, provider, save_to) -> GraphEvaluator:
    gm = trace_forward(
        model, min(c.eval_batch, len(data.y_val)), data.image_shape, train_mode=False
    )
    return GraphEvaluator(gm, make_runner(gm, "forward", provider, save_to), data)


class _Log:
    """The history, with validation timed apart from training."""

    def __init__(self, run: _Run, progress: Progress | None):
        self.run, self.progress = run, progress
        self.history: list[dict[str, Any]] = []
        self.eval_s = 0.0
        self.info = {"total_steps": run.total_steps, "steps_per_epoch": run.steps_per_epoch}

    def evaluate(self) -> tuple[float | None, float | None]:
        if self.run.evaluator is None:
            return None, None
        t0 = time.perf_counter()
        res = self.run.evaluator(self.run.stepper.state_by_qual())
        self.eval_s += time.perf_counter() - t0
        return res

    def add(self, row: dict[str, Any]) -> None:
        self.history.append(row)
        if self.progress is not None:
            self.progress(row, self.info)


def _run(run: _Run, c: TrainConfig, progress: Progress | None) -> TrainResult:
    log = _Log(run, progress)
    vl, va = log.evaluate()
    log.add({"step": 0, "wall_s": 0.0, "train_loss": None, "val_loss": vl, "val_accuracy": va})
    gen = torch.Generator().manual_seed(c.seed)
    spe, lr = run.steps_per_epoch, c.learning_rate
    x_all, y_all = run.data.x_train, run.data.y_train
    wall, perm, diverged, t = 0.0, None, False, 0
    for t in range(1, run.total_steps + 1):
        i, epoch = (t - 1) % spe, (t - 1) // spe
        t0 = time.perf_counter()
        if i == 0:
            perm = torch.randperm(len(y_all), generator=gen)
        assert perm is not None  # drawn at each epoch's first step
        idx = perm[i * c.batch : (i + 1) * c.batch]
        loss = run.stepper.step(x_all[idx], y_all[idx], lr * c.lr_decay**epoch, t)
        if i == spe - 1:
            run.stepper.end_epoch()
        wall += time.perf_counter() - t0
        diverged = not math.isfinite(loss)
        row = {
            "step": t,
            "wall_s": wall,
            "train_loss": loss,
            "val_loss": None,
            "val_accuracy": None,
        }
        if run.eval_every and (t % run.eval_every == 0 or t == run.total_steps or diverged):
            row["val_loss"], row["val_accuracy"] = log.evaluate()
        log.add(row)
        if diverged:
            break
    summary = _summary(run, c, log, steps=t, wall=wall, diverged=diverged)
    params = {q: v.detach().clone() for q, v in run.stepper.state_by_qual().items()}
    return TrainResult(log.history, summary, params)


def _summary(
    run: _Run, c: TrainConfig, log: _Log, *, steps: int, wall: float, diverged: bool
) -> dict[str, Any]:
    history = log.history
    evals = [r for r in history if r["val_loss"] is not None]
    ch, h, w = run.data.image_shape
    fgd = c.method == "fgd"
    return {
        "model": run.name,
        "method": c.method,
        "runtime": c.runtime if c.method != "torch" else "torch",
        "provider": run.provider,
        "optimizer": c.optimizer,
        "lr": c.learning_rate,
        "lr_decay": c.lr_decay,
        "batch": c.batch,
        "steps": steps,
        "epochs": steps / run.steps_per_epoch,
        "steps_per_epoch": run.steps_per_epoch,
        "directions": c.directions if fgd else None,
        "distribution": c.distribution if fgd else None,
        "orthogonal": c.orthogonal if fgd else None,
        "perturb": c.perturb if fgd else None,
        "local_losses": c.local_losses if fgd else None,
        "seed": c.seed,
        "dataset": run.data.name,
        "train_size": len(run.data.y_train),
        "val_size": len(run.data.y_val),
        "image_shape": [ch, h, w],
        "ctor_kwargs": run.ctor_kwargs,
        "params": run.params,
        "initial_val_loss": evals[0]["val_loss"] if evals else None,
        "initial_val_accuracy": evals[0]["val_accuracy"] if evals else None,
        "final_val_loss": evals[-1]["val_loss"] if len(evals) > 1 else None,
        "final_val_accuracy": evals[-1]["val_accuracy"] if len(evals) > 1 else None,
        "best_val_accuracy": max((r["val_accuracy"] for r in evals[1:]), default=None),
        "final_train_loss": history[-1]["train_loss"],
        "diverged": diverged,
        "train_wall_s": wall,
        "seconds_per_step": wall / steps if steps else None,
        "steps_per_s": steps / wall if wall else None,
        "setup_s": run.setup_s,
        "eval_s": log.eval_s,
        "flops_per_step": run.flops_per_step,
        "torch_threads": torch.get_num_threads(),
        "world_size": run.ranks.world,
    }
