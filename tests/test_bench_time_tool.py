"""tools/bench_time.py, the benchmark docs/time.md's figures come from: how it maps eager
profiler events to graphflop's kernels and how it scores a prediction. No timing is asserted:
the events and times are made up, and the expected sums worked out by hand."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bt():
    spec = importlib.util.spec_from_file_location("bench_time", ROOT / "tools" / "bench_time.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_time"] = mod
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop("bench_time", None)


@dataclass
class Ev:
    """A stand-in for torch.profiler's FunctionEvent (the fields the tool reads)."""

    name: str
    cpu_time_total: float  # µs, children included
    cpu_children: list = field(default_factory=list)
    cpu_parent: object = None
    device_time_total: float = 0.0
    time_range: object = None  # .start, .end in µs


@dataclass
class Span:
    start: float
    end: float


def test_eager_names(bt):
    # the op and its in-place form (nn.ReLU(inplace=True) runs relu_)
    assert bt.eager_names("aten.addmm.default", "forward") == ("aten::addmm", "aten::addmm_")
    assert "aten::relu_" in bt.eager_names("aten.relu.default", "forward")
    back = bt.eager_names("aten.native_layer_norm.default", "backward")
    assert "aten::native_layer_norm_backward" in back
    assert "aten::_softmax_backward_data" in bt.eager_names("aten._softmax.default", "backward")
    bn = bt.eager_names("aten._native_batch_norm_legit_functional.default", "forward")
    assert "aten::native_batch_norm" in bn


def test_matched_events_count_once_with_their_children(bt):
    addmm = Ev("aten::addmm", 30.0, [Ev("aten::copy_", 5.0)])
    linear = Ev("aten::linear", 40.0, [Ev("aten::t", 2.0), addmm])
    relu = Ev("aten::relu", 7.0)
    fwd = Ev("phase:forward", 100.0, [linear, relu])
    mm = Ev("aten::mm", 20.0)
    node = Ev(
        "autograd::engine::evaluate_function: AddmmBackward0", 50.0, [mm, Ev("aten::mm", 21.0)]
    )
    bwd = Ev("phase:backward", 60.0, [node])
    upd = Ev("phase:update", 9.0, [Ev("aten::add_", 4.0), Ev("aten::add_", 3.0)])
    kernels = {
        "forward": {"aten::addmm": "aten.addmm.default", "aten::relu": "aten.relu.default"},
        "backward": {"aten::mm": "aten.mm.default"},
        "update": {"*": "optimizer.update"},
    }
    counts = {}
    sums = bt._op_sums([fwd, bwd, upd], kernels, cuda=False, counts=counts)
    # addmm's 30 µs include its copy_; linear and t are looked through; mm twice: 20 + 21;
    # the update whole: its phase's 9 µs (the in-place adds' 4 + 3 and the Python around them)
    assert sums == pytest.approx(
        {
            ("forward", "aten.addmm.default"): 30e-6,
            ("forward", "aten.relu.default"): 7e-6,
            ("backward", "aten.mm.default"): 41e-6,
            ("update", "optimizer.update"): 9e-6,
        }
    )
    # events matched: one addmm, one relu, two mm, the update phase once
    assert counts == {
        ("forward", "aten.addmm.default"): 1,
        ("forward", "aten.relu.default"): 1,
        ("backward", "aten.mm.default"): 2,
        ("update", "optimizer.update"): 1,
    }


def test_on_cuda_the_backward_threads_events_join_their_phase_by_time(bt):
    # on CUDA the autograd engine runs the backward on the device's own thread: its events have
    # no parent under phase:backward and are matched by the phase range that holds their start
    mm1 = Ev("aten::mm", 20.0, device_time_total=4.0)
    mm2 = Ev("aten::mm", 21.0, device_time_total=5.0)
    node = Ev(
        "autograd::engine::evaluate_function: AddmmBackward0", 50.0, [mm1, mm2],
        time_range=Span(150.0, 200.0),
    )  # fmt: skip
    late = Ev("aten::mm", 9.0, device_time_total=7.0, time_range=Span(400.0, 410.0))
    fwd = Ev("phase:forward", 100.0, [Ev("aten::relu", 7.0, device_time_total=1.5)])
    fwd.time_range = Span(0.0, 100.0)
    bwd = Ev("phase:backward", 200.0, time_range=Span(100.0, 300.0))
    upd = Ev("phase:update", 30.0, [Ev("aten::add_", 4.0)], device_time_total=2.0)
    upd.time_range = Span(300.0, 330.0)
    kernels = {
        "forward": {"aten::relu": "aten.relu.default"},
        "backward": {"aten::mm": "aten.mm.default"},
        "update": {"*": "optimizer.update"},
    }
    counts = {}
    events = [fwd, bwd, upd, node, late]
    sums = bt._op_sums(events, kernels, cuda=True, counts=counts)
    # kernels by device time: relu 1.5 µs; the two mm 4 + 5 (the one at 400 µs is outside
    # every phase: not counted); the update whole by the host's 30 µs, not its 2 µs of kernels
    assert sums == pytest.approx(
        {
            ("forward", "aten.relu.default"): 1.5e-6,
            ("backward", "aten.mm.default"): 9e-6,
            ("update", "optimizer.update"): 30e-6,
        }
    )
    assert counts[("backward", "aten.mm.default")] == 2


