"""Lazy imports (issue 19): ``import graphflop`` and ``graphflop inspect`` load none of the
heavy optional libraries; the subcommands and attributes that use them load them on demand.

Each check runs in a fresh interpreter (``sys.modules`` of this one already holds whatever
other tests imported) and prints which of the watched modules got loaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: loaded only by the subcommand or option that uses them
HEAVY = ("onnx", "onnxscript", "onnxruntime", "matplotlib", "sklearn", "graphviz", "transformers")

_REPORT = f"import json, sys\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"


def _loaded(code: str) -> list[str]:
    """The modules of HEAVY loaded after running ``code`` in a fresh interpreter."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", code + "\n" + _REPORT],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_graphflop_loads_no_heavy_library():
    assert _loaded("import graphflop, graphflop.cli") == []


def test_inspect_loads_no_heavy_library():
    code = (
        "import contextlib, io\n"
        "from graphflop.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['inspect', 'models/mlp.py']) == 0\n"
    )
    assert _loaded(code) == []


def test_render_loads_graphviz():
    # the checks above can fail: the attribute that wraps graphviz does load it
    assert "graphviz" in _loaded("import graphflop\ngraphflop.render")
