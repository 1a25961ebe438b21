"""``graphflop plan``: what every rank computes, holds and sends under a parallel plan (DDP,
ZeRO-1/2/3, TP, SP, PP), from the model's train graph (:mod:`graphflop.parallel`)."""

from __future__ import annotations

import argparse
import math

from rich.console import Console

from graphflop.analysis import AMP_DTYPES, RECOMPUTE_POLICIES
from graphflop.cli.common import (
    OPTIMIZER_CHOICES,
    add_model_args,
    analyze_model,
    check_backward_possible,
    check_distinct_outputs,
    check_output_file,
    load_model,
    stdout_console,
)

GIB = 1024**3


def add_parser(sub) -> argparse.ArgumentParser:
    """Add the ``plan`` subcommand to ``graphflop``'s subparsers."""
    p = sub.add_parser(
        "plan",
        help="per-rank FLOPs, memory and collectives under DP/ZeRO/TP/SP/PP",
        description="Put the model's train graph on a parallel plan: tensor-parallel "
        "placements propagated node by node, collectives where they change, ZeRO sharding, "
        "pipeline stages; per rank (one class per pipeline stage): FLOPs by role, peak memory "
        "by kind, collectives, bubble, and whether it fits a device. The model's inputs are "
        "one micro-batch on one data-parallel rank (--batch, or --global-batch).",
    )
    add_model_args(p)
    for name, what in (
        ("--dp", "data-parallel degree (default 1)"),
        ("--tp", "tensor-parallel degree (default 1)"),
        ("--pp", "pipeline-parallel degree: stages (default 1)"),
    ):
        p.add_argument(name, type=int, default=1, metavar="N", help=what)
    p.add_argument(
        "--sp",
        action="store_true",
        help="sequence parallelism over the TP group (norms, dropouts, residual adds hold 1/tp "
        "of the sequence); needs --tp 2 or more",
    )
    p.add_argument(
        "--zero",
        type=int,
        default=0,
        choices=[0, 1, 2, 3],
        help="ZeRO stage over the DP group: 0 DDP, 1 optimizer state sharded "
        "(ZeroRedundancyOptimizer), 2 + gradients (FSDP SHARD_GRAD_OP), 3 + parameters "
        "(FSDP2 fully_shard); 1-3 need --dp 2 or more; default 0",
    )
    p.add_argument(
        "--micro-batches",
        type=int,
        default=None,
        metavar="M",
        help="micro-batches per step (default: --pp, so every stage has one in flight)",
    )
    p.add_argument(
        "--schedule",
        default="1f1b",
        metavar="NAME",
        help="pipeline schedule: gpipe, 1f1b or interleaved, any case (default 1f1b)",
    )
    p.add_argument(
        "--chunks",
        type=int,
        default=None,
        metavar="V",
        help="model chunks per pipeline rank for --schedule interleaved (default 2)",
    )
    p.add_argument(
        "--global-batch",
        type=int,
        default=None,
        metavar="B",
        help="samples per step over all DP ranks; the micro-batch is B / (dp · micro-batches) "
        "(default: --batch × dp × micro-batches)",
    )
    p.add_argument(
        "--world",
        type=int,
        default=None,
        metavar="N",
        help="ranks available: checked to equal dp × tp × pp",
    )
    p.add_argument(
        "--tp-plan",
        metavar="FILE",
        help="JSON or YAML mapping module path patterns (fnmatch globs, or re:REGEX; first "
        "match wins) to a style of torch's parallelize_module: colwise and rowwise (nn.Linear "
        "and nn.Embedding only), colwise:replicate (column-wise, the output gathered; also "
        "written {style: colwise, output_layouts: replicate}), prepare_input (the "
        "sequence-sharded input gathered on entry, PrepareModuleInput), sequence_parallel, "
        "replicate; torch's class names ColwiseParallel, RowwiseParallel, SequenceParallel, "
        "PrepareModuleInput work too. Default: Megatron's column/row pattern found from the "
        "module structure",
    )
    p.add_argument(
        "--optimizer",
        default="adam",
        choices=OPTIMIZER_CHOICES,
        help="optimizer whose state is sharded (default adam)",
    )
    p.add_argument(
        "--checkpoint",
        metavar="PATTERN",
        help="what-if: activation checkpointing of the modules whose path matches (glob, or "
        "re:REGEX): saved bytes and recompute FLOPs per stage",
    )
    p.add_argument("--amp", choices=AMP_DTYPES, help="what-if: autocast's saved bytes per stage")
    p.add_argument(
        "--recompute",
        choices=RECOMPUTE_POLICIES,
        help="what-if: selective activation recomputation (Korthikanti et al. 2022): each "
        "attention core found in the graph (the score product q·kᵀ through the product with v) "
        "rerun in the backward, only its inputs saved; activations and recompute FLOPs per "
        "stage at local (TP/SP) size. Fused attention kernels need nothing and are left alone",
    )
    p.add_argument(
        "--memory-device",
        choices=["cpu", "cuda"],
        default="cuda",
        help="device the eager memory model describes (default cuda)",
    )
    p.add_argument(
        "--device",
        metavar="NAME",
        help="judge fits / does not fit against this data-sheet device's memory (h100, a100, "
        "...: docs/devices.md; not cpu or a calibrate profile, which give no memory size: "
        "use --memory-gib there)",
    )
    p.add_argument(
        "--memory-gib",
        type=float,
        metavar="GIB",
        help="judge fits / does not fit against this much memory per rank (GiB)",
    )
    p.add_argument(
        "--blocks",
        metavar="NAME=N",
        help="analyse per block: the constructor argument or hf: configuration field NAME sets "
        "the number of identical blocks and the model has N (e.g. num_hidden_layers=80); the "
        "model is analysed with one block per pipeline stage (virtual stage), the N blocks split "
        "between the stages as the full model's would be (balanced by FLOPs), and each stage's "
        "blocks counted from its analysed one: fast for deep models",
    )
    p.add_argument("--json", metavar="PATH", help="write the plan's figures as JSON")
    p.add_argument(
        "--render",
        metavar="PATH",
        help="draw one stage's forward graph with its collectives (.dot, .svg, .png, .pdf)",
    )
    p.add_argument(
        "--render-stage",
        type=int,
        default=None,
        metavar="S",
        help="the pipeline stage --render draws (default 0)",
    )
    p.add_argument(
        "--collectives",
        action="store_true",
        help="also print every collective of each rank class",
    )
    return p


