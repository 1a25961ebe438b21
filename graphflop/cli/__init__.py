"""``graphflop`` command line: a thin front end over the library (no logic of its own).

Errors the user can fix (bad spec, bad shape, untraceable model, op without a rule) print one
line to stderr and exit with status 2, leaving no partial output file.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Sequence

from rich.console import Console

EXIT_USAGE = 2
EXIT_VERIFY_FAILED = 1
#: --verify's forward-gradient check: default steps, the FLOP budget they may spend (about half
#: a minute on two CPU cores) and the fewest steps worth a statistical check
VERIFY_SAMPLES = 100
VERIFY_FLOPS = 2e12
MIN_VERIFY_SAMPLES = 16


def _ctor_kwargs(items: Sequence[str]) -> dict:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            from graphflop.load import SpecError

            raise SpecError(f"bad --arg {item!r}: write NAME=VALUE, e.g. middle_layers=10")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", help="model: path/to/file.py[:Name] or package.module:attr")
    p.add_argument(
        "--input-shape",
        action="append",
        metavar="N,C,H,W",
        help="shape of one input (repeat once per input); default: the file's example_inputs()",
    )
    p.add_argument(
        "--dtype",
        default=None,
        help="dtype of floating inputs and parameters "
        "(float32, float64, float16, bfloat16); default float32",
    )
    p.add_argument(
        "--batch", type=int, default=None, help="rescale the first dimension of every input to N"
    )
    p.add_argument(
        "--arg",
        action="append",
        metavar="NAME=VALUE",
        help="constructor argument for the model (repeatable), e.g. middle_layers=10",
    )
    p.add_argument(
        "--eval",
        action="store_true",
        help="trace in eval mode (batch norm uses running statistics)",
    )
    p.add_argument(
        "--loss",
        default="auto",
        choices=["auto", "cross_entropy", "mse", "sum"],
        help="loss the backward starts from (default: cross-entropy against random "
        "integer targets for (N, C) logits, sum otherwise)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="graphflop",
        description="Trace a PyTorch model into a core-ATen graph, build its backward and JVP "
        "graphs from one table of per-op rules, and report FLOPs and memory per "
        "node, per layer and in total.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "inspect",
        help="per-layer FLOPs, backward/forward and JVP/forward ratios, memory",
        description="Trace SPEC, build the backward, update and JVP graphs, and print a "
        "per-layer table of FLOPs (1 multiply-add = 2 FLOPs), ratios and memory.",
    )
    _add_model_args(p)
    p.add_argument(
        "--optimizer",
        default="sgd",
        choices=["sgd", "momentum", "adam", "adamw"],
        help="optimizer whose update is counted (default sgd)",
    )
    p.add_argument(
        "--tangents",
        default="params",
        choices=["params", "inputs", "all"],
        help="which values carry tangents in the JVP graph (default params: weight "
        "perturbation, as in forward gradients)",
    )
    p.add_argument(
        "--directions",
        type=int,
        default=1,
        metavar="K",
        help="directions averaged per forward-gradient step (default 1)",
    )
    p.add_argument(
        "--direction",
        default="normal",
        choices=["normal", "rademacher"],
        help="distribution of forward-gradient directions (default normal)",
    )
    p.add_argument("--no-backward", action="store_true", help="forward (and JVP) only")
    p.add_argument("--no-jvp", action="store_true", help="skip the JVP graph")
    p.add_argument("--json", metavar="PATH", help="write the full result as JSON to PATH")
    p.add_argument("--csv", metavar="PATH", help="write the per-layer table as CSV to PATH")
    p.add_argument(
        "--format",
        choices=["table", "json"],
        default="table",
        help="stdout format (json: the same document as --json)",
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="build the model with real weights in --verify-dtype (float64: about 15 GB and 2 "
        "minutes for GPT-2 small at 1024 tokens), run the generated backward and JVP graphs on "
        "random tensors and compare gradients and tangents with torch.func, and check that the "
        "forward-gradient step is unbiased (see --verify-samples); exit 1 if an error exceeds "
        "its tolerance. The verify lines go to stderr",
    )
    p.add_argument(
        "--verify-dtype",
        default="float64",
        choices=["float32", "float64"],
        help="dtype of the --verify run (default float64; float32 uses a 1e-4 "
        "tolerance too, and ill-conditioned models may exceed it)",
    )
    p.add_argument(
        "--verify-samples",
        type=int,
        default=None,
        metavar="M",
        help="forward-gradient steps (float32) averaged by the --verify unbiasedness "
        "check, whose 4-sigma tolerance is 4*sqrt(2/M); 0 skips it. Default: "
        f"{VERIFY_SAMPLES}, or as many as fit in {VERIFY_FLOPS:.0e} FLOPs, and "
        f"none when fewer than {MIN_VERIFY_SAMPLES} fit (a large model)",
    )
    p.add_argument(
        "--max-layers",
        type=int,
        default=60,
        help="rows shown in the table (default 60; --json and --csv have them all)",
    )
    p = sub.add_parser(
        "export",
        help="write forward, backward, train-step and forward-gradient-step ONNX models",
        description="Export SPEC's graphs to ONNX (parameters are inputs; no weights are "
        "stored), checked with onnx.checker, plus manifest.json mapping every ONNX "
        "node to the graphflop node, module and role it came from.",
    )
    _add_model_args(p)
    p.add_argument("--out", required=True, metavar="DIR", help="output folder")
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "momentum", "adam", "adamw"])

    p = sub.add_parser(
        "bench",
        help="time forward, train step and forward-gradient step (Rf, Rb)",
        description="Time the forward pass, the backprop train step and the forward-gradient "
        "step on ONNX Runtime (graphflop's exported graphs) and/or in eager PyTorch "
        "(autograd, torch.func.jvp); report Rf, Rb, Rf/Rb and achieved FLOP/s.",
    )
    _add_model_args(p)
    p.add_argument("--runtime", default="both", choices=["onnxruntime", "torch", "both"])
    p.add_argument(
        "--device",
        default=None,
        choices=["cpu", "cuda"],
        help="default: CUDA when ONNX Runtime's CUDA provider or torch CUDA works",
    )
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "momentum", "adam", "adamw"])
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

    p = sub.add_parser(
        "render",
        help="draw the forward, backward, JVP or train graph with Graphviz",
        description="Render SPEC's graphs with FLOPs, bytes, roles, pruned work (ghosts) and "
        "residual edges drawn on them. The format follows the output suffix (.svg, "
        ".png, .pdf, or .dot for the Graphviz source).",
    )
    _add_model_args(p)
    p.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="PATH",
        help="output file: .svg, .png, .pdf or .dot",
    )
    p.add_argument(
        "--graph",
        default="train",
        choices=["forward", "backward", "jvp", "train", "all"],
        help="which graphs to draw (default train: forward, backward and update)",
    )
    p.add_argument(
        "--level",
        default="auto",
        choices=["auto", "op", "module"],
        help="one node per op, or one box per module (auto: op level up to a few hundred nodes)",
    )
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "momentum", "adam", "adamw"])
    p.add_argument(
        "--profile-json",
        metavar="PATH",
        help="measured times per module: the JSON of graphflop bench --profile --json",
    )

    from graphflop.cli.train import add_parser as add_train_parser

    add_train_parser(sub)

    p = sub.add_parser(
        "sweep",
        help="backward/forward ratio across batch sizes or depths",
        description="The backward/forward FLOP ratio (with and without the update) per batch "
        "size or per depth, as a table, CSV and PNG plot.",
    )
    _add_model_args(p)
    p.add_argument(
        "--batches",
        "--batch-sizes",
        dest="batches",
        metavar="1,2,4,...",
        help="comma-separated batch sizes",
    )
    p.add_argument(
        "--depth",
        metavar="0,10,100",
        help="comma-separated depths (for models whose constructor takes one)",
    )
    p.add_argument(
        "--depth-arg",
        metavar="NAME",
        help="the constructor argument that sets the depth (default: found by name)",
    )
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "momentum", "adam", "adamw"])
    p.add_argument("--csv", metavar="PATH", help="write the table as CSV")
    p.add_argument("--plot", metavar="PATH", help="write a plot (.png, .svg, .pdf)")
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    err = Console(stderr=True)
    from graphflop.export.graphviz import RenderError
    from graphflop.export.onnx import OnnxExportError
    from graphflop.frontend.trace import TraceError
    from graphflop.load import SpecError
    from graphflop.ops import MissingRuleError

    try:
        if args.command == "inspect":
            return _inspect(args, err)
        if args.command == "export":
            return _export(args, err)
        if args.command == "bench":
            return _bench(args, err)
        if args.command == "sweep":
            return _sweep(args, err)
        if args.command == "render":
            return _render(args, err)
        if args.command == "train":
            from graphflop.cli.train import run as run_train

            return run_train(args, err)
    except (SpecError, TraceError, MissingRuleError, OnnxExportError, RenderError) as e:
        print(f"graphflop: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("graphflop: interrupted", file=sys.stderr)
        return 130
    return 0


def _stdout_console() -> Console:
    """Rich console for stdout; wide when stdout is not a terminal so tables don't wrap."""
    return Console() if sys.stdout.isatty() else Console(width=180)


