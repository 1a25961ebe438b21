"""The command line: output, JSON, and one-line errors with exit code 2 for bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import cli, spec

from graphflop.cli import main


def run_cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "graphflop.cli", *args], capture_output=True, text=True, cwd=cwd
    )


def test_inspect_json(tmp_path):
    out = tmp_path / "out.json"
    assert main(["inspect", spec("logreg.py"), "--batch", "32", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    # logistic regression 784→10 at batch 32: 2·32·784·10 multiply-add FLOPs
    assert d["totals"]["forward"]["mm_flops"] == 2 * 32 * 784 * 10
    assert d["inputs"] == [
        {"name": d["inputs"][0]["name"], "shape": [32, 1, 28, 28], "dtype": "float32"}
    ]
    for key in (
        "params_bytes",
        "forward_peak_bytes",
        "saved_for_backward_bytes",
        "train_peak_bytes",
        "jvp_peak_bytes",
        "grads_bytes",
        "optimizer_state_bytes",
    ):
        assert key in d["memory"]
    assert {"name", "forward_flops", "params"} <= set(d["layers"][0])
    assert d["params"] == 784 * 10 + 10


def test_input_shape_and_ctor_args(capsys):
    assert (
        main(
            [
                "inspect",
                spec("mlp.py"),
                "--input-shape",
                "4,1,28,28",
                "--format",
                "json",
                "--no-jvp",
            ]
        )
        == 0
    )
    d = json.loads(capsys.readouterr().out)
    assert d["inputs"][0]["shape"] == [4, 1, 28, 28]
    assert (
        main(
            [
                "inspect",
                spec("deeper_convnet.py"),
                "--arg",
                "middle_layers=2",
                "--format",
                "json",
                "--no-jvp",
                "--no-backward",
            ]
        )
        == 0
    )
    d = json.loads(capsys.readouterr().out)
    assert any(L["name"] == "middle" for L in d["layers"])


@pytest.mark.slow
def test_verify_passes():
    r = run_cli("inspect", spec("onenet.py"), "--verify")
    assert r.returncode == 0, r.stderr
    assert "3 of 3 checks passed" in r.stderr and "FAILED" not in r.stderr


MASKED_SCATTER = """
import torch
from torch import nn


class MScat(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)

    def forward(self, x):
        m = torch.arange(12).reshape(2, 6) % 3 == 0
        return torch.zeros(2, 6, dtype=x.dtype).masked_scatter(m, self.fc(x))


def example_inputs():
    return (torch.randn(2, 4),)
"""


@pytest.mark.slow  # about 9 s (a process of its own: the raw line went to file descriptor 2)
def test_verify_prints_no_raw_batching_fallback_warning(tmp_path):
    # --verify's forward-gradient check batches its directions with vmap; masked_scatter has
    # no batching rule, and functorch's C++ warning for its fallback ("[W... BatchedFallback.cpp
    # :82] Warning: There is a performance drop because we have not yet implemented the batching
    # rule for aten::masked_scatter ...") reached stderr raw, bypassing Python's warnings
    (tmp_path / "mscat.py").write_text(MASKED_SCATTER)
    r = run_cli("inspect", str(tmp_path / "mscat.py"), "--verify")
    assert r.returncode == 0, r.stderr
    assert "3 of 3 checks passed" in r.stderr
    assert "batching rule" not in r.stderr and "BatchedFallback" not in r.stderr, r.stderr
    # every stderr line is graphflop's own (verify:, note:, warning:), none a raw [W...] line
    assert all(
        line.startswith(("verify: ", "note: ", "warning: "))
        for line in r.stderr.splitlines()
        if line.strip()
    ), r.stderr


def test_verify_samples_follow_the_step_cost():
    """The forward-gradient check's default: 100 directions when they fit in VERIFY_FLOPS, fewer
    when only some do, none below MIN_VERIFY_SAMPLES; an explicit count always wins."""
    from graphflop.runtime.verify import VERIFY_FLOPS, forward_gradient_samples

    assert forward_gradient_samples(None, VERIFY_FLOPS / 1000) == (100, "")
    n, why = forward_gradient_samples(None, VERIFY_FLOPS / 20)
    assert n == 20 and "20 directions" in why
    n, why = forward_gradient_samples(None, VERIFY_FLOPS / 10)
    assert n == 0 and "skipped" in why
    assert forward_gradient_samples(7, VERIFY_FLOPS) == (7, "")
    assert forward_gradient_samples(None, 0) == (100, "")  # cost unknown: the default


TWO_MODULES = """
import torch
class A(torch.nn.Module):
    def forward(self, x): return x
