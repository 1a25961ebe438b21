"""The hierarchical analysis (each outlined block's template costed and rolled up once, then
composed over its calls) gives every figure the flat analysis gives: totals by role, per-module
rows, memory peaks and per-op tables, on the models of ``models/`` and the zoo's (the large
ones marked slow)."""

from __future__ import annotations

import operator

import pytest
import torch
from conftest import ConvRes, node_rows, spec
from torch import nn
from torch.utils.checkpoint import checkpoint

from graphflop.ad.jvp import build_jvp
from graphflop.analysis import analyze
from graphflop.frontend.hierarchy import expand
from graphflop.load import load, make_inputs
from graphflop.meta import (
    CALL_SITE,
    COST,
    DERIVED_HIERARCHY,
    HIERARCHY,
    JVP,
    JVP_LOG,
    KIND,
    LINEARIZED,
    MODULE,
    OUTLINED,
    PARAM,
    PARAM_DERIVED,
    ROLE,
    SOURCE,
    VJP,
)
from graphflop.ops import has_rule, op_name
from graphflop.passes import calls, memory, memory_calls
from graphflop.passes.autodiff import BuildJvp, BuildVjp
from graphflop.passes.eager_memory import (
    eager_jvp_schedule,
    eager_residuals,
    eager_saved_storages,
    eager_train_schedule,
)
from graphflop.passes.flops import AnnotateFlops, flat_costs
from graphflop.passes.infra import run_passes
from graphflop.passes.memory import Step, forward_schedule
from graphflop.passes.summary import Graphs, summarize


def _flat_report(a):
    """The report summed node by node over the flat graphs (no hierarchy)."""
    g = Graphs(a.forward, a.backward, a.update, a.jvp, a.forward_gradient, a.activity_gradient)
    r = a.report
    return summarize(
        g,
        name=r.model,
        optimizer=r.optimizer or "sgd",
        tangents=r.totals.jvp.tangents if r.totals.jvp is not None else "params",
        memory_model=r.memory.memory_model,
        device=r.memory.device,
        keep_grads=r.memory.keep_grads,
        hierarchical=False,
    )


def _nodes(gm):
    """Every node as :func:`conftest.node_rows` has it, with its module path (a call's)."""
    return node_rows(gm, lambda n: (n.meta.get(MODULE) if n.op == "call_function" else None,))


def _derivative_nodes(gm):
    """:func:`_nodes` with each node's role, kind, forward source, name, FLOPs and
    ``PARAM_DERIVED``."""
    return [
        (
            *row,
            n.meta.get(ROLE),
            n.meta.get(KIND),
            n.meta.get(SOURCE),
            n.name,
            n.meta.get(COST),
            n.meta.get(PARAM_DERIVED),
        )
        for row, n in zip(_nodes(gm), gm.graph.nodes)
    ]


def _check_derivatives(a):
    """The JVP and backward graphs built per template (each block's derivative nodes built once
    per variant and expanded at its other calls) are the ones the rules give call by call,
    node for node: ops, arguments, shapes, modules, roles, sources, names, FLOPs; the same
    JVP log, residuals and gradients."""
    fwd = a.forward
    if a.jvp is not None:
        tangents = a.report.totals.jvp.tangents
        flat_jvp = run_passes(fwd, [BuildJvp(tangents, per_template=False), AnnotateFlops()])
        assert _derivative_nodes(a.jvp) == _derivative_nodes(flat_jvp)
        assert a.jvp.meta[JVP] == flat_jvp.meta[JVP]
        pos = {n: i for i, n in enumerate(a.jvp.graph.nodes)}
        flat_pos = {n: i for i, n in enumerate(flat_jvp.graph.nodes)}
        assert [pos.get(e) for e in a.jvp.meta[JVP_LOG]] == [
            flat_pos.get(e) for e in flat_jvp.meta[JVP_LOG]
        ]
    if a.backward is None:
        return
    lin = a.backward.meta[LINEARIZED]
    # the graph transposed, built call by call (for_transpose where the analysis rebuilt it)
    flat_lin = build_jvp(
        fwd,
        "params",
        for_transpose=lin is not a.jvp,
        per_template=False,
    )
    flat = run_passes(fwd, [BuildVjp(linearized=flat_lin, per_template=False), AnnotateFlops()])
    assert _derivative_nodes(a.backward) == _derivative_nodes(flat)
    assert a.backward.meta[VJP] == flat.meta[VJP]


def _stored_nodes(gm):
    """:func:`_nodes` with every annotation a call's node has relative to its block."""
    keys = (ROLE, KIND, SOURCE, PARAM, CALL_SITE)
    return node_rows(gm, lambda n: (n.meta.get(MODULE), *(n.meta.get(k) for k in keys)))


def _flat_sums(gm, keep, default_role):
    """Node by node over ``gm``: the kept nodes' costs summed, FLOPs by role, per module
    ``[flops, mm_flops, {role: flops}]`` in the order first met, per op ``(count, costs
    summed)``, and the rule-less nodes."""
    from graphflop.passes.flops import sum_costs

    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and keep(n)]
    by_role, rows, ops = {}, {}, {}
    for n in nodes:
        c, role = n.meta[COST], n.meta.get(ROLE, default_role)
        by_role[role] = by_role.get(role, 0) + c.flops
        row = rows.setdefault(n.meta.get(MODULE, ""), [0, 0, {}])
        row[0] += c.flops
        row[1] += c.mm_flops
        row[2][role] = row[2].get(role, 0) + c.flops
        if n.target is not operator.getitem:
            ops.setdefault(op_name(n.target), []).append(c)
    rule_less = sum(1 for n in nodes if n.target is not operator.getitem and not has_rule(n.target))
    ops = {k: (len(cs), sum_costs(cs)) for k, cs in ops.items()}
    return sum_costs(n.meta[COST] for n in nodes), by_role, rows, ops, rule_less


def _check_derived_hierarchies(a):
    """The JVP and backward graphs keep each block variant's derivative once, as a template
    the top level calls: the flat graph rebuilt from that alone is the analysed one, node for
    node, and the figures composed per template (totals by role, per-module rows, op table)
    are the flat graph's sums."""
    h = a.forward.meta.get(HIERARCHY)
    for gm, keep, role in (
        (a.jvp, lambda n: n.meta.get(KIND) in ("tangent", "coef"), "tangent_from_input"),
        (a.backward, lambda n: True, "grad_input"),
    ):
        if gm is None:
            continue
        dh = gm.meta.get(DERIVED_HIERARCHY)
        if h is None:
            assert dh is None
            continue
        assert dh is not None
        assert len(dh.templates) <= len(dh.calls) and sum(dh.uses()) == len(dh.calls)
        # fewer nodes at the top level than flat wherever a template is called twice
        top = len(dh.graph.graph.nodes)
        if max(dh.uses()) > 1:
            assert top < len(gm.graph.nodes)
        assert _stored_nodes(calls.expand(dh)) == _stored_nodes(gm)
        f = calls.derived_figures(dh, keep, role)
        total, by_role, rows, ops, rule_less = _flat_sums(gm, keep, role)
        assert f.total == total
        assert f.by_role == by_role
        assert f.rows == rows and list(f.rows) == list(rows)  # same rows in the same order
        assert f.ops == ops and list(f.ops) == list(ops)
        assert f.rule_less == rule_less


def _live_sites(h) -> list[int]:
    """The call sites of hierarchy ``h`` whose variant kept a node of the template (a call
    whose output nothing reads kept none: dead-code elimination removed the call)."""
    return [i for i, site in enumerate(h.sites) if h.variants[site.variant][1]]


def _check_memory(a):
    """The eager memory model's figures composed per call of each block (each template's steps
    worked out once) equal the flat schedules' to the byte, on cpu and cuda, with and without
    kept gradients: the train peak and the step where it first occurs, the storages saved for
    backward (owner and bytes), the forward peak, the eager JVP peak. The composed forward
    schedule calls each live site once (:func:`_live_sites`: a call whose every node
    dead-code elimination dropped, a block whose output nothing reads, has no call)."""
    fwd, bwd = a.forward, a.backward
    if a.jvp is not None:
        for device in ("cpu", "cuda"):
            jsched = eager_jvp_schedule(a.jvp, device, composed=True)
            if DERIVED_HIERARCHY in a.jvp.meta:
                assert isinstance(jsched, memory_calls.ComposedSchedule) and jsched.ties
            assert jsched.peak() == eager_jvp_schedule(a.jvp, device).peak(), device
    composed = memory_calls.composed_forward_schedule(fwd)
    if HIERARCHY in fwd.meta and fwd.meta[HIERARCHY].graph is not None:
        assert composed is not None
        calls = [x for x in composed.items if not isinstance(x, Step)]
        assert len(calls) == len(_live_sites(fwd.meta[HIERARCHY]))
        assert composed.peak() == forward_schedule(fwd).peak()
    if bwd is None:
        return
    for device in ("cpu", "cuda"):
        er = eager_residuals(fwd, bwd, device)
        for keep_grads in (False, True):
            flat = eager_train_schedule(fwd, bwd, "adam", device, keep_grads)
            sched = eager_train_schedule(fwd, bwd, "adam", device, keep_grads, composed=True)
            assert sched.peak() == flat.peak(), (device, keep_grads)
            if isinstance(sched, memory_calls.ComposedSchedule):
                saved = eager_saved_storages(fwd, bwd, device, eager=er, schedule=sched)
                assert saved == eager_saved_storages(fwd, bwd, device)
            elif DERIVED_HIERARCHY in bwd.meta or HIERARCHY in fwd.meta:
                # (a plain ATen op whose derivative saves values graphflop's rule does not
                # read, eager_memory.ATEN_SAVES: the flat schedule)
                flat_only = fwd.meta[HIERARCHY].graph is None and DERIVED_HIERARCHY not in bwd.meta
                assert flat_only or er.held


