"""The analysis of the recorded derivative hierarchies (``direct=True``: each repeated block's
JVP and backward built once per variant, the model's graphs calling them): FLOP and byte
annotation per template derivative, the figures composed from the templates, and
``analyze(record_derivatives=True)``; the flat analysis is the reference for every figure."""

from __future__ import annotations

import operator
from dataclasses import replace

import pytest
import torch
from conftest import node_rows, spec
from torch import nn
from torch.utils.checkpoint import checkpoint

from graphflop.analysis import AnalyzeOptions, analyze
from graphflop.load import load, make_inputs
from graphflop.meta import (
    BACKWARD_KERNELS,
    CALL_SITE,
    COST,
    DERIVED_HIERARCHY,
    KIND,
    MODULE,
    PARAM,
    ROLE,
    SOURCE,
    ZERO_COST,
)
from graphflop.ops import op_name
from graphflop.passes import calls, summary
from graphflop.passes.autodiff import BuildJvp, BuildVjp
from graphflop.passes.flops import (
    AnnotateFlops,
    call_escapes,
    flat_costs,
    sum_costs,
    template_kernel_map,
    total_cost,
)
from graphflop.passes.infra import run_passes
from graphflop.passes.summary import Graphs, summarize

REPEAT = torch.ops.graphflop.repeat.default


class Block(nn.Module):
    def __init__(self, d: int, f: int):
        super().__init__()
        self.fc1 = nn.Linear(d, f)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(f, d)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