def _one_line(e: BaseException) -> str:
    text = str(e.args[0]) if getattr(e, "args", None) else str(e)
    return " ".join(text.split())


def _load(args):
    import torch

    from graphflop.load import load, make_inputs, parse_dtype, parse_shape

    shapes = [parse_shape(s) for s in args.input_shape] if args.input_shape else None
    dtype = parse_dtype(args.dtype) if args.dtype else None
    loaded = load(args.spec, ctor_kwargs=_ctor_kwargs(args.arg), meta=True)
    if dtype is not None and dtype.is_floating_point:
        loaded.model.to(dtype)
    loaded.model.train(not args.eval)
    inputs = make_inputs(loaded, shapes=shapes, dtype=dtype, batch=args.batch)
    return loaded, inputs, torch


def _inspect(args, err: Console) -> int:
    from graphflop.analysis import analyze
    from graphflop.export.report import layers_csv, print_report, to_json, write_atomic

    loaded, inputs, torch = _load(args)
    with err.status("analysing", spinner="dots") as status:
        analysis = analyze(
            loaded.model,
            inputs,
            name=loaded.name,
            loss=args.loss,
            optimizer=args.optimizer,
            tangents=args.tangents,
            backward=not args.no_backward,
            jvp=not args.no_jvp,
            progress=lambda msg: status.update(msg),
        )
    summary = analysis.to_dict()
    rc = 0
    if args.verify:
        from graphflop.load import load
        from graphflop.runtime.verify import verify_analysis

        samples, why = _verify_samples(args.verify_samples, summary)
        if why:
            err.print(f"verify: {why}")
            summary["verify_note"] = why
        with err.status("verifying against torch.func", spinner="dots"):
            real = load(args.spec, ctor_kwargs=_ctor_kwargs(args.arg))  # real weights
            real.model.train(not args.eval)
            checks = verify_analysis(
                real, inputs, analysis, dtype=args.verify_dtype, forward_gradient_samples=samples
            )
        summary["verify"] = [
            {
                "check": c.name,
                "worst_rel_error": c.worst_rel_error,
                "where": c.where,
                "tolerance": c.tolerance,
                "ok": c.ok,
            }
            for c in checks
        ]
        for c in checks:
            mark = "[green]ok[/green]" if c.ok else "[red]FAILED[/red]"
            err.print(
                f"verify: {c.name}: worst relative error {c.worst_rel_error:.2e} "
                f"({c.where}), tolerance {c.tolerance:.0e}: {mark}"
            )
        if not all(c.ok for c in checks):
            rc = EXIT_VERIFY_FAILED
    if args.json:
        write_atomic(args.json, to_json(summary))
    if args.csv:
        write_atomic(args.csv, layers_csv(summary))
    if args.format == "json":
        print(to_json(summary))
    else:
        print_report(summary, _stdout_console(), max_layers=args.max_layers)
    return rc


