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
    p.add_argument("--directions", type=int, default=1, metavar="K",
                   help="directions averaged per forward-gradient step (default 1)")
    p.add_argument("--direction", default="normal", choices=["normal", "rademacher"],
                   help="distribution of forward-gradient directions (default normal)")
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
        help="run the generated graphs on random tensors and compare gradients and "
        "tangents with torch.func (exit 1 if the error exceeds the tolerance)",
    )
    p.add_argument(
        "--verify-dtype",
        default="float64",
        choices=["float32", "float64"],
        help="dtype of the --verify run (default float64; float32 uses a 1e-4 "
        "tolerance too, and ill-conditioned models may exceed it)",
    )
    p.add_argument("--verify-samples", type=int, default=100, metavar="M",
                   help="forward-gradient steps (float32) averaged by the --verify unbiasedness "
                        "check, whose 4-sigma tolerance is 4*sqrt(2/M) (0 skips it; default 100)")
    p.add_argument("--max-layers", type=int, default=60, help="rows shown in the table")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    err = Console(stderr=True)
    from graphflop.load import SpecError
    from graphflop.ops import MissingRuleError
    from graphflop.trace import TraceError

    try:
        if args.command == "inspect":
            return _inspect(args, err)
    except (SpecError, TraceError, MissingRuleError) as e:
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
    from graphflop.export.report import layers_csv, print_report, to_json, write_atomic
    from graphflop.passes.pipeline import analyze

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

        with err.status("verifying against torch.func", spinner="dots"):
            real = load(args.spec, ctor_kwargs=_ctor_kwargs(args.arg))  # real weights
            real.model.train(not args.eval)
            checks = verify_analysis(real, inputs, analysis, dtype=args.verify_dtype,
                                     forward_gradient_samples=args.verify_samples)
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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
