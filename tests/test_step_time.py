"""The time pass (graphflop.passes.step_time) against hand arithmetic on a data-sheet device, its
bounds and eager kernels, the report's ``time`` section, the profile file, and ``graphflop
calibrate`` / ``inspect --device`` (bad input included). No timing assertions: the calibration
test checks only that the file it writes parses and is accepted."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics

import pytest
import torch
from conftest import cli, spec
from torch import nn

from graphflop.analysis import analyze
from graphflop.devices import NoPeak, UnknownDevice, device_spec
from graphflop.export.report import time_lines
from graphflop.meta import COMPOSITE, COST, INPLACE, KIND, SOURCE, TIME
from graphflop.passes.time_profile import (
    CONTRACTED,
    WIDE,
    ProfileError,
    RateCurve,
    TimeProfile,
    default_cpu_profile,
    from_device,
    load_profile,
    resolve_profile,
    save_profile,
)
from graphflop.report import Report, TimeReport

H100 = from_device(device_spec("h100-sxm"))


class MatMul(nn.Module):
    def __init__(self, n: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(n, n, dtype=dtype, device="meta"))

    def forward(self, x):
        return x @ self.w


class Add(nn.Module):
    def forward(self, x, y):
        return x + y


def _node(a, target):
    return next(n for n in a.forward.graph.nodes if n.target == target)


def test_matmul_is_compute_bound_by_hand():
    n = 8192
    x = torch.empty(n, n, dtype=torch.bfloat16, device="meta")
    a = analyze(MatMul(n, torch.bfloat16), x, backward=False, jvp=False, time_profile=H100)
    t = _node(a, torch.ops.aten.mm.default).meta[TIME]
    # FLOPs 2·8192³ = 1.0995e12; achieved rate 989.4e12 × 0.70 = 692.58e12 FLOP/s with a 5 µs
    # fill: compute = 1.0995e12 / 692.58e12 + 5e-6 = 1.58756e-3 + 5e-6 s
    flops = 2 * n**3
    compute = flops / (989.4e12 * 0.70) + 5e-6
    # bytes 3 × 8192² × 2 = 402.65e6 at 3.35e12 × 0.85 = 2.8475e12 B/s, 2 µs fill
    memory = 3 * n * n * 2 / (3.35e12 * 0.85) + 2e-6
    assert t.compute_s == pytest.approx(compute, rel=1e-9)
    assert t.memory_s == pytest.approx(memory, rel=1e-9)
    assert t.overhead_s == pytest.approx(6e-6)
    assert t.seconds == pytest.approx(compute + 6e-6, rel=1e-9)
    assert (t.bound, t.op_class, t.dtype) == ("compute", "matmul", "bfloat16")


def test_add_is_memory_bound_by_hand():
    n = 1 << 24
    x = torch.empty(n, device="meta")
    a = analyze(Add(), (x, x), backward=False, jvp=False, loss="sum", time_profile=H100)
    t = _node(a, torch.ops.aten.add.Tensor).meta[TIME]
    # bytes: read 2 × 4 × 2^24, write 4 × 2^24 = 201.3e6 B at 2.8475e12 B/s, 2 µs fill
    memory = 3 * 4 * n / (3.35e12 * 0.85) + 2e-6
    # FLOPs 2^24 at the vector rate 66.9e12 × 0.5, 2 µs fill
    compute = n / (66.9e12 * 0.5) + 2e-6
    assert t.memory_s == pytest.approx(memory, rel=1e-9)
    assert t.compute_s == pytest.approx(compute, rel=1e-9)
    assert t.seconds == pytest.approx(memory + 6e-6, rel=1e-9)
    assert t.bound == "memory"


def test_tiny_add_is_overhead_bound_and_amp_picks_the_bf16_peak():
    x = torch.empty(4, device="meta")
    a = analyze(Add(), (x, x), backward=False, jvp=False, loss="sum", time_profile=H100)
    t = _node(a, torch.ops.aten.add.Tensor).meta[TIME]
    assert t.bound == "overhead"  # 6 µs launch > 2 µs fill + 48 B
    n = 4096
    x32 = torch.empty(n, n, device="meta")
    plain = analyze(MatMul(n, torch.float32), x32, backward=False, jvp=False, time_profile=H100)
    amp = analyze(MatMul(n, torch.float32), x32, jvp=False, time_profile=H100, amp="bf16")
    t32 = _node(plain, torch.ops.aten.mm.default).meta[TIME]
    t16 = _node(amp, torch.ops.aten.mm.default).meta[TIME]
    assert (t32.dtype, t16.dtype) == ("float32", "bfloat16")
    # 2·4096³ FLOPs at 66.9e12 × 0.7 against 989.4e12 × 0.7 (5 µs fill each)
    assert t32.compute_s == pytest.approx(2 * n**3 / (66.9e12 * 0.7) + 5e-6, rel=1e-9)
    assert t16.compute_s == pytest.approx(2 * n**3 / (989.4e12 * 0.7) + 5e-6, rel=1e-9)


class TwoAdds(nn.Module):
    def forward(self, x):
        y = x + x
        return y + y


@pytest.mark.parametrize("n", [1 << 24, 4])
def test_a_gpu_phase_overlaps_host_overhead_with_device_work(n):
    # the forward phase runs three kernels: x + x, y + y and the loss's sum. The host issues
    # each in 6 µs (H100's launch); the device runs kernel i in w_i seconds from when it is
    # issued and the device is free: host 6, 12, 18 µs; device d1 = 6 + w1,
    # d2 = max(d1, 12) + w2, d3 = max(d2, 18) + w3. Large (w = bytes / 2.8475e12 B/s + 2 µs,
    # 72.7 µs per add): d3 = 6 + w1 + w2 + w3, the last two launches hidden (12 µs). Tiny
    # (w = 2 µs fill + a few bytes): d3 = 18 + w3, the first two kernels' work hidden.
    x = torch.empty(n, device="meta")
    a = analyze(TwoAdds(), x, backward=False, jvp=False, loss="sum", time_profile=H100)
    timed = [nd.meta[TIME] for nd in a.forward.graph.nodes if TIME in nd.meta]
    assert len(timed) == 3 and all(t.overhead_s == pytest.approx(6e-6) for t in timed)
    w1, w2, w3 = (t.seconds - t.overhead_s for t in timed)
    fwd = a.report.time.phase("forward")
    if n > 4:
        assert w1 > 6e-6 and w2 > 6e-6
        expected, hidden = 6e-6 + w1 + w2 + w3, 12e-6
    else:
        assert w1 < 6e-6 and w2 < 6e-6
        expected, hidden = 18e-6 + w3, w1 + w2
    assert fwd.seconds == pytest.approx(expected, rel=1e-9)
    assert fwd.overlap_s == pytest.approx(hidden, rel=1e-9)
    assert fwd.compute_s + fwd.memory_s + fwd.overhead_s == pytest.approx(18e-6 + w1 + w2 + w3)
    cpu = analyze(TwoAdds(), x, backward=False, jvp=False, loss="sum",
                  time_profile=default_cpu_profile(1))  # fmt: skip
    cpu_fwd = cpu.report.time.phase("forward")
    assert cpu_fwd.overlap_s == 0.0  # a CPU runs its kernels one after the other
    assert cpu_fwd.seconds == pytest.approx(
        cpu_fwd.compute_s + cpu_fwd.memory_s + cpu_fwd.overhead_s
    )


def test_a_composite_op_is_one_eager_kernel():
    model = nn.Sequential(nn.Linear(16, 16, device="meta"), nn.LayerNorm(16, device="meta"))
    x = torch.empty(8, 16, device="meta")
    a = analyze(model, x, time_profile=H100)
    ln = [n for n in a.forward.graph.nodes if COMPOSITE in n.meta and TIME in n.meta]
    ln = [n for n in ln if n.meta[COMPOSITE].op == "aten.native_layer_norm.default"]
    assert len(ln) > 3  # decomposed into several nodes
    assert len({n.meta[TIME].kernel_id for n in ln}) == 1
    # one launch overhead for the whole kernel, split among its nodes
    assert sum(n.meta[TIME].overhead_s for n in ln) == pytest.approx(6e-6)
    ops = {(o.phase, o.op): o for o in a.report.time.ops}
    assert ops[("forward", "aten.native_layer_norm.default")].kernels == 1
    assert ops[("backward", "aten.native_layer_norm.default")].kernels == 1


def test_time_section_keys_ratios_and_round_trip():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    a = analyze(model, torch.randn(8, 32), time_profile=H100)
    doc = json.loads(json.dumps(a.to_dict()))
    assert list(doc["time"]) == [
        "device",
        "title",
        "source",
        "amp",
        "phases",
        "ratios",
        "flop_ratios",
        "layers",
        "ops",
        "memory_bytes",  # the H100 SXM's 80 GiB (a data sheet knows it)
    ]
    assert doc["time"]["memory_bytes"] == 80 * 2**30
    phases = doc["time"]["phases"]
    assert list(phases) == [
        "forward",
        "loss",
        "backward",
        "update",
        "train_step",
        "jvp",
        "forward_gradient_step",
    ]
    for p in phases.values():
        parts = p["compute_s"] + p["memory_s"] + p["overhead_s"] + p["host_s"]
        assert p["seconds"] == pytest.approx(parts - p["overlap_s"])
    step = phases["train_step"]["seconds"]
    parts = sum(phases[k]["seconds"] for k in ("forward", "backward", "update"))
    assert step == pytest.approx(parts)
    assert doc["time"]["ratios"]["Rb"] == pytest.approx(step / phases["forward"]["seconds"])
    assert doc["time"]["flop_ratios"]["Rb"] == pytest.approx(doc["ratios"]["train_step_forward"])
    assert Report.from_dict(doc) == a.report
    plain = analyze(model, torch.randn(8, 32))
    assert "time" not in plain.to_dict()


def test_profile_file_round_trip_and_errors(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(save_profile(H100))
    assert load_profile(f) == H100
    assert resolve_profile(str(f)) == H100
    f.write_text('{"kind": "graphflop-time-profile", "schema_version": 7}')
    with pytest.raises(ProfileError, match="schema_version 7"):
        load_profile(f)
    with pytest.raises(ValueError, match="sizes must increase"):
        RateCurve(((2.0, 1.0), (1.0, 1.0)))
    assert RateCurve(((1.0, 1.0), (100.0, 100.0))).rate(10.0) == pytest.approx(10.0)


def _fp32_only(tmp_path):
    one = RateCurve(((1.0, 1e9),))
    p = TimeProfile(
        name="tiny",
        title="tiny",
        source="calibrated",
        kind="cpu",
        compute={"matmul": {"float32": one}, "conv": {"float32": one}, "other": {"float32": one}},
        bandwidth=one,
        launch_overhead_s=1e-6,
        view_overhead_s=1e-7,
    )
    f = tmp_path / "tiny.json"
    f.write_text(save_profile(p))
    return p, f


def test_no_peak_for_a_dtype(tmp_path):
    p, _ = _fp32_only(tmp_path)
    x = torch.empty(8, 8, dtype=torch.float64, device="meta")
    with pytest.raises(
        NoPeak, match="^tiny has no float64 peak for matmul kernels: it has float32$"
    ):
        analyze(MatMul(8, torch.float64), x, backward=False, jvp=False, time_profile=p)


def test_no_peak_lists_every_data_sheet_dtype():
    # l4's data sheet: float32, tf32, bfloat16, float16, float8, int8, no float64; the time
    # profile runs float32 products at the FP32 rate, so its own list lacks tf32 and says why
    x = torch.empty(8, 8, dtype=torch.float64, device="meta")
    with pytest.raises(NoPeak) as e:
        analyze(
            MatMul(8, torch.float64),
            x,
            backward=False,
            jvp=False,
            time_profile=resolve_profile("l4"),
        )
    assert str(e.value) == (
        "l4 has no float64 peak for matmul kernels: it has float32, bfloat16, float16, float8, "
        "int8 (its data sheet's tf32 peak is not used: float32 matrix products are counted at "
        "the FP32 rate, TF32 off)"
    )
    assert all(d in str(e.value).split(": it has ")[1] for d in device_spec("l4").peak_flops)


def test_cli_bad_device_input(capsys, tmp_path, monkeypatch):
    mlp = spec("mlp.py")
    rc, out, err = cli(capsys, "inspect", mlp, "--device", "h100-sx")
    assert (rc, out) == (2, "")
    # the device table's own message (known devices, did-you-mean), then the other choices
    with pytest.raises(UnknownDevice) as e:
        device_spec("h100-sx")
    assert "h100-sxm" in str(e.value)
    assert err == [
        f"graphflop: error: {e.value}; or cpu, or a profile file from graphflop calibrate"
    ]
    bad = tmp_path / "bad.json"
    bad.write_text('{"a":')
    js = tmp_path / "out.json"
    rc, out, err = cli(capsys, "inspect", mlp, "--device", bad, "--json", js)
    assert (rc, out) == (2, "") and not js.exists()
    assert err == [f"graphflop: error: time profile {bad} is not JSON (line 1: Expecting value)"]
    _, tiny = _fp32_only(tmp_path)
    rc, out, err = cli(capsys, "inspect", mlp, "--device", tiny, "--amp", "bf16", "--json", js)
    assert (rc, out) == (2, "") and not js.exists()
    assert err == ["graphflop: error: tiny has no bfloat16 peak for matmul kernels: it has float32"]
    # a file named like a device in the current folder does not shadow the data sheet (tester);
    # a path to it reads the file
    monkeypatch.chdir(tmp_path)
    (tmp_path / "h100").write_text("not a profile")
    assert resolve_profile("h100") == H100
    with pytest.raises(ProfileError, match="not JSON"):
        resolve_profile(os.path.join(".", "h100"))


def test_calibrate_quick_writes_a_profile_inspect_accepts(capsys, tmp_path):
    prof = tmp_path / "cpu.json"
    rc, _, err = cli(capsys, "calibrate", "--quick", "--threads", "1", "-o", prof)
    assert rc == 0, err
    assert "--quick measures few, small points" in " ".join(err)  # for tests: it says so
    p = load_profile(prof)
    assert (p.source, p.kind, p.threads) == ("calibrated", "cpu", 1)
    assert {"matmul", "conv", "transcendental", "other"} <= set(p.compute)
    # fresh pages cost more to write than reused ones (page faults on first touch: Linux)
    assert p.fault_s_per_byte > 0
    js = tmp_path / "r.json"
    rc, out, err = cli(capsys, "inspect", spec("mlp.py"), "--device", prof, "--json", js)
    assert rc == 0, err
    assert "predicted time on" in out
    doc = json.loads(js.read_text())
    assert doc["time"]["device"] == p.name and doc["time"]["source"] == "calibrated"
    rc, _, err = cli(capsys, "calibrate", "--quick", "-o", tmp_path / "p.txt")
    assert rc == 2 and err == [
        f"graphflop: error: --out {tmp_path / 'p.txt'}: unsupported suffix; use one of .json"
    ]
    # more threads than cores: one line (OpenMP aborted the process at 99,999: tester)
    cores = os.cpu_count() or 1
    rc, _, err = cli(
        capsys, "calibrate", "--quick", "--threads", "99999", "-o", tmp_path / "t.json"
    )
    assert rc == 2 and err == [
        f"graphflop: error: bad --threads 99999: give 1 to {cores} (this machine's cores)"
    ]
    assert not (tmp_path / "t.json").exists()
    # an nn.Module call costs more than the F.linear it wraps (1-3 µs on this CPU)
    assert p.module_call_s > 0


def test_the_layer_csv_has_the_predicted_times(capsys, tmp_path):
    # tester's finding: --csv had no time columns where the per-layer table shows them; each
    # row's times equal the JSON's time.layers row of the same module
    import csv

    out, js = tmp_path / "l.csv", tmp_path / "l.json"
    rc, _, err = cli(capsys, "inspect", spec("mlp.py"), "--device", "h100", "--csv", out,
                     "--json", js)  # fmt: skip
    assert rc == 0, err
    rows = list(csv.DictReader(out.open()))
    layers = {t["name"]: t for t in json.loads(js.read_text())["time"]["layers"]}
    assert rows and {r["name"] for r in rows} == set(layers)
    for r in rows:
        t = layers[r["name"]]
        for k in ("forward_s", "backward_s", "update_s", "jvp_s"):
            assert float(r[f"time_{k}"]) == pytest.approx(t[k])
        assert r["time_bound"] == t["bound"]
    rc, _, err = cli(capsys, "inspect", spec("mlp.py"), "--csv", out)  # no --device: no times
    assert rc == 0 and not any(c.startswith("time_") for c in next(csv.reader(out.open())))


def test_sweep_gives_the_ratio_in_time_per_device(capsys, tmp_path):
    js = tmp_path / "s.json"
    rc, out, err = cli(
        capsys, "sweep", spec("mlp.py"), "--batches", "1,64", "--device", "h100-sxm",
        "--device", "cpu", "--json", js,
    )  # fmt: skip
    assert rc == 0, err
    rows = json.loads(js.read_text())
    for r in rows:
        for name in ("h100-sxm", "cpu"):
            # (backward + update) / forward in predicted seconds, from the same row's times
            step, fwd = r[f"train_step_s@{name}"], r[f"forward_s@{name}"]
            assert r[f"time_ratio@{name}"] == pytest.approx((step - fwd) / fwd)
    rc, out, err = cli(capsys, "sweep", spec("mlp.py"), "--batches", "1", "--device", "h100-sxm",
                       "--device", "H100-SXM")  # fmt: skip
    assert (rc, err) == (
        2,
        [
            "graphflop: error: --device gives h100-sxm twice (a profile's name, shown in the "
            "plot's legend): give each device once, or name calibrated profiles apart with "
            "graphflop calibrate --name"
        ],
    )


def test_sweep_times_each_point_under_autocast(capsys, tmp_path):
    """sweep --amp bf16: each point's step time is inspect's under --amp bf16 on the same
    device (the same time pass), different from float32's; --amp without --device: exit 2."""
    from graphflop.load import load, make_inputs

    js = tmp_path / "s.json"
    args = ("sweep", spec("gpt2.py:gpt2_small"), "--batches", "1", "--device", "h100-sxm")
    rc, out, err = cli(capsys, *args, "--amp", "bf16", "--json", js)
    assert rc == 0, err
    (row,) = json.loads(js.read_text())
    loaded = load(spec("gpt2.py:gpt2_small"), meta=True)
    loaded.model.train()
    inputs = make_inputs(loaded, batch=1)
    a = analyze(loaded.model, inputs, jvp=False, amp="bf16", time_profile=H100)
    assert row["train_step_s@h100-sxm"] == pytest.approx(a.report.time.phase("train_step").seconds)
    fp32 = analyze(loaded.model, inputs, jvp=False, time_profile=H100).report.time
    assert row["train_step_s@h100-sxm"] < 0.8 * fp32.phase("train_step").seconds
    rc, out, err = cli(capsys, "sweep", spec("mlp.py"), "--batches", "1", "--amp", "bf16")
    assert rc == 2 and "give --device too" in " ".join(err)


