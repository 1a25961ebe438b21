"""The ``node.meta`` contract: :mod:`graphflop.meta` is the only place a key is spelled."""

from __future__ import annotations

import dataclasses
import re
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
