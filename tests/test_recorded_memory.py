"""The eager memory schedules read off recorded derivative hierarchies
(:mod:`graphflop.passes.recorded_memory`): the JVP's and the train step's peaks and the
storages saved for backward the same, to the byte, as the flat schedules of the flat views
(the reference: node by node, ``composed=False``), on the models
tests/test_recorded_analysis.py runs; None (the caller schedules the flat view) where a call
could differ from its template's copy."""

from __future__ import annotations

import pytest
import torch
from test_recorded_analysis import QUICK, SLOW, _model

from graphflop.analysis import analyze
from graphflop.meta import DERIVED_HIERARCHY
from graphflop.passes import calls
from graphflop.passes.eager_memory import (
    eager_jvp_schedule,
    eager_saved_storages,
    eager_train_schedule,
)
from graphflop.passes.recorded_memory import recorded_jvp_schedule, recorded_train_schedule

#: models whose recorded JVP the schedule reads (the others have no repeated blocks)
READ = {
    "stack",
    "checkpointed",
    "gpt2",  # fx names getitems of one block after another block's forward getitems
    "llama",
    "t5",
    "vit.py",
    "resnet.py:resnet18",
    "torchvision:resnet18",
    "torchvision:mobilenet_v3_small",
    "custom_function",
    *(m for m in SLOW if m != "deeper_convnet.py"),
}
#: models whose recorded backward the train schedule reads (the checkpointed stack's and the
#: custom Functions' backwards are built flat)
READ_BACKWARD = READ - {"checkpointed", "custom_function"}


def _analysis(which: str):
    if which == "custom_function":  # a getitem of a call that nothing reads
        from test_custom_function_grads import CubeStack

        torch.manual_seed(0)
        x = torch.randn(4, 8, dtype=torch.float64)
        return analyze(CubeStack().double(), (x,), loss="cross_entropy")
    model, x = _model(which)
    return analyze(model, x)


def _check(which: str) -> None:
    a = _analysis(which)
    _check_jvp(which, a)
    _check_train(which, a)


def _check_train(which: str, a) -> None:
    dh = a.backward.meta.get(DERIVED_HIERARCHY)
    top = dh.graph if dh is not None else a.backward
    flat = calls.flat_view(top)
    for device in ("cpu", "cuda"):
        saved = eager_saved_storages(a.forward, flat, device)
        for optimizer, keep_grads in (("sgd", False), ("adam", False), ("adam", True)):
            got = recorded_train_schedule(a.forward, top, optimizer, device, keep_grads)
            if which in READ_BACKWARD:
                assert got is not None, (which, device)
            if got is None:
                continue
            ref = eager_train_schedule(a.forward, flat, optimizer, device, keep_grads)
            assert got[0].peak()[0] == ref.peak()[0], (which, device, optimizer, keep_grads)
            assert got[1] == saved, (which, device)


def _check_jvp(which: str, a) -> None:
    dh = a.jvp.meta.get(DERIVED_HIERARCHY)
    top = dh.graph if dh is not None else a.jvp
    flat = calls.flat_view(top)
    for device in ("cpu", "cuda"):
        got = recorded_jvp_schedule(top, device)
        if which in READ:
            assert got is not None, (which, device)
        ref = eager_jvp_schedule(flat, device, composed=False)  # node by node, flat
        if got is not None:
            assert got.peak() == ref.peak(), (which, device)
    if not calls.is_recorded(top):
        assert recorded_jvp_schedule(top) is None


@pytest.mark.parametrize("which", [*QUICK, "custom_function"])
def test_recorded_jvp_schedule_peak_equals_flat(which):
    _check(which)


@pytest.mark.slow
@pytest.mark.parametrize("which", SLOW)
def test_recorded_jvp_schedule_peak_equals_flat_large(which):
    _check(which)


def _read(a, gm, top):
    if gm is a.jvp:
        return recorded_jvp_schedule(top)
    return recorded_train_schedule(a.forward, top, "sgd")


