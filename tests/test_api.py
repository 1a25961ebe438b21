"""The library API: pass ordering, torch.export input, custom-op rules, the compile backend."""

from __future__ import annotations

import json
import os
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, analysis
from torch import nn

import graphflop
from graphflop.meta import COST, FACTS, JVP, OUTLINED, SIGNATURE, NodeCost


def test_docs_examples_run():
    text = (ROOT / "docs" / "api.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 6
    for code in blocks:
        exec(compile(code, "docs/api.md", "exec"), {})


def test_out_of_order_names_the_prerequisite():
    gm = torch.fx.symbolic_trace(nn.Linear(3, 2))
    with pytest.raises(graphflop.PassOrderError, match="build_vjp requires 'traced'.*trace"):
        graphflop.build_vjp(gm)
    with pytest.raises(graphflop.PassOrderError, match="build_jvp requires 'traced'"):
        graphflop.build_jvp(gm)


def test_pass_manager_runs_in_order():
    fwd = graphflop.trace(nn.Linear(3, 2), (torch.randn(4, 3),), loss="sum")
    pm = graphflop.PassManager(
        [graphflop.BuildVjp(), graphflop.AnnotateFlops(), graphflop.AnnotateMemory()]
    )
    assert isinstance(pm, torch.fx.passes.infra.pass_manager.PassManager)
    b = pm(fwd).graph_module
    assert {"traced", "vjp", "flops", "memory"} <= b.meta[FACTS]
    # backward of sum(x·Wᵀ + b): dW = 1ᵀ·x (2·4·3·2 = 48 mm FLOPs), db = sum over batch
    assert sum(n.meta[COST].mm_flops for n in b.graph.nodes) == 2 * 4 * 3 * 2


def _passes(fwd):
    """Each graphflop pass, with the options it needs for ``fwd``."""
    from graphflop.passes.optimizer import build_update_for

    bwd, upd = graphflop.build_vjp(fwd), graphflop.add_optimizer_update(fwd)
    return [
        (graphflop.AnnotateFlops(), "val"),
        (graphflop.AnnotateMemory(), "val"),
        (graphflop.BuildJvp(), "traced"),
        (graphflop.BuildVjp(), "traced"),
        (graphflop.AddOptimizerUpdate("adam"), "traced"),
        (graphflop.BuildForwardGradientStep(update=build_update_for(fwd)), "traced"),
        (graphflop.BuildTrainStep(bwd, upd), "traced"),
    ]


@pytest.mark.parametrize("i", range(7))
def test_each_pass_names_its_missing_prerequisite(i):
    from torch.fx.passes.infra.pass_base import PassBase

    fwd = graphflop.trace(nn.Linear(3, 2), (torch.randn(4, 3),), loss="sum")
    pass_, fact = _passes(fwd)[i]
    assert isinstance(pass_, PassBase)
    # a graph without the prerequisite: symbolic_trace gives no facts and no fake values
    bare = torch.fx.symbolic_trace(nn.Linear(3, 2))
    with pytest.raises(graphflop.PassOrderError, match=f"{pass_.name} requires '{fact}'.* first"):
        pass_(bare)
    # with it, the pass runs and its output has the facts it promised
    out = pass_(fwd).graph_module
    assert set(pass_.provided) <= out.meta[FACTS]


def test_train_step_names_a_missing_backward():
    fwd = graphflop.trace(nn.Linear(3, 2), (torch.randn(4, 3),), loss="sum")
    upd = graphflop.add_optimizer_update(fwd)
    with pytest.raises(graphflop.PassOrderError, match="backward graph requires 'vjp'.*build_vjp"):
        graphflop.build_train_step(fwd, upd, upd)


def test_train_step_refuses_a_forward_without_a_loss():
    # the backward and update come from a traced loss; the forward given has none to seed
    x = torch.randn(4, 3)
    lin = nn.Linear(3, 2)
    fwd = graphflop.trace(lin, (x,), loss="sum")
    bwd, upd = graphflop.build_vjp(fwd), graphflop.add_optimizer_update(fwd)
    no_loss = graphflop.trace(lin, (x,), loss="none")
    with pytest.raises(ValueError, match="the forward graph has no loss"):
        graphflop.build_train_step(no_loss, bwd, upd)


def test_summarize_refuses_a_backward_without_its_update():
    from graphflop.passes.summary import Graphs, summarize

    fwd = graphflop.trace(nn.Linear(3, 2), (torch.randn(4, 3),), loss="sum")
    graphs = Graphs(fwd, backward=graphflop.build_vjp(fwd))
    with pytest.raises(ValueError, match="backward is given without graphs.update"):
        summarize(graphs, name="linear", optimizer="sgd", tangents="params")


def test_analyze_reraises_the_pass_error_not_the_managers():
    # torch.fx's PassManager wraps errors in a bare Exception: run_passes (what analyze runs
    # each graph's passes with) re-raises the pass's own
    from graphflop.passes.infra import run_passes
    from graphflop.passes.optimizer import AddOptimizerUpdate

    fwd = graphflop.trace(nn.Linear(3, 2), (torch.randn(4, 3),), loss="sum")
    with pytest.raises(ValueError, match="unknown optimizer") as e:
        run_passes(fwd, [AddOptimizerUpdate("lion", backward=graphflop.build_vjp(fwd))])
    assert any("AddOptimizerUpdate" in note for note in e.value.__notes__)


def test_report_round_trips_the_schema():
    from graphflop.report import Report

    what_ifs = {"checkpoint": "0", "amp": "bf16", "loss": "sum"}  # module 0: the Linear
    compiled = {"memory_model": "compiled", "jvp": False, "loss": "sum"}
    for kw in ({}, {"jvp": False}, {"backward": False}, {"optimizer": "adam"}, what_ifs, compiled):
        a = graphflop.analyze(nn.Sequential(nn.Linear(3, 4), nn.Tanh()), (torch.randn(2, 3),), **kw)
        d = a.to_dict()
        assert isinstance(a.report, Report) and not hasattr(a, "summary")
        back = Report.from_dict(d)
        assert back == a.report and list(back.to_dict()) == list(d)
        assert back.to_dict() == d  # every key, in order, at every level
        assert ("backward" in d["totals"]) == a.report.has_backward
        assert ("jvp_forward" in d["ratios"]) == a.report.has_jvp
        assert ("ratio" in d["layers"][0]) == a.report.has_backward
    assert list(d) == [
        "schema_version", "model", "inputs", "params", "trainable_params", "frozen_params",
        "loss", "optimizer", "totals", "ratios", "memory", "layers", "uncounted", "ops",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="schema_version"):
        Report.from_dict({**d, "schema_version": 2})
    # the pinned inspect --json documents read back into a Report and write out unchanged
    # (less the keys inspect adds after the report's: model_notes)
    for path in sorted((ROOT / "tests" / "golden").glob("*.json")):
        doc = json.loads(path.read_text())
        assert list(doc)[-1] == "model_notes", path.name
        del doc["model_notes"]
        assert json.dumps(Report.from_dict(doc).to_dict()) == json.dumps(doc), path.name


def test_analysis_builds_the_update_once_and_the_train_step_on_request():
    from graphflop.meta import UPDATE
    from graphflop.passes import optimizer

    calls = []
    real = optimizer.build_update
    optimizer.build_update = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        a = graphflop.analyze(nn.Linear(3, 2), (torch.randn(4, 3),), loss="sum")
    finally:
        optimizer.build_update = real
    assert len(calls) == 1
    assert a.forward_gradient.meta[UPDATE] == a.update.meta[UPDATE]
    ts = a.train_step
    assert ts is a.train_step  # built once, on first access
    assert sum(n.meta[COST].flops for n in ts.graph.nodes if n.op == "call_function") == (
        a.report.totals.train_step.flops
    )


def _custom_op():
    @torch.library.custom_op("gftest::scale", mutates_args=())
    def scale(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * w

    @scale.register_fake
    def _(x, w):
        return torch.empty_like(x)

    return scale, torch.ops.gftest.scale.default


SCALE, SCALE_OP = _custom_op()


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, dtype=torch.float64))

    def forward(self, x):
        return SCALE(x, self.w)


