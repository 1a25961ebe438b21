"""Testers' findings on the CLI's messages and on integer inputs: integer ``--dtype`` for models
that take token ids, a hint on a wrong input shape, advice on reading a tensor's value, and the
factory functions a file offers. Every error is one stderr line, exit 2, no traceback, and no
output file."""

from __future__ import annotations

import json

import pytest
from conftest import cli

TOKENS = """
import torch
from torch import nn
import torch.nn.functional as F

class E(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 16)
        self.fc = nn.Linear(16, 4)
    def forward(self, x):
        return self.fc(self.emb(x).mean(1))

class Bag(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(100, 16)
        self.fc = nn.Linear(16, 4)
    def forward(self, x):
        return self.fc(self.emb(x))

class Table(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(100, 16))
        self.fc = nn.Linear(16, 4)
    def forward(self, x):
        return self.fc(F.embedding(x, self.table).mean(1))

class Lin(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 4)
    def forward(self, x):
        return self.fc(x)

class Conv(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3)
    def forward(self, x):
        return self.c(x).flatten(1)
"""

#: the same models, with token ids given by example_inputs(): the reference figures
EXAMPLE = "\ndef example_inputs():\n    return (torch.randint(0, 100, (4, 5)),)\n"


@pytest.fixture
def work(tmp_path, monkeypatch):
    (tmp_path / "tokens.py").write_text(TOKENS)
    (tmp_path / "example.py").write_text(TOKENS + EXAMPLE)
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.chdir(out)
    return tmp_path


def one_error(capsys, *argv, message=""):
    rc, out, err = cli(capsys, *argv)
    assert rc == 2, (rc, out, err)
    assert out == "", out
    assert len(err) == 1, err
    assert err[0].startswith("graphflop: error: ") and "Traceback" not in err[0], err
    assert message in err[0], err[0]
    return err[0]


def nothing_left(path):
    assert list(path.rglob("*")) == []


@pytest.mark.parametrize("name", ["E", "Bag", "Table"])
@pytest.mark.parametrize("dtype", ["int64", "int32"])
def test_integer_dtype_with_input_shape_takes_token_ids(work, capsys, name, dtype):
    """A tester's finding: --input-shape 4,5 --dtype int64 on a model that looks its input up in
    an nn.Embedding (nn.EmbeddingBag, F.embedding on a parameter) was refused as 'the model
    takes floating-point inputs', judged from default float32 inputs. It is analysed, with the
    figures of the same model given int64 ids by example_inputs()."""
    argv = ["inspect", f"{work / 'tokens.py'}:{name}", "--input-shape", "4,5", "--dtype", dtype]
    rc, _, err = cli(capsys, *argv, "--json", "given.json")
    assert rc == 0, err
    rc, _, err = cli(capsys, "inspect", f"{work / 'example.py'}:{name}", "--json", "ref.json")
    assert rc == 0, err
    given = json.loads((work / "out/given.json").read_text())
    ref = json.loads((work / "out/ref.json").read_text())
    assert given["inputs"] == [{"name": "args_0", "shape": [4, 5], "dtype": dtype}]
    if dtype == "int64":
        assert given["totals"] == ref["totals"]
        assert given["memory"] == ref["memory"]
    assert given["totals"]["forward"]["mm_flops"] == 2 * 4 * 16 * 4  # the Linear's product


@pytest.mark.parametrize(
    "name,shape", [("Lin", "4,5"), ("Conv", "1,3,8,8")], ids=["linear", "conv"]
)
def test_integer_dtype_refused_for_a_model_taking_floats(work, capsys, name, shape):
    """An integer dtype for a model whose first op is a Linear or a convolution on its input is
    still refused before any work, saying why and what to give."""
    line = one_error(
        capsys,
        "inspect",
        f"{work / 'tokens.py'}:{name}",
        "--input-shape",
        shape,
        "--dtype",
        "int64",
        "--json",
        "x.json",
        message="--dtype int64 is not a floating-point dtype, and the model takes "
        "floating-point inputs",
    )
    assert "use float32, float64, float16 or bfloat16" in line
    assert "on int64 inputs its forward fails: RuntimeError: " in line
    nothing_left(work / "out")


def test_integer_dtype_refused_for_float_example_inputs(work, capsys):
    """Without --input-shape, the file's floating-point example_inputs() tell."""
    (work / "lin.py").write_text(
        TOKENS + "\ndef example_inputs():\n    return (torch.randn(4, 5),)\n"
    )
    line = one_error(
        capsys,
        "inspect",
        f"{work / 'lin.py'}:Lin",
        "--dtype",
        "int64",
        message="example_inputs() gives floating-point inputs",
    )
    assert "use float32" in line and "--input-shape" in line


VALUES = """
import torch
from torch import nn

class Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)

class Item(Base):
    def forward(self, x):
        s = x.sum().item()
        return self.fc(x) * s

class Float(Base):
    def forward(self, x):
        return self.fc(x) * float(x.max())

class Int(Base):
    def forward(self, x):
        n = int(x.sum())
        return self.fc(x)[:, :n]

class ToList(Base):
    def forward(self, x):
        return self.fc(x) * x.sum(1).tolist()[0]

class Branch(Base):
    def forward(self, x):
        if x.sum().item() > 0:
            return self.fc(x)
        return self.fc(-x)

def model():
    return Item()

def build(width=3):
    return Item()

def example_inputs():
    return (torch.randn(4, 16),)
"""


