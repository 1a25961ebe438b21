"""The optimizer update graph and the forward-gradient step graph keep a repeated block's work
as calls of one template per block variant (:mod:`graphflop.passes.step_calls`): the flat
graph rebuilt from the hierarchy alone is the built one node for node, and the figures
composed per template (totals by role, per-module rows, op table, rule-less count) are the
flat graph's sums; for SGD, momentum, Adam and AdamW, one and several directions, on the
models ``tests/test_hierarchy.py`` runs (the large ones marked slow)."""

from __future__ import annotations

import pytest
import torch
from conftest import spec
from test_hierarchy import Stack, _flat_sums, _stored_nodes

from graphflop.analysis import analyze
from graphflop.frontend.trace import trace
from graphflop.load import load, make_inputs
from graphflop.meta import CALL_SITE, COST, DERIVED_HIERARCHY, HIERARCHY, PARAM, SOURCE
from graphflop.passes import calls
from graphflop.passes.autodiff import BuildJvp, BuildVjp
from graphflop.passes.flops import AnnotateFlops
from graphflop.passes.forward_gradient import BuildForwardGradientStep
from graphflop.passes.infra import run_passes
from graphflop.passes.optimizer import OPTIMIZERS, AddOptimizerUpdate, for_every_parameter
from graphflop.passes.summary import Graphs, summarize


def _check_graph(gm, h, default_role):
    """``gm``'s stored hierarchy rebuilds it node for node and composes its flat sums."""
    dh = gm.meta.get(DERIVED_HIERARCHY)
    if h is None:
        assert dh is None
        return None
    assert dh is not None
    assert sum(dh.uses()) == len(dh.calls) and len(dh.templates) <= len(dh.calls)
    if max(dh.uses()) > 1:  # a template called twice: fewer nodes at the top level
        assert len(dh.graph.graph.nodes) < len(gm.graph.nodes)
    assert _stored_nodes(calls.expand(dh)) == _stored_nodes(gm)
    f = calls.derived_figures(dh, lambda n: True, default_role)
    total, by_role, rows, ops, rule_less = _flat_sums(gm, lambda n: True, default_role)
    assert f.total == total
    assert f.by_role == by_role
    assert f.rows == rows and list(f.rows) == list(rows)
    assert f.ops == ops and list(f.ops) == list(ops)
    assert f.rule_less == rule_less
    return dh


def _check_model(model, inputs, *, directions=(1, 3), optimizers=OPTIMIZERS):
    """Trace once; per optimizer the update graph, per direction count the step graph."""
    fwd = run_passes(trace(model, inputs, loss="auto"), [AnnotateFlops()])
    h = fwd.meta.get(HIERARCHY)
    jvp = run_passes(fwd, [BuildJvp("params"), AnnotateFlops()])
    bwd = run_passes(fwd, [BuildVjp(linearized=jvp), AnnotateFlops()])
    for opt in optimizers:
        upd = run_passes(fwd, [AddOptimizerUpdate(opt, backward=bwd), AnnotateFlops()])
        _check_graph(upd, h, "update")
        for k in directions:
            step = BuildForwardGradientStep(
                opt, directions=k, jvp=jvp, update=for_every_parameter(upd)
            )
            fg = run_passes(fwd, [step, AnnotateFlops()])
            _check_graph(fg, h, "forward")
    return h


def test_stack_update_and_step_per_template_hand_counted():
    # four blocks of Linear(6, 10), ReLU, Linear(10, 6): 60 + 10 + 60 + 6 = 136 parameters a
    # block, and the head Linear(6, 3): 21
    n, d, f = 4, 6, 10
    a = analyze(Stack(n, d, f), torch.randn(5, d), optimizer="adam")
    upd = a.update.meta[DERIVED_HIERARCHY]
    # one template update for the four blocks (the update does not depend on the block's input)
    assert upd.uses() == [n]
    assert [c.site for c in upd.calls] == [0, 1, 2, 3]
    # Adam: 18 FLOPs per parameter element, 4·136 + 21 = 565 elements
    fig = calls.derived_figures(upd, default_role="update")
    assert fig.total.flops == 18 * (n * 136 + 21) == 10170
    assert fig.rows["blocks.2.fc1"][0] == 18 * (60 + 10)
    # the template holds one block's four parameters' updates, named by their path in it
    t = upd.templates[0]
    params = {x.meta.get(PARAM) for x in t.graph.nodes} - {None}
    assert params == {"@.fc1.weight", "@.fc1.bias", "@.fc2.weight", "@.fc2.bias"}
    # sources by their place in the block: the four parameters' update inputs
    assert upd.calls[1].sources == tuple(
        f"param_blocks_1_{m}_{w}" for m in ("fc1", "fc2") for w in ("weight", "bias")
    )
    assert {x.meta[SOURCE] for x in t.graph.nodes if x.op == "call_function"} == {
        "@0",
        "@1",
        "@2",
        "@3",
    }
    step = a.forward_gradient.meta[DERIVED_HIERARCHY]
    # the step's runs per block: the sampled directions, the tangent work (block 0 reads the
    # model's input: a template of its own), the estimates d·v, the update
    assert [c.site for c in step.calls] == [0, 1, 2, 3] * 4
    assert sorted(step.uses()) == [1, 3, 4, 4, 4]
    _check_graph(a.update, a.forward.meta[HIERARCHY], "update")
    _check_graph(a.forward_gradient, a.forward.meta[HIERARCHY], "forward")
    # the report composed per template equals the one summed node by node
    g = Graphs(a.forward, a.backward, a.update, a.jvp, a.forward_gradient, a.activity_gradient)
    flat = summarize(
        g, name=a.report.model, optimizer="adam", tangents="params", hierarchical=False
    )
    assert flat.to_dict() == a.report.to_dict()
    assert a.report.totals.update.flops == 10170