def test_render_colours_nodes_by_predicted_time(capsys, tmp_path):
    dot = tmp_path / "g.dot"
    rc, out, err = cli(capsys, "render", spec("mlp.py"), "-o", dot, "--device", "h100-sxm",
                       "--color", "time", "--graph", "forward")  # fmt: skip
    assert rc == 0, err
    text = dot.read_text()
    assert "predicted time per node on h100-sxm" in text
    assert "compute" in text and "overhead" in text  # each op's bound in its label
    rc, out, err = cli(capsys, "render", spec("mlp.py"), "-o", tmp_path / "h.dot",
                       "--color", "time")  # fmt: skip
    assert (rc, err) == (
        2,
        ["graphflop: error: --color time fills boxes with predicted time: add --device NAME|FILE"],
    )
    assert not (tmp_path / "h.dot").exists()


def test_a_thin_product_takes_the_thin_rate():
    fast, slow = RateCurve(((1.0, 1e9),)), RateCurve(((1.0, 1e8),))
    p = TimeProfile(
        name="two",
        title="two",
        source="calibrated",
        kind="cpu",
        compute={
            "matmul": {"float32": fast},
            "matmul_thin": {"float32": slow},
            "conv": {"float32": fast},
            "other": {"float32": fast},
        },
        bandwidth=RateCurve(((1.0, 1e12),)),
        launch_overhead_s=0.0,
        view_overhead_s=0.0,
    )
    thin = analyze(MatMul(512, torch.float32), torch.empty(64, 512, device="meta"),
                   backward=False, jvp=False, time_profile=p)  # fmt: skip
    square = analyze(MatMul(512, torch.float32), torch.empty(512, 512, device="meta"),
                     backward=False, jvp=False, time_profile=p)  # fmt: skip
    t = _node(thin, torch.ops.aten.mm.default).meta[TIME]
    # 64 rows <= THIN_ROWS (128): 2·64·512·512 FLOPs at 1e8 FLOP/s
    assert (t.op_class, t.compute_s) == ("matmul_thin", pytest.approx(2 * 64 * 512 * 512 / 1e8))
    t = _node(square, torch.ops.aten.mm.default).meta[TIME]
    assert (t.op_class, t.compute_s) == ("matmul", pytest.approx(2 * 512**3 / 1e9))


