"""Golden figures: ``graphflop inspect --json`` for four models, every number pinned.

The files in ``tests/golden/`` were first written by the CLI before the package's redesign
(docs/architecture.md) moved any code, and are rewritten only where a figure is meant to change;
this test proves a refactor changes no figure and no JSON key. Integers must be equal; floats
(ratios, shares) equal to 1e-12 relative, the rounding of summing in another order.

Regenerate only when a figure is meant to change, and say why in the commit:
``GRAPHFLOP_REGEN_GOLDEN=1 python -m pytest tests/test_golden.py``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from conftest import spec

from graphflop.cli import main

GOLDEN = Path(__file__).parent / "golden"

CASES = {
    "convnet": [spec("convnet.py")],
    "mlp_adam": [spec("mlp.py"), "--optimizer", "adam"],
    "resnet18": [spec("resnet.py:resnet18")],
    "gpt2_small": [spec("gpt2.py:gpt2_small"), "--input-shape", "1,128", "--dtype", "int64"],
}


def _diff(want, got, path="$"):
    """Yield one line per difference between two JSON values."""
    if isinstance(want, dict) and isinstance(got, dict):
        if list(want) != list(got):
            yield f"{path}: keys {list(want)} != {list(got)}"
        for k in want:
            if k in got:
                yield from _diff(want[k], got[k], f"{path}.{k}")
    elif isinstance(want, list) and isinstance(got, list):
        if len(want) != len(got):
            yield f"{path}: length {len(want)} != {len(got)}"
        for i, (w, g) in enumerate(zip(want, got)):
            yield from _diff(w, g, f"{path}[{i}]")
    elif isinstance(want, float) or isinstance(got, float):
        if not (
            isinstance(got, (int, float))
            and isinstance(want, (int, float))
            and math.isclose(want, got, rel_tol=1e-12, abs_tol=0.0)
        ):
            yield f"{path}: {want!r} != {got!r}"
    elif type(want) is not type(got) or want != got:
        yield f"{path}: {want!r} != {got!r}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_inspect_json_is_golden(case, tmp_path):
    out = tmp_path / f"{case}.json"
    assert main(["inspect", *CASES[case], "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    path = GOLDEN / f"{case}.json"
    if os.environ.get("GRAPHFLOP_REGEN_GOLDEN"):
        path.write_text(json.dumps(got, indent=1) + "\n")
    want = json.loads(path.read_text())
    diffs = list(_diff(want, got))
    assert not diffs, f"{len(diffs)} figures differ from {path.name}:\n" + "\n".join(diffs[:40])


def test_diff_finds_changes():
    # the comparison itself must be able to fail
    assert list(_diff({"a": 1, "b": [1.0]}, {"a": 1, "b": [1.0]})) == []
    assert list(_diff({"a": 1}, {"a": 2})) == ["$.a: 1 != 2"]
    assert list(_diff({"a": 1.0}, {"a": 1.0 + 1e-9})) != []
    assert list(_diff({"a": 1, "b": 2}, {"b": 2, "a": 1})) != []  # key order is schema
    assert list(_diff({"a": [1, 2]}, {"a": [1]})) != []
    assert list(_diff({"a": 1}, {"a": True})) != []