def test_custom_op_without_rule_names_op_and_kinds():
    from graphflop.testing import restored_rules, without_rule

    with without_rule(SCALE_OP), restored_rules():
        _custom_op_without_rule()


def _custom_op_without_rule():
    from graphflop.ops import strict_rules

    with pytest.raises(graphflop.MissingRuleError) as e, strict_rules():
        graphflop.analyze(Scaled(), (torch.randn(3, 5, dtype=torch.float64),), loss="sum")
    assert "gftest.scale.default" in str(e.value) and "cost/jvp/transpose" in str(e.value)
    # a cost rule alone: counting works, differentiating names the missing kind
    graphflop.register_rule(SCALE_OP, cost=lambda out, x, w: NodeCost(flops=out.numel()))
    fwd = graphflop.annotate_flops(
        graphflop.trace(Scaled(), (torch.randn(3, 5, dtype=torch.float64),), loss="sum")
    )
    assert sum(n.meta[COST].flops for n in fwd.graph.nodes) == 15 + 15
    with (
        pytest.raises(graphflop.MissingRuleError, match="no jvp rule for gftest.scale"),
        strict_rules(),
    ):
        graphflop.build_vjp(fwd)


def test_custom_op_with_rules_is_counted_and_differentiated():
    from graphflop.testing import restored_rules

    with restored_rules():
        _custom_op_with_rules()


