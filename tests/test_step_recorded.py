"""The forward-gradient step built from a recorded JVP (``record_derivatives``: each repeated
block's JVP built once per variant) without expanding it: the JVP's top level copied with its
calls, the update graph's calls as calls, the sampled directions and the estimates made calls
per block. The step built from the flat JVP is the reference: the recorded step's flat view
equals it node for node (ops, arguments, layouts, every annotation, names), its figures
composed per template equal the flat sums, and where the recorded build does not apply (K > 1
directions, directions as inputs, a custom Function's entries in the JVP's log) the step is
built flat from the JVP's flat view."""

from __future__ import annotations

import operator

import pytest
import torch
from conftest import node_rows, spec
from test_recorded_analysis import QUICK, SLOW, _check_costs, _figures, _flat_figures, _loaded
from test_recorded_analysis import _model as _recorded_model

from graphflop.analysis import analyze
from graphflop.meta import DERIVED_HIERARCHY, HIERARCHY, NODE_KEYS, PACKED, ROLE, SLOT
from graphflop.passes import calls
from graphflop.passes.autodiff import BuildJvp, BuildVjp
from graphflop.passes.flops import AnnotateFlops
from graphflop.passes.forward_gradient import BuildForwardGradientStep
from graphflop.passes.infra import run_passes
from graphflop.passes.optimizer import STATE_KINDS, AddOptimizerUpdate, for_every_parameter
from graphflop.passes.summary import Graphs, summarize

REPEAT = torch.ops.graphflop.repeat.default

#: the models of models/ not in QUICK (the Llama file at three small layers)
MODELS = ["llama.py", "logreg.py", "onenet.py", "linearnet.py"]


def _model(which: str):
    if which == "llama.py":
        cfg = dict(vocab=128, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64)
        return _loaded(spec("llama.py"), max_seq=128, **cfg)
    return _recorded_model(which)


def _rows(gm):
    """Every node by op, arguments and layout, with every graphflop annotation."""
    return node_rows(gm, lambda n: tuple(n.meta.get(k) for k in NODE_KEYS))


def _names(gm):
    return [n.name for n in gm.graph.nodes]


def _graph_meta(gm):
    return {k: v for k, v in gm.meta.items() if k != DERIVED_HIERARCHY}


def _steps(fwd, optimizer="sgd", **kw):
    """The step built from the recorded JVP and from the flat JVP (one update graph), both
    costed, with the two JVPs and the update graph (None where the step builds its own)."""
    lin = run_passes(fwd, [BuildJvp("params", direct=True), AnnotateFlops()])
    flat_lin = run_passes(fwd, [BuildJvp("params"), AnnotateFlops()])
    bwd = run_passes(fwd, [BuildVjp(linearized=flat_lin), AnnotateFlops()])
    upd = run_passes(fwd, [AddOptimizerUpdate(optimizer, backward=bwd), AnnotateFlops()])
    upd = for_every_parameter(upd)

    def step(jvp):
        p = BuildForwardGradientStep(optimizer, jvp=jvp, update=upd, **kw)
        return run_passes(fwd, [p, AnnotateFlops()])

    return step(lin), step(flat_lin), lin, flat_lin, upd


def _check_equal(rec, flat, fwd, lin, flat_lin, optimizer):
    """The recorded step's flat view is the flat step node for node, names and graph
    annotations included; its figures composed per template are the flat sums; the summary
    of either is the same."""
    view = calls.flat_view(rec)
    assert _rows(view) == _rows(flat)
    assert _names(view) == _names(flat)
    assert _graph_meta(view) == _graph_meta(flat)
    dh = rec.meta.get(DERIVED_HIERARCHY)
    if dh is not None:
        keep = lambda n: True  # noqa: E731
        assert _figures(calls.derived_figures(dh, keep, "forward")) == _flat_figures(
            flat, keep, "forward"
        )
    kw = dict(name="m", optimizer=optimizer, tangents="params")
    got = summarize(Graphs(fwd, jvp=lin, forward_gradient=rec), **kw).to_dict()
    want = summarize(Graphs(fwd, jvp=flat_lin, forward_gradient=flat), **kw, hierarchical=False)
    assert got == want.to_dict()
    assert got["totals"]["forward_gradient_step"]["flops"] > 0