def _verify_samples(requested: int | None, summary: dict) -> tuple[int, str]:
    """Forward-gradient steps for --verify's unbiasedness check, and a note when the default
    was cut down or skipped because one step costs too much to repeat on this machine."""
    if requested is not None:
        return requested, ""
    step = summary["totals"].get("forward_gradient_step", {}).get("flops", 0)
    fit = int(VERIFY_FLOPS // step) if step else VERIFY_SAMPLES
    if fit >= VERIFY_SAMPLES:
        return VERIFY_SAMPLES, ""
    if fit >= MIN_VERIFY_SAMPLES:
        return fit, (
            f"forward-gradient check over {fit} steps, not {VERIFY_SAMPLES}: one step "
            f"is {step / 1e9:,.1f} GFLOPs (--verify-samples M sets the number)"
        )
    return 0, (
        f"forward-gradient check skipped: one step is {step / 1e9:,.1f} GFLOPs, too many "
        f"to repeat {MIN_VERIFY_SAMPLES}+ times (--verify-samples M runs it anyway)"
    )


def _export(args, err: Console) -> int:
    from graphflop.analysis import analyze
    from graphflop.export.onnx import export_all

    loaded, inputs, _ = _load(args)
    with err.status("analysing", spinner="dots") as status:
        analysis = analyze(
            loaded.model,
            inputs,
            name=loaded.name,
            loss=args.loss,
            optimizer=args.optimizer,
            progress=lambda m: status.update(m),
        )
        status.update("exporting to ONNX")
        manifest = export_all(analysis, args.out)
    for g in manifest["graphs"].values():
        print(
            f"{args.out}/{g['file']}: {len(g['nodes'])} nodes, {len(g['inputs'])} inputs, "
            f"{len(g['outputs'])} outputs"
        )
    print(f"{args.out}/manifest.json")
    return 0


def _bench(args, err: Console) -> int:
    import torch

    from graphflop.analysis import analyze
    from graphflop.export.report import human, to_json, write_atomic
    from graphflop.load import load
    from graphflop.runtime.bench import PHASES, bench_onnxruntime, bench_torch
    from graphflop.runtime.onnxrt import pick_provider

    loaded, inputs, _ = _load(args)
    real = load(args.spec, ctor_kwargs=_ctor_kwargs(args.arg))
    real.model.train(not args.eval)
    if args.dtype:
        from graphflop.load import parse_dtype

        real.model.to(parse_dtype(args.dtype))
    provider = pick_provider(args.device)
    device = args.device or (
        "cuda" if provider == "CUDAExecutionProvider" or torch.cuda.is_available() else "cpu"
    )
    with err.status("analysing", spinner="dots") as status:
        analysis = analyze(
            loaded.model,
            inputs,
            name=loaded.name,
            loss=args.loss,
            optimizer=args.optimizer,
            progress=lambda m: status.update(m),
        )
    flops = {
        "forward": analysis.summary["totals"]["forward"]["flops"],
        "train_step": analysis.summary["totals"]["train_step"]["flops"],
        "forward_gradient_step": analysis.summary["totals"]["forward_gradient_step"]["flops"],
    }
    results: dict = {
        "model": loaded.name,
        "device": device,
        "flops": flops,
        "method": f"{args.warmup} warm-up runs, then {args.repeat} timed runs "
        f"over {args.rotate} rotating input sets; median and quartiles",
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
            **_timing_doc(t, flops),
            **({"profile": prof} if prof else {}),
        }
    if args.runtime in ("torch", "both"):
        with err.status(f"timing eager PyTorch ({device})", spinner="dots"):
            t = bench_torch(analysis, real.model, device=device, optimizer=args.optimizer, **kw)
        results["runtimes"]["torch"] = {"device": device, **_timing_doc(t, flops)}
    if args.json:
        write_atomic(args.json, to_json(results))
    from rich.table import Table

    table = Table(title=f"{loaded.name} — median wall time per step ({device})")
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
    _stdout_console().print(table)
    prof = results["runtimes"].get("onnxruntime", {}).get("profile")
    if prof:
        for kind, p in prof.items():
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
            _stdout_console().print(t2)
    return 0


def _timing_doc(t: dict, flops: dict) -> dict:
    from graphflop.runtime.bench import ratios

    return {
        "phases": {
            k: {**v.to_dict(), "flops_per_s": flops[k] / v.median_s if v.median_s else None}
            for k, v in t.items()
        },
        "ratios": ratios(t),
    }


def _int_list(text: str | None, what: str) -> list[int]:
    from graphflop.load import SpecError

    if not text:
        return []
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SpecError(
            f"bad {what} list {text!r}: write comma-separated integers, e.g. 1,2,4,8"
        ) from None
    if any(v < 0 for v in values) or (what == "batch" and any(v == 0 for v in values)):
        raise SpecError(f"bad {what} list {text!r}: values must be positive")
    return values


def _sweep(args, err: Console) -> int:
    import csv
    import io
    import json

    from graphflop.export.report import human, write_atomic
    from graphflop.load import SpecError
    from graphflop.sweep import plot, sweep

    batches = _int_list(args.batches, "batch")
    depths = _int_list(args.depth, "depth")
    if not batches and not depths:
        raise SpecError("give --batches 1,2,4,... or --depth 0,10,100")
    with err.status("sweeping", spinner="dots") as status:
        rows = sweep(
            args.spec,
            batches=batches,
            depths=depths,
            depth_name=args.depth_arg,
            optimizer=args.optimizer,
            ctor_kwargs=_ctor_kwargs(args.arg),
            batch=args.batch,
            progress=lambda m: status.update(f"sweeping: {m}"),
        )
    from rich.table import Table

    kind = "batch" if batches else "depth"
    table = Table(title=f"{args.spec}: backward/forward FLOP ratio ({args.optimizer})")
    for col in (kind, "forward", "backward", "update", "(bwd+upd)/fwd", "bwd/fwd"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r.get(kind, r.get("depth"))),
            human(r["forward_flops"]),
            human(r["backward_flops"]),
            human(r["update_flops"]),
            f"{r['ratio']:.3f}",
            f"{r['ratio_no_update']:.3f}",
        )
    _stdout_console().print(table)
    if args.csv:
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
        write_atomic(args.csv, buf.getvalue())
    if args.json:
        write_atomic(args.json, json.dumps(rows, indent=1))
    if args.plot:
        plot(rows, args.plot, title=f"{args.spec.split('/')[-1]} ({args.optimizer})")
    return 0


def _render(args, err: Console) -> int:
    import json
    from pathlib import Path

    from graphflop.analysis import analyze
    from graphflop.export.graphviz import RenderError, render

    profile = None
    if args.profile_json:
        try:
            profile = json.loads(Path(args.profile_json).read_text())
        except (OSError, ValueError) as e:
            raise RenderError(f"cannot read --profile-json {args.profile_json}: {e}") from e
    loaded, inputs, _ = _load(args)
    with err.status("analysing", spinner="dots") as status:
        a = analyze(
            loaded.model,
            inputs,
            name=loaded.name,
            loss=args.loss,
            optimizer=args.optimizer,
            progress=lambda m: status.update(m),
        )
        status.update("rendering")
        render(a, args.output, graph=args.graph, level=args.level, profile=profile)
    print(args.output)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