@pytest.mark.parametrize(
    "name,read,line",
    [
        ("Item", ".item()", "s = x.sum().item()"),
        ("Float", "float()", "return self.fc(x) * float(x.max())"),
        ("Int", "int()", "n = int(x.sum())"),
        ("ToList", ".tolist()", "return self.fc(x) * x.sum(1).tolist()[0]"),
    ],
)
def test_value_read_gets_advice_on_values_not_branches(work, capsys, name, read, line):
    """A tester's finding: .item() in forward, with no branch, got the advice 'make the branch
    depend on shapes'. A value read names the call and its line, says that graphflop traces
    with fake tensors (the value is unknown) and what to do; .tolist() got PyTorch's bare
    'unallocated storage' error."""
    (work / "values.py").write_text(VALUES)
    msg = one_error(capsys, "inspect", f"{work / 'values.py'}:{name}", "--json", "x.json")
    assert f"reads a tensor's value with {read} at values.py:" in msg
    assert msg.split(": ", 1)[1].count(line) == 1
    assert "fake tensors" in msg and "value is unknown" in msg
    assert "from shapes" in msg and "Python number" in msg
    assert "branch" not in msg
    nothing_left(work / "out")


def test_branch_on_a_value_keeps_the_branch_advice(work, capsys):
    (work / "values.py").write_text(VALUES)
    msg = one_error(capsys, "inspect", f"{work / 'values.py'}:Branch")
    assert "values.py:30: if x.sum().item() > 0:" in msg
    assert "make the branch depend on shapes" in msg


MASKS = """
class Masked(Base):
    def forward(self, x):
        return self.fc(x) * x[x > 0].sum()

class NonZero(Base):
    def forward(self, x):
        return self.fc(x).sum() + x.nonzero().sum()
"""


@pytest.mark.parametrize(
    "name,line", [("Masked", "x[x > 0].sum()"), ("NonZero", "x.nonzero().sum()")]
)
def test_data_dependent_shape_gets_advice_on_shapes_not_branches(work, capsys, name, line):
    """A tester's finding: boolean-mask indexing (``h[h > 0]``), with no branch, got the
    advice 'make the branch depend on shapes'. A data-dependent shape names its line and
    the static-shape form."""
    (work / "masks.py").write_text(VALUES + MASKS)
    msg = one_error(capsys, "inspect", f"{work / 'masks.py'}:{name}")
    assert "a tensor whose shape depends on a tensor's values at masks.py:" in msg
    assert line in msg and "aten.nonzero" in msg
    assert "torch.where(mask, x, 0)" in msg
    assert "branch" not in msg


def test_unknown_name_lists_factory_functions(work, capsys):
    """A tester's finding: 'm.py:Nope' said '(nn.Module classes there: none)' of a file whose
    factory function the loader would take; every kind a spec can name is listed."""
    (work / "values.py").write_text(VALUES)
    msg = one_error(capsys, "inspect", f"{work / 'values.py'}:Nope")
    assert msg.endswith(
        "values.py has no attribute 'Nope' (nn.Module classes there: Base, Item, Float, Int, "
        "ToList, Branch; factory functions: model(), build())"
    )
    (work / "f.py").write_text(
        "from torch import nn\ndef model():\n    return nn.Linear(4, 4)\nnet = nn.Linear(2, 2)\n"
    )
    msg = one_error(capsys, "inspect", f"{work / 'f.py'}:Nope")
    assert msg.endswith(
        "(nn.Module classes there: none; factory functions: model(); module instances: net)"
    )
    rc, _, err = cli(capsys, "inspect", f"{work / 'f.py'}:model", "--input-shape", "2,4")
    assert rc == 0, err


SHAPES = """
import torch
from torch import nn

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 32)
    def forward(self, x):
        return self.fc(x)

class Raises(M):
    def forward(self, x):
        raise ValueError("the model's own check")

def example_inputs():
    return (torch.randn(8, 17),)
"""

MISMATCH = (
    "tracing the model on the example inputs failed: RuntimeError: a and b must have same "
    "reduction dim, but got [8, 17] X [16, 32]; the inputs' shapes come from "
)


def test_wrong_input_shape_says_where_the_shapes_came_from(work, capsys):
    """A tester's finding: --input-shape 8,17 on a Linear(16, ...) printed PyTorch's bare
    'a and b must have same reduction dim'; the one line now says the shapes came from
    --input-shape (or the file's example_inputs(), with --batch where given) and what to
    check."""
    (work / "shapes.py").write_text(SHAPES)
    model = f"{work / 'shapes.py'}:M"
    msg = one_error(capsys, "inspect", model, "--input-shape", "8,17", "--json", "x.json")
    assert msg.endswith(
        MISMATCH + "--input-shape 8,17: check them against the shapes the model's first "
        "layers take (in_features, channels)"
    )
    msg = one_error(capsys, "inspect", model, "--json", "x.json")
    assert msg.endswith(
        MISMATCH + "the model file's example_inputs(): check them against the "
        "shapes the model's first layers take, or give --input-shape"
    )
    msg = one_error(capsys, "inspect", model, "--batch", "8")
    assert "example_inputs() with --batch 8: check them" in msg
    nothing_left(work / "out")


def test_other_trace_errors_get_no_shape_hint(work, capsys):
    (work / "shapes.py").write_text(SHAPES)
    msg = one_error(capsys, "inspect", f"{work / 'shapes.py'}:Raises", "--input-shape", "8,16")
    assert "the model's own check" in msg and "--input-shape 8,16" not in msg


def test_no_shape_hint_for_inputs_graphflop_makes():
    from argparse import Namespace

    from graphflop.cli.common import _inputs_origin

    for spec in ("torchvision:resnet18", "timm:resnet18", "hf:gpt2"):
        assert _inputs_origin(Namespace(spec=spec, input_shape=None, batch=None)) is None
    given = _inputs_origin(Namespace(spec="hf:gpt2", input_shape=["2,7"], batch=None))
    assert given is not None and "--input-shape 2,7" in given