def _check(a):
    """The hierarchical report equals the flat one; every copied node's cost (taken from its
    template) equals the cost of the node on its own; the derivative graphs built per template
    equal those built call by call, and their stored hierarchies rebuild and sum to them; the
    memory figures composed per call equal the flat schedules'."""
    _check_derivatives(a)
    _check_derived_hierarchies(a)
    _check_memory(a)
    flat = _flat_report(a).to_dict()
    hier = a.report.to_dict()
    assert hier == flat
    assert list(hier["layers"]) == list(flat["layers"])  # same rows in the same order
    # (a composite op's parts: their rules' FLOPs, its one kernel's bytes: flat_costs)
    alone = flat_costs(a.forward.graph.nodes)
    for n in a.forward.graph.nodes:
        if n.op == "call_function":
            assert n.meta[COST] == alone[n], n.name
    h = a.forward.meta.get(HIERARCHY)
    info = a.forward.meta[OUTLINED]
    if info.calls:
        assert h is not None
        assert len(h.sites) == info.calls
        assert len(h.templates) == info.traced_once
        tagged = [n for n in a.forward.graph.nodes if CALL_SITE in n.meta]
        assert tagged
        if h.graph is not None:
            # the top level calls each live block: fewer nodes than the flat graph
            calls = [n for n in h.graph.graph.nodes if n.meta.get(CALL_SITE, (0, 0))[1] == -1]
            assert [n.meta[CALL_SITE][0] for n in calls] == _live_sites(h)
            # the flat graph rebuilt from the hierarchy alone is the traced one, node for node
            assert _nodes(expand(h)) == _nodes(a.forward)
    return h


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


class PoolBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Linear(8, 8)
        self.d = nn.Linear(8, 8)  # (a block of three modules or more is outlined)

    def forward(self, x):
        return x + self.d(nn.functional.avg_pool1d(self.c(x), 3, 1, 1))


class PoolStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(PoolBlock() for _ in range(3))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_blocks_with_average_pooling_hierarchical_equals_flat():
    # avg_pool1d's backward (avg_pool2d's) saves its input in eager (ATEN_SAVES): the report
    # composed per block equals the flat one
    torch.manual_seed(0)
    a = analyze(PoolStack(), (torch.randn(2, 4, 8),), name="pool_blocks")
    h = _check(a)
    assert h is not None and len(h.sites) == 3
    # per block: its input (c's input) 2·4·8·4 = 256, c's output (avg_pool's self) 256, the
    # pooled values (d's input) 256: 3 · 768 = 2304 B (saved_tensors_hooks measure the same)
    assert a.report.memory.saved_for_backward_bytes == 2304
    er = eager_residuals(a.forward, a.backward, "cpu")
    assert len(er.held) == 3  # each block's first Linear's output, saved for avg_pool2d


class PadActBlock(nn.Module):
    """Ops PyTorch's core-ATen table decomposes and whose decompositions tracing tags
    (reflection and replication padding, hardsigmoid, softshrink, threshold)."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(4, 4, 1)
        self.pad = nn.ReflectionPad2d(1)
        self.d = nn.Conv2d(4, 4, 3)
        self.act = nn.Hardsigmoid()
        self.e = nn.Conv2d(4, 4, 3, padding=1, padding_mode="replicate")

    def forward(self, x):
        h = self.act(self.d(self.pad(self.c(x))))
        return x + nn.functional.threshold(nn.functional.softshrink(self.e(h)), 0.1, 0.0)


class PadActStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(PadActBlock() for _ in range(3))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class ConvPoolBlock(nn.Module):
    """A convolution, an average pooling (``how``) and a 1x1 convolution, with a residual."""

    def __init__(self, how: str, c: int = 4) -> None:
        super().__init__()
        self.how = how
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(6) if how == "adaptive" else nn.AvgPool2d(3, 1, 1)
        self.act = nn.ReLU()
        self.proj = nn.Conv2d(c, c, 1)

    def forward(self, x):
        y = self.conv(x)
        if self.how == "functional":
            y = nn.functional.avg_pool2d(y, 3, 1, 1, count_include_pad=False)
        else:
            y = self.pool(y)
        return x + self.proj(self.act(y))


class ConvPoolStack(nn.Module):
    def __init__(self, how: str, n: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ConvPoolBlock(how) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_blocks_with_decomposed_padding_and_activations_hierarchical_equals_flat():
    # each op's decomposition is tagged with the op: eager saves its input (the padding's
    # whole, though its backward reads only its sizes); the report composed per block equals
    # the flat one and the bytes saved_tensors_hooks measure
    from graphflop.runtime.memory_probe import measure_saved

    torch.manual_seed(0)
    model, x = PadActStack(), torch.randn(2, 4, 6, 6)
    a = analyze(model, (x,), name="pad_act_blocks")
    _check(a)
    h = a.forward.meta[HIERARCHY]
    assert h is not None and len(h.sites) == 3
    # per block, 2·4·6·6·4 = 1152 B a value: its input (c's input), c's output (the reflection
    # padding's self), the padded values 2·4·8·8·4 = 2048 (d's input), d's output
    # (hardsigmoid's self), hardsigmoid's output (the replication padding's self), its padded
    # values 2048 (e's input), e's output (softshrink's self), softshrink's output (threshold's
    # self): 6 · 1152 + 2 · 2048 = 11008; 3 blocks 33024 B, the sum loss saves nothing
    assert measure_saved(model, (x,)) == 33024
    assert a.report.memory.saved_for_backward_bytes == 33024


def _drop_path(x, p):
    """timm's DropPath in training: a per-sample mask drawn in place into a new tensor."""
    mask = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(1 - p)
    return x * mask.div_(1 - p)


class SavesBlock(nn.Module):
    """Ops whose eager saves are not graphflop's residuals: composite in eager too (softsign,
    F.normalize: a division's quotient, which graphflop's rule reads, stands for its
    dividend), decomposed by graphflop only (mish, logsumexp, linalg_vector_norm: tagged), and
    DropPath's random mask (made from no input: an activation, not a constant)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)

    def forward(self, x):
        h = nn.functional.softsign(self.a(x)) * 2
        h = nn.functional.mish(self.b(h))
        h = nn.functional.normalize(h - h.logsumexp(-1, keepdim=True), dim=-1)
        return x + _drop_path(self.c(h), 0.25)


class SavesStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(SavesBlock() for _ in range(3))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_blocks_with_division_tagged_ops_and_drop_path_hierarchical_equals_flat():
    # the report composed per block equals the flat one and the bytes saved_tensors_hooks
    # measure
    from graphflop.runtime.memory_probe import measure_saved

    torch.manual_seed(0)
    model, x = SavesStack(), torch.randn(2, 4, 8)
    a = analyze(model, (x,), name="saves_blocks")
    _check(a)
    h = a.forward.meta[HIERARCHY]
    assert h is not None and len(h.sites) == 3
    # per block, 2·4·8·4 = 256 B a value: its input (a's), a's output (abs's and the
    # division's self), |h| + 1 (the division's other), b's input (the quotient times 2), b's
    # output (mish's self), mish's output (logsumexp's self), the difference (the norm's and
    # the division's self), c's input; 2·4·1·4 = 32 B: logsumexp's result, the norm
    # (clamp_min's self), the clamped norm (the division's other, expanded); the mask 2·4 = 8:
    # 8 · 256 + 3 · 32 + 8 = 2152; 3 blocks 6456 B, the sum loss saves nothing
    assert measure_saved(model, (x,)) == 6456
    assert a.report.memory.saved_for_backward_bytes == 6456


@pytest.mark.parametrize("how", ["module", "functional", "adaptive"])
def test_template_backward_is_not_reused_where_the_cotangent_strides_differ(how):
    """The loss's cotangent reaches the last block as a broadcast (strides 0), the others'
    as a sum (contiguous): a template backward keeps the values its first call gave its nodes
    (after col2im, a reshape of the broadcast has strides (0, 0, ...)), so the last block is a
    variant of its own. The backward built per template equals the one built call by call,
    strides included (_check), and gives torch.func's gradients."""
    from graphflop.runtime.verify import verify_gradients

    torch.manual_seed(0)
    model, x = ConvPoolStack(how), torch.randn(2, 4, 6, 6)
    a = analyze(model, (x,), name=f"conv_pool_{how}")
    h = _check(a)
    assert h is not None and len(h.sites) == 4
    # block 3 (broadcast cotangent) and block 2 (contiguous) built, block 1 block 2's
    # expanded; block 0 reads the model's input (no gradient): the rules
    x_ = _expanded_calls(a)
    assert x_.expanded == 1
    assert sorted(t.site for t in x_.templates.values() if t.reusable) == [2, 3]
    check = verify_gradients(a.forward, a.backward, model, examples=(x,))
    assert check.ok, check


class LinearBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class TransposedInputStack(nn.Module):
    """The first block's input is ``c + x.transpose(1, 2)``: its value contiguous (the add
    follows ``c``'s layout), its tangent ``x``'s tangent transposed (strides (32, 1, 4)); the
    other blocks' tangents are contiguous matrix products."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("c", torch.randn(2, 4, 8))
        self.blocks = nn.ModuleList(LinearBlock() for _ in range(4))

    def forward(self, x):
        h = self.c + x.transpose(1, 2)
        for b in self.blocks:
            h = b(h)
        return h


@pytest.mark.parametrize("record", [True, False])
def test_template_jvp_is_not_reused_where_the_tangent_strides_differ(record):
    """A template JVP built at the first block (its input's tangent transposed) is not
    expanded at the others (contiguous tangents): the JVP graph built per template equals the
    one built call by call, strides included."""
    torch.manual_seed(0)
    a = analyze(
        TransposedInputStack(),
        (torch.randn(2, 8, 4),),
        jvp=True,
        tangents="all",
        record_derivatives=record,
    )
    h = _check(a)
    assert h is not None and len(h.sites) == 4


class LatentsNet(nn.Module):
    """Perceiver-like: one block structure run on the model input (block 0), on learned
    latents, an ``nn.Parameter`` (block 1, its input computed from parameters only), then on
    activations (blocks 2, 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.latents = nn.Parameter(torch.randn(4, 16))
        self.blocks = nn.ModuleList(Block(16, 32) for _ in range(4))
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        x = self.blocks[0](x)
        z = self.blocks[1](self.latents)
        x = self.blocks[2](x + z)
        return self.head(self.blocks[3](x))


class ShiftedFrozenNet(nn.Module):
    """A frozen stem and frozen blocks 0, 1, then a trainable shift before block 2: block 2's
    input tangent is the shift's alone (computed from parameters only), block 3's is not."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 16).requires_grad_(False)
        self.blocks = nn.ModuleList(Block(16, 32) for _ in range(4))
        for i in (0, 1):
            self.blocks[i].requires_grad_(False)
        self.shift = nn.Parameter(torch.zeros(16))
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        x = self.stem(x)
        for i, b in enumerate(self.blocks):
            x = b(x + self.shift if i == 2 else x)
        return self.head(x)


class FrozenLatentsNet(nn.Module):
    """Blocks 1 and 2 both read an input with no tangent: an activation detached (block 1),
    frozen latents (block 2, computed from parameters only)."""

    def __init__(self) -> None:
        super().__init__()
        self.latents = nn.Parameter(torch.randn(4, 16), requires_grad=False)
        self.blocks = nn.ModuleList(Block(16, 32) for _ in range(4))
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        x = self.blocks[0](x)
        d = self.blocks[1](x.detach())
        z = self.blocks[2](self.latents)
        return self.head(self.blocks[3](x + d + z))


# Per block (batch 4, Linear(16, 32), ReLU, Linear(32, 16)), the backward's FLOPs: fc1's
# weight 2·4·16·32 = 4096 and bias 4·32 = 128, fc2's weight 4096 and bias 4·16 = 64 (weight
# gradients, 8384); fc1's input gradient 4096, ReLU's le + where 2·4·32 = 256, fc2's input
# gradient 4096 (input gradients, 8448), weight gradients where the value whose cotangent
# they compute is computed from parameters only. The head Linear(16, 5): 2·4·5·16 = 640
# input, 640 + 4·5 = 660 weight.
# LatentsNet: block 0 reads the input (no fc1 input gradient): 256 + 4096 = 4352 input,
#   8384 weight; block 1 (latents) all weight: 8384 + 8448 = 16832; blocks 2, 3 8448 / 8384:
#   input 4352 + 2·8448 + 640 = 21888, weight 8384 + 16832 + 2·8384 + 660 = 42644.
# ShiftedFrozenNet: block 2's fc1 input gradient flows to the shift's tangent alone (weight),
#   its ReLU and fc2 to fc1's output (fc1's weight tangent reads the activation): block 2
#   4352 / 8384 + 4096 = 12480, block 3 8448 / 8384, the shift's sum over the batch 4·16 =
#   64 weight: input 4352 + 8448 + 640 = 13440, weight 12480 + 8384 + 64 + 660 = 21588.
# FrozenLatentsNet: blocks 0, 1 4352 / 8384 each (no input gradient into the input or the
#   detached one), block 2 (frozen latents: fc1's output computed from parameters only)
#   all weight: 8384 + 256 + 4096 = 12736, block 3 8448 / 8384: input 2·4352 + 8448 + 640 =
#   17792, weight 2·8384 + 12736 + 8384 + 660 = 38548.
SPLITS = [
    (LatentsNet, (4, 16), 21888, 42644),
    (ShiftedFrozenNet, (4, 8), 13440, 21588),
    (FrozenLatentsNet, (4, 16), 17792, 38548),
]


@pytest.mark.parametrize(("model", "shape", "grad_input", "grad_weight"), SPLITS)
def test_role_split_where_a_block_input_is_computed_from_parameters(
    model, shape, grad_input, grad_weight
):
    """A call whose input (or input tangent) is computed from parameters only gives its
    backward's work the role ``grad_weight`` where another call of the same block gives
    ``grad_input``: the derivatives built per template are those built call by call, roles
    and ``PARAM_DERIVED`` included, and the split is the flat trace's and the hand count."""
    torch.manual_seed(0)
    m, x = model(), torch.randn(*shape)
    a = analyze(m, (x,))
    flat = analyze(m, (x,), outline=False)
    assert HIERARCHY in a.forward.meta and HIERARCHY not in flat.forward.meta
    _check_derivatives(a)
    got, want = a.report.to_dict()["totals"], flat.report.to_dict()["totals"]
    assert got == want
    b = a.report.totals.backward
    assert (b.grad_input_flops, b.grad_weight_flops) == (grad_input, grad_weight)


class UnevenPoolBlock(nn.Module):
    """A 1x1 convolution, adaptive average pooling 6x6 -> (4, 3) (uneven windows: PyTorch's
    decomposition, index arithmetic, tagged while tracing), nearest upsampling back to 6x6
    (index arithmetic too) and the residual add."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(4, 4, 1)
        self.pool = nn.AdaptiveAvgPool2d((4, 3))

    def forward(self, x):
        return x + nn.functional.interpolate(self.pool(self.c(x)), size=(6, 6))


class UnevenPoolStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(UnevenPoolBlock() for _ in range(3))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_blocks_with_uneven_adaptive_average_pooling_hierarchical_equals_flat():
    # eager saves the pool's input (its self, whole) for _adaptive_avg_pool2d_backward;
    # graphflop's backward of the decomposition reads only indices made from constants: the
    # report composed per block equals the flat one and the bytes saved_tensors_hooks measure
    from graphflop.runtime.memory_probe import measure_saved

    torch.manual_seed(0)
    model, x = UnevenPoolStack(), torch.randn(2, 4, 6, 6)
    a = analyze(model, (x,), name="uneven_pool_blocks")
    _check(a)
    h = a.forward.meta[HIERARCHY]
    assert h is not None and len(h.sites) == 3
    # per block: its input 2·4·6·6·4 = 1152 (c's input) and c's output 1152 (the pool's
    # self); the upsampling saves nothing (its backward reads constants' indices): 2304;
    # 3 blocks 6912 B, the sum loss saves nothing
    assert measure_saved(model, (x,)) == 6912
    assert a.report.memory.saved_for_backward_bytes == 6912


def test_stack_of_blocks_composes_hand_counted_figures():
    B, d, f, n = 5, 6, 10, 4
    a = analyze(Stack(n, d, f), torch.randn(B, d))
    h = _check(a)
    assert len(h.templates) == 1 and len(h.sites) == n  # one template, four calls
    assert h.graph is not None
    rows = {L.name: L for L in a.report.layers}
    for i in range(n):
        # addmm: 2·B·d·f multiply-adds' FLOPs, then the bias's B·f additions
        assert rows[f"blocks.{i}.fc1"].forward_mm_flops == 2 * B * d * f == 600
        assert rows[f"blocks.{i}.fc1"].forward_flops == 2 * B * d * f + B * f == 650
        assert rows[f"blocks.{i}.fc2"].forward_mm_flops == 2 * B * f * d == 600
        assert rows[f"blocks.{i}.fc2"].output_shape == (B, d)
    # four blocks of two matrix products (600 each), then the head's 2·B·d·3 = 180
    assert a.report.totals.forward.mm_flops == n * 1200 + 180
    addmm = next(o for o in a.report.ops if o.op == "aten.addmm.default" and o.phase == "forward")
    assert addmm.count == 2 * n + 1
    # the template's nodes carry their module relative to the called block
    assert {t.meta[MODULE] for t in h.templates[0].nodes if MODULE in t.meta} >= {"@.fc1", "@"}
    # the memory schedules compose the calls with one profile per template and call pattern:
    # the forward's four calls copy one block and read one value each (1 profile); the
    # backward's and the JVP's call two template derivatives (below): 2 profiles each
    fsched = memory_calls.composed_forward_schedule(a.forward)
    tsched = eager_train_schedule(a.forward, a.backward, "sgd", "cpu", composed=True)
    jsched = eager_jvp_schedule(a.jvp, "cpu", composed=True)
    for sched, calls_, profiles in ((fsched, 4, 1), (tsched, 8, 3), (jsched, 4, 2)):
        assert isinstance(sched, memory_calls.ComposedSchedule)
        assert sum(not isinstance(x, Step) for x in sched.items) == calls_
        assert len(sched._profiles) == profiles
    # the derivative graphs call two template derivatives: block 0 reads the model's input
    # (no tangent, no input cotangent), blocks 1-3 the block before them
    for gm in (a.jvp, a.backward):
        dh = gm.meta[DERIVED_HIERARCHY]
        assert [c.site for c in dh.calls] == ([0, 1, 2, 3] if gm is a.jvp else [3, 2, 1, 0])
        assert sorted(dh.uses()) == [1, 3]
        first = {c.template for c in dh.calls if c.site == 0}
        assert len(first) == 1 and dh.uses()[first.pop()] == 1
    # a template derivative's arguments are placeholders named by role; the backward's are
    # the block's residuals (x, fc1's output ...) and the cotangent arriving at its output
    bwd = a.backward.meta[DERIVED_HIERARCHY]
    t = bwd.templates[bwd.calls[0].template]
    names = [p.name for p in t.graph.nodes if p.op == "placeholder"]
    assert any(x.startswith("residual_") for x in names)
    assert any(x.startswith("cotangent_") for x in names)


class UnusedStack(nn.Module):
    """The tester's m10: five blocks, block 1's output unused, block 3's only in a second
    output."""

    def __init__(self, d: int = 6, f: int = 10):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, f) for _ in range(5))
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        x = self.blocks[0](x)
        _ = self.blocks[1](x)  # unused
        x = self.blocks[2](x)
        side = self.blocks[3](x)  # only in the second output
        x = self.blocks[4](x)
        return self.head(x), side


def test_a_block_whose_output_is_unused_has_no_call_and_the_rest_compose():
    """Tester's finding: the helper asserted one call of the composed forward schedule (and of
    the top level) per call site, where a block whose output nothing reads keeps no node (its
    call removed as dead code): 5 sites, 4 calls, peaks and reports equal. It now asserts a
    call per live site; the live sites here are 0, 2, 3 and 4 by the model's reading."""
    torch.manual_seed(0)
    a = analyze(UnusedStack(), torch.randn(4, 6))
    h = _check(a)
    assert len(h.sites) == 5 and _live_sites(h) == [0, 2, 3, 4]
    fsched = memory_calls.composed_forward_schedule(a.forward)
    assert sum(not isinstance(x, Step) for x in fsched.items) == 4


def test_analyze_composes_the_memory_figures(monkeypatch):
    """``analyze`` takes the train, JVP and forward peaks from the composed schedules where
    the graphs keep their blocks as calls (the flat ones are not run)."""
    composed, flat = [], []
    real_c, real_f = memory_calls.ComposedSchedule.peak, memory.Schedule.peak

    def c_peak(self):
        composed.append(self)
        return real_c(self)

    def f_peak(self):
        flat.append(self)
        return real_f(self)

    monkeypatch.setattr(memory_calls.ComposedSchedule, "peak", c_peak)
    monkeypatch.setattr(memory.Schedule, "peak", f_peak)
    analyze(Stack(), torch.randn(5, 6))
    assert len(composed) == 3  # forward, train step, JVP
    assert len(flat) == 2  # the forward-gradient step and the activity-perturbed step


def test_flat_trace_gives_the_same_report():
    """Against a trace without outlining at all (every block traced in full, no hierarchy)."""
    model = Stack()
    x = torch.randn(5, 6)
    hier = analyze(model, x)
    from graphflop.frontend import outline

    plan = outline.plan
    try:
        outline.plan = lambda *a, **k: {}
        flat = analyze(model, x)
    finally:
        outline.plan = plan
    assert HIERARCHY not in flat.forward.meta
    assert hier.report.to_dict() == flat.report.to_dict()


QUICK = [
    "mlp.py",
    "cnn.py",
    "convnet.py",
    "lora.py",
    "vit.py",
    "resnet.py:resnet18",
]
SLOW = [
    "deeper_convnet.py",
    "resnet.py:resnet50",
    "gpt2.py:gpt2_small",
]


def _analysis(name: str, **ctor):
    loaded = load(spec(name), ctor_kwargs=ctor, meta=True)
    loaded.model.train()
    return analyze(loaded.model, make_inputs(loaded, batch=2), name=name)


@pytest.mark.parametrize("name", QUICK)
def test_models_hierarchical_equals_flat(name):
    _check(_analysis(name))


def test_max_pool_outside_the_blocks_keeps_the_composed_train_schedule():
    """ResNet-18's stem max pool saves its input and indices in eager (ATEN_SAVES), read at
    the top level of the backward: the train schedule still composes the blocks' calls, and
    its peak and saved storages equal the flat schedule's."""
    a = _analysis("resnet.py:resnet18")
    fwd, bwd = a.forward, a.backward
    er = eager_residuals(fwd, bwd, "cpu")
    (names,) = er.held.values()  # the stem's max pool: its input (the ReLU's) and indices
    assert [str(n.target) for n in fwd.graph.nodes if n.name in names] == [
        "aten.relu.default",
        "<built-in function getitem>",
    ]
    sched = eager_train_schedule(fwd, bwd, "sgd", "cpu", composed=True, eager=er)
    assert isinstance(sched, memory_calls.ComposedSchedule)
    assert sched.peak() == eager_train_schedule(fwd, bwd, "sgd", "cpu", eager=er).peak()
    saved = eager_saved_storages(fwd, bwd, "cpu", eager=er, schedule=sched)
    assert saved == eager_saved_storages(fwd, bwd, "cpu", eager=er)


def test_gpt2_few_layers_hierarchical_equals_flat():
    h = _check(_analysis("gpt2.py", n_layer=3, n_embd=32, n_head=2, vocab_size=50))
    assert h is not None and len(h.sites) == 3 and h.graph is not None


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW)
def test_large_models_hierarchical_equals_flat(name):
    _check(_analysis(name))


