"""Analysis without importing Dynamo (docs/analysis_scale.md): :func:`run` calls a function with light
stand-ins for the ``torch._dynamo`` package and its ``source`` module while it runs, and takes
them away afterwards.

``import torch._dynamo`` costs about 2 s of CPU (a third of ``graphflop inspect`` on a small
model), and nothing in an analysis compiles: PyTorch imports Dynamo for names it uses only
under ``torch.compile``. In PyTorch 2.13, ``FakeTensorMode()`` reads ``torch._dynamo.config``
(a small module, loaded for real under the stand-in); making a FakeTensor imports
``torch._dynamo.source`` for ``isinstance(source, RandomValueSource)`` (no source is one outside
Dynamo) and, for a tensor given without a source, a ``ConstantSource`` naming it; ``make_fx``
imports the package and checks ``isinstance(module, OptimizedModule)`` (no module is one before
Dynamo has been imported); PyTorch's reference implementations wrap themselves in
``torch._dynamo.disable`` on their first call (an identity while nothing compiles; the cached
wrappers are removed afterwards, so Dynamo wraps them itself once imported). Dynamo's import
also loads ``torch._higher_order_ops.triton_kernel_wrap``, which ``make_fx`` reads as an
attribute: the stand-in loads it too.

Safety: the stand-ins are used only while ``torch._dynamo`` has never been imported in the
process (otherwise the real package is used as is); when the function fails with an
``AttributeError`` or ``ImportError`` anywhere in its exception chain (a name a stand-in lacks),
it is run again with the real package, so the stand-ins change how long an analysis takes,
never its result or its errors. Afterwards every ``torch._dynamo`` module loaded meanwhile is
gone from ``sys.modules``, so a later ``torch.compile`` imports the real package from scratch
(``tests/test_imports.py`` checks both); the real submodules loaded under the stand-ins (the
config modules, which parse their own source as they load) are kept aside and put back for the
next run in the same process. Like the other process-wide patches of tracing
(:mod:`graphflop.frontend.composite`), not thread-safe: don't call ``torch.compile`` from another
thread while an analysis runs. ``GRAPHFLOP_REAL_DYNAMO=1`` turns the stand-ins off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import os
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch._guards import GuardSource, Source

from graphflop.frontend.errors import find_cause

_T = TypeVar("_T")

#: set to ``1`` to always use the real Dynamo (to compare, or should a stand-in misbehave)
ENV_OFF = "GRAPHFLOP_REAL_DYNAMO"

#: the PyTorch releases whose Dynamo imports the stand-ins were written against (and tested
#: with); any other release uses the real package: the names PyTorch reads from it change
TESTED_TORCH = ("2.13.",)

_NAME = "torch._dynamo"
_INDUCTOR = "torch._inductor"

#: real ``torch._dynamo``/``torch._inductor`` submodules loaded under the stand-ins, by name:
#: put back in place for the next run (never while the real package is imported)
_LOADED: dict[str, types.ModuleType] = {}


def run(fn: Callable[[], _T], *, light: bool = True) -> _T:
    """``fn()`` with the stand-ins for ``torch._dynamo`` in place when Dynamo has not been
    imported (see the module's docstring); again with the real package when a stand-in lacked
    a name ``fn`` needed. ``light=False``: with the real package (for work that compiles, e.g.
    AOTAutograd's partition)."""
    if not light:
        importlib.import_module(_NAME)
    if (
        _NAME in sys.modules
        or os.environ.get(ENV_OFF) == "1"
        or not torch.__version__.startswith(TESTED_TORCH)
    ):
        return fn()
    try:
        with _standins():
            return fn()
    except Exception as e:
        if not _missing_name(e):
            raise
    importlib.import_module(_NAME)
    return fn()


def _missing_name(e: BaseException | None) -> bool:
    """Whether an ``AttributeError`` or ``ImportError`` is in ``e``'s chain."""
    return find_cause(e, (AttributeError, ImportError)) is not None


class _NotOptimized:
    """Stands for ``torch._dynamo.OptimizedModule``: no module is one before Dynamo loads."""


class _NotRandom:
    """Stands for ``torch._dynamo.source.RandomValueSource``: no source is one outside Dynamo."""


@dataclasses.dataclass(frozen=True)
class _Constant(Source):
    """Stands for ``torch._dynamo.source.ConstantSource``: the name PyTorch gives a tensor made
    fake without a source."""

    source_name: str

    @property
    def guard_source(self) -> GuardSource:
        return GuardSource.CONSTANT

    @property
    def _name_template(self) -> str:
        return self.source_name


def _module(name: str, path: list[str] | None = None, **names: Any) -> types.ModuleType:
    m = types.ModuleType(name, "graphflop's stand-in (graphflop/frontend/nodynamo.py)")
    if path is not None:
        m.__path__ = path  # its other submodules load for real
    for k, v in names.items():
        setattr(m, k, v)
    return m


def _package(name: str, **names: Any) -> types.ModuleType:
    """A stand-in for the package ``name`` whose submodules load for real."""
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.submodule_search_locations is not None
    return _module(name, list(spec.submodule_search_locations), **names)


@contextlib.contextmanager
def _standins() -> Iterator[None]:
    import torch._higher_order_ops.triton_kernel_wrap  # noqa: F401  (Dynamo's import loads it)

    wrapped: list[Any] = []

    def disable(fn: Any = None, recursive: bool = True, **_: Any) -> Any:
        if fn is None:
            return lambda f: disable(f, recursive)
        wrapped.append(fn)
        return fn

    source = _module(f"{_NAME}.source", RandomValueSource=_NotRandom, ConstantSource=_Constant)
    dynamo = _package(
        _NAME,
        disable=disable,
        OptimizedModule=_NotOptimized,
        is_compiling=torch.compiler.is_compiling,
        source=source,
    )
    # make_fx reads torch._inductor.config; the package's __init__ imports Dynamo
    inductor = None if _INDUCTOR in sys.modules else _package(_INDUCTOR)
    before = set(sys.modules)
    placed = {m.__name__: m for m in (dynamo, source, inductor) if m is not None}
    sys.modules.update(placed)
    for m in (dynamo, inductor):
        if m is not None:
            setattr(torch, m.__name__.split(".")[-1], m)
    # the real submodules an earlier run loaded under the stand-ins (the config modules, which
    # parse their own source when loaded: a third of a small model's analysis), back in place
    for name, mod in _LOADED.items():
        if ".".join(name.split(".")[:2]) not in placed:  # the real package is loaded
            continue
        parent, _, child = name.rpartition(".")
        if parent in placed:
            setattr(placed[parent], child, mod)
        sys.modules.setdefault(name, mod)
    try:
        yield
    finally:
        for name in set(sys.modules) - before | set(placed):
            if name.split(".")[:2] in (["torch", "_dynamo"], ["torch", "_inductor"]):
                if name not in placed:
                    _LOADED[name] = sys.modules[name]
                del sys.modules[name]
        for m in (dynamo, inductor):
            attr = m.__name__.split(".")[-1] if m is not None else ""
            if m is not None and torch.__dict__.get(attr) is m:
                delattr(torch, attr)
        for fn in wrapped:  # torch._compile._disable_dynamo caches what disable returned
            if getattr(fn, "__dict__", {}).get("__dynamo_disable") is fn:
                del fn.__dict__["__dynamo_disable"]
