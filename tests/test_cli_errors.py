"""Bad input, adversarially: every case is one stderr line and exit 2 (1 for a bug,
with ``--debug`` for the traceback), checked before any work, and leaves no file behind; plus
the library's own refusals (``register_rule`` without ``override``, passes out of order on
derived graphs) and the ``torch.compile`` backend on symbolic shapes."""

from __future__ import annotations

import json
import os
import stat
import subprocess

import pytest
import torch
from conftest import cli, spec

from graphflop.cli import main

INT_OUTPUT = """
import torch
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
    def forward(self, x):
        return self.fc(x).argmax(-1)
def example_inputs(): return (torch.randn(2, 4),)
"""

TUPLE_OUTPUT = """
import torch
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
    def forward(self, x):
        y = self.fc(x)
        return {"a": y, "b": y * 2} if DICT else (y, y * 2)
def example_inputs(): return (torch.randn(2, 4),)
"""

NO_PARAMS = """
import torch
class M(torch.nn.Module):
    def __init__(self, in_features=4):
        super().__init__()
        self.n = in_features
    def forward(self, x):
        return x.flatten(1)[:, :10] * 2
def example_inputs(): return (torch.randn(2, 4),)
"""

FROZEN = """
import torch
class M(torch.nn.Module):
    def __init__(self, in_features=4):
        super().__init__()
        self.fc = torch.nn.Linear(in_features, 10)
        self.fc.requires_grad_(False)
    def forward(self, x):
        return self.fc(x.flatten(1))
def example_inputs(): return (torch.randn(2, 4),)
"""

#: an integer output that the CLI's meta-tensor check cannot run (a CPU constant meets the meta
#: activations): the check then runs it on fake tensors, as the trace does (tester's finding)
CONST_INT_OUTPUT = INT_OUTPUT.replace(
    "self.fc(x).argmax(-1)", "(self.fc(x) + torch.tensor([0.0, 0.1, 0.2])).argmax(-1)"
)

#: an integer output that neither check before the analysis can see: the input check a library
#: makes outside compilation cannot run on meta or fake tensors, and the trace skips it
#: (tester's finding): the commands that need a backward must still refuse it
VALIDATING_INT_OUTPUT = INT_OUTPUT.replace(
    "        return self.fc(x).argmax(-1)",
    "        if not torch.compiler.is_compiling() and bool((x < -1e9).any()):\n"
    "            raise ValueError('bad input')\n"
    "        return self.fc(x).argmax(-1)",
)

NUMBER_LISTS = """
import torch
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 2)
    def forward(self, x):
        return self.fc(x)
def example_inputs(): return ([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]],)
"""

#: a model that writes in place over a value eager autograd saved for the backward (ReLU's
#: backward reads its output): eager PyTorch refuses its backward, graphflop's functional
#: graphs differentiate it (tester's finding: train --method torch and bench were "internal
#: errors")
INPLACE_SAVED = """
import torch
class M(torch.nn.Module):
    def __init__(self, in_features=4):
        super().__init__()
        self.fc = torch.nn.Linear(in_features, 10)
    def forward(self, x):
        h = torch.relu(self.fc(x.flatten(1)))
        h.add_(0.1)
        return h
def example_inputs(): return (torch.randn(2, 4),)
"""

#: an embedding: its backward is a ScatterElements add, which ONNX Runtime's CPU provider has
#: no float16 kernel for
EMBEDDING = """
import torch
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.fc = torch.nn.Linear(4, 3)
    def forward(self, x):
        return self.fc(self.emb(x)).sum(1)
def example_inputs(): return (torch.randint(0, 10, (2, 5)),)
"""

MODELS = {
    "inplace.py": INPLACE_SAVED,
    "embedding.py": EMBEDDING,
    "lists.py": NUMBER_LISTS,
    "int.py": INT_OUTPUT,
    "validating_int.py": VALIDATING_INT_OUTPUT,
    "const_int.py": CONST_INT_OUTPUT,
    "tuple.py": "DICT = False\n" + TUPLE_OUTPUT,
    "dict.py": "DICT = True\n" + TUPLE_OUTPUT,
    "noparam.py": NO_PARAMS,
    "frozen.py": FROZEN,
}


@pytest.fixture
def work(tmp_path, monkeypatch):
    """A folder with the test models in ``models/`` and an empty ``out/`` (the cwd)."""
    (tmp_path / "models").mkdir()
    for name, text in MODELS.items():
        (tmp_path / "models" / name).write_text(text)
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.chdir(out)
    return tmp_path


def one_error(capsys, *argv, code=2, message=""):
    """Run and assert: exit ``code``, one stderr line naming ``message``, no traceback."""
    rc, out, err = cli(capsys, *argv)
    assert rc == code, (rc, out, err)
    assert len(err) == 1, err
    assert err[0].startswith("graphflop: "), err
    assert "Traceback" not in err[0]
    assert message in err[0], err[0]
    return err[0]


def nothing_left(path):
    left = [p for p in path.rglob("*")]
    assert left == [], left


#: a submodule scripted with torch.jit.script (tester's finding: ``internal error: KeyError: 0``)
JIT_SUBMODULE = """
import torch
from torch import nn
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.jit.script(nn.Linear(4, 4))
        self.b = nn.Linear(4, 3)
    def forward(self, x):
        return self.b(self.a(x))
def example_inputs(): return (torch.randn(2, 4),)
"""

#: one tensor a parameter of one module and a buffer of another (tester's finding: torch's
#: "functional_call got multiple values ... Consider using tie_weights=False")
PARAM_AS_BUFFER = """
import torch
from torch import nn
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.side = nn.Module()
        self.side.register_buffer("wcopy", self.a.weight)
    def forward(self, x):
        return self.a(x) + x @ self.side.wcopy
def example_inputs(): return (torch.randn(2, 4),)
"""


@pytest.mark.parametrize(
    "text, message",
    [
        (JIT_SUBMODULE, "submodule a is a TorchScript module"),
        (PARAM_AS_BUFFER, "both the parameter a.weight and the buffer side.wcopy"),
    ],
    ids=["scripted-submodule", "parameter-as-buffer"],
)
def test_models_graphflop_cannot_trace_are_refused_in_one_line(work, capsys, text, message):
    (work / "models/refused.py").write_text(text)
    one_error(capsys, "inspect", work / "models/refused.py", "--json", "a.json", message=message)
    nothing_left(work / "out")


# --- integer-only model output -------------------------------------------------------------


def test_example_inputs_as_number_lists_say_to_make_tensors(work, capsys):
    """A tester's finding: example_inputs() returning nested lists of numbers got PyTorch's
    'linear(): argument must be Tensor, not list' alone."""
    one_error(capsys, "inspect", work / "models/lists.py", message="torch.tensor(...)")


def test_integer_output_inspect_analyses_the_forward_with_a_note(work, capsys):
    rc, out, err = cli(capsys, "inspect", work / "models/int.py", "--format", "json")
    assert rc == 0, err
    assert err == [
        "note: the model's output has no floating-point tensor to differentiate (e.g. it ends "
        "in argmax); analysing the forward only"
    ]
    d = json.loads(out)
    # Linear(4 → 3) at batch 2: 2·2·4·3 = 48 matmul FLOPs; no backward, update or JVP phase
    assert d["totals"]["forward"]["mm_flops"] == 2 * 2 * 4 * 3
    assert set(d["totals"]) == {"forward", "loss"}


def test_integer_output_the_meta_check_cannot_run_is_seen_on_fake_tensors(work, capsys):
    rc, out, err = cli(capsys, "inspect", work / "models/const_int.py", "--format", "json")
    assert rc == 0, err
    assert len(err) == 1 and "analysing the forward only" in err[0]
    assert set(json.loads(out)["totals"]) == {"forward", "loss"}
    one_error(capsys, "bench", work / "models/const_int.py", "--runtime", "torch", message="bench")


def test_integer_output_is_found_by_the_trace_without_a_forward_first(work, capsys, monkeypatch):
    # inspect, render and export no longer run the model once before the analysis to look at
    # its output (0.8 s for GPT-2 XL at batch 8): the trace finds it, with the same note
    import graphflop.cli.common as common

    def no_check(model, inputs):
        raise AssertionError("the output check ran")

    monkeypatch.setattr(common, "float_output", no_check)
    rc, out, err = cli(capsys, "inspect", work / "models/int.py", "--format", "json")
    assert rc == 0, err
    assert err == [
        "note: the model's output has no floating-point tensor to differentiate (e.g. it ends "
        "in argmax); analysing the forward only"
    ]
    assert set(json.loads(out)["totals"]) == {"forward", "loss"}
    rc, out, err = cli(capsys, "render", work / "models/int.py", "-o", "g.dot")
    assert rc == 0 and len(err) == 1 and "forward only" in err[0], err
    rc, out, err = cli(capsys, "inspect", work / "models/tuple.py", "--format", "json")
    assert rc == 0 and err == [] and "backward" in json.loads(out)["totals"]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["inspect", "--keep-grads", "--json", "out/a.json"], "--keep-grads needs a backward"),
        (["inspect", "--verify", "--json", "out/a.json"], "--verify needs a backward"),
        (["render", "--graph", "backward", "-o", "out/g.dot"], "--graph backward needs"),
        (["bench", "--runtime", "torch"], "bench (it times the train step) needs"),
        (["sweep", "--batches", "1,2"], "sweep needs a backward"),
    ],
)
def test_integer_output_only_the_trace_sees_is_refused_where_a_backward_is_needed(
    work, capsys, argv, message
):
    model = str(work / "models/validating_int.py")
    argv = [argv[0], model, *(str(work / a) if a.startswith("out/") else a for a in argv[1:])]
    line = one_error(capsys, *argv, message=message)
    assert "no floating-point tensor" in line
    nothing_left(work / "out")


def test_no_backward_on_an_integer_output_still_notes_the_dropped_jvp(work, capsys):
    rc, out, err = cli(capsys, "inspect", work / "models/int.py", "--no-backward")
    assert rc == 0 and len(err) == 1 and "analysing the forward only" in err[0], err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["inspect", "models/int.py", "--loss", "sum"], "--loss sum needs a backward"),
        (["render", "models/int.py", "-o", "out/g.dot", "--graph", "backward"], "--graph backward"),
        (
            ["render", "models/int.py", "-o", "out/g.dot", "--graph", "jvp"],
            "--graph jvp needs a JVP",
        ),
        (["sweep", "models/int.py", "--batches", "1,2"], "sweep needs a backward"),
        (["bench", "models/int.py", "--runtime", "torch"], "bench (it times the train step)"),
    ],
)
def test_integer_output_where_a_backward_is_asked_for(work, capsys, argv, message):
    argv = [str(work / a) if a.startswith(("models/", "out/")) else a for a in argv]
    line = one_error(capsys, *argv, message=message)
    assert "no floating-point tensor" in line
    nothing_left(work / "out")


