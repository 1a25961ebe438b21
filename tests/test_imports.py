"""Lazy imports: ``import graphflop`` and ``graphflop inspect`` load none of the
heavy optional libraries; the subcommands and attributes that use them load them on demand.
An analysis runs without importing Dynamo (:mod:`graphflop.frontend.nodynamo`) and leaves
``torch.compile`` working; the cheaper core-ATen decomposition table equals ``torch.export``'s.

Each check runs in a fresh interpreter (``sys.modules`` of this one already holds whatever
other tests imported) and prints which of the watched modules got loaded.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: loaded only by the subcommand or option that uses them
HEAVY = ("onnx", "onnxscript", "onnxruntime", "matplotlib", "sklearn", "graphviz", "transformers")

#: graphflop's own modules that only other subcommands use: building the parser (``--help``
#: lists every subcommand's options and defaults) must not load them
OTHER_COMMANDS = ("graphflop.train.loop", "graphflop.train.data", "graphflop.export.onnx")

_REPORT = f"import json, sys\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"


def _loaded(code: str, report: str = _REPORT) -> list[str]:
    """The modules of HEAVY loaded after running ``code`` in a fresh interpreter (or what
    ``report`` prints last, as JSON)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("GRAPHFLOP_REAL_DYNAMO", None)
    proc = subprocess.run(
        [sys.executable, "-c", code + "\n" + report],
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


def test_render_loads_graphviz():
    # the checks above can fail: the attribute that wraps graphviz does load it
    assert "graphviz" in _loaded("import graphflop\ngraphflop.render")


# --- Dynamo (graphflop/frontend/nodynamo.py) -----------------------------------------------

_DYNAMO = (
    "import json, sys\n"
    "def dynamo():\n"
    "    return sorted(m for m in sys.modules if m.startswith(('torch._dynamo', 'torch._inductor')))\n"
)

_INSPECT_MLP = (
    "import contextlib, io\n"
    "from graphflop.cli import main\n"
    "with contextlib.redirect_stdout(io.StringIO()):\n"
    "    assert main(['inspect', 'models/mlp.py']) == 0\n"
)


def test_inspect_loads_no_heavy_library_and_no_dynamo():
    heavy, after, asked = _loaded(
        _DYNAMO + _INSPECT_MLP + f"heavy = [m for m in {HEAVY + OTHER_COMMANDS!r} "
        "if m in sys.modules]\nafter = dynamo()\nimport torch._dynamo\n",
        "print(json.dumps([heavy, after, dynamo()]))\n",
    )
    assert heavy == []
    assert after == []
    assert "torch._dynamo" in asked  # the check can fail: it sees Dynamo once imported


_ANALYZE_THEN_COMPILE = """
import json, sys, torch
import graphflop
from graphflop.load import load, make_inputs

loaded = load("models/convnet.py", meta=True)
light = graphflop.analyze(loaded.model, make_inputs(loaded)).to_dict()
# again: with the config modules the first analysis loaded under the stand-ins
assert graphflop.analyze(loaded.model, make_inputs(loaded)).to_dict() == light
assert "torch._dynamo" not in sys.modules

graphs = []
def backend(gm, example_inputs):
    graphs.append(gm)
    return gm.forward

def f(x):
    return torch.nn.functional.gelu(x) * 2 + x.sum()

x = torch.randn(3, 4)
assert torch.allclose(torch.compile(f, backend=backend)(x), f(x))
assert len(graphs) == 1  # Dynamo captured the function: it works after the analysis
lin = torch.nn.Linear(4, 2)
assert torch.allclose(torch.compile(lin, backend="aot_eager")(x), lin(x))

loaded = load("models/convnet.py", meta=True)  # again, now with the real Dynamo
real = graphflop.analyze(loaded.model, make_inputs(loaded)).to_dict()
print(json.dumps(light == real))
"""


@pytest.mark.slow  # 12 s: two compilations in fresh interpreters
def test_torch_compile_works_after_an_analysis_and_the_figures_are_the_same():
    assert _loaded(_ANALYZE_THEN_COMPILE, "") is True


_CONFIG_ONCE = """
import json, sys
from torch._subclasses.fake_tensor import FakeTensorMode
from graphflop.frontend import nodynamo

def config():
    FakeTensorMode()  # reads torch._dynamo.config
    return sys.modules["torch._dynamo.config"]

first, second = nodynamo.run(config), nodynamo.run(config)
print(json.dumps([first is second, "torch._dynamo.config" in sys.modules]))
"""


def test_the_config_modules_load_once_per_process():
    # loading a config module parses its source (a third of a small model's analysis): a
    # second run reuses the first's, and neither stays in sys.modules afterwards
    assert _loaded(_CONFIG_ONCE, "") == [True, False]


_RETRY = """
import json, sys, torch
from graphflop.frontend import nodynamo

def fails():
    raise ValueError("the function's own error")

try:
    nodynamo.run(fails)
except ValueError:
    pass
assert "torch._dynamo" not in sys.modules  # not retried: not a missing name
# a name the stand-in lacks: run again with the real package
mark_static = nodynamo.run(lambda: torch._dynamo.mark_static)
print(json.dumps([mark_static.__module__, "torch._dynamo" in sys.modules]))
"""


@pytest.mark.slow  # 9 s: imports the real Dynamo
def test_a_name_the_standin_lacks_runs_again_with_the_real_dynamo():
    assert _loaded(_RETRY, "") == ["torch._dynamo.decorators", True]


def test_core_aten_table_equals_torch_exports():
    import functools

    import torch

    from graphflop.ops.registry import core_aten_table

    ours = core_aten_table()
    theirs = dict(torch._decomp.core_aten_decompositions())
    assert set(ours) == set(theirs)

    def same(a, b):
        # torch.export makes a new partial (and closure) per CompositeImplicitAutograd op
        if isinstance(a, functools.partial):
            return (
                isinstance(b, functools.partial)
                and a.func.__code__ is b.func.__code__
                and (a.args, a.keywords) == (b.args, b.keywords)
            )
        return a is b

    assert [op for op in theirs if not same(ours[op], theirs[op])] == []
    assert len(ours) > 900  # PyTorch 2.13: 943 ops


@pytest.mark.slow  # three fresh interpreters: 13 s
def test_torchvision_is_loaded_for_an_import_statement_not_a_mention(tmp_path):
    """models/resnet.py names torchvision only in its docstring: loading it must not import
    torchvision (seconds of import, and Dynamo with it); a file that imports it does."""
    report = "import json, sys\nprint(json.dumps('torchvision' in sys.modules))\n"
    mention = "from graphflop.load import load\nload('models/resnet.py:resnet18', meta=True)"
    assert _loaded(mention, report) is False
    # building it on the meta device runs nn.init through torch._refs: still no Dynamo
    dynamo = "import json, sys\nprint(json.dumps('torch._dynamo' in sys.modules))\n"
    assert _loaded(mention, dynamo) is False
    # a file with an import statement (indented, never run, so the file loads without
    # torchvision installed) makes graphflop preload it; the check is that the preload is asked
    # for, and, where torchvision is installed (the dev extra holds it), that it is loaded
    f = tmp_path / "tv.py"
    f.write_text(
        "import torch\nif False:  # an indented import counts too\n    import torchvision\n"
        "class M(torch.nn.Module):\n    def forward(self, x):\n        return x\n"
    )
    asked = (
        "import graphflop.load as L\ncalls = []\nreal = L._preload_torchvision\n"
        "L._preload_torchvision = lambda: (calls.append(1), real())[1]\n"
        f"L.load({str(f)!r})\n"
    )
    installed = importlib.util.find_spec("torchvision") is not None
    check = "import json, sys\nprint(json.dumps([bool(calls), 'torchvision' in sys.modules]))\n"
    assert _loaded(asked, check) == [True, installed]
    # the mention alone asks for no preload
    plain = asked.replace(repr(str(f)), repr("models/resnet.py:resnet18") + ", meta=True")
    assert _loaded(plain, check) == [False, False]


@pytest.mark.parametrize(
    ("line", "imports"),
    [
        ("import transformers", True),
        ("from timm.layers import DropPath", True),
        ("    import torchvision.models as tv", True),
        # among other modules: a tester's model file began so and failed to load
        ("import torch, transformers as T", True),
        ("import os, torch as t,timm", True),
        ("# import transformers", False),
        ("import torch  # transformers later", False),
        ('"""built with torchvision"""', False),
        ("import mytransformers, torchvision_extra", False),
    ],
)
def test_a_file_importing_torchvision_or_a_library_that_does_is_recognised(line, imports):
    from graphflop.load import _IMPORTS_TORCHVISION

    assert bool(_IMPORTS_TORCHVISION.search(f"import math\n{line}\n")) is imports


def test_the_lazy_train_package_offers_its_names_and_submodules():
    import graphflop.train as train_pkg

    assert set(train_pkg.__all__) <= set(dir(train_pkg))
    for name in train_pkg.__all__:
        assert getattr(train_pkg, name).__module__.startswith("graphflop.train.")
    assert train_pkg.loop.__name__ == "graphflop.train.loop"  # a submodule, as before
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        train_pkg.nope  # noqa: B018
