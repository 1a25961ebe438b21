"""Partial results (docs/flops_conventions.md): an op without a rule is counted as 0 FLOPs, listed in
``uncounted`` with one warning line, and cuts the JVP/backward at its node; ``--strict`` (and
:func:`graphflop.ops.strict_rules`) restore the one-line error."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import graphflop
from graphflop.cli import main
from graphflop.ops import op_name, strict_rules
from graphflop.ops.registry import guess_family

aten = torch.ops.aten


@torch.library.custom_op("gfpartial::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    """A custom op graphflop has no rule for."""
    return 2 * x


@twice.register_fake
def _(x):
    return torch.empty_like(x)


TWICE = torch.ops.gfpartial.twice.default


class CustomNet(nn.Module):
    """fc1 (8→16), relu, the rule-less op, fc2 (16→4): batch 3, sum loss."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(twice(torch.relu(self.fc1(x))))


def example_inputs():
    return (torch.randn(3, 8),)


# Forward, batch 3, every op but `twice` counted (docs/flops_conventions.md):
#   fc1 addmm: 2·3·8·16 = 768 matrix + 3·16 = 48 bias  -> 816
#   relu: 48
#   twice: 0 (no rule)
#   fc2 addmm: 2·3·16·4 = 384 matrix + 3·4 = 12 bias    -> 396
#   sum loss: 12 (1 per input element)
# total 816 + 48 + 396 + 12 = 1,272; matrix part 768 + 384 = 1,152
FORWARD_FLOPS = 1272
FORWARD_MM = 1152


def test_custom_op_counts_the_rest_and_is_listed():
    a = graphflop.analyze(CustomNet(), example_inputs(), loss="sum")
    r = a.report
    assert r.totals.forward.flops == FORWARD_FLOPS
    assert r.totals.forward.mm_flops == FORWARD_MM
    assert r.totals.forward.macs == FORWARD_MM // 2
    assert not r.totals.forward.complete
    assert r.totals.loss.complete  # the loss's own nodes all have rules
    (u,) = r.uncounted
    assert u.op == "gfpartial.twice.default"
    assert u.count == 1 and u.modules == ("",)
    assert u.missing == ("cost", "jvp")
    # the backward stops at `twice`: fc2's weight gradient is built, fc1's is not.
    # fc2: grad_weight mm 2·3·16·4 = 384, bias grad 12 (sum over the batch of 3×4)
    b = r.totals.backward
    assert not b.complete and not r.totals.jvp.complete and not r.totals.train_step.complete
    assert r.layer("fc1").backward_flops == 0
    assert r.layer("fc2").grad_weight_flops == 384 + 12
    assert r.totals.update.complete


def test_ops_rows_sum_to_totals():
    r = graphflop.analyze(CustomNet(), example_inputs(), loss="sum").report
    for phase in ("forward", "backward", "update", "jvp", "forward_gradient_step"):
        rows = [o for o in r.ops if o.phase == phase]
        total = getattr(r.totals, phase)
        assert sum(o.flops for o in rows) == total.flops, phase
        assert sum(o.mm_flops for o in rows) == total.mm_flops, phase
    fwd = {o.op: o for o in r.ops if o.phase == "forward"}
    assert fwd["aten.addmm.default"].count == 2 and fwd["aten.addmm.default"].flops == 816 + 396
    assert fwd["gfpartial.twice.default"].flops == 0


def _spec(tmp_path) -> str:
    """A model file re-exporting CustomNet (the op is registered once, by this module)."""
    path = tmp_path / "custom.py"
    path.write_text("from test_partial import CustomNet, example_inputs  # noqa: F401\n")
    return f"{path}:CustomNet"