ZOO_QUICK = ["torchvision:resnet18", "torchvision:mobilenet_v3_small"]
ZOO_SLOW = [
    "torchvision:swin_t",
    "torchvision:vit_b_16",
    "hf:gpt2",
    "hf:bert",
    "hf:t5",
    "hf:mistral",
    "hf:qwen2",
    "hf:gemma",
]


def _spec_analysis(s: str):
    loaded = load(s, meta=True)
    loaded.model.train()
    return analyze(loaded.model, make_inputs(loaded, batch=2), name=s)


@pytest.mark.parametrize("s", ZOO_QUICK)
def test_zoo_hierarchical_equals_flat(s):
    _check(_spec_analysis(s))


@pytest.mark.slow
@pytest.mark.parametrize("s", ZOO_SLOW)
def test_zoo_large_hierarchical_equals_flat(s):
    _check(_spec_analysis(s))


# the worked example of docs/api.md ("Passes over the hierarchy")
from torch.fx.passes.infra.pass_base import PassResult  # noqa: E402

from graphflop.passes.hierarchy import compose  # noqa: E402
from graphflop.passes.infra import FLAT, GraphPass  # noqa: E402

MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


class MatmulOutputs(GraphPass):
    """Writes on every node the elements a matrix product outputs (0 for other ops)."""

    name = "matmul_outputs"
    required = ("val",)  # scope: TEMPLATE, the default (a node's figure is its own)

    def call(self, gm):
        for n in gm.graph.nodes:
            v = n.meta.get("val")
            n.meta["mm_out"] = v.numel() if n.target in MATMULS else 0
        return PassResult(gm, False)


class Depth(GraphPass):
    """Writes on every node its depth: the longest chain of nodes from an input to it."""

    name = "depth"
    required = ("val",)
    scope = FLAT  # a chain runs through every block: it needs the flat graph

    def call(self, gm):
        for n in gm.graph.nodes:
            n.meta["depth"] = 1 + max((a.meta["depth"] for a in n.all_input_nodes), default=0)
        return PassResult(gm, False)


def test_run_pass_per_template_composes_as_flat():
    B, d, f, n = 5, 6, 10, 4
    a = analyze(Stack(n, d, f), torch.randn(B, d))
    run = a.run_pass(MatmulOutputs())
    assert not run.flat and len(run.templates) == 1  # the block's template, once
    mm_out = lambda node: node.meta.get("mm_out", 0)  # noqa: E731
    # per block: fc1's B·f and fc2's B·d outputs; the head's B·3
    assert compose(a.hierarchy, mm_out) == n * (B * f + B * d) + B * 3 == 335
    rows = compose(a.hierarchy, mm_out, by_module=True)
    assert rows["blocks.2.fc1"] == B * f and rows["blocks.2.fc2"] == B * d and rows["head"] == 15
    # the same pass over the flat graph, node by node
    flat = a.flat().forward
    MatmulOutputs().apply(flat)
    assert rows == _flat_by_module(flat, mm_out)


