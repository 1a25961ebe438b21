"""The derivative graphs' hierarchies recorded while the graphs are built (``direct``): the
flat graph rebuilt from them equals the one built flat, node for node, and the figures composed
per template equal the flat sums and those of the hierarchy read off the flat graph."""

from __future__ import annotations

import operator

import pytest
import torch
from conftest import node_rows, spec
from torch import nn
from torch.utils.checkpoint import checkpoint

from graphflop.ad import blocks, jvp
from graphflop.ad.jvp import build_jvp
from graphflop.ad.vjp import build_vjp
from graphflop.analysis import analyze
from graphflop.frontend.trace import trace
from graphflop.load import load, make_inputs
from graphflop.meta import (
    CALL_SITE,
    CHECKPOINT,
    DERIVED_HIERARCHY,
    GHOST_LINKS,
    GHOSTS,
    HIERARCHY,
    JVP,
    JVP_LOG,
    KIND,
    LINEARIZED,
    MODULE,
    PARAM,
    ROLE,
    SIGNATURE,
    SOURCE,
    VJP,
)
from graphflop.ops.ghost import is_ghost
from graphflop.passes import calls
from graphflop.passes.autodiff import BuildJvp, BuildVjp
from graphflop.passes.calls import DirectRecorder
from graphflop.passes.infra import run_passes
from graphflop.runtime.verify import verify_gradients

torch.manual_seed(0)


def _stored_nodes(gm):
    """Every node by op, arguments, layout and each annotation a call's node has relative to
    its block."""
    keys = (MODULE, ROLE, KIND, SOURCE, PARAM, CALL_SITE)
    return node_rows(gm, lambda n: tuple(n.meta.get(k) for k in keys))


def _names(gm):
    """Every node's name: a recorded hierarchy's flat graph names its nodes as the graph built
    flat does (fx numbers a name per op in the order the nodes were made, which expanding a
    template does not follow on its own)."""
    return [n.name for n in gm.graph.nodes]


def _placeholders(gm):
    """The placeholders' names (residuals and tangent inputs are named after them)."""
    return [n.name for n in gm.graph.nodes if n.op == "placeholder"]


def _figures(f):
    return (f.total, f.by_role, list(f.rows.items()), list(f.ops.items()), f.rule_less)


def _check_jvp(fwd, tangents):
    """The JVP recorded directly against the one built flat (and its hierarchy read off)."""
    flat = run_passes(fwd, [BuildJvp(tangents)])
    direct = run_passes(fwd, [BuildJvp(tangents, direct=True)])
    dh = direct.meta.get(DERIVED_HIERARCHY)
    if fwd.meta.get(HIERARCHY) is None:
        assert dh is None
        return None
    assert dh is not None
    assert _stored_nodes(calls.expand(dh)) == _stored_nodes(flat)
    assert _names(calls.expand(dh)) == _names(flat)
    assert _placeholders(direct) == _placeholders(flat)
    assert direct.meta[JVP] == flat.meta[JVP]
    keep = lambda n: n.meta.get(KIND) in ("tangent", "coef")  # noqa: E731
    role = "tangent_from_input"
    got = _figures(calls.derived_figures(dh, keep, role))
    assert got == _figures(calls.derived_figures(flat.meta[DERIVED_HIERARCHY], keep, role))
    assert got == _figures(calls.derived_figures(calls.build(flat, fwd), keep, role))
    assert got == _flat_figures(flat, keep, role)
    return dh, flat


def _flat_figures(gm, keep, role):
    """Node by node over the flat graph ``gm`` (a hierarchy without calls)."""
    return _figures(calls.derived_figures(calls.DerivedHierarchy((), (), gm), keep, role))


class Block(nn.Module):
    def __init__(self, d: int, f: int):
        super().__init__()
        self.fc1 = nn.Linear(d, f)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(f, d)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


class Stack(nn.Module):
    def __init__(self, n: int = 4, d: int = 6, f: int = 10):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, f) for _ in range(n))
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _forward(model, *inputs):
    return analyze(model, *inputs).forward


def _loaded(s: str, **ctor):
    loaded = load(s, ctor_kwargs=ctor, meta=True) if ctor else load(s, meta=True)
    loaded.model.train()
    return analyze(loaded.model, make_inputs(loaded, batch=2), name=s).forward