def _custom_op_with_rules():
    def jvp(b, out, args, tangents, kwargs):
        x, w = args
        tx, tw = tangents
        return b.add(
            b.call(SCALE_OP, tx, w) if tx is not None else None,
            b.call(SCALE_OP, x, tw) if tw is not None else None,
        )

    def transpose(b, ct, args, kwargs, linear):
        x, w = args
        cts = [None, None]
        if linear[0]:
            cts[0] = b.call(SCALE_OP, ct, w)
        if linear[1]:  # w is broadcast over the batch: sum the per-row products back
            cts[1] = b.sum_to(b.call(SCALE_OP, ct, x), tuple(w.meta["val"].shape))
        return cts

    graphflop.register_rule(
        SCALE_OP, cost=lambda out, x, w: NodeCost(flops=out.numel()), jvp=jvp, transpose=transpose
    )
    from graphflop.runtime.verify import (
        real_arguments,
        run_backward,
        run_forward,
        run_jvp,
    )

    model = Scaled()
    x = torch.randn(3, 5, dtype=torch.float64)
    fwd = graphflop.annotate_flops(graphflop.trace(model, (x,), loss="sum"))
    bwd = graphflop.annotate_flops(graphflop.build_vjp(fwd))
    values = real_arguments(fwd, model)
    xv = values[fwd.meta[SIGNATURE].inputs[0]]
    (gw,) = run_backward(bwd, run_forward(fwd, values))

    # the same function written with a plain multiply, differentiated by torch.func
    def f(w):
        return (xv * w).sum()

    assert torch.allclose(gw, torch.func.grad(f)(model.w.detach()), rtol=1e-12)
    # backward: the transpose w.r.t. w is the op (15) then a sum over the batch (15)
    assert sum(n.meta[COST].flops for n in bwd.graph.nodes) == 15 + 15
    jvp = graphflop.build_jvp(fwd, "all")
    info = jvp.meta[JVP]
    tangents = {p: torch.randn_like(values[p]) for _, p in info.tangent_inputs}
    got = run_jvp(jvp, values, tangents)[info.primal_outputs]
    (pw,) = [p for p, _ in fwd.meta[SIGNATURE].params]
    (px,) = fwd.meta[SIGNATURE].inputs
    _, ref = torch.func.jvp(
        lambda w, x_: (x_ * w).sum(), (values[pw], xv), (tangents[pw], tangents[px])
    )
    assert torch.allclose(got, ref, rtol=1e-12)


@pytest.mark.parametrize("name,batch", [("convnet.py", 2), ("mlp.py", 8)])
def test_compile_backend_matches_inspect_and_eager(name, batch):
    import sys

    sys.path.insert(0, str(ROOT / "models"))
    from conftest import spec

    from graphflop.load import load

    torch.manual_seed(0)
    model = load(spec(name)).model
    x = torch.randn(batch, *({"convnet.py": (3, 224, 224), "mlp.py": (1, 28, 28)}[name]))
    t = torch.randint(0, 10, (batch,))
    report = graphflop.CompileReport()
    compiled = torch.compile(
        lambda x, t: F.cross_entropy(model(x), t), backend=graphflop.compile_backend(report=report)
    )
    loss_c = compiled(x, t)
    grads_c = torch.autograd.grad(loss_c, list(model.parameters()))
    torch._dynamo.reset()
    loss_e = F.cross_entropy(model(x), t)
    grads_e = torch.autograd.grad(loss_e, list(model.parameters()))
    assert torch.equal(loss_c, loss_e)
    assert all(torch.equal(a, b) for a, b in zip(grads_c, grads_e))
    s = analysis(name, batch).to_dict()["totals"]
    assert len(report.graphs) == 1
    assert report.forward_flops == s["forward"]["flops"]
    assert report.backward_flops == s["backward"]["flops"]


