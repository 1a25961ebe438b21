"""The parallel plan: how a training step is split over a world of ranks.

A :class:`Plan` is one frozen value: the data-parallel (``dp``), tensor-parallel (``tp``) and
pipeline-parallel (``pp``) degrees, sequence parallelism (``sp``, over the TP group), the ZeRO
stage (0 = DDP, 1 = optimizer state sharded, 2 = and gradients, 3 = and parameters: FSDP full
shard), the pipeline schedule and micro-batch count, and the TP plan (module path pattern →
``colwise``, ``rowwise``, ``sequence_parallel`` or ``replicate``, the vocabulary of
``torch.distributed.tensor.parallel.parallelize_module``'s ``ColwiseParallel``,
``RowwiseParallel`` and ``SequenceParallel``). It is checked when made; every error is a
:class:`PlanError` with a one-line message saying what to change.
"""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "ACCEPTED_ENTRIES",
    "PLAN_STYLES",
    "SCHEDULES",
    "ZERO_STAGES",
    "Plan",
    "PlanError",
    "match_style",
    "read_tp_plan",
    "too_many_stages",
]

#: the pipeline schedules: GPipe (all forwards, then all backwards), 1F1B (PipeDream-Flush) and
#: interleaved 1F1B with virtual stages (Narayanan et al. 2021, section 2.2)
SCHEDULES = ("gpipe", "1f1b", "interleaved")
#: the ZeRO stages (Rajbhandari et al. 2020): 0 DDP, 1 optimizer state, 2 + gradients,
#: 3 + parameters (FSDP full shard)
ZERO_STAGES = (0, 1, 2, 3)
#: the TP plan's entries (torch's parallelize_module styles, in lower case)
PLAN_STYLES = ("colwise", "rowwise", "sequence_parallel", "replicate")
#: a column-wise module whose output is gathered to every rank (torch's
#: ``ColwiseParallel(output_layouts=Replicate())``, the usual LM head)
COLWISE_REPLICATE = "colwise:replicate"
#: a module whose sequence-sharded input is gathered on entry (torch's
#: ``PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())``)
PREPARE_INPUT = "prepare_input"
_STYLE_ALIASES = {
    "colwiseparallel": "colwise",
    "rowwiseparallel": "rowwise",
    "sequenceparallel": "sequence_parallel",
}


class PlanError(ValueError):
    """A plan that cannot run: the message is one line saying what to change.

    Attributes:
        node: the graph node whose placement rule refused (None: not a node's rule).
    """

    node: str | None = None