@pytest.mark.parametrize("which", ["stack", "gpt2"])
def test_compose_reads_the_analysis_costs_at_the_top_level(which):
    """The top level's nodes carry the costs ``analyze`` wrote on the forward graph (they share
    its nodes' meta), so composing a node's ``COST`` over the hierarchy gives the flat graph's
    sum, per module too. The top level had none: composing dropped the head and the loss."""
    from graphflop.meta import COST

    if which == "stack":
        a = analyze(Stack(4, 6, 10), torch.randn(5, 6))
    else:
        loaded = load(spec("gpt2.py"), ctor_kwargs=dict(n_layer=3, n_embd=32, n_head=2), meta=True)
        a = analyze(loaded.model, make_inputs(loaded, batch=2))
    flops = lambda node: node.meta[COST].flops  # noqa: E731  (every node is costed)
    by = _flat_by_module(a.forward, flops)
    assert compose(a.hierarchy, flops, by_module=True) == by
    assert compose(a.hierarchy, flops) == sum(by.values())
    top = [n for n in a.hierarchy.graph.graph.nodes if n.meta.get(COST) is not None]
    assert any(n.meta[COST].flops > 0 for n in top)  # the head's matmul, the loss


def _flat_by_module(gm, value) -> dict[str, int]:
    """``value`` summed over every node of the flat graph ``gm``, per module path."""
    by: dict[str, int] = {}
    for node in gm.graph.nodes:
        m = node.meta.get(MODULE, "")
        by[m] = by.get(m, 0) + value(node)
    return by


def _tensor_bytes(node) -> int:
    v = node.meta.get("val")
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


@pytest.mark.parametrize("which", ["stack", "convres"])
def test_compose_sums_every_node_of_the_flat_graph(which):
    """``compose`` sums every node of the flat model (docs/api.md), the top level's
    placeholders and output included: a figure that is not 0 on placeholders (the bytes of
    the value a node holds; 1 per node) composes to the flat graph's sum, per module too. It
    summed the ``call_function`` nodes only: the parameters and the input composed to 0."""
    if which == "stack":
        a = analyze(Stack(4, 6, 10), torch.randn(5, 6))
    else:
        a = analyze(ConvRes().eval(), torch.randn(2, 3, 12, 12))
    assert a.hierarchy is not None and a.hierarchy.graph is not None
    by = _flat_by_module(a.forward, _tensor_bytes)
    assert compose(a.hierarchy, _tensor_bytes, by_module=True) == by
    assert compose(a.hierarchy, _tensor_bytes) == sum(by.values())
    params = [n for n in a.forward.graph.nodes if n.op == "placeholder"]
    assert sum(_tensor_bytes(n) for n in params) > 0  # what the old sum left out
    one = lambda node: 1  # noqa: E731
    n_nodes = len(a.forward.graph.nodes)
    if which == "stack":
        assert compose(a.hierarchy, one) == n_nodes
    else:
        # but the getitems tracing added for the batch norms' unread outputs (eval: [1] and
        # [2], the empty saved statistics) are the flat graph's only, in no template: they
        # compose to 0; 2 per norm, 2 norms per block, 4 blocks
        assert compose(a.hierarchy, one) == n_nodes - 2 * 2 * 4


def test_run_pass_flat_scope_sees_every_node():
    a = analyze(Stack(4, 6, 10), torch.randn(5, 6))
    run = a.run_pass(Depth())
    assert run.flat and run.top is a.forward and run.templates == ()
    out = next(n for n in run.top.graph.nodes if n.op == "output")
    # a placeholder is 1, a weight's permute 2, so block k's first addmm is 3 + 4k, its relu,
    # second addmm and residual add follow (4 nodes per block on the longest chain)
    mm = [n for n in run.top.graph.nodes if n.target is torch.ops.aten.addmm.default]
    assert [n.meta["depth"] for n in mm] == [3, 5, 7, 9, 11, 13, 15, 17, 19]  # the head: 18 + 1
    assert out.meta["depth"] > 19


def test_run_pass_rejects_an_unknown_scope():
    class Odd(MatmulOutputs):
        scope = "blocks"

    a = analyze(Stack(2, 6, 10), torch.randn(5, 6))
    with pytest.raises(ValueError, match="scope 'blocks'"):
        a.run_pass(Odd())


def test_compose_without_a_hierarchy_sums_the_flat_graph():
    """A model with no repeated block has no hierarchy: ``run_pass`` runs on the flat forward
    graph, and ``Analysis.compose`` (or ``compose`` given that graph) sums it there; given
    ``None`` (``Analysis.hierarchy``), ``compose`` says what to pass instead."""
    B = 3
    a = analyze(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), torch.randn(B, 4))
    assert a.hierarchy is None
    run = a.run_pass(MatmulOutputs())
    assert run.flat and run.top is a.forward
    mm_out = lambda node: node.meta.get("mm_out", 0)  # noqa: E731
    # the two addmm: B·4 and B·2 outputs
    assert a.compose(mm_out) == compose(a.forward, mm_out) == B * 4 + B * 2 == 18
    rows = {"": 0, "0": B * 4, "1": 0, "2": B * 2, "loss": 0}  # "": the placeholders
    assert a.compose(mm_out, by_module=True) == rows
    # every node: 1 each, the graph's node count
    assert a.compose(lambda node: 1) == len(a.forward.graph.nodes)
    with pytest.raises(TypeError, match=r"Analysis.hierarchy is None.*Analysis.compose"):
        compose(a.hierarchy, mm_out)  # type: ignore[arg-type]


def test_analysis_compose_follows_run_pass():
    """With a hierarchy, ``Analysis.compose`` composes over it (what a TEMPLATE pass wrote),
    and with ``flat=True`` sums the flat forward graph (what a FLAT pass wrote)."""
    B, d, f, n = 5, 6, 10, 4
    a = analyze(Stack(n, d, f), torch.randn(B, d))
    a.run_pass(MatmulOutputs())
    mm_out = lambda node: node.meta.get("mm_out", 0)  # noqa: E731
    assert a.compose(mm_out) == compose(a.hierarchy, mm_out) == 335
    assert a.compose(mm_out, flat=True) == 15  # only the head's B·3: the blocks' own nodes
    # were annotated in the template graph, not in the flat graph (the top level shares
    # the flat graph's nodes' meta)
    run = a.run_pass(Depth())
    assert run.flat
    deepest = a.compose(lambda node: node.meta["depth"], flat=True)
    assert deepest == sum(node.meta["depth"] for node in a.forward.graph.nodes)


def test_llama_decoder_layers_hierarchical_equals_flat():
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
    h = _check(analyze(loaded.model, make_inputs(loaded, batch=2)))
    assert len(h.sites) == 3 and len(h.templates) == 1 and h.graph is not None
    assert h.sites[2].module("@.self_attn") == "model.layers.2.self_attn"


def _expanded_calls(a):
    """How many calls of the backward graph were expanded from a template backward."""
    from graphflop.ad import blocks

    made = []
    of = blocks.BlockTranspose.of

    def spy(forward, b):
        x = of(forward, b)
        made.append(x)
        return x

    blocks.BlockTranspose.of = spy  # type: ignore[method-assign]
    try:
        run_passes(a.forward, [BuildVjp(linearized=a.backward.meta[LINEARIZED])])
    finally:
        blocks.BlockTranspose.of = of  # type: ignore[method-assign]
    return made[0]


def test_backward_expanded_per_template_gives_torch_gradients():
    """Stack of four blocks on real tensors: the block's transpose is built once and expanded
    at the calls that read the same activity; the gradients of the expanded backward match torch.func's."""
    from graphflop.runtime.verify import verify_gradients

    torch.manual_seed(0)
    model, x = Stack(4, 6, 10), torch.randn(5, 6)
    a = analyze(model, x)
    _check(a)
    x_ = _expanded_calls(a)
    # blocks 2 and 1 are block 3's transpose expanded; block 0 reads the model's input, whose
    # tangent is a ghost (no gradient needed), so the rules build its runs
    assert x_.expanded == 2
    assert [t.site for t in x_.templates.values() if t.reusable][0] == 3
    check = verify_gradients(a.forward, a.backward, model, examples=(x,))
    assert check.ok, check


def test_gpt2_backward_expanded_per_template_gives_torch_gradients():
    from graphflop.runtime.verify import verify_gradients

    torch.manual_seed(0)
    loaded = load(spec("gpt2.py"), ctor_kwargs=dict(n_layer=3, n_embd=32, n_head=2, vocab_size=50))
    loaded.model.train()
    x = make_inputs(loaded, batch=2)
    a = analyze(loaded.model, x)
    x_ = _expanded_calls(a)
    assert x_.expanded == 2 and x_.built == 1  # three blocks: built at one, expanded at two
    check = verify_gradients(a.forward, a.backward, loaded.model)
    assert check.ok, check


def _analyses_both_ways(make, monkeypatch):
    """``make()``'s analysis with each block's derivatives built per template, and with the
    rules run at every call (no expander)."""
    from graphflop.ad import blocks

    per_template = make()
    monkeypatch.setattr(blocks.BlockLinearize, "of", classmethod(lambda cls, f, lin: None))
    monkeypatch.setattr(blocks.BlockTranspose, "of", classmethod(lambda cls, f, b: None))
    return per_template, make()