def test_cli_warns_once_and_exits_0(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert main(["inspect", _spec(tmp_path), "--loss", "sum", "--json", str(out)]) == 0
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "gfpartial.twice.default" in warnings[0]
    doc = json.loads(out.read_text())
    assert doc["uncounted"] == [
        {
            "op": "gfpartial.twice.default",
            "count": 1,
            "nodes": [doc["uncounted"][0]["nodes"][0]],
            "modules": [""],
            "missing": ["cost", "jvp"],
        }
    ]
    assert doc["totals"]["forward"]["flops"] == FORWARD_FLOPS
    assert doc["totals"]["forward"]["complete"] is False
    assert doc["totals"]["update"]["complete"] is True


def test_cli_strict_is_one_line_exit_2(tmp_path, capsys):
    out = tmp_path / "out.json"
    rc = main(["inspect", _spec(tmp_path), "--strict", "--json", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and not out.exists()
    assert len(err) == 1 and "gfpartial.twice.default" in err[0]
    assert "Traceback" not in err[0]


def test_strict_rules_raises_in_the_library():
    with strict_rules(), pytest.raises(graphflop.MissingRuleError, match="no cost/jvp/transpose"):
        graphflop.analyze(CustomNet(), example_inputs(), loss="sum")


@pytest.mark.parametrize(
    ("op", "family"),
    [
        (aten.topk.default, "sorting"),
        (aten.sort.default, "sorting"),
        (aten.kthvalue.default, "sorting"),
        (aten._fft_r2c.default, "spectral"),
        (aten._fft_c2c.default, "spectral"),
        (aten._linalg_svd.default, "linalg"),
        (aten.linalg_solve.default, "linalg"),
        (aten.cumsum.default, "reduction"),
        (aten.add_.Tensor, "elementwise"),
        (aten.mkldnn_rnn_layer.default, "recurrent"),
        (aten.convolution.default, "conv"),
        (aten._embedding_bag.default, "embedding"),
        (aten._embedding_bag_forward_only.default, "embedding"),
        (aten.sort.stable, "sorting"),
        (aten._fft_c2r.default, "spectral"),
        (aten.view_as_complex.default, "spectral"),
        (aten.conj_physical.default, "spectral"),
        (aten.cumprod.default, "reduction"),
        (aten._grouped_mm.default, "linalg"),
        (aten.avg_pool3d.default, "pool"),
    ],
)
def test_missing_rule_error_names_the_right_file(op, family):
    assert guess_family(op) == family, op_name(op)
    msg = str(graphflop.MissingRuleError(op))
    assert f"graphflop/ops/{family}.py" in msg


def test_verify_says_which_checks_a_gap_stops(tmp_path, capsys):
    out = tmp_path / "out.json"
    rc = main(["inspect", _spec(tmp_path), "--loss", "sum", "--verify", "--json", str(out)])
    err = capsys.readouterr().err
    assert rc == 1  # a check a gap stops is NOT RUN: not passed
    assert "gradients vs torch.func.grad: NOT RUN (the backward stops" in err
    assert "JVP loss tangent vs torch.func.jvp: NOT RUN (the JVP stops" in err
    doc = json.loads(out.read_text())
    assert "gfpartial.twice.default" in doc["verify_note"]
    assert doc["verify"] and not any(c["ran"] for c in doc["verify"])


ZOO = [
    "linearnet.py",
    "onenet.py",
    "convnet.py",
    "deeper_convnet.py",
    "logreg.py",
    "mlp.py",
    "cnn.py",
    "resnet.py:resnet18",
    "gpt2.py:gpt2_small",
]


@pytest.mark.parametrize("name", ZOO)
def test_op_rows_sum_to_the_totals_for_every_model(name):
    from conftest import analysis

    r = analysis(name, batch=2 if name.startswith("gpt2") else None)
    for phase in ("forward", "backward", "update", "jvp", "forward_gradient_step"):
        rows = [o for o in r.report.ops if o.phase == phase]
        t = getattr(r.report.totals, phase)
        for key in ("flops", "mm_flops", "bytes_read", "bytes_written"):
            assert sum(getattr(o, key) for o in rows) == getattr(t, key), (phase, key)
        assert t.complete and t.macs == t.mm_flops // 2
    assert not r.report.uncounted


def test_depth_rolls_resnet_blocks_up():
    from conftest import analysis

    r = analysis("resnet.py:resnet18").report
    rows = r.layers_at_depth(2)
    names = [L.name for L in rows]
    # conv1, bn1, relu, maxpool, 8 blocks (layer1.0 … layer4.1), avgpool, fc, loss
    assert [n for n in names if n.startswith("layer")] == [
        f"layer{i}.{j}" for i in range(1, 5) for j in range(2)
    ]
    assert sum(L.forward_flops for L in rows) == r.totals.forward.flops
    assert sum(L.backward_flops for L in rows) == sum(L.backward_flops for L in r.layers)


def test_warning_is_one_unwrapped_line_in_a_narrow_terminal(tmp_path):
    import os
    import subprocess
    import sys

    path = tmp_path / "custom.py"
    path.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parent)!r})\n"
        "from test_partial import CustomNet, example_inputs  # noqa: F401\n"
    )
    env = {**os.environ, "COLUMNS": "40"}
    r = subprocess.run(
        [sys.executable, "-m", "graphflop.cli", "inspect", f"{path}:CustomNet", "--no-jvp"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("warning: gfpartial.twice.default"), lines


class _PoolerNotReturned(nn.Module):
    """A BERT-like encoder layer and a pooler (first token → Linear → tanh) whose output the
    model does not return: dead code, removed before counting."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(16, 16)
        self.pool = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.enc(x)
        torch.tanh(self.pool(h[:, 0]))  # the pooler: computed by the code, returned by nothing
        return h


def test_dead_code_is_reported_as_unused_flops():
    a = graphflop.analyze(_PoolerNotReturned(), (torch.randn(2, 5, 16),), loss="sum", jvp=False)
    f = a.report.to_dict()["totals"]["forward"]
    # pooler on (2, 16): addmm 2·2·16·16 = 1,024 matrix + 2·16 = 32 bias adds; tanh 32: 1,088
    assert f["unused_flops"] == 1024 + 32 + 32
    # the encoder alone is counted: 2·10·16·16 = 5,120 matrix FLOPs (10 = 2·5 tokens)
    assert f["mm_flops"] == 5120
    no_pooler = _PoolerNotReturned()
    no_pooler.forward = lambda x: no_pooler.enc(x)  # type: ignore[method-assign]
    g = graphflop.analyze(no_pooler, (torch.randn(2, 5, 16),), loss="sum", jvp=False)
    assert g.report.to_dict()["totals"]["forward"]["flops"] == f["flops"]
    assert g.report.to_dict()["totals"]["forward"]["unused_flops"] == 0


def test_embedding_bag_sum_counts_by_hand():
    bag = nn.EmbeddingBag(10, 4, mode="sum")
    x, off = torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([0, 2])
    a = graphflop.analyze(bag, (x, off), loss="none", backward=False, jvp=False)
    d = a.report.to_dict()
    # 6 indices, 2 bags, dim 4: bag marks index_add of B − 1 = 1 one; cumsum over n + 1 = 7;
    # rows summed into bags 6·4 = 24 adds; the lookup is free: 1 + 7 + 24 = 32
    assert d["totals"]["forward"]["flops"] == 1 + 7 + 24
    assert d["uncounted"] == []


def test_dead_code_removal_keeps_what_fx_keeps():
    """graphflop's dead-code removal (users tested before impurity, removed ops costed as it
    goes) leaves the nodes fx's ``eliminate_dead_code`` leaves, and costs what it removed."""
    import copy

    from torch.fx.experimental.proxy_tensor import make_fx

    from graphflop.frontend.export_form import _eliminate_dead_code, _kept

    def fn(x, w):
        dead = torch.tanh(x @ w)  # a dead chain: mm then tanh
        torch.rand_like(x)  # dead but impure: a random draw stays
        return (x * 2,) if dead is not None else ()

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(2, 16), torch.randn(16, 16))
    ours, theirs = copy.deepcopy(gm.graph), copy.deepcopy(gm.graph)
    unused = _eliminate_dead_code(ours)
    theirs.eliminate_dead_code(is_impure_node=_kept)
    assert [n.name for n in ours.nodes] == [n.name for n in theirs.nodes]
    assert any(n.target is torch.ops.aten.rand_like.default for n in ours.nodes)
    assert not any(n.target is torch.ops.aten.tanh.default for n in ours.nodes)
    # mm (2, 16) @ (16, 16): 2·2·16·16 = 1,024 matrix FLOPs; tanh on 32 elements: 32
    assert unused.mm_flops == 1024
    assert unused.flops == 1024 + 32