@dataclass(frozen=True)
class Plan:
    """How one training step is split over ``dp · tp · pp`` ranks.

    Attributes:
        dp, tp, pp: data-, tensor- and pipeline-parallel degrees (each ≥ 1).
        sp: sequence parallelism over the TP group (Korthikanti et al. 2022): the norms,
            dropouts and residual adds between TP regions hold 1/tp of the sequence; needs
            ``tp > 1``.
        zero: ZeRO stage 0-3 (:data:`ZERO_STAGES`) over the DP group.
        schedule: pipeline schedule (:data:`SCHEDULES`).
        micro_batches: micro-batches per step per pipeline (≥ 1; 1F1B needs ≥ pp,
            interleaved a multiple of pp).
        chunks: model chunks per pipeline rank for the interleaved schedule (virtual stages,
            ≥ 2 there, 1 otherwise).
        tp_plan: (pattern, style) pairs, first match wins; a pattern is an fnmatch glob over
            module paths (``*.attn.c_attn``) or, with the ``re:`` prefix, a regular
            expression matched in full. Empty: the default plan found from the module
            structure (:func:`graphflop.parallel.tp_plan.default_tp_plan`).

    Raises:
        PlanError: a degree below 1, ``sp`` without ``tp > 1``, an unknown ZeRO stage,
            schedule or plan style, too few micro-batches for the schedule.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    sp: bool = False
    zero: int = 0
    schedule: str = "1f1b"
    micro_batches: int = 1
    chunks: int = 1
    tp_plan: tuple[tuple[str, str], ...] = field(default=())

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "micro_batches", "chunks"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise PlanError(f"--{name.replace('_', '-')} must be a positive integer, not {v!r}")
        if self.zero not in ZERO_STAGES:
            raise PlanError(f"unknown --zero {self.zero!r}: one of 0, 1, 2, 3")
        if self.schedule not in SCHEDULES:
            raise PlanError(f"unknown --schedule {self.schedule!r}: one of {', '.join(SCHEDULES)}")
        if self.pp == 1 and self.schedule != "1f1b":
            raise PlanError(
                f"--schedule {self.schedule} orders pipeline stages: give --pp 2 or more, or "
                "drop --schedule"
            )
        if self.sp and self.tp < 2:
            raise PlanError("--sp shards the sequence over the TP group: give --tp 2 or more")
        if self.pp > 1 and self.schedule == "1f1b" and self.micro_batches < self.pp:
            raise PlanError(
                f"1F1B with --pp {self.pp} needs at least {self.pp} micro-batches (one in flight "
                f"per stage), not {self.micro_batches}: raise --micro-batches or use gpipe"
            )
        if self.schedule == "interleaved":
            if self.pp > 1 and self.micro_batches % self.pp:
                raise PlanError(
                    f"the interleaved schedule sends micro-batches in groups of --pp {self.pp}: "
                    f"--micro-batches {self.micro_batches} is not a multiple of it"
                )
        elif self.chunks != 1:
            raise PlanError(
                f"--chunks {self.chunks} (virtual stages) is for --schedule interleaved only"
            )
        for pattern, style in self.tp_plan:
            if style not in (*PLAN_STYLES, COLWISE_REPLICATE, PREPARE_INPUT):
                raise PlanError(
                    f"unknown TP plan entry {style!r} for {pattern!r}: {ACCEPTED_ENTRIES}"
                )

    @property
    def world(self) -> int:
        """Ranks: dp · tp · pp."""
        return self.dp * self.tp * self.pp

    @property
    def virtual_stages(self) -> int:
        """Model chunks in all: pp · chunks."""
        return self.pp * self.chunks

    def to_dict(self) -> dict:
        """The plan as JSON: degrees, world, ZeRO stage, schedule, micro-batches, TP plan."""
        return {
            "dp": self.dp,
            "tp": self.tp,
            "pp": self.pp,
            "sp": self.sp,
            "world": self.world,
            "zero": self.zero,
            "schedule": self.schedule,
            "micro_batches": self.micro_batches,
            "chunks": self.chunks,
            "tp_plan": dict(self.tp_plan),
        }


#: every entry a TP plan file may give, for messages and --help
ACCEPTED_ENTRIES = (
    f"{', '.join(PLAN_STYLES)}, {COLWISE_REPLICATE} (the output gathered), {PREPARE_INPUT} "
    "(the sequence-sharded input gathered on entry), torch's class names ColwiseParallel, "
    "RowwiseParallel, SequenceParallel, PrepareModuleInput, or {style: colwise, "
    "output_layouts: replicate}"
)


def too_many_stages(plan: Plan, blocks: int, what: str = "the model has") -> PlanError:
    """The error for ``plan``'s ``pp · chunks`` virtual stages exceeding ``blocks``: it says
    which degrees fit (``pp ≤ blocks``; under the interleaved schedule ``pp · chunks ≤
    blocks`` with ``chunks ≥ 2``, so at least 4 blocks)."""
    head = (
        f"{plan.virtual_stages} pipeline stages ({plan.pp} × {plan.chunks} chunks) but {what} "
        f"{blocks} blocks"
        if plan.schedule == "interleaved"
        else f"{plan.virtual_stages} pipeline stages but {what} {blocks} blocks"
    )
    if plan.schedule != "interleaved":
        return PlanError(f"{head}: use at most --pp {blocks}")
    if blocks < 4:
        return PlanError(
            f"{head}: interleaving needs --pp 2 or more × --chunks 2 or more, at least 4 "
            f"blocks; use --schedule 1f1b or gpipe with --pp at most {blocks}"
        )
    fits = [f"--pp {p} --chunks {blocks // p}" for p in range(2, blocks // 2 + 1)]
    shown = ", ".join(fits[:3]) + (", ..." if len(fits) > 3 else "")
    return PlanError(
        f"{head}: --pp × --chunks must be at most {blocks} (e.g. {shown}), or use --schedule "
        f"1f1b or gpipe with --pp at most {blocks}"
    )


def _style(value: object, pattern: str) -> str:
    """A plan entry's style in lower case, torch's class names accepted; a mapping
    ``{"style": "colwise", "output_layouts": "replicate"}`` is the gathered column-wise style
    (``output_layouts: shard(-1)``, ColwiseParallel's default, the plain one)."""
    if isinstance(value, dict):
        extra = sorted(map(str, set(value) - {"style", "output_layouts"}))
        if extra or "style" not in value:
            raise PlanError(
                f"TP plan entry for {pattern!r}: a mapping takes the keys style and "
                f"output_layouts{', not ' + ', '.join(extra) if extra else ' (style missing)'}"
            )
        style = _style(value["style"], pattern)
        raw = value.get("output_layouts")
        out = "" if raw is None else str(raw).strip().lower().replace(" ", "").removesuffix("()")
        if out and style != "colwise":
            raise PlanError(
                f"TP plan entry for {pattern!r}: output_layouts is taken by a colwise entry "
                f"only, not {style}"
            )
        if out in ("shard(-1)", "shard(dim=-1)"):
            return style
        if out and out != "replicate":
            raise PlanError(
                f"TP plan entry for {pattern!r}: output_layouts {raw!r} is not supported: "
                "replicate (the output gathered), or none for ColwiseParallel's default "
                "Shard(-1)"
            )
        return COLWISE_REPLICATE if out else style
    if not isinstance(value, str):
        raise PlanError(
            f"TP plan entry for {pattern!r} must be a string or a mapping ({ACCEPTED_ENTRIES}), "
            f"not {value!r}"
        )
    key = value.strip().lower()
    key = _STYLE_ALIASES.get(key, key)
    if key in (COLWISE_REPLICATE, PREPARE_INPUT, "preparemoduleinput"):
        return PREPARE_INPUT if key == "preparemoduleinput" else key
    if key not in PLAN_STYLES:
        raise PlanError(f"unknown TP plan entry {value!r} for {pattern!r}: {ACCEPTED_ENTRIES}")
    return key


def read_tp_plan(path: str) -> tuple[tuple[str, str], ...]:
    """A TP plan file: a JSON or YAML mapping of module path pattern → style.

    Example (YAML)::

        "*.attn.c_attn": colwise
        "*.attn.c_proj": rowwise
        "re:.*ln_\\d": sequence_parallel
        lm_head: {style: colwise, output_layouts: replicate}   # or "colwise:replicate"

    Raises:
        PlanError: a file that cannot be read or parsed, not a mapping, an empty or malformed
            pattern, an unknown style.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise PlanError(f"cannot read --tp-plan {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise PlanError(
            f"--tp-plan {path} is not text (byte {e.start} is not UTF-8): give a JSON or YAML "
            "file mapping module path patterns to styles"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        try:
            import yaml

            data = yaml.safe_load(text)
        except Exception as e:  # yaml's errors are many classes; each is a malformed file
            raise PlanError(f"--tp-plan {path} is neither JSON nor YAML: {e}") from None
    if not isinstance(data, dict) or not data:
        raise PlanError(f"--tp-plan {path} must map module path patterns to styles")
    out = []
    for pattern, value in data.items():
        if not isinstance(pattern, str) or not pattern.strip():
            raise PlanError(f"--tp-plan {path}: a pattern must be a non-empty string")
        if pattern.startswith("re:"):
            try:
                re.compile(pattern[3:])
            except re.error as e:
                raise PlanError(
                    f"--tp-plan {path}: bad regular expression {pattern!r}: {e}"
                ) from None
        out.append((pattern, _style(value, pattern)))
    return tuple(out)


def match_style(tp_plan: tuple[tuple[str, str], ...], module: str) -> str | None:
    """The style of the first entry whose pattern matches ``module`` (a module path), else
    None."""
    for pattern, style in tp_plan:
        if pattern.startswith("re:"):
            if re.fullmatch(pattern[3:], module):
                return style
        elif fnmatch.fnmatchcase(module, pattern):
            return style
    return None