@pytest.mark.parametrize("which", ["stack", "gpt2", "resnet18"])
def test_every_graph_and_report_equal_call_by_call(which, monkeypatch):
    """Every graph the analysis builds on the JVP and backward (the update, the forward-gradient
    and activity-perturbed steps too) and the report are the same with the derivative nodes
    built per template as with the rules run at every call."""

    def make():
        if which == "stack":
            return analyze(Stack(4, 6, 10), torch.randn(5, 6))
        if which == "gpt2":
            return _analysis("gpt2.py", n_layer=3, n_embd=32, n_head=2, vocab_size=50)
        return _analysis("resnet.py:resnet18")

    a, b = _analyses_both_ways(make, monkeypatch)
    assert a.report.to_dict() == b.report.to_dict()
    for g in ("backward", "jvp", "update", "forward_gradient", "activity_gradient"):
        x, y = getattr(a, g), getattr(b, g)
        assert (x is None) == (y is None), g
        if x is not None:
            assert _derivative_nodes(x) == _derivative_nodes(y), g


class _CkptBlock(nn.Module):
    """A residual block with a biased MLP (its recompute reruns the addmm, which reads the
    bias no tangent reads) and dropout (the recompute takes the forward's draw); ``inner``:
    only the MLP under ``torch.utils.checkpoint``."""

    def __init__(self, d: int, inner: bool):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.drop = nn.Dropout(0.1)
        self.inner = inner

    def mlp(self, h):
        return self.fc2(self.drop(torch.tanh(self.fc1(h))))

    def forward(self, x):
        h = self.norm(x)
        return x + (checkpoint(self.mlp, h, use_reentrant=False) if self.inner else self.mlp(h))


class _CkptStack(nn.Module):
    """A stem, four blocks, a head; ``how``: each block under its own checkpoint (``each``, ``reentrant``),
    only its MLP (``inner``), two blocks per checkpoint call (``pairs``: a recompute across
    calls), or only the second block (``second``: a tester's finding, it took the others'
    backward, without its recompute)."""

    def __init__(self, how: str, d: int = 8):
        super().__init__()
        self.stem = nn.Linear(d, d)  # the blocks' input carries a derivative (a reentrant
        # checkpoint of the model's input alone would give its parameters none, as in eager)
        self.blocks = nn.ModuleList(_CkptBlock(d, how == "inner") for _ in range(4))
        self.head = nn.Linear(d, 3)
        self.how = how

    def forward(self, x):
        x = self.stem(x)
        bs = self.blocks
        if self.how == "pairs":
            for i in (0, 2):
                x = checkpoint(lambda y, i=i: bs[i + 1](bs[i](y)), x, use_reentrant=False)
        else:
            for i, b in enumerate(bs):
                if self.how == "inner" or (self.how == "second" and i != 1):
                    x = b(x)
                else:
                    x = checkpoint(b, x, use_reentrant=self.how == "reentrant")
        return self.head(x)


@pytest.mark.parametrize(
    ("how", "expanded"),
    [("each", 3), ("reentrant", 3), ("inner", 3), ("pairs", 0), ("second", 2)],
)
def test_checkpointed_blocks_backward_expanded_per_template(how, expanded):
    """A checkpoint inside a block or around exactly one block is recomputed within the
    block's backward: built once and copied at the other calls (the recompute's own inputs,
    a bias no tangent reads among them, mapped through the forward graph), the graphs and
    every figure the call-by-call ones (``_check``), the recompute kept as eager runs it; a
    checkpoint around two blocks is recomputed at the first of them the backward reaches:
    the rules build every call. Gradients: torch.func's."""
    from graphflop.runtime.verify import verify_gradients

    torch.manual_seed(0)
    model, x = _CkptStack(how), torch.randn(5, 8)
    model.eval()  # dropout off for the gradient check on real tensors; its draw is checked
    a = analyze(model, x)
    _check(a)
    assert _expanded_calls(a).expanded == expanded
    check = verify_gradients(a.forward, a.backward, model, examples=(x,))
    assert check.ok, check
    model.train()
    a = analyze(model, x)
    _check(a)
    assert _expanded_calls(a).expanded == expanded
    # the recompute: each checkpointed block reruns its forward in the backward
    assert a.report.totals.backward.recompute_flops > 0


class _CastBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc(self.norm(x)).double().float()


def test_block_casting_its_dtype_is_recorded():
    """A tester's finding: a block whose output is cast (``.double().float()``, or an autocast
    region) crashed the recorded backward's clean-up (a cast reading a passed product was taken
    for a permute: ``IndexError``). The graphs and figures are the call-by-call ones."""
    model = nn.Sequential(*[_CastBlock(8) for _ in range(3)], nn.Linear(8, 3))
    a = analyze(model, torch.randn(2, 8))
    assert a.forward.meta[OUTLINED].calls == 3
    _check(a)


def _outlined_and_not(make, inputs, monkeypatch, **options):
    """``make()``'s analysis with its repeated blocks outlined, and without outlining (every
    block traced in full: the reference)."""
    from graphflop.frontend import outline

    hier = analyze(make(), *inputs, **options)
    assert HIERARCHY in hier.forward.meta
    with monkeypatch.context() as m:
        m.setattr(outline, "plan", lambda *a, **k: {})
        flat = analyze(make(), *inputs, **options)
    assert HIERARCHY not in flat.forward.meta
    return hier, flat


class _MaskBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x, mask):
        return x + self.fc(self.norm(x)) * mask


class _MaskStack(nn.Module):
    """Three blocks reading one frozen float input (``mask``): each block's cotangent of it
    is pruned work (a ghost term of the mul's tangent, logged inside the call's run)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([_MaskBlock(8) for _ in range(3)])
        self.head = nn.Linear(8, 3)

    def forward(self, x, mask):
        for b in self.blocks:
            x = b(x, mask)
        return self.head(x)


@pytest.mark.parametrize("record", [True, False])
def test_ghost_term_inside_a_recorded_call_is_pruned_at_every_call(record, monkeypatch):
    """The mask's cotangent (``g * fc(norm(x))``, 2·8 = 16 FLOPs per block) and its sum over
    the blocks (eager accumulates the gradient: 2 adds of 16 FLOPs, at blocks.1 and blocks.0)
    are pruned at every call: blocks.2 16, blocks.1 16 + 16, blocks.0 16 + 16 (and the
    LayerNorm input gradient of the model input, blocks.0.norm). The recorded transpose
    dropped blocks.2's term (its cotangent filed on the call's node made flat, which the ghost
    did not read): 16 and 0 at blocks.1 and blocks.2."""
    inputs = (torch.randn(2, 8), torch.ones(2, 8))
    hier, flat = _outlined_and_not(
        _MaskStack, (inputs,), monkeypatch, memory_model="graph", record_derivatives=record
    )
    pruned = {r.name: r.pruned_flops for r in hier.report.layers}
    assert (pruned["blocks.2"], pruned["blocks.1"], pruned["blocks.0"]) == (16, 32, 32)
    h, f = hier.report.to_dict(), flat.report.to_dict()
    assert h["totals"]["backward"]["pruned_flops"] == f["totals"]["backward"]["pruned_flops"]
    assert h["memory"]["saved_for_backward_bytes"] == f["memory"]["saved_for_backward_bytes"]
    assert h == f


class _NormBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc(self.norm(x))


class _Stage(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(_NormBlock(d), _NormBlock(d))
        self.down = nn.Linear(d, d)

    def forward(self, x):
        return self.down(self.blocks(x))


class _Stages(nn.Module):
    """Two stages (each outlined, its two blocks inside): under autocast the first stage's
    LayerNorms read float32 (the input, the residual stream), the second's half (the first
    stage's ``down`` output), though both stages' copies share the template's region
    numbers."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stages = nn.Sequential(_Stage(8), _Stage(8))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.stages(x))


def test_amp_casts_of_outlined_stages_read_each_calls_norm_dtype(monkeypatch):
    """Saved casts under bf16 autocast (CPU: LayerNorm runs in its input's dtype): the half
    weights, 6 · 8·8·2 + 3·8·2 = 816 bytes, and the half copies of the float32 activations
    the first stage's matmuls read (two LayerNorm outputs and the residual stream into
    ``down``), 3 · 2·8·2 = 96; the second stage's are half already: 912 bytes. Keyed by region
    number, the second stage's LayerNorm outputs took the first stage's float32 (976)."""
    hier, flat = _outlined_and_not(_Stages, (torch.randn(2, 8),), monkeypatch, amp="bf16")
    assert hier.report.memory.amp.saved_cast_bytes == 816 + 96
    assert hier.report.memory.amp == flat.report.memory.amp
    assert hier.report.to_dict() == flat.report.to_dict()


class _ConvBnRelu(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 1)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x):
        return nn.functional.relu(self.bn(self.conv(x)), inplace=True)