def _profile(**kw):
    flat = RateCurve(((1.0, 1e9),))
    base = dict(
        name="hand",
        title="hand",
        source="calibrated",
        kind="cpu",
        compute={
            "matmul": {"float32": flat},
            "conv": {"float32": flat},
            "other": {"float32": flat},
        },
        bandwidth=RateCurve(((1.0, 1e15),)),
        launch_overhead_s=0.0,
        view_overhead_s=0.0,
    )
    return TimeProfile(**{**base, **kw})


def test_a_product_takes_the_rate_of_its_smallest_dimension():
    # rates measured at smallest dimension 16 (1e8 FLOP/s) and 256 (1e10 FLOP/s)
    shaped = {
        "matmul": {
            "float32": ((16.0, RateCurve(((1.0, 1e8),))), (256.0, RateCurve(((1.0, 1e10),))))
        }
    }
    p = _profile(shaped=shaped)
    a = analyze(MatMul(512, torch.float32), torch.empty(64, 512, device="meta"),
                backward=False, jvp=False, time_profile=p)  # fmt: skip
    t = _node(a, torch.ops.aten.mm.default).meta[TIME]
    # 64 × 512 @ 512 × 512: smallest dimension 64, log(64/16) / log(256/16) = 1/2 of the way
    # from 1e8 to 1e10 in log rate: 1e9 FLOP/s; 2·64·512·512 FLOPs
    assert t.compute_s == pytest.approx(2 * 64 * 512 * 512 / 1e9)
    # beyond the ends the nearest curve holds: 8 rows at 1e8, 512 rows at 1e10
    assert p.gemm_seconds("matmul", "float32", 1e6, 8) == pytest.approx(1e6 / 1e8)
    assert p.gemm_seconds("matmul", "float32", 1e6, 512) == pytest.approx(1e6 / 1e10)
    # the round trip through the profile file keeps the curves
    q = TimeProfile.from_dict(json.loads(save_profile(p)))
    assert q.gemm_seconds("matmul", "float32", 1e6, 64) == pytest.approx(1e6 / 1e9)


def test_a_backward_convolution_takes_the_conv_backward_rate():
    from graphflop.passes.step_time import _mm_class

    p = _profile(
        compute={
            "matmul": {"float32": RateCurve(((1.0, 1e9),))},
            "conv": {"float32": RateCurve(((1.0, 2e9),))},
            "conv_backward": {"float32": RateCurve(((1.0, 1e9),))},
            "other": {"float32": RateCurve(((1.0, 1e12),))},
        }
    )
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False, device="meta"))
    a = analyze(model, torch.empty(2, 3, 8, 8, device="meta"), jvp=False, time_profile=p)
    fwd = _node(a, torch.ops.aten.convolution.default)
    # forward output 2 × 8 × 8 × 8: implicit GEMM M = 2·8·8 = 128 pixels, N = 8 channels out,
    # K = 3·3·3 = 27; FLOPs 2·128·8·27 = 55296 at 2e9
    assert _mm_class(fwd) == ("conv", 8.0)
    assert fwd.meta[TIME].compute_s == pytest.approx(55296 / 2e9)
    bwd = [n for n in a.backward.graph.nodes if n.target == torch.ops.aten.convolution.default]
    assert bwd  # the weight gradient (the input needs none)
    for n in bwd:
        assert _mm_class(n)[0] == "conv_backward"
        flops = n.meta[COST].mm_flops
        assert n.meta[TIME].compute_s == pytest.approx(flops / 1e9)
    # a profile without conv_backward times them at the conv rate
    plain = _profile()
    assert plain.curve("conv_backward", "float32") is plain.curve("conv", "float32")
    # the JVP's tangent convolution (conv(ẋ, W) + conv(x, Ẇ): tester's finding, it was timed
    # at the backward rate) runs as a forward convolution: 55296 FLOPs at 2e9
    j = analyze(model, torch.empty(2, 3, 8, 8, device="meta"), time_profile=p)
    tangent = [
        n for n in j.jvp.graph.nodes
        if n.target == torch.ops.aten.convolution.default and n.meta.get(KIND) == "tangent"
    ]  # fmt: skip
    assert tangent
    for n in tangent:
        assert _mm_class(n)[0] == "conv"
        assert n.meta[TIME].compute_s == pytest.approx(n.meta[COST].mm_flops / 2e9)


def test_the_update_takes_the_measured_optimizer_step():
    step = RateCurve(((1.0, 1e9),), fill_s=1e-5)
    p = _profile(updates={"adam": step})
    model = nn.Linear(16, 16, bias=False, device="meta")
    a = analyze(model, torch.empty(4, 16, device="meta"), jvp=False, optimizer="adam",
                time_profile=p)  # fmt: skip
    nodes = [n for n in a.update.graph.nodes if TIME in n.meta]
    assert len({n.meta[TIME].kernel_id for n in nodes}) == 1  # one parameter, one kernel
    # the weight: 16·16·4 = 1024 bytes at 1e9 B/s, plus 10 µs per parameter
    assert sum(n.meta[TIME].seconds for n in nodes) == pytest.approx(1024 / 1e9 + 1e-5)
    assert sum(n.meta[TIME].overhead_s for n in nodes) == pytest.approx(1e-5)
    # an optimizer the profile did not measure: the in-place kernel as before
    b = analyze(model, torch.empty(4, 16, device="meta"), jvp=False, optimizer="sgd",
                time_profile=p)  # fmt: skip
    nodes = [n for n in b.update.graph.nodes if TIME in n.meta]
    assert sum(n.meta[TIME].overhead_s for n in nodes) == pytest.approx(0.0)


def test_a_convolution_backward_is_one_eager_kernel():
    p = _profile(
        compute={
            "matmul": {"float32": RateCurve(((1.0, 1e9),))},
            "conv": {"float32": RateCurve(((1.0, 1e9),))},
            "conv_backward": {"float32": RateCurve(((1.0, 1e9),))},
            "other": {"float32": RateCurve(((1.0, 1e9),))},
        }
    )
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, device="meta"),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, device="meta"),
    )
    a = analyze(model, torch.empty(2, 3, 8, 8, device="meta"), jvp=False, time_profile=p)
    second = [n for n in a.forward.graph.nodes if n.target == torch.ops.aten.convolution.default][1]
    nodes = [n for n in a.backward.graph.nodes if n.meta.get(SOURCE) == second.name]
    assert len({n.meta[TIME].kernel_id for n in nodes if TIME in n.meta}) == 1
    # input gradient and weight gradient, 2·(2·8·8·8)·(8·3·3) = 147456 FLOPs each, and the
    # bias gradient's sum over 2·8·8 pixels of 8 channels (2·8·8·8 = 1024 elements, 1 FLOP
    # each): 2·147456 + 1024 FLOPs at 1e9 FLOP/s, one launch (0 s here)
    flops = sum(n.meta[COST].flops for n in nodes)
    assert flops == 2 * 147456 + 1024
    assert sum(n.meta[TIME].compute_s for n in nodes) == pytest.approx(flops / 1e9)
    ops = {(o.phase, o.op): o for o in a.report.time.ops}
    # two convolutions: two convolution_backward kernels (the first computes no input gradient)
    assert ops[("backward", "aten.convolution.default")].kernels == 2
    assert ("backward", "aten.sum.dim_IntList") not in ops


def test_each_kernel_kind_takes_its_fixed_cost():
    # fixed costs by kind: gelu's forward kernel 7 µs, its backward kernel 11 µs, every other
    # kernel that moves bytes 3 µs, every view 1 µs; rates so fast the work is ~0
    fixed = {
        "aten.gelu.default": 7e-6,
        "aten.gelu.default/backward": 11e-6,
        "*": 3e-6,
        "*view": 1e-6,
    }
    fast = RateCurve(((1.0, 1e18),))
    p = _profile(
        compute={"matmul": {"float32": fast}, "other": {"float32": fast}},
        bandwidth=fast,
        launch_overhead_s=100e-6,
        view_overhead_s=100e-6,
        fixed=fixed,
    )
    model = nn.Sequential(nn.Linear(8, 8, device="meta"), nn.GELU())
    a = analyze(model, torch.empty(4, 8, device="meta"), jvp=False, time_profile=p)
    kernels = {}
    for gm, phase in ((a.forward, "forward"), (a.backward, "backward")):
        for n in gm.graph.nodes:
            t = n.meta.get(TIME)
            if t is not None:
                kernels.setdefault((phase, t.kernel, t.kernel_id), 0.0)
                kernels[(phase, t.kernel, t.kernel_id)] += t.overhead_s
    gelu = [v for (ph, op, _), v in kernels.items() if op == "aten.gelu.default"]
    # one gelu kernel in the forward (7 µs), one for its backward (11 µs)
    fwd = [v for (ph, op, _), v in kernels.items() if op == "aten.gelu.default" and ph == "forward"]
    bwd = [
        v for (ph, op, _), v in kernels.items() if op == "aten.gelu.default" and ph == "backward"
    ]
    assert len(gelu) == 2
    assert fwd == [pytest.approx(7e-6)] and bwd == [pytest.approx(11e-6)]
    # the linear layer's addmm (not measured by kind): the '*' entry, 3 µs
    addmm = [v for (ph, op, _), v in kernels.items() if op == "aten.addmm.default"]
    assert addmm == [pytest.approx(3e-6)]
    # views (the weight's transpose): the '*view' entry, 1 µs each
    views = [
        v for (ph, op, _), v in kernels.items() if op in ("aten.t.default", "aten.view.default")
    ]
    assert views and all(v == pytest.approx(1e-6) for v in views)
    # without the table, the launch and view overheads as before (100 µs each)
    assert p.fixed_cost("aten.gelu.default", forward=False) == pytest.approx(11e-6)
    assert p.fixed_cost("aten.relu.default") == pytest.approx(3e-6)
    plain = _profile(launch_overhead_s=5e-6, view_overhead_s=2e-6)
    assert plain.fixed_cost("aten.gelu.default") == pytest.approx(5e-6)
    assert plain.fixed_cost("aten.view.default", view=True) == pytest.approx(2e-6)
    # the table survives the profile file
    q = TimeProfile.from_dict(json.loads(save_profile(p)))
    assert q.fixed == fixed


def test_a_view_the_autograd_engine_runs_takes_the_engines_figure():
    # views in a backward (the engine's, from C++) have their own entries: a reshape 2 µs, any
    # other view 3 µs; the Python-side figures (view 6 µs, any view 7 µs) serve the forward
    fixed = {
        "aten.view.default": 6e-6,
        "aten.reshape.default/backward": 2e-6,
        "*view/backward": 3e-6,
        "*view": 7e-6,
        "*": 9e-6,
    }
    p = _profile(launch_overhead_s=100e-6, view_overhead_s=100e-6, fixed=fixed)
    assert p.fixed_cost("aten.view.default", view=True) == pytest.approx(6e-6)
    assert p.fixed_cost("aten.t.default", view=True) == pytest.approx(7e-6)
    back = dict(forward=False, view=True, engine=True)
    assert p.fixed_cost("aten.reshape.default", **back) == pytest.approx(2e-6)
    # a kind the engine's probe did not run: the engine's median view, not the Python figure
    assert p.fixed_cost("aten.view.default", **back) == pytest.approx(3e-6)
    # a JVP's tangent views run outside the engine: the Python-side figures
    assert p.fixed_cost("aten.reshape.default", forward=False, view=True) == pytest.approx(7e-6)
    assert p.fixed_cost("aten.view.default", forward=False, view=True) == pytest.approx(6e-6)
    # a backward kernel that moves bytes is no view: the '*' entry
    assert p.fixed_cost("aten.mul.Tensor", forward=False) == pytest.approx(9e-6)


