"""``graphflop bench``: forward, train step and forward-gradient step timed in eager PyTorch,
as graphflop's graphs run in PyTorch and on ONNX Runtime (:mod:`graphflop.runtime.bench`), with
Rf, Rb, their quartiles and achieved FLOP/s."""

from __future__ import annotations

import argparse

from rich.console import Console

from graphflop.cli.common import (
    OPTIMIZER_CHOICES,
    add_model_args,
    analyze_model,
    check_backward_possible,
    check_distinct_outputs,
    check_output_file,
    load_model,
    load_real_model,
    print_warnings,
    stdout_console,
)


def add_parser(sub) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to ``graphflop``'s subparsers."""
    p = sub.add_parser(
        "bench",
        help="time forward, train step and forward-gradient step (Rf, Rb)",
        description="Time the forward pass, the backprop train step and the forward-gradient "
        "step (direction sampled inside the step) in eager PyTorch (autograd, torch.func.jvp), "
        "as graphflop's own graphs run in PyTorch (graph_torch) and on ONNX Runtime; rounds "
        "alternate between the phases; report medians and quartiles, Rf, Rb, Rf/Rb and "
        "achieved FLOP/s, and warn when a phase's quartiles span more than 20% of its median.",
    )
    add_model_args(p)
    p.add_argument(
        "--runtime",
        default="all",
        choices=["all", "torch", "graph_torch", "onnxruntime", "both"],
        help="where to time the steps: eager PyTorch (torch), graphflop's graphs in PyTorch "
        "(graph_torch), graphflop's graphs on ONNX Runtime (onnxruntime), both = onnxruntime "
        "and torch, all = the three (default all)",
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
    p.add_argument(
        "--repeat", type=int, default=20, help="timed rounds, one run per phase each (default 20)"
    )
    p.add_argument(
        "--rotate", type=int, default=3, help="distinct input sets cycled through (default 3)"
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="ONNX Runtime per-node times mapped to graphflop nodes and modules (ONNX "
        "Runtime's profile files are kept under --out DIR/profile when --out is given)",
    )
    p.add_argument(
        "--out",
        metavar="DIR",
        help="keep the ONNX files (DIR/onnx) and ONNX Runtime's profiles (DIR/profile)",
    )
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    return p


def _check(args: argparse.Namespace) -> None:
    """The option checks made before any work (ranges, the output path)."""
    from graphflop.load import SpecError

    if args.repeat < 1 or args.rotate < 1 or args.warmup < 0:
        raise SpecError("--repeat and --rotate must be positive, --warmup not negative")
    if "onnxruntime" not in _CHOSEN[args.runtime]:
        # both options serve ONNX Runtime only: the other runtimes would ignore them
        for option, given, what in (
            ("--profile", args.profile, "profiles ONNX Runtime's nodes"),
            ("--out", args.out is not None, "keeps ONNX Runtime's files"),
        ):
            if given:
                raise SpecError(
                    f"{option} {what}, and --runtime {args.runtime} does not run ONNX Runtime: "
                    f"use --runtime onnxruntime, both or all, or drop {option}"
                )
    check_output_file(args.json, "--json")
    check_distinct_outputs({"--json": args.json}, args.spec)
    if args.out is not None:
        import os

        from graphflop.cli.common import check_export_dir, check_output_dir

        check_output_dir(args.out, "--out")
        check_export_dir(os.path.join(args.out, "onnx"), "--out")
        if args.json:
            # bench writes DIR/onnx and DIR/profile: --json must be none of them (nor DIR)
            out = os.path.realpath(args.out)
            js = os.path.realpath(args.json)
            taken = [out, os.path.join(out, "onnx"), os.path.join(out, "profile")]
            if js in taken or any(js.startswith(t + os.sep) for t in taken[1:]):
                raise SpecError(
                    f"--json {args.json} is where --out {args.out} keeps its folders (DIR, "
                    "DIR/onnx, DIR/profile): give the JSON another path, e.g. DIR/bench.json"
                )


def run(args: argparse.Namespace, err: Console) -> int:
    """Analyse, time the chosen runtimes, print the table (and profile), write ``--json``."""
    import json

    from graphflop.io import atomic_write
    from graphflop.load import parse_dtype
    from graphflop.runtime.bench import (
        check_memory,
        low_precision_on_cpu,
        method_note,
        phase_flops,
        pick_devices,
        trainable,
    )

    _check(args)
    loaded, inputs = load_model(args)
    why = "bench (it times the train step)"
    check_backward_possible(args, loaded, inputs, why=why)
    trainable(loaded.model)
    provider, device = pick_devices(args.device, _CHOSEN[args.runtime])
    if args.runtime != "torch":
        low_precision_on_cpu(parse_dtype(args.dtype) if args.dtype else None, provider)
    with err.status("analysing", spinner="dots") as status:
        analysis = analyze_model(args, loaded, inputs, status, err=err, why=why)
    print_warnings(err, analysis)  # an incomplete backward is timed as it is
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
    results["runtimes"] = _time_runtimes(args, analysis, real.model, provider, device, flops, err)
    if args.json:
        atomic_write(args.json, json.dumps(results, indent=2))
    _print_times(results)
    _print_profile(results["runtimes"].get("onnxruntime", {}).get("profile"))
    return 0


#: --runtime → the runtimes timed, in the order reported
_CHOSEN = {
    "all": ("torch", "graph_torch", "onnxruntime"),
    "both": ("torch", "onnxruntime"),
    "torch": ("torch",),
    "graph_torch": ("graph_torch",),
    "onnxruntime": ("onnxruntime",),
}


def _time_runtimes(args, analysis, model, provider: str, device: str, flops, err) -> dict:
    """Time the runtimes ``--runtime`` names; their ``runtimes`` JSON; noisy phases warned."""
    from graphflop.runtime.attention import has_fused_rnn
    from graphflop.runtime.bench import (
        bench_graph_torch,
        bench_onnxruntime,
        bench_torch,
        timing_report,
    )
    from graphflop.runtime.timing import noisy_phases

    kw = dict(warmup=args.warmup, repeat=args.repeat, rotate=args.rotate)
    out: dict = {}
    timings = {}
    for rt in _CHOSEN[args.runtime]:
        where = provider if rt == "onnxruntime" else device
        with err.status(f"timing {rt} ({where})", spinner="dots"):
            if rt == "onnxruntime":
                peaks: dict = {}
                t, prof = bench_onnxruntime(
                    analysis,
                    model,
                    provider=provider,
                    profile=args.profile,
                    export_dir=args.out,
                    peaks=peaks,
                    **kw,
                )
                out[rt] = {"provider": provider, **timing_report(t, flops, rt, peaks)}
                if prof:
                    out[rt]["profile"] = prof
            elif rt == "graph_torch":
                t = bench_graph_torch(analysis, model, device=device, **kw)
                out[rt] = {"device": device, **timing_report(t, flops, rt)}
            else:
                t = bench_torch(analysis, model, device=device, optimizer=args.optimizer, **kw)
                out[rt] = {"device": device, **timing_report(t, flops, rt)}
                if has_fused_rnn(model):
                    fused = "cuDNN" if device == "cuda" else "oneDNN"
                    out[rt]["rnn_note"] = (
                        f"the forward-gradient step ran the RNN layers on PyTorch's native "
                        f"kernels ({fused}'s fused kernel has no forward-mode derivative), the "
                        f"forward and train step on {fused}'s: Rf compares different kernels"
                    )
                    err.print(f"warning: torch runtime: {out[rt]['rnn_note']}", soft_wrap=True)
                skipped = (
                    analysis.report.totals.jvp.skipped_flops if analysis.report.totals.jvp else 0
                )
                if skipped:
                    out[rt]["jvp_note"] = (
                        "torch.func.jvp also multiplies the model input's zero tangent in the "
                        f"first layer: {skipped:,} FLOPs graphflop skips (jvp.skipped_flops)"
                    )
        timings[rt] = t
    for line in noisy_phases(timings):
        err.print(f"warning: {line}", soft_wrap=True)
    return out


def _print_times(results: dict) -> None:
    """The table: per runtime and phase the median (quartiles) and FLOP/s (ONNX Runtime: its
    measured peak and, in parentheses, graphflop's for the order it ran); Rf, Rb and Rf/Rb
    the median (quartiles) of the per-round ratios (``round_ratios``; each round runs the
    phases back to back), as docs/seed-b/bench.md reports them."""
    from rich.table import Table

    from graphflop.export.report import human
    from graphflop.runtime.bench import PHASES

    table = Table(
        title=f"{results['model']} — median (quartiles) wall time per step ({results['device']})",
        caption="Rf, Rb, Rf/Rb: median (quartiles) of the per-round ratios",
    )
    for col in ("runtime", *PHASES, "Rf", "Rb", "Rf/Rb"):
        table.add_column(col, justify="right" if col != "runtime" else "left")
    for rt, doc in results["runtimes"].items():
        label = f"{rt} ({doc.get('provider', doc.get('device'))})"
        cells = [_phase_cell(doc["phases"].get(p), human) for p in PHASES]
        rr = doc.get("round_ratios") or {}
        cells += [_ratio_cell(rr.get(k)) for k in ("Rf", "Rb", "Rf_over_Rb")]
        table.add_row(label, *cells)
    stdout_console().print(table)


def _phase_cell(ph: dict | None, human) -> str:
    if ph is None:
        return "–"
    peak = ""
    if ph.get("peak_bytes") is not None:  # ONNX Runtime's measured peak, graphflop's for its order
        peak = f"\npeak {human(ph['peak_bytes'], 'B')} ({human(ph['predicted_peak_bytes'], 'B')})"
    return (
        f"{ph['median_s'] * 1e3:.3g} ms{' (noisy)' if ph.get('noisy') else ''}\n"
        f"({ph['q1_s'] * 1e3:.3g}–{ph['q3_s'] * 1e3:.3g})\n"
        f"{human(ph['flops_per_s'], 'FLOP/s')}{peak}"
    )


def _ratio_cell(r: dict | None) -> str:
    """A per-round ratio's ``{median, q1, q3}`` as ``median\n(q1–q3)``; "–" without one."""
    if not r:
        return "–"
    return f"{r['median']:.2f}\n({r['q1']:.2f}–{r['q3']:.2f})"


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