def test_call_site_in_two_calls_falls_back():
    """Two calls of one call site (their forward sources' nodes in both): not read."""
    from dataclasses import replace

    a = _analysis("stack")
    for gm in (a.jvp, a.backward):
        top = gm.meta[DERIVED_HIERARCHY].graph
        dh = top.meta[DERIVED_HIERARCHY]
        assert _read(a, gm, top) is not None
        c0 = dh.calls[0]
        twice = replace(dh, calls=(c0, *(replace(c, site=c0.site) for c in dh.calls[1:])))
        top.meta[DERIVED_HIERARCHY] = twice
        try:
            assert _read(a, gm, top) is None
        finally:
            top.meta[DERIVED_HIERARCHY] = dh


def test_node_named_after_another_calls_source():
    """GPT-2's JVP: fx's counter names ``var_mean`` getitems of one block after forward
    getitems of the next block. Read where the eager passes, which find a node's tangents by
    its name, find nothing by that name; not read where the other block's source has a
    tangent node (here made one by its kind)."""
    from graphflop.meta import KIND
    from graphflop.passes import recorded_memory

    top = _analysis("gpt2").jvp.meta[DERIVED_HIERARCHY].graph
    b = recorded_memory._Builder(top, "cpu")
    b.build()
    assert b.foreign
    _, _, other, k = b.foreign[0]
    t = b.template(other)
    node = next(n for n, slot in zip(t.nodes, t.slot) if slot == k)
    kind = node.meta[KIND]
    assert recorded_jvp_schedule(top) is not None
    node.meta[KIND] = "tangent"
    try:
        assert recorded_jvp_schedule(top) is None
    finally:
        node.meta[KIND] = kind


def test_lifetimes_worked_out_again_after_a_step_is_added():
    """The composed schedule keeps the lifetimes ``owners`` worked out for ``peak``; a step
    added after them is in the next peak, as in the flat schedule given the same step."""
    a = _analysis("stack")
    top = a.backward.meta[DERIVED_HIERARCHY].graph
    s, _ = recorded_train_schedule(a.forward, top, "sgd")
    ref = eager_train_schedule(a.forward, calls.flat_view(top), "sgd")
    before = s.peak()[0]
    assert before == ref.peak()[0]
    big = 1 << 40  # more than all the step's storages: the peak is at this step
    s.add_transient("u:probe", big)
    ref.add_transient("u:probe", big)
    assert s.peak() == ref.peak()
    assert s.peak()[0] > big > before


@pytest.mark.parametrize("which", ["stack", "gpt2", "resnet.py:resnet18"])
def test_train_top_copy_without_the_values_only_the_output_reads(which):
    """The train step's copy of the backward's top level leaves out the calls' values only the
    output (and calls) read (the gradients): the overrides worked out on it (scatters in place,
    one-kernel backwards, convolutions' temporaries) are those of the copy with them."""
    from graphflop.passes import recorded_memory as rm
    from graphflop.passes.eager_kernels import one_kernel_backward
    from graphflop.passes.eager_memory import eager_forward, kernel_temporaries, scatters_in_place

    a = _analysis(which)
    top = a.backward.meta[DERIVED_HIERARCHY].graph
    kernels = eager_forward(a.forward, "cpu").kernels

    def overrides(gm):
        inplace = scatters_in_place(gm)
        return (
            inplace,
            one_kernel_backward(gm, kernels, inplace),
            kernel_temporaries(a.forward, gm, "cpu"),
        )

    def name(at):
        return f"gfcall_{at[0]}_{at[1]}"

    full, full_names = rm._top_copy(top, name)
    short, short_names = rm._top_copy(top, name, output_values=False)
    # the gradients of the blocks' parameters: one placeholder each in the full copy only
    grads = sum(len(c.sources) > 0 for c in top.meta[DERIVED_HIERARCHY].calls)
    assert len(full_names) - len(short_names) >= grads > 0
    assert set(short_names) < set(full_names)
    assert overrides(short) == overrides(full)
