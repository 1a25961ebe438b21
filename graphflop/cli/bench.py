"""``graphflop bench``: forward, train step and forward-gradient step timed on ONNX Runtime and
in eager PyTorch (:mod:`graphflop.runtime.bench`), with Rf, Rb and achieved FLOP/s."""

from __future__ import annotations

import argparse

from rich.console import Console

from graphflop.cli.common import (
    OPTIMIZER_CHOICES,
    add_model_args,
    analyze_model,
    check_output_file,
    forward_only_options,
    load_model,
    load_real_model,
    stdout_console,
)


def add_parser(sub) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to ``graphflop``'s subparsers."""
    p = sub.add_parser(
        "bench",
        help="time forward, train step and forward-gradient step (Rf, Rb)",
        description="Time the forward pass, the backprop train step and the forward-gradient "
        "step on ONNX Runtime (graphflop's exported graphs) and/or in eager PyTorch "
        "(autograd, torch.func.jvp); report Rf, Rb, Rf/Rb and achieved FLOP/s.",
    )
    add_model_args(p)
    p.add_argument(
        "--runtime",
        default="both",
        choices=["onnxruntime", "torch", "both"],
        help="where to time the steps: ONNX Runtime, eager PyTorch, or both (default both)",
    )
    p.add_argument(
        "--device",
        default=None,
        choices=["cpu", "cuda"],
        help="default: CUDA when ONNX Runtime's CUDA provider or torch CUDA works",
    )
    p.add_argument(
        "--optimizer",
        default="sgd",
        choices=OPTIMIZER_CHOICES,
        help="optimizer whose update graph is built (default sgd)",
    )
    p.add_argument("--warmup", type=int, default=3, help="untimed runs per phase (default 3)")
    p.add_argument("--repeat", type=int, default=20, help="timed runs per phase (default 20)")
    p.add_argument(
        "--rotate", type=int, default=3, help="distinct input sets cycled through (default 3)"
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="ONNX Runtime per-node times mapped to graphflop nodes and modules",
    )
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    return p


def _check(args: argparse.Namespace) -> None:
    """The option checks made before any work (ranges, the output path)."""
    from graphflop.load import SpecError

    if args.repeat < 1 or args.rotate < 1 or args.warmup < 0:
        raise SpecError("--repeat and --rotate must be positive, --warmup not negative")
    check_output_file(args.json, "--json")


def run(args: argparse.Namespace, err: Console) -> int:
    """Analyse, time the chosen runtimes, print the table (and profile), write ``--json``."""
    import json

    from graphflop.io import atomic_write
    from graphflop.load import parse_dtype
    from graphflop.runtime.bench import (
        bench_onnxruntime,
        bench_torch,
        check_memory,
        low_precision_on_cpu,
        method_note,
        phase_flops,
        pick_devices,
        timing_report,
        trainable,
    )

    _check(args)
    loaded, inputs = load_model(args)
    forward_only_options(args, loaded, inputs, err, why="bench (it times the train step)")
    trainable(loaded.model)
    provider, device = pick_devices(args.device)
    if args.runtime != "torch":
        low_precision_on_cpu(parse_dtype(args.dtype) if args.dtype else None, provider)
    with err.status("analysing", spinner="dots") as status:
        analysis = analyze_model(args, loaded, inputs, status)
    check_memory(analysis, args.rotate, device)  # before any tensor of the batch size exists
    real = load_real_model(args, dtype=True)
    flops = phase_flops(analysis)
    results: dict = {
        "model": loaded.name,
        "device": device,
        "flops": flops,
        "method": method_note(warmup=args.warmup, repeat=args.repeat, rotate=args.rotate),
        "runtimes": {},
    }
    kw = dict(warmup=args.warmup, repeat=args.repeat, rotate=args.rotate)
    if args.runtime in ("onnxruntime", "both"):
        with err.status(f"timing on ONNX Runtime ({provider})", spinner="dots"):
            t, prof = bench_onnxruntime(
                analysis, real.model, provider=provider, profile=args.profile, **kw
            )
        results["runtimes"]["onnxruntime"] = {
            "provider": provider,
            **timing_report(t, flops),
            **({"profile": prof} if prof else {}),
        }
    if args.runtime in ("torch", "both"):
        with err.status(f"timing eager PyTorch ({device})", spinner="dots"):
            t = bench_torch(analysis, real.model, device=device, optimizer=args.optimizer, **kw)
        results["runtimes"]["torch"] = {"device": device, **timing_report(t, flops)}
    if args.json:
        atomic_write(args.json, json.dumps(results, indent=2))
    _print_times(results)
    _print_profile(results["runtimes"].get("onnxruntime", {}).get("profile"))
    return 0


def _print_times(results: dict) -> None:
    from rich.table import Table

    from graphflop.export.report import human
    from graphflop.runtime.bench import PHASES

    table = Table(title=f"{results['model']} — median wall time per step ({results['device']})")
    for col in ("runtime", *PHASES, "Rf", "Rb", "Rf/Rb"):
        table.add_column(col, justify="right" if col != "runtime" else "left")
    for rt, doc in results["runtimes"].items():
        label = f"{rt} ({doc.get('provider', doc.get('device'))})"
        cells = [
            f"{doc['phases'][p]['median_s'] * 1e3:.2f} ms\n"
            f"{human(doc['phases'][p]['flops_per_s'], 'FLOP/s')}"
            if p in doc["phases"]
            else "–"
            for p in PHASES
        ]
        r = doc["ratios"]
        cells += [f"{r[k]:.2f}" if r[k] is not None else "–" for k in ("Rf", "Rb", "Rf_over_Rb")]
        table.add_row(label, *cells)
    stdout_console().print(table)


def _print_profile(prof: dict | None) -> None:
    from rich.table import Table

    from graphflop.export.report import human

    for kind, p in (prof or {}).items():
        t2 = Table(title=f"ONNX Runtime profile: {kind}, most expensive nodes")
        for col in ("node", "op", "module", "role", "time", "FLOPs", "bytes"):
            t2.add_column(col)
        for n in p["top_nodes"][:10]:
            t2.add_row(
                n["onnx_node"],
                str(n["op_type"]),
                str(n["module"]),
                str(n["role"]),
                f"{n['seconds'] * 1e3:.3f} ms",
                human(n["flops"]),
                human(n["bytes"], "B"),
            )
        stdout_console().print(t2)