class InStack(nn.Module):
    """A layer before four blocks (the backward is recorded: no fold across a call)."""

    def __init__(self, n: int = 4, d: int = 6, f: int = 10):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList(Block(d, f) for _ in range(n))
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class NormBlock(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.n = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc(self.n(x))


class DetachedStack(nn.Module):
    """Four blocks, the third's output detached (``cut``), or each block's output added
    detached to its input (``"each"``): some calls' output tangents read by nothing. The
    recorded JVP's whole log kept the getitem its recorder erased for one (a KeyError making
    its flat view)."""

    def __init__(self, cut: int | str = 2):
        super().__init__()
        self.blocks = nn.ModuleList(NormBlock() for _ in range(4))
        self.cut = cut

    def forward(self, x):
        for i, b in enumerate(self.blocks):
            if self.cut == "each":
                x = x + b(x).detach()
                continue
            x = b(x)
            if i == self.cut:
                x = x.detach()
        return x


class CheckpointedStack(nn.Module):
    """Three residual blocks under ``torch.utils.checkpoint``: the backward falls back to the
    flat graph (its hierarchy read off it), the JVP is recorded."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block(8, 16) for _ in range(3))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        for b in self.blocks:
            x = x + checkpoint(b, x, use_reentrant=False)
        return self.head(x)


_GPT2_3 = dict(n_layer=3, n_embd=32, n_head=2, vocab_size=50)


def _loaded(s: str, **ctor):
    loaded = load(s, ctor_kwargs=ctor, meta=True) if ctor else load(s, meta=True)
    loaded.model.train()
    return loaded.model, make_inputs(loaded, batch=2)


def _model(which: str):
    if which == "stack":
        torch.manual_seed(0)
        return InStack(), torch.randn(5, 6)
    if which == "checkpointed":
        torch.manual_seed(0)
        return CheckpointedStack(), torch.randn(4, 8)
    if which == "gpt2":
        return _loaded(spec("gpt2.py"), **_GPT2_3)
    if which == "llama":
        cfg = dict(
            num_hidden_layers=3,
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=50,
        )
        loaded = load("hf:llama-3.1-8b", ctor_kwargs=cfg, meta=True, seq=8)
        loaded.model.train()
        return loaded.model, make_inputs(loaded, batch=2)
    if which == "t5":  # where a copy of a forward node must be named after it (relu_2, ...)
        cfg = dict(num_layers=3, num_decoder_layers=3, d_model=32, d_ff=64, num_heads=2, d_kv=16)
        return _loaded("hf:t5", vocab_size=50, **cfg)
    return _loaded(spec(which) if ".py" in which else which)


def _figures(f):
    return (f.total, f.by_role, list(f.rows.items()), list(f.ops.items()), f.rule_less)


def _flat_figures(gm, keep, role):
    """Node by node over the flat graph ``gm`` (a hierarchy without calls)."""
    return _figures(calls.derived_figures(calls.DerivedHierarchy((), (), gm), keep, role))


def _annotated(fwd):
    """(recorded JVP, recorded backward transposed from it), both through ``AnnotateFlops``,
    and the ones built flat (``analyze(record_derivatives=False)``)."""
    jvp = run_passes(fwd, [BuildJvp("params", direct=True), AnnotateFlops()])
    bwd = run_passes(fwd, [BuildVjp(linearized=jvp, direct=True), AnnotateFlops()])
    flat_jvp = run_passes(fwd, [BuildJvp("params"), AnnotateFlops()])
    flat_bwd = run_passes(fwd, [BuildVjp(linearized=flat_jvp), AnnotateFlops()])
    return (jvp, flat_jvp), (bwd, flat_bwd)


def _check_costs(top):
    """Every template node's cost is its op's rule's (a composite op's parts with its one
    kernel's bytes, a composite op's backward nodes with its one backward kernel's, as its
    first call's: ``flat_costs``); a call node costs its template's nodes summed, its
    getitems nothing."""
    dh = top.meta[DERIVED_HIERARCHY]
    alone: dict = {}  # template -> its nodes' costs, as its first call's
    for n in top.graph.nodes:
        if n.target is REPEAT:
            c = dh.calls[n.args[1]]
            t = dh.templates[c.template]
            if t not in alone:
                kernels = template_kernel_map(top.meta.get(BACKWARD_KERNELS), c.sources)
                alone[t] = flat_costs(t.graph.nodes, kernels, call_escapes(t, n))
                for x in t.graph.nodes:
                    assert x.meta[COST] == alone[t][x], x.name
            assert n.meta[COST] == sum_costs(
                alone[t][x] for x in t.graph.nodes if x.op == "call_function"
            )
        elif n.target is operator.getitem and n.args[0].target is REPEAT:
            assert n.meta[COST] == ZERO_COST


@pytest.mark.parametrize("which", ["stack", "gpt2", "resnet.py:resnet18"])
def test_recorded_graphs_costed_per_template_sum_as_flat(which):
    model, x = _model(which)
    fwd = analyze(model, x, jvp=False, backward=False).forward
    jvp_pair, bwd_pair = _annotated(fwd)
    for (top, flat), keep, role in (
        (jvp_pair, lambda n: n.meta.get(KIND) in ("tangent", "coef"), "tangent_from_input"),
        (bwd_pair, lambda n: True, "grad_input"),
    ):
        assert calls.is_recorded(top), which  # recorded, not fallen back to the flat graph
        assert not calls.is_recorded(flat)
        _check_costs(top)
        # totals, FLOPs by role, per-module rows and op table (each in order), rule-less count
        got = _figures(calls.derived_figures(top.meta[DERIVED_HIERARCHY], keep, role))
        assert got == _flat_figures(flat, keep, role)
        # a node-by-node sum over the top level is the flat graph's total
        assert total_cost(top.graph.nodes) == total_cost(flat.graph.nodes)
        # the top level is smaller than the flat graph: each call one node and its getitems
        assert len(top.graph.nodes) < len(flat.graph.nodes)


def _rows(gm):
    keys = (MODULE, ROLE, KIND, SOURCE, PARAM, CALL_SITE, COST)
    return node_rows(gm, lambda n: tuple(n.meta.get(k) for k in keys))


@pytest.mark.parametrize("which", ["stack", "gpt2", "t5"])
def test_flat_view_is_the_flat_graph_with_costs(which):
    """The flat view of a costed recorded graph equals the graph built flat node for node
    (annotations and costs included), keeps its hierarchy with one run per call, and is made
    once."""
    model, x = _model(which)
    fwd = analyze(model, x, jvp=False, backward=False).forward
    for top, flat in _annotated(fwd):
        view = calls.flat_view(top)
        assert view is not top and calls.flat_view(top) is view
        assert calls.flat_view(flat) is flat
        assert _rows(view) == _rows(flat)
        assert _names(view) == _names(flat)  # every node named as built flat
        dh = view.meta[DERIVED_HIERARCHY]
        assert dh.graph is top and len(dh.runs) == len(dh.calls)
        want = flat.meta[DERIVED_HIERARCHY]
        assert [len(r) for r in dh.runs] == [len(r) for r in want.runs]
        assert [c.site for c in dh.calls] == [c.site for c in want.calls]
        # a copy of a forward node (not a getitem, which fx numbers) is named after it, as in
        # the graph built flat (the eager memory schedules pair a forward node with its
        # tangents by that name)
        primal = [n for n in view.graph.nodes if _named_copy(n)]
        assert [n.name for n in primal] == [n.name for n in flat.graph.nodes if _named_copy(n)]
        assert all(n.name == n.meta[SOURCE] for n in primal)


def _named_copy(n):
    return (
        n.op == "call_function"
        and n.target is not operator.getitem
        and n.meta.get(KIND) == "primal"
    )


def test_rule_less_nodes_of_the_calls_listed_as_flat(monkeypatch):
    """With ``mm`` and ``relu`` made rule-less, the nodes listed without making the flat graph
    are the flat graph's rule-less nodes in its order, with their forward sources and modules;
    the summary's uncounted table and completeness agree."""
    model, x = _model("stack")
    fwd = analyze(model, x, jvp=False, backward=False).forward
    (jvp, flat_jvp), (bwd, flat_bwd) = _annotated(fwd)
    ruleless = {torch.ops.aten.mm.default, torch.ops.aten.relu.default}
    has_rule = calls.has_rule
    for top in (jvp, bwd):  # every op has a rule: the composed figures say so (no list made)
        assert calls.derived_figures(top.meta[DERIVED_HIERARCHY]).ruled is True

    def fake(op):
        return op not in ruleless and has_rule(op)

    monkeypatch.setattr(calls, "has_rule", fake)
    monkeypatch.setattr(summary, "has_rule", fake)
    for top, flat in ((jvp, flat_jvp), (bwd, flat_bwd)):
        got = [(op_name(n.target), s, m) for n, s, m in calls.rule_less_calls(top)]
        want = [
            (op_name(n.target), n.meta.get(SOURCE), n.meta.get(MODULE, ""))
            for n in flat.graph.nodes
            if n.op == "call_function" and n.target in ruleless
        ]
        assert got == want and len(want) > 4  # in every block and outside them
        assert calls.derived_figures(top.meta[DERIVED_HIERARCHY]).ruled is False
    upd = analyze(model, x).update
    g = Graphs(fwd, bwd, upd, jvp)
    flat_g = Graphs(fwd, flat_bwd, upd, flat_jvp)
    kw = dict(name="stack", optimizer="sgd", tangents="params")
    r, flat_r = summarize(g, **kw), summarize(flat_g, **kw, hierarchical=False)
    assert r.uncounted == flat_r.uncounted and r.uncounted
    assert not r.totals.backward.complete and not r.totals.jvp.complete
    assert r.to_dict() == flat_r.to_dict()


def _graphs_equal(a, b):
    """The graphs of two analyses node for node, names included (the renders, ONNX node
    names and JSON read them)."""
    for k in ("forward", "backward", "jvp", "update", "forward_gradient", "activity_gradient"):
        ga, gb = getattr(a, k), getattr(b, k)
        assert (ga is None) == (gb is None), k
        if ga is not None:
            assert _rows(ga) == _rows(gb), k
            assert _names(ga) == _names(gb), k


def _names(gm):
    return [n.name for n in gm.graph.nodes]


#: the models tests/test_hierarchy.py runs by default, the block stacks and a 3-layer Llama
QUICK = [
    "stack",
    "checkpointed",
    "gpt2",
    "llama",
    "t5",
    "mlp.py",
    "cnn.py",
    "convnet.py",
    "lora.py",
    "vit.py",
    "resnet.py:resnet18",
    "torchvision:resnet18",
    "torchvision:mobilenet_v3_small",
]
SLOW = [
    "deeper_convnet.py",
    "resnet.py:resnet50",
    "gpt2.py:gpt2_small",
    "torchvision:swin_t",
    "torchvision:vit_b_16",
    "hf:gpt2",
    "hf:bert",
    "hf:t5",
    "hf:mistral",
    "hf:qwen2",
    "hf:gemma",
]


@pytest.mark.parametrize("cut", [0, 2, "each"])
@pytest.mark.parametrize("tangents", ["params", "all"])
def test_detached_block_outputs_recorded_as_flat(cut, tangents):
    """A stack whose block outputs are detached (their tangents read by nothing): the same
    report and flat graphs, names included, with the derivatives recorded as built flat."""
    torch.manual_seed(0)
    model, x = DetachedStack(cut), torch.randn(4, 8)
    flat = analyze(model, x, tangents=tangents, record_derivatives=False)
    rec = analyze(model, x, tangents=tangents)
    assert rec.report.to_dict() == flat.report.to_dict()
    _graphs_equal(rec, flat)


@pytest.mark.slow  # (the default suite's 5 minutes: run in CI's slow pass)
@pytest.mark.parametrize("which", QUICK)
def test_analyze_with_recorded_derivatives_equals_flat(which):
    """``analyze(record_derivatives=True)`` (the default) gives the report of the analysis
    that builds the derivative graphs flat (totals by role, per-module rows in order, memory
    peaks, op tables) and its flat graphs node for node, names included; the report summed
    node by node over the flat views is the same too."""
    model, x = _model(which)
    assert AnalyzeOptions().record_derivatives
    for optimizer in ("sgd", "adam"):
        flat = analyze(model, x, optimizer=optimizer, record_derivatives=False)
        rec = analyze(model, x, optimizer=optimizer, record_derivatives=True)
        assert rec.report.to_dict() == flat.report.to_dict(), (which, optimizer)
        assert list(rec.report.to_dict()["layers"]) == list(flat.report.to_dict()["layers"])
        _graphs_equal(rec, flat)
        if which in ("stack", "gpt2", "llama", "resnet.py:resnet18"):  # repeated blocks
            for gm in (rec.backward, rec.jvp):
                assert calls.is_recorded(gm.meta[DERIVED_HIERARCHY].graph)
        if which == "checkpointed":  # the backward built flat, the JVP recorded
            assert not calls.is_recorded(rec.backward.meta[DERIVED_HIERARCHY].graph)
            assert calls.is_recorded(rec.jvp.meta[DERIVED_HIERARCHY].graph)
        g = Graphs(rec.forward, rec.backward, rec.update, rec.jvp, rec.forward_gradient)
        kw = dict(name=which, optimizer=optimizer, tangents="params")
        by_node = summarize(g, **kw, hierarchical=False).to_dict()
        assert by_node == summarize(g, **kw).to_dict()


@pytest.mark.slow
@pytest.mark.parametrize("which", SLOW)
def test_large_models_analyzed_with_recorded_derivatives_equal_flat(which):
    test_analyze_with_recorded_derivatives_equals_flat(which)


@pytest.mark.slow  # (the default suite's 5 minutes: run in CI's slow pass)
def test_recorded_derivatives_with_what_ifs_and_other_options():
    """The what-ifs and the other memory model read the flat views: the same report."""
    model, x = _model("gpt2")
    for opts in (
        dict(checkpoint="h.*", amp="bf16", recompute="attention", device="cuda"),
        dict(memory_model="graph", tangents="all", directions=2),
        dict(keep_grads=True, optimizer="adamw"),
    ):
        flat = analyze(model, x, **opts, record_derivatives=False)
        rec = analyze(model, x, **opts, record_derivatives=True)
        assert rec.report.to_dict() == flat.report.to_dict(), opts
        _graphs_equal(rec, flat)


def test_analysis_keeps_graphs_as_built_and_reads_them_flat():
    """``Analysis`` holds the recorded top levels (``as_built``) and gives their flat views on
    read, made once: the flat build's graphs name for name; built flat, both are the one
    graph."""
    model, x = _model("stack")
    rec = analyze(model, x)
    flat = analyze(model, x, record_derivatives=False)
    built = rec.as_built()
    for k in ("backward", "jvp", "update", "forward_gradient"):
        top = getattr(built, k)
        assert calls.is_recorded(top), k
        # analyze itself expanded neither derivative graph (the summary read them recorded;
        # the step's peak, of a model with an activity-perturbed step as this one, reads its
        # flat view, and that step inlines the update's)
        assert (calls._FLAT_VIEW in vars(top)) == (k in ("update", "forward_gradient")), k
        assert any(n.target is REPEAT for n in top.graph.nodes), k
        view = getattr(rec, k)
        assert not calls.is_recorded(view) and view is getattr(rec, k), k
        assert view is calls.flat_view(top), k
        assert _names(view) == _names(getattr(flat, k)), k
        assert getattr(flat.as_built(), k) is getattr(flat, k), k
    assert built.forward is rec.forward
    # the fields take graphs as dataclass fields do (replace, the constructor's default)
    assert replace(rec, jvp=None).jvp is None and replace(rec, jvp=None).backward is rec.backward
    assert type(rec)("m", rec.forward, rec.report).backward is None
    _kept_compactly(rec)


def test_built_top_levels_keep_only_their_own_names():
    """Once built, a recorded top level's fx namespace holds its own nodes' names, neither the
    names it took for its calls' flat copies nor the nodes erased from it
    (``calls.release_names``: a 2 MiB set of Llama-3.1-405B's JVP); the flat views' names
    are held equal to the flat build's by test_detached_block_outputs_recorded_as_flat."""
    model, x = _model("stack")
    rec = analyze(model, x)
    for k in ("backward", "jvp", "update", "forward_gradient"):
        top = getattr(rec.as_built(), k)
        assert calls.is_recorded(top), k
        ns = top.graph._graph_namespace
        assert ns._used_names == set(_names(top)), k
        assert set(ns._obj_to_name) == set(top.graph.nodes), k


def test_analysis_graphs_freed_with_the_analysis():
    """Nothing graphflop keeps outlives an analysis: its graphs, the recorded top levels and
    their flat views, and the fake mode its shape cache was kept for are freed with it. The
    flat views' and shape caches' tables kept every one of them for good (a sweep's memory
    grew with each analysis) because each value named its key."""
    import gc
    import weakref

    from graphflop.meta import graph_fake_mode

    model, x = _model("stack")
    a = analyze(model, x)
    built = a.as_built()
    refs = [weakref.ref(g) for g in (a.forward, built.backward, built.jvp, a.backward, a.jvp)]
    refs.append(weakref.ref(graph_fake_mode(a.forward)))
    assert all(r() is not None for r in refs)
    del a, built
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)


