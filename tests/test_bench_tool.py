"""tools/bench_analysis.py, the benchmark issue 19's figures come from: its code paths run, and
what it records agrees with an independent count.

The timings themselves are not asserted (speed belongs in the benchmark's report, not in
tests); the FLOP totals and node counts it records are.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location(
        "bench_analysis", ROOT / "tools" / "bench_analysis.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_analysis"] = mod
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop("bench_analysis", None)


def test_child_flops_agree_with_flop_counter_mode(bench):
    """The zoo's MLP: FlopCounterMode's forward + backward total equals graphflop's matmul
    FLOPs (forward + backward), which the report sets side by side. By hand, models/mlp.py
    (784 -> 1024 -> 1024 -> 10 at its example batch, 64): forward 2*64*(784*1024 + 1024*1024
    + 1024*10) = 238,288,896; backward: the weight gradients again (238,288,896) and the
    input gradients of the second and third layers, 2*64*(1024*1024 + 1024*10) = 135,528,448
    (none for the first: the input needs no gradient); 612,106,240 in all."""
    name = "mlp"
    spec, kwargs, shapes, batch = bench.ZOO[name]
    r = bench.child(name, spec, kwargs, shapes, batch, repeat=1)
    assert r["fc_flops"] == r["mm_flops"] == 612_106_240
    assert r["nodes"]["forward"] > 0 and r["nodes"]["backward"] > 0 and r["nodes"]["jvp"] > 0
    assert set(r["median_s"]) == {"fc_fwd", "fc_fwd_bwd", "ours_full", "ours_fwd"}
    assert {"trace", "JVP", "VJP", "summary", "memory"} <= set(r["stages_s"])


def test_dispatch_recorder_counts_one_node_per_core_aten_op(bench):
    """``--floor``'s least tracer on one Linear(4, 3) at batch 2: by hand, three placeholders
    (weight, bias, input), the weight transposed (``t``, core ATen's ``permute``) and one ``addmm``:
    5 nodes (queries such as ``prim.device`` make none)."""
    model = nn.Linear(4, 3).to("meta")
    assert bench._record(model, (torch.empty(2, 4, device="meta"),)) == 5


def test_floor_times_every_variant(bench):
    spec, kwargs, shapes, batch = bench.ZOO["mlp"]
    got = bench.floor(spec, kwargs, shapes, batch, repeat=1)
    assert set(got) == {
        "FC fwd",
        "FC fwd+bwd",
        "graphflop trace",
        "plain make_fx fwd",
        "dispatch recorder fwd",
    }
    assert all(t > 0 for t in got.values())
