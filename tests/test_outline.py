"""Repeated modules traced once (graphflop.frontend.outline): the graph equals full tracing's, node for
node, and computes the same values; modules that cannot be copies are traced in full."""

from __future__ import annotations

import importlib.util
import math
import operator
from pathlib import Path

import pytest
import torch
from conftest import node_rows
from torch import nn

import graphflop
from graphflop.frontend import outline as repeats
from graphflop.frontend.trace import trace
from graphflop.meta import CONSTANTS, MODULE, OUTLINED, PARAM_DERIVED, SIGNATURE, OutlineInfo
from graphflop.passes.flops import annotate_flops, total_cost

ROOT = Path(__file__).resolve().parents[1]


def _gpt2(**kwargs):
    spec = importlib.util.spec_from_file_location("gpt2_for_repeats", ROOT / "models" / "gpt2.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.GPT2("small", n_layer=3, n_head=2, n_embd=8, vocab_size=11, n_positions=6, **kwargs)


def _ops(gm):
    """Every node as :func:`conftest.node_rows` has it, with its module path and
    parameter-derivedness: what the passes read."""
    return node_rows(gm, lambda n: (n.meta.get(MODULE), n.meta.get(PARAM_DERIVED)))


def _run(gm, params: dict, buffers: dict, *args):
    """Run a traced graph on real values: parameters and buffers by qualified name."""
    sig = gm.meta[SIGNATURE]
    state = {**params, **buffers}
    values = [state[q] for _, q in sig.params] + [state[q] for _, q in sig.buffers]
    return gm(*values, *args)


def _same_graph(model, x, **kw):
    full = trace(model, (x,), reuse=False, **kw)
    once = trace(model, (x,), **kw)
    assert _ops(once) == _ops(full)
    # the same nodes write the same buffers (by position: a getitem's name depends on the
    # order in which tracing made the getitems of a multi-output op, batch norm's)
    assert _updates(once) == _updates(full)
    return full, once


def _updates(gm) -> list[tuple[int, str]]:
    where = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    return [(where[name], q) for name, q in gm.meta[SIGNATURE].buffer_updates]


def test_plan_outlines_the_outermost_repeated_blocks():
    model = _gpt2()
    chosen = repeats.plan(model)
    names = {m: n for n, m in model.named_modules()}
    # the three blocks (not their inner Linear/LayerNorm, which also repeat)
    assert sorted(names[m] for m in chosen) == ["h.0", "h.1", "h.2"]
    assert len(set(chosen.values())) == 1


def test_gpt2_graph_and_values_equal_full_tracing():
    torch.manual_seed(0)
    model = _gpt2().double().train()
    idx = torch.randint(0, 11, (2, 6))
    full, once = _same_graph(model, idx)
    assert once.meta[OUTLINED] == OutlineInfo(calls=3, traced_once=1)  # copies were made
    assert full.meta[OUTLINED] == OutlineInfo(calls=0, traced_once=0)
    targets = torch.randint(0, 11, (12,))
    params = dict(model.named_parameters())
    got = _run(once, params, {}, idx, targets)
    want = _run(full, params, {}, idx, targets)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # and both equal eager PyTorch: cross-entropy of the logits
    logits = model(idx)
    torch.testing.assert_close(got[0], nn.functional.cross_entropy(logits, targets))
    assert total_cost(annotate_flops(once).graph.nodes) == total_cost(
        annotate_flops(full).graph.nodes
    )


class _Block(nn.Module):
    def __init__(self, scale: float = 1.0):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.act = nn.ReLU()
        self.scale = scale

    def forward(self, x):
        return x + self.scale * self.act(self.bn(self.fc(x)))


class _Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.ReLU()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls.add_(1)
        return self.act(self.fc(x))


def test_batch_norm_blocks_map_their_running_statistics_through_the_template():
    """Training-mode batch norm writes its running statistics: such blocks are outlined, the
    writes mapped through the template (the running mean and variance where the block runs,
    the batch count at the end), and the graph and its buffer updates are full tracing's.
    Another in-place write is seen in the template's trace and tracing starts again without
    outlining that structure."""
    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block(), _Block()).train()
    assert len(repeats.plan(model)) == 3
    x = torch.randn(5, 4)
    full, once = _same_graph(model, x, loss="sum")
    assert once.meta[OUTLINED] == OutlineInfo(calls=3, traced_once=1)
    assert len(once.meta[SIGNATURE].buffer_updates) == 9  # mean, var, count × 3
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    got = _run(once, params, buffers, x)
    expected = [*(state[q] for _, q in once.meta[SIGNATURE].buffer_updates)]
    model(x)  # eager: updates the running statistics in place
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)
    counting = nn.Sequential(_Counting(), _Counting())
    assert len(repeats.plan(counting)) == 2
    full, once = _same_graph(counting, x, loss="sum")
    assert once.meta[OUTLINED].calls == 0  # traced again in full
    assert [q for _, q in once.meta[SIGNATURE].buffer_updates] == ["0.calls", "1.calls"]
    # in eval mode nothing is written: the blocks are outlined and the graph is the same
    model.eval()
    assert repeats.plan(model)
    assert _same_graph(model, x, loss="sum")[1].meta[OUTLINED].calls == 3


class _ConvBlock(nn.Module):
    def __init__(self, bn: nn.Module):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.bn = bn

    def forward(self, x):
        return x + torch.relu(self.bn(self.conv(x)))


class _SharedNorm(nn.Module):
    """Four conv blocks and a linear head. ``how``: ``own``, each block its own batch norm;
    ``blocks``, one batch norm object in every block (the tester's model); ``twice``, own
    norms, block 1 called a second time; ``before`` / ``after``, own norms, block 1's also
    the model's ``stem`` (a module reachable by two paths), called before / after the
    blocks."""

    def __init__(self, how: str):
        super().__init__()
        shared = nn.BatchNorm2d(8)
        self.how = how
        self.blocks = nn.ModuleList(
            _ConvBlock(shared if how == "blocks" else nn.BatchNorm2d(8)) for _ in range(4)
        )
        self.head = nn.Linear(8, 4)
        if how in ("before", "after"):
            self.stem = self.blocks[1].bn

    def forward(self, x):
        if self.how == "before":
            x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        if self.how == "twice":
            x = self.blocks[1](x)
        if self.how == "after":
            x = self.stem(x)
        return self.head(x.mean((2, 3)))