def _check_model(which, optimizers=("sgd", "adamw")):
    model, x = _model(which)
    fwd = analyze(model, x, jvp=False, backward=False).forward
    for optimizer in optimizers:
        rec, flat, lin, flat_lin, _ = _steps(fwd, optimizer)
        _check_equal(rec, flat, fwd, lin, flat_lin, optimizer)
        if fwd.meta.get(HIERARCHY) is None:  # no block: nothing recorded, the same graph
            assert not calls.is_recorded(lin) and not calls.is_recorded(rec)
            continue
        assert calls.is_recorded(rec), which
        _check_costs(rec)
        # the top level is smaller than the flat step: each call one node and its getitems
        assert len(rec.graph.nodes) < len(flat.graph.nodes)


@pytest.mark.parametrize("which", QUICK + MODELS)
def test_recorded_step_equals_the_flat_step(which):
    _check_model(which)


@pytest.mark.slow
@pytest.mark.parametrize("which", SLOW)
def test_large_models_recorded_step_equals_the_flat_step(which):
    _check_model(which, optimizers=("adam",))


def _ops(t):
    return [x.target for x in t.graph.nodes if x.op == "call_function"]


def test_stack_step_calls_the_jvp_and_update_templates():
    """Four blocks (InStack: a Linear before them, a head after): the step's calls are per
    block the sampled directions, the tangent work (the JVP's calls, on copies of its
    templates), the estimates d·v and the update (the update graph's calls, one template for
    the four blocks); the directions and estimates are ``direction`` work, and no node of a
    block is left at the top level."""
    from graphflop.passes.step_calls import _Describer

    model, x = _model("stack")
    fwd = analyze(model, x, jvp=False, backward=False).forward
    site = _Describer(fwd, fwd.meta[HIERARCHY]).site
    for optimizer, distribution in (
        ("sgd", "normal"),
        ("momentum", "rademacher"),  # randn, then its sign: two nodes a parameter
        ("adam", "normal"),
        ("adamw", "rademacher"),
    ):
        rec, flat, lin, flat_lin, upd = _steps(fwd, optimizer, distribution=distribution)
        _check_equal(rec, flat, fwd, lin, flat_lin, optimizer)
        dh = rec.meta[DERIVED_HIERARCHY]
        assert dh.graph is rec and not dh.runs
        assert [c.site for c in dh.calls] == [0, 1, 2, 3] * 4
        ts = [dh.templates[c.template] for c in dh.calls]
        jvp = lin.meta[DERIVED_HIERARCHY]
        assert [_ops(t) for t in ts[4:8]] == [_ops(jvp.templates[c.template]) for c in jvp.calls]
        assert all(t not in jvp.templates for t in ts)  # copies: passes write on templates
        u = upd.meta[DERIVED_HIERARCHY]
        assert [_ops(t) for t in ts[12:]] == [_ops(u.templates[c.template]) for c in u.calls]
        assert len({id(t) for t in ts[12:]}) == 1
        for t in ts[:4] + ts[8:12]:
            roles = {x.meta.get(ROLE) for x in t.graph.nodes if x.op == "call_function"}
            assert roles == {"direction"}
        top = [
            n
            for n in rec.graph.nodes
            if n.target is not REPEAT
            and not (n.target is operator.getitem and n.args[0].target is REPEAT)
        ]
        assert [n for n in top if site(n) is not None] == []
        assert len(top) > 10  # the placeholders, the first layer's and the head's work


def _fallback(fwd, optimizer, **kw):
    rec, flat, lin, flat_lin, _ = _steps(fwd, optimizer, **kw)
    assert calls.is_recorded(lin)
    assert not calls.is_recorded(rec)  # built from the JVP's flat view
    assert not any(n.target is REPEAT for n in rec.graph.nodes)
    _check_equal(rec, flat, fwd, lin, flat_lin, optimizer)
    return rec