def test_calibrate_times_the_views_the_autograd_engine_runs():
    from graphflop.runtime.calibrate import _Run, _timer, plan

    dev = torch.device("cpu")
    run = _Run(dev, plan(quick=True), _timer(dev), 1e-6, lambda label: None)
    out = run.engine_views()
    # the probe's backward runs each of these views from the engine: a view's derivative
    # (reshape), transpose's and permute's (themselves), unsqueeze's (squeeze), mean's (expand)
    for kind in ("reshape.default", "transpose.int", "permute.default", "squeeze.dim", "expand"):
        key = f"aten.{kind}{'.default' if kind == 'expand' else ''}/backward"
        assert 0 < out[key] < 1e-3, key
    assert out["*view/backward"] == pytest.approx(
        statistics.median(v for k, v in out.items() if k != "*view/backward")
    )


def test_checkpointing_adds_the_rerun_forwards_time():
    # block = Linear(16, 32), ReLU, Linear(32, 16); head Linear(16, 4); input 8 × 16. With
    # `block` checkpointed the backward reruns block.0's addmm and the ReLU (block.2's addmm
    # saves only its inputs: test_memory_whatif's hand count), 2·8·16·32 + 8·32 (bias) +
    # 8·32 (ReLU) = 8,704 FLOPs; every FLOP at 1e9 FLOP/s, bytes and overheads ~free:
    # 8.704 µs, which a train step with checkpointing adds
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("block", nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)))
    model.add_module("head", nn.Linear(16, 4))
    x = torch.randn(8, 16)
    a = analyze(model, (x,), jvp=False, checkpoint="block", time_profile=_profile())
    tr = a.report.time
    assert dict(tr.recompute) == {"checkpoint": pytest.approx(8704 / 1e9)}
    assert TimeReport.from_dict(json.loads(json.dumps(tr.to_dict()))).recompute == tr.recompute
    lines = time_lines(tr)
    assert any("with --checkpoint: train step" in line for line in lines)
    # without the what-if there is nothing to add
    plain = analyze(model, (x,), jvp=False, time_profile=_profile()).report.time
    assert plain.recompute == ()
    # on a GPU the phase overlaps host and device: the rerun is its share of the forward
    # phase (block.0's addmm and the ReLU among the forward's nodes), never more than it
    gpu = _profile(kind="gpu", launch_overhead_s=5e-6)
    a = analyze(model, (x,), jvp=False, checkpoint="block", time_profile=gpu)
    fwd = a.report.time.phase("forward")
    assert fwd.overlap_s > 0
    times = {n.name: n.meta[TIME].seconds for n in a.forward.graph.nodes if TIME in n.meta}
    from graphflop.passes.checkpoint import checkpoint_memory

    rerun = checkpoint_memory(a.forward, a.backward, "block").recomputed
    share = sum(t for k, t in times.items() if k in rerun) / sum(times.values())
    assert dict(a.report.time.recompute)["checkpoint"] == pytest.approx(fwd.seconds * share)
    assert dict(a.report.time.recompute)["checkpoint"] < fwd.seconds


def test_the_optimizer_steps_own_cost_is_counted_once():
    # 10 µs per parameter, 50 µs per step around the loop, parameters at 1e9 B/s
    step = RateCurve(((1.0, 1e9),), fill_s=1e-5)
    p = _profile(updates={"sgd": step}, update_step_s={"sgd": 5e-5})
    model = nn.Linear(16, 8, device="meta")
    a = analyze(model, torch.empty(4, 16, device="meta"), jvp=False, optimizer="sgd",
                time_profile=p)  # fmt: skip
    nodes = [n for n in a.update.graph.nodes if TIME in n.meta]
    assert len({n.meta[TIME].kernel_id for n in nodes}) == 2  # weight and bias
    # weight 8·16·4 = 512 bytes, bias 8·4 = 32 bytes, each at 1e9 B/s; 2 × 10 µs + 50 µs once
    total = sum(n.meta[TIME].seconds for n in nodes)
    assert total == pytest.approx((512 + 32) / 1e9 + 2e-5 + 5e-5)
    assert a.report.time.phase("update").overhead_s == pytest.approx(7e-5)
    q = TimeProfile.from_dict(json.loads(save_profile(p)))
    assert q.update_step_s == {"sgd": 5e-5}


def test_a_loss_reads_one_logit_per_row_whatever_the_classes():
    # eager nll_loss gathers one log-probability per row: its kernel's bytes do not grow with
    # the number of classes (graphflop's decomposition takes the whole log-softmax as input)
    from graphflop.passes.step_time import _kernel_bytes, eager_kernels

    def nll_bytes(classes: int) -> int:
        model = nn.Linear(8, classes, device="meta")
        x = torch.empty(4, 8, device="meta")
        a = analyze(model, x, jvp=False, loss="cross_entropy", time_profile=_profile())
        ks = [k for k in eager_kernels(a.forward, a.forward) if "nll_loss" in k.name]
        assert len(ks) == 1
        return _kernel_bytes(ks[0])

    # 4 int64 targets (32 bytes), one float32 log-probability per row (16), the loss (4)
    assert nll_bytes(10) == nll_bytes(1000) == 4 * 8 + 4 * 4 + 4
    # the log-softmax kernel reads and writes its whole 4 × classes input: 2 × 4·1000·4 bytes
    model = nn.Linear(8, 1000, device="meta")
    a = analyze(model, torch.empty(4, 8, device="meta"), jvp=False, loss="cross_entropy",
                time_profile=_profile())  # fmt: skip
    from graphflop.passes.step_time import _kernel_bytes as kb
    from graphflop.passes.step_time import eager_kernels as ek

    ls = [k for k in ek(a.forward, a.forward) if k.name == "aten._log_softmax.default"]
    assert kb(ls[0]) == 2 * 4 * 1000 * 4


def test_a_composite_variant_and_its_backward_take_their_own_kernel_rates():
    # the tanh GELU runs at 1e6 B/s, the exact one at 1e9, the tanh GELU's backward kernel at
    # 2e6 B/s over 3 × its input (eager's cotangent and saved input read, gradient written)
    kernels = {
        "aten.gelu.default": RateCurve(((1.0, 1e9),)),
        "aten.gelu.default[tanh]": RateCurve(((1.0, 1e6),)),
        "aten.gelu.default[tanh]/backward": RateCurve(((1.0, 2e6),)),
    }
    p = _profile(kernels=kernels)
    model = nn.Sequential(nn.Linear(8, 8, device="meta"), nn.GELU(approximate="tanh"))
    a = analyze(model, torch.empty(4, 8, device="meta"), jvp=False, time_profile=p)

    def kernel_s(gm):
        ts = [n.meta[TIME] for n in gm.graph.nodes if TIME in n.meta]
        return sum(t.seconds for t in ts if t.kernel == "aten.gelu.default")

    # forward: the linear layer's 4 × 8 output, 4·8·4 = 128 bytes in, 128 out, at 1e6 B/s
    assert kernel_s(a.forward) == pytest.approx(256 / 1e6)
    # backward: 3 × 128 bytes at 2e6 B/s
    assert kernel_s(a.backward) == pytest.approx(3 * 128 / 2e6)
    # the exact GELU takes the plain entry (its [erf] variant is not in the table)
    b = analyze(nn.Sequential(nn.GELU()), torch.empty(4, 8, device="meta"), jvp=False,
                time_profile=p)  # fmt: skip
    assert kernel_s(b.forward) == pytest.approx(256 / 1e9)


@pytest.mark.parametrize(
    ("device", "title"),
    [
        ("cpu", "predicted time on this CPU, 4 threads (a guess: clock × FMA width × efficiency)"),
        ("h100", "predicted time on NVIDIA H100 SXM5 80 GB (data sheet × efficiency)"),
    ],
)
def test_time_table_title_says_where_the_rates_come_from_once(device, title):
    from graphflop.export.report import _time_table

    profile = default_cpu_profile(4) if device == "cpu" else resolve_profile(device)
    x = torch.empty(8, 8, device="meta")
    rep = analyze(MatMul(8, torch.float32), x, jvp=False, time_profile=profile)
    assert str(_time_table(rep.report.time).title) == title


def test_products_are_timed_on_operands_that_leave_the_cache():
    """Calibrate times a product as a network meets it: each call on the next of copies of its
    operands that together hold at least ``cold_bytes`` (here 1 MiB of quick's plan: a 64 ×
    64 float32 pair is 32 KiB, so 32 copies, each used in turn), and the kernels' backward
    calls get a cotangent of their own, not their input twice."""
    from graphflop.runtime.calibrate import _KERNELS, _Run, _timer, plan

    p = plan(quick=True)
    seen: list[tuple[int, int]] = []

    def op(a: torch.Tensor, b: torch.Tensor) -> None:
        seen.append((a.data_ptr(), b.data_ptr()))

    run = _Run(torch.device("cpu"), p, _timer(torch.device("cpu")), 0.0, lambda _: None)
    run.time_cold(op, torch.ones(64, 64), torch.ones(64, 64).t())
    pairs = set(seen)
    assert len(pairs) == p.cold_bytes // (2 * 64 * 64 * 4) == 32
    assert len({a for a, _ in pairs} | {b for _, b in pairs}) == 64  # no storage shared
    for names, make in _KERNELS:
        if names[0].endswith("/backward"):
            call, _ = make(1 << 12, torch.device("cpu"))
            dy, x = call.args[0], call.args[1]
            assert dy.data_ptr() != x.data_ptr(), names