def test_integer_output_render_and_export_the_forward(work, capsys):
    rc, out, err = cli(capsys, "render", work / "models/int.py", "-o", "g.dot")
    assert rc == 0 and (work / "out/g.dot").read_text().startswith("digraph"), err
    rc, out, err = cli(capsys, "export", work / "models/int.py", "--out", "onnx")
    assert rc == 0, err
    assert sorted(p.name for p in (work / "out/onnx").iterdir()) == [
        "forward.onnx",
        "manifest.json",
    ]


# --- output paths --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv,message",
    [
        (["inspect", "{logreg}", "--json", "adir"], "is an existing folder"),
        (["inspect", "{logreg}", "--csv", "afile/x.csv"], "is a file, not a folder"),
        (["bench", "{logreg}", "--json", "adir"], "is an existing folder"),
        (["export", "{logreg}", "--out", "afile"], "is an existing file"),
        (["export", "{logreg}", "--out", "afile/onnx"], "is a file, not a folder"),
        (["render", "{logreg}", "-o", "adir"], "is an existing folder"),
        (["render", "{logreg}", "-o", "g.xyz"], "unsupported suffix"),
        (["render", "{logreg}", "-o", "afile/g.svg"], "is a file, not a folder"),
        (["train", "{logreg}", "--out", "afile", "--steps", "1"], "is an existing file"),
        (["sweep", "{logreg}", "--batches", "1", "--csv", "s.csv", "--plot", "x.xyz"], "--plot"),
        (["sweep", "{logreg}", "--batches", "1", "--json", "adir"], "is an existing folder"),
        # tester's findings: export/train wrote into the current folder;
        # bench ran in full, then failed naming a temporary file and left DIR/onnx behind
        (["export", "{logreg}", "--out", ""], "--out needs a folder name"),
        (["train", "{logreg}", "--out", "", "--steps", "1"], "--out needs a folder name"),
        (["bench", "{logreg}", "--out", "run", "--json", "run"], "is where --out run keeps"),
        (["bench", "{logreg}", "--out", "run", "--json", "run/onnx"], "is where --out run"),
    ],
)
def test_bad_output_paths_are_refused_before_any_work(work, capsys, monkeypatch, argv, message):
    _no_work(monkeypatch)
    (work / "out/adir").mkdir()
    (work / "out/afile").write_text("keep")
    one_error(capsys, *[a.format(logreg=spec("logreg.py")) for a in argv], message=message)
    assert sorted(p.name for p in (work / "out").iterdir()) == ["adir", "afile"]
    assert list((work / "out/adir").iterdir()) == []


def test_train_error_before_the_first_step_is_the_only_stderr_line(work, capsys):
    """Tester's finding: the progress bar, started before the output folder was checked,
    printed an empty line above the error (the tests' cli() drops empty lines)."""
    from graphflop.cli import main

    (work / "out/afile").write_text("keep")
    rc = main(["train", str(spec("logreg.py")), "--out", "afile/run", "--steps", "1"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("graphflop: error: ") and err.count("\n") == 1, repr(err)


def test_unwritable_folder_is_refused(work, capsys, monkeypatch):
    """A folder without write permission (simulated: the tests may run as root, who may write
    anywhere)."""
    real_access = os.access
    ro = work / "out/ro"
    ro.mkdir()
    monkeypatch.setattr(
        os, "access", lambda p, m: False if str(p) == str(ro) else real_access(p, m)
    )
    for argv in (
        ["inspect", spec("logreg.py"), "--json", ro / "x.json"],
        ["export", spec("logreg.py"), "--out", ro / "onnx"],
        ["train", spec("logreg.py"), "--out", ro / "run", "--steps", "1"],
        ["train", spec("logreg.py"), "--out", ro, "--steps", "1"],
    ):
        one_error(capsys, *argv, message="no permission")
    assert list(ro.iterdir()) == []


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs procfs")
def test_folder_that_takes_no_new_file_is_refused_even_as_root(work, capsys, monkeypatch):
    """Tester's finding: as root, ``os.access`` calls /proc writable, so ``train --out /proc/x``
    trained first and failed at the end; a probe file now finds it before any work."""
    _no_work(monkeypatch)
    for argv in (
        ["train", spec("logreg.py"), "--out", "/proc/graphflop-run", "--steps", "1"],
        ["inspect", spec("logreg.py"), "--json", "/proc/graphflop.json"],
        ["export", spec("logreg.py"), "--out", "/proc/graphflop-onnx"],
    ):
        one_error(capsys, *argv, message="cannot create a file in /proc")


def _refuses_a_file(folder) -> str | None:
    """Why ``folder`` took no new file (the OS error), or None when it took one."""
    probe = folder / "probe"
    try:
        probe.touch()
    except OSError as e:
        return e.strerror
    probe.unlink()
    return None


def _refuse_root(folder) -> list[str]:
    """Make ``folder`` refuse root's new files; return the command that undoes it. Root ignores
    a folder's mode, not its immutable flag (``chattr +i``: EPERM) nor a read-only mount (a
    bind mount of the folder onto itself, remounted read-only: EROFS), the fallback where the
    filesystem has no such flag (overlayfs)."""
    if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0:
        return ["chattr", "-i", str(folder)]
    subprocess.run(["mount", "--bind", str(folder), str(folder)], check=True, capture_output=True)
    undo = ["umount", str(folder)]
    try:
        subprocess.run(
            ["mount", "-o", "remount,bind,ro", str(folder)], check=True, capture_output=True
        )
    except subprocess.CalledProcessError:
        subprocess.run(undo, check=False, capture_output=True)
        raise
    return undo


def test_read_only_folder_for_real(work, capsys):
    """A folder the OS really refuses a file in: mode 0o555 for a user; as root (CI), also
    immutable or mounted read-only (:func:`_refuse_root`)."""
    ro = work / "out/ro"
    ro.mkdir()
    ro.chmod(0o555)
    undo = _refuse_root(ro) if os.geteuid() == 0 else None
    try:
        # the test means something only if the folder refuses a file
        assert _refuses_a_file(ro) is not None, "the folder took a file: nothing to test"
        one_error(capsys, "inspect", spec("logreg.py"), "--json", ro / "x.json", message="ro")
        assert list(ro.iterdir()) == []
    finally:
        if undo:
            subprocess.run(undo, check=False, capture_output=True)
        ro.chmod(0o755)


def test_files_get_the_umask_mode(work, capsys):
    old = os.umask(0o027)
    try:
        rc, _, err = cli(
            capsys, "inspect", spec("logreg.py"), "--json", "new/x.json", "--csv", "x.csv"
        )
        assert rc == 0, err
        train = ["train", spec("logreg.py"), "--runtime", "onnxruntime", "--steps", "1"]
        rc, _, err = cli(capsys, *train, "--eval-every", "0", "--quiet", "--out", "run")
        assert rc == 0, err
    finally:
        os.umask(old)
    files = [work / "out/new/x.json", work / "out/x.csv", *(work / "out/run").rglob("*")]
    assert {p.relative_to(work / "out").as_posix() for p in files} >= {
        "run/train.csv",
        "run/train.png",
        "run/summary.json",
        "run/onnx/train_step.onnx",
    }
    for p in files:  # files 0o666 & ~0o027, folders 0o777 & ~0o027
        assert stat.S_IMODE(p.stat().st_mode) == (0o750 if p.is_dir() else 0o640), p
    assert stat.S_IMODE((work / "out/new").stat().st_mode) == 0o750


def test_atomic_write_leaves_nothing_when_the_writer_fails(tmp_path):
    from graphflop.io import atomic_write

    def fail(p):
        p.write_text("half")
        raise RuntimeError("writer failed")

    with pytest.raises(RuntimeError):
        atomic_write(tmp_path / "a/b/x.png", fail)
    assert list(tmp_path.iterdir()) == []  # no temporary file, no folder made for it


# --- sweep ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--batch", "8"], "--batch and --batches"),
        (["--depth", "1,2"], "--batches or --depth, not both"),  # rows were mislabelled
        (["--seq", "8"], "--seq 8 applies to hf: models only"),
    ],
)
def test_sweep_refuses_options_it_cannot_honour(work, capsys, extra, message):
    one_error(
        capsys,
        "sweep",
        spec("logreg.py"),
        "--batches",
        "1,2",
        "--csv",
        "s.csv",
        *extra,
        message=message,
    )
    nothing_left(work / "out")


@pytest.mark.parametrize(
    "extra", [["--input-shape", "2,1,28,28"], ["--dtype", "float64"], ["--eval"], ["--loss", "mse"]]
)
def test_sweep_has_no_inputs_or_loss_options(work, capsys, extra):
    """A tester's finding: sweep --help listed --input-shape, --dtype, --eval and --loss with
    inspect's wording, and sweep refused each. They are not sweep's options: argparse's one-line
    error, exit 2, and --help does not list them."""
    argv = ["sweep", spec("logreg.py"), "--batches", "1,2", "--csv", "s.csv", *extra]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    cap = capsys.readouterr()
    assert cap.out == "" and cap.err.count("\n") == 1, cap.err
    assert cap.err.startswith(f"graphflop sweep: error: unrecognized arguments: {extra[0]}"), (
        cap.err
    )
    nothing_left(work / "out")
    with pytest.raises(SystemExit):
        main(["sweep", "--help"])
    options = capsys.readouterr().out.partition("\noptions:")[2]  # the description names them
    assert options and extra[0] not in options


@pytest.mark.parametrize(
    "batches,message",
    [
        ("1,,2", "comma-separated integers"),
        ("1,2,", "comma-separated integers"),
        ("1,2,1", "1 is given twice"),
    ],
)
def test_sweep_refuses_an_empty_or_repeated_batch(work, capsys, batches, message):
    """Tester's finding: an empty item was skipped and a repeated one analysed twice."""
    one_error(capsys, "sweep", spec("logreg.py"), "--batches", batches, message=message)


def test_sweep_honours_batch_for_depth_sweeps(work, capsys):
    rc, out, err = cli(
        capsys, "sweep", spec("mlp.py"), "--depth", "1", "--batch", "3", "--json", "s.json"
    )
    assert rc == 0, err
    (row,) = json.loads((work / "out/s.json").read_text())
    # MLP depth 1 at batch 3: 784→1024→10: 2·3·(784·1024 + 1024·10) mm FLOPs, + bias/relu/loss
    assert row["forward_flops"] > 2 * 3 * (784 * 1024 + 1024 * 10)
    assert row["forward_flops"] < 2 * 3 * (784 * 1024 + 1024 * 10) + 3 * 2000 + 500