@pytest.mark.slow  # (moved out of the default suite: its 300 s budget)
def test_falls_back_to_the_flat_step():
    """K > 1 directions (batched and as copies) and directions as inputs: built flat from the
    recorded JVP's flat view, the same graph and figures as from the flat JVP."""
    model, x = _model("gpt2")
    fwd = analyze(model, x, jvp=False, backward=False).forward
    for kw in (
        dict(directions=2),
        dict(directions=3, batched=False),
        dict(direction_inputs=True),
        dict(directions=2, direction_inputs=True),
    ):
        rec = _fallback(fwd, "momentum", **kw)
        assert calls.is_recorded(rec.meta[DERIVED_HIERARCHY].graph) is False


def test_custom_function_entries_fall_back():
    """A JVP whose log holds custom Functions' entries: the step is built flat from its flat
    view."""
    from test_custom_function_grads import CubeStack

    from graphflop.ad.functions import FunctionEntry

    torch.manual_seed(0)
    model = CubeStack().double()
    x = torch.randn(4, 8, dtype=torch.float64)
    fwd = analyze(model, (x,), loss="cross_entropy", jvp=False, backward=False).forward
    _fallback(fwd, "sgd")
    lin = run_passes(fwd, [BuildJvp("params", direct=True)])
    log = lin.meta[DERIVED_HIERARCHY].log
    assert any(isinstance(e, FunctionEntry) for e in log)
    assert not isinstance(log, calls.CallLog) or log.holds(FunctionEntry)  # (_records' read)


def test_analysis_holds_the_flat_view():
    """``analyze`` builds the step from the recorded JVP; ``Analysis.forward_gradient`` (and
    ``flat()``, and the runtime's step graphs) is its flat view, made on the first read, equal
    to the flat analysis's step; the report is the same, the weight-perturbation peak (from
    the flat view) included; with K = 3 directions the analysis falls back to the flat step,
    the same report."""
    from graphflop.runtime.graphs import step_graphs

    model, x = _model("stack")
    for directions in (1, 3):
        rec = analyze(model, x, directions=directions)
        flat = analyze(model, x, directions=directions, record_derivatives=False)
        assert rec.report.to_dict() == flat.report.to_dict()
        peak = rec.report.totals.activity_gradient_step.weight_perturbation_peak_bytes
        assert peak is not None and peak > 0
        fg = rec.forward_gradient
        assert fg is rec.forward_gradient and rec.flat().forward_gradient is fg
        assert not calls.is_recorded(fg)
        assert not any(n.target is REPEAT for n in fg.graph.nodes)
        top = fg.meta[DERIVED_HIERARCHY].graph
        assert calls.is_recorded(top) is (directions == 1)
        assert _rows(fg) == _rows(flat.forward_gradient)
        assert _names(fg) == _names(flat.forward_gradient)
        got = step_graphs(rec, kinds=("forward_gradient_step",), sampling=True)
        assert got["forward_gradient_step"] is fg


def _updates(fwd, optimizer, bwd):
    """The update graph built flat and recorded (``direct=True``), both costed."""
    flat = run_passes(fwd, [AddOptimizerUpdate(optimizer, backward=bwd), AnnotateFlops()])
    add = AddOptimizerUpdate(optimizer, backward=bwd, direct=True)
    return flat, run_passes(fwd, [add, AnnotateFlops()])


