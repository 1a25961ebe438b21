"""``graphflop calibrate``: measure what this machine's CPU (or, with ``--device cuda``, its GPU)
achieves in eager PyTorch and write the profile file ``--device FILE.json`` reads
(:mod:`graphflop.runtime.calibrate`, :mod:`graphflop.passes.time_profile`)."""

from __future__ import annotations

import argparse

from rich.console import Console


def add_parser(sub) -> argparse.ArgumentParser:
    """Add the ``calibrate`` subcommand to ``graphflop``'s subparsers."""
    p = sub.add_parser(
        "calibrate",
        help="measure this machine's achieved FLOP/s, bandwidth and per-op overhead into a "
        "profile file for --device",
        description="Measure this machine in eager PyTorch: matrix products and convolutions "
        "at several sizes and dtypes, in-cache elementwise kernels, streaming bandwidth from "
        "in-cache sizes to well beyond the last-level cache, the per-op launch overhead, "
        "torch.optim's steps per parameter and per step (the least of repeated runs), and "
        "each eager kernel kind's fixed cost as it runs in a network, with the caches cold "
        "(the median of single calls), and write them as a "
        "time profile: pass the file to "
        "'graphflop inspect --device FILE.json'. Two to three minutes on a quiet 2-core CPU.",
    )
    p.add_argument(
        "-o",
        "--out",
        required=True,
        metavar="FILE.json",
        help="where to write the profile (JSON)",
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="what to measure (default cpu; cuda: the first GPU, timed with CUDA events)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads while measuring (default: PyTorch's own count); runs that "
        "the profile predicts must use the same count",
    )
    p.add_argument("--name", default=None, help="the profile's name (default cpu-calibrated/cuda)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="small sizes and few repeats (seconds; for tests: its rates can be far off, "
        "under load many-fold)",
    )
    return p


def run(args: argparse.Namespace, err: Console) -> int:
    """Measure, then write the profile atomically; returns 0."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from graphflop.cli.common import check_output_file
    from graphflop.export.report import counted
    from graphflop.io import atomic_write
    from graphflop.load import SpecError
    from graphflop.passes.time_profile import save_profile
    from graphflop.runtime.calibrate import calibrate, plan
    from graphflop.runtime.timing import threads_problem

    check_output_file(args.out, "--out", (".json",))
    if args.name is not None and not args.name.strip():
        raise SpecError("bad --name '': give the profile a name (it labels tables and plots)")
    problem = threads_problem(args.threads)
    if problem:
        raise SpecError(problem)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SpecError("--device cuda: no CUDA device here; calibrate the cpu instead")
    total = plan(args.quick, args.device).steps
    with Progress(
        TextColumn("calibrating"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=err,
        transient=True,
    ) as bar:
        task = bar.add_task("", total=total)
        profile = calibrate(
            args.device,
            quick=args.quick,
            threads=args.threads,
            name=args.name,
            step=lambda label: bar.update(task, advance=1, description=label),
        )
    atomic_write(args.out, save_profile(profile))
    mm = profile.compute["matmul"]["float32"].peak
    bw = profile.bandwidth.points[-1][1]  # beyond the last-level cache
    err.print(
        f"{profile.title}: matmul float32 up to {mm / 1e9:,.1f} GFLOP/s, streaming "
        f"{bw / 1e9:,.1f} GB/s, {profile.launch_overhead_s * 1e6:.1f} µs per op "
        + (f"({profile.fixed_cost('*') * 1e6:.1f} µs in a network) " if profile.fixed else "")
        + (
            f"({counted(profile.threads, 'host thread')}) "
            if profile.kind == "gpu" and profile.threads
            else ""
        )
        + f"— wrote {args.out}",
        markup=False,
        highlight=False,
    )
    if args.quick:  # a tester's quick profile under load was 100× off, with no sign of it
        err.print(
            "note: --quick measures few, small points once each (for tests): its rates can be "
            "far off, under load many-fold; calibrate without --quick for predictions",
            markup=False,
            highlight=False,
        )
    return 0