class _Broken(nn.Module):
    def __init__(self, brk: bool):
        super().__init__()
        self.brk = brk
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 8)

    def forward(self, x):
        h = torch.relu(self.a(x))
        if self.brk:
            torch._dynamo.graph_break()
        return self.b(h)


def test_graph_break_gives_two_graphs_whose_sums_match():
    torch.manual_seed(0)
    broken = _Broken(True)
    whole = _Broken(False)
    whole.load_state_dict(broken.state_dict())
    x = torch.randn(4, 16)
    report = graphflop.CompileReport()
    torch._dynamo.reset()
    compiled = torch.compile(broken, backend=graphflop.compile_backend(report=report))
    out_c = compiled(x)
    out_c.sum().backward()
    torch._dynamo.reset()
    assert len(report.graphs) == 2
    ref = graphflop.analyze(whole, (x,), loss="sum", jvp=False).to_dict()["totals"]
    # graphflop seeds each graph's backward with a sum it does not count; the whole model's
    # analysis counts its sum loss (4·8 adds forward): take it out to compare
    assert report.forward_flops == ref["forward"]["flops"] - 4 * 8
    assert report.backward_flops == ref["backward"]["flops"] - ref["backward"]["loss_flops"]
    assert torch.equal(out_c, whole(x))


def test_register_rule_refuses_an_op_that_has_a_rule_unless_override():
    from graphflop.ops import registry
    from graphflop.testing import restored_rules

    op = torch.ops.aten.relu.default
    builtin = registry.lookup(op, need=("cost", "jvp"))
    with restored_rules():
        with pytest.raises(ValueError, match="aten.relu.default already has a rule.*override=True"):
            graphflop.register_rule(op, cost=lambda out, x: NodeCost(flops=7))
        assert registry.lookup(op) is builtin  # untouched
        new = graphflop.register_rule(op, cost=lambda out, x: NodeCost(flops=7), override=True)
        # a cost-only override keeps the built-in JVP and transpose rules
        assert new.jvp is builtin.jvp and new.transpose is builtin.transpose
        assert new.zero_derivative == builtin.zero_derivative
        assert new.cost(None, None).flops == 7
        # the same op traced: the new cost counts, the built-in JVP still differentiates
        m = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
        fwd = graphflop.annotate_flops(graphflop.trace(m, (torch.randn(2, 3),), loss="sum"))
        relu = next(n for n in fwd.graph.nodes if n.target is op)
        assert relu.meta[COST].flops == 7
        graphflop.build_vjp(fwd)
        # an override that gives a JVP replaces that one only
        jvp = builtin.jvp
        again = graphflop.register_rule(
            op, cost=builtin.cost, jvp=lambda *a: jvp(*a), override=True
        )
        assert again.jvp is not builtin.jvp and again.transpose is builtin.transpose
    assert registry.lookup(op) is builtin


def test_register_rule_twice_for_a_custom_op():
    from graphflop.testing import restored_rules, without_rule

    with without_rule(SCALE_OP), restored_rules():
        graphflop.register_rule(SCALE_OP, cost=lambda out, x, w: NodeCost(flops=1))
        with pytest.raises(ValueError, match="gftest.scale.default already has a rule"):
            graphflop.register_rule(SCALE_OP, cost=lambda out, x, w: NodeCost(flops=2))