#: what each ZeRO stage shards over the DP group (``--zero``'s help)
_ZERO_SHARDS = {
    1: "the optimizer state",
    2: "the optimizer state and gradients",
    3: "the optimizer state, gradients and parameters",
}


def _plan_from_args(args: argparse.Namespace):
    """The :class:`~graphflop.parallel.Plan` the options name (checked)."""
    from graphflop.parallel import Plan, PlanError, read_tp_plan

    args.schedule = args.schedule.strip().lower()  # any case, as device names
    if args.schedule not in ("gpipe", "1f1b", "interleaved"):
        raise PlanError(f"unknown --schedule {args.schedule!r}: one of gpipe, 1f1b, interleaved")
    chunks = (
        args.chunks if args.chunks is not None else (2 if args.schedule == "interleaved" else 1)
    )
    if args.schedule == "interleaved" and chunks < 2:
        raise PlanError("--schedule interleaved needs --chunks 2 or more (virtual stages per rank)")
    m = args.micro_batches if args.micro_batches is not None else args.pp
    if args.tp_plan and args.tp < 2:
        raise PlanError(
            "--tp-plan shards modules across tensor-parallel ranks: add --tp N (2 or more), "
            "or drop --tp-plan"
        )
    if args.zero and args.dp == 1:
        # ZeRO shards over the DP group: one rank holds everything whatever the stage
        raise PlanError(
            f"--zero {args.zero} shards {_ZERO_SHARDS[args.zero]} over the data-parallel group, "
            "and --dp 1 is one rank: nothing would be sharded; give --dp 2 or more, or drop --zero"
        )
    tp_plan = read_tp_plan(args.tp_plan) if args.tp_plan else ()
    plan = Plan(
        dp=args.dp,
        tp=args.tp,
        pp=args.pp,
        sp=args.sp,
        zero=args.zero,
        schedule=args.schedule,
        micro_batches=m,
        chunks=chunks,
        tp_plan=tp_plan,
    )
    if args.world is not None and args.world != plan.world:
        raise PlanError(
            f"--dp {plan.dp} × --tp {plan.tp} × --pp {plan.pp} = {plan.world} ranks, not "
            f"--world {args.world}: make the product equal the world size"
        )
    return plan


