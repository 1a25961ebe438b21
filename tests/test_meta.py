"""The ``node.meta`` contract: :mod:`graphflop.meta` is the only place a key is spelled."""

from __future__ import annotations

import dataclasses
import gc
import re
import weakref
from pathlib import Path

from graphflop import meta

ROOT = Path(__file__).resolve().parents[1]
KEY = re.compile(re.escape(meta.PREFIX) + r"[a-z]")  # a graphflop key spelled out


def test_no_key_spelled_outside_meta():
    offenders = []
    for folder in ("graphflop", "tools", "tests", "models"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == ROOT / "graphflop" / "meta.py":
                continue
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if KEY.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not offenders, "use the constants of graphflop.meta:\n" + "\n".join(offenders)


def test_the_check_finds_a_spelled_key():
    assert KEY.search('n.meta["' + meta.PREFIX + 'cost"]')
    assert not KEY.search("n.meta[COST]")


def test_every_key_listed_once_and_documented():
    keys = meta.NODE_KEYS + meta.GRAPH_KEYS
    assert len(set(keys)) == len(keys)
    spelled = {
        v
        for k, v in vars(meta).items()
        if k.isupper() and isinstance(v, str) and v.startswith(meta.PREFIX) and k != "PREFIX"
    }
    assert spelled == set(keys)
    names = {k for k, v in vars(meta).items() if isinstance(v, str) and v in keys}
    for name in names:
        assert f":data:`{name}`" in meta.__doc__, name


def test_values_are_frozen():
    for cls in (
        meta.NodeCost,
        meta.Signature,
        meta.Ghost,
        meta.GhostLinks,
        meta.JvpInfo,
        meta.VjpInfo,
        meta.UpdateInfo,
        meta.TrainStepInfo,
        meta.ForwardGradientInfo,
        meta.OutlineInfo,
        meta.MemoryInfo,
        meta.NodeTime,
    ):
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, cls


def test_new_fake_is_the_constructors_tensor():
    """:func:`graphflop.meta.new_fake` (FakeTensor's attributes copied in, not set one by one)
    makes the tensor ``FakeTensor(mode, elem, device)`` makes: the same class, attributes,
    dispatch keys, metadata and grad flag, sharing ``elem``'s storage, usable in the mode."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    mode = FakeTensorMode()
    elem = torch.empty_strided((3, 4), (1, 3), dtype=torch.float16, device="meta")
    for requires_grad in (False, True):
        ours = meta.new_fake(mode, elem, "cpu", requires_grad)
        ref = FakeTensor(mode, elem, torch.device("cpu"))
        ref.requires_grad_(requires_grad)
        assert meta._FAKE_STATES[mode][torch.device("cpu")] is not None  # the copy was taken
        assert type(ours) is FakeTensor and ours is not ref
        assert vars(ours).keys() == vars(ref).keys()
        assert all(vars(ours)[k] is v or vars(ours)[k] == v for k, v in vars(ref).items())
        assert str(torch._C._dispatch_keys(ours)) == str(torch._C._dispatch_keys(ref))
        assert (ours.shape, ours.stride(), ours.dtype, ours.device) == (
            (3, 4),
            (1, 3),
            torch.float16,
            torch.device("cpu"),
        )
        assert (ours.requires_grad, ours.is_leaf) == (requires_grad, True)
        assert ours.untyped_storage()._cdata == elem.untyped_storage()._cdata
        with mode:
            out = ours @ torch.ones(4, 2, dtype=torch.float16)  # (3, 4) @ (4, 2)
        assert type(out) is FakeTensor and out.shape == (3, 2) and out.device.type == "cpu"
    # the copy kept for the mode does not keep the mode alive
    gone = weakref.ref(mode)
    del mode, ours, ref, out
    gc.collect()
    assert gone() is None