def test_analyze_takes_every_form_example_inputs_may_return():
    """Tester's finding: analyze(model, tensor) unpacked the tensor row by row (TypeError:
    forward() takes 2 positional arguments but 9 were given). A tensor, a tuple, a dict of
    keyword inputs and (args, kwargs) all mean the same call. Linear(100, 50) at batch 8:
    2·8·100·50 = 80,000 matrix FLOPs."""
    import graphflop

    class Lin(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(100, 50)

        def forward(self, x, scale=1.0):
            return self.fc(x) * scale

    x = torch.randn(8, 100)
    forms = [x, (x,), {"x": x}, ((x,), {"scale": 2.0})]
    for form in forms:
        assert graphflop.analyze(Lin(), form).report.totals.forward.mm_flops == 80_000, form


class _Argmax(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x).argmax(-1)


def test_analyze_an_integer_only_output_is_forward_only():
    # the library's side of the CLI's note: nothing to differentiate, so loss "auto" is no
    # loss and no backward (it was an IndexError in the backward builder)
    a = graphflop.analyze(_Argmax(), (torch.randn(2, 4),))
    assert a.backward is None and a.update is None and a.jvp is None
    d = a.report.to_dict()
    assert d["loss"] == "none"
    assert set(d["totals"]) == {"forward", "loss"}
    # Linear(4 -> 3) at batch 2: 2*2*4*3 = 48 matmul FLOPs
    assert d["totals"]["forward"]["mm_flops"] == 48


@pytest.mark.parametrize("loss", ["sum", "cross_entropy", "mse", "output"])
def test_an_explicit_loss_of_an_integer_only_output_is_refused(loss):
    with pytest.raises(graphflop.TraceError, match=f"loss '{loss}' needs a floating-point output"):
        graphflop.analyze(_Argmax(), (torch.randn(2, 4),), loss=loss)


def test_loss_output_of_a_non_scalar_output_is_refused():
    # tester's finding: a raw broadcasting RuntimeError escaped from the backward's seed
    with pytest.raises(graphflop.TraceError, match=r"loss 'output'.*shape \(2, 3\)"):
        graphflop.analyze(nn.Linear(4, 3), (torch.randn(2, 4),), loss="output")


def test_analyze_refuses_arguments_it_cannot_use():
    """Tester's findings: a what-if with backward=False returned without
    it; a string model, a float directions and an int progress failed deep inside (bare
    AttributeError/TypeError mid-run); report.layer of an unknown name was a bare KeyError."""
    m, x = nn.Linear(4, 2), torch.randn(2, 4)
    with pytest.raises(ValueError, match="checkpoint= is a what-if on the backward"):
        graphflop.analyze(m, x, checkpoint="0", backward=False)
    with pytest.raises(ValueError, match="amp= is a what-if"):
        graphflop.analyze(m, x, amp="bf16", backward=False)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, not str"):
        graphflop.analyze("notamodel", x)
    with pytest.raises(TypeError, match="directions must be an int"):
        graphflop.analyze(m, x, directions=2.5)
    with pytest.raises(TypeError, match="progress must be callable"):
        graphflop.analyze(m, x, progress=5)
    r = graphflop.analyze(nn.Sequential(nn.Linear(4, 2), nn.ReLU()), x).report
    with pytest.raises(KeyError, match="no layer row '1x'; did you mean 1"):
        r.layer("1x")


def test_analyze_takes_an_options_value_and_keyword_overrides():
    """``analyze(m, x, AnalyzeOptions(...))`` and the keyword form are one analysis; keywords
    replace the value's fields; the value checks itself when made or replaced; a keyword that
    is no field is refused by name. Adam's update: 2·4 + 2 = 10 parameters; the default SGD
    update costs 2 FLOPs per parameter (p - lr·g), Adam more."""
    from dataclasses import replace

    m, x = nn.Sequential(nn.Linear(4, 2), nn.ReLU()), torch.randn(3, 4)
    opts = graphflop.AnalyzeOptions(optimizer="adam", jvp=False)
    a = graphflop.analyze(m, x, opts, name="net")
    b = graphflop.analyze(m, x, optimizer="adam", jvp=False, name="net")
    assert a.report == b.report and a.report.optimizer == "adam" and a.jvp is None
    assert a.report.model == "net" and a.report.params == 10
    c = graphflop.analyze(m, x, opts, optimizer="sgd")  # a keyword overrides the value
    assert c.report.optimizer == "sgd" and c.jvp is None
    assert c.report.totals.update.flops == 2 * 10 < a.report.totals.update.flops
    assert opts == graphflop.AnalyzeOptions(jvp=False, optimizer="adam")  # frozen, compared
    with pytest.raises(ValueError, match="amp= is a what-if on the backward"):
        replace(opts, backward=False, amp="bf16")
    with pytest.raises(ValueError, match="unknown memory_model 'inductor'"):
        graphflop.AnalyzeOptions(memory_model="inductor")
    with pytest.raises(TypeError, match="unexpected keyword argument 'optimiser'.*optimizer"):
        graphflop.analyze(m, x, optimiser="adam")
    with pytest.raises(TypeError, match="options must be an AnalyzeOptions, not dict"):
        graphflop.analyze(m, x, {"optimizer": "adam"})


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"loss": "bogus"}, ValueError, "unknown loss 'bogus': one of cross_entropy"),
        ({"optimizer": "nope"}, ValueError, "unknown optimizer 'nope': one of sgd"),
        ({"tangents": "x"}, ValueError, "unknown tangents 'x': one of params, inputs, all"),
        ({"distribution": "x"}, ValueError, "unknown distribution 'x': one of normal"),
        ({"device": "tpu"}, ValueError, "unknown device 'tpu': one of cpu, cuda"),
        ({"amp": "fp8"}, ValueError, "unknown amp 'fp8': one of bf16, fp16 or None"),
        ({"optimizer": 3}, TypeError, "optimizer must be a str"),
        ({"directions": 0}, ValueError, "directions must be 1 to 1,024"),
        ({"directions": -5}, ValueError, "directions must be 1 to 1,024"),
        ({"directions": 10**9}, ValueError, "directions must be 1 to 1,024"),
        ({"directions": 2.0}, TypeError, "directions must be an int"),
        ({"checkpoint": "re:("}, ValueError, "bad checkpoint pattern: regular expression"),
        ({"checkpoint": ""}, ValueError, "empty checkpoint pattern"),
        ({"checkpoint": 5}, TypeError, "checkpoint must be a module path pattern"),
        ({"backward": "no"}, TypeError, "backward must be True or False, not 'no'"),
        ({"jvp": 0}, TypeError, "jvp must be True or False, not 0"),
        ({"keep_grads": "yes"}, TypeError, "keep_grads must be True or False"),
        (
            {"amp": "bf16", "memory_model": "graph"},
            ValueError,
            "amp= is a what-if on the eager memory model, not on memory_model='graph'",
        ),
        (
            {"checkpoint": "fc*", "memory_model": "compiled"},
            ValueError,
            "checkpoint= is a what-if on the eager memory model",
        ),
    ],
)
def test_analyze_options_refuse_bad_values(kwargs, error, match):
    """Every field is checked when the options are made, with the command line's choices and
    limits (``--directions`` 1 to 1,024; the API ran over 90 s on a tiny MLP with 10**9), and
    the combinations the command line refuses."""
    with pytest.raises(error, match=re.escape(match)):
        graphflop.AnalyzeOptions(**kwargs)