@pytest.mark.parametrize(
    "how, training, calls",
    [
        ("blocks", True, 0),
        ("twice", True, 0),
        ("before", True, 0),
        ("after", True, 0),
        ("own", True, 4),  # nothing shared: outlined
        ("blocks", False, 4),  # eval mode writes no statistics: outlined
    ],
)
def test_running_statistics_updated_by_two_calls_are_traced_in_full(
    how, training, calls, monkeypatch
):
    """Tester's finding: one batch norm shared by the blocks (its running statistics updated
    at every call) was outlined, each copy reading and writing the statistics as the template
    does, where full tracing chains one call's write into the next call's read: saved for
    backward 36,992 bytes, not eager's 49,472; the shared norm's rows and the peaks wrong. A
    structure whose calls update statistics another call updates too (the norm shared by the
    blocks or with the rest of the model, a block called twice) is now traced in full, and
    every figure of the report is full tracing's; saved for backward equals what eager's
    ``saved_tensors_hooks`` see (inputs included). Tracing again after such a failure puts the
    state of a norm reachable by two paths back first (it was left holding traced tensors)."""
    from graphflop.analysis import analyze
    from graphflop.runtime.memory_probe import measure_saved

    def make():
        torch.manual_seed(0)
        return _SharedNorm(how).train(training)

    x = torch.randn(2, 8, 8, 8)
    once = analyze(make(), x, loss="sum")
    if training:
        saved = measure_saved(make(), (x,), loss="sum")
        assert once.report.memory.saved_for_backward_bytes == saved
    with monkeypatch.context() as m:
        m.setattr(repeats, "plan", lambda *a, **k: {})
        full = analyze(make(), x, loss="sum")
    assert once.report.to_dict() == full.report.to_dict()
    info = once.forward.meta[OUTLINED]
    assert info.calls == calls
    # the report says why the blocks were traced in full
    assert any("running statistics of a norm" in why for why in info.in_full) == (calls == 0)


def test_blocks_differing_in_an_attribute_are_not_merged():
    """A per-block attribute (here a residual scale) makes the blocks different functions:
    each is traced, and the values equal eager PyTorch's."""
    torch.manual_seed(0)
    model = nn.Sequential(_Block(1.0), _Block(0.5), _Block(1.0), _Block(0.5)).eval().double()
    chosen = repeats.plan(model)
    assert len(set(chosen.values())) == 2  # blocks 0 and 2 share one trace, 1 and 3 another
    x = torch.randn(5, 4, dtype=torch.float64)
    full, once = _same_graph(model, x, loss="none")
    assert once.meta[OUTLINED] == OutlineInfo(calls=4, traced_once=2)
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    got = _run(once, params, buffers, x)
    torch.testing.assert_close(got[0], model(x), rtol=0, atol=0)


class _Indexed(nn.Module):
    """A block keeping its layer index, as HuggingFace's attention modules do for their KV
    cache; ``first_special`` makes it branch on the index."""

    def __init__(self, layer_idx: int, first_special: bool | str = False):
        super().__init__()
        self.attn = nn.Linear(4, 4)
        self.attn.layer_idx = layer_idx
        self.fc = nn.Linear(4, 4)
        self.first_special = first_special

    def forward(self, x):
        h = self.attn(x)
        if self.first_special == "middle":  # only blocks 1 (of 0-3) differ: the last's graph
            if self.attn.layer_idx % 3 == 1:  # is the first's (a tester's finding)
                h = torch.exp(h)
        elif self.first_special and self.attn.layer_idx == 0:
            h = h * 2
        return x + torch.tanh(self.fc(h))


@pytest.mark.parametrize("first_special", [False, True, "middle"])
def test_blocks_differing_only_in_layer_idx(first_special):
    """Blocks that differ only in ``layer_idx`` share one trace; one whose forward uses it is
    traced in full: caught as it uses the index (only the middle blocks differing: the last
    block's graph, traced for the check, is the first's, so a second trace alone took block 1
    for a copy of block 0), or by a second template trace (from the last block). Either way the
    graph is full tracing's and the values eager PyTorch's."""
    torch.manual_seed(0)
    model = nn.Sequential(*[_Indexed(i, first_special) for i in range(4)]).double()
    assert len(set(repeats.plan(model).values())) == 1
    x = torch.randn(5, 4, dtype=torch.float64)
    full, once = _same_graph(model, x, loss="none")
    # traced in full: said, with why (the modules' paths in the Sequential: 0 to 3)
    why = ("_Indexed ×4 (0, 1, …, 3): its forward uses layer_idx",)
    outlined = OutlineInfo(0, 0, in_full=why) if first_special else OutlineInfo(4, 1)
    assert once.meta[OUTLINED] == outlined
    params = dict(model.named_parameters())
    torch.testing.assert_close(_run(once, params, {}, x)[0], model(x), rtol=0, atol=0)


class _ReadsIndex(nn.Module):
    """A block whose layer 1 (of 0-3) alone adds ``tanh(h) * 3``, told by ``reads(layer_idx)``:
    the first and last blocks' graphs are alike (a tester's finding: ``int(i)`` and ``i.real``
    read an ``int`` subclass's value without any of its methods)."""

    def __init__(self, layer_idx: int, reads):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.Identity()  # (three modules: a tree :func:`repeats.plan` outlines)
        self.layer_idx = layer_idx
        self.reads = reads

    def forward(self, x):
        h = self.act(self.fc(x))
        if self.reads(self.layer_idx):
            h = torch.tanh(h) * 3.0
        return x + h


#: ways to read the index, each True at layer 1 only (of 0-3); "type" is True at every layer in
#: eager PyTorch, read by its type alone (the stand-in's type is not int: the second trace, from a
#: copy with its real index, finds the graphs differ)
_READS = {
    "int": lambda i: int(i) == 1,
    "real": lambda i: i.real == 1,
    "numerator": lambda i: i.numerator == 1,
    "float": lambda i: float(i) == 1.0,
    "list index": lambda i: [False, True, False, False][i],
    "range": lambda i: len(range(i)) == 1,
    "operator.index": lambda i: operator.index(i) == 1,
    "f-string": lambda i: f"{i}" == "1",
    "%d": lambda i: "%d" % i == "1",  # noqa: UP031 (the C path of %d)
    "dict key": lambda i: {1: True}.get(i, False),
    "math": lambda i: math.isclose(math.log2(i + 1), 1.0),
    "bits": lambda i: bool(i & 1) and not i >> 1,
    "divmod": lambda i: divmod(i, 2) == (0, 1),
    "round": lambda i: round(i) == 1,
    "bit_length": lambda i: i.bit_length() == 1,
    "tensor": lambda i: bool(torch.tensor(i) == 1),  # (raises on the stand-in)
    "type": lambda i: type(i) is int,
}


@pytest.mark.parametrize("spelling", list(_READS))
def test_every_read_of_layer_idx_is_seen(spelling):
    """However the forward reads ``layer_idx``, the figures are full tracing's (the structure
    traced in full): the first and the last block alike, the check comparing their graphs
    alone would miss layer 1's tanh."""
    reads = _READS[spelling]
    torch.manual_seed(0)
    model = nn.Sequential(*[_ReadsIndex(i, reads) for i in range(4)])
    x = torch.randn(2, 4)
    opts = dict(loss="none", backward=False, jvp=False)
    assert len(repeats.plan(model)) == 4
    flat = graphflop.analyze(model, (x,), outline=False, **opts).report.totals.forward
    a = graphflop.analyze(model, (x,), **opts)
    assert a.report.totals.forward == flat
    why = "its graph depends on layer_idx" if spelling == "type" else "its forward uses layer_idx"
    assert a.forward.meta[OUTLINED] == OutlineInfo(0, 0, (f"_ReadsIndex ×4 (0, 1, …, 3): {why}",))
    # per block: addmm 2·2·4·4 + 2·4 (its bias) + the residual add 2·4 = 80; tanh (1 FLOP, 1
    # transcendental per element) and · 3 add 8 + 8 at each block that takes the branch
    blocks = 4 if spelling == "type" else 1
    assert (flat.flops, flat.transcendentals) == (4 * 80 + blocks * 16, blocks * 8)