def test_stack_every_optimizer_and_direction_count():
    assert _check_model(Stack(), (torch.randn(5, 6),), directions=(1, 2, 3)) is not None


def test_step_without_batching_and_with_direction_inputs():
    model, x = Stack(), torch.randn(5, 6)
    fwd = run_passes(trace(model, (x,), loss="auto"), [AnnotateFlops()])
    h = fwd.meta[HIERARCHY]
    jvp = run_passes(fwd, [BuildJvp("params"), AnnotateFlops()])
    for kw in ({"batched": False}, {"direction_inputs": True}):
        step = BuildForwardGradientStep("momentum", directions=2, jvp=jvp, **kw)
        fg = run_passes(fwd, [step, AnnotateFlops()])
        dh = _check_graph(fg, h, "forward")
        assert max(dh.uses()) > 1


def test_no_hierarchy_no_calls():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    assert _check_model(model, (torch.randn(2, 4),), directions=(1,), optimizers=("sgd",)) is None


def _model(name, **ctor):
    loaded = load(spec(name), ctor_kwargs=ctor, meta=True)
    loaded.model.train()
    return loaded.model, make_inputs(loaded, batch=2)


def test_gpt2_three_blocks():
    model, inputs = _model("gpt2.py", n_layer=3, n_embd=32, n_head=2, vocab_size=50)
    assert _check_model(model, inputs) is not None