def test_analyze_options_are_keyword_only():
    """``AnalyzeOptions("sgd")`` set the loss to 'sgd' silently (the first field)."""
    with pytest.raises(TypeError, match="positional argument"):
        graphflop.AnalyzeOptions("sgd")  # type: ignore[misc]


def test_a_checkpoint_pattern_matching_nothing_is_worded_for_the_api():
    """The library's error names the option as both interfaces know it, not a CLI flag."""
    from graphflop.passes.checkpoint import CheckpointPatternError

    m, x = nn.Sequential(nn.Linear(4, 2)), torch.randn(3, 4)
    with pytest.raises(CheckpointPatternError, match="^checkpoint pattern 'x' matches no module"):
        graphflop.analyze(m, x, checkpoint="x", jvp=False)


def test_a_model_pytorch_cannot_run_for_its_dtypes_is_refused():
    """Tester's finding: a float64 model given float32 inputs was
    analysed (fake tensors' matrix-product kernels do not check dtypes); eager PyTorch raises
    'mat1 and mat2 must have the same dtype'."""
    from graphflop.frontend.trace import TraceError

    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    with pytest.raises(RuntimeError, match="same dtype"):
        m(torch.randn(2, 4))  # what eager PyTorch does
    with pytest.raises(TraceError, match="addmm in 0 multiplies float32 and float64 operands"):
        graphflop.analyze(m, (torch.randn(2, 4),))
    assert graphflop.analyze(m, (torch.randn(2, 4, dtype=torch.float64),)).report.params == 67


def test_mixed_dtypes_inside_repeated_blocks_are_refused_at_the_first_copy():
    """The check reads each block's template once where the forward calls its blocks: a
    product of two dtypes inside a block is refused, named at its first copy in graph order
    (at block 2, the first whose weights are float64 while its input is float32; block 3 gets
    block 2's output, and is a call of another template)."""
    from graphflop.frontend.trace import TraceError, trace

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.c(torch.relu(self.b(torch.relu(self.a(x)))))

    m = nn.Sequential(nn.Linear(4, 4), *(Block() for _ in range(3)))
    for b in m[2:]:
        b.double()
    with pytest.raises(RuntimeError, match="same dtype"):
        m(torch.randn(2, 4))  # what eager PyTorch does
    with pytest.raises(TraceError, match="addmm in 2.a multiplies float32 and float64 operands"):
        trace(m, torch.randn(2, 4))
    m[1].double()  # every block in float64, given the float64 output of a float32 layer: none
    m[0].double()
    assert trace(m, torch.randn(2, 4, dtype=torch.float64)).meta[OUTLINED].calls == 3