def test_a_weight_gradient_takes_the_contracted_curves():
    # the forward x @ W (64 × 512 @ 512 × 512: M = 64 rows smallest) on matmul's curve at
    # 1e9 FLOP/s; the weight gradient xᵀ @ dy (512 × 64 @ 64 × 512: the 64 rows contracted,
    # M = N = 512) on CONTRACTED's at 4e9; both 2·64·512·512 FLOPs
    shaped = {
        "matmul": {"float32": ((64.0, RateCurve(((1.0, 1e9),))),)},
        CONTRACTED: {"float32": ((64.0, RateCurve(((1.0, 4e9),))),)},
    }
    a = analyze(MatMul(512, torch.float32), torch.empty(64, 512, device="meta"),
                jvp=False, time_profile=_profile(shaped=shaped))  # fmt: skip
    flops = 2 * 64 * 512 * 512
    assert _node(a, torch.ops.aten.mm.default).meta[TIME].compute_s == pytest.approx(flops / 1e9)
    (wgrad,) = [n for n in a.backward.graph.nodes if n.target == torch.ops.aten.mm.default]
    assert [a.meta["val"].shape for a in wgrad.args] == [(512, 64), (64, 512)]
    assert wgrad.meta[TIME].compute_s == pytest.approx(flops / 4e9)
    # a profile without the contracted curves times it on matmul's
    b = analyze(MatMul(512, torch.float32), torch.empty(64, 512, device="meta"), jvp=False,
                time_profile=_profile(shaped={"matmul": shaped["matmul"]}))  # fmt: skip
    (wgrad,) = [n for n in b.backward.graph.nodes if n.target == torch.ops.aten.mm.default]
    assert wgrad.meta[TIME].compute_s == pytest.approx(flops / 1e9)


def test_an_output_above_the_mmap_threshold_pays_its_page_faults():
    # x + y on a calibrated CPU with 1 ns per byte of fresh pages (1 ms per MB), bandwidth and
    # overheads negligible: an output of 40 MiB (10 Mi float32 elements) is above glibc's
    # largest mmap threshold (32 MiB), so 40 · 2**20 B × 1e-9 s/B = 41.9 ms of faults; one of
    # 16 MiB comes from the heap, and is taken to be reused pages: no faults
    p = _profile(fault_s_per_byte=1e-9)
    assert p.fresh_above_bytes == 32 << 20
    big = torch.empty(10 << 20, device="meta")
    a = analyze(Add(), (big, big), backward=False, jvp=False, loss="sum", time_profile=p)
    t = _node(a, torch.ops.aten.add.Tensor).meta[TIME]
    assert t.overhead_s == pytest.approx((40 << 20) * 1e-9)
    assert t.bound == "overhead"
    small = torch.empty(4 << 20, device="meta")
    b = analyze(Add(), (small, small), backward=False, jvp=False, loss="sum", time_profile=p)
    assert _node(b, torch.ops.aten.add.Tensor).meta[TIME].overhead_s == 0.0
    # profiles without the measurement (data sheets, older files) model no faults
    assert TimeProfile.from_dict({**json.loads(save_profile(p)), "fault_s_per_byte": 0.0}) == (
        dataclasses.replace(p, fault_s_per_byte=0.0)
    )
    assert TimeProfile.from_dict(json.loads(save_profile(p))) == p
    doc = json.loads(save_profile(H100))
    del doc["fault_s_per_byte"], doc["fresh_above_bytes"]
    assert TimeProfile.from_dict(doc) == H100
    # a whole number of bytes written as a float (another tool's JSON) reads as that number
    assert TimeProfile.from_dict({**doc, "fresh_above_bytes": 33554432.0}) == H100


class Relu(nn.Module):
    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.relu = nn.ReLU(inplace=inplace)

    def forward(self, x):
        return self.relu(x * 2.0)  # on a temporary, as a network's ReLU after a layer


@pytest.mark.parametrize("inplace", [True, False])
def test_a_relu_the_model_runs_in_place_moves_its_bytes_in_place(inplace):
    # relu of 10 Mi float32 elements (40 MiB, above glibc's largest mmap threshold): 2 × 40 MiB
    # read and written. In place (eager's relu_ writes into x * 2's storage): at the in-place
    # rate, 2 · 40 · 2**20 B / 1e9 B/s = 83.9 ms, and no fresh pages. Out of place: at the
    # allocating rate, 2 · 40 · 2**20 / 2e9 = 41.9 ms, plus 40 · 2**20 B × 1e-9 s/B of faults
    p = _profile(
        bandwidth=RateCurve(((1.0, 2e9),)),
        inplace_bandwidth=RateCurve(((1.0, 1e9),)),
        fault_s_per_byte=1e-9,
    )
    x = torch.empty(10 << 20, device="meta")
    a = analyze(Relu(inplace), x, backward=False, jvp=False, loss="sum", time_profile=p)
    relu = _node(a, torch.ops.aten.relu.default)
    assert bool(relu.meta.get(INPLACE)) is inplace
    assert not _node(a, torch.ops.aten.mul.Tensor).meta.get(INPLACE)
    t = relu.meta[TIME]
    nbytes = 2 * (40 << 20)
    if inplace:
        assert (t.memory_s, t.overhead_s) == (pytest.approx(nbytes / 1e9), 0.0)
    else:
        assert t.memory_s == pytest.approx(nbytes / 2e9)
        assert t.overhead_s == pytest.approx((40 << 20) * 1e-9)


class InPlaceMix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x):
        y = self.bn(self.lin(x))  # training mode: num_batches_tracked.add_(1)
        y += x  # Tensor.__iadd__
        y.mul_(2.0)
        z = torch.sigmoid(y)  # out of place
        return torch.nn.functional.relu(z, inplace=True) + y


def test_the_trace_tags_what_the_model_runs_in_place():
    a = analyze(InPlaceMix(), torch.randn(4, 8), jvp=False)
    tagged = sorted(str(n.target) for n in a.forward.graph.nodes if n.meta.get(INPLACE))
    # the buffer's add_, +=, mul_ and relu(inplace=True); not the linear, batch norm, sigmoid
    # or the final out-of-place add
    assert tagged == ["aten.add.Tensor", "aten.add.Tensor", "aten.mul.Tensor", "aten.relu.default"]
    # derivative graphs' nodes are not eager in-place ops (only placeholders holding a tagged
    # forward value carry it)
    assert not [
        n for n in a.backward.graph.nodes if n.op == "call_function" and n.meta.get(INPLACE)
    ]


