"""``graphflop inspect``: per-layer FLOPs, ratios and memory of one analysis, and ``--verify``."""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import TYPE_CHECKING, Any

from rich.console import Console

from graphflop.ad.jvp import TANGENT_CHOICES
from graphflop.analysis import AMP_DTYPES, DEVICES, MEMORY_MODELS, RECOMPUTE_POLICIES
from graphflop.cli.common import (
    EXIT_VERIFY_FAILED,
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
from graphflop.frontend.dispatch import ROUTED_LINE
from graphflop.passes.forward_gradient import DISTRIBUTIONS, MAX_DIRECTIONS
from graphflop.runtime.verify import (
    MAX_VERIFY_FLOPS,
    MAX_VERIFY_SAMPLES,
    MIN_VERIFY_SAMPLES,
    VERIFY_FLOPS,
    VERIFY_SAMPLES,
)

if TYPE_CHECKING:
    from graphflop.analysis import Analysis


#: defaults of the JVP options (given otherwise with --no-jvp: refused) and of --max-layers
JVP_DEFAULTS = {"tangents": "params", "directions": 1, "direction": "normal"}
MAX_LAYERS = 60


def add_parser(sub) -> argparse.ArgumentParser:
    """Add the ``inspect`` subcommand to ``graphflop``'s subparsers."""
    p = sub.add_parser(
        "inspect",
        help="per-layer FLOPs, backward/forward and JVP/forward ratios, memory",
        description="Trace SPEC, build the backward, update and JVP graphs, and print a "
        "per-layer table of FLOPs (1 multiply-add = 2 FLOPs), ratios and memory.",
    )
    add_model_args(p)
    p.add_argument(
        "--optimizer",
        default="sgd",
        choices=OPTIMIZER_CHOICES,
        help="optimizer whose update is counted (default sgd)",
    )
    p.add_argument(
        "--tangents",
        default=JVP_DEFAULTS["tangents"],
        choices=TANGENT_CHOICES,
        help="which values carry tangents in the JVP graph (default params: weight "
        "perturbation, as in forward gradients)",
    )
    p.add_argument(
        "--directions",
        type=int,
        default=JVP_DEFAULTS["directions"],
        metavar="K",
        help=f"directions averaged per forward-gradient step, 1 to {MAX_DIRECTIONS:,} (default 1)",
    )
    p.add_argument(
        "--direction",
        default=JVP_DEFAULTS["direction"],
        choices=DISTRIBUTIONS,
        help="distribution of forward-gradient directions (default normal)",
    )
    p.add_argument(
        "--memory-model",
        default="eager",
        choices=MEMORY_MODELS,
        help="what the memory figures describe: eager (default) what eager PyTorch autograd "
        "saves and allocates on --memory-device; graph: graphflop's own graphs in their order; "
        "compiled: what torch.compile's AOTAutograd min-cut partition saves, and the FLOPs it "
        "recomputes (inductor not run)",
    )
    p.add_argument(
        "--memory-device",
        default=None,
        choices=DEVICES,
        help="device of the eager (and compiled) memory model: dropout masks, optimizer "
        "temporaries (default cpu; the graph model does not depend on it)",
    )
    p.add_argument(
        "--keep-grads",
        action="store_true",
        help="gradients kept between steps (zero_grad(set_to_none=False)): live from the start",
    )
    p.add_argument(
        "--checkpoint",
        metavar="PATTERN",
        help="what-if: activation checkpointing (torch.utils.checkpoint, use_reentrant=False) of "
        "the modules whose path matches PATTERN, a shell glob (h.*) or, prefixed with re:, a "
        "regular expression: saved bytes and recompute FLOPs in memory.checkpoint",
    )
    p.add_argument(
        "--amp",
        choices=AMP_DTYPES,
        help="what-if: autocast to this dtype on --memory-device: saved bytes and train peak "
        "in memory.amp (FLOPs unchanged)",
    )
    p.add_argument(
        "--recompute",
        choices=RECOMPUTE_POLICIES,
        help="what-if: selective activation recomputation (Korthikanti et al. 2022). "
        "'attention': every attention core found in the graph (a matrix product of two "
        "activations, q·kᵀ, through the next such product consuming it, the product with v: "
        "scaling, mask, softmax and its dropout in between) is rerun in the backward and only "
        "its inputs are saved; saved bytes and recompute FLOPs in memory.recompute. Fused "
        "attention kernels already save only q, k, v and the logsumexp and are left alone",
    )
    p.add_argument(
        "--routing",
        default=None,
        metavar="MODEL",
        help="how a mixture-of-experts model's token-expert rows spread over its experts: "
        "balanced (default: T·k/E each, the expectation under uniform routing), capacity:F "
        "(0 < F ≤ E/k: each expert computes ⌈F·T·k/E⌉ rows, padded or dropped), or a JSON "
        "file holding a list of E measured per-expert token counts; recorded in the report's "
        "experts key. A loop over experts (torch.where(idx == e)) gets each expert's rows from "
        "it (balanced or a histogram), recorded in the report's assumptions",
    )
    p.add_argument(
        "--device",
        metavar="NAME|FILE.json",
        default=None,
        help="predict every node's time on this device: a data-sheet device (h100, ...), cpu "
        "(a guess for this CPU) or a profile file from 'graphflop calibrate'; adds time columns "
        "and the bound to the tables and 'time' to the JSON (--amp bf16|fp16: matrix products "
        "and convolutions at that dtype's peak)",
    )
    p.add_argument(
        "--tf32",
        choices=["convolutions", "all", "none"],
        default="convolutions",
        help="with a data-sheet GPU --device, which float32 products run on TF32 tensor cores "
        "(NVIDIA from Ampere on): convolutions (default, torch's defaults: "
        "torch.backends.cudnn.allow_tf32 True, torch.backends.cuda.matmul.allow_tf32 False), "
        "all (matmul.allow_tf32 = True or set_float32_matmul_precision('high') too) or none "
        "(cudnn.allow_tf32 = False too)",
    )
    p.add_argument("--no-backward", action="store_true", help="forward (and JVP) only")
    p.add_argument("--no-jvp", action="store_true", help="skip the JVP graph")
    p.add_argument("--json", metavar="PATH", help="write the full result as JSON to PATH")
    p.add_argument("--csv", metavar="PATH", help="write the per-layer table as CSV to PATH")
    p.add_argument(
        "--plot-memory",
        metavar="FILE",
        help="draw live bytes (MiB) against step over the training step (forward, backward, "
        "update; the forward alone without a backward) and the JVP, in the memory model of "
        "this run (--memory-model eager or graph, --memory-device, --keep-grads; with eager, "
        "--checkpoint, --amp and --recompute peaks as dashed lines), each peak marked with the largest tensors live at "
        "it; the curve's maximum is the reported train/jvp peak. FILE ends in .png, .svg or "
        ".pdf",
    )
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
        "forward-gradient step is unbiased (see --verify-samples); exit 1 unless every check "
        "ran and passed (an error over its tolerance, or a check NOT RUN). The verify lines "
        "go to stderr",
    )
    p.add_argument(
        "--verify-dtype",
        default="float64",
        choices=["float32", "float64"],
        help="dtype of the --verify run (default float64; float32 uses a 1e-4 "
        "tolerance too, and ill-conditioned models may exceed it). Where the traced graph "
        "computes in a lower precision than that (the model's own torch.autocast to "
        "bfloat16 or float16), the tolerance and the error's absolute floor are that "
        "dtype's machine epsilon (bfloat16 7.8e-3, float16 9.8e-4). The model's weights are "
        "drawn from seed 0, the inputs and directions from fixed seeds: the verdict repeats",
    )
    p.add_argument(
        "--verify-samples",
        type=int,
        default=None,
        metavar="M",
        help="Gaussian directions (float32, batched several per step) averaged by the "
        "--verify unbiasedness check, a two-sided chi-squared test with M degrees of freedom "
        "and a 1e-6 false-alarm rate; 0 skips it. Default: "
        f"{VERIFY_SAMPLES}, or as many as fit in {VERIFY_FLOPS:.0e} FLOPs, and "
        f"none when fewer than {MIN_VERIFY_SAMPLES} fit (a large model). At most "
        f"{MAX_VERIFY_SAMPLES:,}, and as many as fit in {MAX_VERIFY_FLOPS:.0e} FLOPs",
    )
    p.add_argument(  # partial results, per-op tables, MACs (docs/flops_conventions.md)
        "--strict",
        action="store_true",
        help="an op without a rule is an error (exit 2, one line) instead of being counted as "
        "0 FLOPs, listed in 'uncounted' and cutting the JVP/backward at its nodes",
    )
    p.add_argument(
        "--by",
        choices=["layer", "op"],
        default="layer",
        help="table rows: per module (default) or per op, one table per phase",
    )
    p.add_argument(
        "--depth",
        type=int,
        default=None,
        metavar="N",
        help="roll the per-module rows up to paths of at most N dotted parts (1: the model's "
        "children)",
    )
    p.add_argument(
        "--units",
        choices=["flops", "macs"],
        default="flops",
        help="table figures in FLOPs (default; 1 multiply-add = 2) or MACs (multiply-adds of "
        "matrix-class ops = mm FLOPs / 2)",
    )
    p.add_argument(
        "--max-layers",
        type=int,
        default=MAX_LAYERS,
        help="rows shown in the table (default 60; --json and --csv have them all)",
    )
    return p