def _kept_compactly(a) -> None:
    """What analysis ``a`` (of ``_model("stack")``) keeps per block, each object of which the
    collector's pass after ``analyze`` visits (docs/analysis_scale.md): the placeholders of its
    graphs hold one shared empty keyword mapping, not one each; the recorded JVP's whole log
    holds each expanded call's entries as one, and reads as the flat log of ``(repeat node,
    position)`` pairs."""
    from graphflop.ad.builder import NO_KWARGS

    built = a.as_built()
    graphs = (a.forward, built.backward, built.update, built.jvp, built.forward_gradient)
    phs = [n for g in graphs for n in g.graph.nodes if n.op == "placeholder"]
    # 4 blocks of 2 Linear layers plus 2 Linear layers: 20 parameters, each a placeholder of
    # the forward, the update (and its gradient), the JVP (and its tangent), ...
    assert len(phs) > 5 * 20
    assert {id(n.kwargs) for n in phs} == {id(NO_KWARGS)}
    dh = built.jvp.meta[DERIVED_HIERARCHY]
    log = dh.log
    assert isinstance(log, calls.CallLog)
    # 4 calls of one template: those recorded in place are logged as one (repeat node,
    # position) pair per node logged; each other call is one run of the same positions
    runs = [p for p in log._parts if type(p) is calls._Run]
    pairs = [p for p in log._parts if isinstance(p, tuple)]
    in_place = list(dict.fromkeys(rep for rep, _ in pairs))
    assert len(dh.calls) == 4 and runs and len(in_place) + len(runs) == 4
    k = len(runs[0].positions)
    for rep in in_place:
        assert [i for r, i in pairs if r is rep] == list(runs[0].positions)
    assert all(list(r.positions) == list(runs[0].positions) for r in runs)
    others = [p for p in log._parts if not isinstance(p, (tuple, calls._Run))]
    assert len(log) == len(others) + 4 * k and len(log._parts) < len(log)
    expanded = []
    for p in log._parts:
        expanded += [(p.rep, i) for i in p.positions] if type(p) is calls._Run else [p]
    assert list(log) == expanded and log == tuple(expanded) and log[len(log) - 1] == expanded[-1]
    assert list(reversed(log)) == expanded[::-1]
    # holds (read a part at a time, a run's pairs not made) says what reading every entry says
    classes = {type(p) for p in others} | {dict, calls._Run}
    assert len(classes) > 2  # (an entry's class among them)
    for cls in classes:
        assert log.holds(cls) == any(isinstance(e, cls) for e in expanded)