def test_hf_llama_layers_share_one_trace():
    """HuggingFace's decoder layers differ in their attention's layer_idx only: one trace for
    all of them, the graph full tracing's."""
    pytest.importorskip("transformers")
    from graphflop.load import load, make_inputs

    small = dict(
        num_hidden_layers=3,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=50,
    )
    loaded = load("hf:llama", ctor_kwargs=small, meta=True, seq=6)
    loaded.model.train()
    inputs = make_inputs(loaded)
    full = trace(loaded.model, inputs, reuse=False)
    once = trace(loaded.model, inputs)
    assert once.meta[OUTLINED] == OutlineInfo(calls=3, traced_once=1)
    assert _ops(once) == _ops(full)


@pytest.mark.parametrize("reuse", [True, False])
def test_no_stub_is_left_behind(reuse):
    """The stubs that replace forward while tracing are removed afterwards."""
    model = _gpt2()
    trace(model, (torch.randint(0, 11, (1, 6)),), reuse=reuse)
    assert all("forward" not in vars(m) for m in model.modules())


class _ScaledBlock(nn.Module):
    """Makes a constant tensor in forward: its template would hold a get_attr."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.act = nn.Tanh()

    def forward(self, x):
        return self.act(self.fc(x)) * torch.tensor([1.0, 2.0, 3.0])


def test_blocks_that_make_constants_are_traced_in_full():
    model = nn.Sequential(_ScaledBlock(), _ScaledBlock()).double()
    assert len(repeats.plan(model)) == 2  # outlined at first, then traced in full
    x = torch.randn(4, 3, dtype=torch.float64)
    full, once = _same_graph(model, x, loss="none")
    consts = once.meta[CONSTANTS]
    assert len(consts) == 2
    params = dict(model.named_parameters())
    got = _run(once, params, {q: consts[n] for n, q in once.meta[SIGNATURE].buffers}, x)
    torch.testing.assert_close(got[0], model(x), rtol=0, atol=0)


class _AttentionBlock(nn.Module):
    """Batch-first attention: the projections see a transposed (strided) input, for which
    PyTorch's matmul makes one mm only when the weight requires grad."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = self.ln(x)
        y, _ = self.attn(y, y, y, need_weights=False)
        return x + self.fc(y)


def test_attention_blocks_trace_as_in_full():
    """Templates are traced with the parameters' requires_grad flags (inside the trace the
    parameters are wrappers without them): the kernels' choices match full tracing's."""
    torch.manual_seed(0)
    model = nn.Sequential(_AttentionBlock(), _AttentionBlock(), _AttentionBlock()).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    full, once = _same_graph(model.train(), x, loss="sum")
    assert once.meta[OUTLINED] == OutlineInfo(calls=3, traced_once=1)
    assert any(n.target is torch.ops.aten.mm.default for n in once.graph.nodes)
    params = dict(model.named_parameters())
    torch.testing.assert_close(_run(once, params, {}, x)[0], model(x).sum(), rtol=1e-12, atol=1e-12)


# --- calls that must not become copies (found by trying to break outlining) -------------------

D = 8


class _Blk(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.n = nn.Linear(D, D), nn.Linear(D, D), nn.LayerNorm(D)

    def forward(self, x):
        return x + self.b(torch.nn.functional.gelu(self.a(self.n(x))))


class _NoneArgs(_Blk):  # None among the arguments and the outputs
    def forward(self, x, mask=None):
        return super().forward(x), None


class _GradMode(_Blk):  # computes otherwise without grad
    def forward(self, x):
        y = super().forward(x)
        return y * 2 if torch.is_grad_enabled() else y


class _Scaled(_Blk):  # reads an attribute its parent sets before each call
    def forward(self, x):
        return super().forward(x) * self.scale


class _Appends(_Blk):  # writes into a list argument
    def forward(self, x, store):
        y = super().forward(x)
        store.append(y.mean())
        return y


class _Stashes(_Blk):  # sets an attribute its parent reads
    def forward(self, x):
        y = super().forward(x)
        self.last = y.mean()
        return y


class _PassesThrough(_Blk):  # returns its input, which the caller writes into
    def forward(self, x):
        return super().forward(x), x


class _ReturnsView(_Blk):  # returns a view of its input, which the caller writes into
    def forward(self, x):
        return super().forward(x), x.view(x.shape)


class _Blocks(nn.Module):
    def __init__(self, kind, how):
        super().__init__()
        self.blocks = nn.ModuleList([kind() for _ in range(3)])
        self.how = how
        for b in self.blocks:
            b.scale = 1.0
        if how == "swap":
            self.alt = nn.Linear(D, D)

    def _swapped(self, b, x):
        """``b``'s call with another submodule: for this call only ("swap"), or block 0's
        from now on ("tie")."""
        old, b.a = b.a, self.alt if self.how == "swap" else self.blocks[0].a
        x = b(x)
        if self.how == "swap":
            b.a = old
        return x

    def forward(self, x):
        store = []
        for i, b in enumerate(self.blocks):
            if self.how in ("swap", "tie") and i == 1:
                x = self._swapped(b, x)
            elif self.how == "none":
                x = b(x, None)[0]
            elif self.how == "no_grad":
                with torch.no_grad():
                    x = b(x)
            elif self.how == "autocast":
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    x = b(x).float()
            elif self.how == "scale":
                b.scale = 0.5**i
                x = b(x)
            elif self.how == "inner_eval":  # a submodule's mode changed, the block's not
                if i:
                    b.a.eval()
                x = b(x)
            elif self.how == "append":
                x = b(x, store)
            elif self.how == "alias":  # the write into skip reaches x
                x = x * 1
                y, skip = b(x)
                skip.mul_(2)
                x = y + x
            elif self.how == "alias_read":  # outputs that share storage, read only
                y, other = b(x)
                x = y + other.sum()
            elif self.how == "direct":
                x = b.forward(x)
            else:
                x = b(x)
        if self.how == "append":
            x = x + sum(store)
        if self.how == "stash":
            x = x + sum(b.last for b in self.blocks)
        return x


@pytest.mark.parametrize(
    "kind,how,copies",
    [
        (_NoneArgs, "none", 3),
        (_GradMode, "no_grad", 3),  # copies, in the call's grad mode
        (_Blk, "autocast", 0),
        (_Scaled, "scale", 1),  # block 0 keeps its planned attribute (an equal new float)
        (_Blk, "inner_eval", 1),  # blocks 1 and 2: a submodule's mode is not the planned one
        (_Appends, "append", 0),
        (_Stashes, "stash", 0),
        # the input itself: each call returns the caller's own tensor (the write reaches it)
        (_PassesThrough, "alias", 3),
        (_ReturnsView, "alias", 0),
        (_Blk, "direct", 0),
        # a submodule swapped in for one call (put back after it), or for good (tying block
        # 1's to block 0's): that call in full, the other two copies (a tester's finding: the
        # copy read the planned submodule's parameters, the gradient check's error 2e8, and
        # the tied weight's gradient sum was lost, 128 grad_accum FLOPs against 200)
        (_Blk, "swap", 2),
        (_Blk, "tie", 2),
    ],
)
def test_calls_that_cannot_be_copies_trace_as_in_full(kind, how, copies):
    """None arguments, a grad mode or autocast around the call, attributes set by the parent or
    by the block, list arguments written into, outputs that are views of inputs, forward
    called directly: the graph still equals full tracing's and computes what eager PyTorch
    does; so does a block returning its input itself, whose calls are copies."""
    import copy

    torch.manual_seed(0)
    model = _Blocks(kind, how)
    x = torch.randn(2, 5, D)
    full, once = (trace(copy.deepcopy(model), (x,), loss="none", reuse=r) for r in (False, True))
    assert once.meta[OUTLINED].calls == copies
    assert _ops(once) == _ops(full)
    params = dict(model.named_parameters())  # (before eager's run: "tie" drops b.1.a's)
    with torch.no_grad():
        want = model(x)
    got = _run(once, params, {}, x)[0]
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-5, atol=1e-5)
    if how in ("swap", "tie"):
        (why,) = once.meta[OUTLINED].in_full
        assert why.endswith("(blocks.1): its attributes changed after the model was built")