def _device_memory(args: argparse.Namespace) -> tuple[int | None, str | None]:
    from graphflop.parallel import PlanError

    if args.device and args.memory_gib is not None:
        raise PlanError("give --device or --memory-gib, not both")
    if args.memory_gib is not None:
        if not math.isfinite(args.memory_gib) or args.memory_gib <= 0:
            raise PlanError(
                f"--memory-gib must be a positive number of GiB (80 for an 80 GB device), "
                f"not {args.memory_gib}"
            )
        return round(args.memory_gib * GIB), f"{args.memory_gib:g} GiB"
    if args.device:
        import os

        from graphflop.devices import DEVICES, UnknownDevice, device_spec

        name = args.device
        if name.strip().lower() == "cpu" or name.endswith(".json") or os.path.exists(name):
            # inspect's time profiles (the CPU guess, calibrate's files) carry no memory size
            raise PlanError(
                f"plan --device {name}: fits is judged on a data-sheet device's memory, which "
                f"{'the cpu guess' if name.strip().lower() == 'cpu' else 'a profile file'} does "
                f"not give: use --memory-gib GIB, or one of {', '.join(sorted(DEVICES))}"
            )
        try:
            spec = device_spec(name)
        except UnknownDevice as e:
            raise PlanError(str(e)) from None
        return int(spec.memory_bytes), args.device
    return None, None


def _check_outputs(args: argparse.Namespace, stages: int) -> None:
    """``--json``, ``--render`` and ``--render-stage`` checked before any work (sets
    ``args.render_stage`` to 0 where not given).

    Raises:
        PlanError: a stage the plan does not have, or ``--render-stage`` without ``--render``.
        SpecError: an output path that cannot be written or names the model file.
    """
    from graphflop.parallel import PlanError
    from graphflop.parallel.render import RENDER_SUFFIXES

    check_output_file(args.json, "--json")
    check_output_file(args.render, "--render", RENDER_SUFFIXES)
    check_distinct_outputs({"--json": args.json, "--render": args.render}, args.spec)
    if args.render_stage is not None and not args.render:
        raise PlanError("--render-stage picks the stage --render draws: add --render FILE")
    args.render_stage = args.render_stage or 0
    if not 0 <= args.render_stage < stages:
        raise PlanError(
            f"--render-stage {args.render_stage}: the plan has stages 0 to {stages - 1}"
        )


def run(args: argparse.Namespace, err: Console) -> int:
    """Analyse one micro-batch, put it on the plan, print the table and write ``--json``."""
    from graphflop.analysis import AnalyzeOptions
    from graphflop.load import SpecError
    from graphflop.parallel import PlanError, predict
    from graphflop.parallel.plan import too_many_stages

    plan = _plan_from_args(args)
    if args.checkpoint is not None and args.recompute is not None:
        raise PlanError(
            "--checkpoint and --recompute are two what-ifs on the saved activations, each "
            "computed on its own from the eager model: give one of them"
        )
    memory, device = _device_memory(args)
    _check_outputs(args, plan.pp)
    if args.global_batch is not None:
        per = plan.dp * plan.micro_batches
        if args.global_batch < 1 or args.global_batch % per:
            raise PlanError(
                f"--global-batch {args.global_batch} is not a positive multiple of dp × "
                f"micro-batches = {per}: each micro-batch must hold whole samples"
            )
        if args.batch is not None and args.batch != args.global_batch // per:
            raise PlanError(
                f"--batch {args.batch} and --global-batch {args.global_batch} disagree (the "
                f"micro-batch would be {args.global_batch // per}): give one of them"
            )
        args.batch = args.global_batch // per
    total_blocks = None
    if args.blocks:
        name, sep, value = args.blocks.partition("=")
        if sep and name and value.strip().isdigit() and int(value) < 1:
            raise PlanError(
                f"--blocks {args.blocks}: N must be at least 1 (the number of blocks the full "
                "model has, e.g. num_hidden_layers=80)"
            )
        if not sep or not name or not value.strip().isdigit():
            raise PlanError(
                f"bad --blocks {args.blocks!r}: write NAME=N, e.g. num_hidden_layers=80"
            )
        total, stages = int(value), plan.virtual_stages
        if total < stages:
            raise too_many_stages(plan, total, "--blocks gives")
        if any(a.partition("=")[0] == name for a in args.arg or []):
            raise PlanError(f"--blocks sets {name}: drop --arg {name}")
        args.arg = [*(args.arg or []), f"{name}={stages}"]
        total_blocks = total
    try:
        loaded, inputs = load_model(args, note_eval=False)
    except SpecError as e:
        if total_blocks is None or f"--arg {name}=" not in str(e):
            raise
        # the argument is --blocks', not the user's --arg
        raise PlanError(
            f"--blocks {args.blocks}: "
            + str(e).replace(
                f"with --arg {name}={stages}",
                f"with {name}={stages} (--blocks builds one block per pipeline stage)",
            )
        ) from e
    check_backward_possible(args, loaded, inputs, why="plan")
    micro = int(inputs[0].shape[0]) if inputs and getattr(inputs[0], "ndim", 0) else 1
    options = AnalyzeOptions(
        jvp=False,
        device=args.memory_device,
        checkpoint=args.checkpoint,
        amp=args.amp,
        recompute=args.recompute,
    )
    with err.status("analysing", spinner="dots") as status:
        analysis = analyze_model(args, loaded, inputs, status, err=err, options=options)
        status.update("putting the graph on the plan")
        report = predict(
            analysis,
            loaded.model,
            plan,
            micro_batch=micro,
            device_memory_bytes=memory,
            device=device,
            memory_device=args.memory_device,
            total_blocks=total_blocks,
        )
    # the analysis's assumptions (a routed mixture of experts' rows per expert), as inspect
    # prints them
    for line in report.assumptions:
        err.print(f"assumption: {line}", markup=False, highlight=False, soft_wrap=True)
    _print(report, args.collectives)
    import json

    from graphflop.io import atomic_group, atomic_write

    with atomic_group():  # all the files or none of them
        if args.json:
            atomic_write(args.json, json.dumps(report.to_dict(), indent=1))
        if args.render:
            from graphflop.parallel.render import render_stage

            render_stage(report, args.render, args.render_stage)
    return 0