# --- bench ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--repeat", "0"], "--repeat"),
        (["--rotate", "0"], "--rotate"),
        (["--warmup", "-1"], "--warmup"),
        (["--dtype", "fp16", "--runtime", "onnxruntime", "--device", "cpu"], "float16 kernels"),
        (["--dtype", "int64"], "not a floating-point dtype"),
    ],
)
def test_bench_bad_options(work, capsys, argv, message):
    one_error(capsys, "bench", spec("logreg.py"), "--json", "b.json", *argv, message=message)
    nothing_left(work / "out")


@pytest.mark.parametrize("model", ["noparam.py", "frozen.py"])
def test_bench_without_trainable_parameters(work, capsys, model):
    one_error(capsys, "bench", work / "models" / model, message="bench times a train step")


def test_bench_huge_batch_refused_with_the_estimate(work, capsys):
    """logreg at batch 10⁹: the three input sets alone are 3 × 10⁹ × 784 × 4 bytes ≈ 9.4 TB."""
    line = one_error(
        capsys, "bench", spec("logreg.py"), "--batch", "1000000000", "--json", "b.json"
    )
    need = int(line.split("needs about ")[1].split(" bytes")[0].replace(",", ""))
    assert need > 3 * 10**9 * 784 * 4
    assert "available" in line and "lower --batch" in line
    nothing_left(work / "out")


def test_bench_memory_estimate_is_the_peak_plus_the_input_sets():
    from conftest import analysis

    from graphflop.runtime.bench import bench_memory_bytes

    a = analysis("logreg.py", 4)
    m = a.report.memory
    # inputs (4, 1, 28, 28) float32 + int64 targets (4,), plus the 7,850 float32 parameters
    one_set = 4 * 784 * 4 + 4 * 8 + m.params_bytes
    peak = max(m.forward_peak_bytes, m.train_peak_bytes, m.jvp_peak_bytes)
    assert bench_memory_bytes(a, 3) == peak + 3 * one_set


@pytest.mark.parametrize("model", ["tuple.py", "dict.py"])
def test_bench_tuple_and_dict_outputs(work, capsys, model):
    rc, out, err = cli(
        capsys,
        "bench",
        work / "models" / model,
        "--runtime",
        "torch",
        "--repeat",
        "1",
        "--warmup",
        "0",
        "--rotate",
        "1",
        "--json",
        "b.json",
    )
    assert rc == 0, err
    doc = json.loads((work / "out/b.json").read_text())
    assert set(doc["runtimes"]["torch"]["phases"]) == {
        "forward",
        "train_step",
        "forward_gradient_step",
    }


# --- train and inspect options ---------------------------------------------------------------


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--epochs", "nan"], "bad --epochs nan: must be positive"),
        (["--epochs", "inf"], "bad --epochs inf: must be positive"),
        (["--lr", "inf"], "bad --lr inf: must be positive and finite"),
        (["--steps", "0"], "must be positive"),
    ],
)
def test_train_bad_numbers(work, capsys, argv, message):
    one_error(capsys, "train", spec("logreg.py"), "--out", "run", *argv, message=message)
    nothing_left(work / "out")


@pytest.mark.parametrize("model", ["noparam.py", "frozen.py"])
@pytest.mark.parametrize("method", ["torch", "backprop"])
def test_train_without_trainable_parameters(work, capsys, model, method):
    one_error(
        capsys,
        "train",
        work / "models" / model,
        "--method",
        method,
        "--steps",
        "1",
        "--out",
        "run",
        message="nothing to train",
    )
    nothing_left(work / "out")


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--verify-samples", "-1", "--verify"], "bad --verify-samples -1"),
        (["--dtype", "int64"], "--dtype int64 is not a floating-point dtype"),
        (["--max-layers", "-1"], "--max-layers"),
    ],
)
def test_inspect_bad_options(work, capsys, argv, message):
    one_error(capsys, "inspect", spec("logreg.py"), "--json", "x.json", *argv, message=message)
    nothing_left(work / "out")


# --- the error path itself -----------------------------------------------------------------


def test_unexpected_error_is_one_line_exit_1_and_debug_prints_the_traceback(
    work, capsys, monkeypatch
):
    import graphflop.cli.inspect

    def boom(args, **kwargs):
        raise RuntimeError("something graphflop did not expect")

    monkeypatch.setattr(graphflop.cli.inspect, "load_model", boom)
    line = one_error(capsys, "inspect", spec("logreg.py"), code=1, message="internal error")
    assert "RuntimeError: something graphflop did not expect" in line and "--debug" in line
    rc, _, err = cli(capsys, "inspect", spec("logreg.py"), "--debug")
    assert rc == 1 and err[0].startswith("Traceback") and "boom" in "\n".join(err)


@pytest.mark.parametrize("command", ["inspect", "export", "bench", "render", "train", "sweep"])
def test_every_subcommand_has_debug(capsys, command):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert "--debug" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["inspect", "render", "sweep"])
def test_seq_for_a_model_without_token_inputs_is_refused(capsys, command, tmp_path, monkeypatch):
    """A tester's finding: hf:vit-b-16 --seq 999999 exited 0, the image size unchanged."""
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    argv = [command, "hf:vit-b-16", "--arg", "num_hidden_layers=1", "--seq", "999999"]
    argv += {"render": ["-o", "g.dot"], "sweep": ["--batches", "1,2"]}.get(command, [])
    line = one_error(capsys, *argv, message="--seq 999999 sets the length of token inputs")
    assert "hf:vit-b-16 takes none" in line and "drop --seq" in line
    nothing_left(tmp_path)


def test_rows_left_out_of_the_table_are_called_smaller_only_when_they_are():
    """A tester's finding: '415 smaller layers not shown' for layers the same size as those
    shown. Rows: the Linear layers, loss and (model) (no work: never printed, not counted).
    Linear(8, 8) layers 1 to 3 tie (the first has no input cotangent, so less backward work):
    the cut after two of them leaves out the third, 0 and loss, 3 other rows; Linear(8, 2)
    after Linear(8, 8) is smaller: with one row shown, 2 smaller rows (it and loss)."""
    from rich.console import Console
    from torch import nn

    import graphflop
    from graphflop.export.report import print_report

    def footer(model, max_layers):
        report = graphflop.analyze(model, (torch.randn(2, 8),), loss="sum", jvp=False).report
        console = Console(record=True, width=300)
        print_report(report, console, max_layers=max_layers)
        return [x for x in console.export_text().splitlines() if "not shown" in x]

    same = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))
    assert footer(same, 2) == [
        "3 other layers not shown, none larger than those shown (--json has all)"
    ]
    assert footer(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)), 1) == [
        "2 smaller layers not shown (--json has all)"
    ]
    assert footer(same, 4) == ["1 smaller layer not shown (--json has all)"]  # loss
    assert footer(same, 5) == []


@pytest.mark.parametrize("command", ["inspect", "export", "bench", "render", "sweep"])
def test_every_spec_help_names_each_hf_form(capsys, command):
    """The subcommands that take a model SPEC list every hf: form it accepts."""
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse's line wrapping undone
    for form in ("hf:PRESET", "hf:ORG/NAME[@REV]", "hf:MODEL_TYPE", "hf:PATH"):
        assert form in text, (command, form)


# --- the library ---------------------------------------------------------------------------


def test_passes_out_of_order_on_derived_graphs_raise_pass_order_error():
    import graphflop
    from graphflop import api

    m = torch.nn.Sequential(torch.nn.Linear(4, 3))
    fwd = api.annotate_flops(graphflop.trace(m, (torch.randn(2, 4),), loss="sum"))
    bwd, upd = api.build_vjp(fwd), api.add_optimizer_update(fwd)
    derived = {
        "jvp": api.build_jvp(fwd),
        "vjp": bwd,
        "update": upd,
        "forward_gradient": api.build_forward_gradient_step(fwd),
        "train_step": api.build_train_step(fwd, bwd, upd),
    }
    passes = {
        "build_vjp": api.build_vjp,
        "build_jvp": api.build_jvp,
        "add_optimizer_update": api.add_optimizer_update,
        "build_forward_gradient_step": api.build_forward_gradient_step,
        "build_train_step": lambda g: api.build_train_step(g, bwd, upd),
    }
    for kind, g in derived.items():
        for name, run in passes.items():
            match = f"{name} requires 'traced', a forward graph, but this is a {kind} graph"
            with pytest.raises(graphflop.PassOrderError, match=match):
                run(g)
        # annotating a derived graph is in order
        assert api.annotate_memory(api.annotate_flops(g)) is g


def test_compile_backend_counts_symbolic_shapes_at_their_hints():
    from graphflop.compile import CompileReport, compile_backend

    torch._dynamo.reset()
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    for dynamic in (True, None):  # dynamic from the start; PyTorch's recompile at batch 5
        torch._dynamo.reset()
        r = CompileReport()
        f = torch.compile(m, backend=compile_backend(r), dynamic=dynamic)
        for b in (2, 5, 7):
            x = torch.randn(b, 4)
            assert torch.equal(f(x), m(x))
        assert r.skipped == []
        g = r.graphs[-1]
        hint = int(g.note.rsplit("=", 1)[1])
        assert g.note.startswith("symbolic sizes counted at their hints: s")
        # at batch N: 2·N·4·3 + 3N bias + 3N relu + 2·N·3·2 + 2N bias = 44·N FLOPs
        assert g.forward_flops == 44 * hint
    torch._dynamo.reset()


def test_failed_onnx_export_leaves_no_folder(tmp_path, monkeypatch):
    import graphflop.export.onnx as onnx_export

    def fail(*a, **k):
        raise onnx_export.OnnxExportError("no ONNX function for aten.odd.default")

    monkeypatch.setattr(onnx_export, "export_graph", fail)
    monkeypatch.setattr(onnx_export, "graph_io_names", lambda kind, gm: ([], []))
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    with pytest.raises(onnx_export.OnnxExportError):
        onnx_export.export_all({"forward": gm}, tmp_path / "a/b/onnx")
    assert list(tmp_path.iterdir()) == []  # neither the staging folder nor a/b


# --- a tester's findings (bad input in the CLI) ----------------------------------------------

EXAMPLE_RAISES = """
import torch
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
    def forward(self, x):
        return self.fc(x)
def example_inputs(): return {}["no inputs"]
"""

EXITS = """
import sys
import torch
if WHERE == "import":
    sys.exit(0)
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        if WHERE == "init":
            raise SystemExit(3)
        self.fc = torch.nn.Linear(4, 3)
    def forward(self, x):
        return self.fc(x)
def example_inputs():
    if WHERE == "example":
        sys.exit()
    return (torch.randn(2, 4),)
"""


def _no_work(monkeypatch):
    """Make any analysis or training fail the test: the refusal must come before the work."""
    import graphflop.analysis
    import graphflop.sweep  # binds analyze at import: import it before the patch, not during
    import graphflop.train.loop

    def no_work(*a, **k):
        raise AssertionError("work started before the options and paths were checked")

    monkeypatch.setattr(graphflop.analysis, "analyze", no_work)
    monkeypatch.setattr(graphflop.sweep, "analyze", no_work)
    monkeypatch.setattr(graphflop.train.loop, "_setup", no_work)


