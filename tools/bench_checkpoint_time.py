"""Predicted against measured cost of activation checkpointing: graphflop's ``time.recompute``
(the forward kernels ``--checkpoint`` reruns in the backward, timed on a profile) against eager
train steps on this CPU with and without ``torch.utils.checkpoint(use_reentrant=False)`` around
the same modules, alternated step by step (docs/time.md, "Known limits").

    python tools/bench_checkpoint_time.py --profile cpu.json [--repeat 7] [--threads 1]

``--profile``: a profile from ``graphflop calibrate`` on this machine with the same thread
count. Prints one line per model: the measured steps (median and quartiles), their difference,
and the predicted train step and recompute.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.utils.checkpoint as tuc

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_time import _inputs  # noqa: E402

from graphflop.analysis import analyze  # noqa: E402
from graphflop.frontend.loss import loss_output, loss_value  # noqa: E402
from graphflop.load import load  # noqa: E402
from graphflop.meta import LOSS_KIND, SIGNATURE  # noqa: E402
from graphflop.passes.time_profile import load_profile  # noqa: E402
from graphflop.runtime.verify import real_arguments  # noqa: E402

#: (model spec, input shape, checkpoint pattern): consecutive blocks, and layers that rerun
#: nothing (a linear layer saves only its inputs)
CASES = (
    ("models/gpt2.py:gpt2_small", (1, 128), r"re:h\.\d+$"),
    ("models/resnet.py:resnet18", (8, 3, 224, 224), r"re:layer\d\.\d$"),
    ("models/mlp.py", (64, 1, 28, 28), r"re:layers\.fc\d$"),
)


@contextmanager
def checkpointed(model: torch.nn.Module, names: list[str]):
    """The modules ``names`` of ``model`` run under ``checkpoint(use_reentrant=False)``."""
    mods = dict(model.named_modules())
    saved = {}
    for n in names:
        f = mods[n].forward
        saved[n] = f
        mods[n].forward = lambda *a, _f=f, **k: tuc.checkpoint(_f, *a, use_reentrant=False, **k)
    try:
        yield
    finally:
        for n, f in saved.items():
            mods[n].forward = f


def _q(xs: list[float]) -> str:
    q = statistics.quantiles(xs, n=4)
    return f"{statistics.median(xs) * 1e3:,.1f} ({q[0] * 1e3:,.1f}-{q[2] * 1e3:,.1f})"


def run_case(spec: str, shape: tuple[int, ...], pattern: str, prof: Any, repeat: int) -> None:
    model = load(spec).model.train()
    xs = _inputs(spec, shape, model)
    a = analyze(model, xs, jvp=False, checkpoint=pattern, time_profile=prof)
    tr = a.report.time
    rerun = dict(tr.recompute)["checkpoint"]
    step = tr.phase("train_step").seconds
    fwd = a.forward
    kind = fwd.meta.get(LOSS_KIND, "sum")
    kind = kind if kind in ("cross_entropy", "mse") else "sum"
    args = real_arguments(fwd, model, seed=0)
    targets = tuple(args[n] for n in fwd.meta[SIGNATURE].targets[:1])
    names = [n for n, _ in model.named_modules() if n and re.fullmatch(pattern[3:], n)]
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def one() -> float:
        t0 = time.perf_counter()
        loss = loss_value(kind, loss_output(model(*xs)), targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    plain: list[float] = []
    ck: list[float] = []
    for _ in range(repeat):  # alternated: a change of load moves both alike
        one()
        plain.append(one())
        with checkpointed(model, names):
            one()
            ck.append(one())
    extra = statistics.median(ck) - statistics.median(plain)
    print(
        f"{spec} {'×'.join(map(str, shape))}, {len(names)} modules checkpointed: measured step "
        f"{_q(plain)} ms, checkpointed {_q(ck)} ms, +{extra * 1e3:,.1f} ms; predicted step "
        f"{step * 1e3:,.1f} ms, +{rerun * 1e3:,.1f} ms ({100 * (rerun - extra) / extra:+.0f}%)"
        if extra > 0
        else f"{spec}: measured +{extra * 1e3:,.2f} ms, predicted +{rerun * 1e3:,.2f} ms",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True, help="a profile from graphflop calibrate")
    ap.add_argument("--repeat", type=int, default=7, help="alternated step pairs (default 7)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    prof = load_profile(args.profile)
    for spec, shape, pattern in CASES:
        run_case(spec, shape, pattern, prof, max(args.repeat, 3))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