def _print(report, show_collectives: bool) -> None:
    from rich.table import Table
    from rich.text import Text

    from graphflop.export.report import human

    plan = report.plan
    console = stdout_console()
    title = (
        f"{report.model}: dp {plan.dp} × tp {plan.tp}{' (sp)' if plan.sp else ''} × pp "
        f"{plan.pp} = {plan.world} ranks, ZeRO {plan.zero}, {plan.schedule}, "
        f"{plan.micro_batches} micro-batches of {report.micro_batch} (global batch "
        f"{report.global_batch}), loss {report.loss}"
    )
    t = Table(title=Text(title))  # a Text: no markup or emoji codes read in model names
    for col in (
        "ranks",
        "fwd FLOPs",
        "bwd FLOPs",
        "recompute",
        "update",
        "params",
        "grads",
        "opt state",
        "activations",
        "gathered",
        "peak",
        "fits",
        "TP bytes",
        "DP bytes",
        "PP bytes",
    ):
        t.add_column(col, justify="right")
    for r in report.ranks:
        mb = r.memory_bytes
        cb = r.collective_bytes()
        t.add_row(
            f"{r.name} ×{r.ranks}",
            human(r.flops["forward"]),
            human(r.flops["backward"]),
            human(r.flops["recompute"]),
            human(r.flops["update"]),
            _b(mb["parameters"]),
            _b(mb["gradients"]),
            _b(mb["optimizer_state"]),
            f"{_b(mb['activations'])} ({r.in_flight:g} mb)",
            _b(mb["all_gather_buffers"]),
            _b(mb["peak"]),
            "-" if r.fits is None else "yes" if r.fits else "NO",
            _b(cb.get("tp", 0)),
            _b(cb.get("dp", 0)),
            _b(cb.get("pp", 0)),
        )
    console.print(t)
    console.print(
        f"bubble {report.bubble:.1%} of the step; stage balance {report.balance:.3f} "
        f"(busiest / mean); {report.split}",
        soft_wrap=True,
    )
    for note in report.notes:
        console.print(f"note: {note}", soft_wrap=True, markup=False)
    ea = report.eager_attention
    if ea is not None:
        console.print(
            f"attention: FLOPs as eager PyTorch runs them: {ea.calls} calls on its fused kernel "
            f"({ea.kernel}), whose backward recomputes q·kᵀ: "
            f"{ea.backward_recompute_mm_flops:,} mm FLOPs per micro-batch (whole model) over "
            "graphflop's graph, which inspect counts (attention in its math form)",
            soft_wrap=True,
            markup=False,
        )
    if show_collectives:
        from collections import Counter

        for r in report.ranks:
            ct = Table(title=f"collectives per step: {r.name}")
            for col in ("kind", "group", "size", "elements", "dtype", "phase", "count"):
                ct.add_column(col, justify="right")
            counts = Counter(
                (c.kind, c.group, c.group_size, c.elements, c.dtype, c.phase) for c in r.collectives
            )
            for (kind, group, size, el, dt, ph), k in counts.items():
                ct.add_row(kind, group, str(size), f"{el:,}", dt, ph, str(k))
            console.print(ct)


def _b(n: int) -> str:
    for unit, k in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= k:
            return f"{n / k:.2f} {unit}"
    return f"{n} B"