@pytest.mark.parametrize("option", ["--plot-memory", "--json", "--csv"])
def test_empty_output_path_is_refused(work, capsys, monkeypatch, option):
    """A tester's finding: ``--plot-memory ""`` drew nothing and exited 0."""
    _no_work(monkeypatch)
    one_error(capsys, "inspect", spec("logreg.py"), option, "", message=f"{option} needs a file")
    nothing_left(work / "out")


@pytest.mark.parametrize(
    "argv,message",
    [
        (["inspect", "{logreg}", "--plot-memory", "a.png", "--json", "a.png"], "--json and --plot"),
        (["inspect", "{logreg}", "--csv", "./a.json", "--json", "a.json"], "--json and --csv"),
        (["inspect", "{logreg}", "--csv", "sub/../a.svg", "--plot-memory", "a.svg"], "--csv"),
        (["sweep", "{logreg}", "--batches", "1", "--csv", "s.csv", "--json", "s.csv"], "--csv"),
    ],
)
def test_two_outputs_to_one_path_are_refused_before_any_work(
    work, capsys, monkeypatch, argv, message
):
    """A tester's finding: the PNG replaced the JSON written to the same path, exit 0."""
    _no_work(monkeypatch)
    line = one_error(capsys, *[a.format(logreg=spec("logreg.py")) for a in argv], message=message)
    assert "give each output its own file" in line
    nothing_left(work / "out")


def test_a_failed_write_leaves_no_output_file(work, capsys, monkeypatch):
    """A tester's finding: the JSON and CSV were left behind when the plot's write failed after them
    (``/sys/x.png`` as root). The plot's writer is made to fail the way that write does."""
    import matplotlib.figure

    def denied(self, path, **kw):
        raise OSError(13, "Permission denied", str(path))

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", denied)
    argv = ["--json", "ok.json", "--csv", "ok.csv", "--plot-memory", "sub/x.png", "--no-jvp"]
    one_error(capsys, "inspect", spec("logreg.py"), *argv, message="Permission denied")
    nothing_left(work / "out")


def test_atomic_group_writes_all_files_or_none(tmp_path):
    from graphflop.io import atomic_group, atomic_write

    with pytest.raises(OSError), atomic_group():
        atomic_write(tmp_path / "a.json", "{}")
        atomic_write(tmp_path / "new/b.csv", "x\n")
        assert not (tmp_path / "a.json").exists()  # nothing is in place before the group ends
        raise OSError(28, "No space left on device", str(tmp_path / "c.png"))
    assert list(tmp_path.iterdir()) == []
    with atomic_group():
        atomic_write(tmp_path / "a.json", "{}")
        with atomic_group():  # a nested group joins the outer one
            atomic_write(tmp_path / "b.csv", "x\n")
        # only the temporary files (.a.json.XXXX.tmp.json, .b.csv.XXXX.tmp.csv) exist yet
        assert sorted(p.name.split(".")[1] for p in tmp_path.iterdir()) == ["a", "b"]
        assert not (tmp_path / "a.json").exists() and not (tmp_path / "b.csv").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.csv"]
    assert (tmp_path / "b.csv").read_text() == "x\n"


def test_example_inputs_that_raise_are_the_users_error(work, capsys):
    """A tester's finding: exit 1, 'internal error ... a bug in graphflop'."""
    (work / "models/exraise.py").write_text(EXAMPLE_RAISES)
    line = one_error(
        capsys, "inspect", work / "models/exraise.py", "--json", "x.json", message="exraise.py"
    )
    assert "example_inputs() raised KeyError: 'no inputs'" in line
    assert "internal error" not in line
    nothing_left(work / "out")


@pytest.mark.parametrize(
    "where,doing",
    [
        ("import", "importing it"),
        ("init", "constructing it"),
        ("example", "calling example_inputs()"),
    ],
)
def test_model_file_that_exits_is_one_line(work, capsys, where, doing):
    """A tester's finding: sys.exit(0) at import (or SystemExit in the constructor) ended graphflop with
    exit 0 and no output."""
    path = work / f"models/exits_{where}.py"
    path.write_text(f"WHERE = {where!r}\n" + EXITS)
    line = one_error(capsys, "inspect", path, "--json", "x.json", message="exited while loading")
    assert doing in line and "SystemExit(" in line
    nothing_left(work / "out")


FORWARD_EXITS = """
import sys
import torch
from torch import nn


class M(nn.Module):
    def __init__(self, code=0):
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.code = code

    def forward(self, x):
        sys.exit(self.code)


def example_inputs():
    return (torch.randn(2, 4),)
"""


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", "--json", "out/x.json"],
        ["inspect", "--arg", "code=3", "--verify"],
        ["bench", "--runtime", "torch", "--json", "out/b.json"],
    ],
    ids=lambda a: "-".join(a[:2]),
)
def test_model_that_exits_in_forward_is_one_line(work, capsys, argv):
    """Tester's finding: sys.exit in forward ended graphflop with the model's
    status (0: a script took it for success) and no message, no output file."""
    (work / "models/fwdexit.py").write_text(FORWARD_EXITS)
    argv = [argv[0], f"{work / 'models/fwdexit.py'}:M"] + [
        str(work / a) if a.startswith("out/") else a for a in argv[1:]
    ]
    line = one_error(capsys, *argv, message="the model exited while graphflop ran it")
    assert "SystemExit(" in line and "sys.exit" in line
    nothing_left(work / "out")


RAISES_BASE = """
import torch
from torch import nn


class Boom(BaseException):
    pass


if WHERE == "import":
    raise Boom("at import")


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        RAISE


def example_inputs():
    return (torch.randn(2, 4),)
"""


@pytest.mark.parametrize(
    "where,raise_,code,message",
    [
        ("forward", 'raise Boom("base exception")', 2, "the model raised Boom: base exception"),
        ("forward", "raise GeneratorExit", 2, "the model raised GeneratorExit, a BaseException"),
        ("import", "pass", 2, "the model raised Boom: at import"),
        # unchanged: Ctrl-C and the model's exit
        ("forward", "raise KeyboardInterrupt", 130, "graphflop: interrupted"),
        ("forward", "raise SystemExit(3)", 2, "the model exited while graphflop ran it"),
    ],
    ids=["Boom", "GeneratorExit", "import", "KeyboardInterrupt", "SystemExit"],
)
def test_model_raising_a_base_exception_is_one_line(work, capsys, where, raise_, code, message):
    """A tester's finding: a model raising a BaseException subclass (neither an Exception nor
    KeyboardInterrupt or SystemExit) made `inspect --json` exit 1 with an 86-line traceback.
    Now one line naming it and the model's line, exit 2, no output file."""
    path = work / f"models/base_{where}.py"
    path.write_text(f"WHERE = {where!r}\n" + RAISES_BASE.replace("RAISE", raise_))
    line = one_error(capsys, "inspect", path, "--json", "x.json", code=code, message=message)
    if code == 2 and "exited" not in message:
        assert "a BaseException that is not an Exception" in line
        # the model's own line, where the traceback shows it
        assert f"base_{where}.py:" in line and "internal error" not in line
    nothing_left(work / "out")


PRINTS = """
import torch
from torch import nn

print("loading the model")


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        print("forward", tuple(x.shape))
        return self.fc(x)


def example_inputs():
    return (torch.randn(2, 4),)
"""


def test_format_json_stdout_is_the_document_alone_when_the_model_prints(work, capsys):
    """Tester's finding: a model's prints came before the JSON on standard
    output, so `| python -m json.tool` failed; they go to standard error now."""
    (work / "models/prints.py").write_text(PRINTS)
    rc, out, err = cli(capsys, "inspect", f"{work / 'models/prints.py'}:M", "--format", "json")
    assert rc == 0, err
    assert json.loads(out)["params"] == 4 * 2 + 2
    assert "loading the model" in err and "forward (2, 4)" in err
    # the table form leaves the model's prints where they were
    rc, out, err = cli(capsys, "inspect", f"{work / 'models/prints.py'}:M")
    assert rc == 0 and "forward (2, 4)" in out


WARNS = """
import warnings

import torch
from torch import nn


class M(nn.Module):
    def __init__(self):
        super().__init__()
        for _ in range(2):  # the same warning twice: one line
            warnings.warn("this layer is" + chr(10) + "experimental", UserWarning)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x)


def example_inputs():
    return (torch.randn(2, 4),)
"""


def test_python_warnings_are_one_line_each_and_dropped_on_an_error(work, capsys):
    """Tester's finding: PyTorch's and the model's warnings took two stderr
    lines each (message, then the source line), also before a one-line error."""
    (work / "models/warns.py").write_text(WARNS)
    rc, out, err = cli(capsys, "inspect", f"{work / 'models/warns.py'}:M", "--format", "json")
    assert rc == 0, err
    (line,) = err
    assert line.startswith("warning: UserWarning: this layer is experimental (/"), line
    assert line.endswith("/models/warns.py:12)"), line
    one_error(
        capsys,
        "inspect",
        f"{work / 'models/warns.py'}:M",
        "--input-shape",
        "2,5",
        message="input",
    )


WARNS_IN_FORWARD = """
import warnings

import torch
from torch import nn


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        for _ in range(2):  # the same warning twice: one line
            warnings.warn("forward is experimental", UserWarning)
        return self.fc(x)


def example_inputs():
    return (torch.randn(2, 4),)
"""


def test_a_warning_in_forward_is_one_line(work, capsys):
    """Tester's finding: a ``warnings.warn`` in the model's forward() was dropped (tracing
    silenced every warning to hide torch's own about fake tensors)."""
    (work / "models/warns_fwd.py").write_text(WARNS_IN_FORWARD)
    rc, out, err = cli(capsys, "inspect", f"{work / 'models/warns_fwd.py'}:M", "--format", "json")
    assert rc == 0, err
    (line,) = err  # raised twice per call: one line
    assert line.startswith("warning: UserWarning: forward is experimental (/"), line
    assert line.endswith("/models/warns_fwd.py:15)"), line


BACKWARD_OPTIONS = [["--checkpoint", "fc*"], ["--amp", "bf16"], ["--keep-grads"]]


@pytest.mark.parametrize("option", BACKWARD_OPTIONS, ids=lambda o: o[0])
def test_backward_options_with_no_backward_are_refused(work, capsys, monkeypatch, option):
    """A tester's finding: silently ignored (exit 0; the JSON even said keep_grads: true)."""
    _no_work(monkeypatch)
    line = one_error(
        capsys,
        "inspect",
        spec("logreg.py"),
        "--no-backward",
        *option,
        "--json",
        "x.json",
        message=f"{' '.join(option)} needs a backward",
    )
    assert "--no-backward" in line
    nothing_left(work / "out")