class B(torch.nn.Module):
    def forward(self, x): return x * 2
"""

UNTRACEABLE = """
import torch
class Bad(torch.nn.Module):
    def forward(self, x):
        return x.nonzero().sum() * undefined_name
def example_inputs(): return (torch.randn(2, 3),)
"""

NO_RULE = """
import torch
class Odd(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3))
    def forward(self, x):
        return torch.special.i0e(x * self.w)
def example_inputs(): return (torch.randn(2, 3),)
"""


@pytest.mark.parametrize(
    "case",
    [
        "missing",
        "unknown_name",
        "two_modules",
        "bad_shape",
        "untraceable",
        "no_rule",
        "bad_dtype",
        "bad_arg",
    ],
)
def test_bad_input_one_line_exit_2(tmp_path, capsys, case):
    (tmp_path / "two.py").write_text(TWO_MODULES)
    (tmp_path / "bad.py").write_text(UNTRACEABLE)
    (tmp_path / "odd.py").write_text(NO_RULE)
    args = {
        "missing": [str(tmp_path / "nope.py")],
        "unknown_name": [spec("convnet.py") + ":Nope"],
        "two_modules": [str(tmp_path / "two.py")],
        "bad_shape": [spec("convnet.py"), "--input-shape", "1,3,x,224"],
        "untraceable": [str(tmp_path / "bad.py")],
        "no_rule": [str(tmp_path / "odd.py"), "--strict"],  # partial results otherwise
        "bad_dtype": [spec("convnet.py"), "--dtype", "float7"],
        "bad_arg": [spec("deeper_convnet.py"), "--arg", "middle_layers"],
    }[case]
    out = tmp_path / "out.json"
    rc, stdout, lines = cli(capsys, "inspect", *args, "--json", str(out))
    assert rc == 2, (stdout, lines)
    assert len(lines) == 1 and lines[0].startswith("graphflop: error:"), lines
    assert not out.exists()
    assert list(tmp_path.glob(".out.json*")) == []
    if case == "no_rule":
        assert (
            "aten.special_i0e.default" in lines[0]
            and "node special_i0e" in lines[0]
            and "graphflop/ops/" in lines[0]
        )
    if case == "two_modules":
        assert "A, B" in lines[0]


def test_bad_input_in_a_fresh_process_is_one_line_exit_2(tmp_path):
    """The same through ``python -m graphflop.cli`` (the cases above run in-process): a model
    that fails to trace prints one stderr line, no warning or traceback, and writes nothing."""
    (tmp_path / "bad.py").write_text(UNTRACEABLE)
    out = tmp_path / "out.json"
    r = run_cli("inspect", str(tmp_path / "bad.py"), "--json", str(out))
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("graphflop: error:"), r.stderr
    assert not out.exists() and list(tmp_path.glob(".out.json*")) == []


@pytest.mark.parametrize(
    "command,args,message",
    [
        ("export", ["nope.py", "--out", "{tmp}/onnx"], "model file not found"),
        ("bench", [spec("logreg.py"), "--repeat", "0", "--json", "{tmp}/out.json"], "--repeat"),
        (
            "render",
            [spec("logreg.py"), "-o", "{tmp}/out.svg", "--profile-json", "{tmp}/none.json"],
            "cannot read --profile-json",
        ),
        ("sweep", [spec("logreg.py"), "--batches", "1,x", "--json", "{tmp}/out.json"], "bad batch"),
        ("train", [spec("logreg.py"), "--batch", "0", "--out", "{tmp}/run"], "must be positive"),
        ("inspect", [spec("logreg.py"), "--directions", "0"], "bad --directions 0"),
        # tester's findings: K = 10^8 ran until killed; ":A" was an internal error
        ("inspect", [spec("logreg.py"), "--directions", "1025"], "give 1 to 1,024"),
        (
            "train",
            [spec("logreg.py"), "--directions", "100000000", "--out", "{tmp}/run"],
            "give 1 to 1,024",
        ),
        ("inspect", [":A"], "names no file or module before ':'"),
    ],
)
def test_every_subcommand_reports_bad_input_in_one_line(
    tmp_path, capsys, monkeypatch, command, args, message
):
    monkeypatch.chdir(tmp_path)
    rc, stdout, lines = cli(capsys, command, *[a.format(tmp=tmp_path) for a in args])
    assert rc == 2, (stdout, lines)
    assert len(lines) == 1 and lines[0].startswith("graphflop: error:"), lines
    assert message in lines[0]
    assert stdout == "" and list(tmp_path.iterdir()) == []


_ENTRY = """
import atexit, os, sys, threading, time
# what Python's own exit delivers: output printed by an atexit handler, a non-daemon thread's work
atexit.register(lambda: print("atexit handler ran"))
marker = os.environ.get("MARKER")
if marker:
    def late():
        time.sleep(0.5)
        open(marker, "w").write("done")
    threading.Thread(target=late).start()