class TwoBlocks(nn.Module):
    """A residual block whose ReLU module is called twice per block."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.relu = nn.Linear(8, 8), nn.Linear(8, 8), nn.ReLU()

    def forward(self, x):
        return self.relu(self.b(self.relu(self.a(x))) + x)


def _eager_host_counts(model, x):
    """nn.Module calls of one eager forward (pre-hooks on every module) and autograd nodes of
    its graph (a walk of ``grad_fn.next_functions`` from the loss, AccumulateGrad included)."""
    calls = [0]
    hooks = [
        m.register_forward_pre_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
        for m in model.modules()
    ]
    loss = model(x).sum()
    for h in hooks:
        h.remove()
    seen, stack = set(), [loss.grad_fn]
    while stack:
        f = stack.pop()
        if f is not None and f not in seen:
            seen.add(f)
            stack += [g for g, _ in f.next_functions]
    return calls[0], len(seen)


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8)),
        lambda: nn.Sequential(nn.Linear(8, 8), TwoBlocks(), TwoBlocks()),
        lambda: nn.Sequential(
            nn.Conv2d(1, 4, 3),
            nn.BatchNorm2d(4),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(4 * 3 * 3, 8),
        ),  # fmt: skip
    ],
    ids=["mlp", "residual", "conv-bn-pool"],
)
def test_module_calls_and_autograd_nodes_are_eagers(make):
    # host time beyond the kernels: 1 ms per nn.Module call, 0.5 s per autograd node (every
    # other cost negligible), so the phases' host_s count them; eager's own counts are the
    # reference: ReLU called twice per residual block counts twice, each Linear's weight
    # transpose is an autograd node (TBackward0), each parameter an AccumulateGrad, batch
    # norm and max-pool one node each
    model, x = make(), torch.randn(2, 1, 8, 8)
    if not isinstance(model[0], nn.Conv2d):
        x = torch.randn(3, model[0].in_features)
    p = _profile(module_call_s=1e-3, autograd_node_s=0.5)
    assert TimeProfile.from_dict(json.loads(save_profile(p))) == p
    a = analyze(model, x, loss="sum", jvp=False, time_profile=p)
    calls, nodes = _eager_host_counts(model, x)
    fwd, bwd = a.report.time.phase("forward"), a.report.time.phase("backward")
    assert fwd.host_s == pytest.approx(1e-3 * calls)
    assert bwd.host_s == pytest.approx(0.5 * nodes)
    parts = fwd.compute_s + fwd.memory_s + fwd.overhead_s
    assert fwd.seconds == pytest.approx(parts + 1e-3 * calls)
    doc = json.loads(json.dumps(a.to_dict()))
    assert Report.from_dict(doc) == a.report
    # profiles without the two measurements (data sheets, older files) add nothing
    b = analyze(model, x, loss="sum", jvp=False, time_profile=_profile())
    assert b.report.time.phase("backward").host_s == 0.0


class Dropout(nn.Module):
    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.a, self.b, self.inplace = nn.Linear(16, 16), nn.Linear(16, 4), inplace

    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.b(torch.nn.functional.dropout(h, 0.1, training=True, inplace=self.inplace))


def test_in_place_dropout_counts_as_dropout():
    # tester's finding: F.dropout(inplace=True) traced as bernoulli_ + div + mul and counted
    # 4,096 FLOPs fewer in the forward than the same dropout out of place (native_dropout)
    x = torch.randn(8, 16)
    plain, inplace = (analyze(Dropout(ip), x).report.totals for ip in (False, True))
    for phase in ("forward", "backward", "update", "jvp", "forward_gradient_step"):
        assert getattr(inplace, phase).flops == getattr(plain, phase).flops, phase
    # the bytes differ by the write-back into h (a copy of its 8 × 16 float32: 512 B read
    # twice, written once), which the out-of-place dropout does not make
    assert inplace.forward.bytes_written - plain.forward.bytes_written == 8 * 16 * 4


def test_a_resnet_in_bfloat16_is_timed():
    # tester's finding: `inspect models/resnet.py:resnet18 --dtype bfloat16 --device h100`
    # stopped in a gather's transpose: a bfloat16 value (the loss's gathered log-probability)
    # got a float32 cotangent. Eager autograd casts each gradient to its input's dtype; so
    # does the backward builder now: every cotangent has its primal's dtype
    from graphflop.load import load

    model = load(spec("resnet.py") + ":resnet18").model.to(torch.bfloat16)
    x = torch.randn(2, 3, 32, 32, dtype=torch.bfloat16)
    a = analyze(model, x, jvp=False, time_profile=H100)
    assert a.report.time.phase("train_step").seconds > 0
    by_name = {n.name: n for n in a.forward.graph.nodes}
    for n in a.backward.graph.nodes:
        src = by_name.get(n.meta.get(SOURCE, ""))
        v, pv = n.meta.get("val"), src.meta.get("val") if src is not None else None
        if (
            n.meta.get(KIND) == "cotangent"
            and isinstance(v, torch.Tensor)
            and n.target in (torch.ops.aten.scatter_add.default, torch.ops.aten.convolution.default)
            and isinstance(pv, torch.Tensor)
        ):
            assert v.dtype == torch.bfloat16, n


class Widen(nn.Module):
    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(k, n, device="meta"))

    def forward(self, x):
        return x @ self.w


def test_a_widening_product_takes_the_wide_curves():
    # x @ W, 64 × 512 @ 512 × 2,048: M = 64 (smallest), K = 512 < N = 2,048, so wide; the
    # WIDE curve at d = 64 runs 2e9 FLOP/s against matmul's 1e9; 2·64·512·2,048 FLOPs
    shaped = {
        "matmul": {"float32": ((16.0, RateCurve(((1.0, 1e9),))),)},
        WIDE: {"float32": ((64.0, RateCurve(((1.0, 2e9),))),)},
    }
    a = analyze(Widen(512, 2048), torch.empty(64, 512, device="meta"), jvp=False,
                time_profile=_profile(shaped=shaped))  # fmt: skip
    flops = 2 * 64 * 512 * 2048
    assert _node(a, torch.ops.aten.mm.default).meta[TIME].compute_s == pytest.approx(flops / 2e9)
    # the backward's input gradient dy @ Wᵀ (64 × 2,048 @ 2,048 × 512: K = 2,048, the longest)
    # is not wide: matmul's rate; the weight gradient xᵀ @ dy (K = 64) is contracted, and
    # without contracted curves also matmul's
    mms = [n for n in a.backward.graph.nodes if n.target == torch.ops.aten.mm.default]
    assert len(mms) == 1  # the input x needs no gradient: the weight gradient only
    assert mms[0].meta[TIME].compute_s == pytest.approx(flops / 1e9)
    # below the WIDE curves' smallest d (32 rows < 64) the product keeps matmul's curves
    b = analyze(Widen(512, 2048), torch.empty(32, 512, device="meta"), jvp=False,
                time_profile=_profile(shaped=shaped))  # fmt: skip
    small = 2 * 32 * 512 * 2048
    assert _node(b, torch.ops.aten.mm.default).meta[TIME].compute_s == pytest.approx(small / 1e9)


_CURVE = {"points": [[1.0, 1e9]], "fill_s": 0.0}


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        ({"launch_overhead_s": -1.0}, "a time must be 0 to 1 s, not -1.0"),
        ({"view_overhead_s": float("nan")}, "a time must be 0 to 1 s"),
        # tester's findings: finite but huge values made phases inf and the overlap NaN
        ({"module_call_s": 1e308}, "a time must be 0 to 1 s, not 1e+308"),
        ({"autograd_node_s": 2.0}, "a time must be 0 to 1 s, not 2.0"),
        ({"bandwidth": {"points": [[1.0, 1e-300]], "fill_s": 0.0}}, "at least 1 per second"),
        ({"device_kind": "tpu"}, "device_kind must be 'cpu' or 'gpu', not 'tpu'"),
        ({"memory_bytes": 0}, "memory_bytes must be a positive whole number of bytes or null"),
        ({"memory_bytes": True}, "memory_bytes must be a positive whole number of bytes"),
        # tester, stop 45: the entry of a table is named
        ({"fixed": {"*view/backward": -1}}, "fixed: '*view/backward': a time must be 0 to 1 s"),
        # tester's findings: Python's own words, no key named; now the key and what it wants
        ({"compute": []}, "compute: expected an object of name: value, not list"),
        ({"update_step_s": "x"}, "update_step_s: expected an object of name: value, not str"),
        (
            {"bandwidth": {"points": [[1, 2, 3]], "fill_s": 0.0}},
            "bandwidth: a rate curve's points must be a list of [size, rate] pairs",
        ),
        (
            {"bandwidth": {"points": [[1.0, "fast"]], "fill_s": 0.0}},
            "expected a number, not 'fast'",
        ),
        (
            {"shaped": {"matmul": {"float32": [[16.0]]}}},
            "shaped: shaped curves must be a list of [dimension, curve] pairs",
        ),
        ({"name": 5}, "name: expected a non-empty string, not 5"),
        ({"bandwidth": {"points": [[1.0, 1e9]]}}, "bandwidth: missing key 'fill_s'"),
        ({"launch_overhead_s": -1.0}, "malformed time profile: launch_overhead_s: a time must be"),
        ({"threads": "two"}, "threads must be a positive integer or null, not 'two'"),
        ({"threads": 0}, "threads must be a positive integer or null, not 0"),
        ({"fault_s_per_byte": -1e-9}, "fault_s_per_byte must be between 0 and 1e-06"),
        ({"fault_s_per_byte": 1e300}, "fault_s_per_byte must be between 0 and 1e-06"),
        ({"fault_s_per_byte": True}, "fault_s_per_byte must be seconds per byte (a number)"),
        ({"fault_s_per_byte": "1e-9"}, "fault_s_per_byte must be seconds per byte (a number)"),
        ({"fresh_above_bytes": 1.5}, "fresh_above_bytes must be a non-negative whole number"),
        ({"launch_overhead_s": True}, "a time must be 0 to 1 s, not True"),
        (
            {"shaped": {"matmul_wide": {"float32": [[16, _CURVE], [float("nan"), _CURVE]]}}},
            "shaped rate curves need increasing positive dimensions",
        ),
        (
            {"shaped": {"matmul_wide": {"float32": [["16", _CURVE]]}}},
            "a shaped curve's dimension must be a number, not '16'",
        ),
        (
            {"bandwidth": {"points": [[1.0, float("inf")]], "fill_s": 0.0}},
            "rate curve sizes and rates must be positive finite numbers",
        ),
    ],
)
def test_a_profile_with_impossible_values_is_refused(capsys, tmp_path, edit, says):
    # a data-sheet profile written to a file, then one field made impossible: before, negative
    # overheads gave negative step times and NaN gave Rb nan, exit 0
    doc = json.loads(save_profile(H100))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**doc, **edit}))
    rc, out, err = cli(capsys, "inspect", spec("mlp.py"), "--device", bad)
    assert (rc, out) == (2, "")
    assert len(err) == 1 and says in err[0], err


def test_a_profile_that_is_not_text_is_refused(capsys, tmp_path):
    bad = tmp_path / "bin.json"
    bad.write_bytes(b"\xff\xfe")
    rc, out, err = cli(capsys, "inspect", spec("mlp.py"), "--device", bad)
    assert (rc, out) == (2, "")
    assert err == [
        f"graphflop: error: time profile {bad} is not text (byte 0 is not UTF-8): give a file "
        "graphflop calibrate wrote"
    ]


class LinearRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 32)

    def forward(self, x):
        return torch.relu(self.fc(x)).sum()


def test_relu_backward_is_one_eager_kernel():
    """Eager autograd runs ReLU's derivative as one ``threshold_backward(grad, result, 0)``:
    it reads the cotangent and the saved result and writes the gradient, 3 × 64 × 32 × 4 B
    = 24,576 B, in one launch; graphflop's rule writes a mask and a product (two nodes,
    64·32·(4 + 1) + 64·32·(4 + 1 + 4) B = 28,672 B), timed as the one kernel eager runs."""
    p = _profile(bandwidth=RateCurve(((1.0, 1e9),)), launch_overhead_s=1e-6)
    a = analyze(LinearRelu(), torch.randn(64, 16), jvp=False, time_profile=p)
    (row,) = [o for o in a.report.time.ops if o.phase == "backward" and "relu" in o.op]
    assert (row.op, row.kernels) == ("aten.relu.default", 1)
    assert row.memory_s == pytest.approx(3 * 64 * 32 * 4 / 1e9)
    assert row.overhead_s == pytest.approx(1e-6)


class LinearThen(nn.Module):
    """Linear(6, 6) over the last dim, then ``f``, then a sum loss."""

    def __init__(self, f) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.f = f

    def forward(self, x):
        return self.f(self.fc(x)).sum()


def _eager_backward_kernels(f, x: torch.Tensor) -> list[str]:
    """The aten ops eager autograd's node for ``f`` calls in ``backward()`` (the profiler's
    children of the node; their own children, zeros_like's fill inside a kernel, left out).
    ``f`` runs on a clone of a leaf (an in-place op may not write a leaf)."""
    import re

    from torch.profiler import ProfilerActivity, profile

    y = f(x.requires_grad_().clone())
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        y.backward(torch.ones_like(y))
    return [
        e.name
        for e in prof.events()
        if e.cpu_parent is not None
        and re.fullmatch(r"\w+Backward\d", e.cpu_parent.name)
        and e.cpu_parent.name != "CloneBackward0"
        and e.name.startswith("aten::")
    ]


@pytest.mark.parametrize(
    ("f", "shape", "op", "eager", "nbytes"),
    [
        # (2, 3, 4, 6, 6) -> (3, 4, 4), uneven windows: the cotangent 2·3·3·4·4 · 4 B = 1,152 B
        # read, the gradient 2·3·4·6·6 · 4 B = 3,456 B written (eager's kernel reads no forward
        # value; graphflop's rule writes window bounds, a division, zeros and an index_add per
        # dim: 57 nodes, 39 of them timed as kernels of their own that moved 43,800 B)
        (
            lambda y: torch.nn.functional.adaptive_avg_pool3d(y, (3, 4, 4)),
            (2, 3, 4, 6, 6),
            "aten._adaptive_avg_pool3d.default",
            ["aten::_adaptive_avg_pool3d_backward"],
            1_152 + 3_456,
        ),
        # evaluation: leaky_relu_backward(grad, self, (lower + upper) / 2) reads the cotangent
        # and x and writes the gradient, 3 · 4·5·6 · 4 B = 1,440 B (graphflop's rule: a mask, its
        # cast, the coefficient's product and sum, the product with the cotangent, 4,560 B)
        (
            lambda y: torch.nn.functional.rrelu(y, 0.1, 0.3, training=False),
            (4, 5, 6),
            "aten.rrelu_with_noise.default",
            ["aten::rrelu_with_noise_backward"],
            3 * 4 * 5 * 6 * 4,
        ),
        # training: grad · noise, one mul inside rrelu_with_noise_backward; the cotangent and
        # the noise read, the gradient written (one node already; now named for its op)
        (
            lambda y: torch.nn.functional.rrelu(y, 0.1, 0.3, training=True),
            (4, 5, 6),
            "aten.rrelu_with_noise.default",
            ["aten::rrelu_with_noise_backward"],
            3 * 4 * 5 * 6 * 4,
        ),
        # in place (traced as rrelu_with_noise_functional): the same kernel
        (
            lambda y: torch.nn.functional.rrelu(y, 0.1, 0.3, training=True, inplace=True),
            (4, 5, 6),
            "aten.rrelu_with_noise_functional.default",
            ["aten::rrelu_with_noise_backward"],
            3 * 4 * 5 * 6 * 4,
        ),
    ],
    ids=["adaptive_avg_pool3d", "rrelu_eval", "rrelu_train", "rrelu_inplace"],
)
def test_pool3d_and_rrelu_backward_is_one_eager_kernel(f, shape, op, eager, nbytes):
    """Eager autograd runs 3-D adaptive average pooling's derivative as one
    ``_adaptive_avg_pool3d_backward`` and randomized leaky ReLU's as one
    ``rrelu_with_noise_backward`` (measured here with the profiler): the time pass times the
    backward nodes graphflop's rule derives from each as that kernel, one launch over its
    bytes."""
    torch.manual_seed(0)
    x = torch.randn(*shape)
    assert _eager_backward_kernels(f, x.clone()) == eager
    p = _profile(bandwidth=RateCurve(((1.0, 1e9),)), launch_overhead_s=1e-6)
    a = analyze(LinearThen(f), x, jvp=False, time_profile=p)
    (row,) = [o for o in a.report.time.ops if o.phase == "backward" and o.op == op]
    assert row.kernels == 1
    assert row.memory_s == pytest.approx(nbytes / 1e9)
    assert row.overhead_s == pytest.approx(1e-6)


def test_layer_rows_add_up_to_their_phase():
    """Per-layer times are each module's share of its phase: they sum to the phase's
    seconds, on a GPU profile (host and device overlapped: the plain sums exceeded the phase)
    and on a calibrated CPU profile with host costs (module calls, autograd nodes)."""
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    x = torch.randn(8, 16)
    for prof in (
        _profile(kind="gpu", launch_overhead_s=5e-6),
        _profile(module_call_s=2e-6, autograd_node_s=1e-6),
    ):
        tr = analyze(model, (x,), jvp=False, time_profile=prof).report.time
        for phase, field in (("forward", "forward_s"), ("backward", "backward_s")):
            rows = sum(getattr(L, field) for L in tr.layers)
            assert rows == pytest.approx(tr.phase(phase).seconds), (prof.kind, phase)
        gpu = tr.phase("forward")
        if prof.kind == "gpu":
            assert gpu.overlap_s > 0  # the case the rows used to overshoot
        else:
            assert gpu.host_s > 0


def test_a_step_that_does_not_fit_the_device_is_warned():
    """The train step's predicted peak against the device's memory: a data-sheet profile
    carries the device's bytes (the L4's 24 GiB), and a profile of 1 KiB makes any model's
    step not fit; the line names the memory and `graphflop plan`."""
    from graphflop.devices import device_spec
    from graphflop.export.report import warning_lines
    from graphflop.passes.time_profile import from_device

    l4 = from_device(device_spec("l4"))
    assert l4.memory_bytes == 24 * 2**30
    assert TimeProfile.from_dict(json.loads(save_profile(l4))).memory_bytes == 24 * 2**30
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    x = torch.randn(8, 16)
    fits = analyze(model, (x,), jvp=False, time_profile=l4).report
    assert not [w for w in warning_lines(fits) if "does not fit" in w]
    tiny = dataclasses.replace(l4, memory_bytes=1024)
    r = analyze(model, (x,), jvp=False, time_profile=tiny).report
    assert r.time.memory_bytes == 1024 and r.memory.train_peak_bytes > 1024
    (line,) = [w for w in warning_lines(r) if "does not fit" in w]
    assert "exceeds the 1 KiB of one l4" in line and "graphflop plan" in line


def test_human_figures_never_use_exponents():
    from graphflop.export.report import human, human_bytes, human_seconds

    # 1,020 MiB is below a GiB: '1020 MiB', once '1.02e+03 MiB' in the checkpoint line
    assert human_bytes(1020 * 2**20) == "1020 MiB"
    assert human(999.7e6) == "1000 M" and human_seconds(999.8e-6) == "1000 µs"
    assert human_bytes(1536) == "1.5 KiB" and human_seconds(0.00123) == "1.23 ms"


class IntProduct(nn.Module):
    """A 4×4 int64 matrix product (of a buffer) beside a float32 Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("idx", torch.arange(16).view(4, 4))

    def forward(self, x):
        return self.fc(x) + (self.idx @ self.idx).sum().float()