@pytest.mark.parametrize("option", BACKWARD_OPTIONS, ids=lambda o: o[0])
def test_backward_options_on_an_integer_output_are_refused(work, capsys, option):
    """A tester's finding, forward-only analysis of a model whose output is integer-only."""
    line = one_error(
        capsys,
        "inspect",
        work / "models/int.py",
        *option,
        "--json",
        "x.json",
        message=f"{' '.join(option)} needs a backward",
    )
    assert "no floating-point tensor" in line
    nothing_left(work / "out")


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--memory-model", "graph", "--amp", "bf16"], "--amp bf16 is a what-if on the eager"),
        (["--memory-model", "compiled", "--amp", "fp16"], "not on --memory-model compiled"),
        (["--memory-model", "graph", "--checkpoint", "fc*"], "--checkpoint fc* is a what-if"),
        (["--memory-model", "graph", "--memory-device", "cuda"], "does not depend on the device"),
        (["--memory-model", "graph", "--memory-device", "cpu"], "drop --memory-device"),
    ],
)
def test_memory_options_the_memory_model_does_not_have(work, capsys, monkeypatch, argv, message):
    """A tester's finding: --amp/--checkpoint are eager what-ifs (graphflop.passes.amp, .checkpoint),
    drawn against the graph model's figures; the graph model has no device."""
    _no_work(monkeypatch)
    one_error(capsys, "inspect", spec("logreg.py"), *argv, "--json", "x.json", message=message)
    nothing_left(work / "out")


@pytest.mark.parametrize(
    "argv,prog,message",
    [
        (["inspect", "m.py", "--amp", "int8"], "graphflop inspect", "argument --amp: invalid"),
        (["render", "m.py"], "graphflop render", "the following arguments are required: -o"),
        (["train", "m.py", "--steps", "x"], "graphflop train", "argument --steps: invalid int"),
        (["sweep", "m.py", "--nope"], "graphflop sweep", "unrecognized arguments: --nope"),
        (["frobnicate"], "graphflop", "argument command: invalid choice: 'frobnicate'"),
    ],
)
def test_argparse_errors_are_one_line(capsys, argv, prog, message):
    """A tester's finding: argparse printed the whole usage (17 lines for inspect) before the error."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    cap = capsys.readouterr()
    assert cap.out == ""
    assert cap.err.count("\n") == 1 and "usage:" not in cap.err, cap.err
    assert cap.err.startswith(f"{prog}: error: {message}"), cap.err
    assert cap.err.rstrip().endswith(f"see {prog} --help"), cap.err


def test_train_module_argparse_errors_are_one_line(capsys):
    from graphflop.cli.train import main as train_main

    with pytest.raises(SystemExit) as e:
        train_main(["m.py", "--steps", "x"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("graphflop train: error")


def test_folder_as_plot_file_says_it_is_a_folder(work, capsys, monkeypatch):
    """A tester's finding: 'unsupported suffix' for an existing folder."""
    _no_work(monkeypatch)
    (work / "out/adir.png").mkdir()
    for name in ("adir.png", "."):
        line = one_error(
            capsys, "inspect", spec("logreg.py"), "--plot-memory", name, message="existing folder"
        )
        assert "suffix" not in line
    assert [p.name for p in (work / "out").iterdir()] == ["adir.png"]


_NO_PARAMS = """
import torch
class M(torch.nn.Module):
    def __init__(self, frozen=False):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(8), requires_grad=False) if frozen else None
    def forward(self, x):
        y = torch.relu(x) if self.w is None else torch.relu(x * self.w)
        return y.sum(-1)
def example_inputs(): return (torch.randn(4, 8),)
"""


@pytest.mark.parametrize(
    "extra,warned",
    [
        ([], True),
        (["--arg", "frozen=True"], True),
        (["--no-backward"], True),  # the JVP's weight tangents are still all zero
        (["--no-backward", "--no-jvp"], False),
        (["--no-backward", "--tangents", "inputs"], False),
    ],
)
def test_a_model_without_trainable_parameters_is_one_warning(tmp_path, capsys, extra, warned):
    """Tester's finding: a parameterless model printed ratios of 0.00 without a word."""
    (tmp_path / "nop.py").write_text(_NO_PARAMS)
    rc, out, err = cli(capsys, "inspect", tmp_path / "nop.py", *extra)
    assert rc == 0 and "forward" in out, err
    if warned:
        assert len(err) == 1 and err[0].startswith("warning: the model has no trainable"), err
        assert ("(8 frozen)" in err[0]) == ("frozen=True" in extra), err
    else:
        assert err == []


def test_loss_is_computed_from_the_first_floating_point_output(tmp_path, capsys):
    """Tester's finding: a model returning (argmax, logits) crashed every command (IndexError
    in the backward builder: the loss was the integer argmax). The loss now starts from the
    logits: Linear(4, 3) at batch 2 has the cross-entropy backward of a Linear alone, and
    verify's gradients agree with torch.func on the same loss."""
    (tmp_path / "intfirst.py").write_text(
        "import torch\n"
        "class A(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.fc = torch.nn.Linear(4, 3)\n"
        "    def forward(self, x):\n"
        "        y = self.fc(x); return y.argmax(-1), y\n"
        "def example_inputs(): return (torch.randn(2, 4),)\n"
    )
    out = tmp_path / "a.json"
    rc, _, err = cli(capsys, "inspect", tmp_path / "intfirst.py", "--verify", "--json", out)
    assert rc == 0, err
    d = json.loads(out.read_text())
    assert d["loss"] == "cross_entropy"
    # weight gradient δᵀ·x: 2·2·3·4 = 48 matrix FLOPs (the input needs no gradient)
    assert d["totals"]["backward"]["mm_flops"] == 48
    assert all(c["ok"] for c in d["verify"]), d["verify"]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--batch", "99999999999999999999"], "bad batch size"),
        (["--input-shape", "99999999999999999999,784"], "a dimension over"),
        (["--batch", str(2**63 - 1)], "over 2^63 bytes"),  # 2^63-1 · 784 · 4 bytes overflows
    ],
)
def test_sizes_past_what_pytorch_addresses_are_one_line(capsys, args, message):
    """Tester's finding: a 20-digit --batch was an internal error (exit 1) with 2 KB of C++
    stack text."""
    one_error(capsys, "inspect", spec("logreg.py"), *args, message=message)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--seq", "16"], "applies to hf: models only"),
        (["--verify-samples", "5"], "add --verify"),
    ],
)
def test_options_that_would_do_nothing_are_refused(capsys, args, message):
    """Tester's finding: --seq on a model file and --verify-samples without --verify were
    accepted and ignored."""
    one_error(capsys, "inspect", spec("logreg.py"), *args, message=message)


_NO_RULE = """
import torch
from torch import nn


@torch.library.custom_op("gftest::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@twice.register_fake
def _(x):
    return torch.empty_like(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return twice(self.fc(x))


def example_inputs():
    return (torch.randn(2, 4),)
"""


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", "{m}"],
        ["export", "{m}", "--out", "onnx"],
        ["render", "{m}", "-o", "g.svg"],
    ],
)
def test_every_command_warns_of_an_op_without_rules(work, capsys, argv):
    """Tester's finding: export (and bench, render) wrote or timed a backward cut at an op
    without rules and said nothing; inspect warned. The warning names the op; export, whose
    backward.onnx would hold zero gradients, refuses in one line naming it."""
    path = work / "models/norule.py"
    path.write_text(_NO_RULE)
    rc, _, err = cli(capsys, *[a.format(m=path) for a in argv])
    said = "no derivative rule" if argv[0] == "export" else "no cost/jvp rule"
    assert any("gftest.twice" in line and said in line for line in err), err
    assert rc == (2 if argv[0] == "export" else 0)


def test_first_line_and_exception_chain():
    """The one-line error helpers every message goes through: the first line (with the next
    one where the first only introduces it, for HuggingFace's validation errors), and the
    cause/context chain, walked once even when it loops."""
    from graphflop.frontend.errors import exception_chain, find_cause, first_line

    e = ValueError("bad config:\n\n  hidden_size must be even\nmore")
    assert first_line(e) == "bad config:"
    assert first_line(e, continued=True) == "bad config: hidden_size must be even"
    assert first_line(RuntimeError("")) == "RuntimeError"
    inner, outer = KeyError("k"), RuntimeError("x")
    outer.__cause__ = inner
    inner.__context__ = outer  # a loop
    assert exception_chain(outer) == [outer, inner]
    assert find_cause(outer, KeyError) is inner
    assert find_cause(outer, (TypeError, KeyError)) is inner
    assert find_cause(outer, TypeError) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize(
    "runtime,message",
    [
        ("graph_torch", "PyTorch has no CUDA device here"),  # named ONNX Runtime's provider
        ("torch", "PyTorch has no CUDA device here"),
        ("onnxruntime", "ONNX Runtime's CUDA execution provider does not work here"),
    ],
)
def test_bench_on_cuda_without_cuda_names_what_is_missing(work, capsys, runtime, message):
    """Tester's finding: bench --device cuda on a machine without CUDA must say which runtime
    lacks it and suggest --device cpu, in one line."""
    line = one_error(
        capsys,
        "bench",
        spec("logreg.py"),
        "--device",
        "cuda",
        "--runtime",
        runtime,
        message=message,
    )
    assert "use --device cpu" in line


def test_arg_given_twice_is_refused_and_true_false_are_booleans(work, capsys):
    """Tester's findings: a repeated --arg silently kept the last value, and
    use_associative_scan=false was refused as a string ('expected bool')."""
    from graphflop.cli.common import parse_ctor_kwargs

    one_error(
        capsys,
        "inspect",
        spec("mlp.py"),
        "--arg",
        "hidden=8",
        "--arg",
        "hidden=16",
        message="--arg hidden is given twice",
    )
    got = parse_ctor_kwargs(["a=false", "b=TRUE", "c=False", "d=(3, 4)", "e=relu", "f= true"])
    assert got == {"a": False, "b": True, "c": False, "d": (3, 4), "e": "relu", "f": True}


def test_option_value_starting_with_a_dash_gets_a_hint(work, capsys):
    rc, _, err = cli(capsys, "inspect", spec("mlp.py"), "--input-shape", "-1,784")
    assert rc == 2 and len(err) == 1, err  # argparse's 'graphflop inspect: error: ...'
    assert "is written --input-shape=VALUE" in err[0]
    line = one_error(capsys, "inspect", spec("mlp.py"), "--input-shape=-1,784", message="")
    assert "every dimension must be a positive integer" in line