sys.argv = ["graphflop", *sys.argv[1:]]
from graphflop.cli import entry
entry()
print("not reached: entry() ends the process", file=sys.stderr)
"""


def _entry(*argv, marker=None, **kw):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # as users run it
    if marker:
        env["MARKER"] = str(marker)
    kw = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **kw}
    return subprocess.run([sys.executable, "-c", _ENTRY, *argv], text=True, env=env, **kw)


def test_entry_exits_fast_with_status_flushed_output_and_atexit(tmp_path):
    # the console script ends with os._exit (no interpreter teardown): the status,
    # everything written to the pipes and files, the atexit handlers (and what they print) and
    # the non-daemon threads must survive it
    out = tmp_path / "out.json"
    r = _entry(
        "inspect", spec("logreg.py"), "--format", "json", "--json", str(out), marker=tmp_path / "m"
    )
    assert r.returncode == 0, r.stderr[-2000:]
    report, _, last = r.stdout.rstrip().rpartition("\n")
    assert last == "atexit handler ran"
    # the whole report reached the (block-buffered) pipe and the file: both parse
    assert json.loads(report)["params"] == 784 * 10 + 10
    assert json.loads(out.read_text()) == json.loads(report)
    assert (tmp_path / "m").read_text() == "done"
    assert "not reached" not in r.stderr
    bad = _entry("inspect", str(tmp_path / "missing.py"))
    assert bad.returncode == 2
    assert bad.stderr.count("graphflop: error:") == 1 and "atexit handler ran" in bad.stdout


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_entry_standard_output_on_a_full_disk_is_an_error(tmp_path):
    with open("/dev/full", "w") as full:
        r = _entry("inspect", spec("logreg.py"), "--format", "json", stdout=full)
    assert r.returncode == 2
    assert "No space left on device" in r.stderr


def test_entry_reader_that_closed_the_pipe_is_not_an_error(tmp_path):
    # `graphflop inspect M | head`: rich's console exits with status 1 (graphflop's internal
    # error) when the pipe's reader has gone; the table is dropped, the files still written and
    # the status is the command's
    out = tmp_path / "out.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    argv = [sys.executable, "-c", _ENTRY, "inspect", spec("logreg.py"), "--json", str(out)]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    p.stdout.close()  # the reader leaves before the first line
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err.decode()[-2000:]
    assert b"error" not in err, err.decode()
    assert json.loads(out.read_text())["params"] == 7850
    # a plain print that meets the closed pipe (unbuffered, so the write itself fails) ends the
    # command with the status a shell gives a process that SIGPIPE ends, and no message
    env["PYTHONUNBUFFERED"] = "1"
    p = subprocess.Popen(
        [*argv, "--format", "json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    p.stdout.close()
    _, err = p.communicate(timeout=300)
    assert (p.returncode, err) == (141, b"")


def test_entry_with_standard_error_closed(tmp_path):
    # started with fd 2 closed, Python's sys.stderr is None: the exit must not trip on it
    r = subprocess.run(
        [sys.executable, "-c", _ENTRY, "inspect", spec("logreg.py"), "--format", "json"],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: os.close(2),
    )
    assert r.returncode == 0
    assert json.loads(r.stdout.rstrip().rpartition("\n")[0])["params"] == 7850


def test_devices_lists_every_data_sheet_device(capsys):
    """``graphflop devices``: every spec of graphflop.devices by name, its peaks in TFLOP/s
    (the H100 SXM's BF16 989.4 TFLOP/s dense, 3.35 TB/s), and the same figures as JSON."""
    from graphflop.cli import main
    from graphflop.devices import DEVICES

    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    for name in DEVICES:
        assert name in out
    assert "989.4" in out and "3.35" in out
    assert main(["devices", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == list(DEVICES)
    h100 = next(r for r in rows if r["name"] == "h100-sxm")
    assert h100["peak_flops"]["bfloat16"] == 989.4e12
    assert h100["memory_bandwidth"] == 3.35e12
    assert "h100" in h100["aliases"]


PART_EVAL = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x):
        return x + torch.relu(self.bn(self.fc(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(*[Block() for _ in range(3)])
        self.blocks[0].bn.eval()  # frozen batch norm, as fine-tuning keeps it
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.blocks(x))


def example_inputs():
    return (torch.randn(4, 8),)
"""


def test_modules_the_model_leaves_in_eval_mode_stay_so(tmp_path, capsys):
    """A tester's finding: the CLI put every module in training mode, undoing the model file's
    frozen batch norm. Kept as built (with an assumption line); --eval still puts all in eval mode. The
    figures equal graphflop.analyze on the model as built: blocks.0.bn in eval mode saves
    nothing of its own for backward and updates no running statistics."""
    import graphflop
    from graphflop.load import load, make_inputs

    path = tmp_path / "parteval.py"
    path.write_text(PART_EVAL)
    rc, out, err = cli(capsys, "inspect", f"{path}:Net", "--format", "json", "--loss", "sum")
    assert rc == 0, err
    assert err == [
        "assumption: blocks.0.bn in eval mode, as the model left it (its constructor or its "
        "train()): no dropout there, batch norm on running statistics (--eval puts every "
        "module in eval mode)"
    ]
    got = json.loads(out)
    loaded = load(f"{path}:Net", meta=True)
    want = graphflop.analyze(loaded.model, make_inputs(loaded), loss="sum").report
    assert got["totals"]["backward"]["flops"] == want.totals.backward.flops
    assert got["memory"]["saved_for_backward_bytes"] == want.memory.saved_for_backward_bytes
    loaded.model.train()  # what the CLI did: every module in training mode
    train = graphflop.analyze(loaded.model, make_inputs(loaded), loss="sum").report
    assert train.memory.saved_for_backward_bytes != want.memory.saved_for_backward_bytes
    rc, out, err = cli(capsys, "inspect", f"{path}:Net", "--format", "json", "--eval")
    assert rc == 0 and not any("in eval mode, as the model" in e for e in err)


NORM_EVAL = """
import torch
from torch import nn


class Layer(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.bn = nn.BatchNorm1d(d)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(torch.relu(self.bn(self.fc(x))))


class MixedMode(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Layer() for _ in range(4)])
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

    def train(self, mode=True):  # detection models' norm_eval: train() freezes a part
        super().train(mode)
        self.layers[2].eval()
        return self


def example_inputs():
    return (torch.randn(8, 32),)
"""


def test_a_train_override_runs_as_a_training_loop_runs_it(tmp_path, capsys):
    """A tester's finding: a model whose ``train()`` puts layers[2] in eval mode was analysed
    with every module training (its root starts in training mode, so graphflop never called
    ``train()``). The CLI now calls the model's own ``model.train()``, as a training loop does,
    and the report's assumptions name the module left in eval mode. Eager after
    ``model.train()``: dropout draws in the three training layers only, 3 · 8 · 32 = 768
    elements (not 4 · 256 = 1,024), and the bytes ``saved_tensors_hooks`` see (parameters and
    buffers left out) equal the report's saved-for-backward bytes."""
    import importlib.util

    import torch

    from graphflop.runtime.memory_probe import SavedBytes

    path = tmp_path / "norm_eval.py"
    path.write_text(NORM_EVAL)
    rc, out, err = cli(
        capsys, "inspect", f"{path}:MixedMode", "--format", "json", "--loss", "cross_entropy"
    )
    assert rc == 0, err
    got = json.loads(out)
    assert any(a.startswith("layers.2 in eval mode") for a in got["assumptions"])

    spec_ = importlib.util.spec_from_file_location("norm_eval", path)
    assert spec_ is not None and spec_.loader is not None
    mod = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(mod)
    model = mod.MixedMode().train()
    (x,) = mod.example_inputs()
    drawn = []
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.register_forward_hook(
                lambda m, args, out: drawn.append(args[0].numel() if m.training else 0)
            )
    with SavedBytes(model) as saved:
        y = model(x)
        loss = torch.nn.functional.cross_entropy(y, torch.randint(0, 10, (8,)))
    del loss
    assert sum(drawn) == 3 * 8 * 32 == got["totals"]["forward"]["random_elements"]
    assert got["memory"]["saved_for_backward_bytes"] == saved.nbytes


STATE_OUTSIDE = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 8, bias=False)
        self.act = nn.ReLU()

    def forward(self, x):
        h = self.norm(x)
        for _ in range(1 + Net.current % 2):  # state the parent sets: invisible to outlining
            h = self.act(self.fc(h))
        return x + h


class Net(nn.Module):
    current = 0

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(4)])

    def forward(self, x):
        for i, b in enumerate(self.blocks):
            Net.current = i
            x = b(x)
        return x


def example_inputs():
    return (torch.randn(2, 8),)
"""


def test_no_outline_traces_every_call(tmp_path, capsys):
    """A tester's finding: a block whose forward depends on Python state outside it (a class
    attribute its parent sets between calls) is copied from its first call when outlined,
    and the CLI had no way to trace every call. --no-outline does: the four blocks apply fc
    1, 2, 1, 2 times, 6 products of 2·2·8·8 = 256 FLOPs: 1,536. Outlined, every block is
    the template traced once (with whatever the attribute was then): not 1,536."""
    path = tmp_path / "state.py"
    path.write_text(STATE_OUTSIDE)
    rc, out, err = cli(
        capsys, "inspect", f"{path}:Net", "--format", "json", "--loss", "sum", "--no-outline"
    )
    assert rc == 0, err
    assert json.loads(out)["totals"]["forward"]["mm_flops"] == 6 * 2 * 2 * 8 * 8
    rc, out, err = cli(capsys, "inspect", f"{path}:Net", "--format", "json", "--loss", "sum")
    assert json.loads(out)["totals"]["forward"]["mm_flops"] != 6 * 2 * 2 * 8 * 8