def test_an_integer_product_on_a_cpu_runs_at_the_vector_rate():
    """Eager PyTorch multiplies int64 matrices on a CPU without BLAS: the product is timed at
    the profile's 'other' rate (here 1e9 FLOP/s, float32's: the profile has no float64). A 4×4
    int64 product is 2·4·4·4 = 128 FLOPs: 128 ns. (A GPU profile refuses it: the test below.)"""

    prof = _profile(
        compute={
            "matmul": {"float32": RateCurve(((1.0, 1e12),))},
            "other": {"float32": RateCurve(((1.0, 1e9),))},
        }
    )
    a = analyze(IntProduct(), (torch.randn(2, 8),), jvp=False, time_profile=prof)
    mm = [
        n for n in a.forward.graph.nodes if n.target is torch.ops.aten.mm.default and TIME in n.meta
    ]
    assert len(mm) == 1 and mm[0].meta[COST].mm_flops == 128
    assert mm[0].meta[TIME].compute_s == pytest.approx(128 / 1e9)


def test_an_integer_product_on_a_gpu_says_what_to_do():
    """Tester, stop 49: an int64 product on h100 was refused with no way out. Eager PyTorch
    has no CUDA kernel for it (cuBLAS has no integer GEMM): the error names the dtypes the
    profile has, says so and what to do."""
    with pytest.raises(NoPeak) as e:
        analyze(IntProduct(), (torch.randn(2, 8),), jvp=False, time_profile=H100)
    msg = str(e.value)
    assert msg.startswith("h100-sxm has no int64 peak for matmul kernels: it has float64")
    assert "no CUDA kernel for an int64 matrix product" in msg
    assert "--device cpu" in msg and "a.double() @ b.double()" in msg
    # a float64 product on a part without a float64 peak gets no such hint
    x = torch.empty(8, 8, dtype=torch.float64, device="meta")
    with pytest.raises(NoPeak) as e:
        analyze(MatMul(8, torch.float64), x, backward=False, jvp=False,
                time_profile=resolve_profile("l4"))  # fmt: skip
    assert "CUDA kernel" not in str(e.value)


