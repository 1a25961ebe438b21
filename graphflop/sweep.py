"""Backward/forward ratios across batch sizes or depths (seed A's sweeps), from the graphs.

Each point traces the model afresh at that batch size or depth (on the meta device: no memory)
and records the ratio with and without the update, the forward and backward FLOPs and the
update's; with device profiles, the same ratio in predicted time on each
(:mod:`graphflop.passes.step_time`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

from graphflop.analysis import AnalyzeOptions, analyze
from graphflop.frontend.loss import NO_FLOAT_OUTPUT
from graphflop.load import SpecError, load, make_inputs, set_training_mode
from graphflop.passes.step_time import time_report
from graphflop.passes.summary import Graphs
from graphflop.passes.time_profile import TimeProfile

DEPTH_ARGS = ("middle_layers", "depth", "num_layers", "n_layers", "layers")


def depth_arg(spec: str) -> str:
    """The constructor argument of ``spec`` that sets its depth.

    Raises:
        ValueError: when the constructor has none of :data:`DEPTH_ARGS`.
    """
    loaded = load(spec, meta=True)
    target = type(loaded.model).__init__
    params = inspect.signature(target).parameters
    for name in DEPTH_ARGS:
        if name in params:
            return name
    raise SpecError(
        f"{loaded.name}'s constructor takes no depth argument (one of "
        f"{', '.join(DEPTH_ARGS)}); give --depth-arg NAME"
    )


def sweep(
    spec: str,
    *,
    batches: Sequence[int] | None = None,
    depths: Sequence[int] | None = None,
    depth_name: str | None = None,
    optimizer: str = "sgd",
    ctor_kwargs: dict | None = None,
    batch: int | None = None,
    seq: int | None = None,
    progress: Callable[[str], None] | None = None,
    devices: Sequence[TimeProfile] = (),
    amp: str | None = None,
    outline: bool = True,
) -> list[dict[str, Any]]:
    """One row per batch size (``batches``) or per depth (``depths``); ``seq``: the sequence
    length of an ``hf:`` model's token inputs (:func:`graphflop.load.load`).

    Row keys: ``batch`` or ``depth``, ``forward_flops``, ``backward_flops``, ``update_flops``,
    ``ratio`` ((backward + update)/forward), ``ratio_no_update``, ``params``; per profile of
    ``devices`` (:mod:`graphflop.passes.step_time`), ``time_ratio@NAME`` ((backward + update) /
    forward in predicted seconds), ``forward_s@NAME`` and ``train_step_s@NAME``; ``amp``
    (``bf16``/``fp16``): those times under autocast to that dtype. ``outline``: as
    :class:`~graphflop.analysis.AnalyzeOptions`'.

    Raises:
        NoPeak: a matrix product in a dtype a profile of ``devices`` has no rate for.
        SpecError: the model's output has nothing to differentiate (no backward to compare).
        ValueError: an unknown ``amp``.
    """
    say = progress or (lambda m: None)
    rows = []
    points = [("batch", b) for b in batches or []]
    if depths:
        depth_name = depth_name or depth_arg(spec)
        points += [("depth", d) for d in depths]
    for kind, value in points:
        kwargs = dict(ctor_kwargs or {})
        if kind == "depth":
            kwargs[depth_name] = value
        say(f"{kind} {value}")
        loaded = load(spec, ctor_kwargs=kwargs, meta=True, seq=seq)
        set_training_mode(loaded.model)
        inputs = make_inputs(loaded, batch=value if kind == "batch" else batch)
        options = AnalyzeOptions(optimizer=optimizer, jvp=False, outline=outline)
        a = analyze(loaded.model, inputs, options, name=loaded.name)
        r = a.report
        if r.loss == "none":  # nothing to differentiate: a sweep compares backward and forward
            raise SpecError(
                f"sweep needs a backward, but {NO_FLOAT_OUTPUT} ({spec}): return the logits or "
                "scores instead"
            )
        t = r.totals
        assert t.backward is not None and t.update is not None  # a loss: a backward was built
        rows.append(
            {
                kind: value,
                "forward_flops": t.forward.flops,
                "backward_flops": t.backward.flops,
                "update_flops": t.update.flops,
                "ratio": r.ratios.backward_forward,
                "ratio_no_update": r.ratios.backward_forward_no_update,
                "params": r.params,
            }
        )
        for profile in devices:
            tr = time_report(Graphs(a.forward, a.backward, a.update), r, profile, amp=amp)
            fwd, step = tr.phase("forward"), tr.phase("train_step")
            assert fwd is not None and step is not None  # a backward was built
            rows[-1] |= {
                f"time_ratio@{profile.name}": dict(tr.ratios)["backward_forward"],
                f"forward_s@{profile.name}": fwd.seconds,
                f"train_step_s@{profile.name}": step.seconds,
            }
    return rows


def plot(rows: list[dict[str, Any]], path: str, *, title: str) -> None:
    """Ratio vs batch size or depth (log x axis), with and without the update, as PNG/SVG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kind = "batch" if "batch" in rows[0] else "depth"
    xs = [r[kind] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    ax.plot(xs, [r["ratio"] for r in rows], "o-", label="(backward + update) / forward")
    ax.plot(xs, [r["ratio_no_update"] for r in rows], "s--", label="backward / forward")
    for key in (k for k in rows[0] if k.startswith("time_ratio@")):
        name = key.partition("@")[2]
        ax.plot(
            xs, [r[key] for r in rows], "^-", label=f"(backward + update) / forward, time on {name}"
        )
    for y in (1, 2, 3):
        ax.axhline(y, color="grey", lw=0.6, ls=":")
    if min(xs) > 0 and max(xs) / max(min(xs), 1) > 10:
        ax.set_xscale("log", base=2 if kind == "batch" else 10)
    ax.set_xlabel("batch size" if kind == "batch" else "depth")
    timed = any(k.startswith("time_ratio@") for k in rows[0])
    ax.set_ylabel("ratio (FLOPs; predicted time)" if timed else "FLOP ratio")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