def run(args: argparse.Namespace, err: Console) -> int:
    """Analyse, optionally verify, then print and write the report; returns the exit status
    (1 unless every --verify check ran and passed).

    With ``--format json`` standard output carries the JSON document alone: what the model's
    code prints while it is loaded and run goes to standard error instead."""
    from graphflop.export.report import print_report, to_json

    if args.format == "json":
        with contextlib.redirect_stdout(sys.stderr):
            report, extra, rc = _analyse(args, err)
        print(to_json(report, extra))
        return rc
    report, extra, rc = _analyse(args, err)
    print_report(
        report,
        stdout_console(),
        max_layers=args.max_layers,
        by=args.by,
        depth=args.depth,
        units=args.units,
    )
    return rc


def _analyse(args: argparse.Namespace, err: Console) -> tuple[Any, dict[str, Any], int]:
    """The checks, the analysis, ``--verify`` and the output files: (report, the JSON's extra
    keys, exit status)."""
    from graphflop.analysis import AnalyzeOptions
    from graphflop.export.report import layers_csv, to_json
    from graphflop.io import atomic_group, atomic_write
    from graphflop.ops import strict_rules

    _check(args)
    profile = None
    if args.device is not None:  # a bad device or profile file: one line, before any work
        from graphflop.passes.time_profile import resolve_profile

        profile = resolve_profile(args.device, args.tf32)
    elif args.tf32 != "convolutions":
        from graphflop.load import SpecError

        raise SpecError(
            f"--tf32 {args.tf32} sets how --device times float32 products: add --device"
        )
    loaded, inputs = load_model(args, note_eval=False)
    _check_routing(args, loaded)
    why = _backward_option(args)
    check_backward_possible(args, loaded, inputs, why=why)
    from graphflop.ops.transformers_ops import routing

    with (
        err.status("analysing", spinner="dots") as status,
        strict_rules(args.strict),
        routing(args.routing_model),
    ):
        options = AnalyzeOptions(
            tangents=args.tangents,
            directions=args.directions,
            distribution=args.direction,
            backward=not args.no_backward,
            jvp=not args.no_jvp,
            memory_model=args.memory_model,
            device=args.memory_device or "cpu",
            keep_grads=args.keep_grads,
            checkpoint=args.checkpoint,
            amp=args.amp,
            recompute=args.recompute,
            time_profile=profile,
        )
        analysis = analyze_model(args, loaded, inputs, status, err=err, why=why, options=options)
    report = analysis.report
    routed = any(a.startswith(ROUTED_LINE) for a in report.assumptions)
    if getattr(args, "routing_unchecked", None) and not routed:
        from graphflop.load import SpecError

        raise SpecError(
            f"--routing {args.routing} describes routed experts, and {args.routing_unchecked} "
            "has none: drop it"
        )
    # the number of directions is checked against their cost before anything is printed
    samples = _verify_samples(args, analysis) if args.verify else (0, "")
    print_warnings(err, analysis, _tangent_pass_notes(analysis))
    extra: dict[str, Any] = {}  # --verify's results, after the report's keys in the JSON
    experts = _experts(loaded, inputs, report, args.routing_model)
    if experts is not None:
        extra["experts"] = experts
        n = experts["routed_layers"]
        low, high = experts["tokens_per_expert_min"], experts["tokens_per_expert_max"]
        split = (
            f"{experts['tokens_per_expert']:,.1f} tokens per expert"
            if low == high
            else f"{low:,.1f} to {high:,.1f} tokens per expert (mean "
            f"{experts['tokens_per_expert']:,.1f})"
        )
        err.print(
            f"experts ({n} routed {'layer' if n == 1 else 'layers'}, top {experts['top_k']} of "
            f"{experts['experts']}): {experts['routing']}; "
            f"{split}; active "
            f"parameters per token {experts['active_params']:,} of {experts['params']:,}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
    rc = _verify(args, err, inputs, analysis, extra, samples) if args.verify else 0
    # where the model came from (a preset in place of the Hub's config.json, lazy modules
    # left out): the same notes as on standard error
    extra["model_notes"] = list(loaded.notes)
    with atomic_group():  # all the files or none of them
        if args.json:
            atomic_write(args.json, to_json(report, extra))
        if args.csv:
            atomic_write(args.csv, layers_csv(report))
        if args.plot_memory:
            from graphflop.export.memory_plot import plot_memory

            plot_memory(analysis, args.plot_memory)
    return report, extra, rc


def _experts(loaded: Any, inputs: Any, report: Any, routing: Any) -> dict[str, Any] | None:
    """The routing assumption and active parameters of a mixture-of-experts model, with its
    forward and training-step FLOPs per token (T: the elements of the first integer input,
    the token ids), or None for another model."""
    from graphflop.presets import experts_summary

    ids = [t for t in inputs if not t.dtype.is_floating_point and not t.dtype.is_complex]
    if not ids:
        return None
    tokens = ids[0].numel()
    config = getattr(loaded.model, "config", None)
    summary = experts_summary(loaded.model, config, tokens, routing)
    if summary is None:
        return None
    t = report.totals
    summary["forward_flops_per_token"] = (t.forward.flops + t.loss.flops) / tokens
    if t.train_step is not None:
        summary["train_step_flops_per_token"] = t.train_step.flops / tokens
    return summary


def _tangent_pass_notes(analysis: Analysis) -> list[str]:
    """A note when ``--directions K`` could not build one batched tangent pass (K copies of
    the whole tangent graph, or of some ops); read off the report (the step graph is not made
    for it: a recorded step's flat view is made where a graph is read)."""
    info = analysis.report.totals.forward_gradient_step
    if info is None or info.directions == 1 or info.tangent_pass == "one batched tangent pass":
        return []
    return [f"note: forward-gradient step with {info.directions} directions: {info.tangent_pass}"]


def _check_routing(args: argparse.Namespace, loaded: Any) -> None:
    """Refuse a --routing that does not fit the model's stacked routed experts (a histogram of
    another number of experts), and a capacity for a model without them; a balanced routing
    or a histogram given for such a model is checked after the trace (its loop over experts
    may dispatch data-dependently: refused there if it did not, an option the run would
    ignore). No --routing: balanced, nothing to check."""
    from graphflop.load import SpecError
    from graphflop.presets import routed_experts

    if args.routing is None:
        return
    found = routed_experts(loaded.model, getattr(loaded.model, "config", None))
    if not found and args.routing_model.kind == "capacity":
        raise SpecError(
            f"--routing {args.routing} describes stacked routed experts with a capacity "
            f"buffer, and {loaded.name} has none: drop it (a loop over experts takes balanced "
            "or a histogram)"
        )
    if not found:
        # a loop over experts (data-dependent dispatch) shows itself only when traced
        args.routing_unchecked = loaded.name
        return
    factor = args.routing_model.factor
    most = min(e / k for _, _, e, k in found)
    if factor is not None and factor > most:
        e, k = next((e, k) for _, _, e, k in found if e / k == most)
        raise SpecError(
            f"bad --routing {args.routing}: give capacity:F with F at most E/k = {e}/{k} = "
            f"{most:g}: each token runs {k} different experts, so the most tokens an expert can "
            f"receive is all T of them, ⌈F·T·k/E⌉ = T at F = E/k"
        )
    counts = args.routing_model.counts
    if counts is not None and len(counts) != found[0][2]:
        raise SpecError(
            f"--routing {args.routing} holds {len(counts)} counts and the model routes among "
            f"{found[0][2]} experts: give one count per expert"
        )


def _check(args: argparse.Namespace) -> None:
    """The option checks made before any work (ranges, output paths)."""
    from graphflop.load import SpecError
    from graphflop.ops.transformers_ops import parse_routing

    try:
        args.routing_model = parse_routing(args.routing or "balanced")
    except ValueError as e:
        raise SpecError(str(e)) from None

    if not 1 <= args.directions <= MAX_DIRECTIONS:
        raise SpecError(
            f"bad --directions {args.directions}: give 1 to {MAX_DIRECTIONS:,} (the step graph "
            "holds one JVP per direction)"
        )
    if args.verify_samples is not None and not 0 <= args.verify_samples <= MAX_VERIFY_SAMPLES:
        raise SpecError(
            f"bad --verify-samples {args.verify_samples}: give 0 (skip the check) to "
            f"{MAX_VERIFY_SAMPLES:,}"
        )
    if args.verify_samples is not None and not args.verify:
        raise SpecError(
            f"--verify-samples {args.verify_samples} sets a --verify check: add --verify "
            "(or drop --verify-samples)"
        )
    if args.max_layers < 0:
        raise SpecError(f"bad --max-layers {args.max_layers}: give 0 or more")
    if args.depth is not None and args.depth < 1:
        raise SpecError(f"bad --depth {args.depth}: must be at least 1")
    if args.by == "op" and (args.depth is not None or args.max_layers != MAX_LAYERS):
        option = "--depth" if args.depth is not None else "--max-layers"
        raise SpecError(
            f"{option} shapes the per-layer table, and --by op prints the per-op tables: drop "
            "one of the two options"
        )
    if args.no_jvp:
        given = [f"--{k}" for k, v in JVP_DEFAULTS.items() if getattr(args, k) != v]
        if given:
            raise SpecError(
                f"{given[0]} sets the JVP or the forward-gradient step, and --no-jvp skips "
                "both: drop one of the two options"
            )
    _check_memory_options(args)
    check_output_file(args.json, "--json")
    check_output_file(args.csv, "--csv")
    if args.plot_memory is not None:
        from graphflop.export.memory_plot import PLOT_SUFFIXES

        check_output_file(args.plot_memory, "--plot-memory", PLOT_SUFFIXES)
        if args.memory_model == "compiled":
            raise SpecError(
                "--plot-memory draws the eager or graph memory model; --memory-model compiled "
                "takes its train peak from torch.compile's partitioned graphs, which are not "
                "kept: drop one of the two options"
            )
    if args.checkpoint is not None:  # a malformed pattern: one line, exit 2, before any work
        from graphflop.passes.checkpoint import module_matcher

        module_matcher(args.checkpoint)
    check_distinct_outputs(
        {"--json": args.json, "--csv": args.csv, "--plot-memory": args.plot_memory}, args.spec
    )


def _backward_options(args: argparse.Namespace) -> list[str]:
    """The options given that need the backward graph (what they describe is the training
    step's: saved tensors, gradients)."""
    return [
        option
        for option, given in (
            (f"--checkpoint {args.checkpoint}", args.checkpoint is not None),
            (f"--amp {args.amp}", args.amp is not None),
            (f"--recompute {args.recompute}", args.recompute is not None),
            ("--keep-grads", args.keep_grads),
        )
        if given
    ]


def _backward_option(args: argparse.Namespace) -> str | None:
    """The first option given that asks for the backward (None when none does)."""
    asked = (["--verify"] if args.verify else []) + _backward_options(args)
    return asked[0] if asked else None


def _check_memory_options(args: argparse.Namespace) -> None:
    """Refuse memory options this run would ignore or mislabel: a backward what-if without the
    backward, the eager what-ifs (--checkpoint, --amp) on another memory model, and a device
    for the graph model (which has none)."""
    from graphflop.load import SpecError

    need = _backward_options(args)
    if need and args.no_backward:
        raise SpecError(
            f"{need[0]} needs a backward, and --no-backward skips it: drop one of the two options"
        )
    what_ifs = [o for o in need if not o.startswith("--keep-grads")]
    if what_ifs and args.memory_model != "eager":
        raise SpecError(
            f"{what_ifs[0]} is a what-if on the eager memory model, not on --memory-model "
            f"{args.memory_model}: drop one of the two options (or use --memory-model eager)"
        )
    if args.keep_grads and args.memory_model != "eager":
        raise SpecError(
            f"--keep-grads is a what-if on the eager memory model; --memory-model "
            f"{args.memory_model} already keeps every gradient to the end of the step: drop "
            "--keep-grads (or use --memory-model eager)"
        )
    if args.memory_device is not None and args.memory_model == "graph":
        raise SpecError(
            f"--memory-device {args.memory_device}: the graph memory model does not depend on "
            "the device: drop --memory-device (or use --memory-model eager or compiled)"
        )


def _verify_samples(args: argparse.Namespace, analysis: Analysis) -> tuple[int, str]:
    """The directions of ``--verify``'s forward-gradient check and the note on why the default
    was cut (:func:`graphflop.runtime.verify.forward_gradient_samples`).

    Raises:
        SpecError: ``--verify-samples`` asks for steps that would cost more than a check may
            spend.
    """
    from graphflop.load import SpecError
    from graphflop.runtime.verify import forward_gradient_samples

    fg = analysis.report.totals.forward_gradient_step
    try:
        return forward_gradient_samples(args.verify_samples, fg.flops if fg is not None else 0)
    except ValueError as e:
        raise SpecError(str(e)) from None


def _verify(
    args: argparse.Namespace,
    err: Console,
    inputs,
    analysis: Analysis,
    extra: dict[str, Any],
    budget: tuple[int, str],
) -> int:
    """``--verify``: run the checks, print one line each to stderr and add them (``verify``,
    and ``verify_note`` on the forward-gradient check's budget) to ``extra``; ``budget`` is
    :func:`_verify_samples`'s."""
    from graphflop.runtime.verify import seeded
    from graphflop.runtime.verify_all import gap_notes, verify_analysis

    samples, why = budget
    # the checks a gap stops are NOT RUN lines below; verify_note names them too
    notes = ([why] if why else []) + gap_notes(analysis.report)
    if why:
        err.print(f"verify: {why}", markup=False)
    if notes:
        extra["verify_note"] = "; ".join(notes)
    with err.status("verifying against torch.func", spinner="dots"):
        with seeded(0):  # real weights, the same at every run: a repeatable verdict
            real = load_real_model(args)
        checks = verify_analysis(
            real, inputs, analysis, dtype=args.verify_dtype, forward_gradient_samples=samples
        )
    extra["verify"] = [c.to_dict() for c in checks]
    for c in checks:  # one line each, never wrapped (soft_wrap), no markup
        err.print(f"verify: {c.line()}", markup=False, highlight=False, soft_wrap=True)
        if c.detail and getattr(args, "debug", False):  # the error that stopped the check
            err.print(c.detail.rstrip(), markup=False, highlight=False, soft_wrap=True)
    passed = sum(c.ok for c in checks)
    summary = f"verify: {passed} of {len(checks)} checks passed"
    err.print(summary, markup=False, highlight=False, soft_wrap=True)
    # exit 1 unless every check passed: one not run (a gap, attention dropout, an error) has
    # not passed, and neither has a run with no check at all
    return 0 if checks and all(c.ok for c in checks) else EXIT_VERIFY_FAILED