def test_compile_backend_checks_its_arguments_when_made():
    # tester's finding: report=5 was accepted, to fail inside compile
    with pytest.raises(TypeError, match="report must be a graphflop CompileReport, not int"):
        graphflop.compile_backend(report=5)
    with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
        graphflop.compile_backend(optimizer="lion")


def test_jvp_roles_of_the_first_layer_are_all_parameter_work():
    """Tester's finding: with tangents on the parameters, the first
    layer's bias-tangent add was counted tangent_from_input, though no input tangent reaches
    it. Linear(4, 3) → Tanh → Linear(3, 2), batch 2, by hand:
    layer 0: x·Ẇᵀ 2·2·4·3 = 48 + ḃ 2·3 = 6, all from the parameters: 54, none from the input;
    layer 2: ẏ₁·W₂ᵀ 2·2·3·2 = 24 from the input, y₁·Ẇ₂ᵀ 24 from the parameters, and the two
    adds that merge them with ḃ₂ (4 + 4) carry the input tangent: 32 from the input."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    r = graphflop.analyze(m, (torch.randn(2, 4),), loss="sum").report
    rows = {L.name: (L.tangent_from_input_flops, L.tangent_from_param_flops) for L in r.layers}
    assert rows["0"] == (0, 54)
    assert rows["2"] == (32, 24)


def test_compile_backend_under_no_grad_counts_no_backward():
    """Tester's finding: a graph compiled under torch.no_grad() reported
    backward FLOPs that never run. Linear(4, 2) on 3 rows: forward 2·3·4·2 = 48 + bias 6 = 54
    (the output summed: the loss's 5 adds are not the model's); compiled again with gradients
    on (Dynamo guards on grad mode), the backward is counted: the weight gradient
    2·3·4·2 = 48 and the bias gradient's column sum 2·3 = 6."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = nn.Linear(4, 2)
    backend = graphflop.compile_backend()
    compiled = torch.compile(m, backend=backend)
    with torch.no_grad():
        compiled(torch.randn(3, 4))
    (g,) = backend.report.graphs
    assert (g.forward_flops, g.backward_flops) == (54, 0)
    compiled(torch.randn(3, 4))
    assert [x.backward_flops for x in backend.report.graphs] == [0, 54]
    torch._dynamo.reset()


def test_build_vjp_refuses_another_models_jvp():
    """A JVP graph of another forward (other parameter shapes) used to be transposed into a
    backward of the wrong shapes; now a ValueError names the first input that differs."""
    from graphflop.ad.jvp import build_jvp
    from graphflop.ad.vjp import build_vjp
    from graphflop.frontend.trace import trace

    f1 = trace(nn.Sequential(nn.Linear(4, 3)), (torch.randn(2, 4),), loss="sum")
    f2 = trace(nn.Sequential(nn.Linear(5, 2), nn.ReLU()), (torch.randn(2, 5),), loss="sum")
    with pytest.raises(ValueError, match=r"'p_model_0_weight' is \(2, 5\) torch.float32, the"):
        build_vjp(f1, linearized=build_jvp(f2, "params"))
    # its own JVP is accepted (no error): the check compares names, shapes and dtypes only
    build_vjp(f1, linearized=build_jvp(f1, "params"))


@pytest.mark.parametrize(
    ("which", "says"),
    [
        ("jvp", "direct must be True or False, not 'yes'"),
        ("vjp", "per_template must be True or False, not 1"),
    ],
)
def test_pass_switches_are_booleans(which, says):
    """``BuildJvp(direct="yes")`` was taken as true (and ``"no"`` too)."""
    from graphflop.passes.autodiff import BuildJvp, BuildVjp

    with pytest.raises(TypeError, match=re.escape(says)):
        BuildJvp(direct="yes") if which == "jvp" else BuildVjp(per_template=1)


def test_analysis_refuses_deep_copy_and_pickle_with_one_clear_error():
    """A tester's finding: ``copy.deepcopy`` of an analysis (or of its graphs) of 12 blocks
    raised RecursionError (fx's nodes name each other), ``pickle.dumps`` a cryptic pybind11
    error. Both now raise TypeError saying to keep the report; a shallow copy shares the graphs,
    and the report pickles."""
    import copy
    import pickle

    a = graphflop.analyze(
        torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), torch.randn(2, 4)
    )
    for attempt, what in (
        (lambda: copy.deepcopy(a), "deep-copied"),
        (lambda: pickle.dumps(a), "pickled"),
    ):
        with pytest.raises(TypeError, match=f"an Analysis cannot be {what}.*keep its report"):
            attempt()
    b = copy.copy(a)
    assert b.report is a.report and b.backward is a.backward and b.forward is a.forward
    assert pickle.loads(pickle.dumps(a.report)) == a.report


