"""tools/bench_analysis.py, the benchmark docs/analysis_scale.md's figures come from: its code paths run, and
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


@pytest.fixture(autouse=True)
def _threads_kept():
    # the tool's children set one thread (their figures are one thread's CPU time); run here in
    # the test process, that setting would outlive the test and change what later tests measure
    # (oneDNN's convolution buffers depend on the thread count: tests/test_memory_eager.py's
    # measured peaks: 1x1 case, 2,100,424 B measured with one thread against 3,148,996 B
    # predicted, which the two-thread measurement matches within the test's 1%)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


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


# --- the command line: bad input before any work, the report's hand-kept part ---------------


@pytest.fixture
def no_children(bench, monkeypatch):
    """Fail the test if a model would be run."""

    def run(*a, **k):
        raise AssertionError("a model was run")

    monkeypatch.setattr(bench, "_run_child", run)
    monkeypatch.setattr(bench, "floor", run)
    monkeypatch.setattr(bench, "profile", run)


@pytest.mark.parametrize(
    "argv, words",
    [
        ([], "no model selected"),
        (["--only", "resnet9000"], "unknown model 'resnet9000'"),
        (["--zoo", "--repeat", "0"], "--repeat 0: give 1 or more"),
        (["--floor", "--repeat", "-1", "--only", "mlp"], "--repeat -1"),
        (["--only", "mlp", "--out", "/proc/no/such/r.md"], "cannot write the report"),
        (["--only", "mlp", "--json", ""], "cannot write the JSON ''"),
        (["--only", "mlp", "--profile", "/proc/x/p.txt"], "cannot write the profile"),
        (["--profile", "p.txt"], "no model selected"),
    ],
)
def test_bad_input_one_line_before_any_work(bench, no_children, tmp_path, capsys, argv, words):
    out = tmp_path / "r.md"
    argv = argv if "--out" in argv else [*argv, "--out", str(out)]
    assert bench.main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and err.startswith("bench_analysis: error: ")
    assert not out.exists()


def test_existing_report_without_markers_is_not_overwritten(bench, no_children, tmp_path, capsys):
    out = tmp_path / "notes.md"
    out.write_text("# my notes\n")
    assert bench.main(["--only", "mlp", "--out", str(out)]) == 2
    assert "no generated part to replace" in capsys.readouterr().err
    assert out.read_text() == "# my notes\n"


@pytest.mark.parametrize(
    "content, words",
    [
        (None, "cannot read"),
        ("{not json", "is not JSON"),
        ("[1, 2]", "is not a report of this tool"),
        ('{"zoo": [{"name": "x"}], "xl": [], "depth": []}', "is not a report of this tool"),
    ],
)
def test_render_refuses_what_it_cannot_read(bench, tmp_path, capsys, content, words):
    src = tmp_path / "in.json"
    if content is not None:
        src.write_text(content)
    out = tmp_path / "r.md"
    assert bench.main(["--render", str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1
    assert not out.exists()


def test_only_overrides_the_groups(bench):
    import argparse

    def sel(**kw):
        ns = argparse.Namespace(zoo=False, xl=False, depth=False, only=None, **{})
        vars(ns).update(kw)
        return tuple(list(g) for g in bench._select(ns))

    assert sel(xl=True, only=["mlp"]) == (["mlp"], [], [])
    assert sel(only=["gpt2_xl_b8", "gpt2_xl_b8", "gpt2_12_blocks"]) == (
        [],
        ["gpt2_xl_b8"],
        ["gpt2_12_blocks"],
    )
    assert sel(zoo=True, xl=True)[1] == ["gpt2_xl_b8"]


@pytest.mark.slow  # about 10 s; run in CI with -m slow
def test_report_replaces_only_its_part_and_render_keeps_the_run(
    bench, tmp_path, capsys, monkeypatch
):
    """A real run of the MLP (one round) into a file with hand-written notes around the
    markers: the notes stay; --render of its JSON writes the same tables, described by the
    JSON's run (one round, CPU time), whatever --repeat and --wall say now."""
    monkeypatch.setattr(bench, "CLOCK", bench.CLOCK)  # --wall below sets both; restored after
    monkeypatch.setenv("GRAPHFLOP_BENCH_WALL", "")
    out, js = tmp_path / "r.md", tmp_path / "r.json"
    out.write_text(f"intro by hand\n{bench.BEGIN}\nold\n{bench.END}\n## Round 1 by hand\n")
    assert bench.main(["--only", "mlp", "--repeat", "1", "--out", str(out), "--json", str(js)]) == 0
    text = out.read_text()
    assert text.startswith(f"intro by hand\n{bench.BEGIN}\n# Analysis time at scale")
    assert text.endswith(f"{bench.END}\n## Round 1 by hand\n") and "\nold\n" not in text
    assert "1 times each" in text and "| mlp | 39 / " in text
    data = __import__("json").loads(js.read_text())
    assert data["run"]["repeat"] == 1 and data["run"]["clock"] == "cpu"
    again = tmp_path / "again.md"
    assert bench.main(["--render", str(js), "--out", str(again), "--repeat", "7", "--wall"]) == 0
    assert (
        again.read_text().strip()
        == text[text.index(bench.BEGIN) : text.index(bench.END) + len(bench.END)]
    )