class _ConvStackHead(nn.Module):
    """Three conv blocks (outlined), the last one's in-place ReLU output flattened into a
    linear head (torchvision's GoogLeNet auxiliary heads)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(*[_ConvBnRelu(2) for _ in range(3)])
        self.fc = nn.Linear(2 * 3 * 3, 4)

    def forward(self, x):
        return self.fc(torch.flatten(self.blocks(x), 1))


def test_flatten_of_an_in_place_relu_stays_where_the_model_takes_it(monkeypatch):
    """Eager takes the flatten (a view) in the model's own forward, before ``fc`` transposes
    its weight: the ``view`` row comes before ``permute`` and the view is the root module's.
    Traced without outlining, functionalization made the view again where ``fc`` read it (the
    ReLU wrote its base in place), after the transpose and in ``fc``; an outlined last block
    (its ReLU inside the call) did not: the op table's rows were in another order."""
    hier, flat = _outlined_and_not(_ConvStackHead, (torch.randn(2, 2, 3, 3),), monkeypatch)
    for a in (hier, flat):
        ops = [r.op for r in a.report.ops]
        assert ops.index("aten.view.default") < ops.index("aten.permute.default")
        (view,) = [n for n in a.forward.graph.nodes if n.target is torch.ops.aten.view.default]
        assert view.meta[MODULE] == ""
    assert [r.op for r in hier.report.ops] == [r.op for r in flat.report.ops]
    assert hier.report.to_dict() == flat.report.to_dict()


def test_autograd_nodes_of_outlined_stages_count_each_calls_norms(monkeypatch):
    """The host time of the autograd engine (a calibrated profile's ``autograd_node_s``)
    counts one node per op whose output depends on a parameter, a composite op once: per
    block a LayerNorm, the weight's transpose, the addmm and the residual add (4); per stage
    2 · 4 + ``down``'s transpose and addmm = 10; the head's 2; the loss's log-softmax and
    NLL: 2 · 10 + 2 + 2 = 24. Keyed by region number, the second stage's LayerNorms were the
    first stage's (22)."""
    import dataclasses

    from graphflop.passes.step_time import _autograd_nodes
    from graphflop.passes.time_profile import resolve_profile

    profile = dataclasses.replace(resolve_profile("cpu"), autograd_node_s=1e-5)
    hier, flat = _outlined_and_not(_Stages, (torch.randn(2, 8),), monkeypatch, time_profile=profile)
    for a in (hier, flat):
        params = {n.meta[PARAM] for n in a.forward.graph.nodes if n.meta.get(PARAM) is not None}
        assert _autograd_nodes(a.forward, params) == 24
    assert hier.report.to_dict()["time"] == flat.report.to_dict()["time"]
    assert hier.report.to_dict() == flat.report.to_dict()


class _DetachedCkptBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.f, self.g = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, c):  # c: the model's input, which requires no grad
        return self.g(x) + checkpoint(self.f, c, use_reentrant=True)


class _DetachedCkptNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_DetachedCkptBlock() for _ in range(3))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = x
        for b in self.blocks:
            h = b(h, x)
        return self.head(h)


def test_reentrant_checkpoint_inside_a_block_is_decided_per_call(monkeypatch):
    """A helper's finding: a reentrant checkpoint inside a block whose inputs require no grad
    gives, as in eager, outputs with no derivative (its parameters count as frozen); traced
    once as a template its outputs kept theirs (298 figures off, frozen parameters 0 against
    3 · (64 + 8) = 216). Such a block is traced in full; the report is the flat one's."""
    import graphflop.frontend.outline as outline

    x = torch.randn(2, 8)
    a = analyze(_DetachedCkptNet(), x)
    assert a.report.frozen_params == 3 * (64 + 8)
    monkeypatch.setattr(outline, "plan", lambda *a, **k: {})
    assert a.report.to_dict() == analyze(_DetachedCkptNet(), x).report.to_dict()


class _InferBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.g = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return x + self.g(self.fc(x))


class _InferenceCall(nn.Module):
    """Identical blocks, one (the ``frozen``-th) called under ``torch.inference_mode()``."""

    def __init__(self, frozen: int):
        super().__init__()
        self.blocks = nn.ModuleList(_InferBlock() for _ in range(4))
        self.head = nn.Linear(8, 3)
        self.frozen = frozen

    @torch.inference_mode()
    def frozen_call(self, b, x):
        return b(x)

    def forward(self, x):
        for i, b in enumerate(self.blocks):
            x = b(x) if i != self.frozen else self.frozen_call(b, x).clone()
        return self.head(x)


@pytest.mark.parametrize("frozen", [0, 2])
def test_a_block_called_under_inference_mode_is_traced_in_full(frozen, monkeypatch):
    """A tester's finding: a repeated block called under ``torch.inference_mode()`` failed to
    trace when outlined (the first run of its call made its fresh inputs in inference mode,
    where a tensor has no version counter to tell a write by: 'Inference tensors do not track
    version counter'). That call is traced in full (the other three are copies of one
    template); its parameters get no gradient (2 · (64 + 8) = 144 frozen), and the
    hierarchical report equals the flat one and the one traced without outlining."""
    import graphflop.frontend.outline as outline

    x = torch.randn(2, 8)
    a = analyze(_InferenceCall(frozen), x)
    assert a.forward.meta[OUTLINED].calls == 3 and a.forward.meta[OUTLINED].traced_once == 1
    assert a.report.frozen_params == 2 * (64 + 8)
    _check(a)
    monkeypatch.setattr(outline, "plan", lambda *a, **k: {})
    flat = analyze(_InferenceCall(frozen), x)
    assert HIERARCHY not in flat.forward.meta
    assert a.report.to_dict() == flat.report.to_dict()


class _RmsBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc(self.norm(x))


class _RmsStack(nn.Module):
    """Three RMSNorm blocks: ``rms_norm``'s C++ kernel adds its epsilon in place on a
    temporary (``add_``), which tracing rewrites into ``add``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(*[_RmsBlock(8) for _ in range(3)])
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.blocks(x))


def _op_order(a):
    return [(r.phase, r.op) for r in a.report.ops]


def test_in_place_add_of_a_composite_inside_blocks_keeps_the_op_order(monkeypatch):
    """A tester's finding (a Mamba-like model): the template kept ``rms_norm``'s ``add_``,
    which tracing rewrote into ``add`` in the flat graph, so the copies were no longer their
    template's node and counted at the top level, after their call: the forward's ``add.Scalar``
    row came after the whole block's (after ``addmm``) instead of between ``mean`` and
    ``rsqrt`` (``x.pow(2).mean(-1) + eps``, then ``rsqrt``), figures equal. The template is
    rewritten as the flat graph is: each call keeps its add, rows in the flat order."""
    hier, flat = _outlined_and_not(_RmsStack, (torch.randn(2, 8),), monkeypatch)
    h = hier.forward.meta[HIERARCHY]
    assert h.runs
    assert all(len(items) == len(h.variants[0][1]) for _, items in h.variants)
    forward = [op for phase, op in _op_order(hier) if phase == "forward"]
    assert forward[:4] == [
        "aten.pow.Tensor_Scalar",
        "aten.mean.dim",
        "aten.add.Scalar",
        "aten.rsqrt.default",
    ]
    assert _op_order(hier) == _op_order(flat)
    assert hier.report.to_dict() == flat.report.to_dict()
    _check(hier)


def test_a_copy_rewritten_after_tracing_keeps_the_flat_op_order(monkeypatch):
    """Where a call's copy is no longer its template's node (here: the template's ``add_`` left
    in place, the flat graph's rewritten), it counts at the top level, after its call; the
    calls' nodes are then not one run (``Hierarchy.runs``) and the per-op and per-module rows
    take the flat graph's order (``add.Scalar`` before ``rsqrt``, not after the block's ops)."""
    from graphflop.frontend import trace

    monkeypatch.setattr(trace, "functionalize_inplace", lambda graph: 0)
    hier, flat = _outlined_and_not(_RmsStack, (torch.randn(2, 8),), monkeypatch)
    h = hier.forward.meta[HIERARCHY]
    assert not h.runs  # the add_ copies are top-level nodes inside the calls' runs
    forward = [op for phase, op in _op_order(hier) if phase == "forward"]
    assert forward.index("aten.add.Scalar") < forward.index("aten.rsqrt.default")
    assert _op_order(hier) == _op_order(flat)
    assert hier.report.to_dict() == flat.report.to_dict()


class _CtxBlock(nn.Module):
    """A block reading a dict argument (``ctx``); ``how``: ``read`` only, or also ``set`` a
    key of it, or ``append`` to its list, which a copy of the block would not do."""

    def __init__(self, d: int, how: str) -> None:
        super().__init__()
        self.norm, self.f, self.g = nn.LayerNorm(d), nn.Linear(d, d), nn.Linear(d, d)
        self.how = how

    def forward(self, x, ctx):
        h = self.g(torch.tanh(self.f(self.norm(x))) * ctx["scale"])
        if self.how == "set":
            ctx["last"] = h
        elif self.how == "append":
            ctx["seen"].append(h)
        return x + h + ctx["bias"]


class _CtxNet(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(_CtxBlock(8, how) for _ in range(3))
        self.head = nn.Linear(8, 3)
        self.how = how

    def forward(self, x, scale, bias):
        ctx = {"scale": scale, "bias": bias, "seen": []}
        for b in self.blocks:
            x = b(x, ctx)
        if self.how == "set":
            x = x + ctx["last"]
        elif self.how == "append":
            x = x + sum(ctx["seen"])
        return self.head(x)


@pytest.mark.parametrize(("how", "calls"), [("read", 3), ("set", 0), ("append", 0)])
def test_blocks_taking_a_dict_argument_are_outlined_unless_they_write_into_it(
    how, calls, monkeypatch
):
    """A tester's finding: blocks called with a dict of tensors were traced in full, without a
    word (only tensors, numbers and tuples of them were taken as arguments). A dict or list of
    those is taken now: the blocks are one template and three calls, and every figure is the
    full trace's. A block that writes into its argument (a new key, an append: what the caller
    reads afterwards) is still traced in full, the first call's run finding the write."""
    x, scale, bias = torch.randn(2, 8), torch.rand(2, 1), torch.randn(8)
    hier, flat = (
        _outlined_and_not(lambda: _CtxNet(how), ((x, scale, bias),), monkeypatch)
        if calls
        else (analyze(_CtxNet(how), (x, scale, bias)), None)
    )
    assert hier.forward.meta[OUTLINED].calls == calls
    if flat is None:
        from graphflop.frontend import outline

        monkeypatch.setattr(outline, "plan", lambda *a, **k: {})
        flat = analyze(_CtxNet(how), (x, scale, bias))
    assert hier.report.to_dict() == flat.report.to_dict()
    if calls:
        _check(hier)


