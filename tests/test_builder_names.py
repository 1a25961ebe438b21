"""Shortcuts the derivative builders take around fx give what fx gives: a placeholder's name
(:func:`graphflop.ad.builder.placeholder`), names taken from names read once
(:func:`~graphflop.ad.builder.take_parsed`, :func:`~graphflop.ad.builder.take_again`,
:func:`~graphflop.ad.builder.new_node`) and the fake mode of a graph's values
(:func:`graphflop.meta.fake_mode_of`, which reads the values only up to the first fake tensor);
and around FakeTensorMode: an op's output made from the metadata kept for its call in another
fake mode (:func:`graphflop.ad.builder.fake_output`) is the one the mode gives."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import Graph, GraphModule

from graphflop.ad import builder
from graphflop.ad.builder import (
    copy_node,
    fake_output,
    new_node,
    parse_names,
    placeholder,
    shape_cache_scope,
    take_again,
    take_parsed,
)
from graphflop.meta import fake_mode_of, fresh_fake
from graphflop.ops.tree import meta_key

# names fx keeps, names it numbers (taken before) and names it converts (upper case: snake
# case then lower case; ``__magic__``: stripped)
NAMES = ["args_0", "t_addmm_5", "x", "x", "x_1", "p_model_W_q", "p_model_qW", "__y__", "y", "_1"]


def test_placeholder_names_as_fx():
    ours, theirs = Graph(), Graph()
    for name in NAMES:
        a, b = placeholder(ours, name), theirs.placeholder(name)
        assert (a.op, a.target, a.name) == (b.op, b.target, b.name)
    # what fx made of them, worked out by hand from its rules
    assert [n.name for n in ours.nodes] == [
        "args_0",
        "t_addmm_5",
        "x",
        "x_1",  # "x" taken: numbered
        "x_2",  # "x_1" taken: the next number
        "p_model_w_q",  # lower case
        "p_model_q_w",  # "qW" snake-cased ("q_W"), then lower case
        "y",  # "__y__" stripped
        "y_1",
        "_1",
    ]


def _state(g: Graph) -> tuple:
    ns = g._graph_namespace
    return sorted(ns._used_names), sorted(ns._base_count.items())


# a copy's names asked twice (a template's, at two calls): numbered ones, plain ones, a
# builtin's name, a number with a leading zero, a base ending in ``_``, one fx cleans up
CANDIDATES = ["add", "add_3", "list", "getitem", "getitem_1", "add_05", "foo__3", "a.b", "add_3"]


def test_taken_names_as_fx():
    ours, theirs = Graph(), Graph()
    parsed = parse_names(CANDIDATES)
    names: list[str] = []
    nums: list = []
    for _ in range(2):
        got, num = take_parsed(ours, parsed)
        names += got
        nums += num
    want = [theirs._graph_namespace.create_name(c, None) for c in CANDIDATES * 2]
    assert names == want
    assert _state(ours) == _state(theirs)
    # by fx's rules, by hand: "add_3" free at first (taken as it is, the count of "add" 3),
    # then asked again: numbered on from 3; "list" a builtin's: numbered; "add_05" keeps its
    # zero (the count of "add" 5); "a.b" cleaned up to "a_b"
    assert names[:9] == [
        "add", "add_3", "list_1", "getitem", "getitem_1", "add_05", "foo__3", "a_b", "add_6"
    ]  # fmt: skip
    assert names[9:12] == ["add_7", "add_8", "list_2"]
    # the names taken again in another graph by their numbers, as fx takes each
    again, fx = Graph(), Graph()
    for (_, base, _, _), name, num in zip(parsed * 2, names, nums):
        if base is not None:
            assert take_again(again, name, base, num)
        else:
            again._graph_namespace.create_name(name, None)
        assert fx._graph_namespace.create_name(name, None) == name
    assert _state(again) == _state(fx)
    assert not take_again(again, "add_3", "add", 3)  # taken: fx would number it on


def test_copied_node_named_as_fx():
    # a copied node keeps its name and arguments as fx's node_copy's
    src = Graph()
    a = src.placeholder("a")
    relu = src.call_function(torch.relu, (a,))
    dst, ref = Graph(), Graph()
    for g in (dst, ref):
        g.placeholder("a")
    env_d, env_r = dict(zip(src.nodes, dst.nodes)), dict(zip(src.nodes, ref.nodes))
    ours_copy = copy_node(dst, relu, env_d.__getitem__, name="h_out")
    fx_copy = ref.create_node("call_function", torch.relu, (env_r[a],), name="h_out")
    assert (ours_copy.name, ours_copy.args[0].name) == (fx_copy.name, fx_copy.args[0].name)
    assert _state(dst) == _state(ref)


def test_new_node_as_create_node():
    """``new_node`` (the builders' node constructor) makes the node fx's ``create_node`` makes:
    name, op, target, arguments, users, place in the graph (appended, or at an insert point),
    the graph's length and find_nodes table, its code."""
    aten = torch.ops.aten

    def build(make):
        g = Graph()
        x = make(g, "placeholder", "x", "x", (), {})
        w = make(g, "placeholder", "p_w", "p_w", (), {})
        m1 = make(g, "call_function", aten.mul.Tensor, "mul_tensor", (x, 2.0), {})
        m2 = make(g, "call_function", aten.mul.Tensor, "mul_tensor", (m1, w), {})
        s = make(g, "call_function", aten.sum.dim_IntList, "sum", (m2, [0]), {"keepdim": True})
        a = make(g, "call_function", aten.add.Tensor, "mul_tensor_1", (s, x), {"alpha": 2})
        k = make(g, "call_function", aten.add.Tensor, "for", (a, w), {})
        with g.inserting_before(m1):  # at an insert point
            make(g, "call_function", aten.neg.default, "neg", (x,), {})
        g.output(k)
        return g

    def fx(g, op, target, name, args, kwargs):
        return g.create_node(op, target, args, kwargs, name=name)

    ours, theirs = build(new_node), build(fx)

    def rows(g):
        return [
            (n.name, n.op, n.target, str(n.args), str(n.kwargs), list(n.users)) for n in g.nodes
        ]

    assert str(rows(ours)) == str(rows(theirs))
    # worked out from fx's rules: ``mul_tensor`` taken (numbered on: its base's next number,
    # 1, then 2 where ``mul_tensor_1`` is asked for), ``sum`` (a builtin's) and ``for`` (a
    # keyword) numbered even where free
    assert [n.name for n in ours.nodes] == [
        *("x", "p_w", "neg", "mul_tensor", "mul_tensor_1", "sum_1", "mul_tensor_2", "for_1"),
        "output",
    ]
    assert ours._len == theirs._len == 9
    assert ours.find_nodes(op="call_function", target=aten.mul.Tensor) == [
        n for n in ours.nodes if n.target is aten.mul.Tensor
    ]
    assert [n.name for n in ours.find_nodes(op="placeholder")] == ["x", "p_w"]
    ours.lint()
    assert ours.python_code("self").src == theirs.python_code("self").src


def test_new_node_files_in_fx_rows_after_changes():
    """``new_node`` files a node in the row fx's ``find_nodes`` reads, also where the row was
    found by the target's identity (``find_row``'s table, after the first node of a target)
    and after fx re-filed or dropped nodes of that target (a target reassigned, a node
    erased)."""
    aten = torch.ops.aten
    g = Graph()
    x = new_node(g, "placeholder", "x", "x", (), {})
    a = new_node(g, "call_function", aten.relu.default, "relu", (x,), {})
    b = new_node(g, "call_function", aten.relu.default, "relu", (a,), {})
    b.target = aten.sin.default  # fx moves it to the sin row
    c = new_node(g, "call_function", aten.relu.default, "relu", (b,), {})
    d = new_node(g, "call_function", aten.sin.default, "sin", (c,), {})
    g.erase_node(d)
    e = new_node(g, "call_function", aten.sin.default, "sin", (c,), {})
    # relu: a and c (b moved away); sin: b and e (d erased)
    assert g.find_nodes(op="call_function", target=aten.relu.default) == [a, c]
    assert g.find_nodes(op="call_function", target=aten.sin.default) == [b, e]
    assert g.find_nodes(op="placeholder") == [x]
    g.lint()


def test_fake_mode_of_breadth_first_and_lazy():
    m1, m2 = FakeTensorMode(), FakeTensorMode()
    with m1:
        a = torch.empty(2)
    with m2:
        b = torch.empty(2)
    # every value before those nested in them: b (a value) before a (nested in an earlier one)
    assert fake_mode_of([(a,), b]) is m2
    assert fake_mode_of([1, [[a]], [b]]) is m2  # b one level down, a two
    assert fake_mode_of([1, [[a]]]) is m1
    assert fake_mode_of([1, None, [2]]) is None

    def values():
        yield None
        yield b
        raise AssertionError("read past the first fake tensor")

    assert fake_mode_of(values()) is m2


def test_output_kept_across_fake_modes_is_the_modes_own():
    aten = torch.ops.aten
    # x: 2x3x4 float32 laid out as a transposed 2x4x3 (strides 12, 1, 3); w: 4x5
    calls = [
        (aten.mul.Tensor, ("x", 2.0)),  # elementwise keeps x's layout: strides (12, 1, 3)
        (aten.matmul.default, ("x", "w")),  # 2x3x5, contiguous: strides (15, 5, 1)
        (aten.sum.dim_IntList, ("x", [1], True)),  # 2x1x4; the size-1 dim's stride 4 (4, 4, 1)
    ]
    expected = [((2, 3, 4), (12, 1, 3)), ((2, 3, 5), (15, 5, 1)), ((2, 1, 4), (4, 4, 1))]
    for second in (False, True):  # the second mode's outputs: from what the first one kept
        mode = FakeTensorMode()
        with shape_cache_scope():
            x = fresh_fake(mode, (2, 3, 4), (12, 1, 3), torch.float32, "cpu")
            w = fresh_fake(mode, (4, 5), (5, 1), torch.float32, "cpu")
            for (op, names), (shape, stride) in zip(calls, expected):
                args = tuple({"x": x, "w": w}.get(a, a) if isinstance(a, str) else a for a in names)
                key = builder._shape_key(op, args, {}, meta_key)
                assert (key in builder._OUTPUTS) or not second
                out = fake_output(mode, op, args, {})
                with mode:
                    ref = op(*args)
                got = (type(out), out.fake_mode, out.device, out.dtype, out.requires_grad)
                assert got == (type(ref), mode, ref.device, ref.dtype, ref.requires_grad)
                assert (tuple(out.shape), out.stride()) == (tuple(ref.shape), ref.stride())
                assert (tuple(out.shape), out.stride()) == (shape, stride)
                assert not out._is_view() and out.storage_offset() == 0
                assert key in builder._OUTPUTS  # a new tensor, not a view: kept


def test_view_kept_across_fake_modes_is_the_modes_own():
    """A view op's output in a second fake mode, made from the layout the first mode's
    dispatch gave (``builder._VIEW_LAYOUTS``) instead of a dispatch through the mode, is the
    tensor the mode gives: a FakeTensor of the mode, a view of the input (its base the
    input, its storage the input's) with the layout worked out by hand below; a reshape that
    copies is left to the mode (no layout kept)."""
    aten = torch.ops.aten
    # x: 2x3x4 float32 laid out as a transposed 2x4x3 (strides 12, 1, 3)
    calls = [
        # permute(2, 0, 1): the dims reordered with their strides
        (aten.permute.default, ([2, 0, 1],), ((4, 2, 3), (3, 12, 1))),
        # unsqueeze(0): a new leading dim of stride 2 * 12 = 24
        (aten.unsqueeze.default, (0,), ((1, 2, 3, 4), (24, 12, 1, 3))),
        # expand to 5x2x3x4: the new dim of stride 0
        (aten.expand.default, ([5, 2, 3, 4],), ((5, 2, 3, 4), (0, 12, 1, 3))),
        # transpose(0, 2): strides 3 and 12 swapped
        (aten.transpose.int, (0, 2), ((4, 3, 2), (3, 1, 12))),
        # reshape splitting the last dim (4, stride 3) into 2x2: strides 6 and 3, a view
        (aten.reshape.default, ([2, 3, 2, 2],), ((2, 3, 2, 2), (12, 1, 6, 3))),
        # reshape merging dims 1 and 2 (strides 1 and 3 do not merge): a copy, not kept
        (aten.reshape.default, ([2, 12],), None),
    ]
    for second in (False, True):
        mode = FakeTensorMode()
        with shape_cache_scope():
            x = fresh_fake(mode, (2, 3, 4), (12, 1, 3), torch.float32, "cpu")
            for op, rest, layout in calls:
                args = (x, *rest)
                key = builder._shape_key(op, args, {}, meta_key)
                kept = key in builder._VIEW_LAYOUTS
                assert kept == (second and layout is not None)
                out = fake_output(mode, op, args, {})
                if layout is None:
                    assert not out._is_view() and key not in builder._VIEW_LAYOUTS
                    continue
                with mode:
                    ref = op(*args)
                got = (type(out), out.fake_mode, out.device, out.dtype, out.requires_grad)
                assert got == (type(ref), mode, ref.device, ref.dtype, ref.requires_grad)
                assert (tuple(out.shape), out.stride()) == layout
                assert (tuple(ref.shape), ref.stride()) == layout
                assert out.storage_offset() == ref.storage_offset() == 0
                assert out._is_view() and out._base is x and ref._base is x
                assert out.untyped_storage()._cdata == x.untyped_storage()._cdata
                assert key in builder._VIEW_LAYOUTS


def test_name_plan_takes_names_as_fx_one_by_one():
    """:class:`graphflop.ad.builder.NamePlan` (a call's names a base at a time) gives the names
    fx gives nodes made one after the other with them (``_Namespace.create_name`` of each) and
    leaves its namespace as fx does, whatever is taken already."""
    import random

    from graphflop.ad.builder import NamePlan, base_name

    def namespace(used, counts):
        g = Graph()
        ns = g._graph_namespace
        ns._used_names, ns._base_count = set(used), dict(counts)
        return g

    base_name(Graph(), torch.ops.aten.mm.default)  # "mm_default" known as a plain base
    import operator

    base_name(Graph(), operator.getitem)
    # by hand: mm_default taken (count 3): _4, _5; view_4 free: as it is (count 4); getitem
    # taken (count 0): _1, then getitem_2 free: as it is (count 2)
    plan = NamePlan(["mm_default", None, "mm_default", "getitem", None])
    g = namespace({"mm_default", "getitem"}, {"mm_default": 3, "getitem": 0})
    got = plan.take(g, ["view_4", "getitem_2"])
    assert got == ["mm_default_4", "view_4", "mm_default_5", "getitem_1", "getitem_2"]
    assert g._graph_namespace._base_count == {"mm_default": 5, "getitem": 2, "view": 4}

    rng = random.Random(0)
    plain = ["mm_default", "add_tensor", "getitem"]
    numbered = ["view", "getitem", "addmm", "sum_1"]  # sum_1_<n>: the base sum_1
    for _ in range(400):
        fixed = [rng.choice(plain) if rng.random() < 0.6 else None for _ in range(rng.randrange(9))]
        plan = NamePlan(fixed)
        ref = namespace(set(), {})._graph_namespace
        for _ in range(rng.randrange(12)):  # names fx gave before
            b = rng.choice(plain + numbered)
            ref.create_name(f"{b}_{rng.randrange(8)}" if rng.random() < 0.6 else b, None)
        for _ in range(3):  # calls one after the other, the plan kept
            given = [f"{rng.choice(numbered)}_{rng.randrange(12)}" for _ in plan.slots]
            if given and rng.random() < 0.1:
                given[-1] = rng.choice(plain)  # a name of another form: one by one
            g = namespace(ref._used_names, ref._base_count)
            want = [ref.create_name(x, None) for x in plan.candidates(given)]
            assert plan.take(g, given) == want
            ns = g._graph_namespace
            assert ns._used_names == ref._used_names
            assert ns._base_count == ref._base_count


def test_take_plain_takes_names_as_fx_or_declines():
    """:func:`graphflop.ad.builder.take_plain` (a recorded update's packed placeholders' names,
    all at once) gives the names fx gives nodes made one after the other with them and leaves
    its namespace as fx does; where one is taken, repeated, not ASCII or a builtin's name it
    takes nothing and returns None."""
    from graphflop.ad.builder import take_plain

    def namespace(used, counts):
        g = Graph()
        ns = g._graph_namespace
        ns._used_names, ns._base_count = set(used), dict(counts)
        return g

    used = {"grad_h_0_ln_1_weight", "grad_h_1_attn_bias_3"}
    counts = {"grad_h_1_attn_bias": 3, "grad_h_2_mlp_weight": 4}
    names = ["grad_h_1_attn_weight", "grad_h_1_attn_bias", "grad_h_2_mlp_weight"]
    g, ref = namespace(used, counts), namespace(used, counts)._graph_namespace
    want = [ref.create_name(x, None) for x in names]
    # by hand: all free and of no numbered form: each as it is; counts kept (bias's 3,
    # mlp_weight's 4) or 0 (attn_weight)
    assert want == names
    assert take_plain(g, names) == want
    ns = g._graph_namespace
    assert ns._used_names == ref._used_names == used | set(names)
    assert ns._base_count == ref._base_count
    assert ns._base_count == {**counts, "grad_h_1_attn_weight": 0}
    declined = [
        ["grad_h_0_ln_1_weight", "grad_x"],  # taken: fx numbers it
        ["grad_x", "grad_x"],  # twice: fx numbers the second
        ["grad_\u00e9t\u00e9"],  # not ASCII: fx's reading
        ["grad_x", "print"],  # a builtin's name: renamed even where free
    ]
    for names in declined:
        g = namespace(used, counts)
        assert take_plain(g, names) is None
        assert g._graph_namespace._used_names == used  # nothing taken
        assert g._graph_namespace._base_count == counts


class _PropertyElsewhere(Graph):
    """A Graph whose ``owning_module`` property reads elsewhere than ``_owning_module`` (the
    field fx's property returns, and ``new_node`` reads): it reports no owner while owned."""

    @property
    def owning_module(self):
        return None

    @owning_module.setter
    def owning_module(self, mod):
        self._owning_module = mod


def test_makes_nodes_says_what_new_node_does():
    """``makes_nodes(g)``: ``new_node`` makes ``g``'s nodes itself, not through ``create_node``.
    A plain graph: itself; a GraphModule's graph: through ``create_node`` (so its owning
    module's create-node hook sees the node); a graph whose ``owning_module`` property and
    ``_owning_module`` differ: as ``new_node`` reads (before, ``makes_nodes`` read the
    property, ``new_node`` the field: True for a graph whose nodes went through
    ``create_node``)."""
    if not builder._PARTS:  # pragma: no cover - a torch.fx without the parts: create_node
        return
    for g, owned in (
        (Graph(), False),
        (GraphModule(torch.nn.Module(), Graph()).graph, True),
        (GraphModule(torch.nn.Module(), _PropertyElsewhere()).graph, True),
    ):
        through: list[str] = []
        create = g.create_node

        def recorded(*a, create=create, through=through, **k):
            node = create(*a, **k)
            through.append(node.name)
            return node

        g.create_node = recorded  # type: ignore[method-assign]
        hooked: list[str] = []
        if owned:
            owner = g._owning_module
            assert isinstance(owner, GraphModule)
            owner._register_create_node_hook(lambda n, hooked=hooked: hooked.append(n.name))
        new_node(g, "placeholder", "x", "x", (), {})
        assert through == (["x"] if owned else [])
        assert builder.makes_nodes(g) is not owned, type(g).__name__
        if type(g) is Graph:  # fx's create_node calls the hooks of the property's module
            assert hooked == through