def test_stack_jvp_recorded_directly():
    fwd = _forward(Stack(), torch.randn(5, 6))
    for tangents in ("params", "all"):
        dh, flat = _check_jvp(fwd, tangents)
        # four calls, and no node of a block left at the top level; with tangents on the
        # parameters only, block 0 reads the model's input (no tangent: a template of its
        # own, 26 graph nodes against 30, placeholders and output included) and blocks 1-3
        # share one; with tangents on the input too all four share one
        assert [c.site for c in dh.calls] == [0, 1, 2, 3]
        assert [c.template for c in dh.calls] == ([0, 1, 1, 1] if tangents == "params" else [0] * 4)
        sizes = [len(t.graph.nodes) for t in dh.templates]
        assert sizes == ([26, 30] if tangents == "params" else [30])
        repeat = torch.ops.graphflop.repeat.default
        top = [n for n in dh.graph.graph.nodes if n.op == "call_function"]
        assert len([n for n in top if n.target is repeat]) == 4
        inner = [n for n in top if n.target is not operator.getitem and CALL_SITE in n.meta]
        assert not inner
        # the getitems of the calls are the nodes read after them, fewer than their nodes
        assert len(dh.graph.graph.nodes) < len(flat.graph.nodes)


# the default suite keeps three models (its 5-minute budget); the rest run with the slow tests
QUICK = [
    "mlp.py",
    "cnn.py",
    "resnet.py:resnet18",
]
SLOW = [
    "convnet.py",
    "lora.py",
    "vit.py",
    "torchvision:resnet18",
    "torchvision:mobilenet_v3_small",
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


_GPT2_3 = dict(n_layer=3, n_embd=32, n_head=2, vocab_size=50)


def test_gpt2_few_layers_jvp_recorded_directly():
    fwd = _loaded(spec("gpt2.py"), **_GPT2_3)
    for tangents in ("params", "all"):
        dh, _ = _check_jvp(fwd, tangents)
        assert {c.site for c in dh.calls} == {0, 1, 2}


class _NormBlock(nn.Module):
    """A block whose layer norm gives getitems (its mean and rstd) and a residual."""

    def __init__(self, d: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc(self.ln(x))


def test_call_tables_read_a_call_at_a_time_equal_the_walk_node_by_node():
    """The derivative builders' table of where each forward node is in its call, filled a call
    at a time from the hierarchy's variants, equals the one read node by node off the flat
    forward (its CALL_SITE tags): every table, in order; and so does the JVP's set of the
    nodes the loss's tangent depends on, a call's nodes marked at once."""
    norms = nn.Sequential(*(_NormBlock(6) for _ in range(3)), nn.Linear(6, 2))
    for model, n_calls in ((Stack(), 4), (norms, 3)):  # Stack's 4 blocks, the 3 norm blocks
        fwd = trace(model, torch.randn(2, 6))
        by_call = blocks._keys_by_call(fwd, fwd.meta[HIERARCHY])
        by_node = blocks._keys_by_node(fwd)
        assert by_call is not None  # the hierarchy's calls are runs of the flat forward
        for f in ("key", "site_nodes", "by_key", "names", "tags", "tag_names"):
            got, want = getattr(by_call, f), getattr(by_node, f)
            assert got == want and list(got) == list(want), f
        assert by_call.dup == by_node.dup == frozenset()
        assert by_call.split == by_node.split == frozenset()
        assert len(by_call.site_nodes) == n_calls
        # the JVP's walk for the nodes the loss's tangent needs, a call's nodes at once
        loss = jvp._differentiated(fwd, fwd.meta[SIGNATURE], "loss")
        needed = jvp._needed_by_call(fwd, loss)
        assert needed == jvp._needed(fwd.graph, loss)
        assert set(by_call.key) <= needed  # every node of every call reaches the loss
    assert any(n.target is operator.getitem for n in by_call.key)  # the norm's outputs


@pytest.mark.parametrize("s", QUICK)
def test_models_jvp_recorded_directly(s):
    fwd = _loaded(spec(s) if ".py" in s else s)
    _check_jvp(fwd, "params")


@pytest.mark.slow
@pytest.mark.parametrize("s", SLOW)
def test_large_models_jvp_recorded_directly(s):
    fwd = _loaded(spec(s) if ".py" in s else s)
    _check_jvp(fwd, "params")


def _check_vjp(fwd, input_grads=False):
    """The backward recorded directly against the one built flat (and its hierarchy read off);
    None where the direct build fell back to the flat graph."""
    flat = run_passes(fwd, [BuildVjp(input_grads=input_grads)])
    direct = run_passes(fwd, [BuildVjp(input_grads=input_grads, direct=True)])
    dh = direct.meta.get(DERIVED_HIERARCHY)
    if fwd.meta.get(HIERARCHY) is None:
        assert dh is None
        return None
    assert dh is not None
    if dh.graph is not direct:  # fell back: the flat graph, its hierarchy read off
        assert _stored_nodes(direct) == _stored_nodes(flat)
        return None
    assert _stored_nodes(calls.expand(dh)) == _stored_nodes(flat)
    assert _names(calls.expand(dh)) == _names(flat)
    assert _placeholders(direct) == _placeholders(flat)
    assert direct.meta[VJP] == flat.meta[VJP]
    keep = lambda n: True  # noqa: E731
    role = "grad_input"
    got = _figures(calls.derived_figures(dh, keep, role))
    assert got == _figures(calls.derived_figures(flat.meta[DERIVED_HIERARCHY], keep, role))
    assert got == _figures(calls.derived_figures(calls.build(flat, fwd), keep, role))
    assert got == _flat_figures(flat, keep, role)
    return dh, flat


class InStack(Stack):
    """:class:`Stack` behind a linear layer: block 0 reads a value with a cotangent."""

    def __init__(self, n: int = 4, d: int = 6, f: int = 10):
        super().__init__(n, d, f)
        self.inp = nn.Linear(d, d)

    def forward(self, x):
        return super().forward(self.inp(x))


def test_stack_vjp_recorded_directly():
    fwd = _forward(InStack(), torch.randn(5, 6))
    assert _check_vjp(fwd, input_grads=True) is not None  # the input's cotangent returned too
    dh, flat = _check_vjp(fwd)
    # the transpose walks the blocks backwards; all four are calls of one template
    assert [c.site for c in dh.calls] == [3, 2, 1, 0]
    assert dh.uses() == [4]
    assert len(dh.graph.graph.nodes) < len(flat.graph.nodes)


def test_stack_vjp_falls_back_across_a_fold():
    """Block 0 of :class:`Stack` reads the model's input (no cotangent needed there): what
    is left of its call after dead-code elimination is one permute of the cotangent arriving
    at its output, a matrix product made outside the call and read by nothing else, which
    the flat graph folds across the call's boundary. No template can hold that fold: the
    backward is built flat (and its hierarchy read off it)."""
    fwd = _forward(Stack(), torch.randn(5, 6))
    assert _check_vjp(fwd) is None
    direct = run_passes(fwd, [BuildVjp(direct=True)])
    dh = direct.meta[DERIVED_HIERARCHY]
    assert dh.graph is not direct and sorted(dh.uses()) == [1, 3]


def test_gpt2_few_layers_vjp_recorded_directly():
    fwd = _loaded(spec("gpt2.py"), n_layer=3, n_embd=32, n_head=2, vocab_size=50)
    assert _check_vjp(fwd, input_grads=True) is not None  # recorded with input_grads too
    got = _check_vjp(fwd)
    assert got is not None  # recorded, not fallen back to the flat graph
    dh, flat = got
    assert {c.site for c in dh.calls} == {0, 1, 2}
    assert len(dh.graph.graph.nodes) < len(flat.graph.nodes)


@pytest.mark.parametrize("s", QUICK)
def test_models_vjp_recorded_directly(s):
    _check_vjp(_loaded(spec(s) if ".py" in s else s))


@pytest.mark.slow
@pytest.mark.parametrize("s", SLOW)
def test_large_models_vjp_recorded_directly(s):
    _check_vjp(_loaded(spec(s) if ".py" in s else s))


class CheckpointedStack(nn.Module):
    """Three identical residual blocks, each under ``torch.utils.checkpoint``."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block(8, 16) for _ in range(3))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        for b in self.blocks:
            x = x + checkpoint(b, x, use_reentrant=False)
        return self.head(x)


def test_checkpointed_blocks_fall_back_to_the_flat_backward():
    """The backward reruns each checkpointed block, and dead-code elimination must keep the
    recompute eager runs: the recorded backward is not shown equal there, so the flat one is
    built (and its hierarchy read off it); the JVP is recorded as everywhere."""
    fwd = _forward(CheckpointedStack(), torch.randn(4, 8))
    assert fwd.meta.get(HIERARCHY) is not None
    _check_jvp(fwd, "params")
    assert _check_vjp(fwd) is None


def test_api_direct_option():
    """``graphflop.api.build_jvp`` / ``build_vjp`` with ``direct=True``: the top levels of
    the hierarchies, expanding to the graphs built without it."""
    from graphflop import api

    fwd = _forward(InStack(), torch.randn(5, 6))
    for build in (api.build_jvp, api.build_vjp):
        direct, flat = build(fwd, direct=True), build(fwd)
        dh = direct.meta[DERIVED_HIERARCHY]
        assert dh.graph is direct and len(direct.graph.nodes) < len(flat.graph.nodes)
        assert _stored_nodes(calls.expand(dh)) == _stored_nodes(flat)


def test_recorded_jvp_is_transposed():
    """``build_vjp`` given a recorded JVP (``direct=True``) transposes its flat graph: the
    backward equals the one transposed from the flat JVP, node for node."""
    from graphflop import api

    fwd = _forward(InStack(), torch.randn(5, 6))
    for direct in (False, True):
        got = api.build_vjp(fwd, linearized=api.build_jvp(fwd, direct=True), direct=direct)
        want = api.build_vjp(fwd, linearized=api.build_jvp(fwd), direct=direct)
        assert _stored_nodes(got) == _stored_nodes(want)
        assert got.meta[VJP] == want.meta[VJP]


def _log_rows(gm):
    """The JVP log as positions among the graph's nodes; a ghost as its op, kind, record (its
    names are numbered afresh per build: source, module, role, cost) and arguments (nodes as positions); a custom Function's entry as its type."""
    at = {n: i for i, n in enumerate(gm.graph.nodes)}

    def row(e):
        if isinstance(e, torch.fx.Node):
            return at[e]
        if isinstance(e, (list, tuple)):
            return tuple(row(x) for x in e)
        if is_ghost(e):
            r = e.record
            where = (r.source, r.module, r.role, r.cost) if r is not None else None
            return ("ghost", str(e.op), e.kind, where, row(e.args))
        return e if isinstance(e, (int, float, bool, str, type(None))) else type(e).__name__

    return [row(e) for e in gm.meta[JVP_LOG]]


def _check_transposed(fwd, input_grads=False, read=True):
    """The backward transposed from the recorded JVP against the one transposed from the flat
    JVP (both with and without a recorder of the backward): node for node, ``VjpInfo``, and
    the recorded backward's ``derived_figures``; ``read``: whether the recorded JVP is read
    as it is (else through its flat graph). Returns the flat backward transposed from the
    recorded JVP (None where the forward has no hierarchy)."""
    if fwd.meta.get(HIERARCHY) is None:
        return None
    tangents = "all" if input_grads else "params"
    flat = build_jvp(fwd, tangents, for_transpose=True)
    rec = build_jvp(fwd, tangents, for_transpose=True, recorder=DirectRecorder(fwd))
    assert rec.meta[DERIVED_HIERARCHY].graph is rec
    expanded = calls.expand_jvp(rec)
    assert _stored_nodes(expanded) == _stored_nodes(flat)
    assert _names(expanded) == _names(flat)
    assert _log_rows(expanded) == _log_rows(flat)
    assert len(expanded.meta[GHOST_LINKS].links) == len(flat.meta[GHOST_LINKS].links)
    got = build_vjp(fwd, input_grads=input_grads, linearized=rec)
    want = build_vjp(fwd, input_grads=input_grads, linearized=flat)
    # ``read``: the recorded JVP transposed as it is (each call read from its repeat node),
    # not through its flat graph (expand_jvp: checkpointed blocks)
    assert (got.meta[LINEARIZED] is rec) == read
    assert _stored_nodes(got) == _stored_nodes(want)
    assert _names(got) == _names(want)
    assert _placeholders(got) == _placeholders(want)
    assert got.meta[VJP] == want.meta[VJP]
    ghost = lambda g: (g.op, g.shape, g.source, g.module, g.role, g.cost)  # noqa: E731
    assert [ghost(g) for g in got.meta[GHOSTS]] == [ghost(g) for g in want.meta[GHOSTS]]
    d_got = build_vjp(fwd, input_grads=input_grads, linearized=rec, recorder=DirectRecorder(fwd))
    d_want = build_vjp(fwd, input_grads=input_grads, linearized=flat, recorder=DirectRecorder(fwd))
    assert d_got.meta[VJP] == d_want.meta[VJP]
    dh_got, dh_want = d_got.meta.get(DERIVED_HIERARCHY), d_want.meta.get(DERIVED_HIERARCHY)
    assert (dh_got is None) == (dh_want is None)
    if dh_got is not None:
        assert (dh_got.graph is d_got) == (dh_want.graph is d_want)  # recorded, or fell back
        assert _stored_nodes(calls.expand(dh_got)) == _stored_nodes(calls.expand(dh_want))
        assert _stored_nodes(calls.expand(dh_got)) == _stored_nodes(want)
        assert _names(calls.expand(dh_got)) == _names(want)
        keep = lambda n: True  # noqa: E731
        assert _figures(calls.derived_figures(dh_got, keep, "grad_input")) == _figures(
            calls.derived_figures(dh_want, keep, "grad_input")
        )
    return got


def test_stack_transposed_from_the_recorded_jvp():
    """The block stack (with and without a layer before it), and the gradients of the backward
    transposed from the recorded JVP against ``torch.func`` on real tensors."""
    for model in (InStack(), Stack()):
        fwd = _forward(model, torch.randn(5, 6))
        for input_grads in (False, True):
            bwd = _check_transposed(fwd, input_grads)
        assert verify_gradients(fwd, bwd, model, tolerance=1e-5).ok


def test_gpt2_few_layers_transposed_from_the_recorded_jvp(monkeypatch):
    loaded = load(spec("gpt2.py"), ctor_kwargs=_GPT2_3)
    loaded.model.train()
    fwd = analyze(loaded.model, make_inputs(loaded, batch=2)).forward
    made_flat = []
    flat = blocks.RecordedCalls.flat

    def counted(self, rep, run, ct):
        made_flat.append(rep)
        return flat(self, rep, run, ct)

    monkeypatch.setattr(blocks.RecordedCalls, "flat", counted)
    for input_grads in (False, True):
        made_flat.clear()
        bwd = _check_transposed(fwd, input_grads)
        # three calls of one JVP template: the first is made flat and transposed by the rules
        # (each time _check_transposed transposes the recorded JVP: twice), the other two are
        # read from their repeat nodes
        assert len(made_flat) == 2 and len(set(made_flat)) == 1
    assert verify_gradients(fwd, bwd, loaded.model, tolerance=1e-4).ok


def test_recorded_jvp_falls_back_to_its_flat_graph(monkeypatch):
    """Where a call of the recorded JVP cannot be transposed as recorded (forced here: the
    first call made flat raises :class:`RecordedFallback`), the backward is transposed from
    ``calls.expand_jvp`` of it, with a fresh recorder, equal to the flat JVP's."""

    def refuse(self, rep, run, ct):
        raise blocks.RecordedFallback(rep.name)

    fwd = _forward(InStack(), torch.randn(5, 6))
    rec = build_jvp(fwd, "params", for_transpose=True, recorder=DirectRecorder(fwd))
    flat = build_jvp(fwd, "params", for_transpose=True)
    monkeypatch.setattr(blocks.RecordedCalls, "flat", refuse)
    for recorder in (None, DirectRecorder(fwd)):
        got = build_vjp(fwd, linearized=rec, recorder=recorder)
        want = build_vjp(fwd, linearized=flat, recorder=DirectRecorder(fwd) if recorder else None)
        assert got.meta[LINEARIZED] is not rec
        assert got.meta[VJP] == want.meta[VJP]
        dh_got, dh_want = got.meta.get(DERIVED_HIERARCHY), want.meta.get(DERIVED_HIERARCHY)
        if recorder is None:
            assert _stored_nodes(got) == _stored_nodes(want)
        else:
            assert dh_got.graph is got and dh_want.graph is want
            assert _stored_nodes(calls.expand(dh_got)) == _stored_nodes(calls.expand(dh_want))


def test_value_imported_by_key_then_read_as_a_node(monkeypatch):
    """A template backward expanded at a call imports the call's residuals keyed by
    ``(repeat node, position)`` (:meth:`RecordedCalls.lookup`), no node made for them; where
    a later run of the same call reads one as a node (its nodes made flat), the import is
    re-keyed by the node made for it (:meth:`RecordedCalls._rekey`), so the rules read the
    residual imported, not a second placeholder of it. No model in the suite reaches this (a
    call's run is split only by a Function's entry or a ghost, and such a call is built by
    the rules in the JVP: its values are first calls' nodes, never keys), so it is forced:
    each call's run is transposed in two halves, and at the first call whose first half was
    expanded (block 2) the second half finds no template backward (as at a variant's first
    call) and is made flat. The backward equals the one built flat (``per_template=False``)
    node for node, names included (without the re-keying: one placeholder more, a second
    import of block 2's ``relu``), and its gradients are ``torch.func.vjp``'s."""
    from graphflop.frontend.trace import trace
    from graphflop.meta import SIGNATURE
    from graphflop.runtime.verify import real_arguments, run_backward, run_forward

    run = blocks.BlockTranspose.run
    halves_of: dict = {}  # per repeat node, the halves of its run begun
    forced: list = []  # the call site whose second half was made flat

    def halves(self, entries, i):
        j = run(self, entries, i)
        if not isinstance(entries[i], tuple) or j - i < 2:
            return j
        rep = entries[i][0]
        halves_of[rep] = halves_of.get(rep, 0) + 1
        by_key = any(type(k) is tuple and k[0] is rep for k in self.calls.imported)
        if halves_of[rep] == 2 and by_key and not forced:  # its first half imported by key
            forced.append(self.calls.site(rep))
            self.fast.clear()  # the second half made flat, as a variant's first call
        return i + (j - i) // 2

    rekeyed: list = []
    rekey = blocks.RecordedCalls._rekey

    def counted(self, key, v):
        rekeyed.append(key in self.imported)
        rekey(self, key, v)

    monkeypatch.setattr(blocks.BlockTranspose, "run", halves)
    monkeypatch.setattr(blocks.RecordedCalls, "_rekey", counted)
    # each call's entries read one by one (not a call's run whole): its runs are split above
    monkeypatch.setattr(blocks, "_reversed_runs", lambda log, _: list(reversed(log)))
    torch.manual_seed(0)
    model = InStack(n=4).double()
    fwd = trace(model, (torch.randn(5, 6, dtype=torch.float64),), loss="sum")
    rec = build_jvp(fwd, "params", for_transpose=True, recorder=DirectRecorder(fwd))
    got = build_vjp(fwd, linearized=rec)
    assert got.meta[LINEARIZED] is rec  # read from the repeat nodes
    assert forced == [2] and sum(rekeyed) >= 1  # a key imported, then read as a node
    flat = build_jvp(fwd, "params", for_transpose=True, per_template=False)
    want = build_vjp(fwd, linearized=flat, per_template=False)
    assert _stored_nodes(got) == _stored_nodes(want)
    assert _names(got) == _names(want)
    assert got.meta[VJP] == want.meta[VJP]

    values = real_arguments(fwd, model)
    grads = run_backward(got, run_forward(fwd, values))
    sig = fwd.meta[SIGNATURE]
    x = values[sig.inputs[0]]
    loss = lambda p: torch.func.functional_call(model, p, (x,)).sum()  # noqa: E731
    _, pull = torch.func.vjp(loss, {q: values[p] for p, q in sig.params})
    (ref,) = pull(torch.ones((), dtype=torch.float64))
    assert len(grads) == len(sig.params) == 20  # weight and bias: inp, 4 x (fc1, fc2), head
    for g, (_, q) in zip(grads, sig.params):
        assert torch.allclose(g, ref[q], rtol=1e-9, atol=1e-12), q


@pytest.mark.parametrize("s", QUICK)
def test_models_transposed_from_the_recorded_jvp(s):
    _check_transposed(_loaded(spec(s) if ".py" in s else s))


@pytest.mark.slow
@pytest.mark.parametrize("s", SLOW)
def test_large_models_transposed_from_the_recorded_jvp(s):
    _check_transposed(_loaded(spec(s) if ".py" in s else s))


def test_checkpointed_blocks_jvp_is_one_template():
    """Each block under its own ``torch.utils.checkpoint`` call: its nodes carry their call's
    region, which the JVP's primal copies keep. Blocks 1 and 2 are one variant, their JVP built
    once and expanded (the region made relative to the call: each call's own in the flat view,
    as built flat), where the rules built every checkpointed call's JVP and each call was a
    template of its own."""
    fwd = _forward(CheckpointedStack(), torch.randn(4, 8))
    made = []
    of = blocks.BlockLinearize.of

    def spy(forward, lin):
        made.append(of(forward, lin))
        return made[-1]

    blocks.BlockLinearize.of = spy  # type: ignore[method-assign]
    try:
        dh, flat = _check_jvp(fwd, "params")
    finally:
        blocks.BlockLinearize.of = of  # type: ignore[method-assign]
    # block 0 reads the model's input (no tangent): a variant of its own; blocks 1 and 2 one
    # variant, built at block 1 and expanded at block 2, recorded or built flat
    assert [(b.built, b.expanded) for b in made] == [(2, 1), (2, 1)]
    assert len(dh.calls) == 3 and len(dh.templates) == 2
    tags = lambda gm: [n.meta.get(CHECKPOINT) for n in gm.graph.nodes]  # noqa: E731
    assert tags(calls.expand(dh)) == tags(flat)
    regions = {t.region for t in tags(flat) if t is not None}
    assert len(regions) == 3


def test_checkpointed_blocks_transposed_from_the_recorded_jvp():
    _check_transposed(_forward(CheckpointedStack(), torch.randn(4, 8)), read=False)


def test_checkpointed_blocks_backward_built_once(monkeypatch):
    """A checkpointed model's backward, asked for with a recorder, is built flat at once: the
    recompute kept through dead-code elimination is not cleaned up per call, so a recorded
    build was made and then thrown away for a second, flat one (each analysis of a checkpointed
    model built its backward twice: 27 % of a 48-block stack's analysis)."""
    import graphflop.ad.vjp as vjp

    fwd = _forward(CheckpointedStack(), torch.randn(4, 8))
    want = build_vjp(fwd)
    builds = []
    inner = vjp._build_vjp
    monkeypatch.setattr(vjp, "_build_vjp", lambda *a: builds.append(1) or inner(*a))
    got = build_vjp(fwd, recorder=DirectRecorder(fwd))
    assert len(builds) == 1
    assert got.meta.get(DERIVED_HIERARCHY) is None  # flat, as the second build made it
    assert _stored_nodes(got) == _stored_nodes(want)


def test_llama_decoder_layers_recorded_directly():
    """transformers' Llama with 3 decoder layers (one template): both graphs recorded."""
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
    fwd = analyze(loaded.model, make_inputs(loaded, batch=2)).forward
    dh, _ = _check_jvp(fwd, "params")
    assert {c.site for c in dh.calls} == {0, 1, 2}
    assert _check_vjp(fwd) is not None
    _check_transposed(fwd)


def test_names_taken_as_fx_gives_them():
    """``take_name`` (the names a recorded call takes for the copies it stands for) and
    ``FlatNames`` (the fold's names in the flat view) give, in any order of requests, the
    names fx gives nodes made with those names: ops' base names (counted per op), a forward
    node's numbered name (which moves the op's count; numbered again where taken), a
    builtin's name (fx numbers it)."""
    from graphflop.ad.builder import base_name, take_name

    aten = torch.ops.aten
    ops = [aten.mm.default, aten.permute.default, aten.mm.default, operator.getitem]
    fx_graph, ours = torch.fx.Graph(), torch.fx.Graph()
    asked = []
    for i in range(12):
        op = ops[i % len(ops)]
        asked.append(base_name(ours, op))
        if i % 5 == 2:
            asked.append(f"mm_default_{2 * i + 1}")  # a primal copy named after its forward node
        if i % 6 == 3:
            asked.append("sum")
        if i % 4 == 1:  # numbered names: free, taken, odd forms fx reads its own way
            asked += ["getitem_3", "permute_default_2", "a__5", "x_05", "_1", "t_0", "mm_12a"]
        if i % 3 == 0:  # plain names: free, then taken; a keyword's and a builtin's
            asked += ["repeat_item", "p_h_0_w", "abc_", "for", "input"]
    made = [fx_graph.create_node("call_function", print, name=c).name for c in asked]
    assert [take_name(ours, c) for c in asked] == made
    assert len(set(made)) == len(made) and "mm_default_5" in made and "sum_1" in made
    snapshot = calls.FlatNames(fx_graph)
    later = [fx_graph.call_function(op).name for op in ops]
    twice = snapshot.copy()
    assert [snapshot.name(op) for op in ops] == later == [twice.name(op) for op in ops]