@pytest.mark.parametrize(
    "optimizer, states",
    [
        ("adamw", 2),
        pytest.param("sgd", 0, marks=pytest.mark.slow),
        pytest.param("momentum", 1, marks=pytest.mark.slow),
        pytest.param("adam", 2, marks=pytest.mark.slow),
    ],
)
def test_recorded_update_equals_the_flat_update(optimizer, states):
    """The update recorded (``direct=True``: its top level, no flat graph made): per block one
    call with a getitem per new value and new state; its flat view is the flat update node
    for node and name for name, its figures composed per template are the flat sums; the
    step built from it is the step built from the flat update (recorded, from the recorded
    JVP; flat, from the flat JVP), graph for graph. AdamW by default: its update has state
    and a value all calls share (lr·λ)."""
    model, x = _model("stack")
    fwd = analyze(model, x, jvp=False, backward=False).forward
    lin = run_passes(fwd, [BuildJvp("params", direct=True), AnnotateFlops()])
    flat_lin = run_passes(fwd, [BuildJvp("params"), AnnotateFlops()])
    bwd = run_passes(fwd, [BuildVjp(linearized=flat_lin), AnnotateFlops()])
    flat, rec = _updates(fwd, optimizer, bwd)
    assert calls.is_recorded(rec) and not calls.is_recorded(flat)
    # InStack's four blocks, each Linear(6, 10) and Linear(10, 6): four parameters a
    # block, each a new value and `states` new states read after its call
    reps = [n for n in rec.graph.nodes if n.target is REPEAT]
    assert len(reps) == 4
    assert [len(r.users) for r in reps] == [4 * (1 + states)] * 4
    # blocks 1-3 call the update block 0's was built into: each one placeholder for its four
    # parameters, one for their gradients and one per state kind (no node made for the
    # 4·(2 + states)); (2 + states)·3 in all, in the flat graph's order of placeholders
    packs = [n for n in rec.graph.nodes if n.op == "placeholder" and PACKED in n.meta]
    kinds = ["param", "grad", *STATE_KINDS[optimizer]]
    assert [(n.meta[SLOT], len(n.meta[PACKED][0])) for n in packs] == [
        (f"{k}_pack", 4) for k in kinds for _ in range(3)
    ]
    assert not any(n.target is REPEAT for n in flat.graph.nodes)
    view = calls.flat_view(rec)
    assert _rows(view) == _rows(flat)
    assert _names(view) == _names(flat)
    assert _graph_meta(view) == _graph_meta(flat)
    _check_costs(rec)
    keep = lambda n: True  # noqa: E731
    dh = rec.meta[DERIVED_HIERARCHY]
    assert dh.uses() == [4]  # one template update for the four blocks
    assert _figures(calls.derived_figures(dh, keep, "update")) == _flat_figures(
        flat, keep, "update"
    )
    for jvp in (lin, flat_lin):
        steps = [
            run_passes(
                fwd, [BuildForwardGradientStep(optimizer, jvp=jvp, update=u), AnnotateFlops()]
            )
            for u in (rec, flat)
        ]
        assert calls.is_recorded(steps[0]) is (jvp is lin)
        assert _rows(steps[0]) == _rows(steps[1])
        assert _names(steps[0]) == _names(steps[1])
        views = [calls.flat_view(s) for s in steps]
        assert _rows(views[0]) == _rows(views[1])
        assert _names(views[0]) == _names(views[1])


class _SideBlock(torch.nn.Module):
    """Linear(6, 6), ReLU, and a Linear(6, 2) whose output nothing reads: no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(6, 6)
        self.act = torch.nn.ReLU()
        self.side = torch.nn.Linear(6, 2)

    def forward(self, x):
        self.side(x)
        return self.act(self.fc(x))


class _SideStack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_SideBlock() for _ in range(3))
        self.head = torch.nn.Linear(6, 2)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_recorded_update_passes_through_parameters_without_gradient():
    """``analyze`` records the update: a block's parameter the loss does not depend on is
    passed through (``not_updated``, read off the recorded top level's calls), the analysis's
    update graph (its flat view) is the flat analysis's, and the reports are equal."""
    from graphflop.passes.optimizer import not_updated

    torch.manual_seed(0)
    model, x = _SideStack(), torch.randn(4, 6)
    rec = analyze(model, x, optimizer="adam")
    flat = analyze(model, x, optimizer="adam", record_derivatives=False)
    built = rec.as_built().update
    assert calls.is_recorded(built)
    side = {f"blocks.{i}.side.{p}" for i in range(3) for p in ("weight", "bias")}
    assert not_updated(built) == side == not_updated(flat.update)
    assert _rows(rec.update) == _rows(flat.update)
    assert _names(rec.update) == _names(flat.update)
    assert rec.report.to_dict() == flat.report.to_dict()
    # Adam, 18 FLOPs per element updated: per block fc's 6·6 + 6 = 42, the head's 12 + 2 = 14
    assert rec.report.totals.update.flops == 18 * (3 * 42 + 14) == 2520
