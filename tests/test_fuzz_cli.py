"""Fuzzing the command line: argument combinations of every subcommand, valid and
not, run in-process on small models. Whatever the arguments: no traceback, exit status 0, 1 or
2, no "internal error" (a bug), and after a non-zero exit no file left behind.

The examples are derandomised (the same ones every run) and few, so the whole file runs in well
under a minute on 2 cores; ``GRAPHFLOP_FUZZ_EXAMPLES=N`` runs N per subcommand instead, with
fresh random draws.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from conftest import spec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphflop.cli import main

EXAMPLES = int(os.environ.get("GRAPHFLOP_FUZZ_EXAMPLES", "0"))
#: examples per subcommand in the default (CI) run: about 20 s in all on 2 busy cores. In it,
#: export's ONNX conversion (about 2 s a graph; its output is tested in test_onnx.py) is a stub
#: returning a one-node model, so the CLI's checks, folder staging and moves are what run.
DEFAULT_EXAMPLES = {
    "inspect": 8,
    "render": 8,
    "export": 8,
    "bench": 8,
    "sweep": 8,
    "train": 8,
    "plan": 8,
}


def fuzz_settings(command: str) -> settings:
    return settings(
        max_examples=EXAMPLES or DEFAULT_EXAMPLES[command],
        deadline=None,
        derandomize=not EXAMPLES,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


LOGREG, MLP = spec("logreg.py"), spec("mlp.py")


def opt(name: str, *values: str):
    """An optional ``name VALUE`` pair (empty list when not drawn)."""
    return st.one_of(st.just([]), st.sampled_from(values).map(lambda v: [name, v]))


def flag(name: str):
    return st.sampled_from([[], [name]])


def model_args(batch_values=("1", "2", "0", "-3", "x")):
    """A model and the shared model options, each present or not, valid or not."""
    return st.tuples(
        st.sampled_from([[LOGREG], [MLP, "--arg", "hidden=8"], [MLP, "--arg", "hidden"]]),
        opt("--batch", *batch_values),
        opt("--input-shape", "2,1,28,28", "1,x", "0,1,28,28", "2,784"),
        opt("--dtype", "float64", "int64", "float7", "fp16"),
        flag("--eval"),
        opt("--loss", "sum", "mse", "cross_entropy"),
    ).map(lambda parts: [a for p in parts for a in p])


# output paths: {out} is a fresh folder holding an existing folder "adir" and file "afile"
FILE_PATHS = ("{out}/x.json", "{out}/adir", "{out}/afile/x", "{out}/new/x.json")


def combine(*parts):
    return st.tuples(*parts).map(lambda ps: [a for p in ps for a in p])


COMMANDS = {
    "inspect": combine(
        model_args(),
        opt("--json", *FILE_PATHS),
        opt("--csv", "{out}/x.csv", "{out}/adir"),
        opt("--directions", "0", "2"),
        flag("--no-backward"),
        flag("--no-jvp"),
        opt("--max-layers", "-1", "3"),
        opt("--verify-samples", "-1", "0"),
        opt("--format", "json", "table"),
        opt("--optimizer", "adam"),
    ),
    "render": combine(
        model_args(),
        st.sampled_from([["-o", "{out}/g.dot"], ["-o", "{out}/g.xyz"], ["-o", "{out}/adir"]]),
        opt("--graph", "forward", "backward", "jvp", "all"),
        opt("--level", "op", "module"),
        opt("--profile-json", "{out}/afile", "{out}/none.json"),
    ),
    "export": combine(
        model_args(batch_values=("1", "0", "x")),
        st.sampled_from([["--out", "{out}/onnx"], ["--out", "{out}/afile"]]),
        opt("--optimizer", "adam"),
    ),
    "bench": combine(
        model_args(batch_values=("1", "1000000000", "0")),
        st.sampled_from([["--runtime", "torch"], ["--runtime", "torch", "--device", "cpu"]]),
        opt("--repeat", "0", "1"),
        st.sampled_from([["--warmup", "0", "--repeat", "1"], ["--warmup", "-1"]]),
        opt("--rotate", "0", "1"),
        opt("--json", *FILE_PATHS),
    ),
    "plan": combine(
        model_args(batch_values=("2", "0")),
        opt("--dp", "2", "0", "x"),
        opt("--tp", "2", "3"),
        opt("--pp", "2", "9"),
        opt("--zero", "1", "3", "4"),
        opt("--schedule", "gpipe", "zigzag"),
        opt("--micro-batches", "1", "4"),
        opt("--world", "4"),
        opt("--memory-gib", "0", "1"),
        opt("--json", *FILE_PATHS),
    ),
    "sweep": combine(
        model_args(batch_values=("2", "0")),
        st.sampled_from([["--batches", "1,2"], ["--batches", "x"], ["--depth", "1"], []]),
        opt("--csv", "{out}/s.csv", "{out}/adir"),
        opt("--json", "{out}/s.json", "{out}/afile/s.json"),
        opt("--plot", "{out}/s.png", "{out}/s.xyz"),
    ),
    "train": combine(
        st.sampled_from([[LOGREG], [MLP, "--arg", "hidden=8"], [MLP, "--arg", "nope=1"]]),
        st.sampled_from(
            [["--steps", "2"], ["--steps", "0"], ["--epochs", "nan"], ["--epochs", "inf"]]
        ),
        opt("--batch", "16", "0", "100000"),
        opt("--method", "torch", "fgd", "backprop"),
        opt("--optimizer", "adam", "sgd"),
        opt("--lr", "nan", "-1", "0.01"),
        opt("--eval-every", "0", "1", "-1"),
        opt("--directions", "0", "2"),
        opt("--threads", "0", "1"),
        opt("--out", "{out}/run", "{out}/afile", "{out}/afile/run"),
        st.just(["--quiet"]),
    ),
}


def check(command: str, argv: list[str], capsys) -> None:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d)
        (out / "adir").mkdir()
        (out / "afile").write_text("keep")
        args = [command, *(a.format(out=out) for a in argv)]
        try:
            rc = main(args)
        except SystemExit as e:  # argparse: usage line + error line, status 2
            rc = e.code
        cap = capsys.readouterr()
        text = cap.out + cap.err
        assert "Traceback" not in text, (args, text[-2000:])
        assert "internal error" not in cap.err, (args, cap.err)
        assert rc in (0, 1, 2), (args, rc, cap.err)
        if rc != 0:
            left = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
            assert left == ["adir", "afile"], (args, left, cap.err)
            assert (out / "afile").read_text() == "keep"


@pytest.fixture(autouse=True)
def _quiet_threads():
    import torch

    old = torch.get_num_threads()
    yield
    torch.set_num_threads(old)


def _stub_export_graph(gm, kind, inputs, outputs, constants=None):
    from onnx import TensorProto, helper

    from graphflop.export.onnx import ExportedGraph

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], kind, [x], [y])
    return ExportedGraph(kind, helper.make_model(g), list(inputs), list(outputs), [])


# export analyses every example in full (about 35 s of the default suite's 5 minutes): slow
@pytest.mark.parametrize(
    "command",
    [pytest.param(c, marks=pytest.mark.slow) if c == "export" else c for c in COMMANDS],
)
def test_fuzz_subcommand(command, capsys, monkeypatch):
    if command == "export" and not EXAMPLES:
        import graphflop.export.onnx

        monkeypatch.setattr(graphflop.export.onnx, "export_graph", _stub_export_graph)

    @fuzz_settings(command)
    @given(argv=COMMANDS[command])
    def run(argv):
        check(command, argv, capsys)

    run()