@pytest.mark.parametrize("name", ["resnet.py:resnet18"])
def test_models(name):
    model, inputs = _model(name)
    _check_model(model, inputs, directions=(1, 2), optimizers=("sgd", "adamw"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["vit.py", "resnet.py:resnet50", "gpt2.py:gpt2_small", "deeper_convnet.py"]
)
def test_large_models(name):
    model, inputs = _model(name)
    _check_model(model, inputs, directions=(1, 2), optimizers=("momentum", "adam"))


@pytest.mark.slow
@pytest.mark.parametrize("s", ["torchvision:resnet18"])
def test_zoo(s):
    loaded = load(s, meta=True)
    loaded.model.train()
    _check_model(loaded.model, make_inputs(loaded, batch=2), directions=(1, 2))


@pytest.mark.slow
@pytest.mark.parametrize("s", ["torchvision:swin_t", "hf:gpt2", "hf:bert", "hf:mistral"])
def test_zoo_large(s):
    loaded = load(s, meta=True)
    loaded.model.train()
    _check_model(
        loaded.model, make_inputs(loaded, batch=2), directions=(1, 2), optimizers=("adamw",)
    )


def test_costs_from_templates_equal_each_nodes_own():
    """``annotate_flops`` gives each call's nodes their template node's cost: the cost each
    node has on its own (its rule's; a composite op's parts with its one kernel's bytes)."""
    from graphflop.passes.flops import flat_costs

    a = analyze(Stack(), torch.randn(5, 6), optimizer="adamw")
    for gm in (a.update, a.forward_gradient):
        alone = flat_costs(gm.graph.nodes)
        for n in gm.graph.nodes:
            if n.op == "call_function":
                assert n.meta[COST] == alone[n], n.name


def _names_and_rows(gm):
    return [n.name for n in gm.graph.nodes], _stored_nodes(gm)


def _update_both_ways(fwd, opt, no_gradient=frozenset()):
    """The update graph built per block variant (its other calls copied) and op by op."""
    from graphflop.meta import SIGNATURE
    from graphflop.passes.optimizer import build_update
    from graphflop.passes.step_calls import BlockParams

    phs = {n.name: n for n in fwd.graph.nodes if n.op == "placeholder"}
    trainable = fwd.meta[SIGNATURE].trainable()
    params = [(q, phs[p].meta["val"]) for p, q in trainable]
    modules = {q: q.rpartition(".")[0] for _, q in trainable}
    kw = dict(modules=modules, no_gradient=no_gradient)
    per = build_update(params, opt, blocks=BlockParams(fwd), **kw)
    flat = build_update(params, opt, **kw)
    return per, flat


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_update_built_per_template_equals_op_by_op(opt):
    fwd = trace(Stack(), (torch.randn(5, 6),), loss="auto")
    h = fwd.meta[HIERARCHY]
    for no_gradient in (frozenset(), frozenset({"blocks.1.fc1.bias", "head.weight"})):
        per, flat = _update_both_ways(fwd, opt, no_gradient)
        # the same graph node for node, names included
        assert _names_and_rows(per) == _names_and_rows(flat)
        assert DERIVED_HIERARCHY not in flat.meta
        run_passes(per, [AnnotateFlops()])
        dh = _check_graph(per, h, "update")
        # blocks 0, 2, 3 call one template; block 1 (a parameter without gradient) its own
        assert dh.uses() == ([4] if not no_gradient else [3, 1])
        assert [c.site for c in dh.calls] == [0, 1, 2, 3]


def test_gpt2_update_built_per_template_equals_op_by_op():
    model, inputs = _model("gpt2.py", n_layer=3, n_embd=32, n_head=2, vocab_size=50)
    fwd = trace(model, inputs, loss="auto")
    per, flat = _update_both_ways(fwd, "adamw")
    assert _names_and_rows(per) == _names_and_rows(flat)
    assert per.meta[DERIVED_HIERARCHY].uses() == [3]


def test_step_takes_the_jvp_and_update_calls_as_built(monkeypatch):
    """With one direction the step copies the JVP graph's and the update graph's calls: they
    are taken as they are (the templates the same ops); the sampled directions and the
    estimates d·v are built and described at the first block only (one variant each), and
    emitted as calls of that template at the other three, without building them."""
    from graphflop.passes import step_calls

    described = []
    real = step_calls._Describer.describe

    def spy(self, run, s):
        described.append(s)
        return real(self, run, s)

    monkeypatch.setattr(step_calls._Describer, "describe", spy)
    a = analyze(Stack(), torch.randn(5, 6), optimizer="momentum")
    assert described == [0, 0]  # the directions' first run, then the estimates'
    step = a.forward_gradient.meta[DERIVED_HIERARCHY]

    def ops(t):
        return [x.target for x in t.graph.nodes if x.op == "call_function"]

    jvp = a.jvp.meta[DERIVED_HIERARCHY]
    upd = a.update.meta[DERIVED_HIERARCHY]
    step_ops = [ops(step.templates[c.template]) for c in step.calls]
    for dh in (jvp, upd):
        for c in dh.calls:
            assert ops(dh.templates[c.template]) in step_ops
    _check_graph(a.forward_gradient, a.forward.meta[HIERARCHY], "forward")


class _Norm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 6)
        self.LayerNorm = torch.nn.LayerNorm(6)  # fx spells its placeholders layer_norm

    def forward(self, x):
        return x + torch.relu(self.LayerNorm(self.fc(x)))


class _NormStack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Norm() for _ in range(3))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_parameter_names_fx_spells_otherwise():
    """A parameter whose name fx rewrites for its placeholder (``LayerNorm`` → ``layer_norm``):
    each call's update nodes keep their own parameter's source."""
    fwd = trace(_NormStack(), (torch.randn(4, 6),), loss="auto")
    per, flat = _update_both_ways(fwd, "momentum")
    assert _names_and_rows(per) == _names_and_rows(flat)
    run_passes(per, [AnnotateFlops()])
    dh = _check_graph(per, fwd.meta[HIERARCHY], "update")
    assert dh.uses() == [3]
    assert _check_model(_NormStack(), (torch.randn(4, 6),), directions=(1, 2)) is not None


@pytest.mark.parametrize(
    ("qual", "expected"),
    [
        ("h.0.attn.c_attn.weight", "grad_h_0_attn_c_attn_weight"),
        ("0.weight", "grad_0_weight"),  # a leading digit (nn.Sequential)
        ("trunk_output.block1-0.proj.weight", "grad_trunk_output_block1_0_proj_weight"),  # RegNet
        ("a b.c", "grad_a_b_c"),
        ("é.w", "grad_é_w"),  # a non-ASCII letter is a word character: kept
        ("x\u00b7y", "grad_x_y"),  # the middle dot: in identifiers, not a word character
    ],
)
def test_slot_name_replaces_each_non_word_character(qual, expected):
    """slot_name: every character of the qualified name that is not a word character (``\\W``)
    replaced by ``_``, the dots included, after ``KIND_``."""
    from graphflop.passes.step_calls import slot_name

    assert slot_name("grad", qual) == expected