def test_record_derivatives_is_checked():
    model, x = _model("stack")
    with pytest.raises(TypeError, match="record_derivatives"):
        analyze(model, x, record_derivatives="yes")


def test_recorded_analysis_graphs_run_on_real_tensors():
    """The graphs ``Analysis`` holds under ``record_derivatives`` are the flat views: verify
    runs them on real tensors (gradients against ``torch.func``, the loss tangent against
    ``torch.func.jvp``), the train step builds from them, and they keep the recorded top
    levels in their hierarchies."""
    from graphflop.runtime.verify import verify_gradients
    from graphflop.runtime.verify_tangent import verify_jvp

    model, x = _model("stack")
    a = analyze(model, x, record_derivatives=True)
    for gm in (a.backward, a.jvp):
        assert not calls.is_recorded(gm)
        assert calls.is_recorded(gm.meta[DERIVED_HIERARCHY].graph)
        assert not any(n.target is REPEAT for n in gm.graph.nodes)
    assert verify_gradients(a.forward, a.backward, model, tolerance=1e-5).ok
    assert verify_jvp(a.forward, a.jvp, model, examples=(x,)).ok
    flat = analyze(model, x, record_derivatives=False)
    assert _rows(a.train_step) == _rows(flat.train_step)


def test_llama_layers_jvp_expanded_despite_an_unread_argument(monkeypatch):
    """A Llama decoder layer's template has a placeholder no node reads (the position ids):
    the JVP still expands the layers after each variant's first (without the fix every layer
    ran the rules: 3 built, 0 expanded), and the graph is the one the rules give."""
    from graphflop.ad import blocks

    model, x = _model("llama")
    fwd = analyze(model, x, jvp=False, backward=False).forward
    made = []
    of = blocks.BlockLinearize.of

    def spy(forward, lin):
        got = of(forward, lin)
        made.append(got)
        return got

    monkeypatch.setattr(blocks.BlockLinearize, "of", spy)
    per_template = run_passes(fwd, [BuildJvp("params"), AnnotateFlops()])
    (expander,) = made
    assert expander.expanded >= 1 and expander.built + expander.expanded == 3
    monkeypatch.setattr(blocks.BlockLinearize, "of", of)
    by_rules = run_passes(fwd, [BuildJvp("params", per_template=False), AnnotateFlops()])
    assert _rows(per_template) == _rows(by_rules)
    names = [n.name for n in per_template.graph.nodes]
    assert names == [n.name for n in by_rules.graph.nodes]


