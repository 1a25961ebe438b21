"""``graphflop export``: the forward, backward, train-step and forward-gradient-step graphs as
ONNX models with ``manifest.json``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console

from graphflop.cli.common import (
    OPTIMIZER_CHOICES,
    add_model_args,
    analyze_model,
    check_backward_possible,
    check_export_dir,
    check_output_dir,
    load_model,
    print_warnings,
)


def add_parser(sub) -> argparse.ArgumentParser:
    """Add the ``export`` subcommand to ``graphflop``'s subparsers."""
    p = sub.add_parser(
        "export",
        help="write forward, backward, train-step and forward-gradient-step ONNX models",
        description="Export SPEC's graphs to ONNX (parameters are inputs; no weights are "
        "stored), checked with onnx.checker, plus manifest.json mapping every ONNX "
        "node to the graphflop node, module and role it came from.",
    )
    add_model_args(
        p,
        outline_note=". The ONNX models are then flat, as with --flat: no block is a local "
        "function, since none was outlined",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="output folder")
    p.add_argument(
        "--optimizer",
        default="sgd",
        choices=OPTIMIZER_CHOICES,
        help="optimizer whose update graph is built (default sgd)",
    )
    p.add_argument(
        "--allow-incomplete",
        action="store_true",
        help="export even when ops without derivative rules cut the backward or JVP short "
        "(their gradients are then missing or zero): manifest.json lists those ops under "
        "'incomplete'. Without it such a model is refused",
    )
    p.add_argument(
        "--flat",
        action="store_true",
        help="write every block's nodes inline. By default each repeated block (a module "
        "structure the model repeats, e.g. a transformer layer) is written once as an ONNX "
        "local function that the graph calls per block; manifest.json still lists every node, "
        "each folded one with the call that computes it. --no-outline also writes them flat "
        "(no block was outlined), --flat keeps the analysis's outlining",
    )
    p.add_argument(
        "--residuals",
        action="store_true",
        help="forward.onnx also outputs the values backward.onnx reads (saved.<node>), so "
        "forward then backward on ONNX Runtime give the train step's gradients; a backward "
        "input named saved.<name> that forward.onnx does not output (a parameter such as "
        "saved.h.0.ln_1.weight, saved.input_0) is forward.onnx's input <name>",
    )
    return p


def run(args: argparse.Namespace, err: Console) -> int:
    """Analyse, export the step graphs into ``--out`` and list the files written."""
    from graphflop.export.onnx import export_all
    from graphflop.load import SpecError
    from graphflop.runtime.graphs import step_graphs

    check_output_dir(args.out, "--out")
    check_export_dir(args.out, "--out")
    loaded, inputs = load_model(args)
    check_backward_possible(args, loaded, inputs)
    with err.status("analysing", spinner="dots") as status:
        analysis = analyze_model(args, loaded, inputs, status, err=err)
        cut = analysis.report.derivative_gaps
        if cut and not args.allow_incomplete:
            raise SpecError(_cut_message(cut))
        print_warnings(err, analysis)
        status.update("exporting to ONNX")
        graphs = step_graphs(analysis, residuals=args.residuals)
        extra = {"incomplete": [u.to_dict() for u in cut]} if cut else None
        manifest = export_all(
            graphs, args.out, name=analysis.name, extra=extra, functions=not args.flat
        )
    out = Path(args.out)  # "onnx/" prints onnx/forward.onnx, not onnx//forward.onnx
    for line in [*_cpu_kernel_notes(args, out, manifest), *_unknown_constant_notes(manifest)]:
        err.print(line, markup=False, highlight=False, soft_wrap=True)
    for g in manifest["graphs"].values():
        print(
            f"{out / g['file']}: {len(g['nodes'])} nodes{_folded(g)}, {len(g['inputs'])} "
            f"inputs, {len(g['outputs'])} outputs"
        )
    print(out / "manifest.json")
    return 0


def _cpu_kernel_notes(args: argparse.Namespace, out: Path, manifest: dict) -> list[str]:
    """A note per written graph that ONNX Runtime's CPU provider cannot run in ``--dtype``
    float16 or bfloat16 (:func:`graphflop.runtime.onnxrt.cpu_kernel_gap`: the kernels ``bench``
    and ``train --runtime onnxruntime`` would miss); onnx.checker passes such a graph."""
    from graphflop.load import parse_dtype

    dtype = str(parse_dtype(args.dtype)).removeprefix("torch.") if args.dtype else "float32"
    if dtype not in ("float16", "bfloat16"):
        return []
    from graphflop.runtime.onnxrt import cpu_kernel_gap

    notes = []
    for g in manifest["graphs"].values():
        what = cpu_kernel_gap(out / g["file"], dtype)
        if what:
            notes.append(
                f"note: ONNX Runtime's CPU provider cannot run {out / g['file']}: it has no "
                f"{dtype} kernel for {what}; run it on another provider (CUDA), or export with "
                "--dtype float32"
            )
    return notes


def _unknown_constant_notes(manifest: dict) -> list[str]:
    """One note for the constants the model made in its forward whose values are not known
    (the model was on the meta device): the files take them as inputs, listed in the
    manifest under ``unknown_constants``; every other constant is in the files."""
    names = sorted({n for g in manifest["graphs"].values() for n in g.get("unknown_constants", [])})
    if not names:
        return []
    return [
        f"note: the value of the constant{'s' if len(names) > 1 else ''} {', '.join(names)} "
        "the model makes in its forward is not known (made on the meta device), so the ONNX "
        "files take it as an input (manifest.json: unknown_constants); feed its value, or "
        "export the model with real weights"
    ]


def _cut_message(cut: Any) -> str:
    """What export refuses for ops without a JVP or transpose rule (``report.derivative_gaps``):
    which graphs stop there and what to do. An op without a JVP rule cuts the backward too (it
    is the JVP transposed), except a custom autograd.Function, whose own backward is the
    transpose: one without ``jvp`` cuts the JVP graph only."""
    from graphflop.meta import FUNCTION_LABEL

    ops = ", ".join(u.op for u in cut)
    functions = [u.op.removeprefix(FUNCTION_LABEL) for u in cut if u.op.startswith(FUNCTION_LABEL)]
    jvp_only = len(functions) == len(cut) and all(set(u.missing) == {"jvp"} for u in cut)
    if jvp_only:
        names = ", ".join(functions)
        return (
            f"the JVP graph stops at {ops} (custom autograd.Function {names} without a jvp "
            "staticmethod): the exported JVP's and forward-gradient step's tangents would be "
            "missing or zero (the backward is complete); give --allow-incomplete to export "
            f"them anyway (listed in manifest.json), or give {names} a jvp"
        )
    return (
        f"the backward and JVP graphs stop at {ops} (no derivative rule): the exported "
        "gradients would be missing or zero; give --allow-incomplete to export them anyway "
        "(listed in manifest.json), or --strict with inspect to find the rule's file"
    )


def _folded(g: dict) -> str:
    """`` (N in the file: K in the graph, L in F functions)`` for a graph whose blocks were
    folded into local functions (the manifest's counts), else empty."""
    fold = g.get("functions", {})
    if not fold.get("functions"):
        return ""
    top, bodies = fold["graph_nodes"], fold["function_nodes"]
    inside = sum(bodies.values())
    return (
        f" ({top + inside:,} in the file: {top:,} in the graph, {inside:,} in "
        f"{len(bodies)} functions)"
    )