def test_forward_facts_worked_out_per_forward_graph():
    """The forward's keys and checkpoint tags that the derivative graphs' describers read are
    worked out once per forward graph: another forward graph gets its own, and a graph grown
    since is read again (a node copied into a call site gives that site a key twice)."""
    x = torch.randn(5, 6)
    f3, f4 = trace(Stack(3), (x,)), trace(Stack(4), (x,))
    k3, dup3, _ = calls.forward_facts(f3)
    k4, dup4, _ = calls.forward_facts(f4)
    assert (k3, dup3) == calls._forward_keys(f3) and (k4, dup4) == calls._forward_keys(f4)
    assert {s for s, _ in k3.values()} == {0, 1, 2}  # three call sites, four in the other
    assert {s for s, _ in k4.values()} == {0, 1, 2, 3}
    assert calls.forward_facts(f3)[0] is k3  # the same graph: not walked again
    g = f3.graph
    first = next(n for n in g.nodes if n.meta.get(CALL_SITE, (None,))[0] == 0)
    with g.inserting_after(first):
        twin = g.node_copy(first)
    twin.meta = dict(first.meta)
    assert not dup3 and calls.forward_facts(f3)[1] == {0}


def test_call_names_taken_a_base_at_a_time_as_fx_takes_them_one_by_one():
    """The step takes a copied call's names (``base_<n>`` each) a base at a time: the names fx
    gives nodes made one after the other with them (``_Namespace.create_name`` of each), and
    the namespace it leaves, whatever is taken already."""
    import random

    from torch.fx import Graph

    from graphflop.ad.builder import fits_numbered
    from graphflop.passes.step_calls import _numbered_plan, _take_planned

    def namespace(used, counts):
        g = Graph()
        ns = g._graph_namespace
        ns._used_names, ns._base_count = set(used), dict(counts)
        return g

    # by hand: mul_tensor_1 and _2 taken (count 2) are renamed on from the count: _3, _4;
    # sub_tensor_1 is free: taken as it is, its count 1; view_default_7 taken, _8 free
    used = {"mul_tensor", "mul_tensor_1", "mul_tensor_2", "view_default_7"}
    counts = {"mul_tensor": 2, "view_default": 7}
    names = ["mul_tensor_1", "sub_tensor_1", "mul_tensor_2", "view_default_7"]
    g = namespace(used, counts)
    got = _take_planned(g, names, _numbered_plan(names))
    assert got == ("mul_tensor_3", "sub_tensor_1", "mul_tensor_4", "view_default_8")
    assert g._graph_namespace._base_count == {"mul_tensor": 4, "view_default": 8, "sub_tensor": 1}
    # another call of the template fits its plan; a name of another form does not
    plan = _numbered_plan(names)
    assert fits_numbered(
        ["mul_tensor_9", "sub_tensor_9", "mul_tensor_10", "view_default_9"], plan[0]
    )
    assert not fits_numbered(
        ["mul_tensor", "sub_tensor_9", "mul_tensor_10", "view_default_9"], plan[0]
    )
    assert _numbered_plan(["mm_default"]) is None and _numbered_plan(["a__1"]) is None

    rng = random.Random(0)
    bases = ["mul_tensor", "add_tensor", "getitem", "sum_1"]  # sum_1_<n>: the base sum_1
    for _ in range(300):
        used, counts = set(), {}
        ref = namespace(used, counts)._graph_namespace
        for _ in range(rng.randrange(12)):  # names fx gave before
            b = rng.choice(bases)
            ref.create_name(f"{b}_{rng.randrange(8)}" if rng.random() < 0.6 else b, None)
        used, counts = set(ref._used_names), dict(ref._base_count)
        names = [f"{rng.choice(bases)}_{rng.randrange(10)}" for _ in range(rng.randrange(1, 9))]
        if rng.random() < 0.1:
            names.append(names[0])  # a name twice: the second renamed
        want = [ref.create_name(x, None) for x in names]
        g = namespace(used, counts)
        assert list(_take_planned(g, names, _numbered_plan(names))) == want
        ns = g._graph_namespace
        assert ns._used_names == ref._used_names
        assert list(ns._base_count.items()) == list(ref._base_count.items())