@pytest.mark.parametrize(
    "kind,how,fake_runs",
    [
        (_Blk, "plain", 0),  # the template traced at the first call gives the outputs
        (_ReturnsView, "alias", 1),  # a view of its input: the fake run decides (refused)
        (_PassesThrough, "alias", 0),  # its input itself: no storage of its own
        (_Stashes, "stash", 1),  # sets an attribute: the fake run decides (refused)
    ],
)
def test_first_call_traces_the_template_in_place_of_the_fake_run(kind, how, fake_runs, monkeypatch):
    """A call's first run traces its template there and then, its outputs' metadata taken
    from it, and runs the module on fake tensors (under ``routed_again``, which only that run
    enters) only where the template's trace finds what that run decides on; the graph is full
    tracing's either way."""
    import copy

    torch.manual_seed(0)
    model = _Blocks(kind, how)
    x = torch.randn(2, 5, D)
    full = trace(copy.deepcopy(model), (x,), loss="none", reuse=False)
    runs = []
    routed = repeats.routed_again
    monkeypatch.setattr(repeats, "routed_again", lambda: runs.append(1) or routed())
    once = trace(copy.deepcopy(model), (x,), loss="none", reuse=True)
    assert len(runs) == fake_runs
    assert _ops(once) == _ops(full)


class _NoGradInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        with torch.no_grad():
            y = self.a(x)
        return self.b(x) + y


def test_template_traced_at_the_first_call_tags_its_no_grad_nodes():
    """The template traced inside the main trace (at the first call, below the repeat op's
    ``Function.apply``) tags the nodes its forward makes under ``no_grad`` as full tracing
    does: each block's ``self.a`` (a permute of the weight and an addmm), 3 blocks."""
    from graphflop.meta import NO_GRAD

    torch.manual_seed(0)
    model = nn.Sequential(*[_NoGradInside() for _ in range(3)])
    x = torch.randn(2, D)
    tagged = []
    for reuse in (False, True):
        gm = trace(model, (x,), loss="sum", reuse=reuse)
        tagged.append([n.name for n in gm.graph.nodes if n.meta.get(NO_GRAD)])
    assert gm.meta[OUTLINED].calls == 3
    assert tagged[1] == tagged[0]
    assert len(tagged[1]) == 3 * 2


class _ReturnsTwice(_Blk):  # one tensor returned twice
    def forward(self, x):
        y = super().forward(x)
        return y, y


class _ReturnsItsTranspose(_Blk):  # a tensor and a view of it (a tester's ``(y, y.t())``)
    def forward(self, x):
        y = super().forward(x)
        return y, y.transpose(1, 2)