@pytest.mark.parametrize(
    "argv,message",
    [
        (["inspect", "--no-jvp", "--tangents", "inputs"], "--tangents sets the JVP"),
        (["inspect", "--no-jvp", "--directions", "4"], "--directions sets the JVP"),
        (["inspect", "--no-jvp", "--direction", "rademacher"], "--direction sets the JVP"),
        (["inspect", "--memory-model", "graph", "--keep-grads"], "--keep-grads is a what-if"),
        (["inspect", "--memory-model", "compiled", "--keep-grads"], "--keep-grads is a what-if"),
        (["inspect", "--by", "op", "--depth", "1"], "--depth shapes the per-layer table"),
        (["inspect", "--by", "op", "--max-layers", "2"], "--max-layers shapes"),
        (["train", "--method", "backprop", "--directions", "4"], "--directions sets forward-"),
        (["train", "--method", "backprop", "--orthogonal"], "--orthogonal sets forward-"),
        (["train", "--method", "torch", "--distribution", "rademacher"], "--distribution sets"),
    ],
)
def test_options_the_run_would_ignore_are_refused(work, capsys, monkeypatch, argv, message):
    """Tester's findings: each of these ran, ignoring the option (train's
    summary.json then said directions: null)."""
    _no_work(monkeypatch)
    one_error(capsys, argv[0], spec("mlp.py"), *argv[1:], message=message)


def test_warnings_follow_a_command_that_ran_not_an_internal_error(capsys):
    """Status 1 is both a failed --verify check (the command ran: its warnings are shown) and
    an internal error (one line only)."""
    import argparse
    import warnings

    from graphflop.cli.common import run_command

    def failed_check(args, err):
        warnings.warn("noted", UserWarning, stacklevel=1)
        return 1

    def bug(args, err):
        warnings.warn("noted", UserWarning, stacklevel=1)
        raise RuntimeError("boom")

    assert run_command(failed_check, argparse.Namespace()) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("warning: UserWarning: noted ("), err
    assert run_command(bug, argparse.Namespace()) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("graphflop: internal error: RuntimeError: boom")


# --- a tester's findings ---------------------------------------------------------

ASIN = """
import torch
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)
    def forward(self, x):
        return torch.asin(torch.tanh(self.fc(x)))
def example_inputs(): return (torch.randn(4, 16),)
"""


@pytest.mark.slow  # about 10 s; run in CI with -m slow
def test_export_refuses_gradients_an_op_without_rules_would_cut(tmp_path, capsys, monkeypatch):
    """``torch.asin`` has no derivative rule (``logcumsumexp``, then ``atan2`` were the
    example until they got one): the backward stops at it, so backward.onnx's gradients of
    ``fc`` would be zeros. export wrote them with status 0; it now refuses, writing nothing,
    unless --allow-incomplete, which lists the op in manifest.json."""
    model = tmp_path / "asin.py"
    model.write_text(ASIN)
    monkeypatch.chdir(tmp_path)
    one_error(capsys, "export", model, "--out", "onnx", message="stop at aten.asin")
    assert not (tmp_path / "onnx").exists()
    rc, out, err = cli(capsys, "export", model, "--out", "onnx", "--allow-incomplete")
    assert rc == 0, err
    manifest = json.loads((tmp_path / "onnx" / "manifest.json").read_text())
    [cut] = manifest["incomplete"]
    assert cut["op"] == "aten.asin.default" and "jvp" in cut["missing"]
    assert any("asin" in line for line in err)  # the warning still shows


NO_JVP_FUNCTION = """
import torch
from torch import nn
class Sq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x
    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
    def forward(self, x):
        return Sq.apply(self.fc(x))
def example_inputs(): return (torch.randn(2, 4),)
"""


def test_export_names_a_function_without_jvp_as_cutting_the_jvp_only(tmp_path, capsys, monkeypatch):
    """A tester's finding: a custom Function with a backward and no jvp was said to cut "the
    backward and JVP graphs" with a hint to find a rule file; its own backward is the
    transpose, so only the JVP (and the forward-gradient step) stop there."""
    model = tmp_path / "nojvp.py"
    model.write_text(NO_JVP_FUNCTION)
    monkeypatch.chdir(tmp_path)
    line = one_error(
        capsys,
        "export",
        model,
        "--out",
        "onnx",
        message="the JVP graph stops at autograd.Function Sq (custom autograd.Function Sq "
        "without a jvp staticmethod)",
    )
    assert "(the backward is complete)" in line and line.endswith("or give Sq a jvp")
    assert not (tmp_path / "onnx").exists()


# --- the adversarial pass's findings: outputs, inputs and options ------------------------------


def _device_clone(tmp_path, name: str, minor: int) -> str:
    """A path to write for the memory device ``/dev/<name>`` (major 1, ``minor``) that no test
    can harm: as root (who could replace ``/dev/<name>`` itself) a new node for the same device
    in ``tmp_path``; otherwise the device itself, whose folder the user cannot write."""
    if os.geteuid() != 0:
        if not os.path.exists(f"/dev/{name}"):
            pytest.skip(f"no /dev/{name}")
        return f"/dev/{name}"
    path = tmp_path / name
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, minor))
        os.close(os.open(path, os.O_WRONLY))  # a nodev mount refuses to open it
    except OSError as e:
        pytest.skip(f"cannot make a device node in {tmp_path}: {e}")
    return str(path)


def _is_char_device(path) -> bool:
    return stat.S_ISCHR(os.stat(path).st_mode)


def test_an_output_that_is_a_full_device_is_an_error_and_stays_a_device(work, capsys, tmp_path):
    """``--json /dev/full`` exited 0 and left a regular file where the device was (a temporary
    file renamed over it): a device is written into, so its ENOSPC is the error, exit 2; the
    other outputs of the command are not left behind."""
    full = _device_clone(tmp_path, "full", 7)
    one_error(
        capsys,
        "inspect",
        spec("logreg.py"),
        "--no-jvp",
        "--csv",
        "ok.csv",
        "--json",
        full,
        message="No space left on device",
    )
    assert _is_char_device(full)
    nothing_left(work / "out")


def test_an_output_that_is_a_null_device_or_a_fifo_is_written_into(work, capsys, tmp_path):
    """``/dev/null`` works (and stays a device, as root too); a FIFO gets the JSON, read by
    another thread, and stays a FIFO; one device may take several outputs."""
    import threading

    null = _device_clone(tmp_path, "null", 3)
    argv = ["inspect", spec("logreg.py"), "--no-jvp"]
    rc, _, err = cli(capsys, *argv, "--json", null, "--csv", null)
    assert rc == 0, err
    assert _is_char_device(null)
    fifo = work / "out/fifo"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    rc, _, err = cli(capsys, *argv, "--json", fifo)
    reader.join(timeout=60)
    assert rc == 0, err
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    # LogReg at batch 64: Linear(784 → 10), 2·64·784·10 = 1,003,520 mm FLOPs
    assert json.loads(got[0])["totals"]["forward"]["mm_flops"] == 2 * 64 * 784 * 10
    assert sorted(p.name for p in (work / "out").iterdir()) == ["fifo"]


@pytest.mark.parametrize(
    "argv,option",
    [
        (["inspect", "{m}", "--json", "{m}"], "--json"),
        (["inspect", "{m}", "--csv", "out/../models/logreg_copy.py"], "--csv"),
        (["sweep", "{m}", "--batches", "1", "--csv", "{m}"], "--csv"),
        (["sweep", "{m}", "--batches", "1", "--json", "{m}"], "--json"),
        (["bench", "{m}", "--runtime", "torch", "--json", "{m}"], "--json"),
    ],
)
def test_an_output_that_is_the_model_file_is_refused(work, capsys, monkeypatch, argv, option):
    """``--json m.py`` replaced the model with its own report."""
    _no_work(monkeypatch)
    model = work / "models/logreg_copy.py"
    model.write_text((work / "models/int.py").read_text())
    before = model.read_text()
    argv = [a.format(m=model) for a in argv]
    argv = [str(work / a) if a.startswith("out/") else a for a in argv]
    line = one_error(capsys, *argv, message=f"{option} ")
    assert "is the file the model" in line and "would replace the model" in line
    assert model.read_text() == before
    nothing_left(work / "out")