class _WarnsInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            warnings.warn("forward is experimental", UserWarning, stacklevel=1)
        return self.fc(x)


def test_analyze_passes_on_the_model_s_own_warnings_once():
    """Tester's finding: tracing silenced every warning, the model's own too. The model's
    warning comes through once (raised three times per call); torch's
    own warnings about fake tensors do not (none from torch's package among the caught)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphflop.analyze(_WarnsInForward(), torch.randn(2, 4))
    mine = [w for w in caught if str(w.message) == "forward is experimental"]
    assert len(mine) == 1 and mine[0].filename == __file__, [str(w.message) for w in caught]
    torch_dir = os.path.dirname(torch.__file__)
    assert not [w for w in caught if w.filename.startswith(torch_dir)], caught


class _TakesKeyword(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        y = self.fc(x)
        return y if scale is None else y * scale


def test_trace_takes_the_input_forms_analyze_takes():
    """A tester's finding: ``trace(model, x)`` on a bare tensor failed, which ``analyze``
    takes. Each form gives the graph of the one-tuple form: the same placeholders and ops."""
    from graphflop.frontend.trace import trace

    def ops(gm):
        return [(n.op, str(n.target)) for n in gm.graph.nodes]

    x, s = torch.randn(2, 4), torch.randn(2, 2)
    model = _TakesKeyword()
    plain = ops(trace(model, (x,)))
    assert ops(trace(model, x)) == plain
    assert ops(trace(model, [x])) == plain
    keyword = ops(trace(model, (x,), kwargs={"scale": s}))
    assert keyword != plain  # the multiply by scale
    assert ops(trace(model, ((x,), {"scale": s}))) == keyword
    assert ops(trace(model, {"x": x, "scale": s})) == keyword
    with pytest.raises(TypeError, match="return a tensor, a tuple"):
        trace(model, 3)


def test_an_uninitialised_lazy_module_is_refused_with_advice():
    """Before its first call a Lazy* module's shapes are unknown: one line naming the
    parameter and what to do, not torch's ValueError from deep inside the trace; after one
    eager call (as ``graphflop inspect`` makes for a model file) it analyses."""
    from graphflop.frontend.errors import TraceError

    model = torch.nn.Sequential(torch.nn.LazyLinear(8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    x = torch.randn(4, 5)
    with pytest.raises(TraceError, match=r"parameter 0\.weight .*lazy.*run the model once"):
        graphflop.analyze(model, (x,))
    model(x)
    # forward FLOPs: 2·4·5·8 + 4·8 (bias) + 4·8 (relu) + 2·4·8·1 + 4 (bias) = 452, plus the
    # loss, a sum over 4 outputs at 1 per input element (FLOPS.md): 456
    assert graphflop.analyze(model, (x,)).report.totals.forward.flops == 456


class _Marked(nn.Module):
    """Linear(8, 16) and ReLU inside a profiler mark (``record_function``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)

    def forward(self, x):
        with torch.autograd.profiler.record_function("block"):
            return torch.relu(self.fc(x))


class _WithDataParallel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.DataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU()))

    def forward(self, x):
        return self.body(x)


@pytest.mark.parametrize(
    "make",
    [_Marked, _WithDataParallel, lambda: nn.DataParallel(_Marked())],
    ids=["record_function", "data_parallel_submodule", "data_parallel_model"],
)
def test_profiler_marks_and_data_parallel_are_analysed_as_their_work(make):
    """A ``record_function`` mark is no op of the graph (it made the trace fail: its nodes
    have no value); ``nn.DataParallel``, which enters one, is analysed as the module it wraps
    (its forward without GPUs). Batch 4: Linear(8, 16), 2·4·8·16 + 4·16 = 1,088 FLOPs, ReLU
    4·16 = 64, loss "sum" 4·16 = 64 (a reduction counts one FLOP per element read)."""
    if torch.cuda.is_available():
        pytest.skip("nn.DataParallel with GPUs wants its module on cuda:0")
    a = graphflop.analyze(make(), (torch.randn(4, 8),), loss="sum", jvp=False)
    assert a.report.totals.forward.flops == 1088 + 64 + 64
