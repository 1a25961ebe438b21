"""``graphflop render``: the forward, backward, JVP or train graph drawn with Graphviz."""

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
    print_warnings,
)


def add_parser(sub) -> argparse.ArgumentParser:
    """Add the ``render`` subcommand to ``graphflop``'s subparsers."""
    p = sub.add_parser(
        "render",
        help="draw the forward, backward, JVP or train graph with Graphviz",
        description="Render SPEC's graphs with FLOPs, bytes, roles, pruned work (ghosts) and "
        "residual edges drawn on them. The format follows the output suffix (.svg, "
        ".png, .pdf, .html, or .dot for the Graphviz source).",
    )
    add_model_args(p)
    p.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="PATH",
        help="output file: .svg (with tooltips), .png, .pdf, .html (the SVG with a search "
        "box) or .dot",
    )
    p.add_argument(
        "--graph",
        default=None,
        choices=["forward", "backward", "jvp", "train", "all"],
        help="which graphs to draw (default train: forward, backward and update; forward for "
        "a model whose output has no floating-point tensor)",
    )
    p.add_argument(
        "--level",
        default="auto",
        choices=["auto", "op", "module"],
        help="one node per op, or one box per module, repeated identical blocks drawn once "
        "(auto: op level up to a few hundred nodes, or with --module; a picture at op level "
        "holds at most 5,000 op nodes, a .dot file any number)",
    )
    p.add_argument(
        "--module",
        metavar="PATH",
        type=_module_path,
        help="draw only this module (e.g. h.0 or layer3.1), at op level unless --level module",
    )
    p.add_argument(
        "--optimizer",
        default="sgd",
        choices=OPTIMIZER_CHOICES,
        help="optimizer whose update graph is built (default sgd)",
    )
    p.add_argument(
        "--device",
        metavar="NAME|FILE.json",
        default=None,
        help="predict each node's time on this device (a data-sheet device, cpu, or a "
        "'graphflop calibrate' file): shown in op labels; with --color time it fills the boxes",
    )
    p.add_argument(
        "--color",
        choices=["flops", "time"],
        default="flops",
        help="what fills the op boxes: FLOPs (default) or predicted time on --device (op "
        "level), each on a log scale with a legend",
    )
    p.add_argument(
        "--profile-json",
        metavar="PATH",
        help="measured times per module: the JSON of graphflop bench --profile --json",
    )
    return p


def _module_path(text: str) -> str:
    """``--module``'s value: a non-empty dotted path (an empty one would draw the whole model,
    which is what leaving the option out does)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            "an empty module path: give a module such as h.0, or leave --module out to draw "
            "the whole model"
        )
    return text.strip()


def _read_profile(path: str | None) -> dict | None:
    import json
    from pathlib import Path

    from graphflop.export.graphviz import RenderError, load_profile

    if not path:
        return None
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise RenderError(f"cannot read --profile-json {path}: {e}") from e
    try:
        load_profile(data)  # its form, before any work (the picture picks its phase later)
    except RenderError as e:
        raise RenderError(f"--profile-json {path}: {e}") from e
    return data


def _first_name(model, path: str) -> str | None:
    """The first name of the module registered as ``path`` when ``path`` is a later name of
    it (``blocks.1`` where ``blocks.0`` and ``blocks.1`` are one module object, or a submodule
    of such a name); None otherwise. Traced ops carry a module's first name only."""
    first: dict[int, str] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        first.setdefault(id(m), name)
        if name == path:
            return None if first[id(m)] == path else first[id(m)]
    return None


def run(args: argparse.Namespace, err: Console) -> int:
    """Analyse and render into ``--output``; prints the path written."""
    from graphflop.export.graphviz import FORMATS, render

    check_output_file(args.output, "--output", sorted(FORMATS))
    check_distinct_outputs({"--output": args.output}, args.spec)
    profile = _read_profile(args.profile_json)
    time_profile = None
    if args.color == "time" and args.device is None:
        from graphflop.load import SpecError

        raise SpecError("--color time fills boxes with predicted time: add --device NAME|FILE")
    if args.device is not None:  # a bad device or profile file: one line, before any work
        from graphflop.passes.time_profile import resolve_profile

        time_profile = resolve_profile(args.device)
    if args.color == "time" and args.level == "module":
        from graphflop.load import SpecError

        raise SpecError("--color time is drawn at op level: use --level op (or auto)")
    loaded, inputs = load_model(args)
    module = args.module
    first = _first_name(loaded.model, module) if module else None
    if first is not None:
        err.print(
            f"note: {module} is the same module object as {first} (one module registered "
            f"under both names); its ops carry the first name, so {first} is drawn, every "
            "call of it",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        module = first
    explicit = args.graph not in (None, "forward")
    why = f"--graph {args.graph}" if explicit else None
    check_backward_possible(args, loaded, inputs, why=why)
    with err.status("analysing", spinner="dots") as status:
        options = None
        if time_profile is not None:
            from graphflop.analysis import AnalyzeOptions

            options = AnalyzeOptions(time_profile=time_profile)
        analysis = analyze_model(args, loaded, inputs, status, err=err, why=why, options=options)
        graph = "forward" if analysis.report.loss == "none" else (args.graph or "train")
        print_warnings(err, analysis)
        status.update("rendering")
        render(
            analysis,
            args.output,
            graph=graph,
            level=args.level,
            profile=profile,
            module=module,
            color=args.color,
        )
    print(args.output)
    return 0