def test_model_files_of_a_module_spec_are_found_without_importing(tmp_path, monkeypatch):
    from graphflop.load import model_files

    pkg = tmp_path / "gfpkg_never_imported"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise SystemExit('imported')\n")
    (pkg / "net.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert model_files("gfpkg_never_imported.net:M") == [pkg / "net.py"]
    assert model_files("gfpkg_never_imported:M") == [pkg / "__init__.py"]
    assert model_files("torchvision:resnet18") == []
    (tmp_path / "config.json").write_text("{}")
    assert model_files(f"hf:{tmp_path}") == [tmp_path / "config.json"]


def test_verify_samples_are_bounded(work, capsys, monkeypatch):
    """``--verify-samples 1000000000`` ran until killed: at most 10,000 directions (before any
    work), and at most as many as fit in 2e13 FLOPs (after the analysis, which gives a step's
    cost: 2e13 / 1e10 = 2,000 steps of 10 GFLOPs)."""
    from graphflop.runtime.verify import MAX_VERIFY_FLOPS, forward_gradient_samples

    _no_work(monkeypatch)
    argv = ["inspect", spec("logreg.py"), "--verify", "--json", "x.json"]
    one_error(capsys, *argv, "--verify-samples", "1000000000", message="give 0 (skip the check)")
    nothing_left(work / "out")
    assert MAX_VERIFY_FLOPS == 2e13
    assert forward_gradient_samples(2000, 1e10) == (2000, "")
    with pytest.raises(ValueError, match="give at most 2,000"):
        forward_gradient_samples(2001, 1e10)
    with pytest.raises(ValueError, match="give at most 1 "):
        forward_gradient_samples(16, 1.5e13)


def test_export_refuses_a_folder_holding_other_files(work, capsys, monkeypatch):
    """``export --out DIR`` over a folder with files no export writes would leave them beside
    the new manifest: refused before any work, the folder untouched."""
    _no_work(monkeypatch)
    onnx_dir = work / "out/onnx"
    onnx_dir.mkdir()
    (onnx_dir / "old_model.onnx").write_text("keep")
    (onnx_dir / "forward.onnx").write_text("keep")
    one_error(capsys, "export", spec("logreg.py"), "--out", onnx_dir, message="old_model.onnx")
    assert sorted(p.name for p in onnx_dir.iterdir()) == ["forward.onnx", "old_model.onnx"]
    assert (onnx_dir / "forward.onnx").read_text() == "keep"
    # bench --out DIR exports into DIR/onnx
    bench = ["bench", spec("logreg.py"), "--out", work / "out"]
    one_error(capsys, *bench, message="holds files an export does not write (old_model.onnx)")
    assert sorted(p.name for p in onnx_dir.iterdir()) == ["forward.onnx", "old_model.onnx"]


def test_export_over_an_earlier_export_removes_the_graphs_it_does_not_write(tmp_path):
    """The folder's ONNX files are the new manifest's: an earlier export's backward.onnx is
    removed when the new one writes the forward only."""
    from graphflop.export.onnx import export_all
    from graphflop.frontend.trace import trace

    fwd = trace(torch.nn.Linear(4, 3), (torch.randn(2, 4),), loss="sum")
    for kind in ("backward", "train_step", "forward_gradient_step"):
        (tmp_path / f"{kind}.onnx").write_text("an earlier model's graph")
    manifest = export_all({"forward": fwd}, tmp_path)
    assert list(manifest["graphs"]) == ["forward"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["forward.onnx", "manifest.json"]


def test_an_input_that_is_an_array_is_named(work, capsys):
    """``graphflop.analyze(model, (np_array,))`` ended in "order must be str, not int" (the
    model called NumPy's flatten): the input is named, as a TypeError (the library) or one
    line, exit 2 (a model file's example_inputs)."""
    import numpy as np

    import graphflop
    from graphflop.load import load

    model = load(spec("logreg.py")).model
    x = np.zeros((2, 1, 28, 28), dtype=np.float32)
    with pytest.raises(TypeError, match=r"^input 0 is a numpy.ndarray, not a torch.Tensor"):
        graphflop.analyze(model, (x,))
    with pytest.raises(TypeError, match=r"^keyword input 'x' is a numpy.ndarray"):
        graphflop.analyze(model, {"x": x})
    with pytest.raises(TypeError, match=r"^input 1\[0\] is a numpy.ndarray"):
        graphflop.analyze(model, (torch.zeros(1), [x]))
    path = work / "models/np_input.py"
    path.write_text(
        (work / "models/int.py").read_text().replace("(torch.randn(2, 4),)", "(x,)")
        + "import numpy\nx = numpy.zeros((2, 4), dtype=numpy.float32)\n"
    )
    one_error(capsys, "inspect", path, message="input 0 is a numpy.ndarray, not a torch.Tensor")


def test_a_wrongly_typed_arg_is_named(work, capsys):
    """``--arg in_features=abc`` said ``empty(): argument 'size' ...``, naming no argument."""
    line = one_error(capsys, "inspect", spec("logreg.py"), "--arg", "in_features=abc")
    assert "--arg in_features='abc' is a str, but in_features takes an int (default 784)" in line
    line = one_error(capsys, "inspect", spec("logreg.py"), "--arg", "num_classes=2.5")
    assert "--arg num_classes=2.5 is a float, but num_classes takes an int" in line
    # no annotation or default to tell the type: the arguments given are named
    line = one_error(capsys, "inspect", spec("logreg.py"), "--arg", "bogus=1")
    assert "with --arg bogus=1: " in line


@pytest.mark.parametrize(
    "runtime,option", [("torch", "--profile"), ("graph_torch", "--profile"), ("torch", "--out")]
)
def test_bench_refuses_onnxruntime_options_without_onnxruntime(
    work, capsys, monkeypatch, runtime, option
):
    """``bench --runtime torch --profile`` ran and ignored --profile (it profiles ONNX
    Runtime's nodes)."""
    _no_work(monkeypatch)
    extra = [option] if option == "--profile" else [option, "run"]
    argv = ["bench", spec("logreg.py"), "--runtime", runtime, *extra]
    one_error(capsys, *argv, message=f"{option} ")
    nothing_left(work / "out")


def test_a_forward_that_fails_is_one_line_with_verify(work):
    """``--verify`` first runs the model to see its output; on fake tensors a failing kernel
    made FakeTensorMode log its traceback (a dozen lines, through the logging PyTorch sets up
    in a process of its own: hence a subprocess) above graphflop's one-line error."""
    import subprocess
    import sys

    path = work / "models/bad_conj.py"
    path.write_text(
        (work / "models/int.py")
        .read_text()
        .replace(
            "return self.fc(x).argmax(-1)",
            "return torch.view_as_real(torch.fft.fft(self.fc(x)).conj())",
        )
    )
    run = subprocess.run(
        [sys.executable, "-m", "graphflop", "inspect", str(path), "--verify"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    err = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 2, run.stderr
    assert len(err) == 1 and "view_as_real doesn't work" in err[0], err


def test_render_empty_module_path_is_refused(capsys, tmp_path):
    """``--module ""`` used to draw the whole model, as if the option were left out."""
    out = tmp_path / "m.svg"
    rc, _, err = cli(capsys, "render", spec("mlp.py"), "--module", " ", "-o", out)
    assert rc == 2 and len(err) == 1 and not out.exists()
    assert "an empty module path: give a module such as h.0" in err[0]


def test_negative_count_in_an_hf_configuration_is_refused(capsys, tmp_path, monkeypatch):
    """A tester's finding: hf:gpt2 --arg n_layer=-1 analysed a model of no blocks (range(-1)
    is empty). A field whose default is a positive integer takes no negative value."""
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    line = one_error(
        capsys,
        "inspect",
        "hf:gpt2",
        "--arg",
        "n_layer=-1",
        "--json",
        "o.json",
        message="hf:gpt2: n_layer=-1 is negative",
    )
    assert "(default 12): give a positive value" in line
    nothing_left(tmp_path)


@pytest.mark.parametrize(
    "arg,message",
    [
        ("num_hidden_layers=abc", "refuses num_hidden_layers='abc'"),
        ("num_hidden_layers=2.5", "refuses num_hidden_layers=2.5"),
        ("tie_word_embeddings=maybe", "refuses tie_word_embeddings='maybe'"),
    ],
)
def test_wrong_type_in_an_hf_preset_configuration_is_refused(
    capsys, tmp_path, monkeypatch, arg, message
):
    """A tester's finding: a value of the wrong type for a preset's (or a folder's, or a Hub
    configuration's) field was an internal error: transformers checks the type as the field
    is set. One line naming the field and its default's type, exit 2, nothing written."""
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    argv = ["inspect", "hf:llama-3.1-8b", "--arg", arg, "--seq", "8", "--json", "o.json"]
    line = one_error(capsys, *argv, message=message)
    assert "hf:llama-3.1-8b: LlamaConfig" in line and "give a value of the type" in line
    nothing_left(tmp_path)


_BOOL_ARG_MODEL = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, ckpt=False, width: int = 4):
        super().__init__()
        self.ckpt = ckpt
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return self.fc(x)


def example_inputs():
    return torch.randn(2, 4)
"""


@pytest.mark.parametrize("value", ["maybe", "2", "0.5"])
def test_bool_constructor_argument_takes_only_a_bool(capsys, tmp_path, monkeypatch, value):
    """A tester's finding: ``--arg ckpt=maybe`` for ``ckpt=False`` built the model with
    checkpointing on (a non-empty str is true) and exit 0. Anything but true/false (or 0/1) for
    a bool argument is refused before building; true, false, 0 and 1 are taken."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "net.py").write_text(_BOOL_ARG_MODEL)
    line = one_error(
        capsys,
        "inspect",
        "net.py",
        "--arg",
        f"ckpt={value}",
        "--json",
        "o.json",
        message="but ckpt takes a bool (default False): give true or false",
    )
    assert line.startswith("graphflop: error: net.py:Net: --arg ckpt=")
    assert [p.name for p in tmp_path.iterdir()] == ["net.py"]
    for ok in ("true", "False", "0", "1"):
        rc, _, err = cli(capsys, "inspect", "net.py", "--arg", f"ckpt={ok}", "--json", "o.json")
        assert rc == 0, (ok, err)


def test_batch_norm_over_one_example_says_what_to_do():
    """A tester's finding: torchvision's inception_v3 at its default batch of 1 in training
    mode stopped at batch norm's own error, which names no way out; the message now does."""
    from graphflop.frontend.trace import TraceError, trace

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).train()
    with pytest.raises(TraceError, match=r"per channel.*--batch 2.*--eval"):
        trace(model, (torch.randn(1, 4),))


def test_a_folder_made_for_an_output_is_said(work, capsys):
    """A tester's finding: --csv into a folder that does not exist made it silently (a
    mistyped folder name builds a new tree). It is still made, and a note says so."""
    target = work / "out" / "new" / "sub" / "layers.csv"
    rc, out, err = cli(
        capsys, "inspect", work / "models/noparam.py", "--input-shape", "2,4", "--csv", target
    )
    assert rc == 0, err
    assert f"note: --csv {target}: creating the folder {target.parent}" in err
    assert target.is_file()


def test_a_refused_command_says_no_folder_note_and_leaves_none_to_the_next(work, capsys):
    """The --csv check notes the folder it would make, then --plot-memory's suffix is refused:
    the error is the only line and no folder is made; the next command in this process (no
    folder to make) prints no note either."""
    model = work / "models/noparam.py"
    target = work / "out" / "new" / "layers.csv"
    argv = ["inspect", model, "--input-shape", "2,4", "--csv", target]
    one_error(capsys, *argv, "--plot-memory", "m.xyz", message="unsupported suffix")
    assert not target.parent.exists()
    rc, _, err = cli(capsys, "inspect", model, "--input-shape", "2,4", "--csv", "layers.csv")
    assert rc == 0, err
    assert not [line for line in err if line.startswith("note:")], err


def test_two_commands_at_once_keep_their_own_folder_notes(tmp_path, capsys):
    """Command A notes the folder its output will make and is still running when command B
    (another thread, no folder to make) finishes: B prints no note; A prints its own once it
    has run. One list of notes for the process handed A's note to B."""
    import argparse
    import threading

    from graphflop.cli.common import check_output_file, run_command

    target = tmp_path / "new" / "layers.csv"
    noted, b_ran = threading.Event(), threading.Event()
    status: list[int] = []

    def a(args, err):
        check_output_file(str(target), "--csv")
        noted.set()
        return 0 if b_ran.wait(60) else 3

    def b(args, err):
        return 0 if noted.wait(60) else 3

    thread = threading.Thread(target=lambda: status.append(run_command(a, argparse.Namespace())))
    thread.start()
    assert run_command(b, argparse.Namespace()) == 0
    b_err = capsys.readouterr().err
    b_ran.set()
    thread.join(60)
    assert status == [0]
    assert b_err == ""
    assert capsys.readouterr().err == f"note: --csv {target}: creating the folder {target.parent}\n"


# --- the model's in-place write over a saved value (eager autograd refuses it) -------------

OUT_OF_PLACE = (
    "use an out-of-place op there (h = h + 1 for h.add_(1) or h += 1, h = torch.relu(h) for "
    "h.relu_())"
)


def test_train_torch_refuses_a_saved_value_written_in_place_backprop_trains_it(work, capsys):
    # digits: batch 64, Linear(64 → 10): ReLU's output is [64, 10]
    argv = ["train", work / "models/inplace.py", "--steps", "1", "--quiet", "--out", "run"]
    line = one_error(capsys, *argv, "--method", "torch")
    assert line == (
        "graphflop: error: --method torch: eager PyTorch's backward refuses the model: the "
        "model writes in place over output 0 of Relu (shape [64, 10]), a value autograd saved "
        f"for the backward; {OUT_OF_PLACE}, or train with --method backprop (graphflop's "
        "functional train-step graph differentiates it)"
    )
    nothing_left(work / "out")
    rc, out, err = cli(capsys, *argv, "--method", "backprop")
    assert rc == 0, err


def test_train_error_in_the_first_step_is_the_only_stderr_line(work, capsys):
    """The progress bar, started by the validation before the first step, was left above the
    error of a model whose first backward fails (the tests' cli() drops empty lines only)."""
    argv = ["train", str(work / "models/inplace.py"), "--method", "torch", "--steps", "2"]
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("graphflop: error: --method torch: eager") and err.count("\n") == 1, repr(
        err
    )


def test_bench_torch_refuses_a_saved_value_written_in_place(work, capsys):
    line = one_error(
        capsys,
        *("bench", work / "models/inplace.py", "--runtime", "torch", "--json", "b.json"),
        *("--warmup", "0", "--repeat", "1", "--rotate", "1"),
    )
    assert line == (
        "graphflop: error: the torch runtime's train step (eager PyTorch's backward) refuses "
        "the model: the model writes in place over output 0 of Relu (shape [2, 10]), a value "
        f"autograd saved for the backward; {OUT_OF_PLACE}, or time graphflop's functional "
        "graphs alone with --runtime graph_torch or onnxruntime"
    )
    nothing_left(work / "out")


def test_verify_says_why_the_eager_gradient_reference_cannot_run(work, capsys):
    rc, out, err = cli(capsys, "inspect", work / "models/inplace.py", "--verify")
    lines = [ln for ln in [*out.splitlines(), *err] if "verify: gradients" in ln]
    assert lines == [
        "verify: gradients vs torch.func.grad: NOT RUN (eager autograd, the reference, refuses "
        "the model: the model writes in place over output 0 of Relu (shape [2, 10]), a value "
        "autograd saved for the backward; graphflop's functional graphs differentiate it, and "
        "an out-of-place op there lets the check run)"
    ], (out, err)


# --- export in a dtype ONNX Runtime's CPU provider has no kernels for -----------------------


def _ort_runs(path) -> bool:
    """Whether ONNX Runtime's CPU provider runs the ONNX file on ones (indices 1 are valid)."""
    import numpy as np
    import onnxruntime as ort
    from onnx import helper, load

    opts = ort.SessionOptions()
    opts.log_severity_level = 4
    graph = load(str(path)).graph
    feeds = {
        i.name: np.ones(
            [d.dim_value for d in i.type.tensor_type.shape.dim],
            helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type),
        )
        for i in graph.input
    }
    try:
        sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        sess.run(None, feeds)
    except Exception:  # noqa: BLE001 - any refusal of ONNX Runtime's counts
        return False
    return True


@pytest.mark.slow  # (the default suite's 5 minutes: run in CI's slow pass)
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_export_notes_graphs_the_ort_cpu_provider_cannot_run(work, capsys, dtype):
    pytest.importorskip("onnxruntime")
    argv = ["export", work / "models/embedding.py", "--out", "onnx", "--dtype", dtype]
    rc, out, err = cli(capsys, *argv)
    assert rc == 0, err
    folder = work / "out/onnx"
    refused = sorted(p.name for p in folder.glob("*.onnx") if not _ort_runs(p))
    assert refused == (["backward.onnx", "train_step.onnx"] if dtype == "float16" else [])
    assert err == [
        f"note: ONNX Runtime's CPU provider cannot run onnx/{name}: it has no float16 kernel "
        "for ScatterElements with reduction 'add' (node node_scatter_add); run it on another "
        "provider (CUDA), or export with --dtype float32"
        for name in refused
    ]


# --- smaller option checks ------------------------------------------------------------------


@pytest.mark.parametrize("option", ["--lr", "--lr-decay"])
def test_train_names_the_learning_rate_option_out_of_range(work, capsys, monkeypatch, option):
    _no_work(monkeypatch)
    line = one_error(capsys, "train", spec("logreg.py"), "--out", "run", option, "0")
    assert line == f"graphflop: error: bad {option} 0: must be positive and finite"
    nothing_left(work / "out")


def test_train_out_naming_a_file_says_it_once(work, capsys, monkeypatch):
    _no_work(monkeypatch)
    (work / "out/afile.txt").write_text("keep")
    line = one_error(capsys, "train", spec("logreg.py"), "--out", "afile.txt", "--steps", "1")
    assert (
        line
        == "graphflop: error: cannot write --out afile.txt: it is an existing file: give a folder name"
    )


def test_train_refuses_a_folder_of_other_files_as_export_does(work, capsys, monkeypatch):
    _no_work(monkeypatch)
    (work / "out/models").mkdir()
    (work / "out/models/net.py").write_text("keep")
    line = one_error(capsys, "train", spec("logreg.py"), "--out", "models", "--steps", "1")
    assert line == (
        "graphflop: error: --out models holds files a run does not write (net.py): they would "
        "sit beside the new train.csv, train.png and summary.json; give an empty or new folder"
    )
    assert [p.name for p in (work / "out/models").iterdir()] == ["net.py"]


def test_train_reuses_its_own_folder(work, capsys):
    (work / "out/run").mkdir()
    for name in ("train.csv", "train.png", "summary.json"):
        (work / "out/run" / name).write_text("old")
    rc, out, err = cli(
        capsys, "train", spec("logreg.py"), "--out", "run", "--steps", "1", "--quiet"
    )
    assert rc == 0, err
    assert (work / "out/run/summary.json").read_text() != "old"


@pytest.mark.parametrize("zero", ["1", "3"])
def test_plan_zero_without_data_parallelism_is_refused(work, capsys, zero):
    shards = {"1": "the optimizer state", "3": "the optimizer state, gradients and parameters"}
    line = one_error(capsys, "plan", spec("logreg.py"), "--zero", zero)
    assert line == (
        f"graphflop: error: --zero {zero} shards {shards[zero]} over the data-parallel group, "
        "and --dp 1 is one rank: nothing would be sharded; give --dp 2 or more, or drop --zero"
    )


@pytest.mark.parametrize(
    "doc,why",
    [
        (
            {"model": "m", "layers": [{"name": "linear", "params": 15, "fwd_flops": 48}]},
            "it holds no measured seconds per module (an inspect or sweep JSON has none): give "
            "the JSON that graphflop bench --profile --json writes",
        ),
        (
            {"model": "m", "runtimes": {"torch": {"phases": {}}}},
            "it is graphflop bench's JSON without a profile: rerun bench with --profile (ONNX "
            "Runtime's per-node times)",
        ),
    ],
)
def test_render_refuses_a_profile_json_without_times(work, capsys, monkeypatch, doc, why):
    _no_work(monkeypatch)
    (work / "t.json").write_text(json.dumps(doc))
    line = one_error(
        capsys, "render", spec("logreg.py"), "-o", "g.svg", "--profile-json", work / "t.json"
    )
    assert line == f"graphflop: error: --profile-json {work / 't.json'}: {why}"
    nothing_left(work / "out")


def test_transformers_logs_leave_an_error_one_line(capsys):
    """A tester's finding: transformers logged four ``[transformers] Model config: …`` lines
    (token ids outside a 100-token vocabulary) before graphflop's one-line error. Its logger is
    at ERROR while graphflop builds and traces the model, and at its level again afterwards."""
    import logging

    pytest.importorskip("transformers")
    level = logging.getLogger("transformers").level
    rc, out, err = cli(
        capsys,
        *("inspect", "hf:whisper", "--seq", "8"),
        *("--arg", "encoder_layers=1", "--arg", "decoder_layers=1"),
        *("--arg", "d_model=32", "--arg", "vocab_size=100"),
    )
    assert rc == 2 and out == ""
    assert len(err) == 1 and err[0].startswith("graphflop: error: building hf:whisper failed")
    assert logging.getLogger("transformers").level == level


def test_transformers_logs_are_not_shown_on_success(capsys):
    """CLIP's text model with a 100-token vocabulary: transformers logged two lines (its
    bos/eos token ids are outside the vocabulary); the analysis prints none."""
    pytest.importorskip("transformers")
    rc, out, err = cli(
        capsys,
        *("inspect", "hf:clip_text_model", "--seq", "8", "--format", "json"),
        *("--arg", "vocab_size=100", "--arg", "hidden_size=32", "--arg", "num_hidden_layers=1"),
        *("--arg", "intermediate_size=64", "--arg", "num_attention_heads=2"),
    )
    assert rc == 0, err
    assert json.loads(out)["totals"]["forward"]["flops"] > 0
    assert not [e for e in err if "transformers" in e], err


#: each subcommand with the arguments it requires
EVERY_COMMAND = [
    ["inspect", "m.py"],
    ["export", "m.py", "--out", "o.onnx"],
    ["bench", "m.py"],
    ["render", "m.py", "-o", "o.svg"],
    ["train", "m.py"],
    ["sweep", "m.py"],
    ["models"],
    ["plan", "m.py"],
    ["calibrate", "-o", "o.json"],
    ["devices"],
]


@pytest.mark.parametrize("argv", EVERY_COMMAND)
def test_an_unknown_option_names_the_subcommands_help(capsys, argv):
    """A tester's finding: ``graphflop plan m.py --bogus`` said ``see graphflop --help`` (the
    top-level parser reported the argument no subcommand took); each subcommand's own parser
    reports it now, naming its own help. Every subcommand is listed."""
    from graphflop.cli import COMMANDS

    assert sorted(a[0] for a in EVERY_COMMAND) == sorted(COMMANDS)
    rc, out, err = cli(capsys, *argv, "--bogus")
    assert rc == 2 and out == ""
    assert err == [
        f"graphflop {argv[0]}: error: unrecognized arguments: --bogus; "
        f"see graphflop {argv[0]} --help"
    ]


def test_sweep_without_example_inputs_says_to_add_them(work, capsys):
    """A tester's finding: sweep's error on a file without example_inputs() advised
    --input-shape, which sweep does not take (inspect's advice)."""
    (work / "models/noex.py").write_text(
        "import torch\nfrom torch import nn\n\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.fc = nn.Linear(4, 2)\n\n"
        "    def forward(self, x):\n        return self.fc(x)\n"
    )
    err = one_error(
        capsys, "sweep", work / "models/noex.py", "--batches", "1,2", message="example_inputs()"
    )
    assert "--input-shape" not in err
    nothing_left(work / "out")


def test_sweep_lists_say_which_values_they_take():
    """A depth may be 0 (the model without its repeated part, as the README's sweep runs), a
    batch may not: each refusal says what its list takes."""
    from graphflop.cli.sweep import int_list
    from graphflop.load import SpecError

    assert int_list("0,10,100", "depth") == [0, 10, 100]
    with pytest.raises(SpecError, match="values must be 0 or more"):
        int_list("-1,0", "depth")
    with pytest.raises(SpecError, match="values must be positive"):
        int_list("0,2", "batch")