def test_custom_functions_in_blocks_recorded():
    """Blocks that each call a custom Function (its own jvp and backward): the recorded JVP's
    flat graph has the Function's log entry read its own nodes (it read the recorded top
    level's, and the backward transposed from it lost block 0's weight gradient), the backward
    is transposed from the recorded JVP's repeat nodes (the Function's entry reading the nodes
    that stand for the calls' values: it read the first calls' erased nodes, found no
    cotangent, and the rules then made an empty call), and ``analyze`` both ways gives the
    same report and graphs, names included (``tests/test_custom_function_grads.py``: more
    such blocks, and their gradients)."""
    from test_custom_function_grads import CubeStack

    from graphflop.ad.functions import FunctionEntry
    from graphflop.meta import JVP_LOG, LINEARIZED

    torch.manual_seed(0)
    model = CubeStack().double()
    x = torch.randn(4, 8, dtype=torch.float64)
    flat = analyze(model, (x,), loss="cross_entropy", record_derivatives=False)
    rec = analyze(model, (x,), loss="cross_entropy", record_derivatives=True)
    assert rec.report.to_dict() == flat.report.to_dict()
    _graphs_equal(rec, flat)
    assert calls.is_recorded(rec.jvp.meta[DERIVED_HIERARCHY].graph)
    built = rec.as_built()
    assert built.backward.meta[LINEARIZED] is built.jvp  # read from its repeat nodes
    entries = [e for e in rec.jvp.meta[JVP_LOG] if isinstance(e, FunctionEntry)]
    assert len(entries) == 3
    nodes = set(rec.jvp.graph.nodes)
    for e in entries:
        refs = [
            v for v in (*e.inputs, *e.outputs, *e.saved.values()) if isinstance(v, torch.fx.Node)
        ]
        assert refs and all(v in nodes for v in refs)


def test_loop_moe_recorded():
    """Experts run in a loop over a ``where`` (``tests/test_moe_loop.py``): where the top level
    reads no getitem of a call's logged node, the cotangent arriving at it is held by the node
    standing for it, which the transpose of the recorded JVP now reads (it read none there and
    built the next expert's backward without it: 37,888 backward mm FLOPs for 50,176). Both
    ways the same report, the hand count, and the same graphs, names included."""
    from test_moe_loop import D, LoopMoE

    torch.manual_seed(0)
    model, x = LoopMoE(), torch.randn(8, D)
    flat = analyze(model, (x,), record_derivatives=False)
    rec = analyze(model, (x,), record_derivatives=True)
    assert rec.report.totals.backward.mm_flops == 50_176
    assert rec.report.to_dict() == flat.report.to_dict()
    _graphs_equal(rec, flat)
    assert calls.is_recorded(rec.jvp.meta[DERIVED_HIERARCHY].graph)