@torch.library.custom_op("gfsteptime::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    """A custom op graphflop has no cost rule for (as ``aten.bitwise_xor`` had none)."""
    return 2 * x


@_twice.register_fake
def _(x):
    return torch.empty_like(x)


class RuleLessAndTwice(nn.Module):
    """The rule-less op and ``2 * x`` (a rule: N FLOPs, 4N read, 4N written) on one input."""

    def forward(self, x):
        return _twice(x) + 2 * x


def test_an_op_without_a_cost_rule_is_timed_at_its_bytes_and_marked():
    """Tester, stop 49: an op without a cost rule took the 2 µs view overhead and 0 bytes,
    silently (``^`` 2 µs beside a same-size ``&`` at 368 µs on h100)."""
    from graphflop.export.report import warning_lines
    from graphflop.ops import has_rule, op_name

    op = torch.ops.gfsteptime.twice.default
    assert not has_rule(op)
    n = 1 << 23
    x = torch.empty(n, device="meta", requires_grad=False)
    a = analyze(RuleLessAndTwice(), x, jvp=False, loss="sum", time_profile=H100)
    rule_less = _node(a, op)
    assert rule_less.meta[COST].bytes_read == 0  # the FLOP report's figure is unchanged
    t = rule_less.meta[TIME]
    # its tensors: 4 B × 2^23 read, 4 B × 2^23 written = 67,108,864 B at 3.35e12 × 0.85 =
    # 2.8475e12 B/s = 23.568 µs, + 2 µs fill = 25.568 µs of memory; no compute; a 6 µs launch
    # (not the 2 µs view overhead): 31.568 µs
    memory = 8 * n / 2.8475e12 + 2e-6
    assert t.compute_s == 0.0
    assert t.memory_s == pytest.approx(memory, rel=1e-12)
    assert t.overhead_s == pytest.approx(6e-6)
    assert t.seconds == pytest.approx(memory + 6e-6, rel=1e-12)
    assert t.bound == "memory" and t.no_cost_rule
    # the same bytes under a rule (2 * x: 8,388,608 FLOPs / 3.345e13 + 2 µs = 2.25 µs of
    # compute, below its memory) take the same time
    mul = _node(a, torch.ops.aten.mul.Tensor).meta[TIME]
    assert mul.seconds == pytest.approx(t.seconds, rel=1e-12) and not mul.no_cost_rule
    tr = a.report.time
    fwd = tr.phase("forward")
    assert fwd.no_cost_rule == (op_name(op),)
    assert not fwd.complete
    assert tr.phase("loss").complete and not tr.phase("loss").no_cost_rule
    step = tr.phase("train_step")  # forward + backward + update: incomplete with its forward
    assert not step.complete and step.no_cost_rule == fwd.no_cost_rule
    row = next(o for o in tr.ops if o.phase == "forward" and o.no_cost_rule)
    assert row.bytes == 8 * n and row.memory_s == pytest.approx(memory, rel=1e-12)
    assert not any(o.no_cost_rule for o in tr.ops if o is not row)
    doc = json.loads(json.dumps(a.to_dict()))
    assert doc["time"]["phases"]["forward"]["complete"] is False
    assert doc["time"]["phases"]["forward"]["no_cost_rule"] == list(fwd.no_cost_rule)
    assert Report.from_dict(doc) == a.report
    (line,) = [w for w in warning_lines(a.report) if "twice" in w]
    assert "timed on h100-sxm at its tensors' bytes" in line


def test_every_time_breakdown_adds_up_to_its_phase_on_a_gpu():
    """Tester, stop 49: on a data-sheet GPU the per-kernel rows and ``by_role`` summed to the
    phase before the host/device overlap came off (tiny MLP on h100: forward kernels 60 µs
    against a 39 µs phase), and the loss phase (its own timeline) disagreed with its row."""
    # forward on h100, 4 float32 elements: x + x, y + y and the sum loss, each a 6 µs launch
    # and w = 2 µs of fill (+ < 1e-7 s of bytes and FLOPs). Host 6, 12, 18 µs; device
    # 6 + w, max(8, 12) + w = 14, max(16, 18) + w = 20 µs: the phase is 20 µs of 24 µs of
    # kernels (4 µs overlap). Shares (× 20/24): the adds 16 µs -> 13.33 µs (2.67 µs of
    # overlap), the loss 8 µs -> 6.67 µs (1.33 µs)
    a = analyze(TwoAdds(), torch.empty(4, device="meta"), backward=False, jvp=False,
                loss="sum", time_profile=H100)  # fmt: skip
    tr = a.report.time
    fwd = tr.phase("forward")
    assert fwd.seconds == pytest.approx(20e-6, rel=1e-4)
    assert fwd.overlap_s == pytest.approx(4e-6, rel=1e-3)
    ops = {o.op: o for o in tr.ops if o.phase == "forward"}
    add, loss = ops.pop("aten.add.Tensor"), ops.pop("aten.sum.dim_IntList")
    assert not ops
    assert add.seconds == pytest.approx(16e-6 * 20 / 24, rel=1e-4)
    assert add.overlap_s == pytest.approx(16e-6 * 4 / 24, rel=1e-3)
    assert add.overhead_s == pytest.approx(12e-6)  # its kernels' own launches
    assert loss.seconds == pytest.approx(8e-6 * 20 / 24, rel=1e-4)
    # the loss phase is the loss kernel's share of the forward, as its role is
    assert tr.phase("loss").seconds == pytest.approx(loss.seconds, rel=1e-12)
    assert dict(fwd.by_role)["loss"] == pytest.approx(loss.seconds, rel=1e-12)
    assert dict(fwd.by_role)["forward"] == pytest.approx(add.seconds, rel=1e-12)


@pytest.mark.parametrize("kind", ["h100", "gpu_host", "cpu"])
def test_op_role_layer_rows_add_up_column_by_column(kind):
    """Each phase's op rows add up to it column by column (time, compute, memory, overhead,
    host, overlap) and each row to its own columns; its roles and layer rows to its time; the
    loss phase to the loss layer row: a data-sheet GPU, a calibrated GPU with host costs and
    a calibrated CPU with host costs."""
    prof = {
        "h100": H100,
        "gpu_host": _profile(
            kind="gpu", launch_overhead_s=5e-6, module_call_s=3e-6, autograd_node_s=2e-6
        ),
        "cpu": _profile(module_call_s=2e-6, autograd_node_s=1e-6, launch_overhead_s=1e-6),
    }[kind]
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    tr = analyze(model, (torch.randn(8, 16),), time_profile=prof).report.time
    for phase, p in tr.phases:
        if phase == "train_step":
            continue
        rows = [o for o in tr.ops if o.phase == phase]
        if phase != "loss":
            assert rows, phase
            for col in ("seconds", "compute_s", "memory_s", "overhead_s", "host_s", "overlap_s"):
                total = sum(getattr(o, col) for o in rows)
                assert total == pytest.approx(getattr(p, col), rel=1e-9, abs=1e-15), (phase, col)
            for o in rows:
                parts = o.compute_s + o.memory_s + o.overhead_s + o.host_s - o.overlap_s
                assert o.seconds == pytest.approx(parts, rel=1e-9)
        assert sum(s for _, s in p.by_role) == pytest.approx(p.seconds, rel=1e-9), phase
    step = tr.phase("train_step")
    assert sum(s for _, s in step.by_role) == pytest.approx(step.seconds, rel=1e-9)
    loss_row = next(L for L in tr.layers if L.name == "loss")
    assert tr.phase("loss").seconds == pytest.approx(loss_row.forward_s, rel=1e-9)
    if kind != "cpu":
        assert tr.phase("forward").overlap_s > 0  # the case the rows used to overshoot
    if kind != "h100":
        assert tr.phase("forward").host_s > 0


#: the FLOPs of _conv_then_linear's convolution and of its matrix product (worked out where used)
CONV_FLOPS = 2 * (64 * 64 * 32 * 32) * (64 * 3 * 3)
MM_FLOPS = 2 * 64 * (64 * 32 * 32) * 1024


def _conv_then_linear():
    return nn.Sequential(
        nn.Conv2d(64, 64, 3, padding=1, bias=False, device="meta"),
        nn.Flatten(),
        nn.Linear(64 * 32 * 32, 1024, bias=False, device="meta"),
    )


def _conv_and_mm_times(profile):
    x = torch.empty(64, 64, 32, 32, device="meta")
    a = analyze(_conv_then_linear(), x, jvp=False, time_profile=profile)
    fwd_conv = _node(a, torch.ops.aten.convolution.default)
    fwd_mm = _node(a, torch.ops.aten.mm.default)
    (bwd_conv,) = [  # the weight gradient; the input needs none
        n for n in a.backward.graph.nodes if n.target == torch.ops.aten.convolution.default
    ]
    bwd_mm = [n for n in a.backward.graph.nodes if n.target == torch.ops.aten.mm.default]
    return fwd_conv, bwd_conv, fwd_mm, bwd_mm


def test_float32_convolutions_run_at_the_tf32_peak_and_matmuls_at_fp32():
    # PyTorch's defaults (torch 2.13: torch.backends.cudnn.allow_tf32 True, cuda.matmul
    # .allow_tf32 False): a float32 cuDNN convolution runs on TF32 tensor cores, a float32
    # matmul on the FP32 units
    assert torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32
    a100 = from_device(device_spec("a100-80gb"))
    fwd_conv, bwd_conv, fwd_mm, bwd_mm = _conv_and_mm_times(a100)
    # convolution 64×64×32×32 → 64×64×32×32, 3×3 kernel: 2·(64·64·32·32)·(64·3·3) =
    # 4,831,838,208 FLOPs (compute-bound); its weight gradient the same count; at A100's TF32
    # peak 156e12 × TF32 conv efficiency 0.30, 5 µs fill
    conv_s = CONV_FLOPS / (156e12 * 0.30) + 5e-6
    for n, cls in ((fwd_conv, "conv"), (bwd_conv, "conv_backward")):
        assert n.meta[COST].mm_flops == CONV_FLOPS
        t = n.meta[TIME]
        assert t.compute_s == pytest.approx(conv_s, rel=1e-9)
        assert (t.op_class, t.dtype) == (cls, "tf32")
    # linear 64×65,536 → 1,024: 2·64·65,536·1,024 = 8,589,934,592 FLOPs at the FP32 peak
    # 19.5e12 × 0.70, 5 µs fill; its backward's products (weight and input gradients) the
    # same count each, at the same rate
    mm_s = MM_FLOPS / (19.5e12 * 0.70) + 5e-6
    assert fwd_mm.meta[COST].mm_flops == MM_FLOPS
    assert fwd_mm.meta[TIME].compute_s == pytest.approx(mm_s, rel=1e-9)
    assert fwd_mm.meta[TIME].dtype == "float32"
    assert bwd_mm and all(n.meta[TIME].dtype == "float32" for n in bwd_mm)
    for n in bwd_mm:
        flops = n.meta[COST].mm_flops
        assert n.meta[TIME].compute_s == pytest.approx(flops / (19.5e12 * 0.70) + 5e-6)


def test_tf32_follows_the_torch_settings_the_profile_models():
    spec_ = device_spec("a100-80gb")
    # cudnn.allow_tf32 = False: the convolution at the FP32 peak 19.5e12 × 0.60
    off = from_device(spec_, cudnn_allow_tf32=False)
    fwd_conv, bwd_conv, fwd_mm, _ = _conv_and_mm_times(off)
    for n in (fwd_conv, bwd_conv):
        assert n.meta[TIME].compute_s == pytest.approx(CONV_FLOPS / (19.5e12 * 0.60) + 5e-6)
        assert n.meta[TIME].dtype == "float32"
    # cuda.matmul.allow_tf32 = True as well: the matmul at the TF32 peak 156e12 × 0.70
    both = from_device(spec_, matmul_allow_tf32=True)
    fwd_conv, _, fwd_mm, _ = _conv_and_mm_times(both)
    assert fwd_mm.meta[TIME].compute_s == pytest.approx(MM_FLOPS / (156e12 * 0.70) + 5e-6)
    assert (fwd_mm.meta[TIME].dtype, fwd_conv.meta[TIME].dtype) == ("tf32", "tf32")
    # under autocast the convolution runs in the autocast dtype, not TF32: 989.4e12 × 0.60 on
    # H100
    x = torch.empty(64, 64, 32, 32, device="meta")
    amp = analyze(_conv_then_linear(), x, jvp=False, time_profile=H100, amp="bf16")
    t = _node(amp, torch.ops.aten.convolution.default).meta[TIME]
    assert t.dtype == "bfloat16"
    assert t.compute_s == pytest.approx(CONV_FLOPS / (989.4e12 * 0.60) + 5e-6)


def test_no_tf32_without_a_tf32_peak_or_on_amd():
    # MI300X: PyTorch's ROCm convolutions (MIOpen) run float32 as FP32: 163.4e12 × 0.60
    mi300x = from_device(device_spec("mi300x"))
    fwd_conv, bwd_conv, _, _ = _conv_and_mm_times(mi300x)
    for n in (fwd_conv, bwd_conv):
        assert n.meta[TIME].compute_s == pytest.approx(CONV_FLOPS / (163.4e12 * 0.60) + 5e-6)
        assert n.meta[TIME].dtype == "float32"
    # an NVIDIA part without TF32 tensor cores (Volta-like: no tf32 peak): FP32 15.7e12 × 0.60
    volta = dataclasses.replace(
        device_spec("a100-80gb"),
        name="volta-like",
        peak_flops={"float32": 15.7e12, "float16": 125e12},
    )
    fwd_conv, _, _, _ = _conv_and_mm_times(from_device(volta))
    assert fwd_conv.meta[TIME].compute_s == pytest.approx(CONV_FLOPS / (15.7e12 * 0.60) + 5e-6)
    assert fwd_conv.meta[TIME].dtype == "float32"


@pytest.mark.parametrize(
    ("mode", "matmul_tf32", "cudnn_tf32"),
    [("convolutions", False, True), ("all", True, True), ("none", False, False)],
)
def test_inspect_tf32_picks_the_torch_settings_it_models(capsys, mode, matmul_tf32, cudnn_tf32):
    # --tf32 MODE is from_device's (matmul.allow_tf32, cudnn.allow_tf32): the CLI's phases are
    # the library's with those settings; models/cnn.py has convolutions and linear layers, so
    # every mode gives its own figure
    from graphflop.load import load, make_inputs

    argv = ("inspect", spec("cnn.py"), "--device", "a100", "--no-jvp", "--format", "json")
    rc, out, err = cli(capsys, *argv, "--tf32", mode)
    assert rc == 0, err
    got = json.loads(out)["time"]["phases"]
    loaded = load(spec("cnn.py"))
    profile = from_device(
        device_spec("a100-80gb"), matmul_allow_tf32=matmul_tf32, cudnn_allow_tf32=cudnn_tf32
    )
    a = analyze(loaded.model, make_inputs(loaded), jvp=False, time_profile=profile)
    want = a.report.time
    for phase in ("forward", "backward", "train_step"):
        assert got[phase]["seconds"] == pytest.approx(want.phase(phase).seconds, rel=1e-12)


def test_inspect_tf32_needs_a_data_sheet_gpu(capsys):
    rc, _, err = cli(capsys, "inspect", spec("cnn.py"), "--device", "cpu", "--tf32", "all")
    assert rc == 2
    assert err == [
        "graphflop: error: --tf32 all models a torch setting on a data-sheet GPU: a CPU has no TF32"
    ]
    rc, _, err = cli(capsys, "inspect", spec("cnn.py"), "--tf32", "none")
    assert rc == 2
    assert err == [
        "graphflop: error: --tf32 none sets how --device times float32 products: add --device"
    ]