class _ReturnsItsSlice(_Blk):  # a tensor and a slice of it
    def forward(self, x):
        y = super().forward(x)
        return y, y[..., : D // 2]


class _ReturnsViewFirst(_Blk):  # a view of the second output, first
    def forward(self, x):
        y = super().forward(x)
        return y.view(y.shape), y


@pytest.mark.parametrize(
    "kind,how,copies",
    [
        (_ReturnsTwice, "alias", 0),
        (_ReturnsItsTranspose, "alias", 0),
        (_ReturnsItsSlice, "alias", 0),
        (_ReturnsViewFirst, "alias", 0),
        (_ReturnsItsTranspose, "alias_read", 3),
    ],
)
def test_blocks_returning_outputs_that_share_storage(kind, how, copies):
    """A block's outputs that share storage, the caller writing through the second and
    reading the first (``_Blocks`` "alias": in eager the write reaches the first): copies
    return fresh, unrelated tensors and would lose the write (a tester's finding on two
    blocks returning ``(y, y.t())``: forward 2,541 FLOPs against full tracing's 2,573, the
    gradient check's error 0.51). Traced in full, with the reason; read only, copied. Either
    way the graph and its FLOPs are full tracing's, its values eager PyTorch's, and its
    gradients eager autograd's."""
    import copy

    from graphflop.ad.vjp import build_vjp
    from graphflop.runtime.verify import verify_gradients

    torch.manual_seed(0)
    model = _Blocks(kind, how).double()
    x = torch.randn(2, 5, D, dtype=torch.float64)
    full, once = (trace(copy.deepcopy(model), (x,), loss="sum", reuse=r) for r in (False, True))
    info = once.meta[OUTLINED]
    assert info.calls == copies
    why = ["returns outputs that share storage, one written into"] if not copies else []
    assert [w.split(": ", 1)[1] for w in info.in_full] == why
    assert _ops(once) == _ops(full)
    assert total_cost(annotate_flops(once).graph.nodes) == total_cost(
        annotate_flops(full).graph.nodes
    )
    with torch.no_grad():
        want = model(x).sum()
    got = _run(once, dict(model.named_parameters()), {}, x)[0]
    torch.testing.assert_close(got, want)
    if kind is _ReturnsItsTranspose:  # (the gradient check twice: 0.3 s each)
        check = verify_gradients(once, build_vjp(once), model, examples=(x,))
        assert check.ran and check.ok, check.line()


def _hooked(where: str):
    """Three blocks with forward hooks that change what a call computes: on each block (a
    pre-hook scaling its input by 3, a hook doubling its output and recording it), or on
    each block's first Linear (doubling its output)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[_Blk() for _ in range(3)])
    seen: list = []
    for b in model:
        if where == "block":
            b.register_forward_pre_hook(lambda m, args: (args[0] * 3,))
            b.register_forward_hook(lambda m, args, out: seen.append(out * 2) or seen[-1])
        else:
            b.a.register_forward_hook(lambda m, args, out: out * 2)
    return model, seen


@pytest.mark.parametrize("where,copies", [("block", 3), ("inner", 0)])
def test_forward_hooks_run_at_each_call(where, copies):
    """A block's own forward hooks run at each of its calls, around the copy, as eager
    PyTorch runs them (what they record is the call's own tensors); a hook inside the block
    would run only in the template: that block is traced in full."""
    x = torch.randn(2, 5, D)
    full_model, _ = _hooked(where)
    full = trace(full_model, (x,), loss="none", reuse=False)
    model, seen = _hooked(where)
    once = trace(model, (x,), loss="none")
    assert once.meta[OUTLINED].calls == copies
    assert _ops(once) == _ops(full)
    # once per call: not again in the call's fake run or its template's trace
    assert len(seen) == (3 if where == "block" else 0)
    seen.clear()
    with torch.no_grad():
        want = model(x)
    assert len(seen) == (3 if where == "block" else 0)
    got = _run(once, dict(model.named_parameters()), {}, x)[0]
    torch.testing.assert_close(got, want)


def test_shared_submodules_keep_their_first_path_and_stay_parameters():
    """A submodule shared by the blocks is named by its first path, as full tracing names it;
    a module reachable twice keeps its Parameters after tracing (functional_call does not put
    them back)."""
    shared = nn.Linear(D, D)
    model = nn.Sequential(*[nn.Sequential(nn.LayerNorm(D), shared, nn.ReLU()) for _ in range(3)])
    x = torch.randn(2, D)
    full, once = _same_graph(model, x, loss="none")
    assert once.meta[OUTLINED].calls == 3
    assert {n.meta[MODULE] for n in once.graph.nodes if "addmm" in str(n.target)} == {"0.1"}
    twice = nn.Sequential(shared, nn.ReLU(), shared)
    for _ in range(2):
        trace(twice, (x,), loss="none")
        assert isinstance(twice[0].weight, nn.Parameter)


def test_walk_gives_the_paths_modules_and_parameters_of_the_model_s_own_walks():
    """:class:`repeats.Walk` (one walk shared by a trace attempt) gives what each reader walked
    the model for: a shared submodule at its first path (as ``named_modules(remove_duplicate=
    False)``'s first), its inner modules too, each module and parameter once."""
    shared = nn.Sequential(nn.Linear(D, D), nn.ReLU())
    model = nn.Sequential(nn.LayerNorm(D), shared, nn.Sequential(shared, nn.Tanh()))
    walk = repeats.Walk(model)
    # worked out by hand: shared is model.1 (again at model.2.0), its Linear model.1.0
    expected = {
        id(model): "model",
        id(model[0]): "model.0",
        id(shared): "model.1",
        id(shared[0]): "model.1.0",
        id(shared[1]): "model.1.1",
        id(model[2]): "model.2",
        id(model[2][1]): "model.2.1",
    }
    assert walk.paths("model") == expected
    assert walk.modules == list(model.modules())
    assert [n for n, _ in walk.named("_parameters")] == [
        "0.weight",
        "0.bias",
        "1.0.weight",
        "1.0.bias",
    ]
    assert walk.named("_buffers") == []
    # after the model's code ran: the same walk where its tree is as walked, else a new one
    assert walk.after() is walk
    model[2][1] = nn.ReLU()  # another module at model.2.1
    again = walk.after()
    assert again is not walk and again.paths("model")[id(model[2][1])] == "model.2.1"
    # a trace attempt plans and outlines from it as from its own walks
    blocks = nn.Sequential(
        *[nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D)) for _ in range(3)]
    )
    walk = repeats.Walk(blocks)
    chosen = repeats.plan(blocks, walk=walk)
    assert chosen == repeats.plan(blocks) and len(chosen) == 3
    assert all(id(m) in walk.memo for m in blocks.modules() if m is not blocks)


def test_walk_of_a_tree_holding_a_scripted_module():
    """Tester's finding: a model holding ``torch.jit.script(Sub())`` crashed the walk with
    ``KeyError: 0`` (a TorchScript module's ``_modules`` is a wrapper of a C++ table, which
    does not iterate by key). The walk now reads it by ``keys()`` and walks such a tree as
    ``named_modules`` does; the trace refuses the scripted module in one line."""
    model = nn.Sequential(torch.jit.script(nn.Sequential(nn.Linear(D, D))), nn.ReLU())
    walk = repeats.Walk(model)
    # by hand: root, the scripted Sequential at 0, its scripted Linear at 0.0, the ReLU at 1
    assert [n for n, _ in walk.tree] == ["", "0", "0.0", "1"]
    assert not walk.plain and walk.modules == list(model.modules())
    assert [n for n, _ in walk.named("_parameters")] == ["0.0.weight", "0.0.bias"]
    with pytest.raises(graphflop.TraceError, match="submodule 0 is a TorchScript module"):
        trace(model, (torch.randn(2, D),), loss="none")
    # a scripted root is refused so too, before the model is called (the call with its slots
    # holding the traced tensors, trace._state_slots, no longer looks for one; torch.jit.trace's
    # modules are ScriptModules too, refused alike, not run here: its first use takes 1.5 s)
    with pytest.raises(graphflop.TraceError, match="^the model is a TorchScript module"):
        trace(torch.jit.script(nn.Linear(D, D)), (torch.randn(2, D),), loss="none")


def test_instance_norm_running_statistics_are_buffer_updates():
    """Tester's finding: instance norm with running statistics writes them through ``alias``
    in its C++ kernel and into a repeated temporary in batch norm's decomposition: both
    ``copy_`` stayed in the graph without a rule (a warning; the statistics were not updated).
    They are now the graph's buffer updates, equal to eager's after one training step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.InstanceNorm2d(4, track_running_stats=True))
    x = torch.randn(2, 3, 6, 6)
    gm = trace(model.train(), (x,), loss="sum")
    assert not [n for n in gm.graph.nodes if n.target is torch.ops.aten.copy_.default]
    sig = gm.meta[SIGNATURE]
    assert [q for _, q in sig.buffer_updates] == ["1.running_mean", "1.running_var"]
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    got = _run(gm, params, buffers, x)
    model(x)  # eager: updates the running statistics in place
    torch.testing.assert_close(got[0], model[1].running_mean)
    torch.testing.assert_close(got[1], model[1].running_var)


def test_kernel_function_modules_do_not_split_a_structure():
    """transformers' Llama attention keeps a per-instance dict of stateless function modules
    (the ``kernels`` library's ``_kernel_funcs``): equal in structure, so the whole decoder
    layer is outlined (not just its MLP) and the graph still equals full tracing's."""
    from graphflop.load import load, make_inputs

    cfg = dict(
        num_hidden_layers=3,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=50,
    )
    loaded = load("hf:llama-3.1-8b", ctor_kwargs=cfg, meta=True, seq=8)
    model = loaded.model.train()
    (x,) = make_inputs(loaded, batch=2)
    layers = model.model.layers
    assert repeats.structure(layers[0]) == repeats.structure(layers[1])
    assert set(repeats.plan(model)) == set(layers)  # the decoder layers, outermost
    full = trace(model, (x,), reuse=False)
    once = trace(model, (x,))
    assert once.meta[OUTLINED] == OutlineInfo(calls=3, traced_once=1)
    assert _ops(once) == _ops(full)


def test_a_module_with_state_in_a_dict_keeps_its_identity():
    """A module with a parameter kept in a plain dict attribute is not a structure key: two
    such attributes of different modules differ (their weights could)."""
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    assert repeats._attr_key({"f": a}) != repeats._attr_key({"f": b})
    assert repeats._attr_key({"f": nn.ReLU()}) == repeats._attr_key({"f": nn.ReLU()})


#: the linear layer every block calls besides its own (:class:`_Reaching`), by route
_SHARED: dict[str, nn.Module] = {}


class _Reaching(nn.Module):
    """A block that calls a linear layer that is not its submodule: one it holds as a plain
    attribute, or (none held) the module-level one in :data:`_SHARED`."""

    def __init__(self, shared: nn.Module | None):
        super().__init__()
        if shared is not None:
            self.__dict__["shared"] = shared  # not a submodule
        self.fc1 = nn.Linear(16, 16)
        self.act = nn.Tanh()
        self.fc2 = nn.Linear(16, 16)

    def forward(self, x):
        shared = vars(self).get("shared") or _SHARED["lin"]
        return x + self.fc2(self.act(shared(self.fc1(x))))


class _ReachingNet(nn.Module):
    """4 :class:`_Reaching` blocks and a head. ``route``: ``"attribute"``, the blocks hold
    the parent's ``shared`` as a plain attribute (a tester's model); ``"first block"``, they
    hold block 0's ``fc1`` so (a module inside the first call's tree: its template read it as
    that call's own, and each copy read its own ``fc1``); ``"global"``, they call the
    parent's ``shared`` through a global."""

    def __init__(self, route: str):
        super().__init__()
        if route != "first block":
            self.shared = nn.Linear(16, 16)
            _SHARED["lin"] = self.shared
        held = self.shared if route == "attribute" else None
        self.blocks = nn.ModuleList(_Reaching(held) for _ in range(4))
        if route == "first block":
            for b in self.blocks:
                b.__dict__["shared"] = self.blocks[0].fc1
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


@pytest.mark.parametrize(
    "route,device,why",
    [
        ("attribute", "meta", "its attribute shared holds a Linear"),
        ("first block", "meta", "its attribute shared holds a Linear"),
        ("first block", "cpu", "its attribute shared holds a Linear"),
        ("global", "meta", "its forward reads shared.weight, a parameter or buffer of a module"),
    ],
)
def test_blocks_reaching_a_module_outside_their_own_are_traced_in_full(route, device, why):
    """A tester's finding: blocks calling a Linear held as a plain attribute (registered on the
    parent), built on the meta device, failed to trace ("FakeTensorDeviceMismatchError: ...
    cpu and meta"): the templates were traced after the model's call, the parent's weight a
    meta tensor again. Such blocks are traced in full, with why, and every figure of the
    report is --no-outline's; one holding a module of the first block's was outlined, each
    copy calling its own fc1 instead (the graph not full tracing's, on any device)."""
    from graphflop.analysis import analyze

    x = torch.randn(4, 16)
    with torch.device(device):
        model = _ReachingNet(route)
    once = analyze(model, x, loss="sum")
    full = analyze(model, x, loss="sum", outline=False)
    assert once.report.to_dict() == full.report.to_dict()
    # 4 blocks × (3 linears × (2·4·16·16 + 4·16 bias) + 64 tanh + 64 residual adds) + the
    # head's 2·4·16·5 + 20 + the sum's 20 (one per element, graphflop's count for a sum)
    assert once.report.totals.forward.flops == 4 * (3 * (2048 + 64) + 64 + 64) + 660 + 20
    assert _ops(once.forward) == _ops(full.forward)
    info = once.forward.meta[OUTLINED]
    assert info.calls == 0
    assert len(info.in_full) == 1 and why in info.in_full[0], info.in_full
    assert info.in_full[0].startswith("_Reaching ×4 (blocks.0, blocks.1, …, blocks.3): ")


def _flat_rows(gm):
    """Every node's name, op, target, arguments (nodes by name) and annotations (tensors by
    shape, strides, dtype, device and requires_grad), then the graph's signature and unused
    cost: all that a single copy of each node must give as two copies did."""

    def value(v):
        if isinstance(v, torch.Tensor):
            return ("T", tuple(v.shape), v.stride(), v.dtype, v.device, v.requires_grad)
        if isinstance(v, torch.fx.Node):
            return ("N", v.name)
        if isinstance(v, (list, tuple)):
            return (type(v).__name__, tuple(value(x) for x in v))
        if isinstance(v, dict):
            return ("d", tuple((k, value(x)) for k, x in v.items()))
        return repr(v)

    rows = [
        (n.name, n.op, str(n.target), value(n.args), value(n.kwargs))
        + tuple(sorted((k, value(v)) for k, v in n.meta.items() if k != "stack_trace"))
        for n in gm.graph.nodes
    ]
    return rows, repr(gm.meta[SIGNATURE]), repr(gm.meta[OUTLINED])


def _hf_llama():
    pytest.importorskip("transformers")
    from graphflop.load import load, make_inputs

    small = dict(
        num_hidden_layers=3,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=50,
    )
    loaded = load("hf:llama", ctor_kwargs=small, meta=True, seq=6)
    return loaded.model.train(), tuple(make_inputs(loaded)), {}


def _resnet18():
    from graphflop.load import load, make_inputs

    loaded = load(str(ROOT / "models" / "resnet.py") + ":resnet18", meta=True)
    return loaded.model.train(), tuple(make_inputs(loaded, batch=2)), {}


def _fresh_region_numbers(monkeypatch):
    """The process-wide region numbers (fused attention, checkpoints, Functions) restarted, as
    a fresh process would number them, so two traces in one test name their regions alike."""
    import itertools

    from graphflop.frontend import composite, custom_function, regions, replay

    monkeypatch.setattr(composite, "_attention_regions", itertools.count(-1, -1))
    monkeypatch.setattr(replay, "_REPLAYED_ATTENTION", itertools.count(-(10**9), -1))
    ids = itertools.count()
    monkeypatch.setattr(regions, "region_ids", ids)
    monkeypatch.setattr(custom_function, "region_ids", ids)


@pytest.mark.parametrize(
    "make",
    [
        lambda: (_gpt2().train(), (torch.randint(0, 11, (2, 6)),), {}),
        # batch norm's running statistics: buffer writes inside the template and after it
        lambda: (nn.Sequential(_Block(), _Block(), _Block()).train(), (torch.randn(5, 4),), {}),
        _resnet18,
        _hf_llama,
    ],
    ids=["gpt2", "batch_norm_blocks", "resnet18", "hf_llama"],
)
def test_one_copy_per_node_gives_the_two_copies_graph(make, monkeypatch):
    """Each template node is copied once, straight into graphflop's graph where its call
    stood; the flat graph is the one copying it into make_fx's graph first (``inline``) and
    then into graphflop's gave: node for node, names, arguments and annotations included
    (the names appear in reports)."""
    from graphflop.frontend import trace as tracing

    def traced():
        _fresh_region_numbers(monkeypatch)
        return trace(model, inputs, **kw)

    model, inputs, kw = make()
    once = traced()
    monkeypatch.setattr(tracing, "_flat_form", tracing._flat_form_twice)
    twice = traced()
    assert once.meta[OUTLINED].calls >= 2  # blocks were outlined, so copies were made
    assert _flat_rows(once) == _flat_rows(twice)


class _Checkpointed(nn.Module):
    """Three blocks each run under ``torch.utils.checkpoint`` (their copies take the call's
    checkpoint tags)."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.blocks = nn.ModuleList(_Mlp() for _ in range(3))
        self.reentrant = reentrant

    def forward(self, x):
        for b in self.blocks:
            x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=self.reentrant)
        return x


class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


class _PassThrough(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _UnderUserMode(nn.Module):
    """Blocks called inside a torch-function mode of the model's own: graphflop cannot know
    what such a mode does with the ``repeat`` op, so every call is dispatched."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_Mlp() for _ in range(3))

    def forward(self, x):
        with _PassThrough():
            for b in self.blocks:
                x = b(x)
        return x


def _spec_model(name: str, batch: int = 2):
    from conftest import spec

    from graphflop.load import load, make_inputs

    loaded = load(spec(name) if ":" not in name or name.startswith("resnet") else name, meta=True)
    return loaded.model.train(), tuple(make_inputs(loaded, batch=batch)), {}


#: the models of this file's and test_hierarchy.py's default tests: (make, whether every call
#: after a call's first is recorded without the op's dispatch)
_DIRECT_CASES = {
    "gpt2": (lambda: (_gpt2().train(), (torch.randint(0, 11, (2, 6)),), {}), True),
    "gpt2_eval": (lambda: (_gpt2().eval(), (torch.randint(0, 11, (2, 6)),), {}), True),
    "batch_norm_blocks": (
        lambda: (nn.Sequential(_Block(), _Block(), _Block()).train(), (torch.randn(5, 4),), {}),
        True,
    ),
    # a block writing a buffer of its own: outlined, then traced in full (the template's
    # trace sees the write)
    "counting_buffer": (
        lambda: (nn.Sequential(_Counting(), _Counting(), _Counting()), (torch.randn(5, 4),), {}),
        True,
    ),
    "resnet18": (_resnet18, True),
    "hf_llama": (_hf_llama, True),
    "checkpointed": (lambda: (_Checkpointed(False), (torch.randn(5, 4),), {}), True),
    "checkpointed_reentrant": (lambda: (_Checkpointed(True), (torch.randn(5, 4),), {}), True),
    "user_mode": (lambda: (_UnderUserMode(), (torch.randn(5, 4),), {}), False),
    **{
        name: (lambda name=name: _spec_model(name), True)
        for name in ("mlp.py", "cnn.py", "convnet.py", "lora.py", "vit.py", "resnet.py:resnet18")
    },
    **{
        name: (lambda name=name: _spec_model(name), True)
        for name in ("torchvision:resnet18", "torchvision:mobilenet_v3_small")
    },
}


@pytest.mark.parametrize("case", list(_DIRECT_CASES))
def test_calls_recorded_without_dispatch_give_the_dispatched_graph(case, monkeypatch):
    """A call of a block whose first call was traced is recorded without the ``repeat`` op's
    dispatch (``outline.DIRECT_CALLS``): the flat graph is the one dispatching every call
    gives, node for node (names, arguments, every annotation), and so are its signature and
    outline counts. Every call after a distinct call's first takes that path, except under a
    torch-function mode graphflop does not know, where all are dispatched."""
    if case.startswith("torchvision:"):
        pytest.importorskip("torchvision")
    make, recorded = _DIRECT_CASES[case]
    direct = [0]
    inner = repeats.Outliner._direct

    def counted(self, *args):
        out = inner(self, *args)
        direct[0] += out is not None
        return out

    def started(self, *args, **kwargs):  # a trace started again counts afresh
        direct[0] = 0
        init(self, *args, **kwargs)

    init = repeats.Outliner.__init__
    monkeypatch.setattr(repeats.Outliner, "_direct", counted)
    monkeypatch.setattr(repeats.Outliner, "__init__", started)

    def traced(on: bool):
        _fresh_region_numbers(monkeypatch)
        monkeypatch.setattr(repeats, "DIRECT_CALLS", on)
        return trace(model, inputs, **kw), direct[0]

    model, inputs, kw = make()
    dispatched, none = traced(False)
    recorded_gm, n = traced(True)
    assert none == 0
    info = recorded_gm.meta[OUTLINED]
    if recorded and repeats._RECORDABLE:  # a PyTorch without what it takes dispatches all
        assert n == info.calls - info.traced_once
    else:
        assert n == 0 and info.calls > info.traced_once
    assert _flat_rows(recorded_gm) == _flat_rows(dispatched)


@pytest.mark.parametrize("case", ["gpt2", "batch_norm_blocks", "resnet18", "hf_llama", "vit.py"])
@pytest.mark.parametrize("direct", [False, True])
def test_traces_without_make_fx_function_notes_give_the_same_graph(case, direct, monkeypatch):
    """``make_fx``'s torch-function notes (``trace.FUNCTION_METADATA``) are left off: the flat
    graph is the one tracing with them gives, node for node and every annotation."""
    from graphflop.frontend import trace as tracing

    make, _ = _DIRECT_CASES[case]
    monkeypatch.setattr(repeats, "DIRECT_CALLS", direct)

    def traced(notes: bool):
        _fresh_region_numbers(monkeypatch)
        monkeypatch.setattr(tracing, "FUNCTION_METADATA", notes)
        return trace(model, inputs, **kw)

    model, inputs, kw = make()
    assert _flat_rows(traced(False)) == _flat_rows(traced(True))


class _SiameseNorm(nn.Module):
    """One training-mode batch norm called twice (a siamese net's shared norm), no block
    repeated: the tester's m24."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.bn = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        x = self.bn(self.fc(x))
        x = self.bn(torch.relu(x))
        return self.head(x)


def test_batch_norm_called_twice_writes_its_running_statistics_as_eager():
    """Tester's finding: a training-mode batch norm called twice left the second call's
    running-statistics writes in the graph as ``copy_`` nodes without a rule (a warning, phases
    incomplete; ``--strict``: an error), and the buffer updates were the first call's values.
    functionalization writes the second call's statistics into the first ``copy_``'s result
    (which is the buffer); the write is told through it, so both calls' writes are buffer
    updates, the second reading the first's (as eager does). Figures by hand (N = 6·16 = 96
    elements, C = 16 channels): fc 2·6·16·16 + 96 = 3,168; bn per call 6N + 11C = 752
    (docs/flops_conventions.md) plus num_batches_tracked += 1: 2·753 = 1,506; ReLU 96; head
    2·6·16·5 + 30 = 990. Gradients against torch.func.grad (float64; under a sum the gradients
    of the parameters before the norms are rounding noise: cross-entropy). The memory figures
    against eager: the next test."""
    from graphflop.analysis import analyze
    from graphflop.ops import strict_rules
    from graphflop.runtime.verify import copy_model, verify_gradients

    torch.manual_seed(0)
    model = _SiameseNorm().train()
    x = torch.randn(6, 16)
    gm = trace(model, (x,), loss="sum")
    assert not [n for n in gm.graph.nodes if n.target is torch.ops.aten.copy_.default]
    sig = gm.meta[SIGNATURE]
    assert [q for _, q in sig.buffer_updates] == [
        "bn.running_mean",
        "bn.running_var",
        "bn.num_batches_tracked",
    ]
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    got = _run(gm, params, buffers, x)
    model(x)  # eager: both calls update the statistics in place, the second after the first
    assert int(model.bn.num_batches_tracked) == 2
    torch.testing.assert_close(got[0], model.bn.running_mean)
    torch.testing.assert_close(got[1], model.bn.running_var)
    assert int(got[2]) == 2

    torch.manual_seed(0)
    model, x = _SiameseNorm().double().train(), x.double()  # float64: the gradient check's
    with strict_rules(True):  # raised MissingRuleError for copy_ before
        a = analyze(copy_model(model), (x,), jvp=False)  # cross-entropy on the 6 × 5 logits
    rows = {r.name: r.forward_flops for r in a.report.layers}
    assert rows["fc"] == 2 * 6 * 16 * 16 + 96 == 3_168
    assert rows["bn"] == 2 * (6 * 96 + 11 * 16 + 1) == 1_506
    assert rows["(model)"] == 96  # the ReLU between the calls
    assert rows["head"] == 2 * 6 * 16 * 5 + 30 == 990
    assert a.report.totals.forward.complete and a.report.totals.backward.complete
    # (fc.bias's gradient is 0 in exact arithmetic, the norm taking out the mean: rounding
    # noise, 1e-8 of the floor 1024·eps·‖∇L‖)
    f = a.flat()
    check = verify_gradients(f.forward, f.backward, copy_model(model), tolerance=1e-7)
    assert check.dtype == "float64" and check.ok, check


@pytest.mark.slow  # (moved out of the default suite: its 300 s budget)
def test_batch_norm_called_twice_memory_against_eager():
    """The siamese norm's saved-for-backward bytes equal eager's (saved_tensors_hooks) and its
    train peak a measured eager step's (in float32: 1,964 B saved; peak 4,720 B predicted,
    4,776 B measured; both unchanged by the writes' fix: a ``copy_`` had no storage of its
    own)."""
    from graphflop.analysis import analyze
    from graphflop.runtime.memory_probe import measure_saved, measure_train_peak
    from graphflop.runtime.verify import copy_model

    torch.manual_seed(0)
    model, x = _SiameseNorm().train(), torch.randn(6, 16)
    mem = analyze(copy_model(model), (x,), jvp=False).report.memory
    saved = measure_saved(copy_model(model), (x,))
    measured = measure_train_peak(copy_model(model), (x,))
    assert mem.saved_for_backward_bytes == saved == 1_964
    assert abs(mem.train_peak_bytes / measured - 1) < 0.02, (mem.train_peak_bytes, measured)


def test_outlined_batch_norm_blocks_analyze_under_strict_rules():
    """A training-mode batch norm inside outlined blocks: the template keeps its
    running-statistics ``copy_`` into its placeholders (the buffer writes, which no call
    copies: the flat graph returns the values written), and costing the template looked its
    rule up, so ``inspect --strict`` failed on every such model (the tester's m06: ``no
    cost/jvp/transpose rule for aten.copy_.default (node copy_)``, exit 2) while the
    non-strict report had no gap. The write costs nothing; the strict report is the plain one,
    complete."""
    from graphflop.analysis import analyze
    from graphflop.ops import strict_rules

    torch.manual_seed(0)
    model, x = nn.Sequential(_Block(), _Block(), _Block()).train(), torch.randn(5, 4)
    plain = analyze(model, (x,), loss="sum", jvp=False)
    assert plain.forward.meta[OUTLINED].calls == 3
    with strict_rules(True):
        strict = analyze(model, (x,), loss="sum", jvp=False)
    assert strict.report.to_dict() == plain.report.to_dict()
    assert not strict.report.uncounted and strict.report.totals.forward.complete


class _GruBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.fc = nn.GRU(4, 4, batch_first=True), nn.Linear(4, 4)

    def forward(self, x):
        return x + self.fc(self.rnn(x)[0])


def test_repeated_recurrent_blocks_are_named_as_traced_in_full():
    """Three identical blocks holding a GRU are traced in full (the GRU reads its weights
    from ``_flat_weights``, its own list, which a template cannot stand for): the report
    names the group and why (a tester's finding: traced in full, named nowhere)."""
    model = nn.Sequential(_GruBlock(), _GruBlock(), _GruBlock())
    info = trace(model, (torch.randn(2, 3, 4),), loss="sum").meta[OUTLINED]
    assert info.calls == 0
    assert info.in_full == ("_GruBlock ×3 (0, 1, 2): " + repeats.OWN_RNN_WEIGHTS.format("GRU"),)
    assert "recurrent layer (GRU)" in info.in_full[0]


def test_holds_tensors_after_its_types_are_remembered_and_walk_holders_after_code_ran():
    """:func:`repeats.holds_tensors` remembers the attribute types it found not tensors: a
    tensor attribute set later is still seen (a plain Linear holds none: its weight and bias
    are parameters), as is a value whose own ``__class__`` says Tensor (never remembered);
    a :class:`repeats.Walk`'s holders are looked at again after :meth:`repeats.Walk.after`."""
    m = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    assert not repeats.holds_tensors(m[0])
    assert not repeats.holds_tensors(m[0])  # (its types remembered now)
    walk = repeats.Walk(m)
    assert walk.holders() == []
    m[0].scale = torch.ones(2)  # what a forward may do: a tree unchanged, a tensor attribute
    assert repeats.holds_tensors(m[0])
    assert walk.holders() == []  # (before the model's code ran: as walked)
    assert walk.after() is walk and walk.holders() == [m[0]]

    class Posing:
        __class__ = torch.Tensor  # type: ignore[assignment]

    del m[0].scale
    m[1].x = Posing()
    assert isinstance(m[1].x, torch.Tensor)  # (what isinstance says of it)
    assert repeats.holds_tensors(m[1]) and repeats.holds_tensors(m[1])
    assert Posing not in repeats._NOT_TENSOR
