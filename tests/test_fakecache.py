"""FakeTensorMode's cache hits made cheaper while tracing (graphflop.frontend.fakecache): the
cache keys and the tensors a hit gives are PyTorch's own, entry for entry and attribute for
attribute, with PyTorch's functions as the reference (put back in place to compute them)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch._subclasses import fake_tensor as ft

from graphflop.frontend import fakecache

aten = torch.ops.aten

pytestmark = pytest.mark.skipif(
    fakecache._originals() is None, reason="a PyTorch whose fake-tensor cache is not mirrored"
)


def _calls(mode: ft.FakeTensorMode) -> list[tuple]:
    """Ops with arguments of each kind the replacements handle or hand on: strided tensors
    (contiguous, channels-last, transposed, sliced with an offset, 0-d, integer), scalars,
    int lists, None, dtypes, keyword arguments, a nested list of tensors (handed on)."""
    with mode:
        x = torch.empty(2, 3, 4, 5)
        cl = torch.empty(2, 3, 4, 5).to(memory_format=torch.channels_last)
        w = torch.empty(6, 3, 3, 3)
        t = torch.empty(3, 4).t()
        sliced = torch.empty(4, 6)[:, 1:]
        scalar = torch.empty(())
        ids = torch.empty(7, dtype=torch.int64)
    return [
        (aten.add.Tensor, (x, cl), {}),
        (aten.add.Tensor, (x, 2.5), {"alpha": 3}),
        (aten.mul.Tensor, (t, scalar), {}),
        (aten.convolution.default, (cl, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1), {}),
        (aten.sum.dim_IntList, (sliced, [1], True), {"dtype": torch.float64}),
        (aten.relu.default, (sliced,), {}),
        (aten.neg.default, (ids,), {}),
        (aten.cat.default, ([x, cl], 1), {}),
        (aten.empty.memory_format, ([2, 3],), {"dtype": torch.float32, "device": "cpu"}),
        (aten.t.default, (t,), {}),  # a view of its input
        (aten.slice.Tensor, (x, 1, 1, 3), {}),  # a view at an offset
        (aten.add_.Tensor, (torch.empty(3, 4, device="meta"), 1), {}),  # not a fake: handed on
    ]


def _noted(seen: list, fn, *args):
    seen.append(args)
    return fn(*args)


def _key(mode, func, args, kwargs):
    try:
        return mode._cache_key(ft._CacheKeyState(mode.shape_env), func, args, kwargs).key
    except Exception as e:  # a bypass: the same reason either way
        return ("bypass", type(e).__name__, getattr(e, "reason", None))


def test_keys_and_hits_are_pytorchs():
    mode = ft.FakeTensorMode()
    calls = _calls(mode)
    ours, theirs = [], []
    with fakecache.fast_cache_hits():
        assert ft.TensorMetadata._flatten_into is fakecache._flatten_into
        for func, args, kwargs in calls:
            ours.append(_key(mode, func, args, kwargs))
    assert ft.TensorMetadata._flatten_into is not fakecache._flatten_into  # put back
    for func, args, kwargs in calls:
        theirs.append(_key(mode, func, args, kwargs))
    assert ours == theirs
    # the entries' types too (1 and 1.0, True and 1 are equal, and keys tell them apart)
    assert [[type(v) for v in k] for k in ours] == [[type(v) for v in k] for k in theirs]
    assert sum(k[0] == "bypass" for k in ours) == 1  # the meta tensor's call

    # a hit's output: a new FakeTensor with PyTorch's metadata and attributes, a view on its
    # input's storage
    for func, args, kwargs in calls[:11]:
        with mode:
            func(*args, **kwargs)  # (a miss or a hit: the entry is there after)
            hits = ft.FakeTensorMode.cache_hits
            theirs_out = func(*args, **kwargs)
            handed_on = []
            with fakecache.fast_cache_hits():
                pytorchs = fakecache._ORIGINAL["output"]
                fakecache._ORIGINAL["output"] = functools.partial(_noted, handed_on, pytorchs)
                ours_out = func(*args, **kwargs)
            assert ft.FakeTensorMode.cache_hits == hits + 2
            assert not handed_on  # (made by fakecache's own function)
        assert type(ours_out) is ft.FakeTensor
        assert (ours_out.shape, ours_out.stride(), ours_out.dtype, ours_out.device) == (
            theirs_out.shape,
            theirs_out.stride(),
            theirs_out.dtype,
            theirs_out.device,
        )
        assert ours_out.storage_offset() == theirs_out.storage_offset()
        assert not ours_out.requires_grad and ours_out.fake_mode is mode
        assert vars(ours_out).keys() == vars(theirs_out).keys()
        view = func in (aten.t.default, aten.slice.Tensor)
        same = ours_out.untyped_storage()._cdata == theirs_out.untyped_storage()._cdata
        assert same == view
        if isinstance(args[0], torch.Tensor):
            base = args[0].untyped_storage()._cdata
            assert (ours_out.untyped_storage()._cdata == base) == view
    assert theirs_out.storage_offset() == 5 * 4 * 1  # slice(x, 1, 1, 3) of a (2, 3, 4, 5)


def test_off_changes_nothing(monkeypatch):
    monkeypatch.setattr(fakecache, "ENABLED", False)
    before = ft.TensorMetadata._flatten_into
    with fakecache.fast_cache_hits():
        assert ft.TensorMetadata._flatten_into is before