_TENSOR_ATTR_MODEL = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d, mask, how):
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)
        self.mask, self.how = mask, how

    def forward(self, x):
        h = self.a(x)
        if self.how == "setitem":
            h[:, 0] = 0.0
        else:
            h = h * self.mask
        return x + self.b(h)


class Net(nn.Module):
    def __init__(self, how="own"):
        super().__init__()
        m = (torch.arange(8) % 2).float()
        masks = [m.clone() if how == "own" else m for _ in range(3)]
        self.blocks = nn.ModuleList([Block(8, k, how) for k in masks])
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def example_inputs():
    return (torch.randn(2, 8),)
"""


@pytest.mark.parametrize(
    ("how", "why"),
    [
        ("own", "each holds a tensor attribute of its own"),
        ("shared", "its forward reads a tensor that is no parameter, buffer or input"),
        ("setitem", "its forward reads a tensor that is no parameter, buffer or input"),
    ],
)
def test_repeated_blocks_traced_in_full_say_why(how, why, tmp_path, capsys, monkeypatch):
    """A tester's finding: blocks holding a plain tensor attribute (each its own, or one
    shared), or writing a number by setitem (a constant tensor), were traced in full without a
    word. The analysis says which and why (``Analysis.outlined.in_full``), ``inspect`` in one
    line on standard error; the figures are the full trace's either way."""
    from conftest import cli

    from graphflop.cli.common import outline_notes
    from graphflop.frontend import outline

    path = tmp_path / "tensor_attr.py"
    path.write_text(_TENSOR_ATTR_MODEL)
    spec_ = f"{path}:Net"
    loaded = load(spec_, ctor_kwargs={"how": how})
    a = analyze(loaded.model, make_inputs(loaded))
    assert a.outlined.calls == 0
    (line,) = a.outlined.in_full
    assert line.startswith("Block ×3 (blocks.0, blocks.1, blocks.2): " + why)
    (note,) = outline_notes(a)
    rc, _, err = cli(capsys, "inspect", spec_, "--arg", f"how={how}")
    assert rc == 0
    assert [e for e in err if "traced in full" in e] == [note]
    assert line in note
    monkeypatch.setattr(outline, "plan", lambda *a, **k: {})
    loaded = load(spec_, ctor_kwargs={"how": how})
    flat = analyze(loaded.model, make_inputs(loaded))
    assert a.report.to_dict() == flat.report.to_dict()


def test_blocks_traced_once_say_nothing():
    """Every repeated block traced once: no line (and none from ``inspect``)."""
    from graphflop.cli.common import outline_notes

    a = analyze(Stack(4, 6, 10), torch.randn(5, 6))
    assert a.outlined.calls > 0 and a.outlined.in_full == ()
    assert outline_notes(a) == []


class _Pair(nn.Module):
    """Two modules, itself counted: too small to be outlined."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        return x + self.fc(x)


@pytest.mark.parametrize(
    ("build", "calls"),
    [
        (lambda: nn.Sequential(*[_Pair() for _ in range(3)]), 0),
        (lambda: nn.Sequential(*[nn.Linear(6, 6) for _ in range(3)]), 0),
        (lambda: nn.Sequential(*[nn.Sequential(nn.Linear(6, 6), nn.ReLU()) for _ in range(3)]), 3),
    ],
    ids=["two_modules", "one_module", "three_modules"],
)
def test_blocks_of_fewer_than_three_modules_are_not_outlined(build, calls):
    """docs/api.md ("The hierarchy"): a block is outlined where it holds at least 3 modules,
    itself counted; smaller ones are traced at each call and not listed in ``in_full``."""
    a = analyze(build(), torch.randn(5, 6))
    assert a.outlined.calls == calls and a.outlined.in_full == ()
    assert (a.hierarchy is not None) == (calls > 0)


def test_tensor_attribute_shared_by_blocks_is_one_constant_on_the_meta_device(tmp_path):
    """One plain tensor (8 float32: 32 bytes) held by three blocks is one constant of the
    trace, as in eager, whether the model was built on the CPU or on the meta device (as the
    command line builds it): made fake per module, it was three (96 bytes of buffers)."""
    path = tmp_path / "tensor_attr.py"
    path.write_text(_TENSOR_ATTR_MODEL)
    reports = []
    for meta in (False, True):
        loaded = load(f"{path}:Net", ctor_kwargs={"how": "shared"}, meta=meta)
        a = analyze(loaded.model, make_inputs(loaded))
        assert [n.name for n in a.forward.graph.nodes if n.name.startswith("c_")] == [
            "c__tensor_constant0"
        ]
        assert a.report.memory.buffers_bytes == 8 * 4
        reports.append(a.report.to_dict())
    assert reports[0] == reports[1]


class _InferenceNet(nn.Module):
    """Four blocks, the third called under ``torch.inference_mode`` (its output cloned)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(_NormBlock(8) for _ in range(4))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        for i, b in enumerate(self.blocks):
            if i == 2:
                with torch.inference_mode():
                    h = b(x)
                x = h.clone()
            else:
                x = b(x)
        return self.head(x)


def test_block_called_under_inference_mode_is_traced_in_full(monkeypatch):
    """A tester's finding: a block called under ``torch.inference_mode`` failed the trace
    ('Inference tensors do not track version counter': the outlined call's first run made
    its tensors there). That call is traced in full, as under autocast, and said; the other
    three are copies of one template; the figures are the full trace's."""
    hier, flat = _outlined_and_not(_InferenceNet, (torch.randn(2, 8),), monkeypatch)
    assert hier.outlined.calls == 3
    assert hier.outlined.in_full == ("_NormBlock ×1 (blocks.2): called under inference mode",)
    assert hier.report.to_dict() == flat.report.to_dict()


class LnBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(16)
        self.fc = nn.Linear(16, 16)
        self.out = nn.Linear(16, 16)

    def forward(self, x):
        return x + self.out(torch.relu(self.fc(self.ln(x))))


def test_layer_norm_blocks_in_bfloat16_hierarchical_equals_flat():
    # in bfloat16 layer norm's mean and rstd are dropped from the graph (casts nothing reads)
    # but saved by eager (eager_memory._dropped_saves): composed per block as flat
    torch.manual_seed(0)
    model = nn.Sequential(*(LnBlock() for _ in range(3))).to(torch.bfloat16)
    x = torch.randn(2, 4, 16, dtype=torch.bfloat16)
    a = analyze(model, (x,), name="ln_blocks_bf16")
    h = _check(a)
    assert h is not None and len(h.sites) == 3
    # per block: x 2·4·16·2 = 256 (layer norm's input) + mean, rstd 8·2 each + fc's input 256
    # + relu's output 256 (out's input; relu saves its result, the same): 800; 3 · 800
    from graphflop.runtime.memory_probe import measure_saved

    assert a.report.memory.saved_for_backward_bytes == 2400 == measure_saved(model, (x,))


class _TwiceOutBlock(nn.Module):
    """A block returning one value for both its outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        y = self.b(torch.relu(self.a(x)))
        return y, y


class _TwiceInBlock(nn.Module):
    """A block whose first op reads both its arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, y):
        return self.b(torch.relu(self.a(x * y)))


class _TwiceNet(nn.Module):
    def __init__(self, outputs: bool) -> None:
        super().__init__()
        self.outputs = outputs
        block = _TwiceOutBlock if outputs else _TwiceInBlock
        self.blocks = nn.ModuleList(block() for _ in range(3))

    def forward(self, x):
        for b in self.blocks:
            if self.outputs:
                y, z = b(x)
                x = y * z
            else:
                x = b(x, x)  # (one value for both arguments)
        return x


@pytest.mark.parametrize("outputs", [True, False])
def test_blocks_repeating_an_output_or_an_argument_hierarchical_equals_flat(outputs):
    # the flat path's hierarchy of a block returning one value twice, or called with one value
    # for two arguments one node reads, composes the flat figures and rebuilds the flat graph
    torch.manual_seed(0)
    a = analyze(_TwiceNet(outputs), (torch.randn(5, 4),), name="twice")
    h = _check(a)
    assert h is not None and len(h.sites) == 3 and h.graph is not None
