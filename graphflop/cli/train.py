"""``graphflop train``: the command-line front end of :func:`graphflop.train.loop.train`.

:func:`add_parser` adds the ``train`` subcommand, :func:`run` runs it: the options become a
:class:`~graphflop.train.config.TrainConfig` (checked there), and errors a user can fix (bad
data, options, spec, untraceable model) are one line on stderr and exit status 2
(:func:`graphflop.cli.common.run_command`). ``python -m graphflop.cli.train SPEC ...`` works on
its own too.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rich.console import Console

from graphflop.cli.common import OneLineParser, add_debug_arg, parse_ctor_kwargs, run_command
from graphflop.passes.optimizer import OPTIMIZERS

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``train`` options (on an existing parser)."""
    from graphflop.train.config import DEFAULT_EPOCHS, DEFAULT_LR, DEFAULT_OPTIMIZER, METHODS

    p.add_argument(
        "spec",
        help="model: path/to/file.py[:Name] or package.module:attr; built with "
        "in_features= (or in_channels=/image_size=) for the data set",
    )
    p.add_argument(
        "--method",
        default="backprop",
        choices=METHODS,
        help="fgd: graphflop's forward-gradient step graph; backprop: graphflop's "
        "train-step graph; torch: plain autograd + torch.optim (default backprop)",
    )
    p.add_argument(
        "--runtime",
        default="torch",
        choices=["torch", "onnxruntime"],
        help="run the step graph in PyTorch (default) or export it once to ONNX and "
        "run it on ONNX Runtime (not for --method torch)",
    )
    p.add_argument(
        "--optimizer",
        default=DEFAULT_OPTIMIZER,
        choices=list(OPTIMIZERS),
        help=f"update rule, PyTorch's algorithms (default {DEFAULT_OPTIMIZER})",
    )
    defaults = ", ".join(f"{m} {o} {v:g}" for (m, o), v in DEFAULT_LR.items())
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help=f"learning rate (default per method and optimizer: {defaults})",
    )
    p.add_argument(
        "--lr-decay",
        type=float,
        default=1.0,
        metavar="F",
        help="multiply the learning rate by F after every epoch (default 1: constant)",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=64,
        help="batch size (default 64; the incomplete last batch is dropped)",
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument("--steps", type=int, default=None, help="training steps")
    g.add_argument(
        "--epochs", type=float, default=None, help=f"training epochs (default {DEFAULT_EPOCHS})"
    )
    p.add_argument(
        "--directions",
        type=int,
        default=1,
        metavar="K",
        help="forward-gradient directions averaged per step (fgd; default 1)",
    )
    p.add_argument(
        "--distribution",
        default="normal",
        choices=["normal", "rademacher"],
        help="law of the forward-gradient directions (default normal)",
    )
    p.add_argument(
        "--orthogonal",
        action="store_true",
        help="make a step's K directions orthogonal (Gaussian frame scaled to √n; fgd)",
    )
    p.add_argument(
        "--perturb",
        default="weights",
        choices=["weights", "activations"],
        help="fgd: perturb the weights (Baydin et al. 2022; graphflop's step graph, default) or "
        "the layer outputs, each layer's weight gradient formed locally (Ren et al. 2023; "
        "PyTorch torch.func)",
    )
    p.add_argument(
        "--local-losses",
        action="store_true",
        help="with --perturb activations: each block's activity gradient from its own local "
        "linear-classifier loss (Ren et al. 2023)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="initial weights, batch order and directions (default 0)",
    )
    p.add_argument(
        "--dataset",
        default="digits",
        choices=["digits", "mnist"],
        help="digits: scikit-learn's 8×8 digits, bundled (default); mnist: the IDX "
        "files in --data-dir",
    )
    p.add_argument(
        "--data-dir",
        default=None,
        metavar="DIR",
        help="folder with train-images-idx3-ubyte, train-labels-idx1-ubyte, "
        "t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte (each optionally .gz)",
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=None,
        metavar="N",
        help="validate every N steps (default: once per epoch; 0: never)",
    )
    p.add_argument(
        "--arg",
        action="append",
        metavar="NAME=VALUE",
        help="extra constructor argument for the model (repeatable), e.g. hidden=256",
    )
    p.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="ONNX Runtime execution provider (default cpu); PyTorch runs on the CPU",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for PyTorch and ONNX Runtime (default: PyTorch's)",
    )
    p.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="write DIR/train.csv, DIR/train.png, DIR/summary.json (and DIR/onnx/ "
        "with --runtime onnxruntime)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def add_parser(sub) -> argparse.ArgumentParser:
    """Add the ``train`` sub-command to ``graphflop``'s sub-parsers."""
    p = sub.add_parser(
        "train",
        help="train with graphflop's step graphs (fgd, backprop) or plain PyTorch",
        description="Train SPEC on digits (bundled) or MNIST with graphflop's forward-gradient "
        "step (--method fgd) or train step (--method backprop), executed in PyTorch "
        "or on ONNX Runtime, or with plain PyTorch autograd (--method torch). "
        "Writes a per-step CSV, a loss plot and a JSON summary with --out.",
    )
    add_arguments(p)
    return p


def config_from_args(args: argparse.Namespace):
    """The :class:`~graphflop.train.config.TrainConfig` of parsed ``train`` options.

    Raises:
        TrainError: an option out of range; SpecError: a bad ``--arg``.
    """
    from graphflop.train.config import TrainConfig

    return TrainConfig(
        method=args.method,
        runtime=args.runtime,
        optimizer=args.optimizer,
        lr=args.lr,
        lr_decay=args.lr_decay,
        batch=args.batch,
        steps=args.steps,
        epochs=args.epochs,
        directions=args.directions,
        distribution=args.distribution,
        orthogonal=args.orthogonal,
        perturb=args.perturb,
        local_losses=args.local_losses,
        seed=args.seed,
        eval_every=args.eval_every,
        dataset=args.dataset,
        data_dir=args.data_dir,
        ctor_kwargs=parse_ctor_kwargs(args.arg, example="hidden=256"),
        device=args.device,
        threads=args.threads,
    )


def run(args: argparse.Namespace, err: Console | None = None) -> int:
    """Run ``graphflop train`` for parsed ``args``; returns the exit status (2 and one stderr
    line for an error the user can fix)."""
    return run_command(_train, args, err)


def _train(args: argparse.Namespace, err: Console) -> int:
    from graphflop.train.distributed import env_ranks
    from graphflop.train.loop import train

    config = config_from_args(args)
    leader = env_ranks().leader  # under torchrun, rank 0 alone reports and writes
    with _Progress(err, args, quiet=not leader) as bar:
        result = train(args.spec, None, config, out=args.out, progress=bar.update)
    if not leader:
        return 0
    print(_result_line(result.summary))
    if args.out:
        print(f"{args.out}/train.csv, {args.out}/train.png, {args.out}/summary.json")
    return 0


def _result_line(s: dict) -> str:
    acc, loss = s["final_val_accuracy"], s["final_val_loss"]
    line = (
        f"{s['model']} {s['method']}"
        + (f" ({s['runtime']})" if s["method"] != "torch" else "")
        + f", {s['optimizer']} lr {s['lr']:g}: {s['steps']} steps ({s['epochs']:.1f} epochs) "
        + (f"on {s['world_size']} processes " if s.get("world_size", 1) > 1 else "")
        + f"in {s['train_wall_s']:.1f} s ({s['steps_per_s']:.1f} steps/s)"
    )
    if acc is not None:
        line += f"; validation loss {loss:.4f}, accuracy {acc:.2%}"
    if s["diverged"]:
        line += "; stopped: the loss is not finite (lower --lr)"
    return line


class _Progress:
    """A rich progress bar showing loss, accuracy and steps/s (nothing with --quiet)."""

    def __init__(self, console, args, *, quiet: bool = False):
        self.console, self.quiet = console, args.quiet or quiet
        self.progress: Progress | None = None
        self.task: TaskID | None = None
        self.acc = "–"

    def __enter__(self):
        return self

    def _start(self) -> None:
        """The bar, shown from the first step's row on: a run that fails before it (a bad
        --out, a model whose first backward fails) leaves stderr with its one error line only."""
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self.progress = Progress(
            TextColumn("[bold]training"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("val acc {task.fields[acc]}"),
            TextColumn("{task.fields[rate]} steps/s"),
            TimeElapsedColumn(),
            console=self.console,
            transient=False,
        )
        self.progress.__enter__()

    def update(self, row, info):
        if self.quiet:
            return
        if row["val_accuracy"] is not None:
            self.acc = f"{row['val_accuracy']:.1%}"
        if self.progress is None:
            if row["step"] == 0:
                # the validation before the first step: the bar waits for a step, so an error
                # in the first one (the model's, e.g. eager autograd refusing it) stays the
                # only line
                return
            self._start()
        assert self.progress is not None
        if self.task is None:
            self.task = self.progress.add_task(
                "train", total=info["total_steps"], loss="–", acc="–", rate="–"
            )
        loss = row["train_loss"]
        rate = row["step"] / row["wall_s"] if row["wall_s"] else None
        self.progress.update(
            self.task,
            completed=row["step"],
            loss=f"{loss:.4f}" if loss is not None else "–",
            acc=self.acc,
            rate=f"{rate:.1f}" if rate else "–",
        )

    def __exit__(self, *exc):
        if self.progress is not None:
            self.progress.__exit__(*exc)
        return False


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m graphflop.cli.train SPEC [options]`` (the same as ``graphflop train``)."""
    parser = OneLineParser(
        prog="graphflop train", description="Train SPEC with graphflop's step graphs."
    )
    add_arguments(parser)
    add_debug_arg(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