def test_compare_scores_ops_phases_and_step(bt):
    from graphflop.report import OpTime, PhaseTime, TimeReport

    def op(name, phase, seconds, flops):
        return OpTime(name, phase, 1, seconds, seconds, 0.0, 0.0, flops, 0, "compute")

    def ph(seconds):
        return PhaseTime(seconds, seconds, 0.0, 0.0, 1, 0)

    tr = TimeReport(
        device="d",
        title="d",
        source="calibrated",
        amp=None,
        phases=(("forward", ph(1.0)), ("backward", ph(2.0)), ("update", ph(0.5))),
        ratios=(),
        flop_ratios=(),
        ops=(op("a", "forward", 1.2, 300), op("b", "backward", 1.5, 100)),
    )
    m = bt.Measured(
        phase_s={"forward": [1.0] * 5, "backward": [2.5] * 5, "update": [0.5] * 5},
        op_s={("forward", "a"): [1.0, 1.0, 1.0], ("backward", "b"): [2.0, 2.0, 2.0]},
    )
    m.op_n[("forward", "a")] = [2, 3, 3]
    r = bt.compare(tr, m)
    # the median count of eager events matched per step; none recorded for b
    assert [o["measured_kernels"] for o in r["ops"]] == [3, None]
    # op errors: a (1.2 - 1.0)/1.0 = +0.2, b (1.5 - 2.0)/2.0 = -0.25; median of |e| = 0.225;
    # FLOP-weighted (300·0.2 + 100·0.25) / 400 = 0.2125
    assert [o["error"] for o in r["ops"]] == pytest.approx([0.2, -0.25])
    assert r["op_median_abs_error"] == pytest.approx(0.225)
    assert r["op_flop_weighted_abs_error"] == pytest.approx(0.2125)
    # step: predicted 1 + 2 + 0.5 = 3.5 against measured 1 + 2.5 + 0.5 = 4: -12.5%
    assert r["step"]["error"] == pytest.approx(-0.125)
    assert r["phases"]["backward"]["error"] == pytest.approx(-0.2)


def test_the_profilers_own_cost_comes_off_each_matched_event(bt, monkeypatch):
    # 0.5 µs inside each event, 2 µs per event recorded under it
    monkeypatch.setattr(bt, "PROFILER_COST", [0.5e-6, 2e-6])
    conv = Ev(
        "aten::convolution", 40.0, [Ev("aten::_convolution", 35.0, [Ev("aten::mkldnn", 30.0)])]
    )
    view = Ev("aten::view", 0.8)
    fwd = Ev("phase:forward", 100.0, [conv, view])
    kernels = {"forward": {"aten::convolution": "conv", "aten::view": "view"}}
    sums = bt._op_sums([fwd], kernels, cuda=False)
    # convolution: 40 µs less 0.5 for itself and 2 × 2 µs for its two descendants = 35.5 µs;
    # view: 0.8 - 0.5 = 0.3 µs is below half its time, so half: 0.4 µs
    assert sums == pytest.approx({("forward", "conv"): 35.5e-6, ("forward", "view"): 0.4e-6})


@pytest.mark.parametrize(
    ("name", "spec"),
    [
        ("NVIDIA H200", "h200"),  # torch.cuda.get_device_name on the lent H200 (2026-12-04)
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("NVIDIA GeForce RTX 4090", "rtx-4090"),
        ("Tesla T4", None),
    ],
)
def test_the_data_sheet_device_is_matched_from_the_gpus_name(bt, name, spec):
    assert bt.gpu_spec_for(name) == spec


def test_no_reversed_node_list_used_as_an_iterator():
    # torch 2.11's reversed(graph.nodes) is an iterable, not an iterator: next() on it raised
    # TypeError on the GPU machine (2026-12-04); next(iter(reversed(...))) works on 2.11-2.13
    bad = []
    for path in sorted((ROOT / "graphflop").rglob("*.py")) + sorted((ROOT / "tools").glob("*.py")):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if "next(reversed(" in line.replace(" ", ""):
                bad.append(f"{path.relative_to(ROOT)}:{i}")
    assert not bad, bad
